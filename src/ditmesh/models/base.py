"""The adapter contract: everything ditmesh knows about one diffusers transformer family, as data.

An adapter says *what* to split (which tensors carry the sequence, where in the model, in which dimension,
which "stream" of tokens they belong to), *where* the attention layers and the repeated blocks are, which
processor runs attention in parallel, how the linears shard, how its pipelines run CFG, how a resolution
becomes the transformer's inputs (for the planner and the benchmark), and which synthetic architectures
``ditmesh synth`` can build. The parallel modules (``ditmesh.parallel``) say *how*; the tools (planner,
synth, runtime, bench) ask the adapter and never name a family. docs/adding-a-model.md walks through it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .registry import FamilyFacts


# -- sequence parallelism ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Cut a tensor to this rank's contiguous chunk of ``stream`` along ``dim``.

    ``ndim``: the tensor's expected number of dimensions; a tensor with another one is left whole (Wan's
    timestep is split when it is per token, ``[B, N]``, and replicated when it is one value per sample). A
    list or tuple of tensors (SD3's ControlNet residuals) is split element by element, a dict (AnyFlow's RoPE
    tables) value by value. ``broadcast``: a tensor of size 1 along ``dim`` holds one value for every token of the
    stream and stays whole (LTXConditionPipeline's timestep ``[B, 1]``, which is ``[B, N]`` when frames condition the
    call). ``item``: of a tuple or list, only this element is split (each tensor in it) and the others stay whole
    (Allegro's ``image_rotary_emb``: the frequency tables whole, the token positions split).

    ``leading``: the stream fills only the first ``stream_length`` entries along ``dim`` (the stream must have been
    split before in the call); what follows them belongs to streams already split and is kept as it is (HiDream's
    position ids: the image's, built whole, then the local text's).

    ``count``: ``"first"`` or ``"last"``: the value covers only the stream's first or last tokens (the stream must have
    been split before in the call). An int counting them (Helios's ``original_context_length``, the frames being
    denoised after the history; Stable Audio 3's ``num_memory_tokens``, before the audio) becomes how many of them
    this rank holds; a tensor over them along ``dim`` (Stable Audio 3's inpainting conditioning, over the audio after
    the memory tokens) is cut to this rank's part of them.

    ``folded``: ``dim`` folds another axis outside the stream's tokens (the stream must have been split before in the
    call): its entries are groups of ``stream_length`` tokens, one group per outer entry (Latte's temporal timestep,
    ``[B * N, 6D]``, one row per sample and patch position); each group is cut to this rank's tokens.
    """

    dim: int
    stream: str
    ndim: int | None = None
    leading: bool = False
    broadcast: bool = False
    item: int | None = None
    count: str | None = None
    folded: bool = False


@dataclass(frozen=True)
class Gather:
    """All-gather the chunks of ``stream`` along ``dim`` (one collective), back to the full sequence. ``item``: of a
    tuple output, only this element is gathered (Kandinsky 6's blocks return the video and the whole audio)."""

    dim: int
    stream: str
    item: int | None = None


@dataclass(frozen=True)
class TokenGrid:
    """A stream whose tokens are the rows of a 2-D grid, row-major, that some layers mix across rows (Sana's Mix-FFN:
    a depthwise 3x3 convolution over the token grid).

    The stream is split in whole rows (chunk sizes are multiples of the row width, uneven by at most one row), every
    rank holding at least one. ``width``: (transformer, its forward inputs by name) -> tokens per row. ``rows``:
    module-path patterns (``*`` = one segment) -> the name of the int input that counts the grid's rows (the block's
    ``height``), replaced by this rank's rows. ``convs``: patterns of the convolutions over the grid (``[B, C, rows,
    width]``), which exchange the halo rows their windows need with the neighbouring ranks before they run. A row may be
    a whole frame of a video (Sana-Video: ``rows`` names the block's ``frames``, ``convs`` its temporal convolution).
    """

    stream: str
    width: Callable
    rows: dict[str, str] = field(default_factory=dict)
    convs: tuple[str, ...] = ()
    #: what gives at least ``{n}`` rows, for the refusal of a grid with fewer rows than ranks
    enough: str = "an image at least {n} latent rows tall"


