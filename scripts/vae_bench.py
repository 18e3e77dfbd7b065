"""VAE decode: time, peak memory per GPU and error of every decode mode, in one table.

    python scripts/vae_bench.py                                  # one GPU
    torchrun --nproc-per-node 4 scripts/vae_bench.py             # four GPUs
    torchrun --nproc-per-node 2 scripts/vae_bench.py --tiny      # CPU check (gloo, tiny VAEs, tiny sizes)

FLUX.1's VAE (``AutoencoderKL``, the ``flux-dev`` synth architecture's config, random seeded weights) decodes a
random latent of each ``--sizes`` picture, and Wan 2.1's (``AutoencoderKLWan``) one of each ``--wan-sizes`` video,
in every mode ditmesh has:

| mode | what runs |
|---|---|
| ``whole`` | ``vae.decode`` on every rank, each on its own GPU (the 1-GPU decode; the reference) |
| ``split`` | ``parallel.vae.apply``: the latent rows split over the ranks, halo rows, exact group norms, one gather |
| ``tiled`` | diffusers' ``enable_tiling`` on every rank, each on its own GPU (the 1-GPU tiled decode) |
| ``tiled-ranks`` | ``parallel.vae.apply_tiled``: diffusers' tiles spread over the ranks, blended by diffusers |
| ``chunked`` | ``parallel.vae_chunk.apply``: residual blocks and up-samplers in pieces of ``--chunk-rows`` rows |

Per mode: the median seconds of ``--repeat`` timed decodes (after ``--warmup``), slowest rank; the peak allocated
and reserved GiB of the decode on the busiest GPU; and the relative error (Frobenius) of the picture against the
``whole`` decode of this run (``err whole``), for the tiled modes against ``tiled`` (``err tiled``), and with
``--fp32-reference`` against a whole float32 decode (``err fp32``: the half-precision error of each mode, the 1-GPU
decode's included). A mode
that runs out of memory says ``OOM`` on every rank and the run goes on. Modes that need several ranks are skipped on
one; ``tiled-ranks`` and ``chunked`` are skipped for Wan's VAE (not covered). Rank 0 prints the table (and writes
``--json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

MODES = ("whole", "split", "tiled", "tiled-ranks", "chunked")
#: a rank that runs out of memory inside a split decode leaves the others waiting in a collective: they give up after
#: this long (a split decode of an 8192² picture takes seconds)
TIMEOUT = datetime.timedelta(minutes=5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2048,4096,8192", help="FLUX pictures, square sides in pixels ('' for none)")
    p.add_argument("--wan-sizes", default="480x832x81,720x1280x81", help="Wan videos, HxWxFRAMES ('' for none)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--chunk-rows", type=int, default=128, help="rows per piece of the chunked mode")
    p.add_argument("--piece-mib", type=int, default=None,
                   help="split mode: MiB of one piece's temporaries in a large layer (default parallel.vae.PIECE_BYTES; "
                        "a number above any layer's size, e.g. 1000000, runs every layer whole)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--flux-arch", default="flux-dev", help="synth architecture whose VAE config FLUX rows use")
    p.add_argument("--wan-arch", default="wan2.1-14b", help="synth architecture whose VAE config Wan rows use")
    p.add_argument("--tile", type=int, default=None, help="diffusers' tile size in pixels (default: the VAE's own)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU check: flux-tiny and wan-tiny VAEs, float32, sizes 64,96 and 32x48x5, 16-pixel tiles")
    p.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also decode each case whole in float32 and give every mode's error against it (err vs fp32): "
                        "how far each half-precision decode, the 1-GPU one included, is from the float32 result")
    p.add_argument("--profile", action="store_true",
                   help="GPU: profile one more decode of each mode and print where its time goes (rank 0's GPU): "
                        "compute, communication, idle, and the kernels that take longest")
    args = p.parse_args(argv)
    if args.tiny:
        args.sizes, args.wan_sizes, args.dtype = "64,96", "32x48x5", "float32"
        args.flux_arch, args.wan_arch, args.tile, args.chunk_rows = "flux-tiny", "wan-tiny", 32, 4
        args.warmup, args.repeat = 0, 1
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))}; use {', '.join(MODES)}")
    return args


def init() -> tuple[torch.device, object]:
    """This rank's device and the world group (None on one process without torchrun)."""
    if "RANK" not in os.environ:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), None
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return device, dist.group.WORLD


