"""Copy-engine transport for the Ulysses all-to-alls: peer writes into symmetric memory (CUDA only).

Why: NCCL's all-to-all runs as kernels on the SMs, so placed beside a GEMM or an attention kernel it
slows them by about as much as it hides (docs/lab/ulysses-overlap.md). A ``cudaMemcpyAsync`` into
a peer's memory runs on the copy engines instead. Measured on 2x H200 (docs/lab/ulysses-overlap.md,
FLUX 1024^2 Q/K/V of one layer, 21 MB to the peer): NCCL 96.7 us alone and 82 us exposed beside a
230 us GEMM; the peer copies 72.5 us alone and 6 us exposed beside it.

How: every rank of a group allocates the same buffers with ``torch.distributed._symmetric_memory``
(one receive buffer per direction and head group, plus a local staging buffer), and maps its peers'.
:func:`seq_to_heads_start` and :func:`heads_to_seq_start` are custom ops, opaque to ``torch.compile``:
on the current stream they pack this rank's own part straight into its receive buffer and the peers'
parts into the staging buffer; on the group's side stream they then

1. meet every peer at a barrier (so each peer has finished reading what it received last time into the
   buffer about to be overwritten: every use of a receive buffer was issued on the peer's current
   stream before its side stream joined this transfer),
2. copy each peer's part into that peer's receive buffer, at this rank's offset there (copy engines),
3. meet every peer at a barrier again (every part destined for this rank has landed),

and record an event. :func:`wait` makes the current stream wait for that event; it is declared as
mutating the received tensor, so the compiler keeps every read of it after the wait.

Cross-rank rules: all ranks of the group make the same calls in the same order with the same sizes and
``slot`` values (the Ulysses layer guarantees it: sizes come from global lengths). The first call of a
slot with a larger size than before allocates (collective, host-synchronising): it must not happen during
CUDA graph capture, which is why graphs capture only after a normal call (``parallel.graph``).

A received tensor stays valid until the next call with the same direction, group and slot. So a
compiler must not store anything else in it: blocks compiled around these ops need
:data:`COMPILE_OPTIONS`, which turn off inductor's buffer reuse and in-place kernels. Without them,
inductor put a later same-sized tensor (a projection's output, then the block's residual stream) into a
dead receive buffer, and the next layer's transfer overwrote it: FLUX 1024^2 on 2 GPUs with one head
group gave a relative error of 1.15 against one GPU (measured on 2x H200).
"""

from __future__ import annotations

import math

import torch

from .comm import offsets

#: inductor options for code around these ops: a receive buffer must never hold another value
COMPILE_OPTIONS = {"allow_buffer_reuse": False, "inplace_buffers": False}

#: group name -> _Group; module state because the custom ops receive only names and numbers
_GROUPS: dict[str, _Group] = {}


