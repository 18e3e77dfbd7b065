"""`ditmesh bench` on CPU: flux-tiny over gloo, every row measured and exact against one process; the results
schema, where runs are written, and the temporary folder that every run removes."""

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
from conftest import kill_session
from ditmesh.bench.report import SCHEMA, default_out_dir

ROOT = Path(__file__).resolve().parent.parent


def bench(args: list[str], tmp_path: Path, cwd: Path | None = None, **env) -> subprocess.Popen:
    """Start ``python -m ditmesh bench ARGS`` (in ``cwd``) with its own TMPDIR (``tmp_path/tmp``) and extra ``env``
    (a value None: the variable unset)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in dict(os.environ, TMPDIR=str(tmp_path / "tmp"), **env).items() if v is not None}
    return subprocess.Popen([sys.executable, "-m", "ditmesh", "bench", "--model", "flux-tiny", *args], cwd=cwd,
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def bench_here(args: list[str], tmp_path: Path, monkeypatch) -> int:
    """Run ``bench ARGS`` in this process (a start-up less than :func:`bench`) with ``tmp_path/tmp`` as its and its
    ranks' temporary directory; the variables it sets are given back after the test."""
    import tempfile

    from ditmesh.cli import main

    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the ranks' (and a baseline run's)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # this process's
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # the bench sets it
    return main(["bench", "--model", "flux-tiny", *args])


def leftovers(tmp_path: Path) -> list[Path]:
    """What a run left in its TMPDIR: its own folder, or the launcher's (torch's compile cache may stay)."""
    return [*(tmp_path / "tmp").glob("ditmesh-bench-*"), *(tmp_path / "tmp").glob("torchelastic_*")]


#: the shared run's methods: ours and the two peers on two processes, the displaced row beside ours, and torchao's
#: one-process peer (each row its own launch; the 1-process reference row is shared by all of them)
SMOKE_METHODS = "ulysses,displaced,diffusers-ulysses,xdit-ulysses,torchao-fp8"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One ``bench --gpus 1,2`` run whose rows the tests below read (one start-up and one 1-process reference for
    all of them): xfuser is a module that shadows any installed one, and without --out the run goes to
    $DITMESH_BENCH_DIR from an empty working folder. Returns (its folder, its arguments, the written document)."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    hidden = tmp_path / "site" / "xfuser"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('xfuser hidden by the test')\n")
    paths = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")) if p)
    work = tmp_path / "work"
    work.mkdir()
    args = ["--gpus", "1,2", "--methods", SMOKE_METHODS, "--steps", "1", "--warmup", "1"]
    proc = bench(args, tmp_path, cwd=work, PYTHONPATH=paths, DITMESH_BENCH_DIR=str(tmp_path / "runs"),
                 OMP_NUM_THREADS=None)  # the bench's own thread policy
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, err[-2000:]
    [out] = (tmp_path / "runs").glob("flux-tiny-64x64-*.json")
    assert list(work.iterdir()) == []
    return tmp_path, args, json.loads(out.read_text()), out


def test_bench_smoke_flux_tiny_gloo(smoke):
    """ditmesh's row beside the peers' on two gloo processes: diffusers' fails on CPU and xDiT's without xfuser,
    each row recording why; without --out the run goes to $DITMESH_BENCH_DIR and nothing into the working folder."""
    tmp_path, args, doc, out = smoke
    assert doc["schema"] == SCHEMA
    assert doc["command"] == ["ditmesh", "bench", "--model", "flux-tiny", *args]
    assert doc["card"].startswith("cpu") and doc["device_count"] == 2
    assert {"ditmesh", "python", "torch", "diffusers", "transformers"} <= set(doc["versions"])
    assert (doc["model"], doc["height"], doc["width"], doc["batch"], doc["dtype"]) == ("flux-tiny", 64, 64, 1, "float32")
    assert doc["settings"]["compile"] == "off" and doc["settings"]["gpus"] == [1, 2]
    rows = {(r["method"], r["gpus"]): r for r in doc["rows"]}
    ours = rows[("ulysses", 2)]
    for key in ("method", "gpus", "degrees", "height", "width", "compiled", "step_ms", "e2e_28_steps_s",
                "speedup_vs_1gpu", "efficiency", "peak_gib_per_gpu", "rel_err_vs_1gpu", "card"):
        assert key in ours, key
    assert ours["degrees"] == {"ulysses": 2}
    assert ours["rel_err_vs_1gpu"] <= 1e-5
    assert ours["ulysses_chunks"] == 1  # the head groups it ran with are recorded (one on CPU)
    assert "error" in rows[("diffusers-ulysses", 2)]  # the peer fails on CPU; the row records how
    assert rows[("xdit-ulysses", 2)]["error"] == "ImportError: xfuser hidden by the test"
    # one thread policy: the 1-process reference runs with the threads of each of the 2 ranks, not every core
    from ditmesh.shared import cpu_threads

    assert doc["settings"]["cpu"]["threads_per_rank"] == cpu_threads(2)
    assert {r["cpu_threads"] for r in doc["rows"]} == {cpu_threads(2)} and rows[("single", 1)]["cpu_threads"]
    assert "| ulysses | 2 |" in out.with_suffix(".md").read_text()
    assert leftovers(tmp_path) == []  # the workers' temporary folder is gone


