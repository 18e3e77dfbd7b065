"""The service's job states without rank processes: the front end (``serve.app.Service`` and its routes, in process)
with replicas that stand in for rank groups and do what each test tells them, and ``serve.replica.Replica``'s
request loop fed with the events its ranks would send. Each state a job passes through — queued, running, done,
failed, cancelled — when requests run alone, share a call (batched), are cancelled while they wait or run, time
out on a hung rank, are refused by the pipeline or find the queue full; each answered exactly once, and counted
once in the metrics. tests/test_serve.py meets the same paths through a real server and real ranks."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from ditmesh.serve.app import LATENCY_BUCKETS, Service, create_app
from ditmesh.serve.replica import FAULT_GRACE_S, RankFault, RankState, Replica, RequestCancelled, RequestFailed
from ditmesh.serve.requests import Limits
from ditmesh.testing import process_alive

LIMITS = Limits(max_pixels=128 * 128, max_steps=8, max_frames=9, max_n=2)
DEFAULTS = SimpleNamespace(prompt=["a"], steps=2, seed=0, height=64, width=64, frames=None, images_per_prompt=1,
                           guidance=3.5)


class _ScriptedReplica:
    """Stands in for a Replica: each call records its options, then does what the test puts in ``script``, one
    item at a time: ``("step", k)`` reports step k, ``("done",)`` returns a picture per prompt (its prompt and the
    call's seeds; ``("done", phases)``: with the ranks' ``phases`` seconds, else a ``call`` of 0), ``("cancelled",)``, ``("refused", why)`` and ``("fault", why)`` raise what a replica raises."""

    def __init__(self, index: int = 0):
        self.index, self.state, self.restarts, self.served, self.world = index, "ready", 0, 0, 1
        self.load_s, self.warm_s = [], {}
        self.calls, self.cancels = [], []
        self.script: queue.Queue = queue.Queue()
        self.seen = 0  # calls the test has looked at (next_call)
        self.in_flight = None
        # --batching auto: the measurements asked for (their ids), what the next one returns, and its stop flag
        self.batching, self.calibrations, self.measurements, self.stopped = None, [], queue.Queue(), None

    def run(self, job_id, options, on_step=None):
        self.calls.append(options)
        self.state, self.in_flight = "busy", job_id
        try:
            while True:
                what, *arg = self.script.get(timeout=10)
                if what == "step":
                    on_step(arg[0], options.get("steps", DEFAULTS.steps))
                    continue
                self.state = "ready"
                if what == "done":
                    prompts = options["prompt"] if isinstance(options["prompt"], list) else [options["prompt"]]
                    return ([("image/png", f"{p}|{options.get('seed')}".encode()) for p in prompts],
                            arg[0] if arg else {"call": 0.0})
                if what == "cancelled":
                    raise RequestCancelled(f"request {job_id} was cancelled after step 1 of 2")
                if what == "refused":
                    raise RequestFailed(arg[0])
                self.state = "failed"
                raise RankFault(arg[0])
        finally:
            self.in_flight = None

    def next_call(self, then=None) -> dict:
        """Let the call in flight end with ``then`` (if given) and return the options of the next call."""
        if then is not None:
            self.script.put(then)
        _wait(lambda: len(self.calls) > self.seen, "no call reached the replica")
        self.seen += 1
        return self.calls[self.seen - 1]

    def calibrate(self, job_id, waiting=lambda: False):
        """As Replica.calibrate: the measurement the test puts in ``measurements``, or None once cancelled."""
        self.calibrations.append(job_id)
        self.state, self.in_flight, self.stopped = "calibrating", job_id, threading.Event()
        if waiting():
            self.stopped.set()
        try:
            while not self.stopped.is_set():
                with contextlib.suppress(queue.Empty):
                    return self.measurements.get(timeout=0.01)
            return None
        finally:
            self.state, self.in_flight = "ready", None

    def cancel(self, job_id):
        self.cancels.append(job_id)
        if job_id == self.in_flight and self.stopped is not None:
            self.stopped.set()
        return job_id == self.in_flight

    def restart(self):
        self.restarts += 1
        self.state, self.batching = "ready", None  # new ranks: no batch shape built, nothing measured

    def check(self):
        pass

    def pids(self):
        return []

    def close(self):
        return []


@pytest.fixture
def service():
    """A started Service of one scripted replica (``service.replica``), max_batch 3, a queue of 4."""
    replica = _ScriptedReplica()
    svc = Service([replica], LIMITS, DEFAULTS, queue_size=4, max_batch=3, restart_delay_s=0.01)
    svc.replica = replica
    svc.start()
    yield svc
    while not replica.script.empty():
        replica.script.get()
    replica.script.put(("done",))
    svc.stop()


def test_stop_alone_ends_the_dispatchers():
    """``stop`` without a ``shutdown`` first (a replica that could not start, a test's teardown) still ends every
    dispatcher: none is left polling the queue."""
    svc = Service([_ScriptedReplica()], LIMITS, DEFAULTS, queue_size=4, restart_delay_s=0.01)
    svc.start()
    svc.stop()
    assert not [t.name for t in svc.threads if t.is_alive()]


def _wait(condition, what: str, timeout: float = 10):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.01)


def _outcomes(svc) -> dict:
    """The jobs' outcomes ``/metrics`` counts (those not zero; refusals of a route's input, e.g. a 404, left out)."""
    lines = [line for line in svc.metrics().splitlines() if line.startswith("ditmesh_requests_total{")]
    counts = {line.split('"')[1]: int(line.split()[-1]) for line in lines if int(line.split()[-1])}
    return {k: v for k, v in counts.items() if k not in ("bad_request", "unauthorized")}


def test_job_states_through_the_routes_queued_running_progress_cancelled_done(service):
    from fastapi.testclient import TestClient

    replica = service.replica
    with TestClient(create_app(service)) as client:
        first = client.post("/jobs", json={"prompt": "first"})
        assert first.status_code == 202
        first = first.json()["id"]
        replica.next_call()
        assert client.get(f"/jobs/{first}").json() == {"id": first, "state": "running", "step": 0, "steps": 2}
        second = client.post("/jobs", json={"prompt": "second", "steps": 3}).json()
        assert second["state"] == "queued"
        replica.script.put(("step", 1))
        _wait(lambda: client.get(f"/jobs/{first}").json()["step"] == 1, "the step did not show")
        assert client.get(f"/jobs/{second['id']}").json() == {**second, "step": 0, "steps": 3}
        # cancelled while it waits: answered at once, never reaches the replica; a second cancel is refused
        assert client.delete(f"/jobs/{second['id']}").json() == {"id": second["id"], "state": "cancelled"}
        assert client.get(f"/jobs/{second['id']}").json()["state"] == "cancelled"
        again = client.delete(f"/jobs/{second['id']}")
        assert again.status_code == 409 and "is cancelled" in again.json()["error"]["message"]
        third = client.post("/jobs", json={"prompt": "third"}).json()["id"]
        assert replica.next_call(then=("done",))["prompt"] == "third"  # the cancelled one was skipped
        assert client.get(f"/jobs/{first}").json()["state"] == "done"
        assert client.delete(f"/jobs/{first}").status_code == 409  # finished: nothing to cancel
        assert client.get(f"/jobs/{third}").json()["state"] == "running"
        replica.script.put(("done",))
        _wait(lambda: client.get(f"/jobs/{third}").json()["state"] == "done", "the third job did not finish")
        assert [c["prompt"] for c in replica.calls] == ["first", "third"] and replica.cancels == []
        assert client.get("/jobs/nothing").status_code == 404
    assert _outcomes(service) == {"ok": 2, "cancelled": 1}
    metrics = service.metrics()
    assert "ditmesh_images_total 2" in metrics
    # the latency histogram: cumulative counts of the two answered jobs, the last bucket and the count hold both
    buckets = [int(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("ditmesh_request_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 2 and len(buckets) == len(LATENCY_BUCKETS) + 1
    assert "ditmesh_request_latency_seconds_count 2" in metrics


def test_a_service_never_stopped_does_not_keep_the_interpreter_alive():
    # its dispatchers are daemon threads: a front end that dies without stop() leaves no process behind
    code = ("from types import SimpleNamespace; from ditmesh.serve.app import Service\n"
            "class R:\n index, state, world = 0, 'ready', 1\n def check(self): pass\n"
            "Service([R()], None, SimpleNamespace(steps=2)).start(); print('started')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "started", done.stderr


def test_a_running_job_cancelled_is_stopped_by_its_replica_and_answered_499_once(service):
    replica = service.replica
    job = service.submit({"prompt": "long", "steps": 8})
    replica.next_call()
    assert service.cancel(job) and replica.cancels == [job.id]
    assert job.state == "running" and not job.future.done()  # the ranks stop after their next step
    replica.script.put(("cancelled",))
    answer = job.future.result(10)
    assert answer["error"] == (499, f"request {job.id} was cancelled after step 1 of 2") and job.state == "cancelled"
    assert not service.cancel(job)
    assert _outcomes(service) == {"cancelled": 1} and "ditmesh_failures_total 0" in service.metrics()


def test_a_batch_takes_only_compatible_requests_in_order_and_a_cancelled_member_leaves_the_others_running(service):
    replica = service.replica
    busy = service.submit({"prompt": "busy"})
    replica.next_call()
    a, b, c, d = [service.submit(options) for options in (
        {"prompt": "a", "seed": 1}, {"prompt": "b", "seed": 2, "steps": 3}, {"prompt": "c"},
        {"prompt": "d", "images_per_prompt": 2})]
    full = service.submit({"prompt": "full"})  # a queue of 4
    assert full.future.result(1)["error"][0] == 429 and full.state == "failed"
    call = replica.next_call(then=("done",))  # "busy" ends; a and c (same options but prompt and seed) share a call
    assert busy.future.result(10)["images"] == [("image/png", b"busy|None")] and busy.state == "done"
    assert call["prompt"] == ["a", "c"] and call["seed"] == [1, 0]
    assert a.state == c.state == "running" and b.state == d.state == "queued"
    assert service.cancel(c) and replica.cancels == []  # c: answered now; a goes on
    assert c.future.result(1)["error"][0] == 499 and c.state == "cancelled"
    assert not service.cancel(c)
    assert replica.next_call(then=("done",))["prompt"] == "b"  # b differs in steps, d asks for two pictures
    assert a.future.result(10)["images"] == [("image/png", b"a|[1, 0]")] and a.future.result()["batch"] == 2
    assert c.future.result()["error"][0] == 499 and c.state == "cancelled"  # answered once: the picture is dropped
    assert replica.next_call(then=("done",))["prompt"] == "d"
    replica.script.put(("done",))
    assert b.future.result(10)["batch"] == 1 and d.future.result(10)["batch"] == 1
    assert "ditmesh_batched_requests_total 2" in service.metrics()
    assert _outcomes(service) == {"ok": 4, "cancelled": 1, "queue_full": 1}


def test_cancelling_every_member_of_a_running_batch_stops_its_call(service):
    replica = service.replica
    busy = service.submit({"prompt": "busy"})
    replica.next_call()
    a, b, c, d = [service.submit({"prompt": p}) for p in "abcd"]
    assert replica.next_call(then=("done",))["prompt"] == ["a", "b", "c"]  # at most max_batch
    assert busy.future.result(10)["error"] is None and d.state == "queued"
    assert service.cancel(b) and service.cancel(c) and replica.cancels == []  # a still wants the call
    assert service.cancel(a) and replica.cancels == [a.id]  # the last member: the call itself is stopped
    assert a.state == "running" and not a.future.done()
    assert replica.next_call(then=("cancelled",))["prompt"] == "d"
    assert a.future.result(10)["error"][0] == 499 and a.state == b.state == c.state == "cancelled"
    assert b.future.result()["error"][0] == c.future.result()["error"][0] == 499
    replica.script.put(("done",))
    assert d.future.result(10)["error"] is None
    assert _outcomes(service) == {"ok": 2, "cancelled": 3}


def test_a_batch_whose_rank_times_out_fails_500_together_and_the_replica_restarts(service, capsys):
    replica = service.replica
    busy = service.submit({"prompt": "busy"})
    replica.next_call()
    a, b = service.submit({"prompt": "a"}), service.submit({"prompt": "b"})
    replica.next_call(then=("done",))
    assert busy.future.result(10)["error"] is None
    replica.script.put(("step", 1))
    _wait(lambda: a.step == b.step == 1, "both members of the batch report the step")
    hung = "rank 1 of replica 0 hung: no step finished within 0.5 s while running step 2 of 2 of request x"
    replica.script.put(("fault", hung))
    for job in (a, b):
        answer = job.future.result(10)
        assert answer["error"] == (500, f"{hung}; the replica is restarting, send the request again")
        assert job.state == "failed"
    _wait(lambda: replica.restarts == 1, "the replica was not restarted")
    after = service.submit({"prompt": "after"})
    assert replica.next_call()["prompt"] == "after"
    replica.script.put(("done",))
    assert after.future.result(10)["error"] is None and after.state == "done"
    assert _outcomes(service) == {"ok": 2, "fault": 2} and "ditmesh_rank_faults_total 1" in service.metrics()
    assert "ditmesh_restarts_total 1" in service.metrics()
    log = capsys.readouterr().err.splitlines()  # the server's log has the fault (with its requests) and the restart
    assert log == [f"ditmesh: replica 0: rank fault: {hung}; request {a.id}, {b.id} answered 500; restarting the "
                   "replica", "ditmesh: replica 0: restarted in 0.0 s"], log


def test_a_rank_found_dead_while_idle_is_counted_once_and_its_replica_restarted(service, capsys):
    replica = service.replica
    dead = threading.Event()

    def check():  # the idle dispatcher's health check: the rank died between requests, found once
        if not dead.is_set():
            dead.set()
            replica.state = "failed"
            raise RankFault("rank 1 of replica 0 died (exit code -9) while idle")

    replica.check = check
    _wait(lambda: replica.restarts == 1, "the replica was not restarted")
    after = service.submit({"prompt": "after"})
    assert replica.next_call(then=None)["prompt"] == "after"
    replica.script.put(("done",))
    assert after.future.result(10)["error"] is None
    assert "ditmesh_rank_faults_total 1" in service.metrics() and "ditmesh_restarts_total 1" in service.metrics()
    assert capsys.readouterr().err.splitlines() == [
        "ditmesh: replica 0: rank fault while idle: rank 1 of replica 0 died (exit code -9) while idle; restarting "
        "the replica", "ditmesh: replica 0: restarted in 0.0 s"]
    assert _outcomes(service) == {"ok": 1}


def test_a_request_the_pipeline_refuses_fails_422_and_the_replica_keeps_serving(service):
    replica = service.replica
    job = service.submit({"prompt": "odd"})
    replica.next_call()
    replica.script.put(("refused", "height 72 is not a multiple of 16"))
    assert job.future.result(10)["error"] == (422, "the pipeline refused the request: height 72 is not a multiple "
                                                   "of 16")
    assert job.state == "failed" and replica.restarts == 0
    assert _outcomes(service) == {"refused": 1}


def test_a_request_times_its_handoff_and_its_answer(service):
    # handoff: the call's seconds on the front end less the ranks' own ``call``, never below zero (the ranks report
    # their own clock); respond: the seconds building the answer, within the request's
    from fastapi.testclient import TestClient

    replica = service.replica
    slow = service.submit({"prompt": "slow"})
    replica.next_call()
    time.sleep(0.05)
    replica.script.put(("done",))
    assert slow.future.result(10)["timeline"]["handoff"] >= 0.05
    replica.script.put(("done", {"call": 60.0}))  # the ranks report more than the front end waited
    with TestClient(create_app(service)) as client:
        start = time.perf_counter()
        answer = client.post("/generate", json={"prompt": "fast"})
        elapsed = time.perf_counter() - start
    assert answer.status_code == 200 and answer.json()["timeline"]["handoff"] == 0.0
    respond = next(line for line in service.metrics().splitlines() if 'phase="respond"' in line)
    assert 0.0 <= float(respond.split()[-1]) <= elapsed


# -- a replica's request loop, fed the events of its ranks ---------------------------------------------------------
class _Process:
    def __init__(self, exitcode=None, pid=1):
        self.exitcode, self.pid = exitcode, pid

    def is_alive(self):
        return self.exitcode is None


def _replica_in_a_request(processes, steps_done, since_s, step_timeout=0.5):
    """A Replica whose ranks are stand-ins, in request ``j`` of 10 steps; rank k finished ``steps_done[k]``
    steps ``since_s[k]`` seconds ago."""
    replica = Replica(0, len(processes), {"steps": 10}, step_timeout=step_timeout, load_timeout=10)
    now = time.time()
    replica.ranks = [RankState(p, beat=now, step=s, progress=now - t) for p, s, t in zip(processes, steps_done, since_s)]
    replica._events, replica._requests, replica._cancel = queue.Queue(), queue.Queue(), threading.Event()
    replica.state, replica._in_request, replica._job, replica._steps = "busy", True, "j", 10
    return replica


def test_a_rank_that_finishes_no_step_within_the_step_timeout_is_named_as_hung():
    replica = _replica_in_a_request([_Process(), _Process()], [3, 2], [0.0, 1.0])
    with pytest.raises(RankFault, match=r"^rank 1 of replica 0 hung: no step finished within 0.5 s while running "
                                        r"step 3 of 10 of request j$"):
        replica._next_event(None, None)
    assert replica.state == "failed"
    replica = _replica_in_a_request([_Process(), _Process()], [3, 3], [0.1, 0.1])
    assert replica._next_event(None, None) is None  # in time: nothing to say
    replica = _replica_in_a_request([_Process(), _Process()], [10, 10], [0.0, 0.0])
    replica.ranks[0].beat -= 1.0  # no heartbeat from rank 0 for twice the timeout
    with pytest.raises(RankFault, match=r"^rank 0 of replica 0 stopped answering \(no heartbeat for 0.5 s\) while "
                                        r"decoding the pictures of request j$"):
        replica._next_event(None, None)


def test_no_step_for_exactly_the_step_timeout_is_still_in_time(monkeypatch):
    from ditmesh.serve import replica as replica_module

    monkeypatch.setattr(replica_module, "time", SimpleNamespace(time=lambda: 1000.0, sleep=time.sleep))
    replica = _replica_in_a_request([_Process(), _Process()], [3, 3], [0, 0])
    for rank in replica.ranks:
        rank.beat, rank.progress = 1000.0, 999.5  # the clock stands at 1000 s; the step timeout is 0.5 s
    assert replica._next_event(None, None) is None
    replica.ranks[1].progress = 999.25
    with pytest.raises(RankFault, match="^rank 1 of replica 0 hung: no step finished within 0.5 s"):
        replica._next_event(None, None)


def test_of_several_dead_ranks_the_one_killed_by_a_signal_is_named():
    replica = _replica_in_a_request([_Process(exitcode=2, pid=10), _Process(exitcode=-9, pid=11)], [10, 4], [0, 0])
    with pytest.raises(RankFault, match=r"rank 1 of replica 0 \(pid 11\) died with exit code -9 while running step 5"):
        replica._next_event(None, None)


def test_a_collective_fault_names_the_peer_that_dies_within_the_grace_period():
    # rank 0's collective fails first; rank 1's death shows only afterwards (within FAULT_GRACE_S): the peer is named
    peer = _Process(pid=11)
    replica = _replica_in_a_request([_Process(pid=10), peer], [4, 4], [0.0, 0.0], step_timeout=30)
    replica._events.put(("fault", 0, "j", "Connection reset by peer"))
    threading.Timer(0.3, lambda: setattr(peer, "exitcode", -9)).start()
    t0 = time.time()
    with pytest.raises(RankFault, match=r"^rank 1 of replica 0 \(pid 11\) died with exit code -9 while running step 5"):
        replica._next_event(None, None)
    assert 0.3 <= time.time() - t0 < FAULT_GRACE_S
    # no peer dies: after the grace period the rank that saw the fault is named, with its cause
    replica = _replica_in_a_request([_Process(pid=10), _Process(pid=11)], [4, 4], [0.0, 0.0], step_timeout=30)
    replica._events.put(("fault", 0, "j", "Connection reset by peer"))
    t0 = time.time()
    with pytest.raises(RankFault, match=r"^rank 0 of replica 0 lost its peers \(Connection reset by peer\) while "
                                        r"running step 5 of 10 of request j$"):
        replica._next_event(None, None)
    assert time.time() - t0 >= FAULT_GRACE_S
    assert replica.state == "failed"


def test_a_replica_request_reports_steps_then_ends_done_cancelled_or_refused():
    replica = _replica_in_a_request([_Process(), _Process()], [0, 0], [0, 0], step_timeout=30)
    replica.state = "ready"
    steps = []
    # a late answer of an earlier request (its client gone) is not this request's
    for event in [("beat", 1), ("step", 1, "other", 5, 2), ("done", 0, "other", True, [("image/png", b"o")], 0.1, {}),
                  ("step", 1, "k", 1, 2), ("step", 0, "k", 1, 2),
                  ("done", 0, "k", True, [("image/png", b"x")], 0.25, {"call": 0.25})]:
        replica._events.put(event)
    assert replica.run("k", {"prompt": "p"}, lambda step, of: steps.append((step, of))) == ([("image/png", b"x")],
                                                                                             {"call": 0.25})
    assert replica._requests.get_nowait() == {"id": "k", "options": {"prompt": "p"}}
    assert steps == [(1, 2)] and [r.step for r in replica.ranks] == [1, 1]  # rank 0's steps drive the progress
    assert replica.state == "ready" and replica.served == 1 and not replica._in_request
    # cancelled: only the request in flight; the ranks say after which step they stopped
    assert not replica.cancel("k")
    replica._events.put(("cancelled", 0, "m", 1, 2))
    replica._in_request, replica._job = True, "m"
    assert replica.cancel("m") and not replica.cancel("other")
    replica._cancel.clear()  # run() clears it as it sends a request
    with pytest.raises(RequestCancelled, match="^request m was cancelled after step 1 of 2$"):
        replica.run("m", {"prompt": "p"})
    assert replica.state == "ready" and not replica._in_request and replica.served == 1
    replica._events.put(("done", 0, "n", False, "height 72 is not a multiple of 16", 0.0, {}))
    t0 = time.time()
    with pytest.raises(RequestFailed, match="height 72"):
        replica.run("n", {"prompt": "p"})
    # a refusal of the call is answered after a short look for a peer that died (not the grace of a fault)
    assert time.time() - t0 < FAULT_GRACE_S
    assert replica.state == "ready" and replica.served == 1


def _stand_in_rank(rank, world, local_rank, port, options, requests, events, cancel):
    """Stands in for ``serve.worker.rank_main`` (a spawned process that loads nothing): fails loading if told to,
    else reports ready (its local rank as its load seconds, so the test sees each rank's), then rank 0 answers each
    request with its steps and a picture of its prompt. Started before its options (``prestart``), it reads them
    first, one message a rank, as ``worker._await_options`` does."""
    if options is None:
        options = requests.get()[1]
    if options.get("fail_rank") == rank:
        events.put(("load_error", rank, "no such folder", ""))
        time.sleep(0.5)
        os._exit(2)
    events.put(("ready", rank, float(local_rank), {"64x64": 0.25 + rank}))
    while True:
        if rank != 0:
            events.put(("beat", rank, time.time()))
            time.sleep(0.2)
            continue
        request = requests.get()
        if isinstance(request, tuple):  # another rank's options (real ranks meet before rank 0 reads requests)
            requests.put(request)
            continue
        steps = request["options"].get("steps", options["steps"])
        for step in range(1, steps + 1):
            events.put(("step", 0, request["id"], step, steps))
        events.put(("done", 0, request["id"], True, [("image/png", request["options"]["prompt"].encode())], 0.1,
                    {"call": 0.1}))


def test_a_replica_starts_its_ranks_serves_finds_a_dead_rank_restarts_and_stops(monkeypatch):
    from ditmesh.serve import worker

    monkeypatch.setattr(worker, "rank_main", _stand_in_rank)
    replica = Replica(1, 2, {"steps": 2}, step_timeout=30, load_timeout=60)
    try:
        replica.start()
        assert replica.state == "ready" and replica.load_s == [2.0, 3.0]  # replica 1's ranks: local ranks 2 and 3
        assert replica.warm_s == {"64x64": 0.25}  # rank 0's
        pids = replica.pids()
        assert len(set(pids)) == 2 and all(process_alive(p) for p in pids)
        steps = []
        assert replica.run("j", {"prompt": "p"}, lambda step, of: steps.append((step, of)))[0] == [("image/png", b"p")]
        assert steps == [(1, 2), (2, 2)] and replica.served == 1
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankFault, match=rf"^rank 1 of replica 1 \(pid {pids[1]}\) died with exit code -9 while "
                                            "idle$"):
            deadline = time.time() + 10
            while time.time() < deadline:
                replica.check()
        assert replica.state == "failed"
        replica.restart()
        assert replica.state == "ready" and replica.restarts == 1 and not set(replica.pids()) & set(pids)
        assert not replica.cancel("j")  # the started group is idle: no request of before is in flight
        assert replica.run("k", {"prompt": "q", "steps": 1})[0] == [("image/png", b"q")]
    finally:
        replica.stop()
    assert not any(process_alive(p) for p in replica.pids())
    early = Replica(0, 3, {}, step_timeout=30, load_timeout=60)  # started before the front end's checks end
    try:
        early.prestart()
        early.options = {"steps": 1}
        early.start()  # every rank gets the options, once
        assert early.state == "ready" and early.load_s == [0.0, 1.0, 2.0]
        assert early.run("e", {"prompt": "early"})[0] == [("image/png", b"early")]
    finally:
        early.stop()
    broken = Replica(0, 2, {"steps": 2, "fail_rank": 1}, step_timeout=30, load_timeout=60)
    try:
        with pytest.raises(RankFault, match="^rank 1 of replica 0 failed loading the pipeline: no such folder$"):
            broken.start()
        assert broken.state == "failed"
    finally:
        broken.stop()


class _ReplicaThatWillNotStart:
    """Stands in for a Replica whose group fails every restart (its model folder gone, say)."""

    def __init__(self, index: int):
        self.index, self.state, self.restarts, self.served, self.world = index, "failed", 0, 0, 1
        self.load_s, self.warm_s, self.tries = [], {}, 0

    def restart(self):
        self.tries += 1
        raise RankFault(f"rank 0 of replica {self.index} failed loading the pipeline: no such folder")

    def pids(self):
        return []

    def close(self):
        return []


def test_replicas_that_keep_failing_to_restart_are_given_up_and_requests_get_503(capsys):
    replicas = [_ReplicaThatWillNotStart(0), _ReplicaThatWillNotStart(1)]
    service = Service(replicas, limits=None, defaults=SimpleNamespace(steps=2), restart_delay_s=0.01,
                      restart_attempts=3)
    queued = service.submit({"prompt": "waits for a replica"})
    service.start()
    try:
        answer = queued.future.result(timeout=10)
        assert answer["error"][0] == 503 and "each failed 3 restarts in a row" in answer["error"][1], answer
        assert "no such folder" in answer["error"][1]
        assert [r.tries for r in replicas] == [3, 3] and [r.state for r in replicas] == ["down", "down"]
        late = service.submit({"prompt": "after"}).future.result(timeout=1)
        assert late["error"][0] == 503
        assert service.health()["status"] == "unavailable"
        assert "ditmesh_down_replicas 2" in service.metrics()
        assert 'ditmesh_requests_total{outcome="unavailable"} 2' in service.metrics()
        log = capsys.readouterr().err.splitlines()  # two failed tries each, then the give-up, in the server's log
        why = "failed loading the pipeline: no such folder"
        for i in (0, 1):
            mine = [line for line in log if line.startswith(f"ditmesh: replica {i}: ")]
            assert mine[:2] == [f"ditmesh: replica {i}: restart {n} of 3 failed: rank 0 of replica {i} {why}; trying "
                                f"again in {0.01 * 2 ** (n - 1):g} s" for n in (1, 2)], log
            assert mine[2].startswith(f"ditmesh: replica {i}: given up after 3 failed restarts in a row (last: rank 0 "
                                      f"of replica {i} {why}); "), log
        assert log[-1].endswith("0 of 2 replica(s) left; requests are answered 503 until the server is restarted")
    finally:
        service.stop()


# -- no replica able to serve: a bounded answer ---------------------------------------------------------------------
class _ReplicaWaitingForRoom(_ScriptedReplica):
    """Stands in for a Ray replica whose node went: its restart waits for a node with room (``room``), saying so in
    ``waiting``, as ``RayReplica`` does."""

    def __init__(self):
        super().__init__()
        self.room = threading.Event()
        self.waiting = None

    def restart(self):
        self.state, self.waiting = "restarting", "waiting for a node of the Ray cluster with room (alive nodes: none)"
        assert self.room.wait(20)
        self.state, self.waiting = "ready", None
        self.restarts += 1


def test_no_replica_able_to_serve_answers_waiting_and_new_requests_503_within_the_unavailable_timeout(capsys):
    from fastapi.testclient import TestClient

    replica = _ReplicaWaitingForRoom()
    service = Service([replica], LIMITS, DEFAULTS, queue_size=4, restart_delay_s=0.01, unavailable_timeout_s=1.0)
    service.start()
    try:
        with TestClient(create_app(service)) as client:
            lost = service.submit({"prompt": "lost before its first step"})
            replica.next_call(then=("fault", "rank 0 of replica 0 died: its node died or left the cluster"))
            fault_at = time.time()
            # retried (no step had finished), then it waits for a replica that waits for a node: answered 503 once
            # the service has had no replica for more than 1 s, naming why
            answer = lost.future.result(10)
            assert 1.0 < time.time() - fault_at < 1.0 + 4 * 0.25 + 0.5, time.time() - fault_at
            assert lost.retried and lost.state == "failed" and answer["error"][0] == 503, answer
            message = answer["error"][1]
            assert message.startswith("no replica has been able to serve for 1 s (more than --unavailable-timeout "
                                      "1 s): replica 0 restarting, waiting for a node of the Ray cluster"), message
            assert "after: rank 0 of replica 0 died: its node died" in message and "/health says ok" in message
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert health.json()["unavailable_s"] >= 1.0 and health.json()["reason"].startswith("replica 0 restarting")
            late = client.post("/generate", json={"prompt": "late"})  # at once, not after another second
            assert late.status_code == 503 and late.json()["error"]["message"].startswith("no replica has been able")
            assert late.elapsed.total_seconds() < 0.5
            replica.room.set()  # a node joins: the replica is rebuilt and serves
            _wait(lambda: client.get("/health").status_code == 200, "the rebuilt replica serves")
            after = service.submit({"prompt": "after"})
            assert replica.next_call(then=None)["prompt"] == "after"
            replica.script.put(("done",))
            assert after.future.result(10)["error"] is None
            _wait(lambda: service.unavailable_since is None, "the watchdog sees the replica serve")
        assert _outcomes(service) == {"ok": 1, "unavailable": 2}
        log = capsys.readouterr().err.splitlines()
        assert any(line.startswith("ditmesh: no replica has been able to serve for 1 s") and
                   line.endswith("waiting and new requests are answered 503 until one serves again") for line in log)
        assert any(line.startswith("ditmesh: a replica serves again after ") for line in log), log
    finally:
        replica.room.set()
        service.stop()


@pytest.mark.parametrize("waited, answered", [(1.0, False), (1.001, True)])
def test_a_job_waits_for_a_replica_up_to_the_unavailable_timeout_and_no_longer(monkeypatch, waited, answered):
    """The bound's edge, on a clock of the test's: no replica for exactly ``unavailable_timeout_s`` is still in
    time (the job waits, a new one is queued); a millisecond past it both are answered 503, exactly once."""
    from ditmesh.serve import app

    clock = [1000.0]
    monkeypatch.setattr(app, "time", SimpleNamespace(time=lambda: clock[0], perf_counter=time.perf_counter))
    replica = _ScriptedReplica()
    service = Service([replica], LIMITS, DEFAULTS, queue_size=4, unavailable_timeout_s=1.0)  # no dispatcher runs
    replica.state = "failed"
    service._check_unavailable(clock[0])
    job = service.submit({"prompt": "waits"})
    clock[0] += waited
    service._check_unavailable(clock[0])
    assert job.future.done() is answered and service.queue.qsize() == (0 if answered else 1)
    new = service.submit({"prompt": "new"})
    assert new.future.done() is answered
    service._check_unavailable(clock[0])  # looked at again: nothing is answered twice
    for j in (job, new):
        if answered:
            assert j.future.result()["error"][0] == 503 and j.state == "failed"
    assert _outcomes(service) == ({"unavailable": 2} if answered else {})
    clock[0] += 0.26
    health = service.health()  # how long, to a tenth of a second, and why
    assert health["status"] == "unavailable" and health["unavailable_s"] == 1.3
    assert health["reason"] == "replica 0 failed"
    replica.state = "ready"  # serving again: the clock starts over
    clock[0] += 10
    assert not service.submit({"prompt": "x"}).future.done()  # before the watchdog looks, too
    service._check_unavailable(clock[0])
    assert service.unavailable_since is None and not service.submit({"prompt": "y"}).future.done()


# -- each state at its edge: answered once, in no call it should not join -------------------------------------------
def test_a_job_cancelled_while_queued_joins_no_batch_and_a_batch_fills_to_max_batch_and_no_further(service):
    replica = service.replica
    busy = service.submit({"prompt": "busy"})
    replica.next_call()
    a, b, c, d = [service.submit({"prompt": p}) for p in "abcd"]  # the queue's limit: 4 wait
    assert service.submit({"prompt": "e"}).future.result(1)["error"][0] == 429  # one past it
    assert service.cancel(b) and b.future.result(1)["error"][0] == 499
    call = replica.next_call(then=("done",))
    assert call["prompt"] == ["a", "c", "d"]  # exactly max_batch 3, the cancelled one left out
    replica.script.put(("done",))
    assert [j.future.result(10)["batch"] for j in (busy, a, c, d)] == [1, 3, 3, 3]
    assert b.state == "cancelled" and b.future.result()["error"][0] == 499  # answered once, its answer kept
    assert not any("b" in (call["prompt"] if isinstance(call["prompt"], list) else [call["prompt"]])
                   for call in replica.calls)
    assert _outcomes(service) == {"ok": 4, "cancelled": 1, "queue_full": 1}


def test_max_batch_one_runs_every_job_alone():
    replica = _ScriptedReplica()
    svc = Service([replica], LIMITS, DEFAULTS, queue_size=4, restart_delay_s=0.01)  # --max-batch 1 (the default)
    svc.start()
    try:
        busy = svc.submit({"prompt": "busy"})
        replica.next_call()
        jobs = [svc.submit({"prompt": p}) for p in "ab"]
        assert [replica.next_call(then=("done",))["prompt"] for _ in jobs] == ["a", "b"]
        replica.script.put(("done",))
        assert [j.future.result(10)["batch"] for j in (busy, *jobs)] == [1, 1, 1]
    finally:
        svc.stop()


def test_each_job_runs_on_one_replica_once_whatever_its_end():
    """Two replicas: every job reaches exactly one of them, once; a refused (422) one is not run again, a done one
    cannot be cancelled, one answered 503 at shutdown while it runs keeps that answer when its pictures come."""
    replicas = [_ScriptedReplica(0), _ScriptedReplica(1)]
    svc = Service(replicas, LIMITS, DEFAULTS, queue_size=4, restart_delay_s=0.01)
    svc.start()
    try:
        first, second = svc.submit({"prompt": "first"}), svc.submit({"prompt": "second"})
        _wait(lambda: sum(len(r.calls) for r in replicas) == 2, "both replicas took a job")
        assert sorted(c["prompt"] for r in replicas for c in r.calls) == ["first", "second"]
        on = {c["prompt"]: r for r in replicas for c in r.calls}
        on["first"].script.put(("refused", "no"))
        on["second"].script.put(("done",))
        assert first.future.result(10)["error"][0] == 422 and second.future.result(10)["error"] is None
        assert not svc.cancel(first) and not svc.cancel(second)  # finished: nothing to cancel
        last = svc.submit({"prompt": "last"})
        _wait(lambda: sum(len(r.calls) for r in replicas) == 3, "a replica took the last job")
        assert svc.shutdown("SIGTERM") == 1 and last.future.result(1)["error"][0] == 503
        next(r for r in replicas if r.in_flight).script.put(("done",))  # its pictures come after the answer
        time.sleep(0.3)
        assert last.state == "failed" and last.future.result()["error"][0] == 503
        assert sorted(c["prompt"] for r in replicas for c in r.calls) == ["first", "last", "second"]
        assert _outcomes(svc) == {"ok": 1, "refused": 1, "unavailable": 1}
    finally:
        svc.stop()


# -- batching decided by a measurement at start-up ----------------------------------------------------------------
class _Pipe:
    """A pipeline stand-in: the arguments ``_call_kwargs`` keeps."""

    def __call__(self, prompt=None, height=None, width=None, num_inference_steps=None, generator=None,
                 output_type=None):
        raise AssertionError("the timed calls go through warm_up_call")


@pytest.mark.parametrize("seconds, use", [
    ({1: 1.0, 2: 1.2, 3: 1.5}, 3),  # the batch amortises a fixed cost: the largest makes the cheapest picture
    ({1: 1.0, 2: 1.2, 3: 3.3}, 2),  # the cheapest picture at 2
    ({1: 1.0, 2: 2.0, 3: 3.0}, 1),  # a picture costs the same in any batch (a saturated GPU): no batching
    ({1: 1.0, 2: 1.9, 3: 3.0}, 2),  # 5% cheaper at 2: the least gain that batches
    ({1: 1.0, 2: 1.902, 3: 3.0}, 1),  # 4.9% cheaper: not worth it
])
def test_the_start_up_measurement_warms_every_batch_shape_and_batches_only_where_a_picture_gets_cheaper(
        monkeypatch, seconds, use):
    import argparse

    import torch

    from ditmesh.runtime import generate
    from ditmesh.serve.worker import BATCH_REPEATS, _measure_batching

    calls = []

    def timed(pipe, call, device, decode=False):
        size = len(call["prompt"]) if isinstance(call["prompt"], list) else 1
        assert size == 1 or len(call["generator"]) == size  # a seed per picture, as a shared call has
        calls.append((size, decode))
        # a one-step call's seconds, decoded or not, the first call of a shape the slowest
        return seconds[size] + 0.01 * (calls.count((size, decode)) == 1)

    monkeypatch.setattr(generate, "warm_up_call", timed)
    args = argparse.Namespace(prompt=["p"], height=64, width=64, steps=2, guidance=3.5, max_sequence_length=None,
                              seed=0, images_per_prompt=1, frames=None, negative_prompt=None, image=None)
    measured = _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 3)
    # sizes tried in turn: each warmed once, its decode too (size 1 was warmed and decoded with the sizes), then timed
    # against a lone call in rounds as a whole call costs (2 steps and the decode: (2 - 1) x latent + decoded); a size
    # that is not 5% cheaper a picture ends the search, the larger ones neither warmed nor timed
    tried = [2] if seconds[2] / 2 / seconds[1] > 0.95 else [2, 3]
    rounds = [(size, decode) for size in (1, None) for decode in (False, True)] * BATCH_REPEATS
    assert calls == [c for size in tried for c in [(size, False), (size, True)] + [
        (size if s is None else s, d) for s, d in rounds]]
    assert measured == {"seconds": {str(k): round(2 * seconds[k], 4) for k in [1] + tried}, "use": use}
    assert _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 1) is None  # --max-batch 1: nothing to time


def test_a_batch_whose_decode_costs_more_than_its_steps_save_does_not_batch(monkeypatch):
    """The decode counts: two pictures a step cost 1.5x one, but decoding two costs 4x one, and at 2 steps the whole
    call of two (2 x 1.5 + 4 x 1 = 7) is dearer than two lone calls (2 x (2 + 1) = 6)."""
    import argparse

    import torch

    from ditmesh.runtime import generate
    from ditmesh.serve.worker import _measure_batching

    step, decode_excess = {1: 1.0, 2: 1.5}, {1: 1.0, 2: 4.0}
    monkeypatch.setattr(generate, "warm_up_call", lambda pipe, call, device, decode=False: (
        step[len(call["prompt"])] + (decode_excess[len(call["prompt"])] if decode else 0)))
    args = argparse.Namespace(prompt=["p"], height=64, width=64, steps=2, guidance=3.5, max_sequence_length=None,
                              seed=0, images_per_prompt=1, frames=None, negative_prompt=None, image=None)
    assert _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 2) == {"seconds": {"1": 3.0, "2": 7.0}, "use": 1}
    decode_excess[2] = 1.5  # decoded in 1.5x one picture's time: 2 x 1.5 + 1.5 = 4.5 < 6, batching pays
    assert _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 2)["use"] == 2


def test_a_noisy_round_does_not_turn_batching_on(monkeypatch):
    """Seen on the loaded 2-core machine: one picture a call timed at 0.525 s, two at 0.205 s (less than one picture
    can take), and the service batched. The sizes are timed in rounds, and a size batches only where its picture is
    cheaper than the same round's lone call in every round."""
    import argparse

    import torch

    from ditmesh.runtime import generate
    from ditmesh.serve.worker import BATCH_REPEATS, _measure_batching

    def measure(rounds, max_batch=3):
        seen = {size: 0 for size in rounds}

        def timed(pipe, call, device, decode=False):
            size = len(call["prompt"]) if isinstance(call["prompt"], list) else 1
            if size > 1 and not call.get("warmed", {}).get(decode):  # the warm-up calls of a batch shape
                call.setdefault("warmed", {})[decode] = True
                return 5.0
            seen[size] += decode
            return rounds[size][seen[size] - decode] / 2  # a whole call of 2 steps: latent + decoded

        monkeypatch.setattr(generate, "warm_up_call", timed)
        args = argparse.Namespace(prompt=["p"], height=64, width=64, steps=2, guidance=3.5, max_sequence_length=None,
                                  seed=0, images_per_prompt=1, frames=None, negative_prompt=None, image=None)
        measured = _measure_batching(_Pipe(), args, {}, torch.device("cpu"), max_batch)
        # each size tried was timed in BATCH_REPEATS rounds, each round beside a lone call
        tried = [size for size in rounds if size > 1 and seen[size]]
        assert all(seen[size] == BATCH_REPEATS for size in tried) and seen[1] == BATCH_REPEATS * len(tried)
        return measured

    assert BATCH_REPEATS == 3
    # the first two rounds say "batch", the third does not: no batching, and a batch of 3 is not tried (each size's
    # fastest call is reported)
    assert measure({1: [0.525, 0.31, 0.30], 2: [0.41, 0.205, 0.62], 3: [0.9, 0.95, 0.92]}) == {
        "seconds": {"1": 0.3, "2": 0.205}, "use": 1}
    # every round says "batch": batching at the size whose worst round is cheapest (3: 0.45 of a lone picture)
    assert measure({1: [0.5, 0.3, 0.3, 0.5, 0.3, 0.3], 2: [0.6, 0.4, 0.4], 3: [0.6, 0.4, 0.405]}) == {
        "seconds": {"1": 0.3, "2": 0.4, "3": 0.4}, "use": 3}


def test_a_size_that_is_not_cheaper_ends_the_search_before_its_larger_shapes_are_built(monkeypatch):
    """Where one picture fills the GPU (FLUX at 1024² on one H200: a whole call 3.99 s a picture alone, 4.01 in two),
    the batch of two is the last shape built: the warm-up of 3 and 4 would only delay the first picture."""
    import argparse

    import torch

    from ditmesh.runtime import generate
    from ditmesh.serve.worker import _measure_batching

    built = []

    def timed(pipe, call, device, decode=False):
        size = len(call["prompt"])
        built.append(size)
        return {1: 3.99, 2: 8.02, 3: 11.79, 4: 15.64}[size] / 2

    monkeypatch.setattr(generate, "warm_up_call", timed)
    args = argparse.Namespace(prompt=["p"], height=64, width=64, steps=2, guidance=3.5, max_sequence_length=None,
                              seed=0, images_per_prompt=1, frames=None, negative_prompt=None, image=None)
    assert _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 4) == {"seconds": {"1": 3.99, "2": 8.02},
                                                                            "use": 1}
    assert set(built) == {1, 2}
    # --batching always sends every size up to N: every shape is built (and timed) whatever the measurement says
    built.clear()
    assert _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 4, every_size=True)["use"] == 1
    assert set(built) == {1, 2, 3, 4}


