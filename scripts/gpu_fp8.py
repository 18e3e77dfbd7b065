"""The 8-bit GPU rows in one call: each row's speed, peak memory and one-step error against bf16 at once.

Sections (``--only`` picks some; default all, in this order):

* ``attention8-test``: tests/gpu/test_attention8_gpu.py, the int8 attention's Triton kernel against its float32
  emulation (the reference the CPU tests run).
* ``comm8-flux``: FLUX.1-dev architecture at 1024², compiled, CUDA graphs: diffusers' 1-GPU eager row (the error
  reference), its compiled row, ditmesh's 1-GPU graph row, and ulysses 4 with payloads in bf16 and in fp8.
* ``comm8-wan``: Wan2.1-14B architecture at 480x832x81 (32,760 tokens), eager: diffusers' 1-GPU row (the error
  reference) and ulysses 4 with {bf16, fp8 payloads} x {default (exact), int8 attention}.

Each bench section writes its JSON, table and plot under ``--out`` (the table is printed too). On GPUs::

    bash scripts/gpu.sh python3 scripts/gpu_fp8.py --out "$OUT/quant"

``--cpu-dry-run``: the same commands with the tiny architectures on 2 CPU processes, the int8 attention as its
float32 emulation and no graphs or compile (what this machine can run), to check the script end to end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: section -> arguments of ``ditmesh bench`` on GPUs (None: a pytest section)
SECTIONS = {
    "attention8-test": None,
    "comm8-flux": ["--model", "flux-dev", "--height", "1024", "--width", "1024", "--gpus", "1,4", "--methods", "ulysses",
                   "--compile", "on", "--comm-dtype", "auto,fp8", "--steps", "5", "--warmup", "2"],
    "comm8-wan": ["--model", "wan2.1-14b", "--height", "480", "--width", "832", "--frames", "81", "--gpus", "1,4",
                  "--methods", "ulysses", "--compile", "off", "--no-cuda-graph", "--comm-dtype", "auto,fp8",
                  "--attention", "default,int8", "--steps", "3", "--warmup", "1"],
}
#: what the dry run changes: the tiny architectures, 2 CPU processes, the emulated int8 attention, no compile/graphs
DRY = {"flux-dev": "flux-tiny", "wan2.1-14b": "wan-tiny", "1024": "64", "480": "64", "832": "64", "81": "5",
       "1,4": "1,2", "on": "off", "default,int8": "default,int8-emulated"}


def bench_args(section: str, dry: bool) -> list[str]:
    """``ditmesh bench`` arguments of ``section`` (on GPUs, or the CPU dry run's)."""
    args = list(SECTIONS[section])
    if dry:
        args = [DRY.get(a, a) for a in args]
        args[args.index("--steps") + 1], args[args.index("--warmup") + 1] = "1", "0"
    return args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results (JSON, tables, plots)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny architectures on 2 CPU processes")
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_fp8.py: unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for section in sections:
        start = time.time()
        if SECTIONS[section] is None:
            if args.cpu_dry_run:  # the kernel needs CUDA: the dry run runs the CPU tests of the same module instead
                command = [sys.executable, "-m", "pytest", "-q", "tests/test_attention8.py", "-k", "rounding or interpreter"]
            else:
                command = [sys.executable, "-m", "pytest", "-q", "tests/gpu/test_attention8_gpu.py"]
        else:
            command = [sys.executable, "-m", "ditmesh", "bench", *bench_args(section, args.cpu_dry_run),
                       "--out", str(out / f"{section}.json")]
        print(f"== {section}: {' '.join(command[1:])}", flush=True)
        failed += subprocess.run(command, cwd=ROOT).returncode != 0
        print(f"== {section}: {time.time() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
