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
    output_stream: str
    output_dim: int = 1


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
    notes: dict = field(default_factory=dict)

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
