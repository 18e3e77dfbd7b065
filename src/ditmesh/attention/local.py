"""Local (single-rank) attention that returns the output and its log-sum-exp in ONE layout.

Layout, whatever computes it:
    q, k, v: ``[B, S, H, D]`` (sequence before heads, the layout diffusers' processors use)
    out:     ``[B, S_q, H, D]`` in the dtype of ``q``
    lse:     ``[B, H, S_q]`` in float32, natural log: ``lse = log(sum_k exp(q.k * scale))``

Backends return the LSE in different shapes: CUDA flash/efficient give ``[B, H, S]`` or ``[B, H, S, 1]``
depending on the torch build; ROCm's flash kernel in torch >= 2.9 gives ``[B, H, S]`` where CUDA's gives
``[B, H, S, 1]``. :func:`normalize_lse` decides from the tensor's ``ndim`` (never from a version check).
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


def _math_attention(q, k, v, scale):
    # [B, S, H, D] -> [B, H, S, D]; scores in float32 for a stable LSE.
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(probs.to(vh.dtype), vh)
    return out.to(q.dtype).transpose(1, 2), lse


def _cuda_attention(q, k, v, scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    b, h, s, _ = qh.shape
    if q.dtype in (torch.float16, torch.bfloat16):
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, False, False, scale=scale)[:2]
            return out.transpose(1, 2), normalize_lse(lse, b, h, s)
        except RuntimeError:
            pass
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, False, scale=scale)[:2]
    return out.transpose(1, 2), normalize_lse(lse, b, h, s)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over all keys; returns ``(out [B,S,H,D], lse [B,H,S] float32)``.

    CUDA/ROCm use the fused SDPA kernels (flash for half precision, memory-efficient otherwise);
    CPU uses a float32 math path.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.is_cuda:
        return _cuda_attention(q, k, v, scale)
    return _math_attention(q, k, v, scale)
