"""scripts/xdit_pipefusion.py without xfuser or a GPU: its argument checks, and that a failure or a hang ends as
one record (the first failure's) instead of a hung or silent run. The xDiT run itself is measured on GPUs
(docs/benchmarks.md, "PipeFusion against xDiT's, whole images")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cases import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "xdit_pipefusion.py"


@pytest.mark.parametrize("argv, world, message", [
    (["--pp", "2"], "4", "--pp 2 x --ulysses 1 = 2 processes, but WORLD_SIZE is 4"),
    (["--pp", "2", "--patches", "1"], "2", "--patches 1: must be at least --pp (2)"),
    (["--pp", "1", "--height", "1000"], "1", "--height 1000 / --width 1024: FLUX needs multiples of 16"),
    (["--pp", "0"], "1", "--pp 0: must be at least 1"),
])
def test_bad_degrees_and_sizes_are_one_line_errors(monkeypatch, capsys, argv, world, message):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_info:
        load_script("xdit_pipefusion").parse_args(["--model", "m", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_first_failure_record_is_kept_and_a_success_overwrites(tmp_path, capsys):
    script, path = load_script("xdit_pipefusion"), str(tmp_path / "r.json")
    script.emit({"error": "first"}, path, first_only=True)
    script.emit({"error": "second"}, path, first_only=True)  # a later rank's failure: neither written nor printed
    assert json.loads(Path(path).read_text()) == {"error": "first"}
    assert capsys.readouterr().out.count("XDIT ") == 1
    script.emit({"ok": True}, path, first_only=False)
    assert json.loads(Path(path).read_text()) == {"ok": True}


def run_main(tmp_path, body: str, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    """main() in a fresh process whose ``run`` is ``body`` (xfuser and torch are not needed)."""
    out = tmp_path / "r.json"
    out.write_text("stale")  # a file of an earlier run must not hide this run's failure
    code = (f"import importlib.util, time\nspec = importlib.util.spec_from_file_location('x', {str(SCRIPT)!r})\n"
            "x = importlib.util.module_from_spec(spec); spec.loader.exec_module(x)\n"
            f"def run(args):\n    x.stage = 'timed image'\n    {body}\nx.run = run\n"
            f"x.main(['--model', 'm', '--pp', '1', '--json', {str(out)!r}, *{list(argv)!r}])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return proc, json.loads(out.read_text())


def test_an_exception_becomes_the_record_with_its_stage_and_traceback(tmp_path):
    proc, record = run_main(tmp_path, "raise RuntimeError('mat1 and mat2 must have the same dtype')")
    assert proc.returncode == 1
    assert record["ok"] is False and record["stage"] == "timed image" and record["rank"] == 0
    assert record["error"] == "RuntimeError: mat1 and mat2 must have the same dtype"
    assert "in run" in record["traceback_tail"] and proc.stdout.startswith("XDIT {")


def test_a_hang_ends_at_the_deadline_with_the_stack_it_waited_in(tmp_path):
    proc, record = run_main(tmp_path, "time.sleep(30)", "--deadline", "0.5")
    assert proc.returncode == 124
    assert record["error"] == "timed out after 0.5 s"
    assert record["stage"] == "timed image"
    assert record["traceback_tail"].rstrip().endswith("in run")  # the innermost frame: where the main thread waits