def test_a_measurement_stops_between_two_calls_and_every_rank_decides_on_rank_0s_rounds(monkeypatch):
    """In the background (``worker._calibrate``) the measurement asks ``stop`` before each call: once it says yes, no
    further call is made (the request that came runs next). On a replica of several ranks each rank times its own
    calls, but the search must stop at the same size on every rank (their calls are collectives): each decides on
    rank 0's rounds (``share``), whatever its own numbers say."""
    import argparse

    import torch

    from ditmesh.runtime import generate
    from ditmesh.serve.worker import _Cancelled, _measure_batching

    made = []

    def timed(pipe, call, device, decode=False):
        made.append(len(call["prompt"]))
        return {1: 1.0, 2: 2.0, 3: 3.0}[len(call["prompt"])]  # this rank: a batch is no cheaper

    monkeypatch.setattr(generate, "warm_up_call", timed)
    args = argparse.Namespace(prompt=["p"], height=64, width=64, steps=2, guidance=3.5, max_sequence_length=None,
                              seed=0, images_per_prompt=1, frames=None, negative_prompt=None, image=None)
    with pytest.raises(_Cancelled):
        _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 3, stop=lambda: len(made) >= 5)
    assert len(made) == 6  # the 5th call's _call_seconds is two calls; none after the stop was seen
    made.clear()
    assert _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 3)["use"] == 1  # its own numbers: stop at 2
    assert set(made) == {1, 2}
    made.clear()
    # rank 0 found each size cheaper: this rank goes on to 3 and uses what rank 0 chose
    rank0 = iter([[(2.0, 2.4)] * 3, [(2.0, 3.0)] * 3])  # rank 0's rounds of size 2, then of size 3
    shared = _measure_batching(_Pipe(), args, {}, torch.device("cpu"), 3, share=lambda rounds: next(rank0))
    assert shared["use"] == 3 and set(made) == {1, 2, 3}


