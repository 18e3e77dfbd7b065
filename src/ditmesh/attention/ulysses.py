"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Each rank holds ``S_r`` tokens of the sequence and all ``H`` heads. One all-to-all (Q, K and V fused
into one buffer) gives each rank the full sequence for its ``h_r`` heads; local attention runs; a second
all-to-all returns the output to sequence shards. Sequence lengths and head counts need not divide the
degree: every rank computes the same split sizes from global sizes, and the all-to-all carries uneven
per-peer counts.

Overlap. The transfers are issued without waiting (:func:`ditmesh.comm.all_to_all_start`), so work placed
between the issue and the wait runs while they travel. ``chunks > 1`` pipelines head groups: each rank's
heads are cut into ``chunks`` groups; the Q/K/V of group ``c + 1`` travels while group ``c`` attends, and
the output of group ``c`` travels back while group ``c + 1`` attends. Only the first Q/K/V transfer and
the last output transfer are exposed.

Masks: after the all-to-all each rank holds every token, in the order of the ranks' chunks (rank 0's tokens, then
rank 1's, ...), for its heads. A mask in that order for queries and keys, ``[B, S_total]`` or
``[B, 1 or H, S_total, S_total]``, therefore applies as is; one with a head dim gives each head group its heads.

Cross-rank rule: all ranks of the Ulysses group call :func:`ulysses_attention` for every attention
layer, in the same order, with the same ``seq_sizes`` (derived from global lengths at the model entry)
and the same ``chunks``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from .. import symm
from ..comm import all_to_all_start, fp8_bytes, fp8_pack, fp8_unpack, offsets, split_sizes, wait
from .local import score_mask

#: how the all-to-alls travel: NCCL kernels (any backend's functional all-to-all) or copy engines (``ditmesh.symm``)


def _pack_heads(xs, head_starts: list[int], head_sizes: list[int]) -> torch.Tensor:
    """One send buffer holding, for each rank ``j`` in order, ``stack(xs, dim=-3)[..., head_starts[j] + h_j, :]``.

    Rank ``j``'s part is laid out ``[..., S, len(xs), h_j, D]``: the tensors interleave per token, so on the
    receiving side the chunks of all source ranks line up into one ``[..., S_total, len(xs), h, D]`` buffer
    (with no leading dims, the received buffer itself; see :func:`seq_to_heads_start`). Every element is
    written once (no stacked intermediate). When the heads are spread regularly (each rank takes the same
    count at the same offset within its equal share) one strided copy per tensor fills the whole buffer;
    otherwise one copy per tensor and rank.
    """
    world, x0, n = len(head_sizes), xs[0], len(xs)
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in xs])  # as torch.stack would
    lead, heads, dim = x0.shape[:-2], x0.shape[-2], x0.shape[-1]
    share = heads // world
    regular = (heads % world == 0 and len(set(head_sizes)) == 1
               and all(head_starts[j] == head_starts[0] + j * share for j in range(world))
               and head_starts[0] + head_sizes[0] <= share)
    if regular:
        size = head_sizes[0]
        buf = x0.new_empty(world, *lead, n, size, dim, dtype=dtype)
        for i, x in enumerate(xs):
            per_rank = x.unflatten(-2, (world, share)).narrow(-2, head_starts[0], size)  # [..., S, world, h, D]
            buf.select(-3, i).copy_(per_rank.movedim(-3, 0))
        return buf.reshape(-1)
    numel = [n * math.prod(lead) * h * dim for h in head_sizes]
    buf = x0.new_empty(sum(numel), dtype=dtype)
    for j, part in enumerate(buf.split(numel)):
        symm.pack_heads_into(xs, head_starts, head_sizes, j, part)
    return buf


def _pack_seq(x: torch.Tensor, seq_sizes: list[int]) -> torch.Tensor:
    """One send buffer holding ``x[..., chunk j of the sequence, :, :]`` for each rank ``j`` in order."""
    if math.prod(x.shape[:-3]) == 1:  # no leading dims beyond size 1: the chunks already lie in order
        return x.reshape(-1)
    numel = [math.prod(x.shape[:-3]) * n * math.prod(x.shape[-2:]) for n in seq_sizes]
    buf = x.new_empty(sum(numel))
    for part, start, n in zip(buf.split(numel), offsets(seq_sizes), seq_sizes):
        symm.pack_seq_into(x, start, n, part)
    return buf


