"""8-bit attention (``attention="int8"``): Q and K in int8 with a scale per token and head, softmax and P·V in the
compute dtype. One rounding, two ways to compute on it:

* :func:`quantize_qk` turns ``q``, ``k`` ``[B, S, H, D]`` into int8 rows and float32 scales, in torch, for both ways:
  K is first smoothed (its mean over the keys, per batch and head, subtracted: softmax does not change when every
  score of a query moves by the same amount, and the channel-wise offset that K carries no longer takes the int8
  range), then each row of ``D`` values of Q and of K is scaled by ``amax(|row|) / 127`` and rounded to the nearest
  integer. The scales are per token and head, so a row gives the same bytes whatever order the tokens come in (a
  Ulysses rank's gathered order, or the model's); the key mean is summed in float64 and rounded once to float32,
  so it too does not depend on the order in practice.
* :func:`int8_attention` runs the Triton kernel of :mod:`ditmesh.attention.int8_triton` (CUDA): ``Q_i8 K_i8^T`` in
  int32 (exact), times both scales, an online softmax in float32 (exp2), ``P`` cast to V's dtype and ``P V``
  accumulated in float32.
* :func:`emulated_attention` computes the same in float32 math on any device: the integer products are exact in
  float32 (``127^2 D < 2^24`` for ``D <= 1040``), times the same scales, then exact softmax and ``P V``. It is the
  reference the kernel is tested against (tests/gpu/test_attention8_gpu.py; on CPU through Triton's interpreter),
  and what the CPU tests and the quality measurements (``ditmesh eval-tiny --eight-sweep``) run.

The kernel returns no log-sum-exp: ring and USP, which merge partial attention over key chunks (each smoothed and
quantized on its own), do not take it (``options.RunOptions.validate``). No mask either: a call with one raises.
"""

from __future__ import annotations

import math

import torch

#: the largest int8 magnitude a row's largest value maps to
INT8_MAX = 127.0


def smooth_keys(k: torch.Tensor) -> torch.Tensor:
    """``k`` ``[B, S, H, D]`` minus its mean over the keys (per batch, head and channel), in float32."""
    mean = k.double().mean(dim=1, keepdim=True).float()
    return k.float() - mean


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` (float32) as ``(int8 [..., D], scale float32 [...])`` per row of the last dim:
    ``scale = amax(|row|) / 127`` (tiny for an all-zero row), values ``round(row / scale)``."""
    scale = x.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    return torch.round(x / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_qk(q: torch.Tensor, k: torch.Tensor):
    """``(q_i8, q_scale, k_i8, k_scale)`` of ``q``, ``k`` ``[B, S, H, D]``: int8 ``[B, S, H, D]`` and float32 scales
    ``[B, S, H]``, K smoothed first (module docstring)."""
    q_i8, q_scale = int8_rows(q.float())
    k_i8, k_scale = int8_rows(smooth_keys(k))
    return q_i8, q_scale, k_i8, k_scale


def _check(q: torch.Tensor, mask) -> None:
    if mask is not None:
        raise NotImplementedError("attention=int8 takes no attention mask, and this model's attention passes one; "
                                  "use attention=exact for it")
    if q.shape[-1] > 1040:
        raise NotImplementedError(f"attention=int8 takes head dims up to 1040 (int32-exact products), not {q.shape[-1]}")


def emulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                       mask=None) -> torch.Tensor:
    """Attention of ``q``, ``k``, ``v`` ``[B, S, H, D]`` with the int8 rounding of :func:`quantize_qk`, in float32
    math; returns ``[B, S_q, H, D]`` in ``q``'s dtype (module docstring)."""
    _check(q, mask)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_i8, q_scale, k_i8, k_scale = quantize_qk(q, k)
    # [B, H, S, D]: integer products, exact in float32
    scores = torch.matmul(q_i8.transpose(1, 2).float(), k_i8.transpose(1, 2).float().transpose(-1, -2))
    scores = scores * q_scale.transpose(1, 2).unsqueeze(-1) * k_scale.transpose(1, 2).unsqueeze(-2) * scale
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2).float())
    return out.transpose(1, 2).to(q.dtype)


def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   mask=None) -> torch.Tensor:
    """:func:`emulated_attention`'s rounding computed by the Triton kernel (CUDA; on CPU only under Triton's
    interpreter, ``TRITON_INTERPRET=1``); returns ``[B, S_q, H, D]`` in ``q``'s dtype."""
    _check(q, mask)
    from .int8_triton import attention as kernel

    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return kernel(*quantize_qk(q, k), v, scale, q.dtype)
