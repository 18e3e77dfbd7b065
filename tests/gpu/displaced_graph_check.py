"""torchrun worker of test_displaced_graph_gpu.py: displaced attention replayed from CUDA graphs gives the latents of
displaced attention without graphs.

Every rank runs the tiny trained pipeline (float32, 10 steps, ulysses over the world, displaced attention with one
exact warm-up step) three times in a row, without graphs and with ``cuda_graph=True`` (one graph per planned call:
exact, stale of each step parity, last step; the run's gathers joined inside each graph), eager and compiled, with
and without true CFG (two calls a step). Rank 0 prints one JSON line per case; exits 1 on a mismatch.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from gpu_ranks import start_tiny_rank

from ditmesh import ParallelConfig, parallelize, remove
from ditmesh.hooks import find_hook
from ditmesh.testing import rel_err

RUNS = 3


def run(pipe, world: int, graphs: bool, cfg: bool, compile: bool):
    """Final latents of each of RUNS runs, and the graph entries as {key: (captured, failed, replays)}."""
    parallelize(pipe, ParallelConfig(ulysses=world), displaced=True, cuda_graph=graphs, compile=compile)
    kwargs = dict(negative_prompt="", true_cfg_scale=2.0) if cfg else {}
    try:
        latents = [pipe(["a red circle at the top left on a white background"], height=64, width=64,
                        num_inference_steps=10, max_sequence_length=16, output_type="latent",
                        generator=torch.Generator().manual_seed(7), **kwargs).images.float().cpu()
                   for _ in range(RUNS)]
        entries = {}
        if graphs:
            entries = {str(key[2]): (e.replay is not None, e.failed, e.replays)
                       for key, e in find_hook(pipe.transformer, "graph").graphed.entries.items()}
        return latents, entries
    finally:
        remove(pipe)


def main() -> int:
    rank, world, pipe = start_tiny_rank()
    failed = False
    for compile in (False, True):
        for cfg in (False, True):
            eager, _ = run(pipe, world, False, cfg, compile)
            graphed, entries = run(pipe, world, True, cfg, compile)
            errs = [rel_err(g, eager[0]) for g in graphed]
            calls = 2 if cfg else 1
            # four keys per call in step, none failed, each captured; the stale ones replayed from run 1 on
            ok = (max(errs) <= 1e-5 and len(entries) == 4 * calls and all(c and not f for c, f, _ in entries.values())
                  and sum(r for _, _, r in entries.values()) > 0)
            failed |= not ok
            if rank == 0:
                print(json.dumps({"world": world, "compile": compile, "cfg": cfg, "rel_err": errs,
                                  "entries": entries, "ok": ok}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as cache_graph_check.py: the NCCL teardown after captured graphs may not return
