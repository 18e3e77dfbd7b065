"""`ditmesh serve` under load: time to the first image after start, warm latency and throughput, per layout.

    # 4 GPUs, FLUX.1-dev's architecture (random weights), 1024x1024, 28 steps, compiled
    python -m ditmesh synth --arch flux-dev --out /tmp/flux-dev
    bash scripts/gpu.sh python3 scripts/serve_bench.py --model /tmp/flux-dev \\
        --layout "--nproc 4 --ulysses 4" --layout "--nproc 1 --replicas 4" \\
        --layout "--nproc 2 --ulysses 2 --replicas 2" --clients 1,4,16 --json $OUT/serve.json \\
        --compile --cuda-graph --steps 28 --height 1024 --width 1024

    # CPU check (gloo, the tiny pipeline)
    python -m ditmesh synth --arch flux-tiny --out /tmp/flux-tiny
    python scripts/serve_bench.py --model /tmp/flux-tiny --layout "--nproc 2 --ulysses 2" \\
        --layout "--nproc 1 --replicas 2" --clients 1,2 --steps 2 --height 64 --width 64

A layout is the options of ``ditmesh serve`` that place the ranks, as serve reads them: ``--nproc`` counts the ranks
of ONE replica and ``--replicas`` the groups (``--dp N`` is read as ``--replicas N`` with ``--nproc`` counting all
ranks; the table shows what the server reports in ``/health``: replicas x ranks). Every option this script does
not know (``--compile``, ``--steps`` ...) goes to every server unchanged: they are the defaults of every request.

Per layout, the server starts as a subprocess in a process group of its own (``--port 0``: it says the port it
bound). Measured from its launch: ``ready`` (``/health`` answers 200: loaded, compiled, warmed up) and ``first
image`` (a first ``POST /generate`` sent at ready has come back). Then, for each ``--clients C``: C threads each
send ``--requests-per-client`` requests (a distinct prompt and seed each, one after the other) and every answer is
checked (status 200, a picture, an id no other answer has). A row gives the requests answered ok and failed,
latency (client side, send to answer) p50 / p99 (nearest rank) / mean, throughput (pictures answered ok over the
wall of the phase, from the first send to the last answer), and the peak memory per rank seen during the phase
(GPU MiB from ``nvidia-smi`` when it shows the ranks' pids, host RSS MiB from /proc). The server is stopped with
SIGINT, then SIGTERM, then SIGKILL to its process group, each after a bounded wait, also on an error or Ctrl-C;
the rank pids ``/health`` named are checked gone.

The Markdown table goes to stdout, progress lines to stderr, everything (the exact command lines, versions, the
card, every latency) to ``--json``. Exit code 0 when every request of every layout was answered ok exactly once,
1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ditmesh.testing import process_alive  # the servers run this checkout's ditmesh too (PYTHONPATH=src)


#: ``--answer`` kinds: the ``Accept`` header each sends
ANSWERS = {"json": "application/json", "png": "image/png"}


class Deadline(Exception):
    """The whole run's ``--deadline`` passed."""