def test_bench_measures_displaced_rows(smoke):
    """``--methods displaced``: displaced attention over 2 ulysses ranks (``parallel.displaced``), its timed step
    stale."""
    rows = {(r["method"], r["gpus"]): r for r in smoke[2]["rows"]}
    displaced = rows[("displaced", 2)]
    assert "error" not in displaced and displaced["degrees"] == {"ulysses": 2} and not displaced["graph"]
    # the timed step is stale, but every bench step has the same inputs (--warmup 1: the last step's K/V are this
    # step's), so the stale attention gives the one-process output
    assert displaced["rel_err_vs_1gpu"] <= 1e-5


def test_torchao_fp8_peer_row_runs_once_on_one_process(smoke):
    """``--methods torchao-fp8``: diffusers with torchao's fp8 linears (the flux-fast recipe without FA3), a one-GPU
    peer row. On CPU torchao refuses fp8 (it needs compute capability 8.9+), so the row is there with that error:
    the recipe was applied, not skipped."""
    rows = smoke[2]["rows"]
    peers = [r for r in rows if r["method"] == "torchao-fp8"]
    assert [r["gpus"] for r in peers] == [1]  # a one-GPU peer, whatever --gpus lists
    assert "compute capability" in peers[0]["error"]
    assert any(r["method"] == "single" and "step_ms" in r for r in rows)  # diffusers' own row beside it


def test_runs_go_to_a_user_folder_not_the_checkout(tmp_path, monkeypatch):
    for name in ("DITMESH_BENCH_DIR", "DITMESH_CACHE"):
        monkeypatch.delenv(name, raising=False)
    default = default_out_dir().resolve()
    assert default == (Path.home() / ".cache" / "ditmesh" / "bench").resolve()
    assert not default.is_relative_to(ROOT) and not default.is_relative_to(Path.cwd().resolve())
    monkeypatch.setenv("DITMESH_CACHE", str(tmp_path / "cache"))
    assert default_out_dir() == tmp_path / "cache" / "bench"
    monkeypatch.setenv("DITMESH_BENCH_DIR", str(tmp_path / "runs"))
    assert default_out_dir() == tmp_path / "runs"


def test_ctrl_c_removes_the_temporary_folder(tmp_path):
    proc = bench(["--gpus", "1", "--steps", "2000", "--warmup", "0"], tmp_path,
                 DITMESH_BENCH_DIR=str(tmp_path / "runs"))
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "tmp").glob("ditmesh-bench-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list((tmp_path / "tmp").glob("ditmesh-bench-*")), "the run never started"
        time.sleep(2)  # inside the launcher, with a worker running
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        kill_session(proc)
    assert proc.returncode != 0
    assert leftovers(tmp_path) == []
    assert not (tmp_path / "runs").exists()  # an interrupted run writes no results


def test_a_stopped_run_writes_the_rows_it_measured(tmp_path):
    """A SIGTERM while a row runs (a call's deadline, say) stops the run, and the rows measured before it are
    written, the stopped row with its error."""
    out = tmp_path / "b.json"
    proc = bench(["--gpus", "2", "--methods", "ulysses,ring", "--no-single", "--steps", "1", "--warmup", "0",
                  "--out", str(out)], tmp_path)
    started = 0
    for line in proc.stdout:  # each row's label line, as it starts
        started += line.startswith("ditmesh bench: ") and line.rstrip().endswith("...")
        if started == 2:
            break
    time.sleep(1)  # inside the launcher, the second row's ranks starting
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=120)
    finally:
        kill_session(proc)
    assert proc.returncode == 143
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], "step_ms" in r) for r in rows] == [("ulysses", True), ("ring", False)]
    assert rows[1]["error"].startswith("interrupted"), rows[1]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_a_row_past_its_timeout_is_stopped_and_the_run_goes_on(tmp_path, launch):
    """Also --no-single: of --gpus 1,2 only the 2-process rows run (a 1-process row would be stopped too). Forked
    ranks (the default) are stopped at 2 s, while their zygote imports (no machine imports torch and diffusers that
    fast; at 1 s a loaded machine had once not yet started the zygote's stack handler, and printed no stacks): its stacks are printed, and the next row runs (and is stopped too); ranks that are their own interpreters
    (``DITMESH_LAUNCH=exec``) at 4 s: each one's stacks, rank 1's copied from its log. The exec run has one row: what
    comes after a stopped row is the bench's own loop, the same for either launch, and the fork run checks it."""
    out = tmp_path / "b.json"
    limit = {"fork": 2, "exec": 4}[launch]
    methods = {"fork": "ulysses,ring", "exec": "ulysses"}[launch]
    proc = bench(["--gpus", "1,2", "--methods", methods, "--no-single", "--steps", "2000", "--warmup", "0",
                  "--row-timeout", str(limit), "--out", str(out)], tmp_path, DITMESH_LAUNCH=launch)
    try:
        _, err = proc.communicate(timeout=300)
        # nothing of the run is left running once it has ended (the rows' zygotes and ranks name its folder)
        running = subprocess.run(["pgrep", "-f", str(tmp_path / "tmp")], capture_output=True, text=True).stdout
    finally:
        kill_session(proc)
    assert running == "", running
    assert proc.returncode == 0, err[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["gpus"]) for r in rows] == [(m, 2) for m in methods.split(",")], rows
    assert not any("speedup_vs_1gpu" in r for r in rows)
    # where each process was: its Python stacks (faulthandler's format), and below Python its scheduler state and
    # kernel wait channel (py-spy's stacks where it is installed)
    if launch == "fork":
        assert all(r["error"] == "stopped after 2 s: the ranks were still importing (where: the Python stacks "
                   "printed above)" for r in rows), rows
        assert err.count("ditmesh: the ranks' imports at the time limit") == 2, err[-3000:]
        assert err.count("most recent call first") >= 2, err[-3000:]
        assert len(re.findall(r"ditmesh: imports \(pid \d+\): [RSD] \(\w+\); waiting in ", err)) == 2, err[-3000:]
    else:
        assert all(r["error"] == "stopped after 4 s: the ranks had not finished (where each one was: the Python "
                   "stacks printed above)" for r in rows), rows
        assert err.count("ditmesh: rank 1 at the time limit:") == 1, err[-3000:]
        assert err.count("most recent call first") >= 2, err[-3000:]
        assert len(re.findall(r"ditmesh: rank [01] \(pid \d+\): [RSD] \(\w+\); waiting in ", err)) == 2, err[-3000:]
    assert leftovers(tmp_path) == []


