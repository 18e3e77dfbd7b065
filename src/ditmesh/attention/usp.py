"""USP: 2-D sequence parallelism, Ulysses (all-to-all over heads) inside, ring (K/V passing) outside.

The sequence is split over ``ring x ulysses`` ranks, ring-major: sequence-parallel rank
``sp = ring_rank * ulysses + ulysses_rank`` holds chunk ``sp`` of every token stream. Inside a Ulysses
group (fixed ``ring_rank``) one all-to-all turns the group's ``ulysses`` chunks into one longer
sequence for this rank's share of the heads. The ranks of a ring group (fixed ``ulysses_rank``) hold
the same heads, so the ring runs over those longer sequences; a second all-to-all brings the output
back to sequence shards.

Sizes, all from global lengths: ``seq_sizes`` has one entry per sp rank; the Ulysses group of ring rank
``r`` exchanges ``seq_sizes[r*U:(r+1)*U]``, and ring rank ``r``'s K/V length is the sum of that slice.

Placement: Ulysses is a latency-bound all-to-all on the critical path, so it takes the inner mesh axis
(consecutive ranks, the fastest links); the ring's point-to-point transfers overlap compute, so it takes
the outer axis and can cross slower links (see docs/sequence-parallel.md).

Masks: the ring's key order is the sp ranks' chunks in order, the order a Ulysses-only all-to-all gives. A mask
in that order (``[B, S_total]`` or ``[B, 1 or H, S_total, S_total]``) goes to the ring with this Ulysses rank's
heads; the ring takes the rows of its queries (those of the Ulysses group) and each chunk's key columns.

Cross-rank rule: every rank of the sp group calls :func:`usp_attention` for every attention layer, in the
same order, with the same ``seq_sizes``.
"""

from __future__ import annotations

import torch

from ..comm import offsets, split_sizes
from .local import QueryChunks, score_mask
from .ring import ring_attention
from .ulysses import heads_to_seq, seq_to_heads


def ring_chunk_sizes(seq_sizes: list[int], ulysses_degree: int) -> list[int]:
    """K/V length of each ring rank after the Ulysses all-to-all: the sum of its Ulysses group's chunks."""
    return [sum(seq_sizes[r : r + ulysses_degree]) for r in range(0, len(seq_sizes), ulysses_degree)]


def usp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_sizes: list[int],
    ulysses_degree: int,
    ring_rank: int,
    ulysses_rank: int,
    ring_group,
    ulysses_group,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    chunks: QueryChunks | None = None,
    comm_dtype: str = "auto",
) -> torch.Tensor:
    """Full-sequence attention from sp shards ``[B, S_sp, H, D]``; returns ``[B, S_sp, H, D]``.

    ``seq_sizes`` holds the sequence length of every sp rank, ring-major (``len == ring * ulysses_degree``);
    ``ring_rank``/``ulysses_rank`` are this rank's indices in ``ring_group``/``ulysses_group``.
    Collectives: 2 all-to-alls in the Ulysses group and ``ring - 1`` exchange rounds in the ring group.
    ``mask``: optional, over the sp ranks' chunks in order (module docstring). ``chunks``: the local attention
    after the all-to-all runs on pieces of the queries. ``comm_dtype="fp8"``: the all-to-alls and the ring's K/V travel
    as fp8 payloads (K and V are then rounded twice: by the all-to-all, and again by the ring's packing).
    """
    group_sizes = seq_sizes[ring_rank * ulysses_degree : (ring_rank + 1) * ulysses_degree]
    num_heads = query.shape[-2]
    mask = score_mask(mask)
    if mask is not None and mask.shape[1] != 1:  # this Ulysses rank's heads, as seq_to_heads gives them
        heads = split_sizes(num_heads, ulysses_degree)
        mask = mask.narrow(1, offsets(heads)[ulysses_rank], heads[ulysses_rank])
    qkv = seq_to_heads((query, key, value), group_sizes, ulysses_rank, ulysses_group, comm_dtype)
    out = ring_attention(qkv[0], qkv[1], qkv[2], ring_chunk_sizes(seq_sizes, ulysses_degree), ring_rank, ring_group,
                         scale, mask, chunks, comm_dtype)
    return heads_to_seq(out, group_sizes, num_heads, ulysses_rank, ulysses_group, comm_dtype)
