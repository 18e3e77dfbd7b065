"""Ring attention: every rank keeps its queries; K/V chunks travel around the ring of ranks.

Rank ``r`` of ``N`` starts with its own K/V chunk. In round ``s`` it holds the chunk that rank
``(r - s) % N`` started with; it posts the send of that chunk to rank ``r + 1`` and the receive of the
next one from rank ``r - 1`` (one async batch), computes attention of its queries against the chunk in
hand while the transfer runs, then waits and swaps. After ``N - 1`` exchange rounds every query has seen
every key exactly once. At most two chunks are held by the ring on a rank at any time: the one in hand
and the one arriving (the rank's own input chunk is the first "in hand").

Partial results are merged through their log-sum-exp in float32 (:func:`merge_partial`), in the
``logaddexp`` form, so logits of any size neither overflow nor underflow. Key order does not matter to
softmax attention without a mask, so the result equals attention over the full sequence.

Masks: every rank holds the whole mask in the ring's key order (the keys of ring rank 0, then rank 1, ...), so the
chunk that started on rank ``j`` is attended with its own slice of the key columns and nothing travels beside K/V.
A query row that the chunk in hand masks entirely gives 0 with LSE ``-inf`` and adds nothing to the merge; a row
masked in every chunk ends at 0, as torch's SDPA gives for a fully masked row (``attention.local``).

Uneven chunks: ``seq_sizes[j]`` is the K/V length rank ``j`` started with. Every rank derives the list
from global lengths, so a receiver allocates the arriving chunk from ``seq_sizes`` alone; no sizes are
exchanged and there is no host sync in the loop.

fp8 payloads (``comm_dtype="fp8"``): each rank packs its own K and V once (:func:`~ditmesh.comm.fp8_pack`, a float32
scale per token and head) and the packed bytes travel the whole ring unchanged; every rank, the owner included,
attends over the dequantized chunk, so every key and value is :func:`~ditmesh.comm.fp8_round` of the original wherever
it is used, quantized once.

Compiled: under ``torch.compile`` each round is a pair of functional all-to-alls whose only non-empty splits go to the
next rank and come from the previous one (:func:`~ditmesh.comm.ring_shift_start`), so a block with ring attention is
compiled whole and its artifact can be saved (``ditmesh.aot``); eager runs post the batched P2P sends and receives.

Cross-rank rule: all ranks of the ring group call :func:`ring_attention` for every attention layer, in
the same order, with the same ``seq_sizes``.
"""

from __future__ import annotations

import torch

from ..comm import fp8_bytes, fp8_pack, fp8_unpack, offsets, ring_exchange_start, ring_exchange_wait, ring_shift_start, wait
from .local import QueryChunks, attention_with_lse, score_mask


def merge_partial(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over one more key block into a running result; all in float32.

    ``out``/``block_out`` are ``[B, S, H, D]``, ``lse``/``block_lse`` ``[B, H, S]``; ``out is None`` starts
    the merge. ``lse' = logaddexp(lse, block_lse)`` and each side is weighted by ``exp(its_lse - lse')``,
    a number in [0, 1]: stable for any logit size. A row with ``-inf`` on both sides (no key kept so far) stays at
    ``-inf`` with weights 0, never NaN.
    """
    block_out, block_lse = block_out.float(), block_lse.float()
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    shift = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    weight = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)
    block_weight = torch.exp(block_lse - shift).transpose(1, 2).unsqueeze(-1)
    return out * weight + block_out * block_weight, new_lse


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_sizes: list[int],
    rank: int,
    group,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    chunks: QueryChunks | None = None,
    comm_dtype: str = "auto",
) -> torch.Tensor:
    """Attention of local queries ``[B, S_rank, H, D]`` over the keys of every rank; returns ``[B, S_rank, H, D]``.

    ``seq_sizes[j]`` is the K/V sequence length of ring rank ``j``; ``rank`` is this rank's index in
    ``group`` (a process group or its registered name). Issues ``len(seq_sizes) - 1`` exchange rounds (each one
    async send + one receive of K and V).
    ``mask`` (optional, as :func:`attention_with_lse` takes it) covers the keys of every rank in ring order,
    ``sum(seq_sizes)`` columns, and either one row for all queries or the queries of every rank in that order
    (``[B, 1 or H, sum(seq_sizes), sum(seq_sizes)]``): this rank uses its own rows. ``chunks``: each round's
    attention runs on pieces of the queries (``attention.local.in_query_chunks``). ``comm_dtype="fp8"``: K/V
    travel as fp8 payloads (module docstring).
    """
    world = len(seq_sizes)
    starts = offsets(seq_sizes)
    mask = score_mask(mask)
    if mask is not None and mask.shape[-2] != 1:
        mask = mask.narrow(-2, starts[rank], seq_sizes[rank])
    if key.shape[1] != seq_sizes[rank]:
        raise ValueError(f"ring rank {rank} holds {key.shape[1]} keys but seq_sizes says {seq_sizes[rank]}")
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    fp8 = comm_dtype == "fp8"
    traced = torch.compiler.is_compiling()
    # a chunk of n tokens is [B, n, H, D] of K and of V (fp8: D elements a row, a scale each)
    outer = [(t.shape[0], t.shape[2], t.shape[3]) for t in (key, value)]
    if fp8:
        in_hand = [fp8_pack(t, t.shape[-1]) for t in (key, value)]
    else:
        in_hand = [key.contiguous(), value.contiguous()]
    out = lse = None
    for step in range(world):
        works = []
        if step < world - 1:
            # The arriving chunk's size is known from the global sizes: start its transfer now, so it overlaps
            # the attention on the chunk in hand.
            incoming_len = seq_sizes[(rank - step - 1) % world]
            if fp8:
                shapes = [(fp8_bytes(b * incoming_len * h * d, d),) for b, h, d in outer]
            else:
                shapes = [(t.shape[0], incoming_len, *t.shape[2:]) for t in in_hand]
            if traced:  # functional all-to-alls: compiled whole (P2P work handles would break the graph)
                works = ring_shift_start(in_hand, shapes, send_to, recv_from, world, group)
            else:
                arriving = [t.new_empty(shape) for t, shape in zip(in_hand, shapes)]
                works = ring_exchange_start(in_hand, arriving, send_to, recv_from, group)
        source = (rank - step) % world  # the rank this chunk started on: its key columns of the mask
        if seq_sizes[source]:
            chunk_mask = None if mask is None else mask.narrow(-1, starts[source], seq_sizes[source])
            if fp8:
                k, v = (fp8_unpack(t, d, x.dtype).view(b, seq_sizes[source], h, d)
                        for t, x, (b, h, d) in zip(in_hand, (key, value), outer))
            else:
                k, v = in_hand
            block_out, block_lse = attention_with_lse(query, k, v, scale, chunk_mask, chunks)
            out, lse = merge_partial(out, lse, block_out, block_lse)
        if step < world - 1:
            if traced:
                in_hand = [wait(t).view(shape) for t, shape in zip(works, shapes)]
            else:
                ring_exchange_wait(works)
                in_hand = arriving
    if out is None:  # no keys anywhere: attention over nothing is zero
        return torch.zeros_like(query)
    return out.to(query.dtype)
