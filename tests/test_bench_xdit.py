"""`ditmesh bench` xDiT peer rows: the methods exist, and without xfuser the row records why and the bench goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ditmesh.bench import METHODS


def test_xdit_methods_have_our_degrees():
    for m in ("ulysses", "ring", "usp"):
        assert METHODS[f"xdit-{m}"](4) == METHODS[m](4)
    assert METHODS["xdit-usp"](4) == {"ulysses": 2, "ring": 2}


def test_bench_without_xfuser_records_an_error_row(tmp_path):
    hidden = tmp_path / "site" / "xfuser"  # shadows any installed xfuser, so the test means the same everywhere
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('xfuser hidden by the test')\n")
    paths = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    # no --out: the run goes to $DITMESH_BENCH_DIR
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), DITMESH_BENCH_DIR=str(tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "ditmesh", "bench", "--model", "flux-tiny", "--gpus", "1,2",
                           "--methods", "xdit-ulysses", "--steps", "1", "--warmup", "1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [out] = (tmp_path / "runs").glob("flux-tiny-64x64-*.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "site"]  # nothing in the working folder
    rows = {(r["method"], r["gpus"]): r for r in json.loads(out.read_text())["rows"]}
    assert "step_ms" in rows[("single", 1)]
    assert rows[("xdit-ulysses", 2)]["error"] == "ImportError: xfuser hidden by the test"
