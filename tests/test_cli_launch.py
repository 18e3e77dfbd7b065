"""`ditmesh generate` as a new user meets it: errors from every rank as one line, Ctrl-C, clean temporary
folders, several hosts (two launcher agents on this machine meeting at a c10d rendezvous), and fast
argument errors. Every case runs the real CLI in real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import kill_session
from ditmesh.testing import free_port, rel_err


def ditmesh(*argv, env=None, timeout=300, **kwargs):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ditmesh", *argv], capture_output=True, text=True, timeout=timeout,
                          env=full_env, **kwargs)


def error_lines(stderr: str) -> list[str]:
    """stderr without progress bars: the lines a user reads."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line
            and "s/it]" not in line and not line.startswith(("Loading", "denoising"))]


@pytest.fixture
def private_tmp(tmp_path):
    """A TMPDIR of its own, to see what a run leaves behind."""
    path = tmp_path / "tmpdir"
    path.mkdir()
    return path


def leftovers(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(("torchelastic_", "ditmesh-")))


# -- errors answered before anything loads ----------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--guidance", "nan"], "--guidance: nan is not a finite number"),
    (["--true-cfg-scale", "inf"], "--true-cfg-scale: inf is not a finite number"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--out", "/proc/no/x.png"], "--out /proc/no/x.png: cannot write there"),
])
def test_argument_errors_import_neither_torch_nor_diffusers(argv, needle):
    code = ("import sys; from ditmesh.cli import main; rc = main(['generate', *sys.argv[1:]]); "
            "print(rc, 'torch' in sys.modules, 'diffusers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    out = proc.stdout.strip().splitlines()
    if proc.returncode == 2:  # argparse exits itself
        assert out == []
    else:
        assert out[-1] == "2 False False"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and needle in lines[0]


def test_help_imports_neither_torch_nor_diffusers():
    code = ("import sys\nfrom ditmesh.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'diffusers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "False False"
    assert "bench" in proc.stdout and "eval-tiny" in proc.stdout


def test_a_pipeline_ditmesh_cannot_run_is_refused_from_its_model_index(tmp_path, capsys):
    from ditmesh.cli import main
    from ditmesh.models.registry import NOT_ADAPTED

    unet = tmp_path / "sd15"
    unet.mkdir()
    (unet / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                      "unet": ["diffusers", "UNet2DConditionModel"]}))
    other = tmp_path / "other-dit"
    (other / "transformer").mkdir(parents=True)
    (other / "model_index.json").write_text(json.dumps({"_class_name": "SomeDiTPipeline",
                                                       "transformer": ["diffusers", "SomeDiTTransformer2DModel"]}))
    (other / "transformer" / "config.json").write_text(json.dumps({"_class_name": "SomeDiTTransformer2DModel"}))
    cases = [(unet, "StableDiffusionPipeline has no transformer"), (other, "no adapter for SomeDiTTransformer2DModel")]
    for name, why in list(NOT_ADAPTED.items())[:1]:  # a DiT diffusers ships that has no adapter yet: why, in one line
        waiting = tmp_path / "waiting"
        (waiting / "transformer").mkdir(parents=True)
        (waiting / "model_index.json").write_text(json.dumps({"_class_name": "WaitingPipeline",
                                                             "transformer": ["diffusers", name]}))
        (waiting / "transformer" / "config.json").write_text(json.dumps({"_class_name": name}))
        cases.append((waiting, f"no adapter for {name} yet: {why[:40]}"))
    # refused by the launcher from the JSON files, before any rank starts (without torch: tests/test_registry.py)
    for model, needle in cases:
        assert main(["generate", "--model", str(model), "--nproc", "2", "--ulysses", "2"]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_reports_keep_guidance_and_one_report_per_output_file():
    from ditmesh.runtime.generate import default_report_path

    assert default_report_path(Path("out/cat.gif")) != default_report_path(Path("out/cat.mp4"))
    assert default_report_path(Path("out/cat.png")) == "out/cat.png.json"


# -- errors inside ranks, Ctrl-C, temporary folders -------------------------------------------------------------
@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_an_error_inside_the_ranks_is_one_line_and_exit_2(tmp_path, flux_tiny, private_tmp, launch):
    """Forked ranks (the default) and ranks that are their own interpreters (``DITMESH_LAUNCH=exec``)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(flux_tiny, broken)
    weights = next((broken / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download
    proc = ditmesh("generate", "--model", str(broken), "--nproc", "2", "--ulysses", "2", "--steps", "1",
                   "--out", str(tmp_path / "x.png"), env={"TMPDIR": str(private_tmp), "DITMESH_LAUNCH": launch})
    assert proc.returncode == 2
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("ditmesh: error:") and "safetensors" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "x.png").exists()
    assert leftovers(private_tmp) == []


def test_an_unknown_launch_way_is_one_line_and_exit_2(tmp_path, flux_tiny, private_tmp):
    proc = ditmesh("generate", "--model", flux_tiny, "--nproc", "2", "--ulysses", "2", "--steps", "1",
                   "--out", str(tmp_path / "x.png"), env={"TMPDIR": str(private_tmp), "DITMESH_LAUNCH": "spawn"})
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == ["ditmesh: error: DITMESH_LAUNCH='spawn': give fork (the default: ranks forked "
                                        "from one import) or exec (each rank its own interpreter)"], proc.stderr
    assert not (tmp_path / "x.png").exists() and leftovers(private_tmp) == []


def test_an_import_that_fails_before_the_fork_is_one_line_and_exit_2(tmp_path, flux_tiny, private_tmp):
    """The one process the ranks are forked from cannot import diffusers (a module that shadows it): its error is
    the run's, once, and nothing is left running or written."""
    shadow = tmp_path / "site" / "diffusers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('diffusers shadowed by the test')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")) if p)
    out = tmp_path / "x.png"
    proc = ditmesh("generate", "--model", flux_tiny, "--nproc", "2", "--ulysses", "2", "--steps", "1",
                   "--out", str(out), env={"TMPDIR": str(private_tmp), "PYTHONPATH": path})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = error_lines(proc.stderr)
    assert lines == ["ditmesh: error: diffusers shadowed by the test (ImportError on rank 0; traceback in "
                     + lines[0].split("traceback in ", 1)[-1]], proc.stderr[-2000:]
    assert not out.exists() and _ranks_running(str(out)) == 0
    assert leftovers(private_tmp) == []


