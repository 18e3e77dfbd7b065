"""What ditmesh costs before any work, on this machine: its own modules' import time, ``synth --list``, a 2-step
tiny ``generate`` on one process, ``plan`` of FLUX.1-dev with a cold trace cache, and "one import" (``import torch, diffusers; from diffusers import FluxPipeline``)
timed in the same call, for this checkout's source and optionally an older one (``--baseline-src DIR``, a folder
holding the ``ditmesh`` package, as ``bench --baseline-src`` takes; e.g. ``git archive 42e3be5 src | tar -x -C /tmp/base``
then ``--baseline-src /tmp/base/src``).

Prints a table; with ``--out FILE`` writes the rows as JSON, from which ``scripts/tables.py`` generates the table of
docs/timeline.md (put the file under bench/results). Each time is the median of ``--repeat`` runs.

    python scripts/startup_bench.py --baseline-src /tmp/base/src --repeat 3 --out bench/results/<dir>/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_IMPORT = "import torch, diffusers; from diffusers import FluxPipeline"


def _env(src: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("DITMESH_LAUNCH_START", None)
    return env


def _timed(cmd: list[str], env: dict, cwd: str) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"startup_bench: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, proc.stderr


def ditmesh_import_s(importtime_log: str) -> float:
    """Sum of the self times of ditmesh's own modules in a ``-X importtime`` log (seconds)."""
    total_us = 0
    for line in importtime_log.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m and (m.group(2) == "ditmesh" or m.group(2).startswith("ditmesh.")):
            total_us += int(m.group(1))
    return total_us / 1e6


def measure(trees: dict[str, Path], repeat: int, model: str, work: str) -> dict[str, dict]:
    """The row of each source tree (medians of ``repeat`` rounds; each round measures every tree in turn, so a
    change of the machine's load falls on all of them)."""
    py = sys.executable
    gen = ["-m", "ditmesh", "generate", "--model", model, "--steps", "2", "--height", "64", "--width", "64",
           "--out", os.path.join(work, "startup.png")]
    plan = ["-m", "ditmesh", "plan", "--model", "flux-dev", "--height", "1024", "--width", "1024", "--gpus", "4",
            "--link", "nvlink-h100"]
    keys = ("one_import_s", "cli_import_ditmesh_s", "generate_import_ditmesh_s", "synth_list_s", "generate_2step_s",
            "plan_cold_s")
    samples = {name: {k: [] for k in keys} for name in trees}
    for _ in range(repeat):
        for name, src in trees.items():
            env, got = _env(src), samples[name]
            got["one_import_s"].append(_timed([py, "-c", ONE_IMPORT], env, work)[0])
            got["cli_import_ditmesh_s"].append(
                ditmesh_import_s(_timed([py, "-X", "importtime", "-c", "import ditmesh.cli"], env, work)[1]))
            got["synth_list_s"].append(_timed([py, "-m", "ditmesh", "synth", "--list"], env, work)[0])
            got["generate_import_ditmesh_s"].append(ditmesh_import_s(_timed([py, "-X", "importtime", *gen], env, work)[1]))
            got["generate_2step_s"].append(_timed([py, *gen], env, work)[0])
            with tempfile.TemporaryDirectory() as cache:  # cold: the model is traced
                got["plan_cold_s"].append(_timed([py, *plan], dict(env, DITMESH_PLAN_CACHE=cache), work)[0])
    rows = {}
    for name, src in trees.items():
        row = {k: round(statistics.median(v), 3) for k, v in samples[name].items()}
        row["generate_target_s"] = round(1.5 * row["one_import_s"] + 2, 3)  # issue 32's target for the 2-step generate
        row["src"] = str(src)
        rows[name] = row
    return rows


def _commit(src: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def table(rows: dict[str, dict]) -> str:
    """Markdown table of the rows (one column per source tree; the rows of bench/spec.py's startup table)."""
    sys.path.insert(0, str(ROOT))
    from bench.spec import STARTUP_ROWS

    names = list(rows)
    lines = ["| seconds (median) | " + " | ".join(names) + " | target |", "|---|" + "---|" * (len(names) + 1)]
    for label, key, target in STARTUP_ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{rows[n][key]:.2f}" for n in names) + f" | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", default=None, metavar="DIR",
                   help="a folder holding an older ditmesh package, measured first in the same call")
    p.add_argument("--baseline-label", default=None, help="the baseline's column name (e.g. its commit)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model", default="flux-tiny", help="the generate row's model (default flux-tiny)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ditmesh-startup-")
    # the model folder once, outside the timings (synthesized into the cache on first use)
    subprocess.run([sys.executable, "-m", "ditmesh", "generate", "--model", args.model, "--steps", "1", "--height", "64",
                    "--width", "64", "--out", os.path.join(work, "warm.png")], env=_env(ROOT / "src"), cwd=work, check=True,
                   capture_output=True)
    trees = {f"baseline ({args.baseline_label or args.baseline_src})": Path(args.baseline_src)} if args.baseline_src else {}
    trees[f"this tree ({_commit(ROOT) or ROOT})"] = ROOT / "src"
    rows = measure(trees, args.repeat, args.model, work)
    text = table(rows)
    print(text)
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": os.getloadavg(), "repeat": args.repeat, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
