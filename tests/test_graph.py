"""The CUDA-graph wrapper's bookkeeping (input buffers, signatures, fallbacks), checked on CPU.

On CPU the capture is replaced by ``rerun_capture`` (each replay re-runs the call on the captured input
buffers and writes the captured output in place), so a wrong buffer or a stale output shows up as a
wrong result. The graphs themselves run in the GPU benchmark.
"""

from __future__ import annotations

import pytest
import torch

from cases import flux_generate, flux_graphed_generate, rerun_capture
from ditmesh.parallel.graph import GraphedCall
from ditmesh.testing import rel_err


@pytest.mark.parametrize("world,config", [(1, {}), (2, {"ulysses": 2})])
def test_graphed_pipeline_matches_plain_run(pools, flux_tiny, world, config):
    ref, _ = flux_generate(flux_tiny, {}, 3, 48, 48)
    runs = [flux_graphed_generate(flux_tiny, config)] if world == 1 else pools(world).run(
        flux_graphed_generate, flux_tiny, config)
    for latents, entries in runs:
        assert rel_err(latents, ref) <= 1e-5
        # one signature: call 1 eager, call 2 captured, call 3 replayed
        assert entries == [(2, True, False)]


def test_graphed_call_keys_on_shapes_and_values_and_copies_inputs():
    calls = []

    def f(x, scale=1.0):
        calls.append(tuple(x.shape))
        return (x * scale + 1,)

    g = GraphedCall(f, capture=rerun_capture, devices=("cpu",))
    with torch.no_grad():
        for i in range(4):
            x = torch.full((2, 3), float(i))
            assert torch.equal(g(x)[0], x + 1)
        y = torch.ones(5)
        assert torch.equal(g(y, scale=2.0)[0], y * 2 + 1)  # new signature: runs eagerly first
        assert torch.equal(g(y, scale=3.0)[0], y * 3 + 1)  # a non-tensor value is part of the signature
    assert len(g.entries) == 3
    with torch.no_grad():
        out1 = g(torch.zeros(2, 3))[0]
        g(torch.ones(2, 3))
    assert torch.equal(out1, torch.ones(2, 3))  # a returned output is a copy, not the replay buffer


def test_graphed_call_falls_back_when_capture_fails(caplog):
    def bad_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = GraphedCall(lambda x: x * 2, capture=bad_capture, devices=("cpu",))
    with torch.no_grad():
        outs = [g(torch.full((2,), float(i))) for i in range(3)]
    assert [o.tolist() for o in outs] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    assert "CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
    assert next(iter(g.entries.values())).failed


def test_graphed_call_runs_plainly_with_autograd():
    g = GraphedCall(lambda x: x * 2, capture=rerun_capture, devices=("cpu",))
    x = torch.ones(2, requires_grad=True)
    for _ in range(3):
        g(x).sum().backward()
    assert g.entries == {}


def test_graphed_call_runs_plainly_where_a_signature_is_unsafe():
    calls = []

    def f(x, y=None, extra=None):
        calls.append(1)
        return x + (y if y is not None else 0)

    g = GraphedCall(f, capture=rerun_capture)  # default devices: CUDA only
    with torch.no_grad():
        for _ in range(3):
            g(torch.ones(2))  # CPU tensors: no graph
        assert g.entries == {}
        cpu = GraphedCall(f, capture=rerun_capture, devices=("cpu",))
        t = torch.ones(2)
        for _ in range(3):
            cpu(t, y=t)  # aliased inputs
            cpu(torch.ones(2), extra=object())  # a non-plain value
        assert cpu.entries == {}
        for _ in range(3):
            cpu(torch.ones(2), extra=(1, "a"), y=torch.ones(2))
            cpu(torch.ones(2), y=torch.ones(2), extra=(1, "a"))  # keyword order does not matter
        assert len(cpu.entries) == 1
