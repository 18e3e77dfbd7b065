"""fp8 payloads and 8-bit attention: cases executed on every rank of a gloo worker pool."""

from __future__ import annotations

import torch

from cases_ring import _shard


def qkv(seed=0, batch=2, seq=70, heads=3, dim=16, offset=3.0):
    """Random ``q``, ``k``, ``v`` ``[B, S, H, D]``, the keys with a channel offset as real keys carry."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=g) for _ in range(3))
    return q, k + offset, v


def exact_attention(q, k, v):
    """Softmax attention in float64 on ``[B, S, H, D]``, returned in float32."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    return (torch.softmax(qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ vh).transpose(1, 2).float()


def fp8_attention_case(method: str, seq_len: int, heads: int, ring: int = 1, ulysses: int = 1, chunks: int = 1,
                       attention: str = "default", seed: int = 0, big_head: bool = False):
    """Sequence-parallel attention (``method``: ulysses, ring or usp) with ``comm_dtype="fp8"`` on this rank's chunk,
    against one process that rounds where the method sends (``parallel.eight.FP8_POINTS``) and against exact
    attention. ``attention="fp8-emulated"``: the 8-bit attention after the Ulysses all-to-all,
    on both sides.

    Returns (error against the emulation, error against exact attention, collective counts, bytes sent by kind and
    dtype, the bytes the same exchange sends in float32)."""
    import torch.nn.functional as F

    from ditmesh import ParallelConfig
    from ditmesh.attention.ring import ring_attention
    from ditmesh.attention.ulysses import ulysses_attention
    from ditmesh.attention.usp import usp_attention
    from ditmesh.comm import BYTES, count_collectives, split_sizes
    from ditmesh.mesh import ParallelMesh
    from ditmesh.parallel.eight import FP8_POINTS, EightBitAttention, OneProcessAttention

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, seq_len, heads, 16, generator=g) for _ in range(3))
    k = k + 2.0  # a channel offset shared by the keys, as real keys carry
    if big_head:  # head 0 of Q and V 2^10 larger: scales that leave it out round the other heads differently
        q[:, :, 0] *= 1024.0
        v[:, :, 0] *= 1024.0

    def sdpa(q_, k_, v_, mask=None):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q_, k_, v_))).transpose(1, 2)

    mesh = ParallelMesh.build(ParallelConfig(ring=ring, ulysses=ulysses), torch.device("cpu"))
    # the fp8 attention reduces its scales over the Ulysses group; one process (below) takes them from everything
    local = sdpa if attention == "default" else EightBitAttention(attention, group=mesh.group("ulysses"))
    rank = mesh.flat_rank("ring", "ulysses")
    sizes = split_sizes(seq_len, ring * ulysses)
    shards = [_shard(t, sizes, rank) for t in (q, k, v)]

    def run(comm_dtype):
        with count_collectives() as counts, count_collectives(BYTES) as sent:
            if method == "ulysses":
                out = ulysses_attention(*shards, sizes, rank, mesh.group("ulysses"), local, chunks=chunks,
                                        comm_dtype=comm_dtype)
            elif method == "ring":
                out = ring_attention(*shards, sizes, rank, mesh.group("ring"), comm_dtype=comm_dtype)
            else:
                out = usp_attention(*shards, sizes, ulysses, mesh.rank("ring"), mesh.rank("ulysses"), mesh.group("ring"),
                                    mesh.group("ulysses"), comm_dtype=comm_dtype)
        return out, dict(counts), dict(sent)

    out, counts, sent = run("fp8")
    _, exact_counts, exact_sent = run("auto")
    assert counts == exact_counts, (counts, exact_counts)
    emulated = OneProcessAttention(None if attention == "default" else EightBitAttention(attention),
                                   points=FP8_POINTS[method])
    ref = _shard(emulated.attention(q, k, v), sizes, rank)
    exact = _shard(sdpa(q, k, v), sizes, rank)

    def err(a, b):
        return float((a - b).norm() / b.norm())

    return err(out, ref), err(out, exact), counts, sent, exact_sent


def fp8_local_scales_case():
    """:func:`fp8_attention_case` (ulysses 2, the big head) with the fp8 attention's amax reduction taken out: each
    rank scales by its own heads' amax."""
    from ditmesh.attention import fp8 as module

    reduce = module.all_reduce_max
    module.all_reduce_max = lambda x, group: x
    try:
        return fp8_attention_case("ulysses", 15, 3, 1, 2, 1, "fp8-emulated", 0, True)
    finally:
        module.all_reduce_max = reduce