# while the one process the ranks are forked from imports, and while the ranks run (the second started as a shell
# starts a background job: SIGINT ignored, which children inherit; the command takes SIGINT back); a SIGTERM to the
# launcher alone (as `docker stop` or systemd send it); a rank killed by a signal
@pytest.mark.parametrize("case, running, background, code", [
    ("ctrl-c", False, False, 130), ("ctrl-c", True, True, 130), ("sigterm", True, False, 143),
    ("rank-killed", True, False, 2)], ids=["importing", "running-background", "sigterm-to-launcher", "rank-killed"])
def test_ctrl_c_ends_every_rank_quietly_with_130(tmp_path, flux_tiny, private_tmp, case, running, background, code):
    cmd = [sys.executable, "-m", "ditmesh", "generate", "--model", flux_tiny, "--nproc", "2", "--ulysses", "2",
           "--steps", "100000", "--out", str(tmp_path / "never.png")]
    ignored = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(private_tmp)), preexec_fn=ignored)
    try:
        deadline = time.time() + 120
        started = False
        # the launcher and the importing zygote (2), then the launcher and its 2 forked ranks (3)
        while time.time() < deadline and not started:
            time.sleep(0.05)
            started = _ranks_running(str(tmp_path / "never.png")) == (3 if running else 2)
        assert started
        time.sleep(1.0 if running else 0.0)
        if case == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground group
        elif case == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            ranks = [int(p) for p in subprocess.run(["pgrep", "-f", str(tmp_path / "never.png")], capture_output=True,
                                                    text=True).stdout.split() if int(p) != proc.pid]
            os.kill(max(ranks), signal.SIGKILL)  # the last rank forked
        _, stderr = proc.communicate(timeout=60)
        orphans = _ranks_running(str(tmp_path / "never.png"))  # before the session is killed below
    finally:  # a run the signal did not end would run its 100000 steps beside every later test
        kill_session(proc)
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr and len(error_lines(stderr)) <= 1, stderr[-2000:]
    if case == "rank-killed":
        assert re.search(r"ditmesh: error: rank [01] exited with code -9: killed by SIGKILL \(out of memory, or "
                         r"killed from outside\); the other ranks were stopped", stderr), stderr[-2000:]
    assert orphans == 0
    assert leftovers(private_tmp) == []


