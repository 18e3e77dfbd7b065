"""torchrun worker of test_symm_gpu.py: Ulysses attention through copy engines equals the NCCL path.

Every rank runs :func:`ulysses_attention` on random float32 shards with ``transport="symm"`` and
``"nccl"`` (eager, then compiled with fullgraph and ``symm.COMPILE_OPTIONS``), for even and uneven sequence
and head splits, batch 1 and 2, one and two head groups, three calls in a row (buffer reuse), and
compares (rel. error <= 1e-5). Prints one JSON line per case on rank 0; exits 1 on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ditmesh import symm
from ditmesh.attention.ulysses import ulysses_attention
from ditmesh.comm import group_name, split_sizes
from ditmesh.testing import rel_err


def local(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    name = group_name(dist.group.WORLD)
    failed = False
    for seq, heads, batch, chunks in [(4096, 24, 1, 1), (4096, 24, 1, 2), (1001, 6, 2, 1), (1001, 5, 1, 2), (512, 24, 2, 2)]:
        sizes = split_sizes(seq, world)
        g = torch.Generator(device=device).manual_seed(0)
        for compiled in (False, True):
            fn = lambda q, k, v, t: ulysses_attention(q, k, v, sizes, rank, name, local, chunks=chunks, transport=t)  # noqa: E731
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(fn, fullgraph=True, options=symm.COMPILE_OPTIONS)
            worst, error = 0.0, None
            try:
                for _ in range(3):  # consecutive calls reuse the receive buffers
                    q, k, v = (torch.randn(batch, sizes[rank], heads, 64, generator=g, device=device)
                               for _ in range(3))
                    worst = max(worst, rel_err(fn(q, k, v, "symm"), fn(q, k, v, "nccl")))
            except Exception as exc:  # noqa: BLE001  (reported as the case's failure)
                error = f"{type(exc).__name__}: {str(exc)[:400]}"
            ok = error is None and worst <= 1e-5
            failed |= not ok
            if rank == 0:
                print(json.dumps({"seq": seq, "heads": heads, "batch": batch, "chunks": chunks, "compiled": compiled,
                                  "rel_err": worst, "error": error, "ok": ok}), flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # no teardown: a destroy after symmetric-memory use can hang


if __name__ == "__main__":
    main()