#: ``--preset gpu-serve``: issue 32's service rows on 4 GPUs, each (layout, its clients, the adapters its requests
#: take turns with): ulysses 4 at 1 and 16 clients; 4 replicas of 1 GPU under 16 clients without and with batching;
#: ulysses 4 with two named adapters of ``--lora-file`` (requests alternate a, b and none: the switch's cost is this
#: row's 1-client latency against the first row's)
GPU_SERVE_ROWS = (
    ("--nproc 4 --ulysses 4", (1, 16), ()),
    ("--nproc 1 --replicas 4", (16,), ()),
    ("--nproc 1 --replicas 4 --max-batch 4", (16,), ()),
    ("--nproc 4 --ulysses 4 --lora a={lora} --lora b={lora}:0.5", (1,), ("a", "b", None)),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Options not listed here go to every `ditmesh serve` unchanged.")
    p.add_argument("--model", required=True, help="pipeline folder or synthetic architecture name (serve's --model)")
    p.add_argument("--layout", action="append", default=[], metavar="OPTIONS",
                   help="serve's rank options of one layout, quoted, e.g. \"--nproc 4 --ulysses 4\" or "
                        "\"--nproc 1 --replicas 4\"; repeat for several")
    p.add_argument("--preset", choices=("gpu-serve",), default=None,
                   help="gpu-serve: the service rows of issue 32 (ulysses 4 at 1 and 16 clients, 4 x 1 GPU under 16 "
                        "clients with and without --max-batch 4, ulysses 4 switching two named adapters), each with "
                        "its own clients, after any --layout")
    p.add_argument("--lora-file", default=None, metavar="PATH",
                   help="the adapter file of the preset's LoRA row (ditmesh synth --lora RANK --model DIR --out DIR "
                        "writes one); without it that row is left out")
    p.add_argument("--clients", default="1,4,16", help="concurrent clients of each phase, comma-separated")
    p.add_argument("--answer", default="json", metavar="KINDS",
                   help="how the clients take their pictures, comma-separated, each kind a phase of its own per "
                        "client count on the same server: json (the default answer: base64 inside JSON) or png "
                        "(Accept: image/png: the PNG file itself, what the JSON answer says besides in X-Ditmesh-* "
                        "headers); with png, the first request is asked again that way and its file compared with "
                        "the JSON answer's (first_png_same_as_json)")
    p.add_argument("--requests-per-client", type=int, default=0, metavar="N",
                   help="requests each client sends one after the other (default: max(2, ceil(4 / clients)): "
                        "4 at one client, 2 from 2 clients on)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds one request may take")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a server may take to answer /health 200 (load, compile, warm-up)")
    p.add_argument("--deadline", type=float, default=570.0, metavar="S",
                   help="seconds the whole run may take; past it no request is sent, the server is stopped and "
                        "the layouts left are reported skipped (default 570)")
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk, oil painting",
                   help="the requests' prompt (each gets ' #<client>.<request>' appended and its own seed)")
    p.add_argument("--settle", type=float, default=0.0, metavar="S",
                   help="before each server starts, wait up to S seconds for the host's CPUs to be quiet (under "
                        "10%% busy over half a second: the previous server's processes gone), so that servers "
                        "compared on their start-up start alike; the wait and the busy share are recorded (default "
                        "0: no wait)")
    p.add_argument("--json", default=None, metavar="PATH", help="write everything measured here")
    p.add_argument("--logs", default=None, metavar="DIR", help="write each server's output to DIR/layout-<i>.log")
    args, serve_args = p.parse_known_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        p.error(f"--clients {args.clients!r}: give comma-separated counts, e.g. 1,4,16")
    if not args.clients or min(args.clients) < 1:
        p.error(f"--clients {args.clients}: every count must be >= 1, e.g. 1,4,16")
    args.answers = list(dict.fromkeys(a.strip() for a in args.answer.split(",") if a.strip()))
    if not args.answers or set(args.answers) - set(ANSWERS):
        p.error(f"--answer {args.answer!r}: give json, png or json,png")
    if args.requests_per_client < 0:
        p.error(f"--requests-per-client {args.requests_per_client} must be >= 1 (or 0: the default rule)")
    for name in ("timeout", "ready_timeout", "deadline"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0 seconds")
    reserved = [a for a in serve_args if a.split("=")[0] in ("--port", "--host", "--token")]
    if reserved:
        p.error(f"{reserved[0]}: the benchmark sets serve's address itself (127.0.0.1, a free port, no token)")
    rows = [(text, None, ()) for text in args.layout]
    if args.preset == "gpu-serve":
        rows += [(text.format(lora=args.lora_file), clients, loras) for text, clients, loras in GPU_SERVE_ROWS
                 if args.lora_file or not loras]
    if not rows:
        p.error("give at least one --layout, or --preset gpu-serve")
    if args.lora_file and not os.path.isfile(args.lora_file):
        p.error(f"--lora-file {args.lora_file}: no such file (ditmesh synth --lora 64 --model DIR --out DIR writes "
                "DIR/lora.safetensors)")
    args.layouts = [shlex.split(text) for text, _, _ in rows]
    args.layout_clients = [list(clients) if clients else None for _, clients, _ in rows]
    args.layout_loras = [loras for _, _, loras in rows]
    args.serve_args = serve_args
    return args


def requests_per_client(args, clients: int) -> int:
    return args.requests_per_client or max(2, math.ceil(4 / clients))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# -- the server process -------------------------------------------------------------------------------------------
class Server:
    """One ``ditmesh serve`` subprocess in its own process group; its output is kept (tail) and parsed for the port."""

    def __init__(self, command: list[str], log_path: str | None):
        self.command = command
        self.tail: deque[str] = deque(maxlen=60)
        self.port: int | None = None
        self.bound = threading.Event()
        self.log = open(log_path, "w") if log_path else None  # noqa: SIM115  (closed in stop)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.rank_pids: list[int] = []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            if self.log:
                self.log.write(line)
            found = re.search(r"ditmesh: bound http://\S+:(\d+)", line)
            if found and self.port is None:
                self.port = int(found.group(1))
                self.bound.set()
        self.bound.set()  # exited: nobody waits for a port that will not come

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0,
                accept: str | None = None):
        """(status, parsed JSON or text) of one HTTP call to the server; a picture's file (``accept``
        ``image/png``) as the JSON answer's fields (:func:`file_answer`)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data else {}
            if accept:
                headers["Accept"] = accept
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            content = response.read()
            kind = response.getheader("Content-Type", "")
            if kind.startswith("image/") and response.status == 200:
                return response.status, file_answer(response, kind, content)
            text = content.decode()
            return response.status, json.loads(text) if kind.startswith("application/json") else text
        finally:
            conn.close()

    def died(self) -> str:
        """What to say of a server that exited: its last line first (a one-line error), then its output's tail."""
        self.reader.join(timeout=5)  # the lines it wrote before exiting
        lines = [line for line in self.tail if line.strip()]
        last = lines[-1] if lines else "no output"
        tail = "\n".join(lines[-25:])
        return f"the server exited with code {self.proc.returncode}: {last}\nits last lines:\n{tail}"

    def wait_ready(self, timeout: float, deadline: float) -> float:
        """Seconds from launch until /health answers 200; RuntimeError if the server exits or takes too long."""
        limit = min(time.perf_counter() + timeout, deadline)
        self.bound.wait(max(0.0, limit - time.perf_counter()))
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(self.died())
            if self.port is not None:
                with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                    status, health = self.request("GET", "/health", timeout=2)
                    if status == 200:
                        self.rank_pids = [p for r in health["replicas"] for p in r["pids"]]
                        return time.perf_counter() - self.t0
            if time.perf_counter() > limit:
                if limit == deadline:
                    raise Deadline()
                raise RuntimeError(f"the server did not answer /health 200 within {timeout:.0f} s")
            time.sleep(0.25)

    def stop(self) -> list[int]:
        """SIGINT (serve stops its replicas), then SIGTERM, then SIGKILL to the group; the rank pids left alive."""
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            if self.port is not None and self.proc.poll() is None:
                _, health = self.request("GET", "/health", timeout=2)
                self.rank_pids = [p for r in health["replicas"] for p in r["pids"]]
        for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGINT:  # the front end alone: it stops its replicas' ranks itself
                    self.proc.send_signal(sig)
                else:
                    os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        deadline = time.time() + 10
        while [p for p in self.rank_pids if process_alive(p)] and time.time() < deadline:
            time.sleep(0.2)
        left = [p for p in self.rank_pids if process_alive(p)]
        for pid in left:  # ranks that outlived the front end: by their own id, as a last resort
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # anything else left in the server's own group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(timeout=5)
        if self.log:
            self.log.close()
        return left


