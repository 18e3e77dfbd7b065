"""GPU experiment: can an all-to-all on copy engines hide behind a GEMM where NCCL's cannot?

The question came from the third session's variant study (docs/benchmarks.md): once compiled, Ulysses
all-to-alls that ran beside attention or GEMMs got slower by about as much as they hid, because NCCL's
kernels and the compute compete for the same SMs. Copies through symmetric memory (``cudaMemcpyAsync``
into a peer's buffer) run on the copy engines instead. First run: fourth session, 2x H200
(``scripts/gpu_transport.sh``; rows in ``bench/results/transport_x2.jsonl``). Its answer: yes, for the
peers' parts. Beside a 230 µs GEMM, ``ce-remote`` left 6 of its 72.5 µs exposed, where NCCL left 82 of
its 97 µs. A local copy of this rank's own part on the side stream does not hide.

    torchrun --nproc_per_node N scripts/transport_bench.py --tokens 2304              # FLUX 1024^2 x2 sizes
    torchrun --nproc_per_node N scripts/transport_bench.py --tokens 8190 --hidden 5120   # Wan 480x832x81 x4

Per rank: the fused Q/K/V all-to-all of one attention layer (``tensors x tokens x hidden`` bf16, an equal
part to every rank), the GEMM of FLUX's single-block MLP (``[tokens, hidden] x [hidden, 4 hidden]``) and
the attention of one Ulysses layer (all tokens, this rank's heads). Rows, each the mean of ``--iters``
back-to-back repetitions in µs:

- ``gemm``, ``attn``, ``nccl``, ``ce`` (every part, this rank's own by a local copy), ``ce-remote`` (the
  peers' parts only), ``ce+copyout`` (then the received buffer copied out): each alone
- ``gemm+X``, ``attn+X``: the compute on the current stream, the all-to-all X on a side stream, joined
- ``graph:...``: the same captured in a CUDA graph and replayed

Rank 0 prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1152, help="tokens per rank (FLUX 1024^2 on 4 GPUs: 1152)")
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--tensors", type=int, default=3, help="tensors per all-to-all (3: Q/K/V; 2: K/V; 1: output)")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("transport_bench: needs CUDA GPUs (copy engines and NCCL); none are visible here")
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    dtype = torch.bfloat16

    numel = args.tensors * args.tokens * args.hidden // world * world  # divisible into one equal part per rank
    chunk = numel // world
    send = torch.randn(numel, device=device, dtype=dtype)
    nccl_out = torch.empty_like(send)
    recv = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(recv, group_name)
    # peer j's receive buffer, at the slot this rank owns there: a mapped pointer, so copy_ is a peer memcpy
    slots = [handle.get_buffer(j, (chunk,), dtype, rank * chunk) for j in range(world)]
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    w = torch.randn(4 * args.hidden, args.hidden, device=device, dtype=dtype)
    side = torch.cuda.Stream(device)

    def gemm():
        torch.nn.functional.linear(x, w)

    def nccl():
        dist.all_to_all_single(nccl_out, send)

    def ce():
        for step in range(world):  # start with the next rank so that not every rank writes to rank 0 first
            j = (rank + step) % world
            slots[j].copy_(send[j * chunk:(j + 1) * chunk])
        handle.barrier(channel=0)  # every rank's copies into this rank have landed

    def ce_remote():  # the peers' parts only: in a real layer this rank's own part never moves
        for step in range(1, world):
            j = (rank + step) % world
            slots[j].copy_(send[j * chunk:(j + 1) * chunk])
        handle.barrier(channel=0)

    heads = args.hidden // 128
    qkv = [torch.randn(1, max(1, heads // world), args.tokens * world, 128, device=device, dtype=dtype)
           for _ in range(3)]

    def attn():  # the attention of one Ulysses layer: all tokens, this rank's heads
        torch.nn.functional.scaled_dot_product_attention(*qkv)

    out = torch.empty_like(send)

    def ce_out():  # the same, then the received buffer copied out (so it can be reused at once)
        ce()
        out.copy_(recv)

    def graphed(fn):  # fn captured once in a CUDA graph; the row times its replays
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph.replay

    def beside(a2a, work=gemm):
        def both():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                a2a()
            work()
            cur.wait_stream(side)
        return both

    def check_ce():
        ce()
        torch.cuda.synchronize()
        nccl()
        torch.cuda.synchronize()
        return bool(torch.equal(recv, nccl_out))

    say(rank, f"rendezvous done, backend {symm_mem.get_backend(device)}")
    correct = check_ce()
    say(rank, json.dumps({"ce_equals_nccl": correct, "bytes_per_rank": numel * send.element_size(), "hidden": args.hidden,
                          "card": torch.cuda.get_device_name(device), "torch": torch.__version__}))
    rows = [("gemm", gemm), ("nccl", nccl), ("ce", ce), ("ce+copyout", ce_out), ("gemm+nccl", beside(nccl)),
            ("gemm+ce", beside(ce)), ("graph:nccl", graphed(nccl)), ("graph:ce", graphed(ce)),
            ("graph:gemm+nccl", graphed(beside(nccl))), ("graph:gemm+ce", graphed(beside(ce))),
            ("ce-remote", ce_remote), ("gemm+ce-remote", beside(ce_remote)),
            ("graph:gemm+ce-remote", graphed(beside(ce_remote))), ("attn", attn),
            ("attn+nccl", beside(nccl, attn)), ("attn+ce-remote", beside(ce_remote, attn)),
            ("graph:attn+nccl", graphed(beside(nccl, attn))), ("graph:attn+ce-remote", graphed(beside(ce_remote, attn)))]
    for name, fn in rows:
        us = timed(fn, args.iters)
        if rank == 0:
            print(json.dumps({"row": name, "us": round(us, 1), "tokens": args.tokens, "tensors": args.tensors,
                              "world": world}), flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    say(rank, "done")
    os._exit(0)  # no teardown: a destroy after symmetric-memory use can hang


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[transport_bench] {msg}", flush=True)


def timed(fn, iters: int) -> float:
    """Mean µs of ``fn`` over ``iters`` back-to-back calls, after 3 warm-ups, all ranks started together."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


if __name__ == "__main__":
    main()
