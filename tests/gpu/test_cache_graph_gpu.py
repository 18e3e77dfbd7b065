"""Step caches under CUDA graphs on real GPUs (skipped without CUDA): the same decisions and latents as without
graphs on one GPU and under Ulysses 2, and Ulysses 2 equal to one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_ranks import torchrun

from ditmesh.testing import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(world: int, out: Path) -> str:
    return torchrun("cache_graph_check.py", world, str(out))


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