def test_the_service_batches_as_the_measurement_says_or_as_asked_and_says_so():
    from ditmesh.serve.app import describe_batching
    from ditmesh.serve.server import batch_policy

    fast, slow = {"seconds": {"1": 0.1, "2": 0.12}, "use": 2}, {"seconds": {"1": 0.1, "2": 0.2}, "use": 1}
    # always: measured at start-up, every size used; auto: --max-batch bounds what each replica measures when idle
    assert batch_policy(2, "always", [slow, slow]) == (2, dict(slow, policy="always"))
    assert batch_policy(1, "auto", [None]) == (1, None) and batch_policy(2, "auto", [None]) == (2, None)
    assert describe_batching(2, dict(fast, policy="auto")) == (
        "batching up to 2 pictures a call: a batch makes the cheapest picture (a whole call, seconds a picture by "
        "batch size: 1: 0.1 s, 2: 0.06 s)")
    assert describe_batching(1, dict(slow, policy="auto")).startswith("batching off: no batch made a picture cheaper")
    service = Service([_ScriptedReplica()], LIMITS, DEFAULTS, max_batch=1)
    service.batching = dict(slow, policy="auto")
    metrics = service.metrics()
    assert "ditmesh_max_batch 1" in metrics and 'ditmesh_batch_call_seconds{size="2"} 0.2' in metrics