class MemorySampler:
    """Peak memory per rank pid, sampled every ``period`` seconds: GPU MiB from nvidia-smi (when it shows the pids)
    and host RSS MiB from /proc."""

    def __init__(self, pids: list[int], period: float = 1.0):
        self.pids, self.period = pids, period
        self.gpu: dict[int, float] = {}
        self.rss: dict[int, float] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(timeout=10)
        self.sample()

    def _run(self) -> None:
        while not self.stopping.wait(self.period):
            self.sample()

    def sample(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(OSError, StopIteration, ValueError):
                with open(f"/proc/{pid}/status") as f:
                    kib = int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
                self.rss[pid] = max(self.rss.get(pid, 0.0), kib / 1024)
        for pid, mib in gpu_memory_by_pid().items():
            if pid in self.pids:
                self.gpu[pid] = max(self.gpu.get(pid, 0.0), mib)

    def peaks(self) -> dict:
        return {"peak_gpu_mib_per_rank": max(self.gpu.values()) if self.gpu else None,
                "peak_rss_mib_per_rank": round(max(self.rss.values()), 1) if self.rss else None}


def gpu_memory_by_pid() -> dict[int, float]:
    """{pid: MiB} of the compute processes nvidia-smi lists; {} without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[int, float] = {}
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            pid, mib = (x.strip() for x in line.split(","))
            found[int(pid)] = found.get(int(pid), 0.0) + float(mib)
    return found


# -- the clients ---------------------------------------------------------------------------------------------------
def file_answer(response, kind: str, content: bytes) -> dict:
    """A picture's file answered to ``Accept: image/png`` as the JSON answer's fields: its X-Ditmesh-* headers, and
    the file as ``images[0]["file"]``."""
    header = response.getheader
    return {"id": header("X-Ditmesh-Id"), "seconds": float(header("X-Ditmesh-Seconds")),
            "batch": int(header("X-Ditmesh-Batch")), "timeline": json.loads(header("X-Ditmesh-Timeline")),
            "received_at": float(header("X-Ditmesh-Received-At")),
            "answered_at": float(header("X-Ditmesh-Answered-At")), "images": [{"media_type": kind, "file": content}]}


def picture_sha256(image: dict) -> str:
    """The sha256 of a picture's file, from either answer (``file``, or ``b64`` of the JSON answer)."""
    import base64
    import hashlib

    return hashlib.sha256(image["file"] if "file" in image else base64.b64decode(image.get("b64", ""))).hexdigest()


def generate(server: Server, prompt: str, seed: int, timeout: float, lora: str | None = None,
             answer: str = "json") -> dict:
    """One POST /generate (with ``lora``: that named adapter; ``answer``: how the picture comes, ``ANSWERS``): its
    outcome, latency (client side, to the answer read and, as JSON, parsed), the id the server gave it, the server's
    timeline of it (seconds per phase) and the sha256 of its picture's file (taken after the latency)."""
    t0, sent_at = time.perf_counter(), time.time()
    body = {"prompt": prompt, "seed": seed, **({"lora": lora} if lora else {})}
    try:
        status, body = server.request("POST", "/generate", body, timeout=timeout,
                                      accept=None if answer == "json" else ANSWERS[answer])
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return {"ok": False, "seconds": time.perf_counter() - t0, "id": None, "error": f"{type(exc).__name__}: {exc}"}
    seconds, read_at = time.perf_counter() - t0, time.time()
    if status != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)[:200]
        return {"ok": False, "seconds": seconds, "id": None, "error": f"HTTP {status}: {message}"}
    if not body.get("images"):
        return {"ok": False, "seconds": seconds, "id": body.get("id"), "error": "answered 200 without a picture"}
    return {"ok": True, "seconds": seconds, "id": body["id"], "images": len(body["images"]),
            "sha256": picture_sha256(body["images"][0]), "seed": seed,
            "server_seconds": body.get("seconds"), "batch": body.get("batch", 1),
            "timeline": dict(body.get("timeline", {}), **http_phases(body, sent_at, read_at)), "error": None}


