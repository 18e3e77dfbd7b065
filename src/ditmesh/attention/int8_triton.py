"""The Triton kernel of ``attention="int8"`` (:mod:`ditmesh.attention.int8` says what it computes).

One program takes ``BLOCK_M`` queries of one batch and head and walks the keys in blocks of ``BLOCK_N``: the int8
product ``Q K^T`` accumulates in int32, is scaled by the queries' and keys' float32 scales (and the softmax scale
times log2(e)), keys past the end are set to ``-inf``, and an online softmax in base 2 keeps a running maximum, sum
and float32 accumulator of ``P V`` with ``P`` cast to V's dtype. Head dims that are not a power of two of at least
16 are zero-padded (zeros add nothing to ``Q K^T``, and the padded output columns are dropped). Imported only
when the int8 attention runs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

#: the tile shapes tried once per shape (Triton's autotuner keeps the fastest); 128 x 64 with 8 warps is Hopper's
_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4))]


@triton.autotune(configs=_CONFIGS, key=["SQ", "SK", "D"])
@triton.jit
def _int8_attention_kernel(Q, QS, K, KS, V, O,
                           stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                           stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                           stride_qsb, stride_qss, stride_ksb, stride_kss,
                           H, SQ, SK,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    row_ok = rows < SQ
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + dims[None, :],
                mask=row_ok[:, None], other=0)
    q_scale = tl.load(QS + b * stride_qsb + h + rows * stride_qss, mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in range(0, SK, BLOCK_N):
        cols = start_n + cols0
        col_ok = cols < SK
        k = tl.load(K + b * stride_kb + h * stride_kh + cols[None, :] * stride_ks + dims[:, None],
                    mask=col_ok[None, :], other=0)
        k_scale = tl.load(KS + b * stride_ksb + h + cols * stride_kss, mask=col_ok, other=0.0)
        s = tl.dot(q, k).to(tl.float32) * q_scale[:, None] * k_scale[None, :]
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vs + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def _padded(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` ``[B, S, H, d]`` with its last dim zero-padded to ``dim``, last dim contiguous."""
    if x.shape[-1] == dim:
        return x if x.stride(-1) == 1 else x.contiguous()
    return torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def attention(q_i8, q_scale, k_i8, k_scale, v, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The kernel on int8 ``q_i8`` ``[B, S_q, H, D]``, ``k_i8`` ``[B, S_k, H, D]``, their float32 scales
    ``[B, S, H]`` and ``v`` ``[B, S_k, H, D]``; returns ``[B, S_q, H, D]`` in ``dtype``."""
    b, s_q, heads, d = q_i8.shape
    s_k = k_i8.shape[1]
    dim = max(32, 1 << (d - 1).bit_length())  # an int8 tl.dot takes K >= 32 (sm90): smaller heads are zero-padded
    q_i8, k_i8, v = (_padded(t, dim) for t in (q_i8, k_i8, v))
    # the softmax scale (and log2 e) rides on the query scales: a float argument would reach the kernel as fp64
    # under torch.compile and turn the running maximum into fp64
    q_scale = (q_scale * (scale * math.log2(math.e))).contiguous()
    k_scale = k_scale.contiguous()
    out = torch.empty(b, s_q, heads, dim, dtype=dtype, device=q_i8.device)
    grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * heads)  # noqa: E731
    _int8_attention_kernel[grid](
        q_i8, q_scale, k_i8, k_scale, v, out,
        q_i8.stride(0), q_i8.stride(1), q_i8.stride(2), k_i8.stride(0), k_i8.stride(1), k_i8.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1),
        heads, s_q, s_k, D=dim)
    return out[..., :d]
