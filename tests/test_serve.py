"""`ditmesh serve` as a client meets it: a real server process on 127.0.0.1 with the tiny pipeline (64x64, 2
steps, two replicas of one rank), its HTTP API, bad requests, the bearer token, metrics, progress events, a bounded load test, the web
page in a headless chromium, and a rank killed and stopped mid-request on gloo (2 ranks)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from cases_models import run_ranks
from ditmesh.testing import free_port, process_alive
from test_serve_jobs import _ScriptedReplica

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.contextmanager
def running_server(*argv, ready_s: float = 180, tmp=None):
    """``ditmesh serve`` in a process of its own until it answers /health; yields (base URL, process); its output's
    lines collect in ``proc.lines``. ``tmp``: its temporary folder ($TMPDIR). At the end SIGINT must stop it and its
    ranks."""
    port = free_port()
    env = dict(os.environ, **({"TMPDIR": str(tmp)} if tmp else {}))
    launched = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ditmesh", "serve", "--port", str(port), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    proc.lines = []
    reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
    reader.start()
    proc.reader = reader
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + ready_s
    try:
        while True:
            assert proc.poll() is None, f"the server exited: {''.join(proc.lines)[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not become ready"
            time.sleep(0.5)
        ready = time.time() - launched  # as a user times it: launch to the first answer of /health
        while not any("ditmesh: serving" in line for line in proc.lines) and time.time() < deadline:
            time.sleep(0.1)
        said = next(line for line in proc.lines if "ditmesh: serving" in line)
        after = float(re.search(r"ready ([\d.]+) s after launch", said).group(1))
        # the line comes before the first answer; /health may wait up to its 2 s timeout and 0.5 s between tries
        assert ready - 3.0 <= after <= ready + 0.5, (said, ready)
        yield base, proc
    finally:
        pids = []
        with contextlib.suppress(Exception):
            pids = [p for r in httpx.get(f"{base}/health", timeout=2).json()["replicas"] for p in r["pids"]]
        proc.send_signal(signal.SIGINT)
        stopped = True
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stopped = False
            proc.kill()
            proc.wait()
        time.sleep(0.5)
        assert not [p for p in pids if process_alive(p)], "rank processes outlived the server"
        assert stopped, "SIGINT did not stop the server"


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc: parent links)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        children = [p for p, parent in parents.items() if parent == pid]
        found += children
        todo += children
    return found


def test_sigint_while_starting_stops_the_server_and_its_ranks_also_as_a_background_job():
    # a shell starts a background job with SIGINT ignored, and children inherit that; serve must still stop on it
    # (and on SIGTERM) while its ranks load, before the HTTP server takes the signals over
    for sig in (signal.SIGINT, signal.SIGTERM):
        argv = ["serve", "--port", str(free_port()), "--nproc", "2", "--ulysses", "2", "--steps", "2", "--height", "64",
                "--width", "64"]
        ignored = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731  (as a shell's background job)
        proc = subprocess.Popen([sys.executable, "-m", "ditmesh", *argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=ignored)
        try:
            deadline = time.time() + 120
            while len(ranks := _descendants(proc.pid)) < 2:  # the launcher's ranks are up
                assert proc.poll() is None and time.time() < deadline, "the ranks did not start"
                time.sleep(0.2)
            proc.send_signal(sig)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        time.sleep(0.5)
        assert not [p for p in ranks if process_alive(p)], f"rank processes outlived the server ({sig.name})"


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def decode(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


@pytest.fixture(scope="module")
def server():
    with running_server("--dp", "2", "--steps", "2", "--height", "64", "--width", "64", "--token", TOKEN,
                        "--max-steps", "8", "--warmup-sizes", "48x32",
                        "--max-pixels", str(128 * 128), "--max-n", "2") as (base, _):
        with httpx.Client(base_url=base, headers=AUTH, timeout=120) as client:
            yield client


def test_openai_and_native_requests_return_the_pictures(server):
    r = server.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2, "size": "64x64",
                                                    "response_format": "b64_json", "model": "any"})
    assert r.status_code == 200, r.text
    assert [decode(d["b64_json"]).size for d in r.json()["data"]] == [(64, 64), (64, 64)]
    a = server.post("/generate", json={"prompt": "a blue square", "seed": 7, "steps": 3, "guidance": 2.5})
    b = server.post("/generate", json={"prompt": "a blue square", "seed": 7, "steps": 3, "guidance": 2.5})
    c = server.post("/generate", json={"prompt": "a blue square", "seed": 8, "steps": 3, "height": 32, "width": 48})
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.json()["images"][0]["b64"] == b.json()["images"][0]["b64"]  # seeded: the same picture
    assert decode(c.json()["images"][0]["b64"]).size == (48, 32)
    # every replica warmed up at the default size and at --warmup-sizes before it served
    replicas = server.get("/health").json()["replicas"]
    assert [r["ranks"] for r in replicas] == [1, 1]  # --dp 2: two replicas of one rank each
    assert all(list(r["warm_s"]) == ["64x64", "48x32"] for r in replicas)


def test_a_served_picture_is_generates_picture_pixel_for_pixel(server, tmp_path):
    """The service's path to the answer (pictures rounded on the ranks' device, PNG stored or deflated, the answer's
    JSON built around the base64 text) gives the pixels ``generate`` writes for the same request."""
    r = server.post("/generate", json={"prompt": "a green triangle", "seed": 11})
    assert r.status_code == 200, r.text
    out = tmp_path / "g.png"
    # generate's rank code in this process, as a one-process run of the command runs it (cases_models.run_ranks)
    run_ranks(["generate", "--prompt", "a green triangle", "--seed", "11", "--steps", "2", "--height", "64", "--width",
               "64", "--out", str(out)])
    with Image.open(out) as written:
        assert decode(r.json()["images"][0]["b64"]).tobytes() == written.convert("RGB").tobytes()


def test_a_client_that_accepts_image_png_gets_the_file_itself_the_same_bytes_as_the_json_answer(server):
    """``Accept: image/png``: the body is the PNG file the JSON answer carries in base64, byte for byte, and the JSON
    answer's other fields come as X-Ditmesh-* headers (both routes); a request for several pictures that way is
    refused before it runs."""
    body = {"prompt": "a yellow star", "seed": 5}
    as_json = server.post("/generate", json=body)
    as_file = server.post("/generate", json=body, headers={"Accept": "image/png"})
    assert as_json.status_code == as_file.status_code == 200, as_file.text
    assert as_file.headers["content-type"] == "image/png"
    assert as_file.content == base64.b64decode(as_json.json()["images"][0]["b64"])
    assert Image.open(io.BytesIO(as_file.content)).size == (64, 64)
    timeline = json.loads(as_file.headers["x-ditmesh-timeline"])
    assert timeline["steps"] > 0 and "encode" in timeline and as_file.headers["x-ditmesh-batch"] == "1"
    received, answered = float(as_file.headers["x-ditmesh-received-at"]), float(as_file.headers["x-ditmesh-answered-at"])
    assert received <= answered and float(as_file.headers["x-ditmesh-seconds"]) <= answered - received + 0.01
    assert re.fullmatch(r"[0-9a-f]{12}", as_file.headers["x-ditmesh-id"])
    assert as_file.headers["x-ditmesh-id"] != as_json.json()["id"]
    # the JSON answer wins a tie or a higher q; the file a higher q
    preferred = server.post("/generate", json=body, headers={"Accept": "application/json;q=0.5, image/*"})
    assert preferred.headers["content-type"] == "image/png" and preferred.content == as_file.content
    for accept in ("*/*", "image/png;q=0.2, application/json", "image/png, application/json"):
        r = server.post("/generate", json=body, headers={"Accept": accept})
        assert r.headers["content-type"] == "application/json" and r.json()["images"][0]["b64"] == \
            as_json.json()["images"][0]["b64"], accept
    openai = server.post("/v1/images/generations", json={"prompt": "a yellow star", "size": "64x64"},
                         headers={"Accept": "image/png"})
    assert openai.status_code == 200 and openai.content[:8] == b"\x89PNG\r\n\x1a\n"
    # refused in one line, before any work: more than one picture, an Accept of neither kind, a bad q
    before = server.get("/metrics").text
    for path, request, accept, needle in (
            ("/generate", {"prompt": "x", "n": 2}, "image/png", "n 2 with Accept: image/png: the file answer holds "
                                                                "one picture; ask n 1, or accept application/json"),
            ("/v1/images/generations", {"prompt": "x", "n": 2}, "image/*", "n 2 with Accept: image/*"),
            ("/generate", {"prompt": "x"}, "text/html", "Accept: text/html: this route answers application/json"),
            ("/generate", {"prompt": "x"}, "image/png;q=2", "q=2 must be a number from 0 to 1")):
        r = server.post(path, json=request, headers={"Accept": accept})
        message = r.json()["error"]["message"]
        assert r.status_code == 406 and needle in message and len(message.splitlines()) == 1, r.text
    bad = [line for line in server.get("/metrics").text.splitlines() if 'outcome="bad_request"' in line]
    assert int(bad[0].split()[-1]) == 4 + int(next(line for line in before.splitlines()
                                                   if 'outcome="bad_request"' in line).split()[-1])


@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": "x", "height": 70}, 400, "height 70 must be a positive multiple of 16"),
    ({"prompt": "x", "height": 256, "width": 256}, 422, "at most 16384 (--max-pixels)"),
    ({"prompt": "x", "steps": 9}, 422, "steps 9 is over this server's limit: 1 to 8 (--max-steps)"),
    ({"prompt": "x", "n": 3}, 422, "n 3 is over this server's limit: 1 to 2 (--max-n)"),
    ({"prompt": "x", "n": 0}, 400, "n 0 must be >= 1 (this server takes 1 to 2)"),
    ({"prompt": "x", "steps": -3}, 400, "steps -3 must be >= 1 (this server takes 1 to 8)"),
    ({"prompt": "x", "frames": 5}, 400, "frames 5: flux pipelines generate images"),
    ({"prompt": "x", "out": "/etc/passwd"}, 400, "unknown field 'out'"),
    ({"prompt": "x", "steps": "many"}, 400, "steps must be a number"),
    ({"prompt": "x", "lora": "ink"}, 400, "lora 'ink': this server has no named LoRA adapters"),
    ({"prompt": ""}, 400, "prompt is empty"),
])
def test_bad_requests_get_one_clear_4xx(server, body, status, needle):
    r = server.post("/generate", json=body)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, content, needle", [
    ("/generate", '{"prompt": "x", "guidance": NaN}', "NaN is not a finite number"),
    ("/generate", '{"prompt": "x", "seed": Infinity}', "Infinity is not a finite number"),
    ("/generate", '{"prompt": "x", "guidance": 1e999}', "guidance inf is not a finite number"),
    ("/generate", '{"prompt": ', "not valid JSON"),
    ("/generate", '["x"]', "must be a JSON object"),
    ("/v1/images/generations", '{"prompt": "x", "size": "64x65"}', "height 65 must be a positive multiple of 16"),
    ("/v1/images/generations", '{"prompt": "x", "size": "big"}', "must be WIDTHxHEIGHT"),
    ("/v1/images/generations", '{"prompt": "x", "response_format": "url"}', "is not served"),
    ("/v1/images/generations", '{"prompt": "x", "quality": "hd"}', "unknown field 'quality'"),
])
def test_malformed_bodies_get_one_clear_400_and_the_service_keeps_serving(server, path, content, needle):
    r = server.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert server.post("/generate", json={"prompt": "still here"}).status_code == 200


def test_the_bearer_token_is_required_except_for_the_page_and_health(server):
    base = str(server.base_url)
    assert httpx.post(f"{base}/generate", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200
    assert "<form" in httpx.get(f"{base}/").text


def test_progress_events_then_the_picture(server):
    job = server.post("/jobs", json={"prompt": "a green line", "steps": 4})
    assert job.status_code == 202
    events = []
    with server.stream("GET", f"/jobs/{job.json()['id']}/events") as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: ") and events[-1] == "done":
                assert decode(json.loads(line[6:])["images"][0].split(",", 1)[1]).size == (64, 64)
    assert events[-1] == "done" and "progress" in events
    # a finished request cannot be cancelled; an unknown one is not found
    assert server.delete(f"/jobs/{job.json()['id']}").status_code == 409
    assert server.delete("/jobs/nope").status_code == 404
    # an unknown path or a wrong method: the documented error shape, not FastAPI's {"detail": ...}
    missing, method = server.get("/nope"), server.put("/generate")
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("no such path: /nope")
    assert method.status_code == 405 and method.json()["error"] == {
        "message": "PUT is not served at /generate (allowed: POST)", "code": 405}


def test_load_every_request_is_answered_exactly_once(server):
    clients, per_client = 8, 3
    before = _metric(server, 'ditmesh_requests_total{outcome="ok"}')
    pid = server.get("/health").json()["replicas"][0]["pids"][0]
    rss_before = _rss_bytes(pid)

    def client(c):
        out = []
        for i in range(per_client):
            t0 = time.perf_counter()
            r = server.post("/generate", json={"prompt": f"client {c} request {i}", "seed": c * 100 + i})
            out.append((r.status_code, r.json().get("id"), time.perf_counter() - t0))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for chunk in pool.map(client, range(clients)) for x in chunk]
    wall = time.perf_counter() - t0
    assert [s for s, _, _ in results] == [200] * clients * per_client
    assert len({i for _, i, _ in results}) == clients * per_client  # one answer per request, none shared
    assert _metric(server, 'ditmesh_requests_total{outcome="ok"}') - before == clients * per_client
    latencies = sorted(s for _, _, s in results)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(f"\nserve load: {len(results)} requests from {clients} clients in {wall:.2f} s "
          f"({len(results) / wall:.1f} req/s); p50 {statistics.median(latencies):.3f} s, p99 {p99:.3f} s; "
          f"rank RSS {rss_before / 2**20:.0f} -> {_rss_bytes(pid) / 2**20:.0f} MiB")
    assert _rss_bytes(pid) - rss_before < 256 * 2**20
    assert _metric(server, "ditmesh_queue_length") == 0
    # the two replicas (independent process groups) both took requests
    assert all(r["served"] >= 3 for r in server.get("/health").json()["replicas"])


def _metric(client, name: str) -> float:
    text = client.get("/metrics").text
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_metrics_are_prometheus_text(server):
    text = server.get("/metrics").text
    for name in ("ditmesh_queue_length", "ditmesh_images_total", "ditmesh_failures_total",
                 'ditmesh_request_latency_seconds_bucket{le="+Inf"}', "ditmesh_request_latency_seconds_count"):
        assert any(line.startswith(name + " ") for line in text.splitlines()), name
    assert _metric(server, "ditmesh_images_total") >= 1
    assert _metric(server, 'ditmesh_requests_total{outcome="bad_request"}') >= 1


# -- the web page in a real browser -----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium, installed with apt-get when missing (no browser can be downloaded otherwise)."""
    found = shutil.which("chromium")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed and apt-get cannot install it here (needs apt-get as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:  # stale package lists: refresh once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=300)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"apt-get install chromium failed: {proc.stderr[-2000:]}"
    return shutil.which("chromium")


class DevTools:
    """The smallest client of chromium's DevTools protocol: one page, commands answered in order."""

    def __init__(self, binary: str, profile):
        import websocket

        self.proc = subprocess.Popen([binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--remote-debugging-port=0", "--remote-allow-origins=*",
                                      f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.time() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0

    def send(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str, await_promise: bool = False):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=await_promise)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def close(self):
        self.ws.close()
        self.proc.kill()
        self.proc.wait()


def test_the_page_generates_a_picture_in_headless_chromium(server, chromium, tmp_path):
    browser = DevTools(chromium, tmp_path)
    try:
        browser.send("Page.navigate", url=str(server.base_url) + "/")
        deadline = time.time() + 60
        while browser.evaluate("document.readyState") != "complete" or not browser.evaluate("!!document.getElementById('go')"):
            assert time.time() < deadline
            time.sleep(0.1)
        assert browser.evaluate("document.getElementById('size').value") == "64x64"  # the server's defaults
        browser.evaluate(f"""document.getElementById('token').value = {json.dumps(TOKEN)};
                             document.getElementById('steps').value = 3;
                             document.getElementById('seed').value = 5;
                             document.getElementById('go').click()""")
        while not browser.evaluate("!!document.querySelector('#result img')"):
            message = browser.evaluate("document.getElementById('message').textContent")
            assert time.time() < deadline and not message.startswith("error"), message
            time.sleep(0.1)
        size = browser.evaluate("(async () => { const img = document.querySelector('#result img'); await img.decode(); "
                                "return [img.naturalWidth, img.naturalHeight]; })()", await_promise=True)
        assert size == [64, 64]
        src = browser.evaluate("document.querySelector('#result img').src")
        assert decode(src.split(",", 1)[1]).size == (64, 64)
        value, top = browser.evaluate("[document.getElementById('progress').value, document.getElementById('progress').max]")
        assert value == top > 0  # the bar is full
        assert browser.evaluate("document.getElementById('message').textContent").startswith("done in")
        # a refused request after that picture: its error stands alone, the old picture is gone
        # (the submit event itself: the form's own check would stop the click before any request)
        browser.evaluate("document.getElementById('steps').value = 100000; "
                         "document.getElementById('form').dispatchEvent(new Event('submit', {cancelable: true}))")
        while browser.evaluate("document.getElementById('go').disabled") or browser.evaluate(
                "document.getElementById('message').textContent").startswith(("waiting", "done in")):
            assert time.time() < deadline
            time.sleep(0.1)
        assert "steps" in browser.evaluate("document.getElementById('message').textContent")
        assert not browser.evaluate("!!document.querySelector('#result img')")
    finally:
        browser.close()


# -- faults --------------------------------------------------------------------------------------------------------
def _progress_then(client, job_id: str, min_step: int, action) -> tuple[str, dict]:
    """Follow a job's events; call ``action()`` once it has finished ``min_step`` steps; return its last event."""
    acted = False
    event = None
    with client.stream("GET", f"/jobs/{job_id}/events") as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "progress" and data["step"] >= min_step and not acted:
                    action()
                    acted = True
                if event in ("done", "error"):
                    return event, data
    raise AssertionError("the event stream ended without an answer")


def test_a_rank_killed_or_stopped_mid_request_fails_that_request_and_the_replica_restarts_and_cancel_stops_it(
        tmp_path):
    with running_server("--nproc", "2", "--ulysses", "2", "--steps", "2", "--height", "64", "--width", "64",
                        "--step-timeout", "4", "--max-steps", "200", tmp=tmp_path) as (base, proc):
        with httpx.Client(base_url=base, timeout=180) as client:
            pids = client.get("/health").json()["replicas"][0]["pids"]
            # killed: the request in flight fails naming rank 1; one queued behind it runs after the restart
            job = client.post("/jobs", json={"prompt": "a long one", "steps": 200}).json()["id"]
            queued = client.post("/jobs", json={"prompt": "queued behind", "seed": 1}).json()["id"]
            event, data = _progress_then(client, job, 2, lambda: os.kill(pids[1], signal.SIGKILL))
            assert event == "error" and data["status"] == 500, data
            assert "rank 1 of replica 0" in data["message"] and "died" in data["message"]
            assert "running step" in data["message"] and job in data["message"]
            event, data = _progress_then(client, queued, 99, lambda: None)
            assert event == "done", data
            health = client.get("/health").json()["replicas"][0]
            assert health["restarts"] == 1 and not set(health["pids"]) & set(pids)
            pids = health["pids"]
            # cancelled while it runs: both ranks stop after the same step, no restart, the next request runs
            job = client.post("/jobs", json={"prompt": "to cancel", "steps": 200}).json()["id"]
            event, data = _progress_then(client, job, 2, lambda: client.delete(f"/jobs/{job}").raise_for_status())
            assert event == "error" and data["status"] == 499 and "cancelled after step" in data["message"], data
            assert client.post("/generate", json={"prompt": "after the cancel"}).status_code == 200
            health = client.get("/health").json()["replicas"][0]
            assert health["restarts"] == 1 and health["pids"] == pids
            # stopped (a hang): no step and no heartbeat from rank 1 within --step-timeout
            job = client.post("/jobs", json={"prompt": "another long one", "steps": 200}).json()["id"]
            t0 = time.time()
            event, data = _progress_then(client, job, 2, lambda: os.kill(pids[1], signal.SIGSTOP))
            assert event == "error" and "rank 1 of replica 0" in data["message"], data
            assert time.time() - t0 < 4 + 10  # found within the step timeout and a few polls
            ok = client.post("/generate", json={"prompt": "after the restart"})
            assert ok.status_code == 200, ok.text
            assert client.get("/health").json()["replicas"][0]["restarts"] == 2
            assert _metric(client, "ditmesh_rank_faults_total") == 2
            _sigterm_with_requests_in_flight(client, proc, tmp_path)


def _sigterm_with_requests_in_flight(client, proc, tmp):
    """SIGTERM while one request runs and two wait: each client gets a 503 JSON naming its request, the log says
    one line per rank and nothing else (no traceback, no leaked semaphore), no process and no temporary file is
    left, and the exit code is 0."""
    import psutil

    answers = [None] * 3

    def send(i, steps):
        answers[i] = client.post("/generate", json={"prompt": f"in flight {i}", "steps": steps})

    senders = [threading.Thread(target=send, args=(i, 200 if i == 0 else 2)) for i in range(3)]
    senders[0].start()
    while _metric(client, "ditmesh_busy_replicas") < 1:
        time.sleep(0.05)
    for t in senders[1:]:
        t.start()
    while _metric(client, "ditmesh_queue_length") < 2:
        time.sleep(0.05)
    family = psutil.Process(proc.pid).children(recursive=True)
    assert len(family) >= 2  # the two ranks (and multiprocessing's resource tracker)
    seen = len(proc.lines)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    for t in senders:
        t.join(timeout=30)
    for answer in answers:
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == 503 and f"request {error['job']} was stopped" in error["message"], error
        assert "stopping (SIGTERM)" in error["message"]
    assert len({a.json()["error"]["job"] for a in answers}) == 3
    assert sum("at step" in a.json()["error"]["message"] for a in answers) == 1  # the running one
    proc.reader.join(timeout=10)
    log = proc.lines[seen:]
    assert len(log) == 2 and all(re.fullmatch(r"ditmesh: stopped rank [01] of replica 0 \(pid \d+, exit code -9\) "
                                              r"on SIGTERM\n", line) for line in log), log
    assert not [line for line in proc.lines if "Traceback" in line or "leaked semaphore" in line]
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, alive
    assert not list(tmp.iterdir())


@pytest.mark.parametrize("argv, line", [
    (["--warmup-sizes", "64x70"], "--warmup-sizes 64x70: height 70 must be a positive multiple of 16 (e.g. 64)"),
    (["--steps", "50", "--max-steps", "10"], "the server's own defaults break its limits: steps 50 is over this "
                                             "server's limit: 1 to 10 (--max-steps)"),
    # the size given is checked, not the model's default (a wrong pass would meet the --warmup-sizes refusal)
    (["--height", "4096", "--width", "4096", "--warmup-sizes", "64x70"],
     "the server's own defaults break its limits: 4096x4096 is 16777216 pixels; this server allows at most 4194304 "
     "(--max-pixels)"),
    (["--nproc", "2", "--ulysses", "4"], None),
    (["--dp", "2", "--replicas", "2"], "--dp 2 and --replicas 2 both ask for replicas (the service runs --dp as "
                                       "replicas); give one of them"),
    (["--nproc", "3", "--dp", "2"], "--nproc 3 is not a multiple of --dp 2 (with --dp, --nproc counts the ranks of "
                                    "all replicas)"),
    (["--plan", "auto"], "--plan auto needs --nproc (the ranks of one replica)"),
    (["--port", "65536"], "--port 65536 must be between 0 and 65535"),
    (["--step-timeout", "0"], "--step-timeout 0.0 must be > 0 seconds (e.g. 60)"),
    (["--unavailable-timeout", "0"], "--unavailable-timeout 0.0 must be > 0 seconds (e.g. 60)"),
    # timeouts under a second pass their check: the refusal is the next one's
    (["--step-timeout", "0.5", "--load-timeout", "0.5", "--unavailable-timeout", "0.5", "--port", "65536"],
     "--port 65536 must be between 0 and 65535"),
])
def test_serve_refuses_bad_options_in_one_line_and_leaves_no_rank(capsys, argv, line):
    """The values' checks come before any rank starts; those that read the model's family run while the ranks
    import (they start early), and their refusal stops them."""
    import multiprocessing

    from ditmesh.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ditmesh: error: ")
    assert line is None or lines[0] == f"ditmesh: error: {line}"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("ditmesh-serve-")]


def test_batching_auto_is_measured_after_the_first_picture_on_every_rank_and_gives_way_to_a_request():
    """--batching auto on a replica of two ranks: ready without any batch shape built (the start-up line says the
    measurement comes once the service is idle), the first request runs alone; then the idle replica measures, its
    two ranks stopping the search at the same size (a hang otherwise), and a request that comes meanwhile is answered
    (the measurement stops for it and is made again at the next idle moment)."""
    with running_server("--nproc", "2", "--ulysses", "2", "--steps", "2", "--height", "64", "--width", "64",
                        "--max-batch", "2") as (base, proc):
        with httpx.Client(base_url=base, timeout=120) as client:
            ready = next(line for line in proc.lines if "serving" in line)
            assert "batching up to 2 pictures a call where a measurement finds it pays, measured once the service " \
                   "is idle" in ready, ready
            first = client.post("/generate", json={"prompt": "first", "seed": 1}).json()
            assert first["batch"] == 1 and client.get("/health").json()["replicas"][0]["batching"] is None
            deadline = time.time() + 60
            while client.get("/health").json()["replicas"][0]["state"] != "calibrating":
                assert time.time() < deadline, "the idle replica did not measure batching"
                time.sleep(0.02)
            during = client.post("/generate", json={"prompt": "during", "seed": 2})
            assert during.status_code == 200 and during.json()["batch"] == 1
            while (measured := client.get("/health").json()["replicas"][0]["batching"]) is None:
                assert time.time() < deadline + 60, "the measurement never ended"
                time.sleep(0.2)
            assert measured["use"] in (1, 2) and sorted(measured["seconds"]) == ["1", "2"], measured
            assert _metric(client, "ditmesh_max_batch") == measured["use"]
            assert _metric(client, "ditmesh_batching_measured_replicas") == 1
            said = [line for line in proc.lines if "replica 0: " in line and "batching" in line]
            # the request stopped the measurement unless it ended first; either way the last line is its result
            assert said and "measured while idle" in said[-1], said
            assert all("gave way to a request" in line for line in said[:-1]), said
            print("\n" + "\n".join(said))


def test_waiting_requests_that_differ_in_prompt_and_seed_share_one_call_and_get_their_own_pictures(tmp_path):
    import numpy as np

    from cases_lora import make_lora
    from ditmesh.tiny import default_model_path

    asks = [("a red circle at the top left", 3), ("a blue square at the bottom", 4), ("a green triangle", 5)]
    ink = make_lora(default_model_path(), str(tmp_path / "ink"), seed=1)
    with running_server("--steps", "2", "--height", "64", "--width", "64", "--max-steps", "400",
                        "--max-batch", "3", "--batching", "always", "--lora", f"ink={ink}:0.8") as (base, proc):
        with httpx.Client(base_url=base, timeout=120) as client:
            # every batch shape was warmed up and timed before the service said it was ready, and it says what it
            # uses (here, as asked) and what it measured
            measured = client.get("/health").json()["replicas"][0]["batching"]
            assert sorted(measured["seconds"]) == ["1", "2", "3"] and measured["use"] in (1, 2, 3), measured
            assert _metric(client, "ditmesh_max_batch") == 3
            assert _metric(client, 'ditmesh_batch_call_seconds{size="3"}') == measured["seconds"]["3"]
            ready = next(line for line in proc.lines if "serving" in line)
            assert "; batching up to 3 pictures a call: as asked (--batching always) (a whole call, seconds a picture " \
                   "by batch size: 1: " in ready, ready
            _named_adapter_requests(client)
            # the one replica is busy with a long request while three compatible ones arrive; cancelling it lets
            # them run, as one call
            long = client.post("/jobs", json={"prompt": "long", "steps": 400}).json()["id"]
            while client.get(f"/jobs/{long}").json()["state"] != "running":
                time.sleep(0.05)
            ids = [client.post("/jobs", json={"prompt": p, "seed": s}).json()["id"] for p, s in asks]
            assert client.get(f"/jobs/{long}").json()["state"] == "running"
            served = client.get("/health").json()["replicas"][0]["served"]
            client.delete(f"/jobs/{long}").raise_for_status()
            batched = [_progress_then(client, job, 99, lambda: None) for job in ids]
            assert [event for event, _ in batched] == ["done"] * 3, batched
            # /health counts requests answered with pictures: the batched call answered three
            assert client.get("/health").json()["replicas"][0]["served"] == served + 3
            alone = [client.post("/generate", json={"prompt": p, "seed": s}).json() for p, s in asks]
            assert [a["batch"] for a in alone] == [1, 1, 1]
            assert _metric(client, "ditmesh_batched_requests_total") == 3
            assert client.get(f"/jobs/{ids[0]}").json()["state"] == "done"
    for (_, data), single in zip(batched, alone):
        got = np.asarray(decode(data["images"][0].split(",", 1)[1]), dtype=np.int16)
        want = np.asarray(decode(single["images"][0]["b64"]), dtype=np.int16)
        assert np.abs(got - want).max() <= 1  # float32 on CPU: a batch of 3 rounds like a batch of 1, to a level
    firsts = [np.asarray(decode(data["images"][0].split(",", 1)[1])) for _, data in batched]
    assert not np.array_equal(firsts[0], firsts[1])  # each its own prompt and seed


def _named_adapter_requests(client):
    """A server started with ``--lora ink=...``: the adapter is off unless a request names it (native or
    OpenAI-shaped), the same request gives the same picture, and an unknown name is refused naming ``ink``."""
    import numpy as np

    def picture(route, body):
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return np.asarray(decode(data["images"][0]["b64"] if "images" in data else data["data"][0]["b64_json"]))

    body = {"prompt": "a lighthouse", "seed": 9}
    base, inked = picture("/generate", body), picture("/generate", dict(body, lora="ink"))
    assert np.abs(base.astype(int) - inked.astype(int)).max() > 8  # the adapter changes the picture
    assert np.array_equal(picture("/generate", dict(body, lora=None)), base)
    assert np.array_equal(picture("/generate", dict(body, lora="ink")), inked)
    assert np.array_equal(picture("/v1/images/generations", {"prompt": "a lighthouse", "lora": "ink"}),
                          picture("/generate", {"prompt": "a lighthouse", "lora": "ink"}))
    r = client.post("/generate", json=dict(body, lora="clay"))
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "lora 'clay' is not loaded; the adapters are: ink (or null for none)"


@pytest.mark.parametrize("path, body, status, field, needle", [
    ("/generate", {"prompt": "x", "n": 0}, 400, "n", "n 0 must be >= 1 (this server takes 1 to 2)"),
    ("/generate", {"prompt": "x", "steps": -3}, 400, "steps", "steps -3 must be >= 1 (this server takes 1 to 8)"),
    ("/generate", {"prompt": "x", "steps": 9}, 422, "steps", "steps 9 is over this server's limit: 1 to 8"),
    ("/generate", {"prompt": "x", "height": 256, "width": 256}, 422, "height, width", "at most 16384"),
    ("/generate", {"prompt": "x", "height": 70}, 400, "height", "height 70 must be a positive multiple of 16"),
    ("/generate", {"prompt": "x", "seed": "s"}, 400, "seed", "seed must be a number"),
    ("/v1/images/generations", {"prompt": "x", "size": "64x65"}, 400, "size", "height 65 must be a positive multiple"),
    ("/v1/images/generations", {"prompt": "x", "n": 0}, 400, "n", "n 0 must be >= 1"),
])
def test_a_bad_value_is_a_400_naming_its_field_and_counts_as_a_bad_request_not_a_failure(path, body, status, field,
                                                                                          needle):
    # 400: no server would run it; 422: over this server's limits (serve/requests.py). The service's failures
    # (ditmesh_failures_total) are its own, not the client's: in-process app, no replica is asked
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from ditmesh.serve.app import Service, create_app
    from ditmesh.serve.requests import Limits

    defaults = SimpleNamespace(prompt="x", steps=2, seed=0, height=64, width=64, frames=None, images_per_prompt=1,
                               guidance=3.5)
    service = Service([_ScriptedReplica()], limits=Limits(max_pixels=128 * 128, max_steps=8, max_frames=9, max_n=2),
                      defaults=defaults)
    client = TestClient(create_app(service))
    r = client.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["field"] == field, r.text
    assert needle in r.json()["error"]["message"] and len(r.json()["error"]["message"].splitlines()) == 1
    text = client.get("/metrics").text
    assert 'ditmesh_requests_total{outcome="bad_request"} 1' in text.splitlines()
    assert "ditmesh_failures_total 0" in text.splitlines()
    assert service.queue.qsize() == 0  # refused before it was queued
