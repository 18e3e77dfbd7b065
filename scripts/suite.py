"""Run every published row of a suite on the GPU machine, in calls that fit the device's limit.

    python scripts/suite.py --list                    # every suite, its runs, and which are measured
    python scripts/suite.py NAME --dry-run            # the calls (runs packed by their wall times) and commands
    python scripts/suite.py NAME --call K             # run call K (1-based) here: on the GPU machine, with $OUT set
    python scripts/suite.py NAME                      # run every call, one after another
    python scripts/suite.py NAME --unmeasured ...     # only the runs whose result is not in bench/results yet

Suites live in ``bench/spec.py`` (``SUITES``): each run has a command, the GPUs it needs, its recorded (or
expected) wall time and where its result goes. Runs are packed in their order into calls whose wall times add up
to at most ``--limit`` seconds (default 540: a 600 s device call less the machine's start). A run that fails is
reported and the call goes on; the call's record (each run's command, exit code and seconds) is written to
``$OUT/<suite>-call<K>.json``, and the exit code is 1 when a run failed. Copy ``$OUT``'s results to
``bench/results/<date>_<card>x<N>/<suite>/`` (names as the runs give them), add their lines to
``bench/results/MANIFEST.md``, then ``python scripts/tables.py``. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tables  # noqa: E402  (the spec loader and results folder of scripts/tables.py)

LIMIT_S = 540


def pack(runs: list[dict], limit: int = LIMIT_S) -> list[list[dict]]:
    """Runs in their order, grouped into calls whose wall times add up to at most ``limit`` (a run longer than
    ``limit`` alone in its call)."""
    calls: list[list[dict]] = []
    total = limit + 1
    for run in runs:
        if total + run["wall_s"] > limit:
            calls.append([])
            total = 0
        calls[-1].append(run)
        total += run["wall_s"]
    return calls


def selected(spec, name: str, unmeasured: bool) -> list[dict]:
    if name not in spec.SUITES:
        raise SystemExit(f"suite: no suite {name!r}; known: {', '.join(spec.SUITES)} (python scripts/suite.py --list)")
    runs = spec.SUITES[name]["runs"]
    if unmeasured:
        todo = {id(run) for _, run in tables.unmeasured(spec)}
        runs = [r for r in runs if id(r) in todo]
    return runs


def run_call(name: str, k: int, runs: list[dict], out: Path) -> int:
    """Run one call's runs one after another; write its record; 1 if a run failed."""
    record = {"suite": name, "call": k, "runs": []}
    failed = 0
    for run in runs:
        print(f"suite {name}, call {k}: {run['name']} ...", flush=True)
        start = time.time()
        rc = subprocess.run(["bash", "-c", run["command"]], env=dict(os.environ, OUT=str(out))).returncode
        seconds = round(time.time() - start, 1)
        failed += rc != 0
        record["runs"].append({"name": run["name"], "command": run["command"], "exit_code": rc, "wall_s": seconds})
        print(f"suite {name}, call {k}: {run['name']} exit {rc} after {seconds} s", flush=True)
    (out / f"{name}-call{k}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", nargs="?")
    p.add_argument("--list", action="store_true", help="list the suites and their runs")
    p.add_argument("--dry-run", action="store_true", help="print the calls and their commands; run nothing")
    p.add_argument("--call", type=int, default=None, help="run only this call (1-based)")
    p.add_argument("--limit", type=int, default=LIMIT_S, help=f"seconds per call (default {LIMIT_S})")
    p.add_argument("--unmeasured", action="store_true", help="only the runs whose result is not in bench/results")
    args = p.parse_args(argv)
    spec = tables.load_spec()
    if args.list or not args.suite:
        todo = {id(run) for _, run in tables.unmeasured(spec)}
        for name, suite in spec.SUITES.items():
            print(f"{name}:")
            for run in suite["runs"]:
                state = "UNMEASURED" if id(run) in todo else "measured"
                print(f"  {run['name']:<36} {run['gpus']} GPU(s) {run['wall_s']:>4} s  {state:<10} {run['result']}")
        return 0
    if args.limit < 1:
        raise SystemExit(f"suite: --limit {args.limit}: give the seconds one call may take, e.g. {LIMIT_S}")
    calls = pack(selected(spec, args.suite, args.unmeasured), args.limit)
    if args.call is not None and not 1 <= args.call <= len(calls):
        raise SystemExit(f"suite: --call {args.call}: suite {args.suite} has calls 1 to {len(calls)}")
    if args.dry_run:
        for k, runs in enumerate(calls, 1):
            total = sum(r["wall_s"] for r in runs)
            over = f" (over the limit of {args.limit} s: one run alone)" if total > args.limit else ""
            print(f"call {k}: {len(runs)} run(s), about {total} s{over}: "
                  f"python3 scripts/suite.py {args.suite} --call {k}" + (" --unmeasured" if args.unmeasured else ""))
            for run in runs:
                print(f"  {run['name']} ({run['gpus']} GPU(s), {run['wall_s']} s) -> bench/results/{run['result']}")
                print(f"    {run['command']}")
        return 0
    if not os.environ.get("OUT"):
        raise SystemExit("suite: $OUT is not set: the folder the runs write their results to (the GPU machine sets it)")
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    chosen = [(args.call, calls[args.call - 1])] if args.call else list(enumerate(calls, 1))
    return max(run_call(args.suite, k, runs, out) for k, runs in chosen)


if __name__ == "__main__":
    sys.exit(main())
