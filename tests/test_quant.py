"""8-bit linears (``quant``): the parallel runs against the same quantized run on one process, on every axis.

The weight-only modes hold the same 8-bit weights on every rank layout (a row-parallel shard's scales are reduced over
the tp group), so they equal one process to float32 rounding. ``fp8`` also rounds every activation row at each linear:
where a layout reorders a sum before a quantizer (tp's all-reduce, ring's merge of partial attentions) a value may
land on the other side of an fp8 rounding boundary; there the scales are asserted equal to one process's and the
error is bounded (the flips it comes from are counted in ``test_row_parallel_scales_are_one_process_scales``).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cases_quant import MODES, compare_scales, flips_case, quant_runs
from ditmesh.testing import rel_err

FLUX_CALL = dict(prompt="a red circle", height=64, width=64, max_sequence_length=32, guidance_scale=3.5)
TRUE_CFG = dict(FLUX_CALL, negative_prompt="blurry", true_cfg_scale=4.0)
TWO_PROMPTS = dict(FLUX_CALL, prompt=["a red circle", "a blue square"])
#: ``fp8``: what a value landing on the other side of an fp8 rounding boundary (the float32 products of a rank's rows
#: are not bitwise one process's, even under ulysses: the matrix kernels block by the row count) may cost the final
#: latents after 2 steps, and the activation scales (measured: docs/quantization.md)
FP8_BOUND, FP8_SCALE_BOUND = 3e-2, 1e-1

#: (degrees, options, call, steps)
FLUX_MATRIX = {
    "ulysses2": ({"ulysses": 2}, {}, FLUX_CALL, 2),
    "ring2": ({"ring": 2}, {}, FLUX_CALL, 2),
    "tp2": ({"tp": 2}, {}, FLUX_CALL, 2),
    "cfg2": ({"cfg": 2}, {}, TRUE_CFG, 2),
    "dp2": ({"dp": 2}, {}, TWO_PROMPTS, 2),
    "pp2": ({"pp": 2}, {"pp_warmup": 2}, FLUX_CALL, 2),
    "displaced": ({"ulysses": 2}, {"displaced": True, "displaced_warmup": 2}, FLUX_CALL, 2),
    "cache": ({"ulysses": 2}, {"cache": "static:skip=1"}, FLUX_CALL, 3),
    "ulysses2xring2": ({"ulysses": 2, "ring": 2}, {}, FLUX_CALL, 2),
    "tp2xulysses2": ({"tp": 2, "ulysses": 2}, {}, FLUX_CALL, 2),
}


@functools.lru_cache(maxsize=None)
def _reference(model: str, options: tuple, call: tuple, steps: int) -> dict:
    call = {k: list(v) if isinstance(v, tuple) else v for k, v in call}  # lists were made hashable
    return quant_runs(model, {}, call, steps, options=dict(options))


def reference(model: str, options: dict, call: dict, steps: int) -> dict:
    """One process's quantized runs (every mode) with the run options that change the result (cache, stale modes)."""
    same = {k: v for k, v in options.items() if k == "cache"}
    return _reference(model, tuple(sorted(same.items())), tuple((k, tuple(v) if isinstance(v, list) else v)
                                                                for k, v in call.items()), steps)


def check(ref: dict, results: list) -> dict:
    """Each mode's parallel results against one process's; returns the measured errors by mode."""
    seen = {}
    for mode in MODES:
        errors = [rel_err(r[mode]["latents"], ref[mode]["latents"]) for r in results]
        seen[mode] = max(errors)
        if mode != "fp8":
            assert seen[mode] <= 1e-5, (mode, errors)
        else:
            worst, count = compare_scales(ref[mode], [r[mode] for r in results])
            assert count > 0 and worst <= FP8_SCALE_BOUND, (worst, count)
            assert seen[mode] <= FP8_BOUND, (mode, errors)
        assert rel_err(ref[mode]["latents"], ref["fp8-weight" if mode == "fp8" else "fp8"]["latents"]) > 0
    return seen