def seq_to_heads_start(xs, seq_sizes: list[int], head_starts: list[int], head_sizes: list[int],
                       rank: int, group, transport: str = "nccl", slot: int = 0,
                       comm_dtype: str = "auto") -> Callable[[], tuple[torch.Tensor, ...]]:
    """Issue the all-to-all that sends heads ``[head_starts[j], + head_sizes[j])`` of each of ``xs`` to rank ``j``.

    ``xs``: tensors (e.g. Q, K, V) of one shape ``[..., S_rank, H, D]``, sequence shards; they travel in one
    buffer. Returns ``finish()``, which waits and gives one ``[..., S_total, head_sizes[rank], D]`` per tensor.
    With no leading dims beyond size 1 (batch 1) these are strided views of the received buffer
    (``[..., S_total, len(xs), h, D]``, sequence stride ``len(xs) * h * D``): attention kernels read them in
    place, so the receive side copies nothing.

    ``transport="symm"`` sends through copy engines (:mod:`ditmesh.symm`, CUDA) into the receive buffer of
    head group ``slot``, which stays valid until the next transfer of that slot.

    ``comm_dtype="fp8"``: the buffer travels as fp8 bytes with a float32 scale per token, tensor and head
    (:func:`~ditmesh.comm.fp8_pack`) and is dequantized on arrival; the received tensors are then copies in the
    senders' dtype, each row exactly :func:`~ditmesh.comm.fp8_round` of the row sent.
    """
    world = len(seq_sizes)
    lead = xs[0].shape[:-3]
    lead_numel = len(xs) * math.prod(lead)
    dim = xs[0].shape[-1]
    out_splits = [lead_numel * seq_sizes[j] * head_sizes[rank] * dim for j in range(world)]
    if transport == "symm":
        recv = symm.seq_to_heads_start(xs, seq_sizes, head_starts, head_sizes, rank, group, slot)
    else:
        send = _pack_heads(xs, head_starts, head_sizes)
        in_splits = [lead_numel * xs[0].shape[-3] * head_sizes[j] * dim for j in range(world)]
        recv = _all_to_all_in(comm_dtype, send, out_splits, in_splits, dim, group)
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in xs])

    def finish() -> tuple[torch.Tensor, ...]:
        got = symm.wait(recv, group, "qkv", slot) if transport == "symm" else _arrived(comm_dtype, recv, dim, dtype)
        if math.prod(lead) == 1:  # the source ranks' chunks lie in sequence order already: views, no copy
            full = got.view(*lead, sum(seq_sizes), len(xs), head_sizes[rank], dim)
        else:
            parts = got.split(out_splits)
            full = torch.cat([p.view(*lead, seq_sizes[j], len(xs), head_sizes[rank], dim)
                              for j, p in enumerate(parts)], dim=-4)
        return full.unbind(-3)

    return finish


def heads_to_seq_start(x: torch.Tensor, seq_sizes: list[int], head_sizes: list[int], rank: int,
                       group, transport: str = "nccl", slot: int = 0,
                       comm_dtype: str = "auto") -> Callable[[], list[torch.Tensor]]:
    """Inverse of :func:`seq_to_heads_start`: ``x`` is ``[..., S_total, head_sizes[rank], D]``.

    Returns ``finish()``, which waits and gives the list over source ranks ``j`` of
    ``[..., S_rank, head_sizes[j], D]`` (concatenated along heads by the caller). With
    ``transport="symm"`` this rank's own part is a view of ``x``, which therefore is read until ``finish``.
    ``comm_dtype="fp8"``: as in :func:`seq_to_heads_start` (a scale per token and head).
    """
    world = len(seq_sizes)
    lead = x.shape[:-3]
    lead_numel = math.prod(lead)
    dim = x.shape[-1]
    out_splits = [lead_numel * seq_sizes[rank] * head_sizes[j] * dim for j in range(world)]
    own = None  # bound on every path: the compiler reads the closure's cells
    if transport == "symm":
        recv = symm.heads_to_seq_start(x, seq_sizes, head_sizes, rank, group, slot)
        own = x.narrow(-3, sum(seq_sizes[:rank]), seq_sizes[rank])
    else:
        send = _pack_seq(x, seq_sizes)
        in_splits = [lead_numel * seq_sizes[j] * head_sizes[rank] * dim for j in range(world)]
        recv = _all_to_all_in(comm_dtype, send, out_splits, in_splits, dim, group)

    def finish() -> list[torch.Tensor]:
        got = symm.wait(recv, group, "out", slot) if transport == "symm" else _arrived(comm_dtype, recv, dim, x.dtype)
        parts = [p.view(*lead, seq_sizes[rank], head_sizes[j], dim) for j, p in enumerate(got.split(out_splits))]
        if transport == "symm":
            parts[rank] = own
        return parts

    return finish