@dataclass(frozen=True)
class SequencePlan:
    """Where a transformer's tokens are split over the sequence-parallel ranks and where they are gathered.

    The shape follows diffusers' ``_cp_plan``: keys are module paths inside the transformer (``""`` is the
    transformer itself, ``"blocks.0"`` its first block). ``inputs`` split forward inputs (by name) before the
    module runs; ``outputs`` split what it returns (by position in a returned tuple, ``None`` for a single
    tensor); ``gathers`` gather its output. ``streams`` lists the token streams in the order the attention
    concatenates them (FLUX: text before image); each stream is split into contiguous chunks on its own, and
    the first split of a stream in a call fixes its chunk sizes (from the global length, so all ranks agree).
    A path may hold ``*`` for one segment (``transformer_blocks.*``: an input every block takes is split at each) and
    ``-1`` for the last entry of a list (``visual_transformer_blocks.-1``: Kandinsky 5 gathers after its last block).
    """

    streams: tuple[str, ...]
    inputs: dict[str, dict[str, Split]] = field(default_factory=dict)
    outputs: dict[str, dict[int | None, Split]] = field(default_factory=dict)
    gathers: dict[str, Gather] = field(default_factory=dict)
    #: where this plan differs from the class's ``_cp_plan`` and why (checked against it by the tests)
    differs_from_cp_plan: str = ""
    #: path patterns (``*`` = one segment) of the class's ``_cp_plan`` entries this plan does not keep, because it
    #: splits elsewhere (Helios' plan cuts around every attention and feed-forward, six exchanges a block; its adapter
    #: splits once before the blocks): ``differs_from_cp_plan`` says why
    replaces_cp_plan: tuple[str, ...] = ()
    #: forward inputs the class's ``_cp_plan`` splits that this plan keeps whole on every rank: a mask over the
    #: keys, which the processor passes to ``sp.attention`` in the model's own order (it is reordered like the keys)
    whole: tuple[str, ...] = ()
    #: a stream laid out as a 2-D grid that convolutions mix across rows (:class:`TokenGrid`), or None
    grid: TokenGrid | None = None


# -- tensor parallelism ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorPlan:
    """How a transformer's linears are sharded over the tensor-parallel ranks (Megatron style), as data.

    Keys are module-name patterns where ``*`` stands for one path segment (``transformer_blocks.*.attn.to_q``).
    Any linear not named here stays replicated (e.g. AdaLN modulation, embedders, the final projection).

    - ``colwise``: output features (weight rows, bias) split contiguously; the output stays sharded.
    - ``rowwise``: input features (weight columns) split contiguously; the output is summed over the
      tensor-parallel ranks with ONE all-reduce, and the bias (kept whole) is added once after it.
    - ``packed_colwise``: a column-parallel linear whose output is several tensors side by side (FLUX.2's fused
      Q, K, V and MLP input; a SwiGLU's gate and value halves): each part is split on its own, so a rank keeps
      its share of every part, in order. Parts are named relative to the linear's parent: a linear (its output
      features) or an integer attribute (``inner_dim``, ``linear_out.in_features``).
    - ``equal_parts_colwise``: a packed column-parallel linear whose output is as many equal parts as the width of the
      one part named (as for ``packed_colwise``) goes into it, whatever their count (Stable Audio 3's fused Q/K/V:
      three parts, or five where the checkpoint has differential attention).
    - ``packed_rowwise``: a row-parallel linear whose input is the concatenation of the outputs of
      several column-parallel parts (named as for ``packed_colwise``: sibling linears such as FLUX's
      ``attn.to_q`` and ``proj_mlp``, or integer attributes); its input columns are split as one contiguous
      range per part, which is NOT a contiguous range of the whole input.
    - ``per_rank_attrs``: integer attributes of matching modules that count heads and must be divided by
      the degree on each rank (e.g. ``attn.heads``).
    - ``sharded_norms``: RMSNorms over the full (all-heads) output of a column-parallel linear, applied
      before the head split (Wan's QK-norms): their weight is split like that output and their mean square
      is summed over the tensor-parallel ranks (one all-reduce of ``[..., 1]`` per norm).

    - ``head_outputs``: modules (patterns) whose outputs, a tensor or a tuple of them, hold one slice per attention
      head along the given dim (Mochi's RoPE table, cos and sin ``[N, H, D / 2]``; LTX's, one entry per channel of
      the whole inner dim in the last dim, applied to the column-parallel Q and K before the head split): each rank
      keeps the slice of its heads, as ``per_rank_attrs`` divides the head counts.
    - ``head_inputs``: modules (patterns) with inputs, by name, that hold one slice per attention head along the given
      dim, a tensor or a dict of them (AnyFlow-FAR's K/V cache ``{"full_cache": [2, B, H, L, D], ...}``, which its
      pipeline allocates with every head and the attention writes in place): each rank gets a view of its heads'
      slice, so what the layer writes lands in the caller's tensor.

    A pattern ending in ``?`` may match nothing (a module only some checkpoints of the family have).
    """

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    packed_rowwise: dict[str, tuple[str, ...]] = field(default_factory=dict)
    packed_colwise: dict[str, tuple[str, ...]] = field(default_factory=dict)
    equal_parts_colwise: dict[str, str] = field(default_factory=dict)
    per_rank_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sharded_norms: tuple[str, ...] = ()
    head_outputs: dict[str, int] = field(default_factory=dict)
    head_inputs: dict[str, dict[str, int]] = field(default_factory=dict)


