"""Copy-engine Ulysses transport on real GPUs (skipped without 2 CUDA devices): equal to the NCCL path."""

from __future__ import annotations

import pytest
import torch
from gpu_ranks import torchrun

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def test_symm_ulysses_equals_nccl_ulysses_eager_and_compiled():
    out = torchrun("symm_check.py", 2, timeout=600)
    assert out.count('"ok": true') == 10, out
