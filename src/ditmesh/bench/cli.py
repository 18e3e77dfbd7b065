"""``ditmesh bench`` command line: the options, and the run that launches every configuration.

Each configuration runs in its own set of local processes (one per GPU; gloo processes on a CPU-only
machine), on the same seeded weights and inputs: the transformer of a synthetic architecture, one
denoising step's inputs as the pipeline builds them. Rows: median step time over ``--steps`` timed
steps after ``--warmup`` steps, peak memory per GPU, and the relative error of the output against the
1-process run. The workers share one temporary folder, removed when the run ends, also on an error or
Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

#: method name -> degrees for g processes. Peers run with the same degrees as ours, on the same weights and
#: inputs: ``diffusers-*`` rows are diffusers' own context parallelism (``enable_parallelism``), ``xdit-*`` rows
#: are xDiT's FLUX wrapper with its USP attention (optional: needs xfuser 0.7, see ``peers.enable_xdit``).
METHODS = {
    "single": lambda g: {},
    "ulysses": lambda g: {"ulysses": g},
    "ring": lambda g: {"ring": g},
    "usp": lambda g: {"ulysses": g // 2, "ring": 2} if g >= 4 else {"ulysses": 0},  # 2-D needs >= 4
    "tp": lambda g: {"tp": g},
    "tp-ulysses": lambda g: {"tp": 2, "ulysses": g // 2} if g >= 4 else {"tp": 0},
    "tp4-ulysses": lambda g: {"tp": 4, "ulysses": g // 4} if g >= 8 else {"tp": 0},
    "cfg": lambda g: {"cfg": 2, "ulysses": g // 2} if g > 2 else {"cfg": 2},
    # PipeFusion (pp patches, 1 exact warm-up step; the measured steps are the stale pipeline's): approximate
    "pp": lambda g: {"pp": g},
    "pp-ulysses": lambda g: {"pp": 2, "ulysses": g // 2} if g >= 4 else {"pp": 0},
    # displaced attention over g ulysses ranks (1 exact warm-up step; the measured steps are stale): approximate
    # (``parallel.displaced``)
    "displaced": lambda g: {"ulysses": g},
}
#: warm-up calls a graphed row needs before its timed calls replay: each graph's first call runs without it and its
#: second is captured; displaced attention's first step is exact and its stale steps alternate between two graphs
#: (one per step parity), so its fifth call is the second capture
GRAPH_WARMUP = {"displaced": 5}
#: peers, each measured with our ulysses/ring/usp degrees as ``<peer>-<method>``
PEERS = ("diffusers", "xdit")
METHODS.update({f"{peer}-{m}": METHODS[m] for peer in PEERS for m in ("ulysses", "ring", "usp")})
#: one-GPU peers: diffusers with torchao's fp8 linears (every linear of the transformer, dynamic per-row activation
#: and weight scales: the flux-fast recipe without FA3), its blocks compiled as ours are (``peers.enable_torchao_fp8``)
SINGLE_PEERS = ("torchao-fp8",)
METHODS.update({m: METHODS["single"] for m in SINGLE_PEERS})

#: what a GPU run measures when ``--methods`` is not given: ours and both peers, side by side
GPU_METHODS = "ulysses,diffusers-ulysses,xdit-ulysses"


def add_bench_parser(sub) -> None:
    """Register ``bench`` on an ``argparse`` subparsers object."""
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
    b.add_argument("--row-timeout", type=float, default=None, metavar="S",
                   help="stop a row still running after S seconds (its error says so) and go on with the next "
                        "(default: none)")
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
    b.add_argument("--fuse-qkv", action="store_true",
                   help="ditmesh rows compute Q, K and V with one GEMM (parallelize(fuse_qkv=True))")
    b.add_argument("--cache", default=None, metavar="POLICY",
                   help="ditmesh rows run with this step cache (--cache of generate); the timed calls are steps "
                        "0, 1, ... of one run, on the same inputs (rows note the cached steps)")
    b.add_argument("--comm-dtype", default="auto", metavar="LIST",
                   help="ditmesh rows' sequence-parallel payloads: auto, fp8, or a comma list (auto,fp8: each row "
                        "twice, side by side; fp8 only on rows with ulysses or ring > 1). docs/quantization.md")
    b.add_argument("--attention", default="default", metavar="LIST",
                   help="ditmesh rows' attention: default (exact), fp8 (cuDNN, Hopper+), fp8-emulated, or a comma "
                        "list (default,fp8: each row twice); the 8-bit kernel on one GPU or under ulysses alone")
    b.add_argument("--quant", default="off", metavar="LIST",
                   help="ditmesh rows' block linears: off, fp8, fp8-weight, int8-weight, each optionally with "
                        ":keep-modulation or :quant-modulation (the AdaLN modulation linears in the model's dtype or "
                        "in 8 bits; default: kept by fp8-weight, quantized by the others), or a comma list of them "
                        "(off,fp8: each row twice, side by side). docs/quantization.md")
    b.add_argument("--quant-backend", default="auto", metavar="NAME",
                   help="with --quant, who does the 8-bit work in ditmesh's rows: auto (on CUDA scaled-mm for fp8, torchao for "
                        "the weight-only modes), torchao, "
                        "scaled-mm (ditmesh's own layer, torch._scaled_mm on plain tensors), emulated")
    b.add_argument("--no-single", action="store_true",
                   help="skip the 1-GPU rows (diffusers eager and compiled, ditmesh's 1-GPU CUDA-graph row): for "
                        "comparing multi-GPU rows only; rows then have no speedup or error columns")
    b.add_argument("--no-diffusers", action="store_true",
                   help="skip diffusers' own 1-GPU rows (eager and compiled) and keep ditmesh's 1-GPU row: for a "
                        "second call that adds ditmesh variants beside rows already measured; rows then have no "
                        "speedup or error columns")
    b.add_argument("--lora", default=None, metavar="RANK",
                   help="ditmesh rows (and the 1-process row, their reference) are timed three times more in the "
                        "same process: with a synthetic rank-RANK LoRA on every attention projection, loaded after "
                        "parallelize, then with it fused, then fused with peft's layers taken out (needs peft: "
                        "pip install 'ditmesh[lora]'; no CUDA graph)")
    b.add_argument("--profile", action="store_true",
                   help="add each row's per-step breakdown (compute / communication / idle) from the profiler (CUDA only)")
    b.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    b.add_argument("--baseline-src", default=None, metavar="DIR",
                   help="A/B: first run the same command with the ditmesh package in DIR (e.g. the src/ of an older "
                        "checkout), then this one; rows carry tree=baseline|current and the table compares them")
    b.add_argument("--out", default=None,
                   help="results JSON (default: $DITMESH_BENCH_DIR, else ~/.cache/ditmesh/bench/, "
                        "<model>-<HxW>-<time>.json); a .md table and a .png plot are written next to it")
    b.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    b.set_defaults(func=run_bench)


def run_bench(args) -> int:
    """Run every configuration, then print a Markdown table and write the results (``report.write``)."""
    if args.worker:
        from .worker import run_worker

        run_worker(json.loads(args.worker))
        return 0
    from ..runtime.report import device_name, versions
    from . import report

    settings = _settings(args)
    available = settings.pop("available")
    out_path = Path(args.out) if args.out else report.default_out_path(settings["model"], settings["height"],
                                                                        settings["width"])
    tmp = tempfile.mkdtemp(prefix="ditmesh-bench-")
    stopped = None
    try:
        rows = []
        if settings["baseline_src"]:
            rows += [dict(r, tree="baseline") for r in _baseline_rows(args, settings, tmp)]
        try:
            current = _measure(settings, Path(tmp) / "current")
        except RowsInterrupted as exc:  # the rows measured before the stop are written, then the run ends
            current, stopped = exc.rows, exc
        rows += [dict(r, tree="current") for r in current] if settings["baseline_src"] else current
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if stopped is not None and not any("step_ms" in r for r in current):
        raise stopped  # stopped before any row was measured: nothing to write
    on_gpu = torch.cuda.is_available()
    doc = report.document(
        command=["ditmesh", *_typed(args)], settings=settings,
        card=device_name(torch.device("cuda" if on_gpu else "cpu")), device_count=available,
        versions={**versions(), **_peer_versions()}, rows=rows, model=settings["model"], height=settings["height"],
        width=settings["width"], frames=settings["frames"], batch=settings["batch"], dtype=settings["dtype"])
    written = report.write(out_path, doc)
    print(report.markdown(doc))
    print(f"ditmesh bench: wrote {', '.join(str(p) for p in written)}")
    return 0 if stopped is None else stopped.code


def _peer_versions() -> dict[str, str]:
    """Versions of the optional peers that are installed, from their metadata (nothing is imported)."""
    from importlib import metadata

    out = {}
    for name in ("xfuser", "yunchang", "distvae"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _typed(args) -> list[str]:
    """The command line as typed, after ``ditmesh`` (set by ``ditmesh.cli.main``; else the process's own)."""
    return list(getattr(args, "argv", None) or sys.argv[1:])


def _settings(args) -> dict:
    """Every option resolved (GPU or CPU defaults) and checked; bad input raises ConfigError before any work."""
    from ..config import ConfigError
    from ..options import QUANT_BACKENDS, RunOptions, quant_variants
    from ..shared import DTYPES
    from ..synth import get_arch

    # the paths first: checked before the model's architecture is looked up (which imports diffusers)
    if args.out and (Path(args.out).suffix != ".json" or Path(args.out).is_dir()):
        raise ConfigError(f"--out {args.out}: give a .json file path (the .md table and .png plot go next to it)")
    if args.baseline_src and not (Path(args.baseline_src) / "ditmesh" / "__init__.py").is_file():
        raise ConfigError(f"--baseline-src {args.baseline_src}: no ditmesh package there (expected "
                          f"{Path(args.baseline_src) / 'ditmesh' / '__init__.py'}); give a source folder such as "
                          "the src/ of another checkout")
    on_gpu = torch.cuda.is_available()
    model = args.model or ("flux-dev" if on_gpu else "flux-tiny")
    arch = get_arch(model)  # an unknown name raises a ValueError that lists the known ones
    available = torch.cuda.device_count() if on_gpu else 2
    try:
        gpus = [int(g) for g in (args.gpus or ",".join(str(g) for g in (1, 2, 4) if g <= available)).split(",")]
    except ValueError:
        raise ConfigError(f"--gpus {args.gpus}: give process counts like 1,2,4") from None
    if min(gpus) < 1:
        raise ConfigError(f"--gpus {args.gpus}: process counts must be >= 1, e.g. 1,2,4")
    if max(gpus) > available:
        raise ConfigError(f"--gpus {args.gpus}: only {available} {'GPUs' if on_gpu else 'CPU processes'} here")
    methods = [m.strip() for m in (args.methods or (GPU_METHODS if on_gpu else "ulysses")).split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"--methods: unknown method {m!r}; known: {', '.join(METHODS)}")
    if args.no_single and max(gpus) == 1:
        raise ConfigError(f"--no-single with --gpus {args.gpus}: no row is left; give a count above 1, e.g. --gpus 4")
    cuda_graph = on_gpu if args.cuda_graph is None else args.cuda_graph
    if (cuda_graph or args.profile) and not on_gpu:
        raise ConfigError(f"{'--cuda-graph' if cuda_graph else '--profile'} needs CUDA GPUs; none are visible here")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps {args.steps} --warmup {args.warmup}: give at least 1 timed step and 0 or more "
                          "warm-ups")
    if args.row_timeout is not None and not args.row_timeout > 0:
        raise ConfigError(f"--row-timeout {args.row_timeout}: give the seconds a row may take, above 0 (e.g. 180)")
    # the options every ditmesh row shares, checked as generate checks them (each row's degrees come later)
    RunOptions.create(ulysses_chunks=args.ulysses_chunks, transport=args.transport, cache=args.cache,
                      fuse_qkv=args.fuse_qkv, cli=True).validate(device=torch.device("cuda" if on_gpu else "cpu"),
                                                                 cli=True)
    lora = _lora_rank(args)
    if lora:  # the LoRA rows run without a CUDA graph (on GPUs the default is with one)
        cuda_graph = False
    comm_dtypes, attentions = _eight_variants(args, methods)
    quants = quant_variants(args.quant)
    if args.quant_backend not in QUANT_BACKENDS:
        raise ConfigError(f"--quant-backend {args.quant_backend!r} is not a backend of the 8-bit linears; use one of "
                          f"{', '.join(QUANT_BACKENDS)}")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    cpu = None
    if not on_gpu:  # one thread policy: every row's ranks, the 1-process reference included, get the threads of the
        # widest row's ranks (else the reference runs on every core and the speed-ups count threads, not ranks)
        from ..shared import cpu_load, cpu_threads

        threads = int(os.environ.get("OMP_NUM_THREADS") or cpu_threads(max(gpus)))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the rows' launcher passes it on to every rank
        cpu = {"threads_per_rank": threads, **cpu_load(threads * max(gpus))}
        if cpu["warning"]:
            print(cpu["warning"], file=sys.stderr, flush=True)
    return dict(model=model, height=args.height or arch.default_size[0], width=args.width or arch.default_size[1],
                frames=args.frames, batch=args.batch, gpus=gpus, methods=methods, steps=args.steps,
                warmup=args.warmup, compile=args.compile or ("on" if on_gpu else "off"), cuda_graph=cuda_graph,
                ulysses_chunks=args.ulysses_chunks, transport=args.transport, fuse_qkv=args.fuse_qkv,
                profile=args.profile, dtype=dtype, available=available, cache=args.cache, single=not args.no_single,
                diffusers=not args.no_diffusers,
                lora=lora, comm_dtypes=comm_dtypes, attentions=attentions, quants=quants,
                quant_backend=args.quant_backend, row_timeout=args.row_timeout, cpu=cpu,
                baseline_src=str(Path(args.baseline_src).resolve()) if args.baseline_src else None)


