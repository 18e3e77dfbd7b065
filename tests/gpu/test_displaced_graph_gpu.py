"""Displaced attention under CUDA graphs on real GPUs (skipped without 2 CUDA GPUs): the graphed run gives the
ungraphed displaced run's latents under Ulysses 2, eager and compiled, with and without true CFG."""

from __future__ import annotations

import pytest
import torch
from gpu_ranks import torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def test_displaced_calls_replayed_from_graphs_give_the_ungraphed_run():
    out = torchrun("displaced_graph_check.py", 2, timeout=1200)
    assert out.count('"ok": true') == 4, out