def _all_to_all_in(comm_dtype: str, send: torch.Tensor, out_splits: list[int], in_splits: list[int], dim: int, group):
    """Start the all-to-all of ``send`` (element counts per peer), as fp8 bytes when ``comm_dtype`` is ``fp8``."""
    if comm_dtype == "fp8":
        send, out_splits, in_splits = (fp8_pack(send, dim), [fp8_bytes(n, dim) for n in out_splits],
                                       [fp8_bytes(n, dim) for n in in_splits])
    return all_to_all_start(send, out_splits, in_splits, group)


def _arrived(comm_dtype: str, recv: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The finished all-to-all of :func:`_all_to_all_in`, in ``dtype``."""
    got = wait(recv)
    return fp8_unpack(got, dim, dtype) if comm_dtype == "fp8" else got


def seq_to_heads(xs, seq_sizes: list[int], rank: int, group, comm_dtype: str = "auto") -> tuple[torch.Tensor, ...]:
    """Sequence shards ``xs`` (each ``[..., S_rank, H, D]``) -> one ``[..., S_total, h_rank, D]`` per tensor (blocking)."""
    head_sizes = split_sizes(xs[0].shape[-2], len(seq_sizes))
    return seq_to_heads_start(xs, seq_sizes, offsets(head_sizes), head_sizes, rank, group, comm_dtype=comm_dtype)()


def heads_to_seq(x: torch.Tensor, seq_sizes: list[int], num_heads: int, rank: int, group,
                 comm_dtype: str = "auto") -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[..., S_total, h_rank, D]`` -> ``[..., S_rank, H, D]`` (blocking)."""
    head_sizes = split_sizes(num_heads, len(seq_sizes))
    return torch.cat(heads_to_seq_start(x, seq_sizes, head_sizes, rank, group, comm_dtype=comm_dtype)(), dim=-2)


def head_groups(num_heads: int, world: int, chunks: int) -> list[tuple[list[int], list[int]]]:
    """``(starts, sizes)`` per pipelined head group: rank ``j``'s heads of group ``c`` start at ``starts[j]``.

    Rank ``j`` owns the contiguous heads ``split_sizes(num_heads, world)[j]``; each group takes a
    contiguous part of every rank's heads. Groups with no heads anywhere are left out.
    """
    owned = split_sizes(num_heads, world)
    first = offsets(owned)
    parts = [split_sizes(owned[j], chunks) for j in range(world)]
    groups = []
    for c in range(chunks):
        sizes = [parts[j][c] for j in range(world)]
        if sum(sizes):
            groups.append(([first[j] + sum(parts[j][:c]) for j in range(world)], sizes))
    return groups


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_sizes: list[int],
    rank: int,
    group,
    local_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    chunks: int = 1,
    transport: str = "nccl",
    mask: torch.Tensor | None = None,
    comm_dtype: str = "auto",
) -> torch.Tensor:
    """Attention over the full sequence from sequence shards ``[B, S_rank, H, D]``; returns ``[B, S_rank, H, D]``.

    ``local_attention(q, k, v)`` runs on ``[B, S_total, h, D]`` and returns the same layout; with a ``mask``
    (in the gathered order, module docstring) it is called as ``local_attention(q, k, v, mask)`` with the mask as
    ``[B, 1 or h, S_total or 1, S_total]``. ``chunks`` head groups are pipelined against the transfers (module
    docstring). Collectives: 2 all-to-alls per non-empty head group, through ``transport`` (``ditmesh.options.TRANSPORTS``);
    ``comm_dtype="fp8"``: their payloads travel as fp8 with a scale per token and head (:func:`seq_to_heads_start`),
    so ``local_attention`` sees :func:`~ditmesh.comm.fp8_round` of Q, K and V and the caller gets it of the output.
    """
    world = len(seq_sizes)
    mask = score_mask(mask)
    qkv = (query, key, value)
    groups = head_groups(query.shape[-2], world, max(1, chunks))
    pending = seq_to_heads_start(qkv, seq_sizes, *groups[0], rank, group, transport, 0, comm_dtype)
    returning = []
    for c, (starts, sizes) in enumerate(groups):
        following = (seq_to_heads_start(qkv, seq_sizes, *groups[c + 1], rank, group, transport, c + 1, comm_dtype)
                     if c + 1 < len(groups) else None)
        q, k, v = pending()
        if not sizes[rank]:
            out = q
        elif mask is None:
            out = local_attention(q, k, v)
        else:
            heads = mask if mask.shape[1] == 1 else mask.narrow(1, starts[rank], sizes[rank])
            out = local_attention(q, k, v, heads)
        returning.append(heads_to_seq_start(out, seq_sizes, sizes, rank, group, transport, c, comm_dtype))
        pending = following
    parts = [finish() for finish in returning]  # parts[c][j]: rank j's heads of group c
    return torch.cat([parts[c][j] for j in range(world) for c in range(len(groups))], dim=-2)
