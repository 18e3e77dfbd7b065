"""Where one denoising step's time goes on a GPU: compute, communication, and idle, from the profiler.

:func:`profile_step` runs a callable once under ``torch.profiler`` (CUDA kernels only), reads the kernel
intervals of this rank's GPU from the exported trace, and :func:`breakdown` reduces them to

- ``span_ms``: first kernel start to last kernel end;
- ``compute_ms``: time at least one non-communication kernel runs (union of intervals);
- ``comm_ms``: time at least one communication kernel (NCCL) runs; ``comm_exposed_ms`` is the part of it
  with no compute kernel running beside it (what overlap could still win), ``comm_hidden_ms`` the rest;
- ``idle_ms``: time no kernel, copy or memset runs at all (host launch gaps, waits on the host);
- ``kernels_ms``: summed durations by kind (``gemm``, ``attention``, ``comm``, ``copy`` for memcpy and
  memset, ``other``); copies count as compute;
- ``top_kernels``: the kernels (by name, cut to 90 characters) with the largest summed durations, as
  ``[name, ms, count]``, largest first (what to look at first in a slow step).

A communication kernel's time includes waiting for the slowest peer to reach the collective, so load
imbalance between ranks shows up as communication.
"""

from __future__ import annotations

import json
import os
import tempfile

COMM_MARKERS = ("nccl", "rccl", "alltoall", "all_to_all", "allgather", "reducescatter", "allreduce")
GEMM_MARKERS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "wgmma", "sm90_", "triton_tem_")
ATTENTION_MARKERS = ("flash", "fmha", "attention", "attn", "cudnn_sdpa", "sdpa")


def kind_of(name: str) -> str:
    """``comm``, ``copy``, ``attention``, ``gemm`` or ``other``, from a kernel's (or copy's) name."""
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return "copy"
    if any(m in low for m in COMM_MARKERS):
        return "comm"
    if any(m in low for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in low for m in GEMM_MARKERS):
        return "gemm"
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length covered by both of two unions of disjoint sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(kernels: list[tuple[str, float, float]], top: int = 12) -> dict:
    """Reduce ``(name, start_us, duration_us)`` kernel records of one GPU to the step's time budget (ms)."""
    if not kernels:
        raise ValueError("no GPU kernels were recorded")
    by_kind: dict[str, float] = {"gemm": 0.0, "attention": 0.0, "comm": 0.0, "copy": 0.0, "other": 0.0}
    by_name: dict[str, list] = {}
    comm, compute = [], []
    for name, start, dur in kernels:
        kind = kind_of(name)
        by_kind[kind] += dur
        entry = by_name.setdefault(name[:90], [0.0, 0])
        entry[0] += dur
        entry[1] += 1
        (comm if kind == "comm" else compute).append((start, start + dur))
    comm_u, compute_u = _union(comm), _union(compute)
    busy = _length(_union(comm + compute))
    span = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    hidden = _intersection(comm_u, compute_u)
    ms = lambda us: round(us / 1e3, 3)  # noqa: E731
    return {
        "span_ms": ms(span),
        "compute_ms": ms(_length(compute_u)),
        "comm_ms": ms(_length(comm_u)),
        "comm_hidden_ms": ms(hidden),
        "comm_exposed_ms": ms(_length(comm_u) - hidden),
        "idle_ms": ms(span - busy),
        "kernels_ms": {k: ms(v) for k, v in by_kind.items()},
        "kernel_count": len(kernels),
        "top_kernels": [[name, ms(us), count] for name, (us, count)
                        in sorted(by_name.items(), key=lambda item: -item[1][0])[:top]],
    }


def kernels_from_trace(path: str, device_index: int | None = None) -> list[tuple[str, float, float]]:
    """``(name, start_us, duration_us)`` of every GPU kernel, copy and memset in a ``torch.profiler`` Chrome trace."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    out = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        dev = (e.get("args") or {}).get("device")
        if device_index is not None and dev is not None and dev != device_index:
            continue
        out.append((e.get("name", ""), float(e["ts"]), float(e["dur"])))
    return out


def profile_step(fn, device) -> dict:
    """Run ``fn()`` once under the profiler on CUDA ``device``; return :func:`breakdown` of its kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="ditmesh-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return breakdown(kernels_from_trace(path, device.index))
    finally:
        os.unlink(path)
