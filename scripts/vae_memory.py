"""Peak live bytes of one rank's share of a split VAE decode: measured on CPU ranks, traced on the meta device.

    torchrun --nproc-per-node 4 scripts/vae_memory.py                 # FLUX's VAE, 256² and 512², float32, gloo
    python scripts/vae_memory.py --trace-only --sizes 2048,4096,8192 --dtype bfloat16

Each size is decoded twice by ``parallel.vae`` over the ranks: with no layer in pieces (``--old``-style: a piece
budget larger than any layer, the split decode as it ran before its large layers were cut) and with the pieces cut
as they would be at ``--pieces-as`` (the budget ``parallel.vae.PIECE_BYTES`` scaled by the pixels and the element
size, so each layer runs in as many pieces as at that size, at most one latent row a piece). The peak of live
tensor bytes allocated during the decode (the planner's dispatch-mode counter: every op's outputs, freed when the
last reference goes; weights and the latent not counted) is taken on every rank and the busiest printed, with the
error against the whole decode. Beside it, the planner's trace of rank 0's share on the meta device
(``planner.vae.TracedRank``) at the same size, dtype and budget: the two agree when the trace is right, and the
trace at the real size (``--trace-only``) then gives the peak of a size no CPU can decode. ``--workspace`` adds
each convolution's workspace to the traces (what ``ditmesh plan`` counts on GPUs).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def flux_vae(dtype, device):
    import diffusers

    from ditmesh.synth import ARCHS

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**ARCHS["flux-dev"].vae).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return vae.to(device, dtype)


def budget(size: int, pieces_as: int, dtype) -> int:
    """The piece budget that cuts a ``size``² decode into as many pieces as ``PIECE_BYTES`` cuts a bf16
    ``pieces_as``² one."""
    from ditmesh.parallel.vae import PIECE_BYTES

    scale = (size / pieces_as) ** 2 * torch.empty(0, dtype=dtype).element_size() / 2
    return max(1, int(PIECE_BYTES * scale))


def traced(size: int, world: int, piece_bytes: int, dtype, workspace: bool) -> int:
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae
    from ditmesh.planner.vae import TracedRank, _traced_peak

    with torch.device("meta"):
        vae = flux_vae(dtype, "meta")
    undo = parallel_vae.install(vae, vae_plan_for(vae), TracedRank(0, world, piece_bytes))
    z = torch.empty(1, 16, size // 8, size // 8, device="meta", dtype=dtype)
    peak = _traced_peak(vae, z, conv_workspace=workspace)
    for fn in reversed(undo):
        fn()
    return peak


def measured(vae, z, piece_bytes: int) -> tuple[int, float, torch.Tensor]:
    """(busiest rank's peak live bytes, this rank's seconds, the picture) of a split decode."""
    import time

    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae
    from ditmesh.planner.stats import _TrafficCounter

    undo = parallel_vae.apply(vae, vae_plan_for(vae), dist.group.WORLD, piece_bytes=piece_bytes)
    counter = _TrafficCounter(lambda t: "fixed")
    start = time.perf_counter()
    with torch.no_grad(), counter:
        out = vae.decode(z).sample
    seconds = time.perf_counter() - start
    for fn in reversed(undo):
        fn()
    peak = torch.tensor([counter.peak], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item()), seconds, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,512")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--pieces-as", type=int, default=8192, help="cut each layer into as many pieces as at this size")
    p.add_argument("--world", type=int, default=4, help="ranks of --trace-only")
    p.add_argument("--trace-only", action="store_true", help="meta-device traces only (no ranks, any size)")
    p.add_argument("--workspace", action="store_true", help="add each convolution's workspace to the traces")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    gib = 2 ** 30
    if args.trace_only:
        print("| size | ranks | dtype | old trace GiB | pieces trace GiB | old / pieces | pieces GiB per megapixel |")
        print("|---|---|---|---|---|---|---|")
        for size in map(int, args.sizes.split(",")):
            old = traced(size, args.world, 1 << 60, dtype, args.workspace)
            new = traced(size, args.world, budget(size, args.pieces_as, dtype), dtype, args.workspace)
            print(f"| {size}² | {args.world} | {args.dtype} | {old / gib:.3f} | {new / gib:.3f} | {old / new:.2f} | "
                  f"{new / gib / (size * size / 1e6):.4f} |")
        return
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    vae = flux_vae(dtype, "cpu")
    if rank == 0:
        print("| size | ranks | dtype | old: measured / traced GiB | pieces: measured / traced GiB | old / pieces | "
              "err vs whole (old, pieces) | s (old, pieces) |")
        print("|---|---|---|---|---|---|---|---|")
    for size in map(int, args.sizes.split(",")):
        g = torch.Generator().manual_seed(1)
        z = torch.randn(1, 16, size // 8, size // 8, generator=g).to(dtype)
        with torch.no_grad():
            whole = vae.decode(z).sample
        rows = []
        for piece_bytes in (1 << 60, budget(size, args.pieces_as, dtype)):
            peak, seconds, out = measured(vae, z, piece_bytes)
            err = ((out.double() - whole.double()).norm() / whole.double().norm()).item()
            rows.append((peak, traced(size, world, piece_bytes, dtype, args.workspace), err, seconds))
        if rank == 0:
            (old, old_t, old_err, old_s), (new, new_t, new_err, new_s) = rows
            print(f"| {size}² | {world} | {args.dtype} | {old / gib:.3f} / {old_t / gib:.3f} | {new / gib:.3f} / "
                  f"{new_t / gib:.3f} | {old / new:.2f} | {old_err:.1e}, {new_err:.1e} | {old_s:.1f}, {new_s:.1f} |")
    from ditmesh.runtime.generate import end_rank_process  # no gloo teardown (it can abort: SIGABRT)

    end_rank_process(0)


if __name__ == "__main__":
    main()
