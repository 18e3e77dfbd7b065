"""What starting the ranks costs: forked from one process that imported everything once (the default) against
one interpreter per rank (``DITMESH_LAUNCH=exec``), timed from outside in one call, the two ways in turn.

Rows (flux-tiny, 2 steps at 64x64; the model folder made once before any timing):

- ``generate N procs``: ``ditmesh generate --nproc N --ulysses N`` on the CPU (gloo; ``CUDA_VISIBLE_DEVICES=``
  on a GPU host) for each ``--cpu-ranks`` N;
- ``generate 1 GPU`` (on a CUDA machine): ``--nproc 1`` on the GPU.

Each row: the wall seconds from outside and the CPU seconds of every process the command started (the rusage of its
whole tree, as its waits collect it); the pictures of both ways must be byte-identical.

Each number is the median of ``--repeat`` rounds. Prints a table; ``--out FILE`` writes the rows as JSON, from
which ``scripts/tables.py`` makes the table in docs/timeline.md::

    python scripts/launch_bench.py --cpu-ranks 2 --out bench/results/<date>_cpu2/launch.json
    bash scripts/gpu.sh python3 scripts/launch_bench.py --cpu-ranks 4 --out $OUT/launch.json   # the GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("exec", "fork")
GEN = ["generate", "--model", "flux-tiny", "--steps", "2", "--height", "64", "--width", "64"]


def _env(way: str, cpu: bool = False) -> dict:
    env = dict(os.environ, DITMESH_LAUNCH=way, TOKENIZERS_PARALLELISM="false")
    if cpu:  # on a GPU host too: gloo ranks on the CPU cores
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("PYTHONPATH", str(ROOT / "src"))
    return env


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_generate(way: str, args: list[str], out: str, cpu: bool) -> dict:
    """One ``generate``: wall seconds and the CPU seconds of its process tree; its picture's bytes."""
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ditmesh", *GEN, *args, "--out", out], env=_env(way, cpu),
                          capture_output=True, text=True, timeout=600)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"launch_bench: generate {' '.join(args)} ({way}) failed: {proc.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "png": Path(out).read_bytes()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-ranks", default="2", help="comma-separated rank counts of the CPU generate rows")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    work = tempfile.mkdtemp(prefix="ditmesh-launch-")
    # the model folder once, outside the timings (synthesized into the cache on first use)
    subprocess.run([sys.executable, "-m", "ditmesh", *GEN, "--steps", "1", "--out", os.path.join(work, "warm.png")],
                   env=_env("exec", cpu=True), check=True, capture_output=True)
    cases = {f"generate {n} procs (CPU, gloo)": (["--nproc", str(n), "--ulysses", str(n)], True)
             for n in (int(x) for x in args.cpu_ranks.split(","))}
    if cuda:
        cases["generate 1 GPU"] = (["--nproc", "1"], False)
    samples: dict[str, dict[str, list]] = {}
    pngs: dict[tuple, bytes] = {}
    for _ in range(args.repeat):
        for case, (case_args, on_cpu) in cases.items():
            for way in WAYS:
                got = timed_generate(way, case_args, os.path.join(work, f"{way}.png"), on_cpu)
                key = f"{case} [{way}]"
                samples.setdefault(key, {"wall_s": [], "cpu_s": []})
                samples[key]["wall_s"].append(got["wall_s"])
                samples[key]["cpu_s"].append(got["cpu_s"])
                if pngs.setdefault((case, way), got["png"]) != got["png"]:
                    raise SystemExit(f"launch_bench: {case} ({way}) drew a different picture on a later round")
    for case in cases:
        if pngs[(case, "exec")] != pngs[(case, "fork")]:
            raise SystemExit(f"launch_bench: {case}: forked ranks drew another picture than exec'd ones")
    rows = []
    for case in cases:
        for way in WAYS:
            s = samples[f"{case} [{way}]"]
            rows.append({"case": case, "way": way, "wall_s": round(statistics.median(s["wall_s"]), 2),
                         "cpu_s": round(statistics.median(s["cpu_s"]), 2), "same_picture": True,
                         "samples_wall_s": [round(x, 2) for x in s["wall_s"]]})
    keys = ("wall_s", "cpu_s")
    lines = ["| case | ranks started | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in rows:
        lines.append(f"| {r['case']} | {r['way']} | " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    print("\n".join(lines))
    doc = {"command": "python scripts/launch_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
           **({"card": torch.cuda.get_device_name(0), "device_count": 1} if cuda else
              {"device": f"{os.cpu_count()} CPU cores"}),
           "cpus": os.cpu_count(), "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "repeat": args.repeat, "load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
