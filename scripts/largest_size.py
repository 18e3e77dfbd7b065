"""The largest picture, or the longest video, that ``ditmesh generate`` completes, per rank layout.

For each ``--layout`` (``generate``'s rank and memory options, quoted: ``"--nproc 1"``, ``"--nproc 4 --ulysses 4
--chunk 4096 --vae-chunk 64"``) it runs ``ditmesh generate --steps 2`` (``--steps``) at each candidate size in
ascending order, each try its own process, and stops at the first try that does not complete. Candidates are square
sides (``--sides 4096,5120,6144``: pictures) or frame counts at ``--height`` × ``--width`` (``--frames 81,121``:
videos). A try ends as ``ok``, ``oom`` (its error names running out of memory), ``timeout`` (``--timeout`` seconds,
its ranks stopped) or ``error`` (the error's last line); a try that the run's ``--deadline`` stops first ends as
``deadline``, which is no failure of its size: that size and the larger ones are reported as not tried. It prints one Markdown row per layout (the largest size
completed, its seconds and peak GiB per GPU from the run's report, the first size that failed and why) and writes
every try to ``--json``. ``--deadline`` bounds the whole run: past it no try starts and the layouts left are
reported as not tried.

    python scripts/largest_size.py --model /tmp/flux-dev --layout "--nproc 1" --layout "--nproc 4 --ulysses 4" \\
        --sides 4096,4928,5632 --timeout 280 --deadline 560 --json largest.json
    python scripts/largest_size.py --model /tmp/wan --height 480 --width 832 --frames 81,161,241 --layout "--nproc 4 --ulysses 4"

Options it does not know go to every ``generate`` unchanged (``--compile``, ``--max-sequence-length`` ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_sizes(text: str, name: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(v <= 0 for v in sizes):
        raise SystemExit(f"largest_size: {name} {text!r}: give positive integers separated by commas, e.g. 4096,5120")
    return sorted(set(sizes))


def outcome(rc: int | None, stderr: str) -> tuple[str, str]:
    """(``ok`` | ``oom`` | ``timeout`` | ``error``, the error's last line) of a finished try."""
    if rc is None:
        return "timeout", ""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.strip().startswith("denoising")]
    last = lines[-1] if lines else f"exit code {rc}"
    if rc == 0:
        return "ok", ""
    if "out of memory" in stderr.lower():
        return "oom", last
    return "error", last


def run_try(cmd: list[str], timeout: float) -> tuple[int | None, str, float]:
    """Run one ``generate`` in its own process group; (exit code or None on timeout, stderr, seconds)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        err.seek(0)
        return rc, err.read(), time.perf_counter() - start


def search(layout: str, sizes: list[int], video: bool, args, extra: list[str], out: Path, ends_at: float) -> dict:
    """Try ``sizes`` in order under ``layout`` until one does not complete (or the deadline comes)."""
    tries = []
    for index, size in enumerate(sizes):
        left = ends_at - time.monotonic()
        if left < 10:
            break
        shape = ["--height", str(args.height), "--width", str(args.width), "--frames", str(size)] if video else \
            ["--height", str(size), "--width", str(size)]
        tag = f"try{index}"
        report = out / f"{tag}.json"
        cmd = [sys.executable, "-m", "ditmesh", "generate", "--model", args.model, "--steps", str(args.steps), *shape,
               *shlex.split(layout), *extra, "--out", str(out / f"{tag}.{'gif' if video else 'png'}"),
               "--report", str(report)]
        rc, stderr, seconds = run_try(cmd, min(args.timeout, left))
        state, why = outcome(rc, stderr)
        if state == "timeout" and left < args.timeout:  # stopped by the run's deadline, not by its own time limit
            state = "deadline"
        entry = {"size": size, "outcome": state, "seconds": round(seconds, 1), "command": shlex.join(cmd[1:])}
        if why:
            entry["error"] = why
        if state == "ok" and report.exists():
            peaks = json.loads(report.read_text()).get("peak_memory_bytes") or [0]
            entry["peak_gib_per_gpu"] = round(max(peaks) / 2**30, 2)
        tries.append(entry)
        print(f"  {layout}: {size} -> {state} in {seconds:.0f} s {why}".rstrip(), file=sys.stderr, flush=True)
        if state != "ok":
            break
    done = [t for t in tries if t["outcome"] == "ok"]
    failed = next((t for t in tries if t["outcome"] not in ("ok", "deadline")), None)
    cut = len(done) < len(sizes) and failed is None  # the deadline came first: the sizes left are not tried
    return {"layout": layout, "tries": tries, "largest": done[-1]["size"] if done else None,
            "largest_seconds": done[-1]["seconds"] if done else None,
            "largest_peak_gib": done[-1].get("peak_gib_per_gpu") if done else None,
            "first_failed": failed["size"] if failed else None,
            "why": (failed["outcome"] + (f": {failed['error']}" if failed.get("error") else "")) if failed else
            (f"{sizes[len(done)]} and up not tried (deadline)" if cut else "every size completed")}


def table(results: list[dict], video: bool) -> str:
    unit = "frames" if video else "side"
    rows = [f"| layout | largest {unit} completed | its s | its peak GiB/GPU | first failed | why |", "|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| `{r['layout']}` | {r['largest'] if r['largest'] is not None else 'none'} | "
                    f"{r['largest_seconds'] or ''} | {r['largest_peak_gib'] or ''} | {r['first_failed'] or ''} | {r['why']} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="pipeline folder or synthetic architecture name (generate's --model)")
    p.add_argument("--layout", action="append", required=True, metavar="OPTIONS",
                   help='generate\'s rank and memory options of one layout, quoted, e.g. "--nproc 4 --ulysses 4"; repeat')
    p.add_argument("--sides", help="square picture sides to try, comma-separated (pictures)")
    p.add_argument("--frames", help="frame counts to try at --height x --width, comma-separated (videos)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one try may take")
    p.add_argument("--deadline", type=float, default=570.0, help="seconds the whole run may take")
    p.add_argument("--json", help="write every try here")
    args, extra = p.parse_known_args()
    if (args.sides is None) == (args.frames is None):
        p.error("give exactly one of --sides (pictures) and --frames (videos)")
    video = args.frames is not None
    sizes = parse_sizes(args.frames if video else args.sides, "--frames" if video else "--sides")
    ends_at = time.monotonic() + args.deadline
    results = []
    with tempfile.TemporaryDirectory(prefix="ditmesh-largest-") as tmp:
        for i, layout in enumerate(args.layout):
            out = Path(tmp) / f"layout{i}"
            out.mkdir()
            results.append(search(layout, sizes, video, args, extra, out, ends_at))
    print(table(results, video), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": shlex.join(sys.argv), "model": args.model, "video": video,
                                               "sizes": sizes, "steps": args.steps, "extra": extra,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
