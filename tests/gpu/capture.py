"""Shared by the GPU attention tests: a kernel compiled and replayed from a CUDA graph."""

from __future__ import annotations

import torch


def compiled_and_graphed_errors(fn, inputs, fresh) -> tuple[float, float]:
    """``fn`` compiled (fullgraph) on ``inputs`` against eager, and replayed from a CUDA graph captured on copies of
    ``inputs`` after they were overwritten with ``fresh``, against eager on ``fresh``: two relative errors."""
    def err(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    compiled = torch.compile(fn, fullgraph=True)
    first = err(compiled(*inputs), fn(*inputs))
    static = [t.clone() for t in inputs]
    compiled(*static)  # the normal call before capture builds what the capture must not (graphs, constants)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(*static)
    for s, t in zip(static, fresh):
        s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    return first, err(out, fn(*fresh))
