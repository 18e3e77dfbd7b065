"""``ditmesh quantize``: a pipeline written with 8-bit transformer weights, loaded without the originals (a
tensor-parallel rank reads its slices only), runs exactly as the same model quantized on the fly, on one process and
across ranks; bad input is refused in one line before torch loads, and a failed write leaves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cases_quant import MODES, checkpoint_runs, compare_scales, quant_runs
from ditmesh.testing import rel_err

CALL = dict(prompt="a red circle", height=64, width=64, max_sequence_length=32, guidance_scale=3.5)
FP8_BOUND, FP8_SCALE_BOUND = 3e-2, 1e-1  # as test_quant.py: fp8 roundings may flip where sums are reordered


@pytest.fixture(scope="module")
def written(flux_tiny, tmp_path_factory) -> dict:
    """flux-tiny written by ``ditmesh quantize`` in every mode (float32, as CPU runs load it)."""
    from ditmesh.options import modulation_quantized
    from ditmesh.quantize import quantize_pipeline

    root = tmp_path_factory.mktemp("quantized")
    for mode in MODES:  # the modulation as the mode's default (fp8-weight keeps it), as the command writes it
        quantize_pipeline(flux_tiny, root / mode, mode, modulation_quantized(mode, None), "float32", log=lambda _: None)
    return {mode: str(root / mode) for mode in MODES}


@pytest.fixture(scope="module")
def on_the_fly(flux_tiny) -> dict:
    """One process, quantized while loading (``parallelize(..., quant=mode)`` on the original pipeline)."""
    return quant_runs(flux_tiny, {}, CALL)


def test_written_folder_holds_8bit_weights_and_the_rest_unchanged(flux_tiny, written):
    from diffusers import FluxTransformer2DModel
    from safetensors import safe_open

    from ditmesh.parallel.quant import QuantLinear, apply
    from ditmesh.models import adapter_for

    folder = written["fp8"]
    from ditmesh.shared import current_umask

    for name in ("diffusion_pytorch_model.safetensors", "ditmesh_quant.json", "config.json"):  # as the umask says
        assert os.stat(os.path.join(folder, "transformer", name)).st_mode & 0o777 == 0o666 & ~current_umask(), name
    manifest = json.loads(open(os.path.join(folder, "transformer", "ditmesh_quant.json")).read())
    assert manifest["mode"] == "fp8" and manifest["quant_modulation"] is True and manifest["dtype"] == "float32"
    with safe_open(os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for layer in manifest["layers"]:
            assert f"{layer}.weight" not in keys  # only the 8-bit values and their scales
            assert f.get_tensor(f"{layer}.qweight").dtype == torch.float8_e4m3fn
            assert f.get_tensor(f"{layer}.scale").dtype == torch.float32
        assert f.get_tensor("proj_out.weight").dtype == torch.float32  # outside the blocks: as it was
    assert len(manifest["layers"]) == 40
    # bitwise the values quantizing the original while loading gives
    model = FluxTransformer2DModel.from_pretrained(flux_tiny, subfolder="transformer", torch_dtype=torch.float32)
    apply(model, adapter_for(model), "fp8", backend="emulated")
    with safe_open(os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"), "pt") as f:
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                assert torch.equal(f.get_tensor(f"{name}.qweight").view(torch.uint8), m.qweight.view(torch.uint8))
                assert torch.equal(f.get_tensor(f"{name}.scale"), m.scale) and manifest["layers"][name] == m.mode
    with safe_open(os.path.join(written["int8-weight"], "transformer", "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert f.get_tensor("transformer_blocks.0.ff.net.2.qweight").dtype == torch.int8
    for same in ("model_index.json", "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"):
        assert open(os.path.join(folder, same), "rb").read() == open(os.path.join(flux_tiny, same), "rb").read()


def test_one_process_equals_quantizing_while_loading(written, on_the_fly):
    # the same 8-bit values and scales (bitwise: test_written_...); the products differ by float32 rounding only,
    # as the weights' buffers sit at other memory alignments (CPU matrix kernels pick their path by alignment)
    for mode in MODES:
        got = checkpoint_runs({mode: written[mode]}, {}, CALL)[mode]
        assert rel_err(got["latents"], on_the_fly[mode]["latents"]) <= (FP8_BOUND if mode == "fp8" else 1e-5), mode
        assert got["held"]["transformer_blocks.0.ff.net.2"][1] == (torch.int8 if mode == "int8-weight"
                                                                      else torch.float8_e4m3fn)


def test_a_tp_rank_reads_only_its_8bit_slices(written, monkeypatch):
    from ditmesh.parallel import tensor
    from ditmesh.parallel.quant import load_quantized_transformer

    reads = []
    read = tensor.MetaLoad.read

    def spy(self, name, dim=None, ranges=None, keep_dtype=False):
        t = read(self, name, dim, ranges, keep_dtype)
        reads.append((name, tuple(t.shape), t.dtype))
        return t

    monkeypatch.setattr(tensor.MetaLoad, "read", spy)
    model = load_quantized_transformer(written["fp8"], "transformer", "cpu", torch.float32, tp_rank=1, tp_size=2)
    layers = json.loads(open(os.path.join(written["fp8"], "transformer", "ditmesh_quant.json")).read())["layers"]
    by_name = {name: (shape, dtype) for name, shape, dtype in reads}
    assert not any(f"{layer}.weight" in by_name for layer in layers)  # never the weights in the model's dtype
    ff_in, ff_out = "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2"  # column-, row-parallel
    from safetensors import safe_open

    with safe_open(os.path.join(written["fp8"], "transformer", "diffusion_pytorch_model.safetensors"), "pt") as f:
        full_in, full_out = (tuple(f.get_slice(f"{n}.qweight").get_shape()) for n in (ff_in, ff_out))
    assert by_name[f"{ff_in}.qweight"] == ((full_in[0] // 2, full_in[1]), torch.float8_e4m3fn)  # half its rows
    assert by_name[f"{ff_in}.scale"][0] == (full_in[0] // 2, 1)  # their scales only
    assert by_name[f"{ff_out}.qweight"][0] == (full_out[0], full_out[1] // 2)  # half its columns
    assert by_name[f"{ff_out}.scale"][0] == (full_out[0], 1)  # every row's scale
    assert model.transformer_blocks[0].ff.net[0].proj.out_features == full_in[0] // 2
    assert all(dtype in (torch.float8_e4m3fn, torch.float32) for dtype in (d for _, _, d in reads))


@pytest.mark.parametrize("config", [{"tp": 2}, {"ulysses": 2}], ids=["tp2", "ulysses2"])
def test_parallel_runs_equal_one_process(pools, written, on_the_fly, config):
    modes = MODES if "tp" in config else ("fp8",)
    results = pools(2).run(checkpoint_runs, {m: written[m] for m in modes}, config, CALL)
    for mode in modes:
        errors = [rel_err(r[mode]["latents"], on_the_fly[mode]["latents"]) for r in results]
        if mode == "fp8":
            worst, count = compare_scales(on_the_fly[mode], [r[mode] for r in results])
            assert count > 0 and worst <= FP8_SCALE_BOUND and max(errors) <= FP8_BOUND, (worst, errors)
        else:
            assert max(errors) <= 1e-5, (mode, errors)
    if "tp" in config:
        held = [r["fp8"]["held"]["transformer_blocks.0.ff.net.2"][0] for r in results]
        whole = on_the_fly["fp8"]["held"]["transformer_blocks.0.ff.net.2"][0]
        assert held[0] == held[1] == (whole[0], whole[1] // 2)  # each rank half the columns


def test_generate_runs_the_checkpoint_in_its_mode(written, flux_tiny, tmp_path):
    """From the command line: the written folder runs without --quant, as --quant on the original does."""
    from safetensors.torch import load_file

    from ditmesh.cli import main

    for model, extra, name in ((written["int8-weight"], [], "q"), (flux_tiny, ["--quant", "int8-weight"], "o")):
        assert main(["generate", "--model", model, *extra, "--steps", "2", "--height", "64", "--width", "64",
                     "--out", str(tmp_path / f"{name}.png"), "--save-latents", str(tmp_path / f"{name}.st")]) == 0
    assert rel_err(load_file(tmp_path / "q.st")["latents"], load_file(tmp_path / "o.st")["latents"]) <= 1e-5
    report = json.loads((tmp_path / "q.png.json").read_text())
    assert '"int8-weight"' in json.dumps(report)


def test_refusals_are_one_line_before_torch(written, flux_tiny, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (["quantize", "--model", flux_tiny, "--out", str(tmp_path / "a")], "no --quant: quantize writes one of fp8"),
        (["quantize", "--model", flux_tiny, "--out", str(tmp_path / "a"), "--quant", "off"], "--quant off: quantize"),
        (["quantize", "--model", flux_tiny, "--out", str(tmp_path / "full"), "--quant", "fp8"],
         "exists and is not an empty folder"),
        (["quantize", "--model", written["fp8"], "--out", str(tmp_path / "a"), "--quant", "fp8"], "already quantized"),
        (["quantize", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "a"), "--quant", "fp8"],
         "nothing"),
        (["quantize", "--model", flux_tiny, "--out", str(tmp_path / "a"), "--quant", "fp8", "--dtype", "fp64"],
         "--dtype fp64 is not one of"),
        (["generate", "--model", written["fp8"], "--quant", "int8-weight"],
         "--quant int8-weight: " + written["fp8"] + " was written by `ditmesh quantize` in fp8; drop --quant or give fp8"),
        (["generate", "--model", written["fp8"], "--nproc", "2", "--pp", "2"], "PipeFusion (pp=2) does not load"),
        (["generate", "--model", written["fp8"], "--lora", str(tmp_path / "full" / "x")],
         "--lora adapters do not load on a checkpoint of 8-bit weights"),
    ]
    code = ("import sys; from ditmesh.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for argv, needle in cases:
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            (argv, proc.returncode, proc.stderr)
    assert not (tmp_path / "a").exists()


def test_a_failed_write_leaves_nothing(flux_tiny, tmp_path, monkeypatch):
    from ditmesh.parallel import quant
    from ditmesh.quantize import quantize_pipeline

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(quant, "save_quantized", broken)
    with pytest.raises(OSError, match="disk full"):
        quantize_pipeline(flux_tiny, tmp_path / "out", "fp8", True, "float32", log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_parallelize_refuses_another_mode_than_the_checkpoints(written):
    from diffusers import DiffusionPipeline

    from ditmesh import ConfigError, ParallelConfig, parallelize
    from ditmesh.parallel.quant import load_quantized_transformer

    pipe = DiffusionPipeline.from_pretrained(written["fp8"], dtype=torch.float32, transformer=None)
    pipe.register_modules(transformer=load_quantized_transformer(written["fp8"], "transformer", "cpu", torch.float32))
    with pytest.raises(ConfigError, match="written by `ditmesh quantize` in fp8; use quant=fp8"):
        parallelize(pipe, ParallelConfig(), quant="int8-weight")
