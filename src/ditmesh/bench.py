"""``ditmesh bench``: per-step latency, memory and accuracy of parallel configurations, side by side.

Each configuration runs in its own set of local processes (one per GPU; gloo processes on a CPU-only
machine), on the same seeded weights and inputs: the transformer of a synthetic architecture, one
denoising step's inputs as the pipeline builds them. Rows: median step time over ``--steps`` timed
steps after ``--warmup`` steps, peak memory per GPU, and the relative error of the output against the
1-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

#: method name -> degrees for g processes. Peers run with the same degrees as ours, on the same weights and
#: inputs: ``diffusers-*`` rows are diffusers' own context parallelism (``enable_parallelism``), ``xdit-*`` rows
#: are xDiT's FLUX wrapper with its USP attention (optional: needs xfuser 0.7, see :func:`_enable_xdit`).
METHODS = {
    "single": lambda g: {},
    "ulysses": lambda g: {"ulysses": g},
    "ring": lambda g: {"ring": g},
    "usp": lambda g: {"ulysses": g // 2, "ring": 2} if g >= 4 else {"ulysses": 0},  # 2-D needs >= 4
    "tp": lambda g: {"tp": g},
    "tp-ulysses": lambda g: {"tp": 2, "ulysses": g // 2} if g >= 4 else {"tp": 0},
    "cfg": lambda g: {"cfg": 2, "ulysses": g // 2} if g > 2 else {"cfg": 2},
}
#: peers, each measured with our ulysses/ring/usp degrees as ``<peer>-<method>``
PEERS = ("diffusers", "xdit")
METHODS.update({f"{peer}-{m}": METHODS[m] for peer in PEERS for m in ("ulysses", "ring", "usp")})

#: what a GPU run measures when ``--methods`` is not given: ours and both peers, side by side
GPU_METHODS = "ulysses,diffusers-ulysses,xdit-ulysses"


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark parallel configurations (per-step latency, memory, accuracy)")
    b.add_argument("--model", default=None, help="synthetic architecture (default flux-dev on GPU, flux-tiny on CPU)")
    b.add_argument("--height", type=int, default=None)
    b.add_argument("--width", type=int, default=None)
    b.add_argument("--frames", type=int, default=None, help="video frames (video models)")
    b.add_argument("--batch", type=int, default=1, help="batch of the transformer call (2 = a batched CFG step)")
    b.add_argument("--gpus", default=None, help="process counts, e.g. 1,2,4 (default: 1,2 on CPU, 1,2,4 up to the GPU count)")
    b.add_argument("--methods", default=None,
                   help=f"comma list of: {', '.join(m for m in METHODS if m != 'single')} (default: {GPU_METHODS} on "
                        "GPUs, ulysses on CPU)")
    b.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--compile", choices=["off", "on", "both"], default=None,
                   help="torch.compile every transformer block (regional); both = eager and compiled rows "
                        "(default: on on GPUs, off on CPU)")
    b.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="ditmesh rows replay each step from a CUDA graph; adds a 1-GPU ditmesh row "
                        "(CUDA only; default: on on GPUs)")
    b.add_argument("--ulysses-chunks", type=int, default=None,
                   help="head groups pipelined per Ulysses attention (default: 2 on CUDA in eager mode, else 1)")
    b.add_argument("--transport", default="nccl",
                   help="ditmesh rows' Ulysses all-to-alls: nccl, or symm (copy engines; CUDA GPUs of one host)")
    b.add_argument("--profile", action="store_true",
                   help="add each row's per-step breakdown (compute / communication / idle) from the profiler (CUDA only)")
    b.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    b.add_argument("--out", default=None, help="JSON results (default bench/results/<model>-<HxW>-<time>.json); "
                                               "a .md table and a .png plot are written next to it")
    b.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    b.set_defaults(func=run_bench)


def _error_text(exc: BaseException) -> str:
    """A failed row's note: the exception's type and first line."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _worker(spec: dict) -> None:
    import torch.distributed as dist

    from .api import parallelize
    from .comm import all_gather_object
    from .config import ParallelConfig
    from .mesh import default_device
    from .models.base import adapter_for
    from .runtime.generate import _init_distributed
    from .runtime.report import device_name
    from .shared import DTYPES
    from .synth import build_transformer, get_arch

    device = default_device()
    _init_distributed(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = DTYPES[spec["dtype"]]
    arch = get_arch(spec["model"])
    model = build_transformer(arch, seed=0, device=device, dtype=dtype)
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(1)
    shape = dict(height=spec["height"], width=spec["width"])
    if spec.get("frames"):
        shape["frames"] = spec["frames"]
    inputs = adapter.example_inputs(model, batch=spec.get("batch", 1), text_len=arch.max_sequence_length,
                                    generator=gen, device=device, dtype=dtype, **shape)

    class _Pipe:  # parallelize() needs only `.transformer`
        transformer = model

    row = {"method": spec["method"], "gpus": spec["gpus"], "height": spec["height"], "width": spec["width"],
           "compiled": spec["compile"], "graph": spec.get("graph", False), "model": spec["model"], "dtype": spec["dtype"]}
    ours = False  # parallelize() compiles our rows itself; peers and plain diffusers are compiled below
    try:
        if spec["method"].startswith("diffusers-"):
            from .bench_peers import enable_diffusers

            enable_diffusers(model, spec["method"], spec["degrees"])
        elif spec["method"].startswith("xdit-"):
            from .bench_peers import enable_xdit

            model = enable_xdit(model, arch.transformer, spec, text_len=arch.max_sequence_length)
        elif spec["method"] != "single" or row["graph"]:  # plain "single" rows are diffusers as it is
            runtime = parallelize(_Pipe, ParallelConfig(**spec["degrees"]), device=device, cuda_graph=row["graph"],
                                  ulysses_chunks=spec.get("chunks"), compile=spec["compile"],
                                  transport=spec.get("transport", "nccl"))
            ours = True
            sp = runtime.sequence()
            if sp is not None and sp.ulysses_degree > 1 and sp.ring_degree == 1:  # USP runs one group
                row["ulysses_chunks"] = sp.ulysses_chunks  # head groups as resolved (the default depends on compile)
                row["transport"] = sp.transport
    except Exception as exc:  # noqa: BLE001  (a configuration that cannot run is a row with its error)
        row["error"] = _error_text(exc)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # steady state: weights as placed + activations
    if "error" not in row:
        if spec["compile"] and not ours:
            from .api import compile_blocks

            compile_blocks(model, adapter)
        times = []
        with torch.no_grad():
            for i in range(spec["warmup"] + spec["steps"]):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if dist.is_initialized():
                    dist.barrier()
                t0 = time.perf_counter()
                try:
                    out = model(**inputs)[0]
                except Exception as exc:  # noqa: BLE001
                    row["error"] = _error_text(exc)
                    break
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= spec["warmup"]:
                    times.append(time.perf_counter() - t0)
    if "error" not in row and spec.get("profile") and device.type == "cuda":
        from .profiling import profile_step

        if dist.is_initialized():
            dist.barrier()  # start together, so that start-up skew does not read as communication
        try:
            with torch.no_grad():
                row["breakdown"] = profile_step(lambda: model(**inputs), device)
        except Exception as exc:  # noqa: BLE001  (the row keeps its timing; every rank goes on)
            row["breakdown_error"] = _error_text(exc)
    if "error" not in row:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        peaks = all_gather_object(peak)
        row.update(step_ms=round(statistics.median(times) * 1e3, 3), step_ms_all=[round(t * 1e3, 3) for t in times],
                   peak_gib_per_gpu=round(max(peaks) / 2**30, 3), card=device_name(device))
        if rank == 0:
            torch.save(out.float().cpu(), Path(spec["tmp"]) / f"{_key(row)}.pt")
    if rank == 0:
        with open(Path(spec["tmp"]) / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"ditmesh bench row: {json.dumps({k: v for k, v in row.items() if k != 'step_ms_all'})}", flush=True)
    if dist.is_initialized():
        from .runtime.generate import end_rank_process

        dist.barrier()
        end_rank_process(0)


def _key(row: dict) -> str:
    return f"{row['method']}-{row['gpus']}-{'c' if row.get('compiled') else 'e'}{'g' if row.get('graph') else ''}"


def run_bench(args) -> int:
    """Run every configuration, then print a Markdown table and write JSON, Markdown and a plot."""
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    from .api import check_transport, check_ulysses_chunks
    from .config import ConfigError
    from .runtime.launch import launch_local
    from .runtime.report import versions
    from .shared import write_json
    from .synth import get_arch
    from .testing import rel_err

    on_gpu = torch.cuda.is_available()
    model = args.model or ("flux-dev" if on_gpu else "flux-tiny")
    arch = get_arch(model)
    height = args.height or arch.default_size[0]
    width = args.width or arch.default_size[1]
    available = torch.cuda.device_count() if on_gpu else 2
    try:
        gpus = [int(g) for g in (args.gpus or ",".join(str(g) for g in (1, 2, 4) if g <= available)).split(",")]
    except ValueError:
        raise ConfigError(f"--gpus {args.gpus}: give process counts like 1,2,4") from None
    if max(gpus) > available:
        raise ConfigError(f"--gpus {args.gpus}: only {available} {'GPUs' if on_gpu else 'CPU processes'} here")
    args.methods = args.methods or (GPU_METHODS if on_gpu else "ulysses")
    args.compile = args.compile or ("on" if on_gpu else "off")
    args.cuda_graph = on_gpu if args.cuda_graph is None else args.cuda_graph
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"--methods: unknown method {m!r}; known: {', '.join(METHODS)}")
    if (args.cuda_graph or args.profile) and not on_gpu:
        raise ConfigError(f"{'--cuda-graph' if args.cuda_graph else '--profile'} needs CUDA GPUs; none are visible here")
    check_ulysses_chunks(args.ulysses_chunks, "--ulysses-chunks ")
    check_transport(args.transport, torch.device("cuda" if on_gpu else "cpu"), "--transport ")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    compiled = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    tmp = tempfile.mkdtemp(prefix="ditmesh-bench-")
    peer = lambda m: m.startswith(tuple(f"{p}-" for p in PEERS))  # noqa: E731
    plan = [("single", 1, False, False)] + [("single", 1, True, False)] * (True in compiled)
    plan += [("single", 1, c, True) for c in compiled if args.cuda_graph]  # ditmesh on one GPU
    plan += [(m, g, c, args.cuda_graph and not peer(m)) for c in compiled for g in gpus if g > 1 for m in methods]
    for method, g, comp, graph in plan:
        degrees = METHODS[method](g)
        spec = dict(model=model, height=height, width=width, frames=args.frames, batch=args.batch, method=method,
                    gpus=g, degrees=degrees, steps=args.steps, warmup=max(args.warmup, 2 if graph else 0), compile=comp,
                    graph=graph, chunks=args.ulysses_chunks, transport=args.transport, profile=args.profile,
                    dtype=dtype, tmp=tmp)
        label = f"{method} on {g} process(es){' compiled' if comp else ''}{' + CUDA graph' if graph else ''}"
        product = 1
        for d in degrees.values():
            product *= d
        if degrees and product != g:
            _append(tmp, {"method": method, "gpus": g, "compiled": comp, "graph": graph,
                          "error": f"{method} needs another GPU count"})
            continue
        print(f"ditmesh bench: {label} ...", flush=True)
        try:
            launch_local(g, ["bench", "--worker", json.dumps(spec)])
        except Exception as exc:  # noqa: BLE001  (a failed configuration is a row, not the end of the run)
            _append(tmp, {"method": method, "gpus": g, "compiled": comp, "graph": graph,
                          "error": str(exc).splitlines()[0]})
    rows = [json.loads(line) for line in open(Path(tmp) / "rows.jsonl")]
    ref_path = Path(tmp) / "single-1-e.pt"
    if not ref_path.exists():
        ref_path = Path(tmp) / "single-1-c.pt"  # the eager row failed or was cut short
    ref = torch.load(ref_path) if ref_path.exists() else None
    singles = [r for r in rows if r.get("method") == "single" and "step_ms" in r]
    base = {r.get("compiled"): r["step_ms"] for r in singles if not r.get("graph")}  # diffusers on one GPU
    ours = {r.get("compiled"): r["step_ms"] for r in singles if r.get("graph")}  # ditmesh (CUDA graph) on one GPU
    info = versions()
    for r in rows:
        out = Path(tmp) / f"{_key(r)}.pt"
        if ref is not None and out.exists():
            r["rel_err_vs_1gpu"] = rel_err(torch.load(out), ref)
        b = base.get(r.get("compiled"))
        if b and "step_ms" in r:
            r["speedup_vs_1gpu"] = round(b / r["step_ms"], 3)
            r["efficiency"] = round(b / r["step_ms"] / r["gpus"], 3)
            r["e2e_28_steps_s"] = round(r["step_ms"] * 28 / 1e3, 3)
        if ours.get(r.get("compiled")) and "step_ms" in r:
            r["speedup_vs_our_1gpu"] = round(ours[r.get("compiled")] / r["step_ms"], 3)
        r["versions"] = info
        r.setdefault("height", height)
        r.setdefault("width", width)
    stem = f"{model}-{height}x{width}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_path = Path(args.out or f"bench/results/{stem}.json")
    write_json(out_path, {"model": model, "height": height, "width": width, "frames": args.frames,
                          "batch": args.batch, "rows": rows})
    table = markdown_table(rows)
    out_path.with_suffix(".md").write_text(table + "\n")
    plotted = _plot(rows, out_path.with_suffix(".png"), f"{model} {height}x{width}")
    print(table)
    print(f"ditmesh bench: wrote {out_path}, {out_path.with_suffix('.md')}" + (f", {plotted}" if plotted else ""))
    return 0