def http_phases(body: dict, sent_at: float, read_at: float) -> dict:
    """The way in (from the client's send to the server's reading the request) and the way out (from the server's
    starting the answer to the client's having read and parsed it), from the answer's ``received_at`` and
    ``answered_at`` and this host's clock (the client runs beside the server); none for a server without them."""
    if "received_at" not in body or "answered_at" not in body:
        return {}
    return {"http_in": round(body["received_at"] - sent_at, 4), "http_out": round(read_at - body["answered_at"], 4)}


def run_phase(server: Server, args, clients: int, seed0: int, deadline: float, loras: tuple = (),
              answer: str = "json") -> dict:
    """``clients`` threads, each sending its requests one after the other (``loras``: request i of a client asks
    for adapter ``loras[i % len(loras)]``, None for none; ``answer``: how the pictures come, each a prompt of its
    own so that no phase hits the prompt cache of another); the row of this phase."""
    per_client = requests_per_client(args, clients)
    start = threading.Barrier(clients)
    interrupted = threading.Event()  # Ctrl-C or SIGTERM: each client sends nothing more

    def client(c: int) -> list[dict]:
        start.wait()
        answers = []
        for i in range(per_client):
            left = deadline - time.perf_counter()
            if left <= 0 or interrupted.is_set():
                answers.append({"ok": False, "seconds": 0.0, "id": None, "error": "not sent: the run's deadline passed"
                                if left <= 0 else "not sent: interrupted"})
                continue
            answers.append(generate(server, f"{args.prompt} #{c}.{i}" + ("" if answer == "json" else f" {answer}"),
                                    seed0 + c * per_client + i, min(args.timeout, left),
                                    loras[(c + i) % len(loras)] if loras else None, answer))
        return answers

    with MemorySampler(server.rank_pids) as memory:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            try:
                answers = [a for chunk in pool.map(client, range(clients)) for a in chunk]
            except BaseException:
                interrupted.set()  # the pool's exit waits for the requests in flight only (each bounded)
                raise
        wall = time.perf_counter() - t0
    ok = [a for a in answers if a["ok"]]
    ids = [a["id"] for a in ok]
    duplicates = len(ids) - len(set(ids))
    latencies = [a["seconds"] for a in ok]
    errors = sorted({a["error"] for a in answers if a["error"]})
    row = {"clients": clients, "answer": answer, "requests_per_client": per_client, "sent": len(answers),
           "ok": len(ok),
           "failed": len(answers) - len(ok), "duplicate_ids": duplicates,
           "answered_once": duplicates == 0 and len(ok) == len(answers),
           "images": sum(a["images"] for a in ok), "wall_s": round(wall, 6),
           "images_per_s": round(sum(a["images"] for a in ok) / wall, 4),
           "latency_s": ({"p50": round(percentile(latencies, 50), 4), "p99": round(percentile(latencies, 99), 4),
                          "mean": round(sum(latencies) / len(latencies), 4), "min": round(min(latencies), 4),
                          "max": round(max(latencies), 4)} if latencies else None),
           "latencies_s": [round(s, 4) for s in latencies],
           "server_seconds": [a["server_seconds"] for a in ok],
           "batched": sum(a["batch"] > 1 for a in ok), "errors": errors[:5], **memory.peaks(),
           "pictures_sha256": {str(a["seed"]): a["sha256"] for a in ok},
           "phases_s": mean_phases([a["timeline"] for a in ok])}
    return row


