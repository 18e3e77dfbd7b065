"""scripts/largest_size.py: a real search on CPU (the tiny pipeline over gloo) that stops at the first size generate
refuses, a try stopped by its timeout with its ranks gone, and how a try's end is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cases import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "largest_size.py"


def _run(flux_tiny, tmp_path, *args):
    out = tmp_path / "largest.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", flux_tiny, "--json", str(out), *args,
                           "--max-sequence-length", "16"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_search_stops_at_the_first_size_that_does_not_complete(flux_tiny, tmp_path):
    # tried smallest first: 64 completes over 2 gloo ranks; 104 is not a multiple of 16 (generate's one-line error,
    # exit 2); 128 is never tried
    report, table = _run(flux_tiny, tmp_path, "--layout", "--nproc 2 --ulysses 2", "--sides", "128,104,64")
    (result,) = report["results"]
    assert [(t["size"], t["outcome"]) for t in result["tries"]] == [(64, "ok"), (104, "error")]
    assert result["largest"] == 64 and result["first_failed"] == 104
    assert "104" in result["why"] and result["why"].startswith("error: ")
    assert result["tries"][0]["peak_gib_per_gpu"] >= 0 and result["tries"][0]["seconds"] > 0
    assert report["extra"] == ["--max-sequence-length", "16"]
    assert "| `--nproc 2 --ulysses 2` | 64 |" in table


def test_a_try_past_its_timeout_is_stopped_with_its_ranks(flux_tiny, tmp_path):
    report, table = _run(flux_tiny, tmp_path, "--layout", "--nproc 2", "--sides", "64", "--timeout", "3",
                         "--dp", "2", "--prompt", "a", "--prompt", "b")
    (result,) = report["results"]
    assert [(t["size"], t["outcome"]) for t in result["tries"]] == [(64, "timeout")]
    assert result["largest"] is None and result["why"] == "timeout" and "| none |" in table
    leftover = subprocess.run(["pgrep", "-f", "ditmesh generate --model " + flux_tiny], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_a_try_cut_by_the_runs_deadline_is_no_failure_of_its_size(flux_tiny, tmp_path):
    # the try runs until the deadline cuts it (a try starts only with 10 s left): one process (on the tests' one
    # thread) keeps it to one core
    report, table = _run(flux_tiny, tmp_path, "--layout", "--nproc 1", "--sides", "64,96", "--timeout", "100",
                         "--deadline", "11", "--steps", "100000")
    (result,) = report["results"]
    assert [(t["size"], t["outcome"]) for t in result["tries"]] == [(64, "deadline")]
    assert result["largest"] is None and result["first_failed"] is None
    assert result["why"] == "64 and up not tried (deadline)"


def test_how_a_try_ends_is_read_from_its_exit_code_and_error():
    outcome = load_script("largest_size").outcome
    assert outcome(0, "denoising 100%\n") == ("ok", "")
    assert outcome(None, "") == ("timeout", "")
    oom = ("ditmesh: error: rank 1 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. "
           "GPU 1 has a total capacity of 79.19 GiB")
    assert outcome(2, "loading\n" + oom + "\n") == ("oom", oom)
    assert outcome(2, "ditmesh: error: --height 104 is not a multiple of 16\n") == (
        "error", "ditmesh: error: --height 104 is not a multiple of 16")
