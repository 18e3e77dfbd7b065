"""Local attention with LSE: one layout whatever the backend returns."""

from __future__ import annotations

import math

import pytest
import torch

from ditmesh.attention import attention_with_lse, normalize_lse


def reference(q, k, v):
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, -1) @ vh).transpose(1, 2), torch.logsumexp(s, -1)


def test_attention_with_lse_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, 3, 8, generator=g) for _ in range(3))
    out, lse = attention_with_lse(q, k, v)
    ref_out, ref_lse = reference(q, k, v)
    assert out.shape == (2, 11, 3, 8) and lse.shape == (2, 3, 11) and lse.dtype == torch.float32
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_lse_merge_of_two_key_halves_equals_full_attention():
    # The property ring attention relies on: partial results over key chunks merge exactly through the LSE.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 4, generator=g) for _ in range(3))
    o1, l1 = attention_with_lse(q, k[:, :4], v[:, :4])
    o2, l2 = attention_with_lse(q, k[:, 4:], v[:, 4:])
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).transpose(1, 2).unsqueeze(-1)
    w2 = torch.exp(l2 - lse).transpose(1, 2).unsqueeze(-1)
    full, full_lse = attention_with_lse(q, k, v)
    assert torch.allclose(o1 * w1 + o2 * w2, full, atol=1e-6)
    assert torch.allclose(lse, full_lse, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 5, 1), (2, 5, 3), (2, 3, 8)])
def test_normalize_lse_accepts_3d_rocm_4d_cuda_seq_first_and_padded(shape):
    # ROCm flash (torch >= 2.9) returns [B, H, S]; CUDA returns [B, H, S, 1]; some kernels pad S.
    base = torch.arange(2 * 3 * 5, dtype=torch.float32).view(2, 3, 5)
    if shape == (2, 3, 5, 1):
        lse = base.unsqueeze(-1)
    elif shape == (2, 5, 3):
        lse = base.transpose(1, 2).contiguous()
    elif shape == (2, 3, 8):
        lse = torch.cat([base, torch.full((2, 3, 3), -1.0)], dim=-1)
    else:
        lse = base
    assert torch.equal(normalize_lse(lse, 2, 3, 5), base)


def test_normalize_lse_rejects_shapes_it_cannot_place():
    with pytest.raises(ValueError, match="unexpected 4-D LSE shape"):
        normalize_lse(torch.zeros(2, 3, 5, 2), 2, 3, 5)
    with pytest.raises(ValueError, match="does not fit"):
        normalize_lse(torch.zeros(2, 4, 5), 2, 3, 5)
