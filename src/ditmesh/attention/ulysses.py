"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards and back.

Each rank holds ``S_r`` tokens of the sequence and all ``H`` heads. One all-to-all (Q, K and V fused
into one buffer) gives each rank the full sequence for its ``h_r`` heads; local attention runs; a second
all-to-all returns the output to sequence shards. Sequence lengths and head counts need not divide the
degree: every rank computes the same split sizes from global sizes, and the all-to-all carries uneven
per-peer counts.

Cross-rank rule: all ranks of the Ulysses group call :func:`ulysses_attention` for every attention
layer, in the same order, with the same ``seq_sizes`` (derived from global lengths at the model entry).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import all_to_all_single, offsets, split_sizes


def seq_to_heads(x: torch.Tensor, seq_sizes: list[int], rank: int, group) -> torch.Tensor:
    """``[..., S_rank, H, D]`` sequence shard -> ``[..., S_total, h_rank, D]`` head shard.

    Leading dims (e.g. a stacked Q/K/V dim and batch) travel unchanged; the sequence is dim -3.
    """
    world = len(seq_sizes)
    heads = x.shape[-2]
    head_sizes = split_sizes(heads, world)
    head_starts = offsets(head_sizes)
    lead = x.shape[:-3]
    lead_numel = 1
    for n in lead:
        lead_numel *= n
    local_seq, dim = x.shape[-3], x.shape[-1]
    send = torch.cat([x.narrow(-2, head_starts[j], head_sizes[j]).reshape(-1) for j in range(world)])
    in_splits = [lead_numel * local_seq * head_sizes[j] * dim for j in range(world)]
    out_splits = [lead_numel * seq_sizes[j] * head_sizes[rank] * dim for j in range(world)]
    recv = all_to_all_single(send, out_splits, in_splits, group)
    parts = [p.view(*lead, seq_sizes[j], head_sizes[rank], dim) for j, p in enumerate(recv.split(out_splits))]
    return torch.cat(parts, dim=-3)


def heads_to_seq(x: torch.Tensor, seq_sizes: list[int], num_heads: int, rank: int, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[..., S_total, h_rank, D]`` -> ``[..., S_rank, H, D]``."""
    world = len(seq_sizes)
    head_sizes = split_sizes(num_heads, world)
    lead = x.shape[:-3]
    lead_numel = 1
    for n in lead:
        lead_numel *= n
    dim = x.shape[-1]
    send = torch.cat([c.reshape(-1) for c in x.split(seq_sizes, dim=-3)])
    in_splits = [lead_numel * seq_sizes[j] * head_sizes[rank] * dim for j in range(world)]
    out_splits = [lead_numel * seq_sizes[rank] * head_sizes[j] * dim for j in range(world)]
    recv = all_to_all_single(send, out_splits, in_splits, group)
    parts = [p.view(*lead, seq_sizes[rank], head_sizes[j], dim) for j, p in enumerate(recv.split(out_splits))]
    return torch.cat(parts, dim=-2)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_sizes: list[int],
    rank: int,
    group,
    local_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Attention over the full sequence from sequence shards ``[B, S_rank, H, D]``; returns ``[B, S_rank, H, D]``.

    ``local_attention(q, k, v)`` runs on ``[B, S_total, h_rank, D]`` and returns the same layout.
    """
    num_heads = query.shape[-2]
    qkv = seq_to_heads(torch.stack([query, key, value]), seq_sizes, rank, group)
    out = local_attention(qkv[0], qkv[1], qkv[2])
    return heads_to_seq(out, seq_sizes, num_heads, rank, group)