class _Buffer:
    """One symmetric allocation (bytes) of a group, its rendezvous handle, and its element views."""

    def __init__(self, group: str, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.nbytes = nbytes
        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.tensor, group)

    def local(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.tensor.view(dtype)[:numel]

    def peer(self, rank: int, dtype: torch.dtype, numel: int, offset: int) -> torch.Tensor:
        return self.handle.get_buffer(rank, (numel,), dtype, offset)


class _Group:
    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.recv: dict[tuple[str, int], _Buffer] = {}
        self.stage: dict[tuple[str, int], torch.Tensor] = {}
        self.events: dict[tuple[str, int], torch.cuda.Event] = {}

    def recv_buffer(self, key, dtype: torch.dtype, numel: int) -> _Buffer:
        nbytes = numel * dtype.itemsize
        buf = self.recv.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self.recv[key] = _Buffer(self.name, nbytes, self.device)
        return buf

    def stage_buffer(self, key, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self.stage.get(key)
        if buf is None or buf.numel() * buf.element_size() < numel * dtype.itemsize:
            buf = self.stage[key] = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=self.device)
        return buf.view(dtype)[:numel]

    def send(self, key, buf: _Buffer, parts: list[tuple[int, torch.Tensor, int]], rank: int, world: int) -> None:
        """On the side stream: barrier, copy each ``(peer, source, offset)`` into that peer's buffer, barrier."""
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            buf.handle.barrier(channel=0)
            # the next rank first, so that not every rank writes to one peer at once
            for peer, src, offset in sorted(parts, key=lambda part: (part[0] - rank) % world):
                if src.numel():
                    buf.peer(peer, src.dtype, src.numel(), offset).copy_(src)
            buf.handle.barrier(channel=0)
        event = self.events.get(key)
        if event is None:
            event = self.events[key] = torch.cuda.Event()
        event.record(self.stream)


def _group(name: str, device: torch.device) -> _Group:
    group = _GROUPS.get(name)
    if group is None:
        group = _GROUPS[name] = _Group(name, device)
    return group


# -- layout (pure functions: also what the CPU tests check) ---------------------------------------------

def seq_to_heads_layout(lead_numel: int, n: int, local_seq: int, dim: int, seq_sizes: list[int],
                        head_sizes: list[int], rank: int) -> tuple[list[int], list[int], int]:
    """``(send_numel, dst_offsets, recv_numel)`` of the Q/K/V transfer.

    ``send_numel[j]``: elements this rank sends to rank ``j``; ``dst_offsets[j]``: where they land in
    rank ``j``'s receive buffer (after the parts of the lower source ranks); ``recv_numel``: this rank's
    receive buffer, laid out ``[source rank][..., seq_sizes[source], n, head_sizes[rank], D]``.
    """
    world = len(seq_sizes)
    send = [lead_numel * n * local_seq * head_sizes[j] * dim for j in range(world)]
    dst = [sum(lead_numel * n * seq_sizes[s] * head_sizes[j] * dim for s in range(rank)) for j in range(world)]
    return send, dst, sum(lead_numel * n * seq_sizes[s] * head_sizes[rank] * dim for s in range(world))


def heads_to_seq_layout(lead_numel: int, dim: int, seq_sizes: list[int], head_sizes: list[int],
                        rank: int) -> tuple[list[int], list[int], int]:
    """``(send_numel, dst_offsets, recv_numel)`` of the output transfer (layout ``[source][..., S_rank, h_source, D]``)."""
    world = len(seq_sizes)
    send = [lead_numel * seq_sizes[j] * head_sizes[rank] * dim for j in range(world)]
    dst = [sum(lead_numel * seq_sizes[j] * head_sizes[s] * dim for s in range(rank)) for j in range(world)]
    return send, dst, sum(lead_numel * seq_sizes[rank] * head_sizes[s] * dim for s in range(world))


def pack_heads_into(xs, head_starts: list[int], head_sizes: list[int], j: int, out: torch.Tensor) -> None:
    """Write rank ``j``'s part of ``xs`` (heads ``[head_starts[j], + head_sizes[j])``) into ``out`` as ``[..., S, n, h, D]``."""
    x0 = xs[0]
    view = out.view(*x0.shape[:-2], len(xs), head_sizes[j], x0.shape[-1])
    for i, x in enumerate(xs):
        view.select(-3, i).copy_(x.narrow(-2, head_starts[j], head_sizes[j]))


def pack_seq_into(x: torch.Tensor, start: int, length: int, out: torch.Tensor) -> None:
    """Write ``x[..., start:start + length, :, :]`` into ``out``."""
    out.view(*x.shape[:-3], length, *x.shape[-2:]).copy_(x.narrow(-3, start, length))


# -- the ops --------------------------------------------------------------------------------------------

@torch.library.custom_op("ditmesh::symm_seq_to_heads", mutates_args=())
def _seq_to_heads(xs: list[torch.Tensor], head_starts: list[int], head_sizes: list[int], seq_sizes: list[int],
                  rank: int, group: str, slot: int) -> torch.Tensor:
    x0 = xs[0]
    lead_numel, n, dim = math.prod(x0.shape[:-3]), len(xs), x0.shape[-1]
    send, dst, recv_numel = seq_to_heads_layout(lead_numel, n, x0.shape[-3], dim, seq_sizes, head_sizes, rank)
    g = _group(group, x0.device)
    key = ("qkv", slot)
    buf = g.recv_buffer(key, x0.dtype, recv_numel)
    recv = buf.local(x0.dtype, recv_numel)
    pack_heads_into(xs, head_starts, head_sizes, rank, recv.narrow(0, dst[rank], send[rank]))
    stage = g.stage_buffer(key, x0.dtype, sum(send))
    parts, start = [], 0
    for j in range(len(seq_sizes)):
        if j != rank:
            part = stage.narrow(0, start, send[j])
            pack_heads_into(xs, head_starts, head_sizes, j, part)
            parts.append((j, part, dst[j]))
        start += send[j]
    g.send(key, buf, parts, rank, len(seq_sizes))
    return recv


@_seq_to_heads.register_fake
def _(xs, head_starts, head_sizes, seq_sizes, rank, group, slot):
    x0 = xs[0]
    return x0.new_empty(seq_to_heads_layout(math.prod(x0.shape[:-3]), len(xs), x0.shape[-3], x0.shape[-1],
                                            seq_sizes, head_sizes, rank)[2])


@torch.library.custom_op("ditmesh::symm_heads_to_seq", mutates_args=())
def _heads_to_seq(x: torch.Tensor, seq_sizes: list[int], head_sizes: list[int], rank: int, group: str,
                  slot: int) -> torch.Tensor:
    lead_numel, dim = math.prod(x.shape[:-3]), x.shape[-1]
    send, dst, recv_numel = heads_to_seq_layout(lead_numel, dim, seq_sizes, head_sizes, rank)
    g = _group(group, x.device)
    key = ("out", slot)
    buf = g.recv_buffer(key, x.dtype, recv_numel)
    starts = offsets(seq_sizes)
    direct = lead_numel == 1 and x.is_contiguous()  # each peer's rows are one contiguous run of x: no packing
    if direct:
        flat = x.reshape(-1)
        row = math.prod(x.shape[-2:])
        # x is read on the side stream until wait(); the caller keeps it alive past that (it reads x's own rows)
        parts = [(j, flat.narrow(0, starts[j] * row, send[j]), dst[j]) for j in range(len(seq_sizes)) if j != rank]
    else:
        stage = g.stage_buffer(key, x.dtype, sum(send) - send[rank])
        parts, start = [], 0
        for j in range(len(seq_sizes)):
            if j != rank:
                part = stage.narrow(0, start, send[j])
                pack_seq_into(x, starts[j], seq_sizes[j], part)
                parts.append((j, part, dst[j]))
                start += send[j]
    g.send(key, buf, parts, rank, len(seq_sizes))
    return buf.local(x.dtype, recv_numel)


@_heads_to_seq.register_fake
def _(x, seq_sizes, head_sizes, rank, group, slot):
    return x.new_empty(heads_to_seq_layout(math.prod(x.shape[:-3]), x.shape[-1], seq_sizes, head_sizes, rank)[2])


@torch.library.custom_op("ditmesh::symm_wait", mutates_args=("t",))
def _wait(t: torch.Tensor, group: str, direction: str, slot: int) -> None:
    g = _GROUPS[group]
    torch.cuda.current_stream(g.device).wait_event(g.events[(direction, slot)])


@_wait.register_fake
def _(t, group, direction, slot):
    return None


def seq_to_heads_start(xs, seq_sizes, head_starts, head_sizes, rank, group: str, slot: int) -> torch.Tensor:
    """Issue the Q/K/V transfer; returns the receive buffer (``[source][..., S_source, n, h_rank, D]``, flat).

    Read it only after :func:`wait` with ``("qkv", slot)``.
    """
    return torch.ops.ditmesh.symm_seq_to_heads(list(xs), list(head_starts), list(head_sizes), list(seq_sizes),
                                              rank, group, slot)


def heads_to_seq_start(x, seq_sizes, head_sizes, rank, group: str, slot: int) -> torch.Tensor:
    """Issue the output transfer; returns the receive buffer (``[source][..., S_rank, h_source, D]``, flat).

    The part of source ``rank`` (this rank) is left unwritten: it is ``x``'s own rows. Read the buffer
    only after :func:`wait` with ``("out", slot)``.
    """
    return torch.ops.ditmesh.symm_heads_to_seq(x, list(seq_sizes), list(head_sizes), rank, group, slot)


def wait(t: torch.Tensor, group: str, direction: str, slot: int) -> torch.Tensor:
    """``t`` once its transfer has landed (the current stream waits on the side stream; no host sync)."""
    torch.ops.ditmesh.symm_wait(t, group, direction, slot)
    return t
