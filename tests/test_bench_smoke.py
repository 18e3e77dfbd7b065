"""`ditmesh bench` smoke run on CPU: flux-tiny over gloo, every row measured and exact against one process."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_smoke_flux_tiny_gloo(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ditmesh", "bench", "--model", "flux-tiny", "--gpus", "1,2",
                           "--methods", "ulysses,diffusers-ulysses", "--steps", "1", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["method"], r["gpus"]): r for r in json.loads(out.read_text())["rows"]}
    ours = rows[("ulysses", 2)]
    for key in ("method", "gpus", "height", "width", "compiled", "step_ms", "e2e_28_steps_s", "speedup_vs_1gpu",
                "efficiency", "peak_gib_per_gpu", "rel_err_vs_1gpu", "card", "versions"):
        assert key in ours, key
    assert ours["rel_err_vs_1gpu"] <= 1e-5
    assert ours["ulysses_chunks"] == 1  # the head groups it ran with are recorded (one on CPU)
    assert "error" in rows[("diffusers-ulysses", 2)]  # the peer fails on CPU; the row records how
    assert "| ulysses | 2 |" in out.with_suffix(".md").read_text()
