"""Synthetic checkpoints: complete diffusers pipeline folders with seeded random weights in real architectures.

``ditmesh synth --arch flux-dev --out DIR`` writes a folder that loads through the ordinary
``FluxPipeline.from_pretrained(DIR)`` (``StableDiffusion3Pipeline`` for ``sd3-*``, ``WanPipeline`` for
``wan-*``): the named model's transformer and VAE, small text encoders with the right output widths, and
tokenizers built locally (no download). Each architecture's ``family`` names the function that builds
its pipeline's other components (:data:`COMPONENT_BUILDERS`).

Weights: every parameter is drawn from a generator seeded by ``(seed, parameter name)``, normal with
std ``1/sqrt(fan_in)`` for matrices (so activations keep their scale through deep stacks), ones for norm
scales, zeros for biases. Same seed and device type -> same weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Words the synthetic tokenizers know as whole tokens (anything else falls back to characters).
WORDS = (
    "a an the of on at in with and or to is are this that photo picture image painting drawing "
    "red green blue yellow white black gray grey orange purple pink brown "
    "circle square triangle shape top bottom left right center middle background "
    "cat dog man woman city street mountain sea sky tree house car flower portrait landscape "
    "big small large tiny bright dark light night day sunset forest river lake"
).split()


@dataclass(frozen=True)
class Arch:
    """A synthetic architecture: the pipeline class and the config of each component."""

    name: str
    description: str
    pipeline: str
    transformer_class: str
    transformer: dict
    vae: dict
    clip: dict
    t5: dict
    scheduler: dict
    default_dtype: str = "float32"
    default_size: tuple[int, int] = (1024, 1024)
    max_sequence_length: int = 512
    extra: dict = field(default_factory=dict)
    #: which builder makes the non-transformer components: "flux", "sd3" or "wan" (see COMPONENT_BUILDERS)
    family: str = "flux"
    #: the second CLIP text encoder (SD3's CLIP-G); ``clip`` is the first (CLIP-L)
    clip_2: dict = field(default_factory=dict)
    scheduler_class: str = "FlowMatchEulerDiscreteScheduler"
    #: video architectures: frames generated when ``--frames`` is not given (4k+1 for Wan)
    default_frames: int | None = None


_FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

_FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
)

ARCHS: dict[str, Arch] = {}


def _add(arch: Arch) -> Arch:
    ARCHS[arch.name] = arch
    return arch


_add(
    Arch(
        name="flux-tiny",
        description="FLUX.1 architecture shrunk for CPU tests: 2 double + 2 single blocks, 6 heads x 16",
        pipeline="FluxPipeline",
        transformer_class="FluxTransformer2DModel",
        transformer=dict(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=6,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=[4, 6, 6],
        ),
        vae=dict(_FLUX_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
        clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, projection_dim=32),
        t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
        scheduler=_FLUX_SCHEDULER,
        default_size=(64, 64),
        max_sequence_length=32,
    )
)

_add(
    Arch(
        name="flux-tiny-tp",
        description="flux-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads",
        pipeline="FluxPipeline",
        transformer_class="FluxTransformer2DModel",
        transformer=dict(ARCHS["flux-tiny"].transformer, num_attention_heads=4),
        vae=ARCHS["flux-tiny"].vae,
        clip=ARCHS["flux-tiny"].clip,
        t5=ARCHS["flux-tiny"].t5,
        scheduler=_FLUX_SCHEDULER,
        default_size=(64, 64),
        max_sequence_length=32,
    )
)

_add(
    Arch(
        name="flux-dev",
        description="FLUX.1-dev transformer (19 double + 38 single blocks, 24 heads x 128, 11.9B params), full VAE",
        pipeline="FluxPipeline",
        transformer_class="FluxTransformer2DModel",
        transformer=dict(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=[16, 56, 56],
        ),
        vae=_FLUX_VAE,
        clip=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=12, projection_dim=768),
        t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
        scheduler=_FLUX_SCHEDULER,
        default_dtype="bfloat16",
        default_size=(1024, 1024),
        max_sequence_length=512,
    )
)


# --- Stable Diffusion 3 / 3.5 -----------------------------------------------------------------------
_SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)

#: SD3's VAE: FLUX's AutoencoderKL layout (16 latent channels) with SD3's latent scaling
_SD3_VAE = dict(_FLUX_VAE, scaling_factor=1.5305, shift_factor=0.0609)

SD35_LARGE = _add(
    Arch(
        name="sd3.5-large",
        description="SD3.5-Large transformer (38 joint blocks, 38 heads x 64, RMS QK-norm, 8.1B params), full SD3 VAE",
        pipeline="StableDiffusion3Pipeline",
        transformer_class="SD3Transformer2DModel",
        transformer=dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=38,
            attention_head_dim=64,
            num_attention_heads=38,
            joint_attention_dim=4096,
            caption_projection_dim=2432,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=192,
            dual_attention_layers=[],
            qk_norm="rms_norm",
        ),
        vae=_SD3_VAE,
        # real widths: CLIP-L 768 (pooled 768), CLIP-G 1280 (pooled 1280), T5-XXL 4096; 2 CLIP layers (SD3 reads
        # CLIP's penultimate layer), 1 T5 layer
        clip=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=12, projection_dim=768),
        clip_2=dict(hidden_size=1280, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=20,
                    projection_dim=1280),
        t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
        scheduler=_SD3_SCHEDULER,
        default_dtype="bfloat16",
        default_size=(1024, 1024),
        max_sequence_length=256,
        family="sd3",
    )
)

_add(
    dataclasses.replace(
        SD35_LARGE,
        name="sd3-tiny",
        description="SD3.5 architecture shrunk for CPU tests: 3 joint blocks (block 0 dual-attention, "
                    "RMS QK-norm, last context_pre_only), 6 heads x 16",
        transformer=dict(SD35_LARGE.transformer, sample_size=8, num_layers=3, attention_head_dim=16, num_attention_heads=6,
                         joint_attention_dim=64, caption_projection_dim=96, pooled_projection_dim=32,
                         pos_embed_max_size=16, dual_attention_layers=[0]),
        vae=dict(_SD3_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
        # CLIP-L and CLIP-G: hidden 16 + 32 = 48 <= T5 width 64 (the pipeline zero-pads CLIP to T5's width);
        # pooled 16 + 16 = 32 = pooled_projection_dim
        clip=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, projection_dim=16),
        clip_2=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=16),
        t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
        default_dtype="float32",
        default_size=(64, 64),
        max_sequence_length=32,
    )
)

_add(
    dataclasses.replace(
        ARCHS["sd3-tiny"],
        name="sd3-tiny-tp",
        description="sd3-tiny with 4 heads x 16 (64 wide, caption_projection_dim 64), so tensor parallelism of "
                    "degree 4 divides the heads",
        transformer=dict(ARCHS["sd3-tiny"].transformer, num_attention_heads=4, caption_projection_dim=64),
    )
)

# --- Wan 2.1 (video) ---------------------------------------------------------------------------------
#: Wan 2.1's scheduler as its diffusers checkpoints ship it (UniPC on flow-matching sigmas)
_WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)

WAN21_14B = _add(
    Arch(
        name="wan2.1-14b",
        description="Wan2.1-T2V-14B transformer (40 blocks, 40 heads x 128, FFN 13824), full Wan VAE, small UMT5",
        pipeline="WanPipeline",
        transformer_class="WanTransformer3DModel",
        transformer=dict(
            patch_size=[1, 2, 2],
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=40,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
        vae={},  # AutoencoderKLWan's defaults are the Wan 2.1 VAE
        clip={},
        t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # UMT5-XXL's width, one layer
        scheduler=_WAN_SCHEDULER,
        scheduler_class="UniPCMultistepScheduler",
        default_dtype="bfloat16",
        default_size=(480, 832),
        max_sequence_length=512,
        family="wan",
        default_frames=81,
    )
)

_add(
    dataclasses.replace(
        WAN21_14B,
        name="wan-tiny",
        description="Wan 2.1 architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, 3-D RoPE, tiny Wan VAE",
        transformer=dict(WAN21_14B.transformer, num_attention_heads=6, attention_head_dim=16, text_dim=64, freq_dim=32,
                         ffn_dim=128, num_layers=2, rope_max_seq_len=64),
        vae=dict(base_dim=8, num_res_blocks=1),
        t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
        default_dtype="float32",
        default_size=(64, 64),
        max_sequence_length=32,
        default_frames=5,
    )
)

_add(
    dataclasses.replace(
        ARCHS["wan-tiny"],
        name="wan-tiny-tp",
        description="wan-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads",
        transformer=dict(ARCHS["wan-tiny"].transformer, num_attention_heads=4),
    )
)


class UnknownArchError(ValueError):
    """An architecture name ``ditmesh synth`` does not know."""


def get_arch(name: str) -> Arch:
    """The architecture called ``name``; the error lists the known ones."""
    if name not in ARCHS:
        raise UnknownArchError(f"unknown architecture {name!r}; known: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


# ---------------------------------------------------------------------------------------------------
# tokenizers, built locally
# ---------------------------------------------------------------------------------------------------
def build_clip_tokenizer(words=WORDS, max_length: int = 77):
    """A CLIP BPE tokenizer over bytes, with merges that make each of ``words`` one token."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for c in alphabet:
        vocab[c] = len(vocab)
    for c in alphabet:
        vocab[c + "</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    seen = set()
    for word in words:
        pieces = list(word)
        pieces[-1] += "</w>"
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            joined = pieces[0] + pieces[1]
            vocab.setdefault(joined, len(vocab))
            pieces = [joined] + pieces[2:]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


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


# ---------------------------------------------------------------------------------------------------
# seeded weights
# ---------------------------------------------------------------------------------------------------
def seeded_init_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter with values drawn from a generator seeded by ``(seed, name)``."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(fan_in**-0.5))
            elif leaf == "bias" or "bias" in leaf:
                p.zero_()
            elif "norm" in name.lower() or leaf in ("weight", "scale", "gamma"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(0.02))
    return module


def _make_model(cls, cfg, seed: int, device: torch.device, dtype: torch.dtype):
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
    seeded_init_(model, seed)
    return model.to(dtype).eval()


def build_transformer(arch: Arch | str, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Only the transformer of ``arch``, seeded exactly as in :func:`build_pipeline` (used by benchmarks)."""
    import diffusers

    arch = get_arch(arch) if isinstance(arch, str) else arch
    dtype = dtype or getattr(torch, arch.default_dtype)
    return _make_model(getattr(diffusers, arch.transformer_class), arch.transformer, seed, torch.device(device), dtype)


def _clip_config(tokenizer, cfg: dict):
    import transformers

    return transformers.CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **cfg)


def _t5_config(tokenizer, cfg: dict, config_class=None):
    import transformers

    config_class = config_class or transformers.T5Config
    return config_class(vocab_size=len(tokenizer), feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, **cfg)


def _clip_and_t5(arch: Arch, make, clip_class):
    """The CLIP (``arch.clip``, seed offset 2) and T5 (``arch.t5``, offset 3) encoders and their tokenizers."""
    import transformers

    clip_tok = build_clip_tokenizer()
    t5_tok = build_t5_tokenizer(max_length=arch.max_sequence_length)
    clip = make(clip_class, _clip_config(clip_tok, arch.clip), 2)
    t5 = make(transformers.T5EncoderModel, _t5_config(t5_tok, arch.t5), 3)
    return clip, clip_tok, t5, t5_tok


def _flux_components(arch: Arch, make) -> dict:
    """FluxPipeline: AutoencoderKL, CLIP-L (pooled) and T5 text encoders."""
    import diffusers
    import transformers

    clip, clip_tok, t5, t5_tok = _clip_and_t5(arch, make, transformers.CLIPTextModel)
    return dict(vae=make(diffusers.AutoencoderKL, arch.vae, 1), text_encoder=clip, tokenizer=clip_tok,
                text_encoder_2=t5, tokenizer_2=t5_tok)


def _sd3_components(arch: Arch, make) -> dict:
    """StableDiffusion3Pipeline: AutoencoderKL, CLIP-L and CLIP-G (with projections), T5."""
    import diffusers
    import transformers

    clip, clip_tok, t5, t5_tok = _clip_and_t5(arch, make, transformers.CLIPTextModelWithProjection)
    clip_g = make(transformers.CLIPTextModelWithProjection, _clip_config(clip_tok, arch.clip_2), 4)
    return dict(vae=make(diffusers.AutoencoderKL, arch.vae, 1), text_encoder=clip, tokenizer=clip_tok,
                text_encoder_2=clip_g, tokenizer_2=clip_tok, text_encoder_3=t5, tokenizer_3=t5_tok)


def _wan_components(arch: Arch, make) -> dict:
    """WanPipeline: AutoencoderKLWan (video VAE) and a UMT5 text encoder with a T5 (Unigram) tokenizer."""
    import diffusers
    import transformers

    t5_tok = build_t5_tokenizer(max_length=arch.max_sequence_length)
    return dict(
        vae=make(diffusers.AutoencoderKLWan, arch.vae, 1),
        text_encoder=make(transformers.UMT5EncoderModel, _t5_config(t5_tok, arch.t5, transformers.UMT5Config), 3),
        tokenizer=t5_tok,
    )


#: family -> (arch, make(cls, config, seed_offset)) -> the pipeline's components other than transformer and scheduler.
#: Seed offsets: transformer 0, VAE 1, first CLIP 2, T5/UMT5 3, second CLIP 4.
COMPONENT_BUILDERS = {"flux": _flux_components, "sd3": _sd3_components, "wan": _wan_components}


def build_pipeline(arch: Arch | str, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Build the diffusers pipeline of ``arch`` in memory with seeded random weights."""
    import diffusers

    arch = get_arch(arch) if isinstance(arch, str) else arch
    dtype = dtype or getattr(torch, arch.default_dtype)
    device = torch.device(device)

    def make(cls, cfg, offset):
        return _make_model(cls, cfg, seed + offset, device, dtype)

    components = COMPONENT_BUILDERS[arch.family](arch, make)
    transformer = build_transformer(arch, seed, device, dtype)
    scheduler = getattr(diffusers, arch.scheduler_class)(**arch.scheduler)
    return getattr(diffusers, arch.pipeline)(scheduler=scheduler, transformer=transformer, **components)


def write_checkpoint(arch_name: str, out_dir: str | os.PathLike, seed: int = 0, device: str | None = None, dtype: str | None = None) -> Path:
    """Write the synthetic pipeline folder for ``arch_name`` to ``out_dir`` and return its path.

    The folder is written to a temporary sibling and renamed at the end, so an interrupted run leaves
    nothing half-written under ``out_dir``.
    """
    import shutil
    import tempfile

    arch = get_arch(arch_name)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output folder {out} exists and is not empty; choose a new --out or remove it")
    from .config import ConfigError
    from .runtime.generate import DTYPES
    from .runtime.report import current_umask

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of: {', '.join(sorted(DTYPES))}")
    torch_dtype = DTYPES[dtype] if dtype else None
    pipe = build_pipeline(arch, seed=seed, device=device, dtype=torch_dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes a private folder; the checkpoint follows the umask
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        meta = {"arch": arch.name, "seed": seed, "dtype": str(torch_dtype).replace("torch.", "") if dtype else arch.default_dtype, "default_size": list(arch.default_size),
                "max_sequence_length": arch.max_sequence_length, "generator": "ditmesh synth"}
        if arch.default_frames:
            meta["default_frames"] = arch.default_frames
        (tmp / "ditmesh_synth.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
