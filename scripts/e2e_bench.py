"""Seconds to an image as a user times them: ``ditmesh generate`` run from outside, row by row, in one call.

Each row is ``TREE:MODE:CACHE``. TREE is ``new`` (this checkout's ``src``) or ``old`` (``--baseline-src DIR``, a
folder holding an older ``ditmesh`` package, as ``ditmesh bench --baseline-src`` takes). MODE is one of ``1gpu``,
``ulysses``, ``ring``, ``tp``, ``pp``, ``displaced`` (over ``--gpus`` processes, 1 for ``1gpu``). CACHE is ``cold``
(compile caches empty: a fresh folder, copied into the shared one afterwards) or ``warm`` (the shared compile caches
after an earlier run of the same tree and mode; a warm-up run of ``--warmup-steps`` steps is made first where
there was none, several at once with ``--parallel-warmups``).

Per row: the wall time from outside, and from the run's report ``load_s``, the steady step (median of the step
latencies), the first step's extra, ``overhead = wall - load - steps x steady step``, and where the tree writes a
timeline (``generate --trace``), its split: launcher, imports (a forked rank's: its zygote's "shared imports",
taken out of the launcher's share), checks, text encoding, VAE decode, writing, and what
came after the report (exit). "One import" (``import torch, diffusers; from diffusers import FluxPipeline``) is
timed in the same call. Writes ``e2e.json`` (every row, the reports' timelines included: ``ditmesh.timeline.
chrome_trace`` makes a Chrome trace of any row) and ``e2e.md`` (the table) into ``--out``; prints the table.

On GPUs (issue 32)::

    python3 scripts/e2e_bench.py --synth flux-dev --model /tmp/flux-dev --gpus 4 --height 1024 --width 1024 \\
        --steps 28 --compile --cuda-graph --baseline-src old/src --parallel-warmups --deadline-s 540 --out $OUT \\
        --rows new:ulysses:cold,new:ulysses:warm,old:ulysses:warm,new:1gpu:warm,new:pp:warm,new:displaced:warm

On CPU (a dry run: flux-tiny, gloo, 2 processes)::

    python scripts/e2e_bench.py --cpu-dry-run --out /tmp/e2e --baseline-src /tmp/base/src \\
        --rows new:ulysses:cold,new:ulysses:warm,old:ulysses:warm,new:1gpu:warm,new:pp:warm,new:displaced:warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_IMPORT = "import torch, diffusers; from diffusers import FluxPipeline"
MODES = {"1gpu": [], "ulysses": ["--ulysses", "{n}"], "ring": ["--ring", "{n}"], "tp": ["--tp", "{n}"],
         "pp": ["--pp", "{n}"], "displaced": ["--ulysses", "{n}", "--displaced"]}
#: the compile caches a run reads and writes (inductor's FX graphs and AOT autograd results, triton's kernels)
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
#: a row's time when nothing of its kind ran yet, to decide whether it fits before the deadline (seconds)
GUESS_S = {"cpu": 60.0, "gpu": 120.0}


class Bench:
    """One call's state: the settings, the shared compile caches, the rows measured and skipped."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="ditmesh-e2e-"))
        # the compile caches the warm rows share: a folder of the call's own, or --shared-cache (the serve rows
        # that follow in gpu_issue32.sh then find the same graphs: the cache is content-addressed)
        self.shared_cache = Path(args.shared_cache) if args.shared_cache else self.work / "compile"
        self.warmed: set[tuple[str, str]] = set()
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.walls: dict[str, float] = {}
        self.warmups: list[dict] = []

    # -- running one command -------------------------------------------------------------------------------------
    def env(self, tree: str, cache: Path) -> dict:
        src = str(ROOT / "src") if tree == "new" else str(Path(self.args.baseline_src).resolve())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
                   TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
        if self.args.cpu_dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("DITMESH_LAUNCH_START", None)
        return env

    def left_s(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - self.start)

    def run(self, cmd: list[str], env: dict, log: Path) -> tuple[int, float]:
        """Run ``cmd`` in its own process group (ended whole at the deadline); returns (exit code, wall seconds)."""
        start = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, cwd=self.work, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=max(1.0, self.left_s()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = -9
        return code, time.perf_counter() - start

    def generate(self, tree: str, mode: str, steps: int, name: str, cache: Path, trace: bool,
                 env: dict | None = None, more: tuple = ()) -> tuple[int, float, Path]:
        a = self.args
        nproc = 1 if mode == "1gpu" else a.gpus
        flags = [f.format(n=nproc) for f in MODES[mode]]
        report = self.work / f"{name}.json"
        cmd = [sys.executable, "-m", "ditmesh", "generate", "--model", a.model, "--nproc", str(nproc), *flags,
               "--steps", str(steps), "--height", str(a.height), "--width", str(a.width),
               "--out", str(self.work / f"{name}.png"), "--report", str(report), *more, *a.extra]
        if a.compile:
            cmd.append("--compile")
        if a.cuda_graph and mode != "pp":  # PipeFusion runs no CUDA graphs (refused in one line)
            cmd.append("--cuda-graph")
        if trace:  # the timelines travel in e2e.json (ditmesh.timeline.chrome_trace makes a trace of any row)
            cmd += ["--trace", str(self.work / f"{name}.trace.json")]
        code, wall = self.run(cmd, dict(self.env(tree, cache), **(env or {})), self.work / f"{name}.log")
        return code, wall, report

    # -- rows ----------------------------------------------------------------------------------------------------
    def warm_up(self, keys: list[tuple[str, str]]) -> None:
        """A run of each (tree, mode) not run yet in the shared caches (``--warmup-steps`` steps: the stale steps of
        pp and displaced compile too), several at once with ``--parallel-warmups``."""
        todo = [k for k in dict.fromkeys(keys) if k not in self.warmed]
        if not todo:
            return

        workers = len(todo) if self.args.parallel_warmups else 1
        processes = sum(1 if mode == "1gpu" else self.args.gpus for _, mode in todo) if workers > 1 else 1
        # inductor starts a pool of compile workers per process: share the host's cores among the runs at once
        threads = {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}

        def one(key):
            tree, mode = key
            # --compile-artifacts: this tree's warm-up saves the compiled blocks its warm rows then load
            saves = ("--compile-artifacts", "save") if tree == "new" and self.args.compile_artifacts else ()
            code, wall, _ = self.generate(tree, mode, self.args.warmup_steps, f"warmup-{tree}-{mode}",
                                          self.shared_cache, trace=False, env=threads if workers > 1 else None,
                                          more=saves)
            return key, code, wall

        with ThreadPoolExecutor(workers) as pool:
            for (tree, mode), code, wall in pool.map(one, todo):
                print(f"e2e: warm-up {tree} {mode}: {wall:.1f} s (exit {code})", flush=True)
                self.warmups.append({"tree": tree, "mode": mode, "wall_s": round(wall, 3), "exit": code,
                                     "at_once": workers})
                if code == 0:
                    self.warmed.add((tree, mode))

    def guess_s(self, tree: str, mode: str, cache: str) -> float:
        """The seconds a row is expected to take: its own last wall time; else, warm with its warm-up done, that
        warm-up's (it compiled, so it took longer) or 1.3 x the longest warm row of its tree measured, whichever is less
        (a row that overruns is still ended at the deadline); else
        :data:`GUESS_S` (1.6 x when a warm-up must run first)."""
        if f"{tree}:{mode}" in self.walls:
            return self.walls[f"{tree}:{mode}"]
        fallback = GUESS_S["cpu" if self.args.cpu_dry_run else "gpu"]
        if cache == "warm" and (tree, mode) in self.warmed:
            warmup = next(w["wall_s"] for w in self.warmups if (w["tree"], w["mode"]) == (tree, mode))
            measured = [r["wall_s"] for r in self.rows if r["cache"] == "warm" and r["tree"] == tree]
            return min(warmup, 1.3 * max(measured)) if measured else warmup
        return fallback * (1.6 if cache == "warm" else 1.0)

    def row(self, spec: str) -> None:
        tree, mode, cache = spec.split(":")
        name = spec.replace(":", "-")
        if self.left_s() < self.guess_s(tree, mode, cache):
            self.skipped.append({"row": spec, "why": f"{self.left_s():.0f} s left before the deadline"})
            print(f"e2e: skipped {spec} ({self.left_s():.0f} s left)", flush=True)
            return
        if cache == "cold":
            private = self.work / f"compile-{name}"
            code, wall, report = self.generate(tree, mode, self.args.steps, name, private, trace=tree == "new")
            shutil.copytree(private, self.shared_cache, dirs_exist_ok=True)  # content-addressed: merging is safe
            if code == 0:
                self.warmed.add((tree, mode))
        else:
            self.warm_up([(tree, mode)])
            loads = ("--compile-artifacts", "load") if tree == "new" and self.args.compile_artifacts else ()
            code, wall, report = self.generate(tree, mode, self.args.steps, name, self.shared_cache, trace=tree == "new",
                                               more=loads)
        self.walls[f"{tree}:{mode}"] = wall
        if code != 0:
            self.skipped.append({"row": spec, "why": f"exit {code}; log {name}.log",
                                 "log_tail": (self.work / f"{name}.log").read_text()[-2000:]})
            print(f"e2e: {spec} failed (exit {code}):\n{(self.work / f'{name}.log').read_text()[-2000:]}", flush=True)
            return
        result = summarize(json.loads(report.read_text()), wall, self.args.steps)
        result.update(row=spec, tree=tree, mode=mode, cache=cache, nproc=1 if mode == "1gpu" else self.args.gpus)
        self.rows.append(result)
        print(f"e2e: {spec}: wall {wall:.1f} s, load {result['load_s']:.1f} s, overhead {result['overhead_s']:.1f} s",
              flush=True)


def _phase_s(timeline: dict, *names: str) -> float | None:
    spans = [p["end_s"] - p["start_s"] for p in timeline["phases"] if p["name"] in names]
    return round(sum(spans), 3) if spans else None


def summarize(report: dict, wall_s: float, steps: int) -> dict:
    """A row from a ``generate`` report and the wall time measured outside it."""
    latencies = report["step_latency_s"]
    steady = statistics.median(latencies[1:] or latencies)  # the later steps' (the first pays compile and capture)
    row = {"wall_s": round(wall_s, 3), "load_s": report["load_s"], "steady_step_s": round(steady, 5),
           "first_step_extra_s": report.get("first_step_extra_s"), "steps": len(latencies),
           "steps_s": round(steady * len(latencies), 3),
           "overhead_s": round(wall_s - report["load_s"] - steady * len(latencies), 3),
           "total_latency_s": report["total_latency_s"], "compile_breakdown_s": report.get("compile_breakdown_s"),
           "compile_artifacts": report.get("compile_artifacts"),
           "devices": report.get("devices"), "versions": report.get("versions"), "config": report.get("config")}
    timelines = report.get("timeline")
    if timelines:
        rank0 = timelines[0]
        end = max(p["end_s"] for p in rank0["phases"])
        shared = _phase_s(rank0, "shared imports") or 0.0  # forked ranks: their imports, done once in "launch"
        launch = _phase_s(rank0, "launch")
        row["split_s"] = {
            "launch": None if launch is None else round(launch - shared, 3),
            "imports": round((_phase_s(rank0, "imports") or 0.0) + shared, 3),
            "checks": _phase_s(rank0, "checks", "family checks"), "rendezvous": _phase_s(rank0, "rendezvous"),
            "load": _phase_s(rank0, "load"), "text_encoding": _phase_s(rank0, "text encoding"),
            "vae_decode": _phase_s(rank0, "vae decode"),
            "writing": _phase_s(rank0, "encode images", "write outputs", "write videos", "write report"),
            "after_report": round(wall_s - end, 3)}
        row["timeline"] = timelines
    return row


def serve_rows(bench: Bench) -> list[dict]:
    """Rows of a warm ``ditmesh serve`` (1 and 16 clients), timed from outside: none yet (issue 32, part 3). Each row
    is a dict with at least ``row``, ``wall_s`` and ``overhead_s``, added to the table and ``e2e.json``."""
    return []


def one_import_s(env: dict, runs: int) -> float:
    """Seconds of ``python -c "import torch, diffusers; from diffusers import FluxPipeline"``, the last of ``runs``
    (the earlier ones leave the bytecode and the files warm)."""
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", ONE_IMPORT], env=env, check=True, capture_output=True)
    return round(time.perf_counter() - start, 3)


#: what a forked rank's zygote runs (runtime/forked.py), as it runs it: its imports of PRELOAD (with torch's NVML
#: device check), the collector paused
ZYGOTE_IMPORTS = ("from ditmesh.runtime.forked import _preload\nfrom ditmesh.shared import imports_without_gc\n"
                  "with imports_without_gc():\n    _preload()")
#: the collector's seconds while ``code`` runs, printed last as ``gc <seconds> <full collections>``
_GC_TIMED = ("import gc, time\n_gc = [0.0, 0, 0.0]\ndef _cb(phase, info):\n    if phase == 'start':\n"
             "        _gc[2] = time.perf_counter()\n    else:\n        _gc[0] += time.perf_counter() - _gc[2]\n"
             "        _gc[1] += info['generation'] == 2\ngc.callbacks.append(_cb)\n{code}\n"
             "print('gc', round(_gc[0], 3), _gc[1])")


def _self_times(log: str) -> dict[str, float]:
    """Module -> its own seconds, from a ``python -X importtime`` log."""
    out = {}
    for line in log.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[0].split(":")[1].strip().isdigit():
            out[parts[2].strip()] = int(parts[0].split(":")[1]) / 1e6
    return out


def import_accounts(env: dict) -> dict:
    """Where a rank's imports go beyond "one import", measured here: the forked ranks' zygote's imports and one import,
    each once under ``python -X importtime`` (the rows ran before: the files and bytecode are warm), with the
    collector's seconds and full collections; the packages of the modules only the zygote imports (their own
    seconds, largest first) and of those only one import imports (the pipeline's classes, which a rank imports later,
    while it loads)."""
    runs = {}
    for name, code in (("zygote", ZYGOTE_IMPORTS), ("one_import", ONE_IMPORT)):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", _GC_TIMED.format(code=code)], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        gc_line = next((line.split() for line in proc.stdout.splitlines() if line.startswith("gc ")), None)
        runs[name] = {"wall_s": round(wall, 3), "exit": proc.returncode, "modules": _self_times(proc.stderr),
                      "gc_s": float(gc_line[1]) if gc_line else None, "gc_full": int(gc_line[2]) if gc_line else None}

    def by_package(only: dict[str, float]) -> list[list]:
        sums: dict[str, float] = {}
        for module, seconds in only.items():
            sums[module.split(".")[0]] = sums.get(module.split(".")[0], 0.0) + seconds
        return [[k, round(v, 3)] for k, v in sorted(sums.items(), key=lambda kv: -kv[1])]

    zygote, one = runs["zygote"]["modules"], runs["one_import"]["modules"]
    extra = {m: s for m, s in zygote.items() if m not in one}
    missing = {m: s for m, s in one.items() if m not in zygote}
    return {**{name: {k: v for k, v in r.items() if k != "modules"} for name, r in runs.items()},
            "zygote_only_s": round(sum(extra.values()), 3), "zygote_only": by_package(extra)[:12],
            "one_import_only_s": round(sum(missing.values()), 3), "one_import_only": by_package(missing)[:12]}


def imports_table(accounts: dict) -> str:
    """The import accounts as lines of text (printed after the rows' table)."""
    z, o = accounts["zygote"], accounts["one_import"]
    lines = ["| imports (-X importtime, one run each) | wall s | collector s | full collections |", "|---|---|---|---|"]
    for label, r in (("the forked ranks' zygote (runtime/forked.py PRELOAD, collector paused)", z),
                     ("one import", o)):
        lines.append(f"| {label} | {r['wall_s']:.2f} | {r['gc_s']} | {r['gc_full']} |")
    lines.append("")
    lines.append(f"only the zygote imports: {accounts['zygote_only_s']:.3f} s of their own: "
                 + ", ".join(f"{pkg} {s:.3f}" for pkg, s in accounts["zygote_only"]))
    lines.append(f"only one import imports (a rank imports them while it loads): {accounts['one_import_only_s']:.3f} s: "
                 + ", ".join(f"{pkg} {s:.3f}" for pkg, s in accounts["one_import_only"]))
    return "\n".join(lines)


def table(rows: list[dict], one_import: float) -> str:
    head = ("| row | wall s | load s | first step's extra s | steps x steady s | overhead s | overhead - one import s "
            "| launcher s | imports s | text enc s | VAE s | writing s | after report s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        split = r.get("split_s") or {}

        def cell(key):
            return "" if split.get(key) is None else f"{split[key]:.2f}"

        extra = r.get("first_step_extra_s")
        lines.append(f"| {r['row']} | {r['wall_s']:.1f} | {r['load_s']:.1f} | "
                     f"{'' if extra is None else f'{extra:.1f}'} | {r['steps_s']:.2f} | {r['overhead_s']:.1f} | "
                     f"{r['overhead_s'] - one_import:.1f} | {cell('launch')} | {cell('imports')} | "
                     f"{cell('text_encoding')} | {cell('vae_decode')} | {cell('writing')} | {cell('after_report')} |")
    return "\n".join(lines)


#: the first step's one-time costs from the run's report (runtime/generate.py compile_breakdown), in this order
FIRST_STEP = ("dynamo", "bytecode_tracing", "backend", "cuda_graph_capture")


def first_step_table(rows: list[dict]) -> str:
    """Per row, where the first step's extra went: dynamo (of it bytecode tracing and the backend, i.e. AOT autograd
    and inductor with its cache hits), CUDA graph capture, compiled blocks loaded (``--compile-artifacts``), and the
    rest (the first step's extra minus dynamo and capture: kernels' first launches, cuDNN/cuBLAS heuristics, the
    allocator's growth)."""
    lines = ["| row | first step's extra s | dynamo s | bytecode tracing s | backend s | graph capture s | "
             "artifacts loaded s | rest s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra, parts = r.get("first_step_extra_s"), r.get("compile_breakdown_s") or {}
        loaded = sum(v for _, v in (r.get("compile_artifacts") or {}).get("loaded", []) if isinstance(v, (int, float)))
        rest = None if extra is None else extra - parts.get("dynamo", 0.0) - parts.get("cuda_graph_capture", 0.0) - loaded
        cells = ["" if parts.get(k) is None else f"{parts[k]:.2f}" for k in FIRST_STEP]
        lines.append(f"| {r['row']} | {'' if extra is None else f'{extra:.2f}'} | " + " | ".join(cells)
                     + f" | {loaded:.2f} | {'' if rest is None else f'{rest:.2f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", required=True, help="comma-separated TREE:MODE:CACHE, run in this order")
    p.add_argument("--model", default=None, help="pipeline folder (with --synth: written there once)")
    p.add_argument("--synth", default=None, metavar="ARCH", help="write --model with `ditmesh synth --arch ARCH` first "
                                                                 "(timed), unless it is there")
    p.add_argument("--gpus", type=int, default=4, help="processes of the multi-GPU modes (default 4)")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps of a warm-up run (default 3)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--cuda-graph", action="store_true")
    p.add_argument("--compile-artifacts", action="store_true",
                   help="with --compile: this tree's warm-ups save the compiled blocks and its warm rows load them")
    p.add_argument("--baseline-src", default=None, metavar="DIR", help="folder holding the old tree's ditmesh package")
    p.add_argument("--parallel-warmups", action="store_true", help="run the warm-ups a row needs at the same time")
    p.add_argument("--shared-cache", default=None, metavar="DIR",
                   help="the compile caches the warm rows share (inductor/ and triton/ in it); default: a folder of "
                        "the call's own, removed at the end")
    p.add_argument("--deadline-s", type=float, default=540.0, help="skip rows that would end after this (default 540)")
    p.add_argument("--cpu-dry-run", action="store_true", help="flux-tiny on CPU processes (gloo), 2 of them, 64x64, "
                                                             "2 steps: the whole flow in a few minutes")
    p.add_argument("--no-import-accounts", action="store_true",
                   help="skip the imports' accounts (the zygote's imports and one import under -X importtime)")
    p.add_argument("--out", required=True, help="folder for e2e.json, e2e.md and the traces")
    p.add_argument("extra", nargs="*", help="after --: more generate options for every row")
    args = p.parse_args(argv)
    specs = [s.strip() for s in args.rows.split(",") if s.strip()]
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in ("new", "old") or parts[1] not in MODES or parts[2] not in ("cold", "warm"):
            p.error(f"--rows: {spec!r} is not TREE:MODE:CACHE (TREE new|old, MODE {'|'.join(MODES)}, CACHE cold|warm)")
        if parts[0] == "old" and not args.baseline_src:
            p.error(f"--rows {spec}: an old row needs --baseline-src DIR")
    if args.cpu_dry_run:
        args.gpus, args.height, args.width, args.steps, args.warmup_steps = 2, 64, 64, 2, 3
        args.synth = args.synth or "flux-tiny"
    bench = Bench(args)
    if args.model is None:
        args.model = str(bench.work / (args.synth or "model"))
    synth_s = None
    if args.synth and not (Path(args.model) / "model_index.json").is_file():
        code, synth_s = bench.run([sys.executable, "-m", "ditmesh", "synth", "--arch", args.synth, "--out", args.model],
                                  bench.env("new", bench.shared_cache), bench.work / "synth.log")
        if code != 0:
            raise SystemExit(f"e2e: synth failed: {(bench.work / 'synth.log').read_text()[-2000:]}")
        print(f"e2e: synth {args.synth}: {synth_s:.1f} s", flush=True)
    # synth imported the same packages just before: the bytecode is written and the files are in memory
    one_import = one_import_s(bench.env("new", bench.shared_cache), runs=1 if synth_s else 2)
    print(f"e2e: one import: {one_import:.2f} s", flush=True)
    cold = [s for s in specs if s.endswith(":cold")]
    for spec in cold:  # first, while the shared caches are empty of their modes
        bench.row(spec)
    if args.parallel_warmups:
        bench.warm_up([tuple(s.split(":")[:2]) for s in specs if s.endswith(":warm")])
    for spec in specs:
        if spec not in cold:
            bench.row(spec)
    bench.rows += serve_rows(bench)
    accounts = None
    if args.no_import_accounts or bench.left_s() < 2.5 * one_import:  # two imports' time, and some to spare
        print("e2e: imports' accounts skipped" + ("" if args.no_import_accounts else
                                                  f" ({bench.left_s():.0f} s left before the deadline)"), flush=True)
    else:
        accounts = import_accounts(bench.env("new", bench.shared_cache))
    text = table(bench.rows, one_import) + "\n\n" + first_step_table(bench.rows)
    if accounts:
        text += "\n\n" + imports_table(accounts)
    print(text)
    result = {"schema": "ditmesh-e2e/1", "command": [Path(sys.argv[0]).name, *(argv or sys.argv[1:])],
              "settings": {k: v for k, v in vars(args).items()}, "one_import_s": one_import, "synth_s": synth_s,
              "wall_s": round(time.perf_counter() - bench.start, 1), "rows": bench.rows, "warmups": bench.warmups,
              "import_accounts": accounts,
              "skipped": bench.skipped}
    (bench.out / "e2e.json").write_text(json.dumps(result, indent=1))
    (bench.out / "e2e.md").write_text(text + "\n")
    if not os.environ.get("E2E_KEEP"):
        shutil.rmtree(bench.work, ignore_errors=True)
    return 0 if not bench.skipped else 1


if __name__ == "__main__":
    sys.exit(main())
