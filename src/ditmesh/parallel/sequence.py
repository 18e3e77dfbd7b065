"""Sequence parallelism on a transformer: split once at the entry, gather once at the exit.

A forward pre-hook splits every input the adapter's :class:`SequencePlan` names into this rank's
contiguous chunk of its stream; inside, every block works on the local shard; attention layers run
through the adapter's processor, which calls :meth:`SequenceParallel.attention`; a forward hook
gathers the output stream back to full length on every rank.

Cross-rank rules: chunk sizes come from global lengths only (identical on every rank, nothing is
exchanged); every rank runs every attention layer in the same order.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..attention.ring import ring_attention
from ..attention.ulysses import ulysses_attention
from ..attention.usp import usp_attention
from ..comm import all_gather_uneven, group_name, split_sizes
from ..mesh import ParallelMesh
from ..models.base import ModelAdapter
from .forward_io import bind_kwargs, output_sample, with_output_sample


class SequenceParallel:
    """Runtime state of sequence parallelism for one model: groups, degrees, and the current split.

    The sequence-parallel (sp) ranks are the ``ring x ulysses`` sub-mesh, ring-major:
    ``rank = ring_rank * ulysses_degree + ulysses_rank``, the DeviceMesh's own row-major order (ulysses
    is the inner axis). Chunk ``rank`` of every stream lives on this rank; ``group`` spans all sp ranks
    in that order and gathers the output at the exit.
    """

    def __init__(self, mesh: ParallelMesh, adapter: ModelAdapter, chunks: int | None = None, compiled: bool = False,
                 transport: str = "nccl"):
        self.adapter = adapter
        self.plan = adapter.sequence_plan
        self.ring_degree = mesh.size("ring")
        self.ulysses_degree = mesh.size("ulysses")
        self.ring_rank = mesh.rank("ring")
        self.ulysses_rank = mesh.rank("ulysses")
        self.ring_group = mesh.group("ring")
        self.ulysses_group = mesh.group("ulysses")
        self.degree = self.ring_degree * self.ulysses_degree
        self.rank = mesh.flat_rank("ring", "ulysses")
        self.group = mesh.group_of("ring", "ulysses")
        # functional collectives take group names; resolved here, outside any compiled region
        self.ulysses_group_name = group_name(self.ulysses_group) if self.ulysses_degree > 1 else None
        #: head groups pipelined against the Ulysses all-to-alls (see ``attention.ulysses``)
        self.ulysses_chunks = default_chunks(mesh.device, compiled) if chunks is None else chunks
        #: how Ulysses-only attention moves its all-to-alls (``attention.ulysses.TRANSPORTS``)
        self.transport = transport
        #: tokens of each stream on each sp rank, set at every model entry
        self.stream_sizes: dict[str, list[int]] = {}
        #: local attention sequence length of each sp rank (sum over streams)
        self.seq_sizes: list[int] = []

    def attention(self, query, key, value, backend=None, streams=None):
        """Full-sequence attention from local shards ``[B, S_local, H, D]``; returns the same layout.

        Ulysses alone runs the local attention through diffusers' dispatcher with ``backend``. Ring and
        USP need the log-sum-exp of each partial result, so they run :func:`attention_with_lse` (fused
        flash / memory-efficient kernels on CUDA, float32 math on CPU) whatever ``backend`` says.
        """
        # ``streams``: the streams this attention runs over (default: all, e.g. joint text+image); an
        # image-only attention inside a joint model (SD3.5 ``attn2``) passes ``("image",)``.
        seq_sizes = self.seq_sizes if streams is None else self.local_lengths(streams)
        if self.ring_degree == 1:

            def local(q, k, v):
                return dispatch_attention_fn(q, k, v, backend=backend)

            return ulysses_attention(query, key, value, seq_sizes, self.ulysses_rank, self.ulysses_group_name, local,
                                     chunks=self.ulysses_chunks, transport=self.transport)
        if self.ulysses_degree == 1:
            return ring_attention(query, key, value, seq_sizes, self.ring_rank, self.ring_group)
        return usp_attention(query, key, value, seq_sizes, self.ulysses_degree, self.ring_rank, self.ulysses_rank,
                             self.ring_group, self.ulysses_group)

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
        if self.plan.output_stream is None:
            return output  # the adapter's own hook gathered inside the model (before unpatchify)
        sizes = self.stream_sizes[self.plan.output_stream]
        full = all_gather_uneven(output_sample(output), self.plan.output_dim, sizes, self.group)
        return with_output_sample(output, full)

    def full_placeholder(self, output):
        """A skipped call's output at full length, uninitialized (its sp group skips together: no gather)."""
        if self.plan.output_stream is None:
            return output  # the model gathers inside; a skipped call never ran it and returned full length
        sample = output_sample(output)
        shape = list(sample.shape)
        shape[self.plan.output_dim] = sum(self.stream_sizes[self.plan.output_stream])
        return with_output_sample(output, sample.new_empty(shape))

    # -- split points inside the model (``ModelAdapter.sequence_hooks``) ---------------------------
    def local_lengths(self, streams) -> list[int]:
        """Local attention length of each sp rank over ``streams`` (those split so far in this forward)."""
        return [sum(self.stream_sizes[s][j] for s in streams if s in self.stream_sizes) for j in range(self.degree)]

    def split(self, tensor: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """This rank's chunk of ``tensor`` along ``dim``, for tokens that only exist inside the model.

        For adapters whose model patchifies internally (SD3, Wan): their hooks split where the tokens
        appear. The first split of a stream in a forward fixes its sizes (from the global length, so
        every rank agrees); later splits of the same stream (e.g. its RoPE table) must match it.
        """
        n = tensor.shape[dim]
        sizes = self.stream_sizes.setdefault(stream, split_sizes(n, self.degree))
        if sum(sizes) != n:
            raise ValueError(f"stream {stream!r} has {sum(sizes)} tokens but a split point sees {n}")
        self.seq_sizes = self.local_lengths(self.plan.streams)
        return tensor.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])

    def gather(self, tensor: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """Every rank's chunk of ``stream`` concatenated along ``dim`` (one all-gather)."""
        return all_gather_uneven(tensor, dim, self.stream_sizes[stream], self.group)


def default_chunks(device: torch.device, compiled: bool = False) -> int:
    """Head groups pipelined per Ulysses attention when none are asked for: 2 on GPUs in eager mode, else 1.

    Measured on 4x H200 (docs/benchmarks.md): in eager mode the all-to-all of one group runs beside the
    attention of the previous one and pays (Wan2.1-14B video hid 35 ms per step). Compiled, the hidden
    transfers ran slower beside the compute and saved nothing (FLUX 1024^2 x4 with CUDA graphs: 44.5 ms with one
    group, 44.8 with two; 2048^2: 198.6 vs 204.3; Wan compiled: 796.6 vs 796.9), so one group is the default
    there. On CPU (gloo) the same cores would do both.
    """
    return 2 if device.type == "cuda" and not compiled else 1


def apply(model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter, chunks: int | None = None,
          compiled: bool = False, transport: str = "nccl") -> list:
    """Make ``model`` sequence-parallel over the mesh's ring and ulysses axes. Returns undo callables.

    Ulysses alone, ring alone, or both (USP) follow from the degrees. ``chunks``: Ulysses head groups
    pipelined against the all-to-alls (default :func:`default_chunks`, which depends on whether the blocks
    will be ``compiled``). ``transport``: how Ulysses-only attention moves its all-to-alls ("nccl" or
    "symm"; ring and USP always use the process group's backend). Does nothing (and returns ``[]``) when the sequence-parallel degree is 1.
    """
    if mesh.config.sp == 1:
        return []
    sp = SequenceParallel(mesh, adapter, chunks, compiled, transport)
    forward = model.forward

    def pre_hook(module, args, kwargs):
        return (), sp.split_inputs(bind_kwargs(forward, args, kwargs))

    def post_hook(module, args, kwargs, output):
        batch = getattr(module, "_ditmesh_batch", None)
        if batch is not None and batch.skip:  # a CFG/data-parallel call this rank skips: nothing to gather
            return sp.full_placeholder(output)
        return sp.gather_output(output)

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True),
        model.register_forward_hook(post_hook, with_kwargs=True),
    ]
    if adapter.sequence_hooks is not None:  # split points inside the model, registered after the entry split
        handles += adapter.sequence_hooks(model, sp)
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