def world(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def build_vae(arch_name: str, dtype, device, tile):
    """The VAE of a synth architecture, random weights (seed 0, the same on every rank), eval mode."""
    import diffusers

    from ditmesh.models.base import adapter_for_class, vae_plan_for
    from ditmesh.synth import ARCHS

    arch = ARCHS[arch_name]
    cls = getattr(diffusers, adapter_for_class(arch.transformer_class).vae.class_names[0])
    torch.manual_seed(0)
    vae = cls(**arch.vae).eval()
    with torch.no_grad():  # random norms and biases too (a fresh init has ones and zeros there)
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    vae = vae.to(device, dtype)
    if tile and hasattr(vae, "tile_sample_min_size"):  # the KL VAE's tiles (a quarter overlap)
        vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // vae_plan_for(vae).spatial_factor(vae)
    if tile and hasattr(vae, "tile_sample_min_height"):  # Wan's tiles and their stride
        vae.tile_sample_min_height = vae.tile_sample_min_width = tile
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = tile * 3 // 4
    return vae


def latent_of(vae, height: int, width: int, frames: int, dtype, device) -> torch.Tensor:
    """A random latent (seed 1, the same on every rank) of a ``height`` x ``width`` picture (or ``frames`` video)."""
    from ditmesh.models.base import vae_plan_for

    factor = vae_plan_for(vae).spatial_factor(vae)
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    time_dims = ((frames - 1) // 4 + 1,) if frames > 1 else ()
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, channels, *time_dims, height // factor, width // factor, generator=g).to(device, dtype)


def installed(vae, mode: str, group, device, chunk_rows: int, piece_mib: int | None = None) -> list:
    """Install ``mode`` on ``vae``; returns the undo callables (None: the mode does not apply here)."""
    from ditmesh.config import ConfigError
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae
    from ditmesh.parallel import vae_chunk

    plan = vae_plan_for(vae)
    if mode == "whole":
        return []
    if mode == "tiled":
        if not hasattr(vae, "enable_tiling"):
            return None
        vae.enable_tiling()
        return [vae.disable_tiling]
    if mode == "split":
        pieces = parallel_vae.PIECE_BYTES if piece_mib is None else piece_mib << 20
        return None if world(group) == 1 else parallel_vae.apply(vae, plan, group, strict=True, piece_bytes=pieces)
    if mode == "tiled-ranks":
        if world(group) == 1 or plan.tile_decoder is None:
            return None
        return parallel_vae.apply_tiled(vae, plan, group)
    if mode == "chunked":
        try:
            return vae_chunk.apply(vae, chunk_rows, device)
        except ConfigError:
            return None
    raise ValueError(mode)


def sync(device, group):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group)


def reduce_max(values: list[float], device, group) -> list[float]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_mode(vae, z, mode, args, device, group):
    """(seconds, peak allocated GiB, peak reserved GiB, picture on the CPU, profile or None) of ``mode``, or None
    (does not apply) or "OOM"; the same answer on every rank."""
    undo = installed(vae, mode, group, device, args.chunk_rows, args.piece_mib)
    if undo is None:
        return None
    times, out, failed = [], None, 0.0
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.repeat):
            sync(device, group)
            start = time.perf_counter()
            try:
                with torch.no_grad():
                    out = vae.decode(z).sample
            except torch.OutOfMemoryError:
                out, failed = None, 1.0
            sync(device, group)
            if reduce_max([failed], device, group)[0]:  # one rank out of memory: the mode failed everywhere
                return "OOM"
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        peak = reserved = 0.0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            reserved = torch.cuda.max_memory_reserved(device) / 2**30
        seconds, peak, reserved = reduce_max([statistics.median(times), peak, reserved], device, group)
        picture, profiled = out.float().cpu(), None
        if args.profile and device.type == "cuda":
            from ditmesh.profiling import profile_step

            out = None
            sync(device, group)
            profiled = profile_step(lambda: vae.decode(z), device)
        return seconds, peak, reserved, picture, profiled
    finally:
        for fn in reversed(undo):
            fn()
        out = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


def rel_err(a, b) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return float((a - b).norm() / b.norm())


