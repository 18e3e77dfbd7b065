"""Step caches under CUDA graphs on real GPUs (skipped without CUDA): the same decisions and latents as without
graphs on one GPU and under Ulysses 2, and Ulysses 2 equal to one GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditmesh.testing import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(world: int, out: Path) -> str:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                           str(Path(__file__).with_name("cache_graph_check.py")), str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_cached_calls_replayed_from_graphs_decide_and_compute_as_without_graphs(tmp_path):
    one = _check(1, tmp_path / "one.pt")
    assert one.count('"ok": true') == 10, one
    if torch.cuda.device_count() < 2:
        return
    two = _check(2, tmp_path / "two.pt")
    assert two.count('"ok": true') == 10, two
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for case in a:
        assert rel_err(b[case], a[case]) <= 1e-4, case  # float32 on GPUs: TF32 off, reduction orders differ
