"""Synthetic checkpoints: complete diffusers pipeline folders with seeded random weights in real architectures.

``ditmesh synth --arch flux-dev --out DIR`` writes a folder that loads through the ordinary
``DiffusionPipeline.from_pretrained(DIR)`` (the architecture's own pipeline class): the named model's
transformer(s) and VAE, small text encoders with the right output widths, and tokenizers built locally (no
download). The architectures and the components of each family's pipeline come from the family's adapter
(``synth_archs``, ``synth_components``); this module builds them with a :class:`Kit`.

Weights: every parameter is drawn from a generator seeded by ``(seed, parameter name)``, normal with
std ``1/sqrt(fan_in)`` for matrices (so activations keep their scale through deep stacks), and, like a real
checkpoint's, non-zero biases (normal, std :data:`BIAS_STD`) and norm scales off one (``1 + N(0,``
:data:`NORM_STD` ``)``): a parallel plan that mishandles a bias or a norm weight changes the output.
``affine="identity"`` gives zero biases and unit norm scales instead (the recipe the shipped tiny pipeline
was trained from). Same seed and device type -> same weights.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import adapter_for_class, registry
from .models.base import SynthArch as Arch
from .models.base import adapter_for
from .shared import DTYPES, current_umask, empty_output, follow_umask

#: Words the synthetic tokenizers know as whole tokens (anything else falls back to characters).
WORDS = (
    "a an the of on at in with and or to is are this that photo picture image painting drawing "
    "red green blue yellow white black gray grey orange purple pink brown "
    "circle square triangle shape top bottom left right center middle background "
    "cat dog man woman city street mountain sea sky tree house car flower portrait landscape "
    "big small large tiny bright dark light night day sunset forest river lake"
).split()


#: every family's synthetic architectures, by name (each family's adapter lists its own: ``synth_archs``)
ARCHS: Mapping[str, Arch] = registry.ARCHS  # loads an architecture's family when it is looked up


def get_arch(name: str) -> Arch:
    """The architecture called ``name``; the error (registry.UnknownArchError) lists the known ones."""
    registry.check_arch(name)
    return ARCHS[name]


# ---------------------------------------------------------------------------------------------------
# tokenizers, built locally
# ---------------------------------------------------------------------------------------------------
def build_clip_tokenizer(words=WORDS, max_length: int = 77):
    """A CLIP BPE tokenizer over bytes, with merges that make each of ``words`` one token."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update((c, i) for i, c in enumerate(alphabet + [c + "</w>" for c in alphabet], start=len(vocab)))
    merges = _word_merges([list(word[:-1]) + [word[-1] + "</w>"] for word in words], vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def _word_merges(words: list[list[str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges joining each word's pieces left to right (each joined piece added to ``vocab``)."""
    merges: list[tuple[str, str]] = []
    seen = set()
    for pieces in words:
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            joined = pieces[0] + pieces[1]
            vocab.setdefault(joined, len(vocab))
            pieces = [joined] + pieces[2:]
    return merges


def byte_bpe(specials: tuple[str, ...], words=WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and merges of a byte-level BPE (GPT-2 style, as Qwen2's tokenizer reads them): ``specials``
    first, then the 256 byte symbols, then each of ``words`` as one token, with and without a leading space."""
    from tokenizers import pre_tokenizers

    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update((c, i) for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()), start=len(vocab)))
    return vocab, _word_merges([list(form) for w in words for form in ("\u0120" + w, w)], vocab)


def build_t5_tokenizer(words=WORDS, max_length: int = 512):
    """A T5 (Unigram) tokenizer whose pieces are ``words`` plus single characters."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    for word in words:
        pieces.append(("\u2581" + word, -1.0))
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    pieces.append(("\u2581", -5.0))
    for c in chars:
        pieces.append((c, -8.0))
        pieces.append(("\u2581" + c, -8.0))
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


def _piece_bpe(specials: tuple[str, ...], words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and merges of a SentencePiece-style BPE over single characters (``▁`` marks a word start):
    ``specials`` first, then the characters, then each of ``words`` after its ``▁`` as one token."""
    vocab = {s: i for i, s in enumerate(specials)}
    for c in "\u2581abcdefghijklmnopqrstuvwxyz0123456789.,!?'-":
        vocab[c] = len(vocab)
    return vocab, _word_merges([["\u2581", *word] for word in words], vocab)


def build_gemma_tokenizer(words=WORDS, max_length: int = 300, add_bos: bool = False):
    """A Gemma (BPE) tokenizer over single characters, with merges that make each of ``words`` (after the ``▁`` that
    marks a word start) one token; ``add_bos``: every text starts with ``<bos>``, as Gemma's own tokenizers do (an
    empty prompt is then one token, not none)."""
    from transformers import GemmaTokenizer

    vocab, merges = _piece_bpe(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"), words)
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=max_length, add_bos_token=add_bos)


def build_llama_tokenizer(specials: tuple[str, ...] = (), words=WORDS, max_length: int = 2048):
    """A Llama (BPE) tokenizer as :func:`build_gemma_tokenizer`'s (``<unk>``, ``<s>``, ``</s>`` first), knowing
    ``specials`` (a chat template's markers) as whole special tokens."""
    from transformers import LlamaTokenizer

    vocab, merges = _piece_bpe(("<unk>", "<s>", "</s>", *specials), words)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# seeded weights
# ---------------------------------------------------------------------------------------------------
#: std of the seeded biases (real checkpoints' biases are small but not zero)
BIAS_STD = 0.05
#: std of the seeded norm scales around 1
NORM_STD = 0.1
#: how biases and norm scales are drawn: ``seeded`` (non-zero, like a real checkpoint) or ``identity`` (0 and 1)
AFFINE = ("seeded", "identity")


def seeded_init_(module: torch.nn.Module, seed: int, affine: str = "seeded") -> torch.nn.Module:
    """Overwrite every parameter with values drawn from a generator seeded by ``(seed, name)``.

    Matrices: normal with std ``1/sqrt(fan_in)``. Biases: normal with std :data:`BIAS_STD`; norm scales
    (1-D weights): ``1 + N(0, NORM_STD)``; with ``affine="identity"``, zeros and ones. Other vectors: std 0.02.
    """
    if affine not in AFFINE:
        raise ValueError(f"affine={affine!r} is not one of: {', '.join(AFFINE)}")
    seeded = affine == "seeded"
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            normal = lambda std: torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(std)  # noqa: E731,B023
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim >= 2:
                p.copy_(normal(p[0].numel() ** -0.5))
            elif "bias" in leaf:
                p.copy_(normal(BIAS_STD) if seeded else torch.zeros(p.shape))
            elif "norm" in name.lower() or leaf in ("weight", "scale", "gamma"):
                p.copy_(normal(NORM_STD).add_(1.0) if seeded else torch.ones(p.shape))
            else:
                p.copy_(normal(0.02))
    return module


def _make_model(cls, cfg, seed: int, device: torch.device, dtype: torch.dtype, affine: str = "seeded"):
    # Initialize directly in the target dtype on the target device: a 12B-parameter model never
    # exists in float32 (48 GB) on the way.
    import transformers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg) if isinstance(cfg, transformers.PretrainedConfig) else cls(**cfg)
    finally:
        torch.set_default_dtype(previous)
    seeded_init_(model, seed, affine)
    return model.to(dtype).eval()


def build_transformer(arch: Arch | str, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                      affine: str = "seeded"):
    """Only the transformer of ``arch``, seeded exactly as in :func:`build_pipeline` (used by benchmarks and tests)."""
    import diffusers

    arch = get_arch(arch) if isinstance(arch, str) else arch
    dtype = dtype or getattr(torch, arch.default_dtype)
    return _make_model(getattr(diffusers, arch.transformer_class), arch.transformer, seed, torch.device(device), dtype,
                       affine)


def attention_lora(model: torch.nn.Module, rank: int, seed: int = 0, scale: float = 0.1,
                   device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """A synthetic rank-``rank`` LoRA for ``model`` as a state dict in peft's format (``<module>.lora_A.weight``,
    ``<module>.lora_B.weight``, no prefix), for the transformer's ``load_lora_adapter(sd, prefix=None)``.

    It adapts every ``nn.Linear`` inside the attention layers the model's adapter parallelizes
    (``attention_modules``; FLUX: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``, ``add_q_proj``, ``add_k_proj``,
    ``add_v_proj``, ``to_add_out``). A is normal with std ``1/sqrt(in)``, B normal with std ``scale/sqrt(rank)``
    (non-zero, unlike peft's start), so each adapted output moves by about ``scale`` times its input's RMS; both are
    drawn on the CPU from ``seed``, the same on every rank. Call it on the whole model (before ``parallelize``):
    the shapes are the layers' full ones, which ditmesh's ``lora`` hooks cut per tensor-parallel rank on loading.
    The tensors have the model's dtype and sit on ``device`` (default: the model's).
    """
    weight = next(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for attn_name, attn in adapter_for(model).attention_modules(model):
        for name, linear in attn.named_modules():
            if isinstance(linear, torch.nn.Linear):
                a = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5
                b = torch.randn(linear.out_features, rank, generator=generator) * (scale / rank ** 0.5)
                for factor, value in (("A", a), ("B", b)):
                    state[f"{attn_name}.{name}.lora_{factor}.weight"] = value.to(device or weight.device, weight.dtype)
    return state


@dataclass
class Kit:
    """What a family's ``synth_components`` builds its pipeline with: seeded models and local tokenizers."""

    arch: Arch
    seed: int
    device: torch.device
    dtype: torch.dtype
    #: how biases and norm scales are drawn (:data:`AFFINE`)
    affine: str = "seeded"

    def make(self, cls, cfg, seed_offset: int):
        """A seeded ``cls(cfg)`` in the kit's dtype and device. Seed offsets: transformer 0, VAE 1, first CLIP 2,
        T5/UMT5 3, second CLIP 4, second transformer 5."""
        return _make_model(cls, cfg, self.seed + seed_offset, self.device, self.dtype, self.affine)

    def clip_tokenizer(self):
        return build_clip_tokenizer()

    def t5_tokenizer(self, max_length: int):
        return build_t5_tokenizer(max_length=max_length)

    def llama_tokenizer(self, specials: tuple[str, ...], max_length: int):
        return build_llama_tokenizer(specials, max_length=max_length)

    def byte_bpe(self, specials: tuple[str, ...], words=()):
        """(vocab, merges) of a byte-level BPE knowing ``specials`` and :data:`WORDS` plus ``words`` (:func:`byte_bpe`)."""
        return byte_bpe(specials, tuple(WORDS) + tuple(words))

    def gemma_tokenizer(self, max_length: int, add_bos: bool = False):
        return build_gemma_tokenizer(max_length=max_length, add_bos=add_bos)

    def gemma2_text_encoder(self, arch, generation: str = "Gemma2", add_bos: bool = False) -> dict:
        """``text_encoder`` (a Gemma-2 of ``arch.t5``'s sizes; ``generation="Gemma"``: a Gemma) and its
        ``tokenizer`` (``add_bos``: :func:`build_gemma_tokenizer`), as Sana's, Lumina 2's and Lumina-Next's pipelines
        take them."""
        import transformers

        tokenizer = self.gemma_tokenizer(arch.max_sequence_length, add_bos)
        config = getattr(transformers, f"{generation}Config")(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=8192,
            attn_implementation="eager", **arch.t5)
        return dict(text_encoder=self.make(getattr(transformers, f"{generation}Model"), config, 3), tokenizer=tokenizer)

    def clip_config(self, tokenizer, cfg: dict):
        import transformers

        return transformers.CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=77,
                                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                           pad_token_id=tokenizer.pad_token_id, **cfg)

    def t5_config(self, tokenizer, cfg: dict, config_class=None):
        import transformers

        config_class = config_class or transformers.T5Config
        return config_class(vocab_size=len(tokenizer), feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                            use_cache=False, **cfg)


def build_pipeline(arch: Arch | str, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   affine: str = "seeded"):
    """Build the diffusers pipeline of ``arch`` in memory with seeded random weights (biases and norm scales
    drawn as ``affine`` says, :func:`seeded_init_`)."""
    import diffusers

    arch = get_arch(arch) if isinstance(arch, str) else arch
    dtype = dtype or getattr(torch, arch.default_dtype)
    device = torch.device(device)

    adapter = adapter_for_class(arch.transformer_class)
    if adapter.synth_components is None:
        from .config import ConfigError

        raise ConfigError(f"synth --arch {arch.name}: ditmesh builds only the transformer of {arch.pipeline} (its other "
                          f"components are not synthesized yet); plan --model {arch.name} and bench take it")
    kit = Kit(arch, seed, device, dtype, affine)
    components = adapter.synth_components(arch, kit)
    components["transformer"] = build_transformer(arch, seed, device, dtype, affine)
    if arch.transformer_2 is not None:
        cls = getattr(diffusers, arch.transformer_class)
        components["transformer_2"] = kit.make(cls, arch.transformer_2, 5)
    scheduler = getattr(diffusers, arch.scheduler_class)(**arch.scheduler)
    pipe = getattr(diffusers, arch.pipeline)(scheduler=scheduler, **components, **arch.pipeline_config)
    # pipeline config the class keeps unsaved (DiT's id2label) goes to model_index.json, as released checkpoints have it
    pipe.register_to_config(**{k: v for k, v in arch.pipeline_config.items() if k not in pipe.config})
    return pipe


def write_lora(model_dir: str | os.PathLike, rank: int, out_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, int]:
    """Write a synthetic rank-``rank`` LoRA for the pipeline folder ``model_dir`` (:func:`attention_lora` on its
    transformer: every linear of the attention layers ditmesh parallelizes) to ``out_dir/lora.safetensors``, as the
    pipeline class saves LoRAs (peft's format under the ``transformer.`` prefix), for ``generate --lora``. Written to a
    temporary sibling and renamed at the end; returns the file and the number of adapted linears."""
    import diffusers

    from .config import ConfigError

    if rank < 1:
        raise ConfigError(f"--lora {rank}: give the adapter's rank, a positive integer (e.g. 64)")
    index_file = Path(model_dir) / "model_index.json"
    if not index_file.is_file():
        raise ConfigError(f"--model {model_dir}: no pipeline folder (no model_index.json); give the folder that "
                          "ditmesh synth --arch wrote")
    index = json.loads(index_file.read_text())
    out = empty_output(out_dir)
    transformer = getattr(diffusers, index["transformer"][1]).from_pretrained(model_dir, subfolder="transformer")
    state = attention_lora(transformer, rank, seed=seed)
    del transformer
    _write_folder(out, lambda tmp: getattr(diffusers, index["_class_name"]).save_lora_weights(
        tmp, transformer_lora_layers=state, weight_name="lora.safetensors"))
    return out / "lora.safetensors", len(state) // 2


def _write_folder(out: Path, write) -> None:
    """``write(folder)`` into a temporary sibling of ``out``, renamed to ``out`` at the end (an interrupted run
    leaves nothing half-written there); the folder follows the umask, as a folder made by hand would."""
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes a private folder
    try:
        write(tmp)
        follow_umask(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_checkpoint(arch_name: str, out_dir: str | os.PathLike, seed: int = 0, device: str | None = None, dtype: str | None = None) -> Path:
    """Write the synthetic pipeline folder for ``arch_name`` to ``out_dir`` and return its path.

    The folder is written to a temporary sibling and renamed at the end, so an interrupted run leaves
    nothing half-written under ``out_dir``.
    """
    arch = get_arch(arch_name)
    out = empty_output(out_dir)
    from .config import ConfigError

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of: {', '.join(sorted(DTYPES))}")
    torch_dtype = DTYPES[dtype] if dtype else None
    pipe = build_pipeline(arch, seed=seed, device=device, dtype=torch_dtype)
    meta = {"arch": arch.name, "seed": seed, "dtype": str(torch_dtype).replace("torch.", "") if dtype else arch.default_dtype, "default_size": list(arch.default_size),
            "max_sequence_length": arch.max_sequence_length, "generator": "ditmesh synth"}
    if arch.default_frames:
        meta["default_frames"] = arch.default_frames

    def write(tmp: Path) -> None:
        pipe.save_pretrained(tmp, safe_serialization=True)
        # a component the pipeline takes with a default (LongCatAudioDiTPipeline's scheduler) is named in
        # model_index.json but not saved by diffusers: written here, so that the folder holds every component it names
        for name, entry in pipe.config.items():
            component = getattr(pipe, name, None)
            if (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(entry) and not (tmp / name).exists()
                    and hasattr(component, "save_pretrained")):
                component.save_pretrained(tmp / name)
        (tmp / "ditmesh_synth.json").write_text(json.dumps(meta, indent=2))

    _write_folder(out, write)
    return out