def _append(tmp: str, row: dict) -> None:
    with open(Path(tmp) / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _plot(rows: list[dict], path: Path, title: str) -> str | None:
    """Latency and speedup against GPU count, one line per method (needs matplotlib; skipped without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[str, list] = {}
    for r in rows:
        if "step_ms" in r:
            name = r["method"] + (" (compiled)" if r.get("compiled") else "") + (" +graph" if r.get("graph") else "")
            series.setdefault(name, []).append((r["gpus"], r["step_ms"], r.get("speedup_vs_1gpu", 0)))
    singles = {k: v for k, v in series.items() if k.startswith("single")}
    for name, points in series.items():
        if name.startswith("single"):
            continue
        mode = (" (compiled)" if "compiled" in name else "") + (" +graph" if name.endswith("+graph") else "")
        base = singles.get("single" + mode, [])
        points = sorted(base + points)
        ax1.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax2.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=name)
    ax1.set(xlabel="GPUs", ylabel="ms per step", title=title)
    ax2.set(xlabel="GPUs", ylabel="speedup vs 1 GPU", title="speedup")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (with the profiler's breakdown where rows have one)."""
    head = ("| method | gpus | compiled | graph | step ms | speedup | efficiency | peak GiB/GPU | rel err vs 1 "
            "| compute / comm exposed / idle ms | note |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r.get("rel_err_vs_1gpu")
        b = r.get("breakdown")
        split = f"{b['compute_ms']} / {b['comm_exposed_ms']} / {b['idle_ms']}" if b else ""
        lines.append(
            f"| {r['method']} | {r['gpus']} | {r.get('compiled', '')} | {r.get('graph', False)} | {r.get('step_ms', '')} "
            f"| {r.get('speedup_vs_1gpu', '')} | {r.get('efficiency', '')} | {r.get('peak_gib_per_gpu', '')} "
            f"| {'' if err is None else f'{err:.2e}'} | {split} | {r.get('error', '')} |"
        )
    return "\n".join(lines)