def mean_phases(timelines: list[dict]) -> dict:
    """The mean seconds of each phase over the timelines that have it."""
    names = [name for t in timelines for name in t]
    return {name: round(sum(t[name] for t in timelines if name in t) / sum(name in t for t in timelines), 4)
            for name in dict.fromkeys(names)}


# -- one layout ----------------------------------------------------------------------------------------------------
def cpu_busy(period: float = 0.5) -> float:
    """The share of the host's CPU time spent busy over ``period`` seconds (/proc/stat; 0.0 where it is missing)."""
    def read():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # all, idle + iowait
    try:
        total0, idle0 = read()
        time.sleep(period)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def settle(limit_s: float, below: float = 0.10) -> tuple[float, float]:
    """Wait until the host is under ``below`` busy, at most ``limit_s`` seconds: (seconds waited, busy share then)."""
    t0 = time.perf_counter()
    busy = cpu_busy()
    while busy >= below and time.perf_counter() - t0 < limit_s:
        busy = cpu_busy()
    return round(time.perf_counter() - t0, 2), round(busy, 3)


def run_layout(index: int, layout: list[str], args, deadline: float) -> dict:
    clients, loras = args.layout_clients[index] or args.clients, args.layout_loras[index]
    command = [sys.executable, "-m", "ditmesh", "serve", "--model", args.model, "--port", "0", *layout,
               *args.serve_args]
    result = {"layout": shlex.join(layout), "command": shlex.join(command), "rows": [], "error": None,
              "request_loras": list(loras)}
    log = os.path.join(args.logs, f"layout-{index}.log") if args.logs else None
    if args.settle > 0:
        result["settle_s"], result["busy_at_start"] = settle(min(args.settle, max(0.0, deadline - time.perf_counter())))
        progress(f"  host settled in {result['settle_s']:.1f} s ({100 * result['busy_at_start']:.0f}% busy)")
    progress(f"layout {index + 1}/{len(args.layouts)} [{result['layout']}]: starting {result['command']}")
    server = Server(command, log)
    try:
        result["ready_s"] = round(server.wait_ready(args.ready_timeout, deadline), 3)
        _, health = server.request("GET", "/health")
        replicas = health["replicas"]
        result.update(replicas=len(replicas), ranks_per_replica=replicas[0]["ranks"],
                      gpus=sum(r["ranks"] for r in replicas), load_s=[r["load_s"] for r in replicas],
                      warm_s=[r["warm_s"] for r in replicas])
        progress(f"  ready after {result['ready_s']:.1f} s: {len(replicas)} replica(s) x {replicas[0]['ranks']} "
                 f"rank(s)")
        left = max(1.0, deadline - time.perf_counter())
        first = generate(server, f"{args.prompt} #first", 0, min(args.timeout, left))
        if not first["ok"]:
            raise RuntimeError(f"the first request failed: {first['error']}")
        result["first_image_s"] = round(time.perf_counter() - server.t0, 3)
        result["first_request_s"] = round(first["seconds"], 3)
        progress(f"  first image {result['first_image_s']:.1f} s after launch (the request itself "
                 f"{first['seconds']:.2f} s)")
        result["first_timeline"] = first.get("timeline")
        result["first_sha256"] = first["sha256"]
        if measures_batching(command):  # measured once the service is idle: the load phases run as it decided
            result["batching_measured_s"], result["batching"] = wait_batching(server, deadline)
            progress(f"  batching measured {result['batching_measured_s']:.1f} s after launch: use "
                     f"{[b['use'] for b in result['batching']]} (a whole call's seconds by batch size: "
                     f"{[b['seconds'] for b in result['batching']]})")
        for phase, count in enumerate(clients):
            for answer in args.answers:
                if time.perf_counter() >= deadline:
                    raise Deadline()
                progress(f"  {count} client(s) x {requests_per_client(args, count)} request(s), {answer} ...")
                row = run_phase(server, args, count, 1000 * (phase + 1), deadline, loras, answer)
                result["rows"].append(row)
                lat = row["latency_s"] or {}
                progress(f"  {count} client(s), {answer}: {row['ok']}/{row['sent']} ok in {row['wall_s']:.1f} s, "
                         f"{row['images_per_s']:.3f} img/s, p50 {lat.get('p50', float('nan')):.2f} s, "
                         f"p99 {lat.get('p99', float('nan')):.2f} s"
                         + (f"; errors: {row['errors']}" if row["errors"] else ""))
                if server.proc.poll() is not None:
                    raise RuntimeError(server.died())
        if "png" in args.answers:  # the first request again, as a file: the JSON answer's picture byte for byte
            again = generate(server, f"{args.prompt} #first", 0, max(1.0, min(args.timeout, deadline -
                                                                              time.perf_counter())), answer="png")
            result["first_png_same_as_json"] = again["ok"] and again["sha256"] == result["first_sha256"]
            same = "the same bytes" if result["first_png_same_as_json"] else "DIFFERENT from the JSON answer's"
            progress(f"  the first picture asked again as a file: {same}")
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            _, health = server.request("GET", "/health")
            result["restarts"] = sum(r["restarts"] for r in health["replicas"])
    except Deadline:
        result["error"] = f"the run's --deadline {args.deadline:.0f} s passed"
    except RuntimeError as exc:
        result["error"] = str(exc)
    except KeyboardInterrupt:
        result["error"] = result["interrupted"] = "interrupted (Ctrl-C or SIGTERM)"
    finally:
        left = server.stop()
        result["exit_code"] = server.proc.returncode
        if left:
            result["error"] = (result["error"] or "") + f"; rank pids {left} outlived the server (killed)"
        progress(f"  stopped (exit code {server.proc.returncode})" + (f"; ERROR: {result['error']}"
                                                                        if result["error"] else ""))
    return result