def name_pattern(pattern: str) -> re.Pattern:
    """A module-name pattern as a regex: ``*`` is exactly one path segment; a trailing ``?`` is dropped."""
    pattern = pattern.removesuffix("?")
    return re.compile("^" + r"\.".join("[^.]+" if seg == "*" else re.escape(seg) for seg in pattern.split(".")) + "$")


# -- attention layers and blocks ------------------------------------------------------------------------------
def is_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a diffusers attention layer (it runs through a swappable processor: one it sets with
    ``set_processor``, or a callable ``processor`` attribute that is not a module, as Mochi's ``MochiAttention``)."""
    processor = getattr(module, "processor", None)
    return processor is not None and (hasattr(module, "set_processor")
                                      or (callable(processor) and not isinstance(processor, torch.nn.Module)))


def set_processor(attn: torch.nn.Module, processor) -> None:
    """Give the attention layer ``attn`` ``processor``: through its ``set_processor``, or as its attribute where it has
    none (Mochi's ``MochiAttention``)."""
    if hasattr(attn, "set_processor"):
        attn.set_processor(processor)
    else:
        attn.processor = processor


@dataclass(frozen=True)
class AttentionSelector:
    """Which attention layers of a model a rule covers: by class name, by processor type, or by module path.

    Many diffusers models use the generic ``Attention`` class for self- and cross-attention alike, so a class
    name alone may not tell them apart; a processor type or a path pattern (``*`` = one segment) can.
    """

    class_names: tuple[str, ...] = ()
    processor_types: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()

    def matches(self, name: str, module: torch.nn.Module) -> bool:
        """Whether the attention layer ``module`` at ``name`` is covered."""
        return (type(module).__name__ in self.class_names
                or type(getattr(module, "processor", None)).__name__ in self.processor_types
                or any(name_pattern(p).match(name) for p in self.paths))

    def select(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """(name, module) of every attention layer of ``model`` this selector covers."""
        return [(n, m) for n, m in model.named_modules() if is_attention(m) and self.matches(n, m)]


@dataclass(frozen=True)
class BlockList:
    """One ordered list of repeated transformer blocks, and the activations passed from block to block.

    ``path`` is the ``ModuleList`` attribute; ``carries`` the forward inputs that each block updates (the
    activations that flow between blocks: what pipeline stages send on and what a step cache keeps);
    ``returns`` what a block returns, in order, naming the input each returned tensor replaces. Other
    forward inputs (``temb``, RoPE) are the same for every block of a call. ``joins``: for a list whose one
    carried sequence the model builds by concatenating, along the tokens (dim 1), carries of the list before it
    (Chroma's and FLUX.2's single blocks: ``cat([encoder_hidden_states, hidden_states])``), those carries in order.
    ``streams``: the sequence plan's token stream of each carried input, in the order of ``carries`` (tokens along dim 1), so that PipeFusion can size a
    patch's activations before they arrive; empty when not declared. ``packed``: carried inputs that every block
    but the first receives as consecutive slices (dim 1, in this order) of one tensor, because each block
    concatenates them and returns slices of its output (FLUX's single blocks: text then image); compiled, the
    first block receives them laid out the same way, so that one graph serves the whole list
    (``api.compile_blocks``).
    """

    path: str
    carries: tuple[str, ...]
    returns: tuple[str, ...]
    streams: tuple[str, ...] = ()
    joins: tuple[str, ...] = ()
    packed: tuple[str, ...] = ()


class SequenceProcessor:
    """What a family's sequence processor keeps: ``sp`` (what it calls ``attention`` on), the layer's ``previous``
    processor (for the attentions it hands back unchanged) and that processor's attention backend. diffusers reads
    ``_parallel_config`` on every processor; none is ours."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)


def token_range(runtime, stream: str, local: int) -> tuple[int, int]:
    """``(first, total)``: the global index of this rank's first token of ``stream`` and the stream's global length,
    for a processor that needs its tokens' positions (Wan Animate's per-frame face attention). ``runtime`` is what the
    processor calls ``attention`` on: the sequence-parallel runtime (or a runtime holding it as ``sp``), whose split of
    ``stream`` in this call gives both; any other (chunked attention at degree 1) holds every token, ``local`` of them."""
    sp = getattr(runtime, "sp", runtime)
    sizes = getattr(getattr(sp, "ctx", None), "stream_sizes", {}).get(stream)
    if sizes is None:
        return 0, local
    return sum(sizes[: sp.rank]), sum(sizes)


def norm1_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The modulated input of a block whose ``norm1`` is an AdaLN-Zero layer returning the modulated stream first
    (FLUX's and SD3's joint blocks)."""
    return block.norm1(named["hidden_states"], emb=named["temb"])[0]


def replace_forward(module: torch.nn.Module, forward: Callable) -> Callable[[], None]:
    """Give ``module`` ``forward`` in place of its own (a family's ``meta_trace``: a RoPE table that turns autocast off
    on its positions' device, which the meta device has not, answered with an empty table of its shape); returns the
    undo callable."""
    module.forward = forward
    return lambda: delattr(module, "forward")


# -- what the planner and the benchmark build ------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Token counts of one sample at one resolution. ``split_tokens`` is the sequence that sequence
    parallelism divides (text + image for joint attention, video tokens alone for Wan)."""

    image_tokens: int
    text_tokens: int
    split_tokens: int
    latent_shape: tuple[int, ...]


def spatial_latent(height: int, width: int, multiple: int, what: str) -> tuple[int, int]:
    """``(height // 8, width // 8)`` after checking both are positive multiples of ``multiple``.

    Raises ValueError naming the value and the nearest sizes that work.
    """
    for name, value in (("height", height), ("width", width)):
        if value < multiple or value % multiple:
            near = sorted({max(multiple, value // multiple * multiple), (value // multiple + 1) * multiple})
            raise ValueError(f"{name}={value} is not a positive multiple of {multiple}, which {what} needs; "
                             f"try {', '.join(str(v) for v in near)}")
    return height // 8, width // 8


def temporal_latent(frames: int, step: int, what: str) -> int:
    """Latent frames of a video of ``frames`` frames under a VAE that compresses time ``step``x, keeping the first
    frame (``(frames - 1) // step + 1``), after checking ``frames`` is ``step * k + 1``.

    Raises ValueError naming the value and the nearest count that works.
    """
    if frames < 1 or (frames - 1) % step:
        raise ValueError(f"frames={frames} must be {step}k+1 for {what}; try {max(1, (frames - 1) // step * step + 1)}")
    return (frames - 1) // step + 1


# -- synthetic architectures ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SynthArch:
    """A synthetic architecture ``ditmesh synth`` builds: the pipeline class and the config of each component.

    ``components`` of the family's adapter turns it into the pipeline's modules other than the transformer
    and the scheduler.
    """

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
    #: the second CLIP text encoder (SD3's CLIP-G); ``clip`` is the first (CLIP-L)
    clip_2: dict = field(default_factory=dict)
    scheduler_class: str = "FlowMatchEulerDiscreteScheduler"
    #: video architectures: frames generated when ``--frames`` is not given
    default_frames: int | None = None
    #: a second transformer (Wan 2.2 A14B's low-noise expert), same class; None: one transformer
    transformer_2: dict | None = None
    #: pipeline config entries (Wan 2.2's ``boundary_ratio``)
    pipeline_config: dict = field(default_factory=dict)


# -- the VAE --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VaePlan:
    """How a family's VAE runs split along height over the ranks that hold the same image (``ditmesh.parallel.vae``).

    The parallel VAE finds convolutions, group norms, zero pads and diffusers' ``Downsample2D`` by their torch and
    diffusers types; the plan says what only the family knows. Only height is split, never frames: a video VAE
    with a causal temporal cache (Wan's) keeps its frames whole on every rank, and each rank's cache holds its own
    rows (a convolution's cache input is extended with halo rows like its input).

    - ``class_names``: the VAE classes it covers.
    - ``spatial_factor``: (vae) -> image rows per latent row (8 for the 2-D KL VAE and Wan 2.1's).
    - ``gathered``: class names of modules that mix all rows of a frame (the mid-block attention): they run on the
      all-gathered rows and keep their own rows of the result.
    - ``conv_padding``: (conv) -> (top, bottom) zero rows a convolution adds along height, for a convolution that
      keeps its padding outside ``conv.padding`` (Wan's causal 3-D convolution); None for the default
      (``conv.padding`` along height, both sides).
    - ``pre_padding``: (module) -> ``(conv, (top, bottom))`` for a module that pads the input of its convolution
      ``conv`` along height in its ``forward`` (Mochi's causal convolution, replicating the edge rows), else None:
      those rows belong to the image's edges, kept on the edge ranks and replaced by halo rows elsewhere.
    - ``decode_method`` / ``encode_method``: the VAE methods whose input is split and whose output is gathered
      (once per call): ``decode`` (its output's ``sample``) and ``_encode`` (the latent moments, before the
      distribution is built from them).
    - ``tile_decoder``: for ``vae_parallel="tiled"``, the submodule that ``tiled_method`` calls once per tile, all
      tiles first and the blending after (diffusers' ``AutoencoderKL.tiled_decode`` and its ``decoder``); None: the
      family's tiled decode cannot be spread over ranks.
    """

    class_names: tuple[str, ...]
    spatial_factor: Callable
    gathered: tuple[str, ...] = ()
    conv_padding: Callable | None = None
    pre_padding: Callable | None = None
    decode_method: str = "decode"
    encode_method: str = "_encode"
    tile_decoder: str | None = None
    tiled_method: str = "tiled_decode"


def transformer_only(family: str, missing: str) -> Callable:
    """The ``synth_components`` of a family whose pipeline ditmesh does not synthesize (``missing``: what it would
    need), so that only its transformer is built (``synth.build_transformer``, every transformer-level test): a
    pipeline asked for raises NotImplementedError in one line."""

    def components(arch: SynthArch, kit) -> dict:
        raise NotImplementedError(f"{arch.name}: ditmesh builds {family}'s transformer only (its pipeline needs "
                                  f"{missing}); use build_transformer or a real checkpoint")

    return components


def torchvision_error() -> str | None:
    """Why ``import torchvision`` fails here, in one line (``"ModuleNotFoundError: No module named 'torchvision'"``,
    or PyPI's CUDA build beside a CPU torch: ``"RuntimeError: operator torchvision::nms does not exist"``); None when
    it imports. transformers and diffusers only look whether the package is installed, so a broken one counts as there
    for them: this imports it."""
    global _TORCHVISION_ERROR
    if _TORCHVISION_ERROR is None:
        import importlib

        try:
            importlib.import_module("torchvision")
            _TORCHVISION_ERROR = ""
        except Exception as exc:  # noqa: BLE001 - any failure to import it is the reason to give
            _TORCHVISION_ERROR = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return _TORCHVISION_ERROR or None


_TORCHVISION_ERROR: str | None = None


def with_torchvision(family: str, why: str, components: Callable) -> Callable:
    """The ``synth_components`` of a family whose pipeline needs torchvision (``why``: what needs it): ``components``
    where torchvision imports; elsewhere only the transformer is built (``transformer_only``) and a pipeline asked for
    is refused in one line that names the import's error and ``pip install torchvision``."""

    def guarded(arch: SynthArch, kit) -> dict:
        error = torchvision_error()
        if error is not None:
            raise NotImplementedError(f"{arch.name}: ditmesh builds {family}'s pipeline only where torchvision imports "
                                      f"({why}); here it does not ({error}): pip install torchvision (the release "
                                      "built for your torch), or use build_transformer or a real checkpoint")
        return components(arch, kit)

    return guarded


def vae_and_t5(vae_class: str, encoder: str = "T5EncoderModel", config_class: str = "T5Config") -> Callable:
    """``synth_components`` of a pipeline whose other components are a VAE of the diffusers class ``vae_class``
    (``arch.vae``) and a T5-shaped text encoder (the transformers class ``encoder`` of config ``config_class``, sized by
    ``arch.t5``) with a locally built T5 tokenizer: the LTX pipelines, AllegroPipeline (T5), AuraFlowPipeline (UMT5)."""

    def components(arch: SynthArch, kit) -> dict:
        import diffusers
        import transformers

        t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
        config = kit.t5_config(t5_tok, arch.t5, getattr(transformers, config_class))
        return dict(vae=kit.make(getattr(diffusers, vae_class), arch.vae, 1),
                    text_encoder=kit.make(getattr(transformers, encoder), config, 3), tokenizer=t5_tok)

    return components


# -- image-conditioned pipelines ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImagePipeline:
    """One image-conditioned pipeline of a family, as ``generate --image`` runs it.

    ``mode`` names it on the command line (``--image-mode``); ``pipeline`` is the diffusers class that loads the
    same checkpoint folder. ``mask``: it takes a mask (``--mask``, required) or refuses one; ``strength``: it takes
    ``--strength`` (how far into the schedule the run starts). ``check``: (transformer config dict) -> why this
    checkpoint's transformer cannot run it (one line), or None. ``setup``: () -> None, called before the pipeline
    class is used (it makes up for what the diffusers pipeline expects of the environment), or None. ``processor``:
    the class the checkpoint's ``processor`` component must be for the image to reach the text encoder (JoyImage-Edit's
    ``Qwen3VLProcessor``; a synthetic checkpoint written where torchvision does not import holds a tokenizer there).
    """

    mode: str
    pipeline: str
    mask: bool = False
    strength: bool = True
    check: Callable | None = None
    setup: Callable | None = None
    processor: str | None = None


# -- the adapter ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelAdapter:
    """Everything ditmesh needs to know about one diffusers transformer family (see the module docstring)."""

    name: str
    #: the diffusers transformer classes of the family
    class_names: tuple[str, ...]
    num_heads: Callable[[torch.nn.Module], int]
    sequence_plan: SequencePlan
    #: the attention layers that run through ``sequence_processor`` under sequence parallelism
    attention: AttentionSelector
    sequence_processor: Callable  # (sp_runtime, old_processor) -> processor
    #: ordered lists of repeated blocks (compiled one by one; what stages and step caches work on)
    blocks: tuple[BlockList, ...]
    #: (model, height, width, batch, text_len, generator, device, dtype, frames=None) -> one denoising step's
    #: forward kwargs, as the family's pipeline builds them
    example_inputs: Callable
    #: (transformer config dict, height, width, frames, text_tokens) -> :class:`Layout`; ValueError for a size
    #: the family cannot take
    layout: Callable
    #: its block lists run in turn, block ``i`` of each list before block ``i + 1`` of the first (Latte's spatial and
    #: temporal blocks), not one list after the other: compiled block by block all the same, but a family with them
    #: refuses PipeFusion and the step caches (its ``pp_refusal`` and ``cache_refusal``)
    alternating_blocks: bool = False
    #: text tokens the family's pipelines feed the transformer by default (the planner's default)
    text_tokens: int = 512
    #: (model_index.json as a dict) -> text tokens for that checkpoint, or None for ``text_tokens``
    checkpoint_text_tokens: Callable | None = None
    #: Megatron-style sharding of the linears (None: the family has no tensor-parallel plan)
    tensor_plan: TensorPlan | None = None
    #: forward inputs that carry the batch in dim 0 (split by data/CFG parallelism); others are replicated
    batch_inputs: tuple[str, ...] = ()
    #: batch inputs whose batch is another dim than 0, by name (HiDream's Llama states ``[layers, B, L, D]``: 1)
    batch_dims: dict[str, int] = field(default_factory=dict)
    #: the forward input whose dim 0 counts the samples of a call (data/CFG parallelism splits by it)
    sample_input: str = "hidden_states"
    #: batch inputs that are lists with one tensor per sample (Z-Image's latents and captions): split by slicing the
    #: list; a family with any returns one output tensor per sample too (a list, gathered stacked)
    sample_lists: tuple[str, ...] = ()
    #: batch inputs that are plain lists with one entry per sample, not tensors (JoyImage-Edit Plus's ``shape_list``, each
    #: sample's image grids): sliced with the batch, the output gathered as usual
    batch_lists: tuple[str, ...] = ()
    #: how its pipelines run classifier-free guidance: "sequential" (two transformer calls per step,
    #: e.g. FLUX true CFG, Wan) or "batched" (one call on [uncond, cond], e.g. SD3)
    cfg_mode: str = "sequential"
    #: why cfg parallelism cannot pair the family's two CFG branches (one line: Ideogram 4 runs its unconditional
    #: branch on a second transformer), or None: it can; ``parallelize`` refuses cfg > 1 with it
    cfg_refusal: str | None = None
    #: the pipeline argument that turns CFG on: "guidance_scale" (> 1) or "true_cfg_scale" (> 1, with a
    #: negative prompt; FLUX's ``guidance_scale`` is distilled guidance, an input of one call)
    cfg_switch: str = "guidance_scale"
    #: the ``generate`` flags that turn CFG on, for messages (e.g. "--guidance 5")
    cfg_hint: str = "--guidance > 1 (e.g. --guidance 5)"
    #: the transformer's output sample has ``hidden_states``'s shape except this dim, which is ``out_channels(model)``
    output_channel_dim: int = -1
    out_channels: Callable | None = None
    #: (model, a call's forward kwargs) -> the output's tokens (dim 1) where they are not the sample input's (Qwen-Image
    #: 2.1 returns its whole joint sequence of text and images); None: the sample input's
    output_tokens: Callable | None = None
    #: its processors read diffusers' fused Q/K/V path (``attn.fused_projections``): ``ditmesh.fusion`` applies
    fuse_qkv: bool = False
    #: video families: valid frame counts are ``frame_step * k + first_frames`` (the VAE's temporal compression);
    #: None: images
    frame_step: int | None = None
    #: the fewest frames of a video family (1: a causal VAE's lone first frame; Allegro's tiled decode: 24)
    first_frames: int = 1
    #: frames per second of written videos
    fps: int = 16
    #: the diffusers pipeline classes of the family (for messages and checks before loading)
    pipelines: tuple[str, ...] = ()
    #: synthetic architectures ``ditmesh synth`` builds for this family
    synth_archs: tuple[SynthArch, ...] = ()
    #: (arch, make(cls, config, seed_offset)) -> the pipeline's components other than transformer(s) and scheduler
    synth_components: Callable | None = None
    #: (first block, its call inputs by name) -> the block's modulated input (the normalized, timestep-modulated main
    #: stream its attention reads), shaped and split like ``hidden_states``: what the TeaCache-like step cache and
    #: ``ditmesh analyze`` measure. None: the family does not name one
    modulated_input: Callable | None = None
    #: exchanges sequence parallelism adds beyond the softmax attentions' (which the planner finds by tracing):
    #: (transformer config dict, :class:`Layout`, bytes per element, tp) -> ``[(collective, bytes of one sample's
    #: exchanged tensors per transformer call, messages)]``; None: none
    sequence_traffic: Callable | None = None
    #: module-name patterns of the modules that act on each token alone (the feed-forwards), which
    #: ``parallelize(chunk=...)`` may run on pieces of the sequence
    token_wise: tuple[str, ...] = ()
    #: attention layers that run on tokens every rank holds whole, before the sequence is split (Lumina 2's
    #: refiners): left as they are under sequence parallelism. None: every attention layer runs on split tokens
    whole_attention: AttentionSelector | None = None
    #: how the family's VAE runs split along height (None: the VAE runs whole on every rank)
    vae: VaePlan | None = None
    #: why a transformer call of the family cannot be captured in a CUDA graph (one line), or None: it can
    graph_refusal: str | None = None
    #: why PipeFusion cannot run the family's calls (one line), or None: it runs wherever its block lists allow
    pp_refusal: str | None = None
    #: why the step caches cannot skip the family's blocks (one line), or None: they run wherever it declares block
    #: lists (Wan VACE adds its control hints between blocks, outside them: a skipped span would add them twice)
    cache_refusal: str | None = None
    #: why ring attention (and USP) cannot run the family exactly (one line: Kandinsky 6 SR's NABLA block mask), or None;
    #: ``parallelize`` refuses ring > 1 with it and the table says ulysses only
    ring_refusal: str | None = None
    #: why cfg and dp cannot split the family's calls (one line), or None (LTX-2 returns the audio beside the video, and
    #: the batch hook gathers the first output only)
    batch_refusal: str | None = None
    #: every cfg/dp batch rank must hold a sample of each call, or the call is refused in one line: its calls return
    #: more than the sample, which a rank that skips a call could not give (AnyFlow-FAR's K/V cache)
    full_batches: bool = False
    #: (model) -> undo callable: makes a model whose forward has data-dependent shapes (HiDream's MoE routing)
    #: traceable on the meta device at the cost of an average call, for the planner's trace; None: it traces as is
    meta_trace: Callable | None = None
    #: its VAE decodes only with diffusers' tiling on (Allegro's raises otherwise): ``generate`` turns it on
    vae_tiled_only: bool = False
    #: () -> None, called once its pipeline is loaded for ``generate``: makes up for what the diffusers pipeline expects
    #: of the environment (WanVACEPipeline cleans prompts with ``ftfy`` whether or not it is installed); None: nothing
    pipeline_setup: Callable | None = None
    #: (pipeline, its call's kwargs from generate's options, not yet cut to those the pipeline takes) -> the kwargs it
    #: is called with, where the family's pipeline takes what the options do not name (DiT: classes named by the
    #: prompts; Ideogram 4: a constant ``guidance_scale`` in place of its per-step schedule); ValueError (one line)
    #: for options it cannot take. None: the options' kwargs as they are
    call_arguments: Callable | None = None
    #: its image-conditioned pipelines (``generate --image``), the default without a mask first, then with one
    image_pipelines: tuple[ImagePipeline, ...] = ()
    #: (transformer, ParallelConfig) -> why this checkpoint cannot run exactly under that configuration (one line naming
    #: what would work), or None: ``parallelize`` refuses it with that line (HunyuanVideo's token-replace blocks under
    #: sequence parallelism). None: every configuration the plans allow runs
    unsupported: Callable | None = None
    #: transformer -> why the 8-bit attention (``--attention fp8``) cannot stand in for this checkpoint's own
    #: attention kernel (one line), or None: Kandinsky's nabla block-sparse attention; None: it runs every checkpoint
    attention_refusal: Callable | None = None
    #: (model, attention layer name) -> keyword arguments the family's processor takes for that layer, where layers
    #: of one class run over different streams that their inputs do not tell apart (Motif-Video's decoder blocks
    #: attend over the encoder's output video where the encoder's single blocks attend over the text); None: none
    processor_args: Callable | None = None
    #: (model, the sequence-parallel runtime) -> undo callables: the family's own hooks on modules that mix tokens
    #: without an attention processor to swap (Sana-WM's gated delta-net and softmax attentions, whose forwards call
    #: parameter-free recurrence modules), put on after the plan's split points; None: every token-mixing layer is an
    #: attention layer (``attention``) or a token grid's convolution
    sequence_hooks: Callable | None = None
    notes: dict = field(default_factory=dict)

    def output_like(self, model: torch.nn.Module, hidden_states: torch.Tensor, kwargs: dict | None = None) -> torch.Tensor:
        """An uninitialized tensor shaped like the model's output for input ``hidden_states`` (of the call whose forward
        kwargs are ``kwargs``, for ``output_tokens``)."""
        shape = list(hidden_states.shape)
        if self.out_channels is not None:
            shape[self.output_channel_dim] = self.out_channels(model)
        if self.output_tokens is not None:
            shape[1] = self.output_tokens(model, kwargs)
        return hidden_states.new_empty(shape)

    def attention_modules(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """(name, module) of every attention layer the plan parallelizes."""
        return self.attention.select(model)

    def set_processors(self, model: torch.nn.Module, runtime) -> Callable[[], None]:
        """Give every attention layer the plan parallelizes the family's processor around ``runtime`` (what it calls
        ``attention`` on: the sequence-parallel runtime, or the chunked local one); returns the undo callable."""
        return self.set_layer_processors(model, lambda name: runtime)

    def set_layer_processors(self, model: torch.nn.Module, runtime_of: Callable) -> Callable[[], None]:
        """:meth:`set_processors` with a runtime per layer, ``runtime_of(layer name)`` (PipeFusion's and displaced
        attention's per-layer K/V buffers); returns the undo callable."""
        previous = {}
        for name, attn in self.attention_modules(model):
            previous[name] = attn.processor
            args = self.processor_args(model, name) if self.processor_args is not None else {}
            set_processor(attn, self.sequence_processor(runtime_of(name), attn.processor, **args))

        def restore() -> None:
            for name, attn in self.attention_modules(model):
                set_processor(attn, previous[name])

        return restore

    def block_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Every repeated block of ``model``, in the order the forward runs them."""
        return [block for spec in self.blocks for block in model.get_submodule(spec.path)]

    #: whether a call with (guidance_scale, true_cfg_scale, negative_prompt) runs both CFG branches (one rule for the
    #: adapter and its torch-free :class:`~ditmesh.models.registry.FamilyFacts`)
    cfg_on = FamilyFacts.cfg_on

    def image_pipeline(self, mode: str | None, checkpoint_pipeline: str | None, mask: bool) -> ImagePipeline:
        """The image-conditioned pipeline of a run: ``mode`` when given; else the checkpoint's own pipeline class
        (``model_index.json``) when it is one of them (an editing or fill checkpoint); else the first without a mask,
        or the first with one when ``mask``. Raises ValueError (one line) for a family without one or a mode it lacks.
        """
        if not self.image_pipelines:
            raise ValueError(f"{self.name} has no image-conditioned pipeline in ditmesh")
        by_mode = {p.mode: p for p in self.image_pipelines}
        if mode is not None:
            if mode not in by_mode:
                raise ValueError(f"{self.name} has no image mode {mode!r} (its modes: {', '.join(by_mode)})")
            return by_mode[mode]
        for p in self.image_pipelines:
            if p.pipeline == checkpoint_pipeline:
                return p
        fitting = [p for p in self.image_pipelines if p.mask == mask]
        if not fitting:
            raise ValueError(f"{self.name} has no image-conditioned pipeline {'with' if mask else 'without'} a mask")
        return fitting[0]

    #: why a positive frame count breaks the family's frame rule (one line), or None (as ``FamilyFacts``'s)
    frames_error = FamilyFacts.frames_error


_REGISTRY: dict[str, ModelAdapter] = {}


def register(adapter: ModelAdapter) -> ModelAdapter:
    """Add ``adapter`` to the registry under each of its class names."""
    for name in adapter.class_names:
        _REGISTRY[name] = adapter
    return adapter


def adapters() -> list[ModelAdapter]:
    """Every adapter, once each, in the order of the registry's table (every family's module is imported)."""
    from .registry import CLASSES, import_family

    for module in dict.fromkeys(CLASSES.values()):
        import_family(module)
    unique = {id(_REGISTRY[name]): _REGISTRY[name] for name in CLASSES}
    return list(unique.values())


def supported_classes() -> list[str]:
    """Names of the diffusers transformer classes ditmesh can parallelize (no family is imported)."""
    from . import registry

    return registry.supported_classes()


def adapter_for_class(class_name: str) -> ModelAdapter:
    """The adapter of the transformer class ``class_name`` (its family's module imported on first use);
    NotImplementedError naming the supported ones."""
    from .registry import CLASSES, import_family

    if class_name not in _REGISTRY and class_name in CLASSES:
        import_family(CLASSES[class_name])
    if class_name not in _REGISTRY:
        from .registry import refusal

        raise NotImplementedError(refusal(class_name))
    return _REGISTRY[class_name]


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    """The adapter of ``model``'s class; a clear error naming the supported classes otherwise."""
    return adapter_for_class(type(model).__name__)


def vae_plan_for(vae: torch.nn.Module) -> VaePlan | None:
    """The :class:`VaePlan` of ``vae``'s class (from the first adapter, in the registry's order, whose plan names
    it), or None. Imports only the family the registry names for that class."""
    from .registry import CLASSES, VAES, import_family

    name = type(vae).__name__
    if name not in VAES:
        return None
    import_family(VAES[name])
    for cls in CLASSES:  # the adapters loaded so far, in the registry's order: the first match is VAES's family's
        adapter = _REGISTRY.get(cls)
        if adapter is not None and adapter.vae is not None and name in adapter.vae.class_names:
            return adapter.vae
    return None


def synth_archs() -> dict[str, SynthArch]:
    """Every synthetic architecture of every family, by name."""
    return {arch.name: arch for adapter in adapters() for arch in adapter.synth_archs}
