"""The int8 attention's Triton kernel on a CUDA GPU (skipped without one or without triton): against its float32
emulation (``attention.int8.emulated_attention``, the reference the CPU tests run), in bf16 and fp16, on FLUX's and
Wan's head dim, with key counts that are not a multiple of the kernel's block, and on a head dim it pads."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs a CUDA GPU and triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,seq_q,seq_k,heads,dim", [
    (1, 4608, 4608, 6, 128),   # FLUX 1024^2 under ulysses 4: 24 heads / 4
    (1, 2000, 2011, 3, 128),   # key count off the block size
    (2, 300, 257, 4, 64),
    (1, 333, 333, 2, 96),      # padded to 128
])
def test_int8_kernel_matches_its_emulation(dtype, batch, seq_q, seq_k, heads, dim):
    from ditmesh.attention.int8 import emulated_attention, int8_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seq_q, heads, dim, device="cuda", generator=g).to(dtype)
    k = (torch.randn(batch, seq_k, heads, dim, device="cuda", generator=g) + 2).to(dtype)
    v = torch.randn(batch, seq_k, heads, dim, device="cuda", generator=g).to(dtype)
    out = int8_attention(q, k, v)
    ref = emulated_attention(q, k, v.float()).float()  # exact P V on the same rounding of Q and K
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
    err = float((out.float() - ref).norm() / ref.norm())
    assert out.dtype == dtype and out.shape == q.shape
    # the kernel differs from the emulation by P and the output in 16 bits only
    assert err <= 1e-2, err
    assert float((out.float() - exact.transpose(1, 2)).norm() / exact.norm()) <= 3e-2


def test_flux_tiny_with_int8_attention_is_close_to_exact_on_one_gpu():
    """The whole path (parallelize's one-process processor, the kernel) in a FLUX pipeline run, bf16."""
    from ditmesh import ParallelConfig, parallelize, remove
    from ditmesh.synth import build_pipeline

    pipe = build_pipeline("flux-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe("a red circle", height=64, width=64, num_inference_steps=2, max_sequence_length=32,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images.float()

    exact = run()
    parallelize(pipe, ParallelConfig(), attention="int8")
    got = run()
    remove(pipe)
    err = float((got - exact).norm() / exact.norm())
    assert 0 < err <= 5e-2, err


def test_int8_attention_under_compile_and_cuda_graph():
    """Compiled (inductor wraps the Triton kernel: no float argument may reach it as fp64) and captured."""
    from capture import compiled_and_graphed_errors
    from ditmesh.attention.int8 import int8_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, *fresh = (torch.randn(1, 1000, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(6))
    compiled, graphed = compiled_and_graphed_errors(int8_attention, (q, k, v), fresh)
    assert compiled <= 1e-2 and graphed <= 1e-2
