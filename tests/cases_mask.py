"""Masked sequence-parallel attention cases, run on every rank of a gloo worker pool (module-level for the workers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q, k, v, mask=None):
    """torch's SDPA in ditmesh's ``[B, S, H, D]`` layout: what diffusers' native backend runs in one process."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    return out.transpose(1, 2)


def masked_inputs(text: int, image: int, heads: int, kind: str, seed: int = 0):
    """Q/K/V ``[2, text + image, heads, 8]`` in the global order (all text, then all image) and a mask of ``kind``:

    - ``padding``: boolean key padding ``[B, N]``: sample 0 keeps its first 2 text tokens, sample 1 all but the
      last 3 (the padded keys sit on different ranks);
    - ``general``: boolean ``[B, H, N, N]``, random, with a few query rows masked entirely;
    - ``additive``: floating ``[B, 1, N, N]``, Chroma's ``m_q * m_k`` of 0/1 (added to the scores), with ``-inf`` on
      every key of some rows and on some (query, key) pairs;
    - ``text-only``: boolean key padding keeping no image key and, in sample 0, no text key either: every row of
      sample 0 is fully masked, and the image chunks of every rank are masked whole.
    """
    n = text + image
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, heads, 8, generator=g) for _ in range(3))
    if kind == "padding":
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[0, 2:text] = False
        mask[1, text - 3 : text] = False
    elif kind == "general":
        mask = torch.rand(2, heads, n, n, generator=g) > 0.4
        mask[0, :, 1] = False
        mask[1, 0, n - 1] = False
        mask[1, 1:, text] = False
    elif kind == "additive":
        keep = torch.ones(2, n)
        keep[0, 3:text] = 0
        keep[1, text - 2 : text] = 0
        mask = (keep[:, None, None, :] * keep[:, None, :, None]).clone()
        mask[0, 0, 2] = float("-inf")
        mask[1, 0, :, 5] = float("-inf")
        mask[1, 0, n - 2, : n // 2] = float("-inf")
    elif kind == "text-only":
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[1, : text - 1] = True
    else:
        raise ValueError(kind)
    return q, k, v, mask


def sp_masked_attention_case(ring: int, ulysses: int, text: int, image: int, heads: int, kind: str, chunks: int = 1):
    """``SequenceParallel.attention`` with a global-order mask on this rank's chunks of a text and an image stream
    against SDPA over the whole sequence in one process. Returns (rel. error, output finite, collective counts)."""
    from ditmesh import ParallelConfig
    from ditmesh.comm import count_collectives
    from ditmesh.hooks import ForwardContext
    from ditmesh.mesh import ParallelMesh
    from ditmesh.models.base import SequencePlan
    from ditmesh.parallel.sequence import SequenceParallel
    from ditmesh.testing import rel_err

    class Adapter:
        sequence_plan = SequencePlan(streams=("text", "image"))

    mesh = ParallelMesh.build(ParallelConfig(ring=ring, ulysses=ulysses), torch.device("cpu"))
    sp = SequenceParallel(mesh, Adapter, ForwardContext(), chunks=chunks, transport="nccl")
    q, k, v, mask = masked_inputs(text, image, heads, kind)
    sp.begin()

    def local(t):  # this rank's [text chunk, image chunk], as a FLUX-like processor concatenates them
        return torch.cat([sp.split(t[:, :text], 1, "text"), sp.split(t[:, text:], 1, "image")], dim=1)

    ql, kl, vl = local(q), local(k), local(v)
    with count_collectives() as counts:
        out = sp.attention(ql, kl, vl, mask=mask)
    ref = local(sdpa(q, k, v, mask if mask.ndim == 4 else mask[:, None, None, :]))
    return rel_err(out, ref), bool(torch.isfinite(out).all()), dict(counts)
