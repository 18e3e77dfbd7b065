"""Shared fixtures: one synthetic flux-tiny checkpoint per session, and long-lived gloo worker pools."""

from __future__ import annotations

import getpass
import os
import tempfile
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one compile cache for the whole session, named here so that every process of it (this one, the pools' workers,
# the commands the tests start) reads and fills the same one: generate keeps a cache the user named
# (runtime.generate.persist_compile_caches), and a test that changed it would leave later compiles cold
COMPILE_CACHES = {env: os.environ.setdefault(env, os.path.join(tempfile.gettempdir(), f"{name}_{getpass.getuser()}"))
                  for env, name in (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton"))}

_POOLS: dict[int, object] = {}


def kill_session(proc) -> None:
    """Kill what is left of a command a test started with ``start_new_session=True`` (its whole session): a run the
    test failed to stop would go on beside every later test."""
    import contextlib
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _compile_caches_stay():
    """A test that leaves the compile cache variables changed fails (every compile after it would start cold)."""
    yield
    changed = {env: os.environ.get(env) for env, value in COMPILE_CACHES.items() if os.environ.get(env) != value}
    assert not changed, f"the test left the compile cache variables changed: {changed}"


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


def new_pool(n: int):
    """A new ProcessPool of n gloo ranks. ``$DITMESH_TEST_TIMEOUT_S`` (default 300) bounds a collective's wait (the
    mutation check sets it low)."""
    from ditmesh.testing import ProcessPool

    return ProcessPool(n, float(os.environ.get("DITMESH_TEST_TIMEOUT_S", "300")))


def pool(n: int):
    """A :func:`new_pool` of n gloo ranks, started once per session (and again after a failed case closed it)."""
    if n not in _POOLS or _POOLS[n].closed:
        _POOLS[n] = new_pool(n)
    return _POOLS[n]


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> :func:`pool` (n); the session's pools are closed at its end."""
    yield pool
    for started in _POOLS.values():
        if not started.closed:
            started.close()
    _POOLS.clear()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """``tiny_checkpoints(name)`` -> the path of the synthetic ``name`` pipeline folder (seed 0), written once."""
    from ditmesh.synth import write_checkpoint

    written: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in written:
            written[name] = str(write_checkpoint(name, tmp_path_factory.mktemp("tiny") / name, seed=0, device="cpu"))
        return written[name]

    return get


# -- where the suite's time goes (docs/testing.md): DITMESH_TEST_TIMELINE=FILE writes one line a test --------------
_TIMELINE = os.environ.get("DITMESH_TEST_TIMELINE")
_STARTED: dict = {}


def pytest_configure(config):
    global _TIMELINE
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        _TIMELINE = None  # xdist's controller: its workers write the lines


def _children_cpu() -> float:
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def pytest_runtest_logstart(nodeid, location):
    if _TIMELINE:
        _STARTED[nodeid] = (time.time(), time.process_time(), _children_cpu())


def pytest_runtest_logfinish(nodeid, location):
    """The test's worker, start and end (epoch seconds), its own CPU seconds and its reaped children's."""
    if _TIMELINE and nodeid in _STARTED:
        start, cpu, children = _STARTED.pop(nodeid)
        with open(_TIMELINE, "a") as out:
            out.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.2f}\t{time.time():.2f}\t"
                      f"{time.process_time() - cpu:.2f}\t{_children_cpu() - children:.2f}\t{nodeid}\n")
