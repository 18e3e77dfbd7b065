"""Sequence parallelism on a transformer: split once at the entry, gather once at the exit.

A forward pre-hook splits every input the adapter's :class:`SequencePlan` names into this rank's
contiguous chunk of its stream; inside, every block works on the local shard; attention layers run
through the adapter's processor, which calls :meth:`SequenceParallel.attention`; a forward hook
gathers the output stream back to full length on every rank.

Cross-rank rules: chunk sizes come from global lengths only (identical on every rank, nothing is
exchanged); every rank runs every attention layer in the same order.
"""

from __future__ import annotations

import inspect

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..attention.ulysses import ulysses_attention
from ..comm import all_gather_uneven, split_sizes
from ..mesh import ParallelMesh
from ..models.base import ModelAdapter


class SequenceParallel:
    """Runtime state of sequence parallelism for one model: group, degree, and the current split."""

    def __init__(self, mesh: ParallelMesh, adapter: ModelAdapter):
        self.adapter = adapter
        self.plan = adapter.sequence_plan
        self.degree = mesh.size("ulysses")
        self.rank = mesh.rank("ulysses")
        self.group = mesh.group("ulysses")
        #: tokens of each stream on each rank, set at every model entry
        self.stream_sizes: dict[str, list[int]] = {}
        #: local attention sequence length of each rank (sum over streams)
        self.seq_sizes: list[int] = []

    def attention(self, query, key, value, backend=None):
        """Full-sequence attention from local shards ``[B, S_local, H, D]``."""

        def local(q, k, v):
            return dispatch_attention_fn(q, k, v, backend=backend)

        return ulysses_attention(query, key, value, self.seq_sizes, self.rank, self.group, local)

    # -- hooks -------------------------------------------------------------------------------------
    def split_inputs(self, kwargs: dict) -> dict:
        lengths: dict[str, int] = {}
        for name, spec in self.plan.inputs.items():
            t = kwargs.get(name)
            if t is None:
                continue
            dim = spec.dim + (t.ndim - spec.ndim)
            n = t.shape[dim]
            if lengths.setdefault(spec.stream, n) != n:
                raise ValueError(f"inputs of stream {spec.stream!r} disagree in length: {lengths[spec.stream]} vs {n} ({name})")
        self.stream_sizes = {s: split_sizes(n, self.degree) for s, n in lengths.items()}
        self.seq_sizes = [sum(self.stream_sizes[s][j] for s in self.plan.streams if s in self.stream_sizes) for j in range(self.degree)]
        out = dict(kwargs)
        for name, spec in self.plan.inputs.items():
            t = kwargs.get(name)
            if t is None:
                continue
            dim = spec.dim + (t.ndim - spec.ndim)
            sizes = self.stream_sizes[spec.stream]
            out[name] = t.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])
        return out

    def gather_output(self, output):
        sizes = self.stream_sizes[self.plan.output_stream]
        if isinstance(output, tuple):
            return (all_gather_uneven(output[0], self.plan.output_dim, sizes, self.group),) + tuple(output[1:])
        output.sample = all_gather_uneven(output.sample, self.plan.output_dim, sizes, self.group)
        return output


def _bind_kwargs(forward, args, kwargs):
    if not args:
        return kwargs
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    return dict(bound.arguments)


def apply(model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter) -> list:
    """Make ``model`` sequence-parallel over the mesh's ulysses axis. Returns undo callables.

    Does nothing (and returns ``[]``) when the sequence-parallel degree is 1.
    """
    if mesh.config.sp == 1:
        return []
    if mesh.config.ring > 1:
        raise NotImplementedError("ring attention (ring > 1) is not implemented yet; use --ulysses for sequence parallelism")
    sp = SequenceParallel(mesh, adapter)
    forward = model.forward

    def pre_hook(module, args, kwargs):
        return (), sp.split_inputs(_bind_kwargs(forward, args, kwargs))

    def post_hook(module, args, kwargs, output):
        return sp.gather_output(output)

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True),
        model.register_forward_hook(post_hook, with_kwargs=True),
    ]
    previous = {}
    for name, attn in adapter.attention_modules(model):
        previous[name] = attn.processor
        attn.set_processor(adapter.sequence_processor(sp, attn.processor))

    def undo():
        for h in handles:
            h.remove()
        for name, attn in adapter.attention_modules(model):
            attn.set_processor(previous[name])

    model._ditmesh_sp = sp
    return [undo]