def measures_batching(command: list[str]) -> bool:
    """Whether ``ditmesh serve COMMAND`` measures batching while idle: ``--max-batch`` N > 1 without ``--batching
    always`` (which measures before the service is ready)."""
    values = {flag: command[i + 1] for i, flag in enumerate(command[:-1]) if flag in ("--max-batch", "--batching")}
    return int(values.get("--max-batch", 1)) > 1 and values.get("--batching", "auto") == "auto"


def wait_batching(server, deadline: float) -> tuple[float, list[dict]]:
    """Wait (the service idle) until every replica has measured batching; returns the seconds after launch and each
    replica's measurement."""
    while True:
        _, health = server.request("GET", "/health")
        measured = [r["batching"] for r in health["replicas"]]
        if all(m is not None for m in measured):
            return round(time.perf_counter() - server.t0, 3), measured
        if time.perf_counter() >= deadline:
            raise Deadline()
        if server.proc.poll() is not None:
            raise RuntimeError(server.died())
        time.sleep(0.25)


def progress(line: str) -> None:
    print(f"[serve_bench {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def environment() -> dict:
    """Versions, the card and the host, without starting CUDA in this process."""
    from importlib import metadata

    versions = {}
    for name in ("ditmesh", "torch", "diffusers", "fastapi", "uvicorn"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            versions["ditmesh_commit"] = commit.stdout.strip()
    cards = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        cards = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return {"versions": versions, "python": platform.python_version(), "host": platform.node(),
            "card": cards[0].split(",")[0] if cards else f"cpu ({platform.processor() or platform.machine()})",
            "cards": cards, "cpus": os.cpu_count()}


def row_layout(layout: dict, row: dict) -> str:
    """A row's layout cell: the layout, and how its clients took their pictures unless as JSON (the default)."""
    answer = row.get("answer", "json")
    return f"`{layout['layout']}`" + ("" if answer == "json" else f", {answer}")


def table(results: list[dict]) -> str:
    def num(value, digits=2):
        return "" if value is None else f"{value:.{digits}f}"

    lines = ["| layout | replicas x ranks | clients | ok / sent | wall s | img/s | p50 s | p99 s | mean s | ready s | "
             "first image s | peak GPU MiB/rank | peak RSS MiB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        shape = f"{r['replicas']} x {r['ranks_per_replica']}" if "replicas" in r else ""
        if not r["rows"] and not r["error"]:
            lines.append(f"| `{r['layout']}` | {shape} | | | | | | | | {num(r.get('ready_s'), 1)} | "
                         f"{num(r.get('first_image_s'), 1)} | | |")
        for row in r["rows"]:
            lat = row["latency_s"] or {}
            lines.append(f"| {row_layout(r, row)} | {shape} | {row['clients']} | {row['ok']} / {row['sent']} | "
                         f"{row['wall_s']:.1f} | {row['images_per_s']:.3f} | {num(lat.get('p50'))} | "
                         f"{num(lat.get('p99'))} | {num(lat.get('mean'))} | {num(r.get('ready_s'), 1)} | "
                         f"{num(r.get('first_image_s'), 1)} | {num(row['peak_gpu_mib_per_rank'], 0)} | "
                         f"{num(row['peak_rss_mib_per_rank'], 0)} |")
        if r["error"]:
            lines.append(f"| `{r['layout']}` | error: {r['error'].splitlines()[0]} |||||||||||")
    return "\n".join(lines)


#: the phases of a request in the order they run, as the timelines name them: the way in, the queue, rank 0's call
#: (its phases, then ``call_other``: the call's seconds outside them), the hand-off to the front end, PNG encoding,
#: the way out (the answer built, sent, read and parsed by the client)
SEQUENCE = ("http_in", "queue", "lora_switch", "text_encode", "prepare", "steps", "vae_decode", "postprocess",
            "call_other", "handoff", "encode", "http_out")
#: the phases of the second table: the sequence and, after the steps, ``step`` (the median later step) and
#: ``step_max`` (the slowest)
TABLE_PHASES = (*SEQUENCE[:6], "step", "step_max", *SEQUENCE[6:])
#: a lone request's bound: the steps at the steady step plus this much (issue 45)
LONE_BOUND_S = 0.15


def account(phases: dict, latency: float) -> dict:
    """``phases`` (mean seconds) with ``call_other`` (the call minus its phases), ``sum`` (the sequence's phases) and
    ``unaccounted`` (the client's mean latency minus that sum: what no phase measured)."""
    out = dict(phases)
    if "call" in phases:
        inside = sum(phases.get(name, 0.0) for name in SEQUENCE[2:8])
        out["call_other"] = round(phases["call"] - inside, 4)
    out["sum"] = round(sum(out.get(name, 0.0) for name in SEQUENCE), 4)
    out["unaccounted"] = round(latency - out["sum"], 4)
    return out


def phase_table(results: list[dict], steps: int | None = None) -> str:
    """Mean seconds of each phase of a request, per layout and clients: the way in, the server's timelines, the way
    out; their sum against the client's mean latency; for one client, the bound ``steps`` x step + 0.15 s."""
    names = (*TABLE_PHASES, "sum", "client", "unaccounted", "bound")
    lines = ["| layout | clients | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in results:
        for row in r["rows"]:
            latency = (row.get("latency_s") or {}).get("mean")
            phases = account(row.get("phases_s") or {}, latency or 0.0)
            phases["client"] = latency
            if row["clients"] == 1 and steps and "step" in phases:
                phases["bound"] = round(steps * phases["step"] + LONE_BOUND_S, 4)
            lines.append(f"| {row_layout(r, row)} | {row['clients']} | " + " | ".join(
                f"{phases[name]:.3f}" if phases.get(name) is not None else "" for name in names) + " |")
    return "\n".join(lines)


def serve_steps(serve_args: list[str]) -> int:
    """The steps of every request: the servers' ``--steps`` (28, ``generate``'s default, without it)."""
    return int(serve_args[serve_args.index("--steps") + 1]) if "--steps" in serve_args else 28


def e2e_rows(report: dict) -> list[dict]:
    """Rows of ``scripts/e2e_bench.py``'s table from a report of this script: per layout and clients, ``wall_s`` the
    mean latency a client saw, and ``overhead_s`` that minus the steps at the steady step (the timelines' median
    later step, times ``--steps``): the service's own cost, which issue 32 bounds at 0.15 s for a lone client."""
    steps = serve_steps(report.get("serve_args") or [])
    rows = []
    for layout in report["layouts"]:
        for row in layout["rows"]:
            phases, latency = row.get("phases_s") or {}, row.get("latency_s") or {}
            if "step" not in phases or "mean" not in latency:
                continue
            answer = "" if row.get("answer", "json") == "json" else f", {row['answer']}"
            rows.append({"row": f"serve {layout['layout']} x {row['clients']} client(s){answer}",
                         "wall_s": latency["mean"],
                         "steady_step_s": phases["step"], "steps": steps,
                         "overhead_s": round(latency["mean"] - steps * phases["step"], 4),
                         "images_per_s": row["images_per_s"], "phases_s": phases})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    # SIGTERM and SIGINT stop this script (and, through its SIGINT to each, the servers) as Ctrl-C does, also where
    # SIGINT came ignored (a shell's background job)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.perf_counter()
    deadline = t0 + args.deadline
    report = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **environment(), "serve_args": args.serve_args, "clients": args.clients, "layouts": []}
    try:
        for index, layout in enumerate(args.layouts):
            if time.perf_counter() >= deadline:
                report["layouts"].append({"layout": shlex.join(layout), "rows": [], "command": None,
                                          "error": f"skipped: the run's --deadline {args.deadline:.0f} s passed"})
                continue
            report["layouts"].append(run_layout(index, layout, args, deadline))
            if report["layouts"][-1].get("interrupted"):
                report["interrupted"] = True
                break
    except KeyboardInterrupt:  # between layouts: no server runs
        report["interrupted"] = True
    if report.get("interrupted"):
        progress("interrupted; no server is left running")
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    print(table(report["layouts"]))
    print()
    print(phase_table(report["layouts"], serve_steps(args.serve_args)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        progress(f"wrote {args.json}")
    complete = not report.get("interrupted") and all(
        not r["error"] and all(row["answered_once"] for row in r["rows"]) for r in report["layouts"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
