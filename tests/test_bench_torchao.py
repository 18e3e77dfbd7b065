"""``ditmesh bench --methods torchao-fp8``: diffusers with torchao's fp8 linears (the flux-fast recipe without FA3), a
one-GPU peer row. On CPU torchao refuses fp8 (it needs compute capability 8.9+), so the row is there with that error:
the recipe was applied, not skipped."""

from __future__ import annotations

import json
import subprocess
import sys


def test_torchao_fp8_peer_row_runs_once_on_one_process(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "ditmesh", "bench", "--model", "flux-tiny", "--methods",
                           "torchao-fp8", "--gpus", "1,2", "--steps", "1", "--warmup", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    peers = [r for r in rows if r["method"] == "torchao-fp8"]
    assert [r["gpus"] for r in peers] == [1]  # a one-GPU peer, whatever --gpus lists
    assert "compute capability" in peers[0]["error"]
    assert any(r["method"] == "single" and "step_ms" in r for r in rows)  # diffusers' own row beside it
