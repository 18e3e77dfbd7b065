"""``RunOptions``: one description of a run, built by one constructor from every entry point, checked in one place."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from ditmesh import ConfigError, ParallelConfig, RunOptions
from ditmesh.options import CacheConfig, LoraSpec


def test_defaults_describe_a_plain_run_and_the_object_is_frozen():
    options = RunOptions.create()
    assert options == RunOptions() and options.describe() == "single" and not options.stale
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.compile = True
    assert options.as_dict()["degrees"] == ParallelConfig().as_dict()


def test_create_reads_typed_forms_and_replace_checks_again():
    options = RunOptions.create(ParallelConfig(ulysses=2), cache="fbcache:0.1", chunk_tokens="4096",
                                vae_chunk="auto", loras=["style=a/b:0.5"])
    assert options.cache == CacheConfig.parse("fbcache:0.1") and options.chunk_tokens == 4096
    assert options.vae_chunk == "auto" and options.loras == (LoraSpec("a/b", 0.5, "style"),)
    assert options.describe() == ("ulysses2 cache=dbcache:threshold=0.1,first=1,last=0,warmup=1,max_skips=3 "
                                  "chunk_tokens=4096 vae_chunk=auto loras=style=a/b:0.5")
    assert options.replace(compile=True).compile and options.replace(compile=True).loras == options.loras
    with pytest.raises(ConfigError, match="displaced attention needs ulysses > 1"):
        options.replace(config=ParallelConfig(), cache=None, displaced=True)
    with pytest.raises(TypeError, match="unknown run option"):
        RunOptions.create(compiled=True)


@pytest.mark.parametrize("text, spec", [
    ("a.safetensors", LoraSpec("a.safetensors")),
    ("a.safetensors:0.8", LoraSpec("a.safetensors", 0.8)),
    ("owner/name", LoraSpec("owner/name")),
    ("ink=owner/name:2", LoraSpec("owner/name", 2.0, "ink")),
    ("dir/x=y.safetensors", LoraSpec("dir/x=y.safetensors")),  # an '=' after a path separator is part of the path
    ("C:\\loras\\a.safetensors", LoraSpec("C:\\loras\\a.safetensors")),
])
def test_lora_texts_parse_with_optional_name_and_scale(text, spec):
    assert LoraSpec.parse(text) == spec and LoraSpec.parse(spec.describe()) == spec


@pytest.mark.parametrize("values, message", [
    ({"transport": "shm"}, "transport='shm' is not a transport; use one of nccl, symm"),
    ({"vae_parallel": "sideways"}, "vae_parallel='sideways' is not a mode"),
    ({"chunk_tokens": 0}, "chunk_tokens=0 is not a token count"),
    ({"ulysses_chunks": 0}, "ulysses_chunks=0 must be >= 1"),
    ({"quant": "fp4"}, "quant='fp4' is not a quantization mode"),
    ({"comm_dtype": "int4"}, "comm_dtype='int4' is not a communication dtype"),
    ({"fuse_lora": True}, "fuse_lora is given without loras"),
    ({"loras": ["a=x.safetensors", "a=y.safetensors"]}, "the adapter name 'a' is given twice"),
    ({"loras": ["missing.safetensors"]}, "loras=missing.safetensors: no such file or folder"),
    ({"loras": ["bad name=owner/x"]}, "the name 'bad name' may hold letters"),
    ({"displaced_warmup": 2}, "displaced_warmup=2 is given without displaced"),
    ({"compile": "yes"}, "compile='yes' is not true or false"),
    ({"config": ParallelConfig(cfg=2), "cuda_graph": True}, "CUDA graphs do not run with dp=1, cfg=2"),
    ({"cuda_graph": True, "check_consistency": True}, "CUDA graphs do not run with the consistency check"),
    ({"config": ParallelConfig(pp=2), "cache": "teacache:0.2"}, r"cache teacache does not run with PipeFusion \(pp=2\)"),
    ({"config": ParallelConfig(pp=2), "pp_patches": 1}, "pp_patches=1 is fewer than the pp=2 stages"),
    ({"config": ParallelConfig(ring=2), "transport": "symm"}, "transport=symm moves Ulysses all-to-alls only"),
    ({"config": ParallelConfig(pp=2), "attention": "fp8-emulated"},
     "attention=fp8-emulated runs on one process or under ulysses alone, and pp=2 merges partial attention"),
    ({"config": ParallelConfig(ulysses=2), "displaced": True, "attention": "fp8-emulated"},
     "and displaced merges partial attention"),
])
def test_every_refusal_is_one_line_naming_the_value(values, message):
    values = dict(values)
    config = values.pop("config", None)
    with pytest.raises(ConfigError, match=message) as error:
        RunOptions.create(config, **values)
    assert "\n" not in str(error.value)


def test_messages_name_the_command_line_flags_when_built_from_a_command_line():
    with pytest.raises(ConfigError, match="--pp-warmup 0 must be >= 1"):
        RunOptions.create(ParallelConfig(pp=2), pp_warmup=0, cli=True)
    with pytest.raises(ConfigError, match="--chunk 'lots' is not a token count"):
        RunOptions.create(chunk_tokens="lots", cli=True)


def test_device_and_model_checks_need_their_facts():
    import torch

    graphed = RunOptions.create(cuda_graph=True)  # fine without a device
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device, but this rank runs on cpu"):
        graphed.validate(device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="tp=5 does not divide the 24 attention heads of FluxTransformer2DModel"):
        RunOptions.create(ParallelConfig(tp=5)).validate(heads=24, model_name="FluxTransformer2DModel")


def test_family_refusals_come_from_the_adapter():
    from ditmesh.models import adapter_for_class

    sana = adapter_for_class("SanaTransformer2DModel")
    with pytest.raises(NotImplementedError, match="displaced attention does not run sana"):
        RunOptions.create(ParallelConfig(ulysses=2), displaced=True).validate(adapters=[sana])
    zimage = adapter_for_class("ZImageTransformer2DModel")
    with pytest.raises(NotImplementedError, match="PipeFusion does not run zimage"):
        RunOptions.create(ParallelConfig(pp=2)).validate(adapters=[zimage])


def test_family_allows_reads_the_refusals():
    from ditmesh.models import adapter_for_class
    from ditmesh.options import displaced_refusal, family_allows, pipefusion_refusal

    flux, zimage, sana = (adapter_for_class(c) for c in ("FluxTransformer2DModel", "ZImageTransformer2DModel",
                                                         "SanaTransformer2DModel"))
    assert family_allows(pipefusion_refusal, flux) and not family_allows(pipefusion_refusal, zimage)
    assert family_allows(displaced_refusal, flux) and not family_allows(displaced_refusal, sana)


# -- the five entry points build it the same way ---------------------------------------------------------------------
def _refused(argv: list[str], needle: str) -> None:
    """Run ``ditmesh ARGV`` in a fresh interpreter: it exits 2 with one line holding ``needle``, before torch loads."""
    code = ("import sys; from ditmesh.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded'); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and needle in lines[0], done.stderr
    return done.stdout.strip()


def test_generate_and_serve_refuse_an_option_before_torch_loads():
    assert _refused(["generate", "--vae-parallel", "sideways"], "--vae-parallel 'sideways' is not a mode") \
        == "torch not loaded"
    assert _refused(["serve", "--pp", "2", "--nproc", "2", "--pp-warmup", "0"], "--pp-warmup 0 must be >= 1") \
        == "torch not loaded"


def test_the_local_launcher_refuses_degrees_the_heads_forbid_before_torch_or_any_rank(flux_tiny):
    # the heads from the registry's table (a synthetic architecture) or the folder's transformer config: no rank of
    # the 32 starts (each would import torch and diffusers to find the same refusal)
    assert _refused(["generate", "--model", "flux-dev", "--nproc", "32", "--ulysses", "32"],
                    "ulysses=32 exceeds the 24 attention heads of FluxTransformer2DModel") == "torch not loaded"
    assert _refused(["generate", "--model", flux_tiny, "--nproc", "8", "--tp", "2", "--ulysses", "4"],
                    "ulysses=4 exceeds the 3 heads each tp=2 rank holds of FluxTransformer2DModel") == "torch not loaded"


def test_plan_builds_the_options_generate_builds():
    _refused(["plan", "--model", "flux-dev", "--gpus", "4", "--chunk", "0"], "--chunk 0 is not a token count")


def test_bench_checks_its_options_through_run_options(monkeypatch, capsys):
    from ditmesh.cli import main

    built = []
    create = RunOptions.create.__func__
    monkeypatch.setattr(RunOptions, "create", classmethod(lambda cls, *a, **k: built.append(k) or create(cls, *a, **k)))
    assert main(["bench", "--transport", "shm"]) == 2
    assert "--transport 'shm' is not a transport" in capsys.readouterr().err
    assert built and built[0]["transport"] == "shm"


def test_the_python_api_reads_the_options_it_is_given(flux_tiny):
    from diffusers import DiffusionPipeline

    from ditmesh import parallelize

    pipe = DiffusionPipeline.from_pretrained(flux_tiny)
    options = RunOptions.create(vae_parallel="off", chunk_tokens=64)
    runtime = parallelize(pipe, options)
    assert runtime.options is options and any(step.startswith("chunk(64)") for step in runtime.applied)
    runtime.remove()
    with pytest.raises(TypeError, match="takes the options in the RunOptions"):
        parallelize(pipe, options, compile=True)
    runtime = parallelize(pipe, ParallelConfig(), chunk_tokens=64)  # the keyword form builds the same object
    assert runtime.options == options.replace(vae_parallel="auto")
    runtime.remove()
    with pytest.raises(ConfigError, match="chunk_tokens=0 is not a token count"):
        parallelize(pipe, ParallelConfig(), chunk_tokens=0)


def test_a_plan_writes_options_that_run():
    from ditmesh.planner import plan

    base = RunOptions.create(compile=True, chunk_tokens=4096)
    result = plan("flux-dev", 1024, 1024, 4, options=base)
    chosen = result.best.options(base)
    assert chosen.config == result.best.config and chosen.chunk_tokens == 4096 and chosen.compile
    assert result.workload.mode == "compiled"


@pytest.mark.parametrize("name,sizes,mode,modulation,chosen", [
    ("transformer_blocks.0.ff.net.2", (12288, 3072), "fp8", True, "fp8"),
    ("transformer_blocks.0.ff.net.2", (12288, 3072), "int8-weight", True, "int8-weight"),
    ("transformer_blocks.0.ff_context.net.2", (12288, 3072), "fp8", True, "fp8-weight"),  # wide text input: pytorch/ao#4582
    ("transformer_blocks.0.ff_context.net.2", (8192, 3072), "fp8", True, "fp8-weight"),  # the bound itself
    ("transformer_blocks.0.ff_context.net.2", (8176, 3072), "fp8", True, "fp8"),  # one multiple of 16 below
    ("transformer_blocks.0.ff_context.net.2", (12288, 3072), "fp8-weight", True, "fp8-weight"),
    ("transformer_blocks.0.norm1.linear", (3072, 18432), "fp8", True, "fp8"),
    ("transformer_blocks.0.norm1.linear", (3072, 18432), "fp8", False, None),  # modulation kept
    ("transformer_blocks.0.attn.to_q", (3072, 3072), "fp8", False, "fp8"),
    ("transformer_blocks.0.attn.to_q", (3072, 3080), "fp8", True, None),  # not a multiple of 16
    ("transformer_blocks.0.attn.to_q", (3080, 3072), "int8-weight", True, None),
    ("transformer_blocks.0.attn.to_q", (3072, 3072), "off", True, None),
])
def test_quant_layer_mode_picks_each_linears_mode(name, sizes, mode, modulation, chosen):
    from ditmesh.options import quant_layer_mode

    assert quant_layer_mode(name, *sizes, mode, modulation) == chosen
