"""The fp8 attention's cuDNN kernel on a CUDA GPU (skipped without a Hopper-or-newer GPU or cuDNN's frontend): against
its float32 emulation (``attention.fp8.emulated_attention_lse``, what the CPU tests run), output and log-sum-exp, in
bf16 and fp16, with key counts off cuDNN's block size and a batch of two samples with their own scales; and the same
under torch.compile and a CUDA graph's replay."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0)
    or importlib.util.find_spec("cudnn") is None, reason="needs a Hopper-or-newer GPU and nvidia-cudnn-frontend")


def _inputs(batch, seq_q, seq_k, heads, dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, dim, device="cuda", generator=g).to(dtype)
    k = (torch.randn(batch, seq_k, heads, dim, device="cuda", generator=g) + 2).to(dtype)
    v = (torch.randn(batch, seq_k, heads, dim, device="cuda", generator=g) * (1 + torch.arange(batch, device="cuda")
         .view(-1, 1, 1, 1))).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,seq_q,seq_k,heads,dim", [
    (1, 4608, 4608, 6, 128),   # FLUX 1024^2 under ulysses 4
    (2, 2000, 2011, 3, 128),   # key count off the block size; two samples, each its own scales
    (1, 333, 333, 2, 64),
])
def test_fp8_kernel_matches_its_emulation(dtype, batch, seq_q, seq_k, heads, dim):
    from ditmesh.attention.fp8 import emulated_attention_lse, fp8_attention_lse

    q, k, v = _inputs(batch, seq_q, seq_k, heads, dim, dtype)
    out, lse = fp8_attention_lse(q, k, v)
    ref, ref_lse = emulated_attention_lse(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (batch, heads, seq_q)
    # the kernel rounds P against its running maximum, the emulation against the final one, so P's values and the
    # fp8 output round to neighbouring e4m3 values: apart by less than e4m3's relative step 2^-4 (measured on the H200:
    # 0.030-0.038, the most at FLUX's shape under ulysses 4); a wrong scale would be off by O(1)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err <= 2**-4, err
    assert float((lse - ref_lse).abs().max()) <= 1e-2


def test_fp8_attention_under_compile_and_cuda_graph():
    from capture import compiled_and_graphed_errors
    from ditmesh.attention.fp8 import fp8_attention

    inputs = _inputs(2, 1000, 1000, 6, 128, torch.bfloat16)
    fresh = _inputs(2, 1000, 1000, 6, 128, torch.bfloat16, seed=1)
    compiled, graphed = compiled_and_graphed_errors(fp8_attention, inputs, fresh)
    assert compiled <= 1e-2 and graphed <= 1e-2