def _eight_variants(args, methods: list[str]) -> tuple[list[str], list[str]]:
    """``--comm-dtype`` and ``--attention`` as lists, each value checked (``options.RunOptions.validate``)."""
    from ..config import ConfigError
    from ..options import ATTENTION_MODES, COMM_DTYPES, refuse_retired_attention

    comm = [c.strip() for c in args.comm_dtype.split(",") if c.strip()]
    attention = [a.strip() for a in args.attention.split(",") if a.strip()]
    for mode in attention:
        refuse_retired_attention(mode, "--attention ")
    for flag, values, known in (("--comm-dtype", comm, COMM_DTYPES), ("--attention", attention, ATTENTION_MODES)):
        bad = [v for v in values if v not in known] or ([] if values else [""])
        if bad:
            raise ConfigError(f"{flag} {bad[0]!r} is not one of {', '.join(known)} (a comma list of them runs each)")
    if (set(attention) - {"default"}) and any(m.startswith(("ring", "usp", "pp", "displaced")) for m in methods):
        raise ConfigError(f"--attention {args.attention}: the 8-bit attention runs on one GPU or under ulysses "
                          "alone; leave ring, usp, pp and displaced out of --methods")
    return comm, attention


def _lora_rank(args) -> int | None:
    """``--lora``'s rank, checked against the options it cannot run with (``None`` without ``--lora``)."""
    import importlib.util

    from ..config import ConfigError

    if args.lora is None:
        return None
    if not args.lora.isdigit() or int(args.lora) < 1:
        raise ConfigError(f"--lora {args.lora}: give the adapter's rank, a whole number >= 1 (e.g. 64)")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora needs peft (diffusers loads adapters through it): pip install 'ditmesh[lora]'")
    if args.cuda_graph:  # a graph captured before the adapter would replay the kernels of the plain model
        raise ConfigError("--lora cannot run with --cuda-graph (the graph holds the model without the adapter); "
                          "use --no-cuda-graph")
    for given, name in ((args.cache, "--cache"), (args.fuse_qkv, "--fuse-qkv")):
        if given:  # a step cache's decisions span the phases; fused Q/K/V would bypass an adapter on to_q/to_k/to_v
            raise ConfigError(f"--lora cannot run with {name}; leave {name} out")
    return int(args.lora)


