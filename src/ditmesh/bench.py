"""``ditmesh bench``: per-step latency, memory and accuracy of parallel configurations, side by side.

Each configuration runs in its own set of local processes (one per GPU; gloo processes on a CPU-only
machine), on the same seeded weights and inputs: the transformer of a synthetic architecture, one
denoising step's inputs as the pipeline builds them. Rows: median step time over ``--steps`` timed
steps after ``--warmup`` steps, peak memory per GPU, and the relative error of the output against the
1-process run.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

#: method name -> degrees for g processes
METHODS = {
    "single": lambda g: {},
    "ulysses": lambda g: {"ulysses": g},
    "ring": lambda g: {"ring": g},
    "usp": lambda g: {"ulysses": g // 2, "ring": 2},
    "tp": lambda g: {"tp": g},
}


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark parallel configurations (per-step latency, memory, accuracy)")
    b.add_argument("--model", default=None, help="synthetic architecture (default flux-dev on GPU, flux-tiny on CPU)")
    b.add_argument("--height", type=int, default=None)
    b.add_argument("--width", type=int, default=None)
    b.add_argument("--gpus", default=None, help="process counts, e.g. 1,2,4 (default: 1,2 on CPU, 1,2,4 up to the GPU count)")
    b.add_argument("--methods", default="ulysses", help=f"comma list of: {', '.join(m for m in METHODS if m != 'single')}")
    b.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--compile", action="store_true", help="torch.compile every transformer block")
    b.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    b.add_argument("--out", default=None, help="JSON results (default bench/results/<model>-<HxW>-<time>.json)")
    b.add_argument("--worker", default=None, help=argparse_suppress())
    b.set_defaults(func=run_bench)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def _worker(spec: dict) -> None:
    import torch.distributed as dist

    from .api import parallelize
    from .comm import all_gather_object
    from .config import ParallelConfig
    from .mesh import default_device
    from .models.base import adapter_for
    from .runtime.generate import DTYPES, _init_distributed
    from .runtime.report import device_name
    from .synth import build_transformer, get_arch

    device = default_device()
    _init_distributed(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = DTYPES[spec["dtype"]]
    arch = get_arch(spec["model"])
    model = build_transformer(arch, seed=0, device=device, dtype=dtype)
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(1)
    inputs = adapter.example_inputs(model, spec["height"], spec["width"], 1, arch.max_sequence_length, gen, device, dtype)

    class _Pipe:  # parallelize() needs only `.transformer`
        transformer = model

    row = {"method": spec["method"], "gpus": spec["gpus"], "height": spec["height"], "width": spec["width"],
           "compiled": spec["compile"], "model": spec["model"], "dtype": spec["dtype"]}
    try:
        parallelize(_Pipe, ParallelConfig(**spec["degrees"]), device=device)
    except (NotImplementedError, ValueError) as exc:
        row["error"] = str(exc).splitlines()[0]
    if "error" not in row:
        if spec["compile"]:
            for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
                block.compile()
        times = []
        with torch.no_grad():
            for i in range(spec["warmup"] + spec["steps"]):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if dist.is_initialized():
                    dist.barrier()
                t0 = time.perf_counter()
                out = model(**inputs)[0]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= spec["warmup"]:
                    times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        peaks = all_gather_object(peak)
        row.update(step_ms=round(statistics.median(times) * 1e3, 3), step_ms_all=[round(t * 1e3, 3) for t in times],
                   peak_gib_per_gpu=round(max(peaks) / 2**30, 3), card=device_name(device))
        if rank == 0:
            torch.save(out.float().cpu(), Path(spec["tmp"]) / f"{spec['method']}-{spec['gpus']}.pt")
    if rank == 0:
        with open(Path(spec["tmp"]) / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    if dist.is_initialized():
        from .runtime.generate import end_rank_process

        dist.barrier()
        end_rank_process(0)


def run_bench(args) -> int:
    """Run every configuration, then print a Markdown table and write the JSON results."""
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    from .config import ConfigError
    from .runtime.launch import launch_local
    from .runtime.report import versions, write_json
    from .synth import get_arch

    on_gpu = torch.cuda.is_available()
    model = args.model or ("flux-dev" if on_gpu else "flux-tiny")
    arch = get_arch(model)
    height = args.height or arch.default_size[0]
    width = args.width or arch.default_size[1]
    available = torch.cuda.device_count() if on_gpu else (os.cpu_count() or 1)
    gpus = [int(g) for g in (args.gpus or ("1,2,4" if on_gpu else "1,2")).split(",")]
    if max(gpus) > max(available, 2 if not on_gpu else 0):
        raise ConfigError(f"--gpus {args.gpus}: only {available} devices here")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"--methods: unknown method {m!r}; known: {', '.join(METHODS)}")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    tmp = tempfile.mkdtemp(prefix="ditmesh-bench-")
    plan = [("single", 1)] + [(m, g) for g in gpus if g > 1 for m in methods]
    for method, g in plan:
        spec = dict(model=model, height=height, width=width, method=method, gpus=g, degrees=METHODS[method](g),
                    steps=args.steps, warmup=args.warmup, compile=args.compile, dtype=dtype, tmp=tmp)
        print(f"ditmesh bench: {method} on {g} process(es) ...", flush=True)
        try:
            launch_local(g, ["bench", "--worker", json.dumps(spec)])
        except Exception as exc:  # noqa: BLE001  (a failed configuration is a row, not the end of the run)
            with open(Path(tmp) / "rows.jsonl", "a") as f:
                f.write(json.dumps({"method": method, "gpus": g, "error": str(exc).splitlines()[0]}) + "\n")
    rows = [json.loads(line) for line in open(Path(tmp) / "rows.jsonl")]
    ref_path = Path(tmp) / "single-1.pt"
    ref = torch.load(ref_path) if ref_path.exists() else None
    base = next((r["step_ms"] for r in rows if r.get("method") == "single" and "step_ms" in r), None)
    for r in rows:
        out = Path(tmp) / f"{r['method']}-{r['gpus']}.pt"
        if ref is not None and out.exists():
            r["rel_err_vs_1gpu"] = float((torch.load(out) - ref).norm() / ref.norm())
        if base and "step_ms" in r:
            r["speedup_vs_1gpu"] = round(base / r["step_ms"], 3)
            r["efficiency"] = round(base / r["step_ms"] / r["gpus"], 3)
            r["e2e_28_steps_s"] = round(r["step_ms"] * 28 / 1e3, 3)
        r["versions"] = versions()
    out_path = args.out or f"bench/results/{model}-{height}x{width}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(out_path, {"model": model, "height": height, "width": width, "rows": rows})
    print(markdown_table(rows))
    print(f"ditmesh bench: wrote {out_path}")
    return 0


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table."""
    head = "| method | gpus | compiled | step ms | speedup | efficiency | peak GiB/GPU | rel err vs 1 | note |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r.get("rel_err_vs_1gpu")
        lines.append(
            f"| {r['method']} | {r['gpus']} | {r.get('compiled', '')} | {r.get('step_ms', '')} | {r.get('speedup_vs_1gpu', '')} "
            f"| {r.get('efficiency', '')} | {r.get('peak_gib_per_gpu', '')} | {'' if err is None else f'{err:.2e}'} "
            f"| {r.get('error', '')} |"
        )
    return "\n".join(lines)
