"""Local (single-rank) attention that returns the output and its log-sum-exp in ONE layout.

Layout, whatever computes it:
    q, k, v: ``[B, S, H, D]`` (sequence before heads, the layout diffusers' processors use)
    out:     ``[B, S_q, H, D]`` in the dtype of ``q``
    lse:     ``[B, H, S_q]`` in float32, natural log: ``lse = log(sum_k exp(q.k * scale))``

Backends return the LSE in different shapes: CUDA flash/efficient give ``[B, H, S]`` or ``[B, H, S, 1]``
depending on the torch build; ROCm's flash kernel in torch >= 2.9 gives ``[B, H, S]`` where CUDA's gives
``[B, H, S, 1]``. :func:`normalize_lse` decides from the tensor's ``ndim`` (never from a version check).

Masks (:func:`score_mask`): a boolean mask keeps the scores where it is True (SDPA's meaning); a floating mask is
added to the scores (also SDPA's meaning: diffusers' pipelines that pass 0/1 floats get a +1 bias, not a cut). A
key-padding mask ``[B, S_k]`` applies to every query and head. A query row whose keys are all masked out attends
to nothing: its output is 0 and its LSE ``-inf`` (torch's SDPA returns 0 there too, for boolean and ``-inf``
masks alike), so such a row adds nothing when partial results are merged.

Query chunks (:class:`QueryChunks`, :func:`in_query_chunks`): attention runs on consecutive pieces of the queries,
each against all keys, and the pieces' outputs (and LSEs) are concatenated. Every query's softmax is over the same
keys either way, so the result is the same; what changes is the largest activation a kernel that materialises the
scores holds (the CPU math path's ``[B, H, S_q, S_k]`` float32 scores, the masked CUDA path's bias): one piece's.
"""

from __future__ import annotations

import math

import torch


def normalize_lse(lse: torch.Tensor, batch: int, heads: int, seq_q: int) -> torch.Tensor:
    """Bring a backend's LSE to ``[B, H, S_q]`` float32, from its own ``ndim`` and sizes.

    Accepts ``[B, H, S]``, ``[B, H, S, 1]`` and ``[B, S, H]`` (some kernels return it sequence-first).
    Kernels may pad S up to a block multiple; padding is trimmed.
    """
    if lse.ndim == 4:
        if lse.shape[-1] != 1:
            raise ValueError(f"unexpected 4-D LSE shape {tuple(lse.shape)}; expected [B, H, S, 1]")
        lse = lse.squeeze(-1)
    if lse.ndim != 3:
        raise ValueError(f"unexpected LSE shape {tuple(lse.shape)}; expected 3 or 4 dims")
    if lse.shape[1] != heads and lse.shape[2] == heads and lse.shape[1] >= seq_q:
        lse = lse.transpose(1, 2)
    if lse.shape[0] != batch or lse.shape[1] != heads or lse.shape[2] < seq_q:
        raise ValueError(f"LSE shape {tuple(lse.shape)} does not fit batch={batch}, heads={heads}, seq={seq_q}")
    return lse[:, :, :seq_q].float()


def score_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask`` in the scores' layout ``[B, 1 or H, S_q, S_k]`` (broadcast): a key-padding mask ``[B, S_k]`` becomes
    ``[B, 1, 1, S_k]``; a 3-D ``[B, S_q, S_k]`` mask gains the head dim; a 4-D mask is returned as is."""
    if mask is None or mask.ndim == 4:
        return mask
    if mask.ndim == 2:
        return mask[:, None, None, :]
    if mask.ndim == 3:
        return mask[:, None]
    raise ValueError(f"attention mask of shape {tuple(mask.shape)}: expected [B, S_k], [B, S_q, S_k] or [B, H, S_q, S_k]")


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean or floating mask as the bias added to the scores, in ``dtype`` (False -> ``-inf``)."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _math_attention(q, k, v, scale, mask):
    # [B, S, H, D] -> [B, H, S, D]; scores in float32 for a stable LSE.
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + additive_mask(mask, torch.float32)
    lse = torch.logsumexp(scores, dim=-1)
    # a row with every key masked has lse = -inf: shift it by 0 instead, so exp(-inf) = 0 and the row's output is 0
    shift = lse if mask is None else lse.masked_fill(torch.isneginf(lse), 0.0)
    probs = torch.exp(scores - shift.unsqueeze(-1))
    out = torch.matmul(probs.to(vh.dtype), vh)
    return out.to(q.dtype).transpose(1, 2), lse


def _cuda_bias(mask: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """The memory-efficient kernel's ``attn_bias``: ``[B, H, S_q, S_k]`` in ``dtype``, its rows 16-element aligned."""
    b, h, s_q, s_k = shape
    padded = torch.empty(b, h, s_q, -(-s_k // 16) * 16, dtype=dtype, device=mask.device)
    bias = padded[..., :s_k]
    bias.copy_(additive_mask(mask, dtype).expand(b, h, s_q, s_k))
    return bias


def _cuda_attention(q, k, v, scale, mask):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    b, h, s, _ = qh.shape
    if mask is not None:  # the flash kernel takes no mask: the memory-efficient one adds it as a bias
        bias = _cuda_bias(mask, q.dtype, (b, h, s, kh.shape[2]))
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, bias, True, 0.0, False,
                                                                          scale=scale)[:2]
        out, lse = out.transpose(1, 2), normalize_lse(lse, b, h, s)
        # a fully masked row: 0 out, -inf LSE, whatever the kernel left there
        empty = torch.isneginf(lse) | torch.isnan(lse)
        return out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))
    if q.dtype in (torch.float16, torch.bfloat16):
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, False, False, scale=scale)[:2]
            return out.transpose(1, 2), normalize_lse(lse, b, h, s)
        except RuntimeError:
            pass
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, False, scale=scale)[:2]
    return out.transpose(1, 2), normalize_lse(lse, b, h, s)