@pytest.mark.parametrize("case", list(FLUX_MATRIX))
def test_flux_quantized_matches_one_process(pools, flux_tiny, case):
    config, options, call, steps = FLUX_MATRIX[case]
    ref = reference(flux_tiny, options, call, steps)
    results = pools(math.prod(config.values())).run(quant_runs, flux_tiny, config, call, steps, MODES, options)
    errors = check(ref, results)
    print(case, {m: f"{e:.2e}" for m, e in errors.items()})


@pytest.mark.parametrize("model,config", [("sd3-tiny", {"ulysses": 2}), ("sd3-tiny", {"tp": 2}),
                                          ("wan-tiny", {"ulysses": 2}), ("wan-tiny", {"tp": 2})])
def test_families_quantized_match_one_process(pools, tiny_checkpoints, model, config):
    call = dict(prompt="a red circle", height=64, width=64, max_sequence_length=35 if model.startswith("sd3") else 32,
                guidance_scale=5.0)
    if model.startswith("wan"):
        call["num_frames"] = 5
    path = tiny_checkpoints(model)
    ref = _reference(path, (), tuple(call.items()), 2)
    results = pools(2).run(quant_runs, path, config, call, 2)
    check(ref, results)


def test_row_parallel_scales_are_one_process_scales(pools):
    for equal, flipped, codes, err in pools(2).run(flips_case):
        assert equal  # weight scales and 8-bit weights, and the activation scales, are one process's
        assert 0 < flipped < codes // 20, (flipped, codes)  # a few codes flip, not many
        print(f"row-parallel fp8: {flipped} of {codes} codes flipped by a 1e-4 change, output rel. err {err:.2e}")
        assert err < 5e-2


@pytest.mark.parametrize("mode,modulation,kept", [
    ("int8-weight", None, 0), ("int8-weight", True, 0), ("int8-weight", False, 6),
    ("fp8-weight", None, 6), ("fp8-weight", True, 0), ("fp8", None, 0)])