def fp32_decode(vae, z, device, group):
    """The whole decode of ``z`` in float32 on the CPU (None where it runs out of memory on any rank); the VAE is
    given back in its own dtype."""
    dtype, failed, out = z.dtype, 0.0, None
    try:
        with torch.no_grad():
            out = vae.float().decode(z.float()).sample.cpu()
    except torch.OutOfMemoryError:
        failed = 1.0
    finally:
        vae.to(dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return None if reduce_max([failed], device, group)[0] else out


def bench_case(label: str, vae, z, args, device, group) -> list[dict]:
    rows, pictures = [], {}
    reference = fp32_decode(vae, z, device, group) if args.fp32_reference else None
    for mode in args.modes.split(","):
        result = run_mode(vae, z, mode, args, device, group)
        if result is None:
            continue
        row = dict(case=label, mode=mode, gpus=world(group) if mode in ("split", "tiled-ranks") else 1,
                   ranks=world(group), seconds=None, peak_gib=None, reserved_gib=None, err_whole=None, err_tiled=None,
                   err_fp32=None)
        if result == "OOM":
            row["status"] = "OOM"
        else:
            row.update(status="ok", seconds=result[0], peak_gib=result[1], reserved_gib=result[2])
            pictures[mode] = result[3]
            if result[4] is not None:
                row["profile"] = result[4]
        rows.append(row)
    for row in rows:
        picture = pictures.get(row["mode"])
        row["err_whole"] = rel_err(picture, pictures.get("whole")) if row["mode"] != "whole" else None
        row["err_fp32"] = rel_err(picture, reference)
        if row["mode"] in ("tiled", "tiled-ranks"):
            row["err_tiled"] = rel_err(picture, pictures.get("tiled")) if row["mode"] != "tiled" else None
    return rows


def table(rows: list[dict], device, dtype: str, ranks: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"VAE decode, {dtype}, {ranks} rank(s) on {name}; torch {torch.__version__}",
             "",
             "| case | mode | GPUs | s | peak GiB/GPU | reserved GiB/GPU | err vs whole | err vs tiled | err vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|"]

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        if r["status"] == "OOM":
            lines.append(f"| {r['case']} | {r['mode']} | {r['gpus']} | OOM | OOM | OOM | - | - | - |")
            continue
        lines.append(f"| {r['case']} | {r['mode']} | {r['gpus']} | {num(r['seconds'], '.3f')} | "
                     f"{num(r['peak_gib'], '.2f')} | {num(r['reserved_gib'], '.2f')} | {num(r['err_whole'], '.2e')} | "
                     f"{num(r['err_tiled'], '.2e')} | {num(r['err_fp32'], '.2e')} |")
    for r in rows:
        b = r.get("profile")
        if b:
            lines += ["", f"profile of {r['case']}, {r['mode']}: span {b['span_ms']} ms, compute {b['compute_ms']}, "
                          f"comm exposed {b['comm_exposed_ms']}, idle {b['idle_ms']}; by kind {b['kernels_ms']}"]
            lines += [f"    {ms:9.2f} ms {count:6d}x  {name}" for name, ms, count in b["top_kernels"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, group = init()
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    rows = []
    cases = [("flux", args.flux_arch, int(s), int(s), 1) for s in args.sizes.split(",") if s]
    for spec in (s for s in args.wan_sizes.split(",") if s):
        h, w, f = (int(v) for v in spec.split("x"))
        cases.append(("wan", args.wan_arch, h, w, f))
    vaes = {}
    for family, arch, h, w, f in cases:
        if arch not in vaes:
            vaes[arch] = build_vae(arch, dtype, device, args.tile)
        vae = vaes[arch]
        z = latent_of(vae, h, w, f, dtype, device)
        label = f"{family} {h}x{w}" + (f"x{f}" if f > 1 else "")
        rows += bench_case(label, vae, z, args, device, group)
        if rank(group) == 0:
            print(f"done: {label}", file=sys.stderr, flush=True)
    if rank(group) == 0:
        print(table(rows, device, args.dtype, world(group)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "dtype": args.dtype, "ranks": world(group),
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}, f,
                          indent=2)
    if group is not None:  # leave without destructors: a gloo group torn down while its threads wind down can
        from ditmesh.runtime.generate import end_rank_process  # abort the interpreter (SIGABRT) after the run

        end_rank_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