def test_bad_bench_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import tempfile

    from ditmesh.cli import main

    cases = [(["--baseline-src", str(tmp_path)], "--baseline-src"),
             (["--out", str(tmp_path / "r.txt")], "give a .json file path"),
             (["--dtype", "int3"], "--dtype 'int3' is not one of"),
             (["--gpus", "0"], "--gpus 0: process counts must be >= 1"),
             (["--row-timeout", "0"], "--row-timeout 0.0: give the seconds a row may take, above 0"),
             (["--steps", "0"], "give at least 1 timed step"),
             (["--gpus", "1", "--no-single"], "--no-single with --gpus 1: no row is left"),
             (["--comm-dtype", "auto,fp4"], "--comm-dtype 'fp4' is not one of auto, fp8"),
             (["--attention", "int8"], "--attention int8 was retired: it was slower than the exact attention"),
             (["--attention", "fp8-emulated", "--methods", "ring"], "the 8-bit attention runs on one GPU or under "
                                                                      "ulysses alone")]
    # the first as its own process (the exit code a shell sees), the others in this one (each a start-up less)
    proc = bench(cases[0][0], tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and cases[0][1] in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    for args, needle in cases[1:]:
        assert main(["bench", "--model", "flux-tiny", *args]) == 2, args
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (args, err)
    assert leftovers(tmp_path) == []


def test_baseline_src_runs_the_same_command_on_both_trees(tmp_path, monkeypatch):
    """The command runs in this process, its baseline run as its own process, as always."""
    out = tmp_path / "ab.json"
    assert bench_here(["--gpus", "1", "--steps", "1", "--warmup", "0", "--baseline-src", str(ROOT / "src"),
                       "--out", str(out)], tmp_path, monkeypatch) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["baseline_src"] == str(ROOT / "src")
    assert sorted((r["tree"], r["method"]) for r in doc["rows"]) == [("baseline", "single"), ("current", "single")]
    assert all("step_ms" in r for r in doc["rows"])
    assert "| single | 1 | False | False |" in out.with_suffix(".md").read_text().split("Against the baseline")[1]
    assert leftovers(tmp_path) == []


def test_vae_bench_script_on_two_gloo_ranks(tmp_path):
    # scripts/vae_bench.py under torchrun, tiny VAEs on CPU: every mode runs, the exact ones equal their reference
    out = tmp_path / "vae.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(ROOT / "scripts" / "vae_bench.py"), "--tiny",
                           "--json", str(out)], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("| flux 64x64 |") == 5 and "| wan 32x48x5 | split | 2 |" in proc.stdout
    rows = {(r["case"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    for case in ("flux 64x64", "flux 96x96", "wan 32x48x5"):
        assert rows[(case, "split")]["err_whole"] <= 1e-5 and rows[(case, "split")]["gpus"] == 2
    for case in ("flux 64x64", "flux 96x96"):
        assert rows[(case, "tiled-ranks")]["err_tiled"] <= 1e-6 and rows[(case, "chunked")]["err_whole"] <= 1e-5
        assert rows[(case, "tiled")]["err_whole"] > 1e-3  # tiling changes the picture: the columns tell them apart