def _measure(s: dict, tmp: Path) -> list[dict]:
    """Launch every configuration of the settings ``s``; return the rows with their derived columns."""
    from ..runtime.launch import Interrupted, launch_local
    from .worker import append_row

    tmp.mkdir()
    interrupted = None
    compiled = {"off": [False], "on": [True], "both": [False, True]}[s["compile"]]
    peer = lambda m: m.startswith(tuple(f"{p}-" for p in PEERS)) or m in SINGLE_PEERS  # noqa: E731
    plan = []
    if s["single"]:  # diffusers eager (and compiled) on one GPU, then ditmesh on one GPU
        if s.get("diffusers", True):
            plan += [("single", 1, False, False)] + [("single", 1, True, False)] * (True in compiled)
        plan += [("single", 1, c, True) for c in compiled if s["cuda_graph"]]
    plan += [(m, 1, c, False) for m in s["methods"] if m in SINGLE_PEERS for c in compiled]  # one GPU whatever --gpus
    plan += [(m, g, c, s["cuda_graph"] and not peer(m)) for c in compiled for g in s["gpus"]
             if g > 1 for m in s["methods"] if m not in SINGLE_PEERS]
    retried: dict[tuple, str] = {}
    variants = [(c, a, q) for q in s.get("quants", ["off"]) for c in s.get("comm_dtypes", ["auto"])
                for a in s.get("attentions", ["default"])]
    # ditmesh's rows (not the peers', not plain diffusers') run once per --quant x --comm-dtype x --attention variant
    # that fits
    plan = [(m, g, c, graph, variant) for m, g, c, graph in plan
            for variant in (variants if not peer(m) and (m != "single" or graph) else [("auto", "default", "off")])
            if variant[0] == "auto" or g > 1]
    for method, g, comp, graph, (comm_dtype, attention, quant) in plan:
        degrees = METHODS[method](g)
        product = 1
        for d in degrees.values():
            product *= d
        if degrees and product != g:
            append_row(tmp, {"method": method, "gpus": g, "compiled": comp, "graph": graph,
                             "error": f"{method} needs another GPU count"})
            continue
        spec = dict(model=s["model"], height=s["height"], width=s["width"], frames=s["frames"], batch=s["batch"],
                    method=method, gpus=g, degrees=degrees, steps=s["steps"],
                    warmup=max(s["warmup"], GRAPH_WARMUP.get(method, 2) if graph else 0), compile=comp, graph=graph,
                    chunks=s["ulysses_chunks"],
                    transport=s["transport"], fuse_qkv=s["fuse_qkv"], profile=s["profile"], dtype=s["dtype"],
                    cache=s.get("cache"), lora=None if peer(method) else s.get("lora"), tmp=str(tmp),
                    comm_dtype=comm_dtype, attention=attention, quant=quant,
                    quant_backend=s.get("quant_backend", "auto") if quant != "off" else "auto")
        label = (f"{method} on {g} process(es){' compiled' if comp else ''}{' + CUDA graph' if graph else ''}"
                 f"{' quant ' + quant if quant != 'off' else ''}"
                 f"{' comm ' + comm_dtype if comm_dtype != 'auto' else ''}"
                 f"{' attention ' + attention if attention != 'default' else ''}")
        print(f"ditmesh bench: {label} ...", flush=True)
        causes: list[str] = []  # a row's ranks that could not meet start once more on a fresh store
        named = {k: v for k, v, default in (("quant", quant, "off"), ("comm_dtype", comm_dtype, "auto"),
                                            ("attention", attention, "default")) if v != default}
        try:
            launch_local(g, ["bench", "--worker", json.dumps(spec)], log_dir=str(tmp / "launcher"),
                         on_retry=causes.append, timeout_s=s.get("row_timeout"))
        except Interrupted as exc:  # Ctrl-C or a SIGTERM ends the run, not one row: the rows done are still written
            append_row(tmp, {"method": method, "gpus": g, "degrees": degrees, "compiled": comp, "graph": graph,
                             **named, "error": "interrupted: the run was stopped while this row ran"})
            print(f"ditmesh bench: {label}: interrupted; writing the rows measured so far", flush=True)
            interrupted = exc
            break
        except Exception as exc:  # noqa: BLE001  (a failed configuration is a row, not the end of the run)
            append_row(tmp, {"method": method, "gpus": g, "degrees": degrees, "compiled": comp, "graph": graph,
                             **named, "error": str(exc).splitlines()[0]})
        if causes:
            print(f"ditmesh bench: {label}: started again on a fresh store after: {causes[0]}", flush=True)
            retried[(method, g, comp, graph, comm_dtype, attention, quant)] = causes[0]
    rows = [json.loads(line) for line in open(tmp / "rows.jsonl")]
    for r in rows:  # the row records why its first start failed
        cause = retried.get((r.get("method"), r.get("gpus"), r.get("compiled"), r.get("graph"),
                             r.get("comm_dtype", "auto"), r.get("attention", "default"), r.get("quant", "off")))
        if cause:
            r["rendezvous_retry"] = cause
    rows = _derive(rows, tmp, s)
    if interrupted is not None:
        raise RowsInterrupted(rows, interrupted.code)
    return rows


