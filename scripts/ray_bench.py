"""Throughput of ``ditmesh serve --ray`` on 1 versus 2 Ray nodes of this machine, each one pinned CPU core with a
one-rank replica of the tiny pipeline: the same bounded load (REQUESTS from CLIENTS clients) on each, answered
requests per second and latency percentiles, written as one JSON document of rows (two alternating rounds by
default; the speed-up is against the median of the one-node rounds).

    PYTHONPATH=src python scripts/ray_bench.py            # -> bench/results/2026-11-28_cpu/ray/throughput.json
    PYTHONPATH=src python scripts/ray_bench.py --requests 16 --out /tmp/ray.json   # a quick look

Each configuration gets a fresh cluster (``ditmesh.testing.PinnedRayCluster``: a head without CPUs and N worker
nodes of one logical CPU, node i pinned to core i) and a fresh server (``--min-replicas N --max-replicas N``); the
load starts once every replica is ready, after one request per replica has warmed the path up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "2026-11-28_cpu" / "ray" / "throughput.json"


def serve_args(steps: int, size: int) -> list[str]:
    """The server's options: the tiny pipeline at ``size``² for ``steps`` steps, a queue that holds the load."""
    return ["--steps", str(steps), "--height", str(size), "--width", str(size), "--queue-size", "256"]


def measure(nodes: int, requests: int, clients: int, serve: list[str]) -> dict:
    """One configuration: a cluster of ``nodes`` pinned nodes, one one-rank replica on each, the load."""
    import httpx

    from ditmesh.testing import PinnedRayCluster, free_port

    cluster = PinnedRayCluster(nodes)
    port = free_port()
    argv = [sys.executable, "-m", "ditmesh", "serve", "--port", str(port), "--ray", cluster.address,
            "--min-replicas", str(nodes), *serve]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stderr.read()[-2000:]}")
            try:
                health = httpx.get(f"{base}/health", timeout=5).json()
                if sum(r["state"] == "ready" for r in health["replicas"]) == nodes:
                    break
            except (httpx.TransportError, ValueError):
                pass
            if time.time() > deadline:
                raise SystemExit("the server did not become ready in 600 s")
            time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=600) as client:
            for i in range(nodes):  # warm the path of every replica
                client.post("/generate", json={"prompt": "warm", "seed": i}).raise_for_status()
        latencies: list[float] = []

        def one(i: int) -> None:
            with httpx.Client(base_url=base, timeout=600) as own:
                t0 = time.perf_counter()
                own.post("/generate", json={"prompt": f"request {i}", "seed": i}).raise_for_status()
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(requests)))
        wall = time.perf_counter() - t0
        served = [r["served"] for r in httpx.get(f"{base}/health", timeout=5).json()["replicas"]]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        cluster.shutdown()
    latencies.sort()
    return {"nodes": nodes, "replicas": nodes, "ranks_per_replica": 1, "requests": requests, "clients": clients,
            "wall_s": round(wall, 3), "req_per_s": round(requests / wall, 3),
            "p50_s": round(statistics.median(latencies), 3),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "served_per_replica": served}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2,
                        help="rounds of (1 node, 2 nodes), alternating, so that other work on the machine weighs on "
                             "both alike (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps a request (default 2)")
    parser.add_argument("--size", type=int, default=64,
                        help="height and width (default 64; more steps or pixels weigh the replicas' work against the "
                             "front end's, which shares the machine's cores)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.requests < 1 or args.clients < 1 or args.repeat < 1 or args.steps < 1:
        parser.error("--requests, --clients, --repeat and --steps must be >= 1")
    if args.size < 16 or args.size % 16:
        parser.error(f"--size {args.size}: give a multiple of 16, e.g. 64")
    serve = serve_args(args.steps, args.size)
    import ray
    import torch

    load_before = os.getloadavg()[0]
    rows = [dict(measure(nodes, args.requests, args.clients, serve), round=i + 1)
            for i in range(args.repeat) for nodes in (1, 2)]
    one_node = statistics.median(r["req_per_s"] for r in rows if r["nodes"] == 1)
    for row in rows:  # against the median of the one-node rounds
        row["speedup"] = round(row["req_per_s"] / one_node, 3)
        print(f"round {row['round']}, {row['nodes']} node(s): {row['req_per_s']:.2f} req/s, p50 {row['p50_s']:.2f} s, "
              f"p99 {row['p99_s']:.2f} s, x{row['speedup']:.2f}", flush=True)
    doc = {"kind": "ray-throughput", "card": "CPU cores", "device": "cpu",
           "command": "PYTHONPATH=src python scripts/ray_bench.py" + (
               f" --requests {args.requests}" if args.requests != 64 else "") + (
               f" --clients {args.clients}" if args.clients != 8 else "") + (
               f" --repeat {args.repeat}" if args.repeat != 2 else "") + (
               f" --steps {args.steps}" if args.steps != 2 else "") + (
               f" --size {args.size}" if args.size != 64 else ""),
           "serve": serve, "cores": len(os.sched_getaffinity(0)),
           # other work on the machine shares the pinned cores: the 1-minute load average around the runs
           "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "versions": {"torch": torch.__version__, "ray": ray.__version__,
                                        "python": platform.python_version()},
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
