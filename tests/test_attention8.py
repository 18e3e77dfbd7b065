"""``attention="int8"``: Q and K in int8 per token and head (``attention.int8``). On CPU its rounding runs as the
float32 emulation (``int8-emulated``); the Triton kernel is checked against the emulation under Triton's interpreter
here (when triton is installed) and on a GPU in tests/gpu/test_attention8_gpu.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from cases import flux_generate
from cases_eight import exact_attention as _exact, fp8_attention_case, qkv as _qkv
from ditmesh.attention.int8 import emulated_attention, int8_rows, quantize_qk
from ditmesh.testing import rel_err


def test_int8_rounding_is_per_token_and_head_and_close_to_exact():
    q, k, v = _qkv()
    q_i8, q_scale, k_i8, k_scale = quantize_qk(q, k)
    assert q_i8.dtype == k_i8.dtype == torch.int8 and q_scale.shape == q.shape[:3] and k_scale.shape == k.shape[:3]
    assert q_i8.abs().amax(-1).eq(127).all()  # each row's largest magnitude takes the full int8 range
    # K is smoothed first: its offset shared by the keys does not take the int8 range
    assert (k_scale * 127 < k.abs().amax(-1)).float().mean() > 0.9
    out = emulated_attention(q, k, v)
    assert 1e-4 < rel_err(out, _exact(q, k, v)) < 2e-2
    # the tokens in another order (a Ulysses rank's gathered order) give the same outputs in that order
    perm = torch.randperm(q.shape[1], generator=torch.Generator().manual_seed(1))
    assert torch.allclose(emulated_attention(q[:, perm], k[:, perm], v[:, perm]), out[:, perm], rtol=0, atol=1e-6)


def test_int8_rows_of_zeros_stay_zero():
    values, scale = int8_rows(torch.zeros(2, 16))
    assert torch.equal(values, torch.zeros(2, 16, dtype=torch.int8)) and torch.isfinite(scale).all()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("batch,seq_q,seq_k,heads,dim", [(1, 70, 70, 2, 16), (2, 33, 100, 3, 24)])
def test_triton_kernel_under_the_interpreter_matches_the_emulation(batch, seq_q, seq_k, heads, dim, monkeypatch):
    # the interpreter runs the kernel on CPU tensors; it is read when triton is imported
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import subprocess
    import sys

    code = (f"import torch; from ditmesh.attention.int8 import emulated_attention, int8_attention\n"
            f"g = torch.Generator().manual_seed(0)\n"
            f"q = torch.randn({batch}, {seq_q}, {heads}, {dim}, generator=g)\n"
            f"k, v = (torch.randn({batch}, {seq_k}, {heads}, {dim}, generator=g) for _ in range(2))\n"
            f"a, e = int8_attention(q, k + 2, v), emulated_attention(q, k + 2, v)\n"
            f"print(float((a - e).norm() / e.norm()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) <= 1e-5


def test_ulysses_int8_emulated_attention_with_fp8_payloads_matches_one_process(pools):
    for emulated, exact, counts, sent, _ in pools(2).run(fp8_attention_case, "ulysses", 15, 3, 1, 2, 1,
                                                         "int8-emulated"):
        assert emulated <= 1e-6 and exact > 1e-4
        assert counts == {"all_to_all": 2}


def test_flux_ulysses_int8_emulated_attention_matches_one_process(pools, flux_tiny):
    exact, _ = flux_generate(flux_tiny, {}, 2, 48, 48)
    ref, _, _ = flux_generate(flux_tiny, {}, 2, 48, 48, options={"attention": "int8-emulated"})
    assert rel_err(ref, exact) > 1e-4
    for latents, counts, _ in pools(2).run(flux_generate, flux_tiny, {"ulysses": 2}, 2, 48, 48,
                                           options={"attention": "int8-emulated"}):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == {"all_to_all": 2 * 4 * 2, "all_gather": 2}


def test_exact_steps_at_both_ends_of_the_run(flux_tiny):
    """attention_bf16_steps=W: the first and last W steps attend exactly; W covering every step is the exact run."""
    exact, _ = flux_generate(flux_tiny, {}, 3, 48, 48)
    every, _, _ = flux_generate(flux_tiny, {}, 3, 48, 48,
                                options={"attention": "int8-emulated", "attention_bf16_steps": 2})
    assert rel_err(every, exact) <= 1e-6
    middle, _, _ = flux_generate(flux_tiny, {}, 3, 48, 48,
                                 options={"attention": "int8-emulated", "attention_bf16_steps": 1})
    assert rel_err(middle, exact) > 1e-5


@pytest.mark.parametrize("config,options,message", [
    ({}, {"attention": "int4"}, "attention='int4' is not a attention kernel; use one of default, fp8, fp8-emulated, int8, int8-emulated"),
    ({}, {"attention": "int8"}, "attention=int8 runs a Triton kernel on CUDA GPUs, and this rank runs on cpu"),
    ({}, {"attention_bf16_steps": 2}, "attention_bf16_steps=2 keeps steps out of 8-bit attention, and the attention is "
                                      "the default one"),
    ({}, {"attention": "int8-emulated", "attention_bf16_steps": -1}, "must be a step count >= 0"),
])
def test_bad_attention_option_is_refused_with_what_would_work(flux_tiny, config, options, message):
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.api import runtime_of
    from ditmesh.config import ConfigError

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallelize(pipe, ParallelConfig(**config), **options)
    assert runtime_of(pipe) is None


@pytest.mark.parametrize("config,options,message", [
    ({"ring": 2}, {"attention": "int8-emulated"},
     "--attention int8-emulated runs on one process or under ulysses alone, and ring=2 merges partial attention"),
    ({"ulysses": 2}, {"attention": "int8-emulated", "attention_bf16_steps": 1, "cuda_graph": True},
     "--attention-bf16-steps 1 switches attention per step on the host"),
    ({"ulysses": 2}, {"comm_dtype": "fp8", "displaced": True}, "--comm-dtype fp8 does not run with displaced attention"),
])
def test_eight_bit_options_are_refused_before_any_import(config, options, message):
    """The checks that need no model run in RunOptions.create, torch-free (the command line's messages)."""
    from ditmesh import ParallelConfig
    from ditmesh.config import ConfigError
    from ditmesh.options import RunOptions

    with pytest.raises(ConfigError, match=message):
        RunOptions.create(ParallelConfig(**config), cli=True, **options)


def test_eval_tiny_eight_sweep_settings_are_read_before_any_work():
    from ditmesh.config import ConfigError
    from ditmesh.tiny.evaluate import parse_eight_setting

    assert parse_eight_setting("comm=fp8,attention=int8,exact-steps=2") == {"comm": "fp8", "attention": "int8",
                                                                          "quant": "off", "exact_steps": 2}
    assert parse_eight_setting("attention=int8") == {"comm": "auto", "attention": "int8", "quant": "off",
                                                     "exact_steps": 0}
    assert parse_eight_setting("attention=fp8,quant=fp8") == {"comm": "auto", "attention": "fp8", "quant": "fp8",
                                                              "exact_steps": 0}
    for text, needle in (("comm=fp16", "give comm=fp8, attention=int8 or fp8, quant=fp8 and exact-steps=W"),
                         ("exact-steps=2", "exact-steps keeps steps out of 8-bit attention; add attention=int8"),
                         ("", "names no 8-bit mode")):
        with pytest.raises(ConfigError, match=needle):
            parse_eight_setting(text)