class RowsInterrupted(KeyboardInterrupt):
    """The run was stopped while a row ran: ``rows`` are those measured (the stopped one with its error)."""

    def __init__(self, rows: list[dict], code: int):
        super().__init__(f"interrupted (exit {code})")
        self.rows, self.code = rows, code


def _derive(rows: list[dict], tmp: Path, s: dict) -> list[dict]:
    """Add each row's error against the 1-process output and its speedups against the 1-GPU rows."""
    from ..testing import rel_err
    from .report import LORA_PHASES
    from .worker import row_key

    def reference(suffix: str):  # the eager 1-process output, else the compiled one (the eager row failed)
        paths = [tmp / f"single-1-{mode}{suffix}.pt" for mode in "ec"]
        return next((torch.load(p) for p in paths if p.exists()), None)

    ref, ref_lora = reference(""), reference("-lora")
    singles = [r for r in rows if r.get("method") == "single" and "step_ms" in r]
    base = {r.get("compiled"): r["step_ms"] for r in singles if not r.get("graph")}  # diffusers on one GPU
    ours = {r.get("compiled"): r["step_ms"] for r in singles if r.get("graph")}  # ditmesh (CUDA graph) on one GPU
    for r in rows:
        out = tmp / f"{row_key(r)}.pt"
        if ref is not None and out.exists():
            r["rel_err_vs_1gpu"] = rel_err(torch.load(out), ref)
        out_lora = tmp / f"{row_key(r)}-lora.pt"
        if ref_lora is not None and out_lora.exists():
            r["rel_err_lora_vs_1gpu"] = rel_err(torch.load(out_lora), ref_lora)
        for phase in LORA_PHASES:  # the adapter's cost, a fraction of the plain step
            if f"step_ms_lora_{phase}" in r:
                r[f"lora_{phase}_overhead"] = round(r[f"step_ms_lora_{phase}"] / r["step_ms"] - 1, 4)
        b = base.get(r.get("compiled"))
        if b and "step_ms" in r:
            r["speedup_vs_1gpu"] = round(b / r["step_ms"], 3)
            r["efficiency"] = round(b / r["step_ms"] / r["gpus"], 3)
            r["e2e_28_steps_s"] = round(r["step_ms"] * 28 / 1e3, 3)
        if ours.get(r.get("compiled")) and "step_ms" in r:
            r["speedup_vs_our_1gpu"] = round(ours[r.get("compiled")] / r["step_ms"], 3)
        r.setdefault("height", s["height"])
        r.setdefault("width", s["width"])
    return rows


def _baseline_rows(args, s: dict, tmp: str) -> list[dict]:
    """The same command, run first with the ditmesh package of ``--baseline-src`` ahead on the path."""
    from ..shared import strip_option

    out = Path(tmp) / "baseline.json"  # a later --out wins over the command's own
    argv = strip_option(_typed(args), "--baseline-src") + ["--out", str(out)]
    path = os.pathsep.join(p for p in (s["baseline_src"], os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, TMPDIR=tmp)  # what an older tree leaves in its TMPDIR goes with ours
    print(f"ditmesh bench: baseline tree {s['baseline_src']} ...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "ditmesh", *argv], env=env)
    if proc.returncode != 0 or not out.exists():
        from ..runtime.launch import LaunchError

        raise LaunchError(f"--baseline-src {s['baseline_src']}: the baseline run exited with code {proc.returncode} "
                          "(its error is printed above)")
    return json.loads(out.read_text())["rows"]