class QueryChunks:
    """How many queries one attention call takes at a time: at most ``tokens``, or (``tokens`` None) as many as keep
    one piece's scores (``[B, H, piece, S_k]`` in float32) within ``budget`` bytes. ``split_calls`` counts the calls
    that ran in more than one piece."""

    def __init__(self, tokens: int | None = None, budget: int | None = None):
        if (tokens is None) == (budget is None):
            raise ValueError("QueryChunks takes tokens or budget, one of them")
        self.tokens, self.budget = tokens, budget
        self.split_calls = 0

    def size(self, q: torch.Tensor, k: torch.Tensor) -> int:
        """Queries per piece for ``q`` ``[B, S_q, H, D]`` against ``k`` ``[B, S_k, H, D]``."""
        if self.tokens is not None:
            return self.tokens
        return max(1, self.budget // (q.shape[0] * q.shape[2] * max(1, k.shape[1]) * 4))


def in_query_chunks(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    chunks: QueryChunks | None):
    """``attend(q, k, v, mask)`` on consecutive pieces of the queries (``chunks``; None: one call), the outputs
    concatenated along the sequence. ``attend`` returns ``out [B, S_q, H, D]`` or ``(out, lse [B, H, S_q])``; a mask
    with one row per query is cut with the queries, one with a single row is shared."""
    size = q.shape[1] if chunks is None else chunks.size(q, k)
    if q.shape[1] <= size:
        return attend(q, k, v, mask)
    chunks.split_calls += 1
    mask = score_mask(mask)
    out = lse = None  # written piece by piece: the whole output and one piece are alive, never all pieces and a copy
    for start in range(0, q.shape[1], size):
        n = min(size, q.shape[1] - start)
        rows = mask if mask is None or mask.shape[-2] == 1 else mask.narrow(-2, start, n)
        piece = attend(q.narrow(1, start, n), k, v, rows)
        piece_out, piece_lse = piece if isinstance(piece, tuple) else (piece, None)
        if out is None:
            out = piece_out.new_empty(piece_out.shape[0], q.shape[1], *piece_out.shape[2:])
            lse = None if piece_lse is None else piece_lse.new_empty(*piece_lse.shape[:2], q.shape[1])
        out.narrow(1, start, n).copy_(piece_out)
        if lse is not None:
            lse.narrow(2, start, n).copy_(piece_lse)
    return out if lse is None else (out, lse)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, mask: torch.Tensor | None = None,
    chunks: QueryChunks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over all keys; returns ``(out [B,S,H,D], lse [B,H,S] float32)``.

    ``mask`` (optional): boolean (True keeps) or floating (added to the scores), ``[B, S_k]`` or broadcastable to
    ``[B, H, S_q, S_k]`` (module docstring; a fully masked row gives 0 and LSE ``-inf``). CUDA/ROCm use the fused
    SDPA kernels (flash for half precision, memory-efficient otherwise and with a mask); CPU uses a float32 math
    path. ``chunks``: run on pieces of the queries (:func:`in_query_chunks`).
    """
    if chunks is not None:
        return in_query_chunks(lambda q, k, v, m: attention_with_lse(q, k, v, scale, m), q, k, v, mask, chunks)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    mask = score_mask(mask)
    if q.is_cuda:
        return _cuda_attention(q, k, v, scale, mask)
    return _math_attention(q, k, v, scale, mask)