def test_quantized_linears_and_kept_modulation(flux_tiny, mode, modulation, kept):
    """The modulation linears: quantized or kept as asked, else as the mode's default (fp8-weight keeps them)."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.parallel.quant import QuantLinear

    pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
    parallelize(pipe, ParallelConfig(), quant=mode, quant_modulation=modulation, quant_backend="emulated")
    t = pipe.transformer
    linears = {n: type(m) for n, m in t.named_modules() if isinstance(m, (torch.nn.Linear, QuantLinear))}
    norms = [n for n, cls in linears.items() if ".norm" in n and n.startswith(("transformer_blocks",
                                                                               "single_transformer_blocks"))]
    assert len(norms) == 6 and sum(linears[n] is torch.nn.Linear for n in norms) == kept
    assert linears["proj_out"] is torch.nn.Linear and linears["x_embedder"] is torch.nn.Linear
    assert linears["transformer_blocks.0.ff.net.2"] is QuantLinear
    assert t.transformer_blocks[0].ff.net[2].qweight.dtype == (torch.int8 if mode == "int8-weight"
                                                                else torch.float8_e4m3fn)


def test_the_quant_backend_is_a_run_option_and_a_bad_one_is_named(flux_tiny):
    from diffusers import FluxPipeline

    from ditmesh import ConfigError, ParallelConfig, parallelize

    def step(backend):
        pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
        parallelize(pipe, ParallelConfig(), quant="fp8", quant_backend=backend)
        return pipe(prompt="a red circle", height=32, width=32, num_inference_steps=1, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images

    # on CPU the fp8 products are the float32 emulation whichever layer does them
    assert torch.equal(step("scaled-mm"), step("auto"))
    with pytest.raises(ConfigError, match="quant_backend='cutlass' is not a backend of the 8-bit linears; use one "
                                          "of auto, torchao, scaled-mm, emulated"):
        step("cutlass")
    with pytest.raises(ConfigError, match="quant_backend=torchao is given without a quant= mode"):
        parallelize(FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32), ParallelConfig(),
                    quant_backend="torchao")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_is_torchaos(dtype):
    """The emulation's scales and 8-bit values are torchao's (its CPU paths), bit for bit."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    from ditmesh.parallel.quant import fp8_quantize, fp8_scale, int8_quantize, int8_scale, row_amax

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=g) * torch.linspace(0.01, 3, 64)[:, None]).to(dtype)
    scale = fp8_scale(row_amax(w), dtype)
    theirs = _choose_scale_float8(w, [1, 96])
    assert torch.equal(scale.reshape(-1), theirs.reshape(-1))
    assert torch.equal(fp8_quantize(w, scale).view(torch.uint8),
                       _quantize_affine_float8(w, theirs).view(torch.uint8))
    linear = torch.nn.Linear(96, 64).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    quantize_(linear, Int8WeightOnlyConfig())
    scale = int8_scale(row_amax(w), dtype)
    assert torch.equal(scale.reshape(-1), linear.weight.scale.float().reshape(-1))
    assert torch.equal(int8_quantize(w, scale), linear.weight.qdata)


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--quant", "fp4"], "--quant 'fp4' is not a quantization mode; use one of off, fp8, fp8-weight"),
    (["generate", "--quant-keep-modulation"], "--quant-keep-modulation is given without a --quant mode"),
    (["generate", "--quant-modulation"], "--quant-modulation is given without a --quant mode"),
    (["bench", "--quant", "fp8-weight:quant"], "(optionally MODE:keep-modulation or MODE:quant-modulation"),
    (["generate", "--quant", "fp8", "--lora", "x.safetensors"], "no such file"),
    (["bench", "--quant", "fp8:keep"], "--quant 'fp8:keep' is not one of off, fp8"),
    (["generate", "--quant", "fp8", "--quant-backend", "cutlass"],
     "--quant-backend 'cutlass' is not a backend of the 8-bit linears; use one of auto, torchao, scaled-mm, emulated"),
    (["generate", "--quant-backend", "torchao"], "--quant-backend torchao is given without a --quant mode"),
    (["bench", "--quant", "fp8", "--quant-backend", "cutlass"], "--quant-backend 'cutlass' is not a backend of the "
                                                                 "8-bit linears"),
    (["plan", "--model", "flux-dev", "--gpus", "2", "--quant", "int4"], "--quant 'int4' is not a quantization mode"),
])
def test_quant_bad_input_one_line(argv, needle, capsys, tmp_path, monkeypatch):
    from ditmesh.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_both_modulation_flags_are_refused_by_the_parser(capsys):
    from ditmesh.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--quant", "fp8", "--quant-modulation", "--quant-keep-modulation"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--quant-keep-modulation: not allowed with argument --quant-modulation" in err


def test_quant_refuses_unfused_lora(tmp_path):
    from ditmesh import ConfigError
    from ditmesh.options import RunOptions

    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(ConfigError, match="quant=fp8 with unfused LoRA adapters: add fuse_lora"):
        RunOptions.create(quant="fp8", loras=[str(lora)])
    assert RunOptions.create(quant="fp8", loras=[str(lora)], fuse_lora=True).quant == "fp8"


