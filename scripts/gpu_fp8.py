"""The 8-bit GPU rows in one call of at most 570 s on 4 GPUs: each row's speed, peak memory and one-step error.

Sections in order of priority (``--only`` picks some; default all); each starts only when its expected seconds
(:data:`EXPECTED_S`, on 4 H200s) fit in what is left of ``--deadline-s``, and one still running at the deadline is
ended (its rows are lost, the earlier sections' files stay):

* ``quant-test``: tests/gpu/test_quant_gpu.py, the 8-bit linears' float32 emulation (what the CPU tests run) against
  torchao's kernels: weights and scales bit for bit, products within 1e-2.
* ``attention8-test``: tests/gpu/test_attention_fp8_gpu.py, the fp8 attention's cuDNN kernel against its float32
  emulation.
* ``quant-flux-1gpu``: FLUX.1-dev architecture at 1024², compiled, CUDA graphs, one GPU: diffusers' eager row (the
  error reference) and compiled row, ditmesh's rows with the block linears in bf16, fp8 and fp8-weight.
* ``quant-flux-x4``: the same at ulysses 4, ditmesh's rows only: bf16 and fp8 block linears (the speedups against
  quant-flux-1gpu's rows of the same mode are printed at the end; the error of a parallel row against its
  one-process run is what the CPU tests check).
* ``quant-flux-x4-comm``: ulysses 4 with fp8 payloads (``--comm-dtype fp8``), with fp8 and with bf16 block linears;
  skipped when quant-flux-x4's fp8 row failed (it would fail the same way).

The FLUX sections run with ``TORCH_LOGS=recompiles`` (a recompiling block says why on the console) and a row time
limit; a row past it prints every rank's Python stack before it is stopped.
* ``quant-wan``: Wan2.1-14B architecture at 480x832x81 (32,760 tokens), eager: diffusers' 1-GPU row (the error
  reference) and ulysses 4 with {bf16, fp8} block linears x {default (exact), fp8 attention}.
* ``quant-checkpoint``: ``ditmesh quantize --quant fp8`` of the FLUX.1-dev architecture, then a 1-GPU ``generate``
  from the written folder at 1024² (eager, 8 steps): its load and run peaks (the transformer never in bf16) and
  the seconds each took (``quant-checkpoint.json``).
* ``quant-flux-keep``: ulysses 4 with fp8 block linears and the AdaLN modulation linears in bf16, if time is left.
* ``quant-e2e-1gpu``, ``fp8-scaled-mm-1gpu`` (``--only``, one GPU): ``generate`` from outside in bf16 and fp8
  after a warm-up, and ditmesh's own fp8 layer's step beside diffusers' rows.
* ``quant-modulation-1gpu`` (``--only``, one GPU): FLUX.1-dev at 1024² compiled with CUDA graphs, bf16 beside fp8
  and fp8-weight, each with the AdaLN modulation linears quantized and kept in bf16 (the modes' defaults differ).
* ``fp8-eager``, ``fp8-compiled``, ``fp8-scaled-mm`` (run them with ``--only``): where the parallel fp8 row stalls.
  FLUX at ulysses 4 in fp8 without compile and graphs, compiled without graphs, and compiled with graphs through
  ditmesh's own fp8 layer (``--quant-backend scaled-mm``: ``torch._scaled_mm`` on plain tensors rather than
  torchao's tensor subclass), with bf16 and fp8 payloads. A row past its limit prints each rank's scheduler state,
  kernel wait channel and (py-spy carried as a wheel) native stacks.

Each bench section writes its JSON, table and plot under ``--out`` (the table is printed too). On GPUs::

    bash scripts/gpu.sh python3 scripts/gpu_fp8.py --out "$OUT/quant"

``--cpu-dry-run``: the same commands with the tiny architectures on 2 CPU processes, the fp8 attention as its
float32 emulation and no graphs or compile (what this machine can run), to check the script end to end; the
deadline applies there only when ``--deadline-s`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: pytest sections: (the GPU test, the CPU tests of the same module the dry run runs instead)
TESTS = {
    "quant-test": (["tests/gpu/test_quant_gpu.py", "-s"], ["tests/test_quant.py", "-k", "rounding"]),
    "attention8-test": (["tests/gpu/test_attention_fp8_gpu.py"], ["tests/test_attention_fp8.py", "-k", "emulation"]),
}
FLUX = ["--model", "flux-dev", "--height", "1024", "--width", "1024", "--methods", "ulysses", "--compile", "on",
        "--steps", "3", "--warmup", "1", "--row-timeout", "150"]
WAN = ["--model", "wan2.1-14b", "--height", "480", "--width", "832", "--frames", "81", "--methods", "ulysses",
       "--compile", "off", "--no-cuda-graph", "--steps", "2", "--warmup", "1", "--row-timeout", "240"]
#: section -> arguments of ``ditmesh bench`` on GPUs (None: a pytest section, :data:`TESTS`), in order of priority
SECTIONS = {
    "quant-test": None,
    "attention8-test": None,
    "quant-flux-1gpu": FLUX + ["--gpus", "1", "--quant", "off,fp8,fp8-weight"],
    "quant-flux-x4": FLUX + ["--gpus", "4", "--no-single", "--quant", "off,fp8"],
    "quant-flux-x4-comm": FLUX + ["--gpus", "4", "--no-single", "--quant", "fp8,off", "--comm-dtype", "fp8"],
    "quant-checkpoint": "checkpoint",
    "quant-wan": WAN + ["--gpus", "1,4", "--quant", "off,fp8", "--attention", "default,fp8"],
    "quant-flux-keep": FLUX + ["--gpus", "4", "--no-single", "--quant", "fp8:keep-modulation"],
    # where the parallel fp8 row stalls: without compile and graphs, compiled without graphs, and ditmesh's own fp8
    # layer (torch._scaled_mm on plain tensors, --quant-backend scaled-mm) instead of torchao's tensors
    "fp8-eager": [{"on": "off", "150": "75"}.get(a, a) for a in FLUX] + ["--no-cuda-graph", "--gpus", "4",
                                                                         "--no-single", "--quant", "fp8"],
    "fp8-compiled": [{"150": "110"}.get(a, a) for a in FLUX] + ["--no-cuda-graph", "--gpus", "4", "--no-single",
                                                               "--quant", "fp8"],
    "fp8-scaled-mm": FLUX + ["--gpus", "4", "--no-single", "--quant", "fp8", "--quant-backend", "scaled-mm",
                             "--comm-dtype", "auto,fp8"],
    # one GPU: `generate` timed from outside in bf16 and with the transformer in fp8 (after a warm-up), and
    # ditmesh's own fp8 layer's step
    "quant-e2e-1gpu": "e2e",
    "fp8-scaled-mm-1gpu": FLUX + ["--gpus", "1", "--quant", "fp8", "--quant-backend", "scaled-mm"],
    # one GPU: each mode with the modulation linears quantized and kept, beside bf16 (step, peak, error)
    # (a fresh machine compiles each 8-bit row cold: more than FLUX's 150 s limit for a row)
    "quant-modulation-1gpu": [{"150": "300"}.get(a, a) for a in FLUX]
    + ["--gpus", "1", "--quant", "off,fp8,fp8:keep-modulation,fp8-weight,fp8-weight:quant-modulation"],
}

#: a section's expected wall seconds on 4 H200s (a compiled FLUX row: ~15 s of imports, process start and weights,
#: 15-25 s compiling cold (fp8's graphs are new to the cache: ~+20 s), 1 s of steps; an eager Wan row: ~15 s of
#: start and weights, then 3 steps of 0.9 s (ulysses 4) or 3.2 s (1 GPU)); 535 s before the optional last section
EXPECTED_S = {
    "quant-test": 35,         # pytest start, torchao's kernels on a few layers
    "attention8-test": 30,    # cuDNN builds the graph once per shape
    "quant-flux-1gpu": 185,   # 5 rows: diffusers eager 15, compiled 35; ditmesh bf16 30, fp8 55, fp8-weight 50
    "quant-flux-x4": 85,      # 2 rows: bf16 35, fp8 50
    "quant-flux-x4-comm": 85,  # 2 rows: fp8 + fp8 payloads 50, bf16 + fp8 payloads 35
    "quant-checkpoint": 100,  # quantize: read 24 GB of bf16 and write 12 GB; generate: start, load, 8 eager steps
    "quant-wan": 115,         # 5 rows: diffusers 1 GPU 30, ulysses 4 x {bf16, fp8} x {exact, fp8} ~21 each
    "quant-flux-keep": 50,    # 1 row, compiled cold
    "fp8-eager": 45,          # 1 eager row
    "fp8-compiled": 70,       # 1 row, compiled cold
    "fp8-scaled-mm": 110,     # 2 rows, compiled cold (fp8 payloads: new graphs)
    "quant-e2e-1gpu": 230,    # synth 60, one import 22, per variant a warm-up that saves (55) and its row (35)
    "fp8-scaled-mm-1gpu": 150,  # synth 60; diffusers eager and compiled, ditmesh fp8
    "quant-modulation-1gpu": 540,  # 7 rows; on a fresh machine an 8-bit row compiles cold for over 150 s: a call
                                   # of its own, whose deadline may end the last rows
}
#: what the dry run changes: the tiny architectures, 2 CPU processes, the emulated fp8 attention, no compile/graphs
DRY = {"flux-dev": "flux-tiny", "wan2.1-14b": "wan-tiny", "1024": "64", "480": "64", "832": "64", "81": "5",
       "1,4": "1,2", "4": "2", "on": "off", "default,fp8": "default,fp8-emulated"}


def bench_args(section: str, dry: bool, gpus: int = 4) -> list[str]:
    """``ditmesh bench`` arguments of ``section`` (on GPUs, or the CPU dry run's); ``gpus``: the machine's GPU count,
    which the sections' parallel rows use (their ulysses degree)."""
    args = [{"4": str(gpus), "1,4": f"1,{gpus}"}.get(a, a) for a in SECTIONS[section]]
    if dry:
        args = [DRY.get(a, a) for a in args]
        args[args.index("--steps") + 1], args[args.index("--warmup") + 1] = "1", "0"
    return args


def checkpoint_commands(out: Path, dry: bool) -> list[tuple[str, list[str]]]:
    """quant-checkpoint's commands: quantize the FLUX.1-dev architecture (flux-tiny in the dry run) into a folder
    of its own, then generate from it on one process."""
    model, size, folder = ("flux-tiny", "64", out / "flux-tiny-fp8") if dry else ("flux-dev", "1024", Path("/tmp/flux-dev-fp8"))
    ditmesh = [sys.executable, "-m", "ditmesh"]
    return [("quantize", [*ditmesh, "quantize", "--model", model, "--out", str(folder), "--quant", "fp8",
                          *(["--dtype", "float32"] if dry else [])]),
            ("generate", [*ditmesh, "generate", "--model", str(folder), "--height", size, "--width", size, "--steps",
                          "2" if dry else "8", "--out", str(out / "quant-checkpoint.png"),
                          "--report", str(out / "quant-checkpoint-report.json")])]


def run_checkpoint(out: Path, dry: bool, seconds: float | None) -> int:
    """Run quant-checkpoint's commands; write ``quant-checkpoint.json``: each command's wall seconds and exit code,
    and from generate's report its load and run peaks per rank (GiB) and the steady step."""
    result = {"schema": "ditmesh-quant-checkpoint/1", "commands": []}
    start = time.time()
    code = 0
    for name, command in checkpoint_commands(out, dry):
        print(f"== quant-checkpoint {name}: {' '.join(command[1:])}", flush=True)
        begun = time.time()
        code = run_until(command, None if seconds is None else seconds - (time.time() - start))
        result["commands"].append({"name": name, "command": ["ditmesh", *command[3:]], "exit": code,
                                   "wall_s": round(time.time() - begun, 2)})
        if code != 0:
            break
    report = out / "quant-checkpoint-report.json"
    if code == 0 and report.exists():
        r = json.loads(report.read_text())
        gib = lambda values: [round(v / 2**30, 2) for v in values]  # noqa: E731
        result.update(load_peak_gib=gib(r.get("load_peak_memory_bytes", [])), peak_gib=gib(r.get("peak_memory_bytes", [])),
                      load_s=r.get("load_s"), total_s=r.get("total_latency_s"),
                      step_ms=round(1e3 * sorted(r["step_latency_s"])[len(r["step_latency_s"]) // 2], 2),
                      devices=r.get("devices"), versions=r.get("versions"))
    (out / "quant-checkpoint.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "versions"}), flush=True)
    return code


def run_e2e(out: Path, dry: bool, seconds: float | None) -> int:
    """quant-e2e-1gpu: ``scripts/e2e_bench.py`` on one GPU, FLUX.1-dev architecture at 1024², 28 steps, compiled with
    CUDA graphs, warm: the block linears in bf16 (``e2e-bf16/``), then in fp8 (``e2e-fp8/``), each row after a warm-up
    that fills the compile caches."""
    start, code = time.time(), 0
    for name, extra in (("e2e-bf16", []), ("e2e-fp8", ["--", "--quant", "fp8"])):
        left = None if seconds is None else seconds - (time.time() - start)
        command = [sys.executable, "scripts/e2e_bench.py", "--rows", "new:1gpu:warm", "--out", str(out / name)]
        command += (["--cpu-dry-run"] if dry else
                    ["--synth", "flux-dev", "--model", "/tmp/flux-dev", "--gpus", "1", "--height", "1024", "--width",
                     "1024", "--steps", "28", "--compile", "--cuda-graph",
                     "--deadline-s", f"{max(30, (left or 600) - 10):.0f}"])
        print(f"== quant-e2e-1gpu {name}: {' '.join(command[1:] + extra)}", flush=True)
        code = run_until(command + extra, left) or code
    return code


def fp8_failed(path: Path) -> bool:
    """Whether the bench file at ``path`` has an fp8 row without a step time (or is missing: the section ended)."""
    if not path.exists():
        return True
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("quant") == "fp8"]
    return not rows or any("step_ms" not in r for r in rows)


def run_until(command: list[str], seconds: float | None, env: dict | None = None) -> int:
    """Run ``command`` in its own process group (``env``: variables added to this one's); end the whole group when
    ``seconds`` pass (exit code 124)."""
    proc = subprocess.Popen(command, cwd=ROOT, start_new_session=True, env=dict(os.environ, **(env or {})))
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return 124


def speedups(out: Path) -> list[str]:
    """quant-flux-x4's rows against quant-flux-1gpu's ditmesh row of the same block-linear mode (Markdown lines)."""
    one_path = out / "quant-flux-1gpu.json"
    parallel = [p for p in (out / "quant-flux-x4.json", out / "quant-flux-x4-comm.json") if p.exists()]
    if not one_path.exists() or not parallel:
        return []
    one = json.loads(one_path.read_text())["rows"]
    four = [r for p in parallel for r in json.loads(p.read_text())["rows"]]
    single = {r.get("quant", "off"): r["step_ms"] for r in one if r.get("graph") and "step_ms" in r}
    lines = ["| ulysses 4 row | step ms | 1-GPU ditmesh row of the same mode, ms | speedup |", "|---|---|---|---|"]
    for r in four:
        base = single.get(r.get("quant", "off"))
        if "step_ms" in r and base:
            name = f"quant {r.get('quant', 'off')}, comm {r.get('comm_dtype', 'auto')}"
            lines.append(f"| {name} | {r['step_ms']:.1f} | {base:.1f} | {base / r['step_ms']:.2f}x |")
    return lines if len(lines) > 2 else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results (JSON, tables, plots)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny architectures on 2 CPU processes")
    parser.add_argument("--gpus", type=int, default=4, help="the machine's GPUs: the parallel rows' degree (default 4)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds the whole script may take (default 570 on GPUs, none in the dry run)")
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_fp8.py: unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    deadline = args.deadline_s if args.deadline_s is not None else (None if args.cpu_dry_run else 570.0)
    if deadline is not None and deadline <= 0:
        print(f"gpu_fp8.py: --deadline-s {args.deadline_s}: give a number of seconds above 0, e.g. 570", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    failed, skipped = 0, []
    for section in sections:
        left = None if deadline is None else deadline - (time.time() - start)
        expected = 0 if args.cpu_dry_run else EXPECTED_S[section]
        if left is not None and left < expected:
            print(f"== {section}: skipped ({left:.0f} s left, it takes ~{expected} s)", flush=True)
            skipped.append(section)
            continue
        if section == "quant-flux-x4-comm" and fp8_failed(out / "quant-flux-x4.json"):
            print(f"== {section}: skipped (quant-flux-x4's fp8 row failed)", flush=True)
            skipped.append(section)
            continue
        begun = time.time()
        if SECTIONS[section] == "e2e":
            code = run_e2e(out, args.cpu_dry_run, left)
            failed += code != 0
            print(f"== {section}: {time.time() - begun:.0f} s (expected ~{EXPECTED_S[section]} s on GPUs)", flush=True)
            continue
        if SECTIONS[section] == "checkpoint":
            code = run_checkpoint(out, args.cpu_dry_run, left)
            failed += code != 0
            print(f"== {section}: {time.time() - begun:.0f} s (expected ~{EXPECTED_S[section]} s on GPUs)", flush=True)
            continue
        if SECTIONS[section] is None:
            # the kernels need CUDA: the dry run runs the CPU tests of the same module instead
            command = [sys.executable, "-m", "pytest", "-q", *TESTS[section][args.cpu_dry_run]]
        else:
            command = [sys.executable, "-m", "ditmesh", "bench", *bench_args(section, args.cpu_dry_run, args.gpus),
                       "--out", str(out / f"{section}.json")]
        print(f"== {section}: {' '.join(command[1:])}", flush=True)
        env = {"TORCH_LOGS": "recompiles"} if "flux" in section or section.startswith("fp8") else None
        code = run_until(command, left, env)
        failed += code != 0
        ended = " (ended at the deadline)" if code == 124 else ""
        print(f"== {section}: {time.time() - begun:.0f} s (expected ~{EXPECTED_S[section]} s on GPUs){ended}",
              flush=True)
    lines = speedups(out)
    if lines:
        print("\n".join(["", "ulysses 4 against one GPU, the same block-linear mode:", *lines]))
    print(f"== all: {time.time() - start:.0f} s{'; skipped: ' + ', '.join(skipped) if skipped else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
