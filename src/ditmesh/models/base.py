"""Model adapters: per-family parallel plans as data, and the registry from diffusers classes to them.

An adapter says *what* to split (which forward inputs carry the sequence, in which dimension, which
"stream" of tokens they belong to), *where* the attention layers are, and which processor runs the
attention of a layer in parallel. The parallel modules (``ditmesh.parallel``) say *how*.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqInput:
    """A forward input that carries tokens of one stream along dimension ``dim`` (for its usual ``ndim``)."""

    dim: int
    stream: str
    ndim: int


@dataclass(frozen=True)
class SequencePlan:
    """How a transformer's forward is split over the sequence-parallel ranks.

    ``streams`` lists token streams in the order the attention concatenates them (e.g. text before
    image in FLUX). Each stream is split into contiguous chunks, one per rank, independently; a rank's
    local attention sequence is its chunks of every stream, concatenated in that order.
    """

    inputs: dict[str, SeqInput]
    streams: tuple[str, ...]
    #: stream gathered at the transformer's exit; None when the adapter's ``sequence_hooks`` gather inside
    output_stream: str | None
    output_dim: int = 1


@dataclass(frozen=True)
class TensorPlan:
    """How a transformer's linears are sharded over the tensor-parallel ranks (Megatron style), as data.

    Keys are module-name patterns where ``*`` stands for one path segment (``transformer_blocks.*.attn.to_q``).
    Any linear not named here stays replicated (e.g. AdaLN modulation, embedders, the final projection).

    - ``colwise``: output features (weight rows, bias) split contiguously; the output stays sharded.
    - ``rowwise``: input features (weight columns) split contiguously; the output is summed over the
      tensor-parallel ranks with ONE all-reduce, and the bias (kept whole) is added once after it.
    - ``packed_rowwise``: a row-parallel linear whose input is the concatenation of the outputs of
      several column-parallel sibling linears (named relative to the linear's parent); its input columns
      are split as one contiguous range per part, which is NOT a contiguous range of the whole input.
    - ``per_rank_attrs``: integer attributes of matching modules that count heads and must be divided by
      the degree on each rank (e.g. ``attn.heads``).
    - ``sharded_norms``: RMSNorms over the full (all-heads) output of a column-parallel linear, applied
      before the head split (Wan's QK-norms): their weight is split like that output and their mean square
      is summed over the tensor-parallel ranks (one all-reduce of ``[..., 1]`` per norm).

    A pattern ending in ``?`` may match nothing (a module only some checkpoints of the family have).
    """

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    packed_rowwise: dict[str, tuple[str, ...]] = field(default_factory=dict)
    per_rank_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sharded_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelAdapter:
    """Everything ditmesh needs to know about one diffusers transformer family."""

    name: str
    class_names: tuple[str, ...]
    num_heads: Callable[[torch.nn.Module], int]
    sequence_plan: SequencePlan
    attention_class_names: tuple[str, ...]
    sequence_processor: Callable  # (sp_runtime, old_processor) -> processor
    #: (model, height, width, batch, text_len, generator, device, dtype) -> forward kwargs, as the pipeline builds them
    example_inputs: Callable | None = None
    #: (model, sp_runtime) -> removable hook handles, for models that patchify inside forward (SD3, Wan):
    #: they split tokens where they first exist (``sp.split``) and gather before unpatchify (``sp.gather``)
    sequence_hooks: Callable | None = None
    #: Megatron-style sharding of the linears (None: the family has no tensor-parallel plan)
    tensor_plan: TensorPlan | None = None
    #: forward inputs that carry the batch in dim 0 (split by data/CFG parallelism); others are replicated
    batch_inputs: tuple[str, ...] = ()
    #: how its pipelines run classifier-free guidance: "sequential" (two transformer calls per step,
    #: e.g. FLUX true CFG, Wan) or "batched" (one call on [uncond, cond], e.g. SD3)
    cfg_mode: str = "sequential"
    #: the transformer's output sample has ``hidden_states``'s shape except this dim, which is ``out_channels(model)``
    output_channel_dim: int = -1
    out_channels: Callable | None = None
    #: its processors read diffusers' fused Q/K/V path (``attn.fused_projections``): ``ditmesh.fusion`` applies
    fuse_qkv: bool = False
    notes: dict = field(default_factory=dict)

    def output_like(self, model: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """An uninitialized tensor shaped like the model's output for input ``hidden_states``."""
        shape = list(hidden_states.shape)
        if self.out_channels is not None:
            shape[self.output_channel_dim] = self.out_channels(model)
        return hidden_states.new_empty(shape)

    def attention_modules(self, model: torch.nn.Module):
        """(name, module) of every attention layer the plan parallelizes."""
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ in self.attention_class_names]


_REGISTRY: dict[str, ModelAdapter] = {}


def register(adapter: ModelAdapter) -> ModelAdapter:
    """Add ``adapter`` to the registry under each of its class names."""
    for name in adapter.class_names:
        _REGISTRY[name] = adapter
    return adapter


def supported_classes() -> list[str]:
    """Names of the diffusers transformer classes ditmesh can parallelize."""
    return sorted(_REGISTRY)


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    """The adapter of ``model``'s class; a clear error naming the supported classes otherwise."""
    name = type(model).__name__
    if name not in _REGISTRY:
        raise NotImplementedError(
            f"ditmesh has no adapter for {name}; supported transformers: {', '.join(supported_classes())}"
        )
    return _REGISTRY[name]