def test_batching_auto_measures_while_idle_gives_way_to_a_job_and_then_batches_as_measured(monkeypatch):
    """--batching auto: no batch shape is built before the service is ready (the first picture does not wait for
    them); the replica runs one request a call until it has measured, which it does once nothing has arrived for
    CALIBRATE_IDLE_S; a job that comes meanwhile stops the measurement and runs at once, and the measurement is asked
    again at the next idle moment; then calls hold up to the size it chose (not --max-batch), /metrics says so; a
    restarted replica (new ranks) measures again."""
    from ditmesh.serve import app

    monkeypatch.setattr(app, "CALIBRATE_IDLE_S", 0.3)
    replica = _ScriptedReplica()
    svc = Service([replica], LIMITS, DEFAULTS, queue_size=8, max_batch=3, restart_delay_s=0.01, measure_batching=True)
    svc.start()
    try:
        jobs = [svc.submit({"prompt": "a"})]
        assert replica.next_call()["prompt"] == "a"
        jobs += [svc.submit({"prompt": p}) for p in "bc"]  # compatible and waiting, but nothing is measured yet
        assert replica.next_call(then=("done",))["prompt"] == "b"
        assert replica.next_call(then=("done",))["prompt"] == "c"
        replica.script.put(("done",))
        assert not replica.calibrations and "ditmesh_max_batch 1" in svc.metrics()
        _wait(lambda: replica.in_flight in replica.calibrations, "no measurement once the service was idle")
        assert svc.health()["status"] == "ok" and svc.health()["replicas"][0]["state"] == "calibrating"
        jobs.append(svc.submit({"prompt": "d"}))  # a job comes: the measurement gives way to it
        assert replica.next_call()["prompt"] == "d" and replica.cancels == replica.calibrations[:1]
        replica.script.put(("done",))
        _wait(lambda: len(replica.calibrations) == 2 and replica.in_flight == replica.calibrations[1],
              "the measurement was not asked again at the next idle moment")
        replica.measurements.put({"seconds": {"1": 1.0, "2": 1.5, "3": 2.4}, "use": 2})
        _wait(lambda: replica.batching is not None and replica.state == "ready", "the measurement did not end")
        time.sleep(0.6)  # idle again, measured already: no third measurement
        assert len(replica.calibrations) == 2
        metrics = svc.metrics()
        assert "ditmesh_max_batch 2" in metrics and "ditmesh_batching_measured_replicas 1" in metrics
        assert 'ditmesh_batch_call_seconds{size="3"} 2.4' in metrics
        # three compatible jobs wait behind a running one: calls of at most the measured 2, not --max-batch 3
        jobs.append(svc.submit({"prompt": "long"}))
        assert replica.next_call()["prompt"] == "long"
        jobs += [svc.submit({"prompt": p}) for p in "xyz"]
        assert replica.next_call(then=("done",))["prompt"] == ["x", "y"]
        assert replica.next_call(then=("done",))["prompt"] == "z"
        replica.script.put(("done",))
        assert [j.future.result(5).get("error") for j in jobs] == [None] * len(jobs)
        assert _outcomes(svc) == {"ok": len(jobs)}
        # a rank fault restarts the replica: its new ranks built no batch shape, so it runs alone and measures again
        jobs.append(svc.submit({"prompt": "fault"}))
        assert replica.next_call(then=None)["prompt"] == "fault"
        replica.script.put(("fault", "rank 1 died"))
        assert replica.next_call()["prompt"] == "fault"  # run again, first in line, on the restarted replica
        assert replica.restarts == 1 and "ditmesh_max_batch 1" in svc.metrics()
        replica.script.put(("done",))
        assert jobs[-1].future.result(5).get("error") is None
        _wait(lambda: len(replica.calibrations) == 3, "no measurement after the restart")
    finally:
        replica.measurements.put({"seconds": {}, "use": 1})
        svc.stop()


