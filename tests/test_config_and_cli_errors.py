"""Configuration validation and the CLI's one-line errors."""

from __future__ import annotations

import pytest

from ditmesh import ConfigError, ParallelConfig
from ditmesh.cli import main


def test_config_defaults_and_product():
    c = ParallelConfig(ulysses=2, tp=2, cfg=2)
    assert c.world_size == 8 and c.sp == 2 and c.describe() == "cfg2 x ulysses2 x tp2"
    assert ParallelConfig().describe() == "single" and ParallelConfig().active_axes() == []


@pytest.mark.parametrize("kwargs,message", [
    ({"ulysses": 0}, "ulysses=0 must be >= 1"),
    ({"tp": -2}, "tp=-2 must be >= 1"),
    ({"ring": 1.5}, "ring=1.5 is not an integer"),
    ({"cfg": 3}, "cfg=3 is not supported"),
])
def test_config_rejects_bad_degrees(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(Exception):
        ParallelConfig().ulysses = 2


def test_config_checks_world_size_and_heads():
    with pytest.raises(ConfigError, match="multiply to 4, but there are 2 processes"):
        ParallelConfig(ulysses=4).check_world_size(2)
    with pytest.raises(ConfigError) as none_set:  # no "the degrees single multiply to 1"
        ParallelConfig().check_world_size(2)
    assert str(none_set.value).startswith("every degree is 1 (one process's work), but there are 2 processes")
    assert str(none_set.value).endswith("(e.g. --ulysses 2)")
    with pytest.raises(ConfigError, match="ulysses=32 exceeds the 24 attention heads of Flux"):
        ParallelConfig(ulysses=32).check_heads(24, "FluxTransformer2DModel")
    with pytest.raises(ConfigError, match=r"tp=5 does not divide the 24 attention heads .* valid: 1, 2, 3, 4, 6, 8, 12, 24"):
        ParallelConfig(tp=5).check_heads(24, "FluxTransformer2DModel")
    ParallelConfig(ulysses=5).check_heads(24, "FluxTransformer2DModel")  # uneven head split is supported


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--nproc", "2", "--ulysses", "4"], "multiply to 4, but there are 2 processes"),
    (["generate", "--ulysses", "0"], "ulysses=0 must be >= 1"),
    (["generate", "--model", "/no/such/folder"], "--model /no/such/folder: no such folder"),
    (["generate", "--model", "flux-dev", "--nproc", "32", "--ulysses", "32"], "exceeds the 24 attention heads"),
    (["generate", "--model", "flux-tiny", "--nproc", "4", "--tp", "4"], "tp=4 does not divide the 6 attention heads"),
    (["generate", "--height", "50"], "--height 50 must be a positive multiple of 16"),
    (["generate", "--nproc", "two"], "argument --nproc"),
    (["synth", "--arch", "flux-huge", "--out", "x"], "unknown architecture 'flux-huge'; known: "),
])
def test_cli_bad_input_gives_one_line_error_and_nonzero_exit(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) if "two" in argv else _nothing():
        code = main(argv)
        assert code != 0
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_cli_missing_model_folder_content(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--model", str(tmp_path / "empty")]) == 2
    assert "has no model_index.json" in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--out", "x.txt"], "--out x.txt: unknown image or audio format"),
    (["generate", "--max-sequence-length", "-5"], "--max-sequence-length -5 must be >= 1"),
    (["generate", "--model", "flux-tiny", "--nproc", "8", "--tp", "2", "--ulysses", "4"],
     "ulysses=4 exceeds the 3 heads each tp=2 rank holds"),
    (["synth", "--arch", "flux-tiny", "--out", "s", "--dtype", "bogus"], "--dtype 'bogus' is not one of"),
    (["synth", "--out", "s"], "synth needs --arch NAME and --out DIR (ditmesh synth --list names the architectures)"),
    (["eval-tiny", "--pp-sweep", "pp=0"], "--pp-sweep setting 'pp=0': give pp >= 1"),
    (["eval-tiny", "--pp-sweep", "displaced=1"], "displaced must be >= 2 ranks"),
    (["eval-tiny", "--cache-sweep", "bogus"], "--cache-sweep setting 'bogus': cache policy 'bogus' is not one of"),
    (["analyze", "--schedule", "-1"], "--schedule -1.0: give a positive relative change"),
    (["analyze", "--height", "50"], "--height 50 must be a positive multiple of 16"),
    (["serve", "--step-timeout", "0"], "--step-timeout 0.0 must be > 0 seconds (e.g. 60)"),
    (["plan", "--model", "flux-dev", "--gpus", "4", "--top", "-1"], "--top -1: give 0 (all rows)"),
    (["generate", "--model", "mochi-tiny", "--nproc", "2", "--pp", "2"],
     "PipeFusion does not run mochi yet: every call carries its captions' key-padding mask"),
    (["generate", "--model", "sana-tiny", "--nproc", "2", "--ulysses", "2", "--displaced"],
     "displaced attention does not run sana: its token grid's convolutions and linear attention exchange rows"),
    (["synth", "--arch", "flux-tiny", "--out", "s", "--device", "bogus"], "--device 'bogus' is not a device"),
    (["generate", "--model", "flux-tiny", "--cuda-graph"], "CUDA graphs need a CUDA device, but this rank runs on cpu"),
    (["generate", "--model", "flux-tiny", "--transport", "symm"], "--transport symm needs CUDA GPUs (copy engines), not cpu"),
    (["generate", "--model", "flux-tiny", "--transport", "mpi"], "--transport 'mpi' is not a transport; use one of nccl, symm"),
    (["bench", "--transport", "symm"], "--transport symm needs CUDA GPUs (copy engines), not cpu"),
    (["generate", "--model", "flux-tiny", "--vae-parallel", "yes"], "--vae-parallel 'yes' is not a mode; use one of auto, on, tiled, off"),
    (["generate", "--model", "flux-tiny", "--chunk", "0"], "--chunk '0' is not a token count; give a positive integer"),
    (["generate", "--model", "flux-tiny", "--nproc", "2", "--pp", "2", "--pp-patches", "1"],
     "--pp-patches 1 is fewer than the pp=2 stages"),
    (["generate", "--model", "flux-tiny", "--nproc", "2", "--pp", "2", "--pp-warmup", "0"], "--pp-warmup 0 must be >= 1"),
    (["generate", "--model", "flux-tiny", "--nproc", "2", "--pp", "2", "--cache", "fbcache:0.1"],
     "cache dbcache does not run with PipeFusion (pp=2): its statistic covers the whole image"),
])
def test_more_bad_inputs_fail_before_any_work(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_output_path_that_is_a_folder_is_rejected(tmp_path, capsys):
    assert main(["generate", "--report", str(tmp_path)]) == 2
    assert "is a folder; give a file path" in capsys.readouterr().err


def test_synth_list_names_every_architecture_with_its_description(capsys):
    from ditmesh.synth import ARCHS

    assert main(["synth", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(ARCHS)
    assert all(ARCHS[line.split()[0]].description in line for line in lines)