def test_fused_qkv_is_quantized_once_and_matches_the_separate_projections(flux_tiny):
    """``fuse_qkv`` with ``quant``: the fused linear is the quantized one (one activation rounding, one product), the
    separate projections it replaced hold no weight (their model-dtype rows would otherwise stay alive), and the
    result is the separate projections' quantized result: per-row weight scales and per-token activation scales do
    not change when rows are stacked."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.parallel.quant import QuantLinear

    outs = {}
    for fused in (False, True):
        pipe = FluxPipeline.from_pretrained(flux_tiny, dtype=torch.float32)
        parallelize(pipe, ParallelConfig(), quant="fp8", quant_backend="emulated", fuse_qkv=fused)
        attn = pipe.transformer.transformer_blocks[0].attn
        if fused:
            assert isinstance(attn.to_qkv, QuantLinear) and isinstance(attn.to_added_qkv, QuantLinear)
            assert all(getattr(attn, p).weight.numel() == 0 for p in ("to_q", "to_k", "add_q_proj", "add_v_proj"))
            single = pipe.transformer.single_transformer_blocks[0].attn
            assert isinstance(single.to_qkv, QuantLinear) and single.to_q.weight.numel() == 0
        else:
            assert isinstance(attn.to_q, QuantLinear) and not hasattr(attn, "to_qkv")
        outs[fused] = pipe(**FLUX_CALL, num_inference_steps=2, output_type="latent",
                           generator=torch.Generator().manual_seed(0)).images
    err = rel_err(outs[True], outs[False])
    assert err <= 1e-5, err


@pytest.mark.parametrize("backend,mode,device,who", [
    ("auto", "fp8", "cuda", "scaled-mm"), ("auto", "fp8-weight", "cuda", "torchao"),
    ("auto", "int8-weight", "cuda", "torchao"), ("auto", "fp8", "cpu", "emulated"),
    ("torchao", "fp8", "cuda", "torchao"), ("scaled-mm", "int8-weight", "cpu", "scaled-mm")])
def test_one_rule_says_who_does_the_8bit_work(backend, mode, device, who):
    """The device check (torchao needed?), the quant step and the report read the same rule."""
    import torch as _torch

    from ditmesh.options import RunOptions, resolved_quant_backend
    from ditmesh.runtime.generate import ran_options

    assert resolved_quant_backend(backend, mode, device) == who
    if backend == "auto" and device == "cpu":
        report = ran_options(RunOptions.create(quant=mode), _torch.device("cpu"), 1)
        assert report["quant_backend"] == "ditmesh"


def test_wide_rows_heuristics_reduce_a_wide_row_in_one_pass(monkeypatch):
    """DITMESH_FP8_WIDE_ROWS: inductor's persistent-reduction choice widened from 1,024 to the limit for contiguous
    rows (FLUX's 3,072 and 15,360), nothing else changed; installed only where blocks hold fp8 products."""
    from types import SimpleNamespace

    import sympy
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    from ditmesh.parallel import quant

    def features(numel, hint=ReductionHint.INNER):
        return SimpleNamespace(reduction_numel=sympy.Integer(numel), get_reduction_hint=lambda: hint,
                               numel=sympy.Integer(4608))

    from ditmesh.parallel.wide_rows import WideRows

    wide = WideRows
    with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())):
        for numel, default, widened in ((1024, True, True), (3072, False, True), (15360, False, True),
                                        (16384, False, True), (32768, False, False)):
            assert InductorChoices.should_use_persistent_reduction(features(numel), False) is default, numel
            assert wide.should_use_persistent_reduction(features(numel), False) is widened, numel
        assert not wide.should_use_persistent_reduction(features(3072), True)  # cooperative: inductor's own rule
        assert not wide.should_use_persistent_reduction(features(3072, ReductionHint.OUTER), False)

    # installed only when asked (DITMESH_FP8_WIDE_ROWS, off by default) and only over fp8 products
    assert quant.WIDE_ROWS == 0
    monkeypatch.setattr(quant, "WIDE_ROWS", 16384)
    assert not quant.install_compile_heuristics([torch.nn.Linear(16, 16)])
    fp8_block = torch.nn.Sequential(quant.QuantLinear(torch.nn.Linear(32, 16), "fp8", scaled_mm=True))
    monkeypatch.setattr(quant, "WIDE_ROWS", 0)
    assert not quant.install_compile_heuristics([fp8_block])
    monkeypatch.setattr(quant, "WIDE_ROWS", 16384)
    from torch._inductor import config

    monkeypatch.setattr(config, "inductor_choices_class", config.inductor_choices_class)
    try:
        assert quant.install_compile_heuristics([fp8_block])
        assert config.inductor_choices_class is WideRows and isinstance(V.choices, WideRows)
        import pickle

        assert pickle.loads(pickle.dumps(WideRows)) is WideRows  # inductor's cache key pickles it by name
    finally:
        V.set_choices_handler(InductorChoices())