def test_a_call_that_ends_after_the_encoders_stopped_is_answered_503_once(service):
    # the server stops (its encoders shut down) while a call runs: its pictures cannot be encoded, the job is
    # answered 503 naming the stop, not left waiting
    replica = service.replica
    job = service.submit({"prompt": "late"})
    replica.next_call()
    service.encoders.shutdown(wait=True)
    replica.script.put(("done",))
    assert job.future.result(10)["error"] == (503, "the server is stopping") and job.state == "failed"
    assert _outcomes(service) == {"unavailable": 1}


def test_a_token_guards_every_route_but_the_page_and_health_and_a_refusal_reaches_no_replica(service):
    from fastapi.testclient import TestClient

    with TestClient(create_app(service, token="s3cret")) as client:
        for method, route in (("post", "/generate"), ("post", "/jobs"), ("get", "/metrics"), ("get", "/jobs/x")):
            refused = getattr(client, method)(route, **({"json": {"prompt": "p"}} if method == "post" else {}),
                                              headers={"Authorization": "Bearer wrong"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == 401, (route, refused.text)
        assert client.get("/health").status_code == 200 and client.get("/").status_code == 200
        job = client.post("/jobs", json={"prompt": "p"}, headers={"Authorization": "Bearer s3cret"})
        assert job.status_code == 202
        assert service.replica.next_call()["prompt"] == "p" and len(service.replica.calls) == 1
    assert 'ditmesh_requests_total{outcome="unauthorized"} 4' in service.metrics()