def _ranks_running(marker: str) -> int:
    """Processes whose command line holds ``marker`` (a path unique to one run)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return len(out.split())


# -- several hosts, simulated -----------------------------------------------------------------------------------
def _hosts(tmp_path, model, degrees, name, nnodes=2, joined=2, timeout=60):
    """``joined`` launcher agents of ``nnodes`` hosts x 2 processes meeting at one c10d endpoint."""
    port = free_port()
    out = tmp_path / f"{name}.png"
    cmd = [sys.executable, "-m", "ditmesh", "generate", "--model", model, "--nproc", "2", "--nnodes", str(nnodes),
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", str(timeout), "--steps", "2", *degrees,
           "--prompt", "a red circle", "--prompt", "a blue square", "--out", str(out),
           "--save-latents", str(tmp_path / f"{name}.safetensors")]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(joined)]
    results = [p.communicate(timeout=300) for p in procs]
    return procs, results, out


#: the one-process latents of the two-prompt run, by checkpoint
_ONE_PROCESS: dict[str, object] = {}


# one layout: each pair of hosts costs four interpreters started by torch's elastic agent (about 45 s of the 2-core
# machine); tp inside a host and ring across the two is the layout with traffic both ways. That the innermost active
# axis takes consecutive ranks (so a host holds whole groups of it) is the mesh's one rule, checked for ulysses in
# tests/test_ring_usp.py (its groups' ranks); ulysses x dp over two hosts ran here as well until 2026-12-02.
@pytest.mark.parametrize("degrees, inner", [(["--tp", "2", "--ring", "2"], "tp")])
def test_two_hosts_match_one_process_and_keep_inner_groups_on_a_host(tmp_path_factory, tmp_path, flux_tiny, degrees,
                                                                     inner):
    if flux_tiny not in _ONE_PROCESS:  # the reference both layouts compare with, run once
        folder = tmp_path_factory.mktemp("one")
        one = ditmesh("generate", "--model", flux_tiny, "--steps", "2", "--prompt", "a red circle", "--prompt",
                      "a blue square", "--out", str(folder / "one.png"), "--save-latents", str(folder / "one.safetensors"))
        assert one.returncode == 0, one.stderr[-2000:]
        _ONE_PROCESS[flux_tiny] = load_file(str(folder / "one.safetensors"))["latents"]
    procs, results, out = _hosts(tmp_path, flux_tiny, degrees, inner)
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    ref = _ONE_PROCESS[flux_tiny]
    got = load_file(str(tmp_path / f"{inner}.safetensors"))["latents"]
    assert rel_err(got, ref) <= 1e-5
    report = json.loads(out.with_name(out.name + ".json").read_text())
    placement = report["placement"]
    assert sorted(p["node"] for p in placement) == [0, 0, 1, 1]
    groups: dict = {}
    for p in placement:  # ranks that differ only along the inner axis form one inner group
        key = tuple(v for axis, v in sorted(p["coords"].items()) if axis != inner)
        groups.setdefault(key, set()).add(p["node"])
    assert len(groups) == 2 and all(len(nodes) == 1 for nodes in groups.values())


def test_a_host_that_never_joins_ends_the_run_with_one_line(tmp_path, flux_tiny):
    start = time.time()
    procs, results, _ = _hosts(tmp_path, flux_tiny, ["--ulysses", "2", "--dp", "2"], "alone", joined=1, timeout=5)
    assert time.time() - start < 60
    assert procs[0].returncode == 2
    lines = error_lines(results[0][1])
    assert len(lines) == 1 and "not all 2 hosts joined the rendezvous" in lines[0]


# -- compile caches and warm-up ---------------------------------------------------------------------------------
def test_compile_caches_live_under_the_ditmesh_cache_unless_the_user_set_them(tmp_path, monkeypatch):
    from ditmesh.runtime.generate import COMPILE_CACHE_ENV, persist_compile_caches

    monkeypatch.setenv("DITMESH_CACHE", str(tmp_path))
    for env in COMPILE_CACHE_ENV:  # set, then removed: monkeypatch puts back what the session had after the test
        monkeypatch.setenv(env, "")
        monkeypatch.delenv(env)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    used = persist_compile_caches()
    assert used["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert used["TRITON_CACHE_DIR"] == "/mine"


def test_warmup_only_runs_one_step_and_writes_nothing(tmp_path, flux_tiny, private_tmp):
    """... from a launcher that imports neither torch nor diffusers (the ranks start at once and import them)."""
    out = tmp_path / "never.png"
    code = ("import sys; from ditmesh.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules, 'diffusers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, "generate", "--model", flux_tiny, "--nproc", "2", "--ulysses",
                           "2", "--warmup-only", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(private_tmp)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0 False False", proc.stdout
    assert "warmed up ulysses2 on 2 processes at 64x64" in proc.stdout
    assert not out.exists() and not out.with_name(out.name + ".json").exists()
    assert leftovers(private_tmp) == []
