"""GPU experiment: what pays in Ulysses at 1024^2 on FLUX.1-dev (synthetic weights), one launch.

Run with ``torchrun --nproc_per_node N scripts/overlap_bench.py [--height H --width W]``. Rank 0 first
measures the one-GPU step (eager, then compiled, then compiled in a CUDA graph with separate and with fused
Q/K/V projections); then every rank runs ulysses N in several variants: head-group pipelining (``cN``: N
groups), eager (``-eager``), inductor's comm/compute reordering (``-reorder``), a CUDA graph of the whole
step (``-graph``), separate Q/K/V projections (``-nofuse``; fused is this script's default, separate is ditmesh's), the received Q/K/V
copied into one contiguous buffer as before the in-place receive layout (``-copyrecv``), and an all-to-all
group whose NCCL communicator gets at least / at most N CTAs (``-minctasN`` / ``-maxctasN``), and the
copy-engine transport (``-symm``, ``ditmesh.symm``) instead of NCCL. Each variant reports the median step,
its relative error against the eager one-GPU output, and the profiler's breakdown (compute /
communication / idle). Rows go to stdout and, as JSON lines, to ``$OUT/overlap.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ditmesh.api import compile_blocks, parallelize
from ditmesh.attention import ulysses
from ditmesh.comm import group_name
from ditmesh.config import ParallelConfig
from ditmesh.fusion import fuse_qkv
from ditmesh.models.base import adapter_for
from ditmesh.parallel.graph import cuda_capture, side_stream_run
from ditmesh.profiling import profile_step
from ditmesh.synth import build_transformer, get_arch
from ditmesh.testing import rel_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--model", default="flux-dev")
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--single", choices=["eager", "both"], default="both", help="one-GPU rows to measure")
    ap.add_argument("--variants", default="c1-graph,c2-graph,c3-graph,c2,c2-eager,c2-reorder")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()  # CPU (gloo, float32, flux-tiny) only to check the script itself
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    torch._dynamo.config.cache_size_limit = 64
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
    out_path = os.path.join(os.environ.get("OUT", "/tmp"), "overlap.jsonl")
    arch = get_arch(args.model)
    model = build_transformer(arch, seed=0, device=device, dtype=dtype)
    adapter = adapter_for(model)
    shape = dict(height=args.height, width=args.width, **({"frames": args.frames} if args.frames else {}))
    inputs = adapter.example_inputs(model, **shape, batch=1,
                                    text_len=arch.max_sequence_length, generator=torch.Generator().manual_seed(1),
                                    device=device, dtype=dtype)
    step = lambda: model(**inputs)[0]  # noqa: E731

    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    measure = (lambda fn: profile_step(fn, device)) if cuda else (lambda fn: {})

    def timed(fn, warmup=2, steps=args.steps, barrier=True):
        with torch.no_grad():
            for _ in range(warmup):
                out = fn()
            times = []
            for _ in range(steps):
                sync()
                if barrier:
                    dist.barrier()
                t0 = time.perf_counter()
                out = fn()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), out

    def report(name, ms, out, ref, prof):
        err = rel_err(out.float(), ref) if ref is not None else None
        row = dict(variant=name, gpus=1 if name.startswith("single") else world, step_ms=round(ms, 3), rel_err=err,
                   card=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                   peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else 0, **prof)
        if rank == 0:
            print(json.dumps(row), flush=True)
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def uncompile():
        for block in model.modules():
            block._compiled_call_impl = None
        torch._dynamo.reset()

    def graph_row(name):
        graphed = _graphed(step, device)
        ms, out = timed(graphed, barrier=False)
        with torch.no_grad():
            prof = measure(graphed)
        report(name, ms, out, ref, prof)

    ref = None
    if rank == 0:
        ms, out = timed(step, 1, 3, barrier=False)
        ref = out.float()
        report("single-eager", ms, out, ref, {})
    if rank == 0 and args.single == "both":
        compile_blocks(model)
        ms, out = timed(step, barrier=False)
        with torch.no_grad():
            prof = measure(step)
        report("single-compiled", ms, out, ref, prof)
        if cuda:
            graph_row("single-compiled-graph")
            undo_fusion = fuse_qkv(model, adapter)
            uncompile()
            compile_blocks(model)
            graph_row("single-compiled-graph-fused")
            for fn in undo_fusion:
                fn()
        uncompile()
    dist.barrier()

    class Pipe:
        transformer = model

    sp = parallelize(Pipe, ParallelConfig(ulysses=world), device=device, fuse_qkv=False).sequence()
    default_group = sp.ulysses_group
    undo_fusion = None
    copying = _copying_receive(ulysses.seq_to_heads_start)
    for name in args.variants.split(","):
        parts = name.split("-")
        sp.ulysses_chunks = int(parts[0][1:])
        sp.transport = "symm" if "symm" in parts else "nccl"
        if "nofuse" not in parts and undo_fusion is None:
            undo_fusion = fuse_qkv(model, adapter)
        elif "nofuse" in parts and undo_fusion is not None:
            for fn in undo_fusion:
                fn()
            undo_fusion = None
        ulysses.seq_to_heads_start = copying if "copyrecv" in parts else copying.original
        ctas = [p for p in parts if p.startswith(("minctas", "maxctas"))]
        sp.ulysses_group = _nccl_group(world, ctas[0]) if ctas and cuda else default_group
        sp.ulysses_group_name = group_name(sp.ulysses_group)
        torch._inductor.config.reorder_for_compute_comm_overlap = "reorder" in parts
        uncompile()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            if "eager" not in parts:
                compile_blocks(model)
            fn = step
            if "graph" in parts and cuda:
                fn = _graphed(step, device)
            ms, out = timed(fn)
            with torch.no_grad():
                prof = measure(fn)
            report(name, ms, out, ref, prof)
        except Exception as exc:  # noqa: BLE001  (an experiment that fails is a row)
            if rank == 0:
                print(json.dumps({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _copying_receive(start):
    """``seq_to_heads_start`` whose Q/K/V come back as one contiguous stacked copy (the layout before the
    in-place receive): the same bytes moved as the previous concatenation of the received chunks."""

    def copying(*args, **kwargs):
        finish = start(*args, **kwargs)
        return lambda: torch.stack(finish()).unbind(0)

    copying.original = start
    return copying


def _nccl_group(world, spec):
    """A new all-rank NCCL group whose communicator gets ``minctasN`` / ``maxctasN`` CTAs (channels)."""
    opts = dist.ProcessGroupNCCL.Options()
    setattr(opts.config, "min_ctas" if spec.startswith("min") else "max_ctas", int(spec[7:]))
    return dist.new_group(list(range(world)), pg_options=opts)


def _graphed(step, device):
    """Capture one whole transformer call in a CUDA graph (ditmesh's own capture, ``parallel.graph``) after
    three runs on a side stream; return a function that replays it."""
    with torch.no_grad(), torch.cuda.device(device):
        for _ in range(3):
            side_stream_run(step)
        replay_graph, static_out = cuda_capture(step)

    def replay():
        replay_graph()
        return static_out

    return replay


if __name__ == "__main__":
    main()
