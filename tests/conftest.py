"""Shared fixtures: one synthetic flux-tiny checkpoint per session, and long-lived gloo worker pools."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_POOLS: dict[int, object] = {}


@pytest.fixture(scope="session")
def flux_tiny(tmp_path_factory) -> str:
    """Path of a flux-tiny synthetic pipeline folder (seed 0)."""
    from ditmesh.synth import write_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "flux-tiny"
    write_checkpoint("flux-tiny", path, seed=0, device="cpu")
    return str(path)


@pytest.fixture(scope="session")
def model_checkpoints(tmp_path_factory) -> dict:
    """Synthetic sd3-tiny and wan2.2-tiny (two transformers) pipeline folders (seed 0)."""
    from ditmesh.synth import write_checkpoint

    root = tmp_path_factory.mktemp("family-ckpt")
    return {name: str(write_checkpoint(name, root / name, seed=0, device="cpu")) for name in ("sd3-tiny", "wan2.2-tiny")}


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> a ProcessPool of n gloo ranks, started once per session."""
    from ditmesh.testing import ProcessPool

    def get(n: int):
        if n not in _POOLS:
            _POOLS[n] = ProcessPool(n)
        return _POOLS[n]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
