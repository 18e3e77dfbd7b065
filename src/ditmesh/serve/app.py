"""The HTTP front end: a queue of jobs, one dispatcher thread per replica that takes the next job when its
replica is free, the routes, the metrics and the web page.

Every job is answered exactly once: its future is set by the one dispatcher that took it (a result, a refusal
by the pipeline, or the fault of its replica), or by a cancellation while it still waits in the queue.

A replica that fails (a rank died, hung or stopped; on a Ray cluster also its node) while it holds a job: the job is
run again once, at the head of the queue, if no step of it had finished (its client has seen no progress); else it
is answered 500 naming the fault. A job is retried at most once, so a request that keeps killing replicas fails.

No replica able to serve (each failed, restarting, or on a Ray cluster waiting for a node with room) for longer than
``unavailable_timeout_s``: every waiting job is answered 503 naming each replica's state and last fault, and so is
every new one at once, until a replica serves again (``/health`` says why meanwhile). A request never waits longer
than that bound for a replica that may never come back.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request  # at module level: the routes' annotations are resolved here

from .replica import RankFault, Replica, RequestCancelled, RequestFailed
from .requests import BadRequest, Limits, native_options, openai_options, parse_json

#: upper bounds of the latency histogram (seconds, from arrival to answer)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: how often the watchdog looks whether some replica can serve (seconds)
WATCH_S = 0.25
#: with ``--batching auto``: a replica measures batching once nothing has arrived for this long (seconds)
CALIBRATE_IDLE_S = 2.0
#: the states of a replica that takes the next job at once (a calibrating one stops its measurement for it)
SERVING = ("ready", "busy", "calibrating")
#: how long a finished job's result stays available to ``GET /jobs/<id>`` (the web page reads it once)
KEEP_FINISHED = 64
#: the outcomes of ``ditmesh_requests_total`` that ``ditmesh_failures_total`` adds up: the service's, not the client's
SERVICE_FAILURES = ("refused", "fault", "queue_full", "unavailable")
#: a request's phases as its ``timeline`` and ``/metrics`` name them, in the order they run: waiting in the queue,
#: on rank 0 (the LoRA switch, text encoding, the steps, the VAE, the pictures out of the pipeline; ``call``: all of
#: it), going to and from the ranks (``handoff``), PNG encoding in the front end, and building the answer
PHASES = ("queue", "lora_switch", "text_encode", "steps", "vae_decode", "postprocess", "call", "handoff", "encode",
          "respond")


@dataclass
class Job:
    """One request: its options, progress, and the future its answer lands in."""

    options: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    arrived: float = field(default_factory=time.time)
    state: str = "queued"  # queued, running, done, failed, cancelled
    step: int = 0
    steps: int = 0
    future: Future = field(default_factory=Future)
    timeline: dict = field(default_factory=dict)  # seconds per phase (PHASES), filled as they end
    retried: bool = False  # queued again once after its replica failed before its first step


def _batch_key(options: dict) -> tuple:
    """What requests that share a call must have in common: every option but the prompt and the seed."""
    return tuple(sorted((k, repr(v)) for k, v in options.items() if k not in ("prompt", "seed")))


def describe_batching(used: int, batching: dict) -> str:
    """The start-up line's (--batching always) or the log's (auto) word on batching: what is used and the
    measurement it comes from."""
    per = ", ".join(f"{int(size)}: {seconds / int(size):.3g} s" for size, seconds in batching["seconds"].items())
    what = f"batching up to {used} pictures a call" if used > 1 else "batching off"
    why = "as asked (--batching always)" if batching["policy"] == "always" else (
        "a batch makes the cheapest picture" if used > 1 else "no batch made a picture cheaper")
    return f"{what}: {why} (a whole call, seconds a picture by batch size: {per})"


def log(line: str) -> None:
    """One line of the server's log (stderr): a rank fault, a restart, a replica given up."""
    print(f"ditmesh: {line}", file=sys.stderr, flush=True)


class Service:
    """The queue, the replicas and their dispatchers, and the numbers ``/metrics`` shows."""

    def __init__(self, replicas: list[Replica], limits: Limits, defaults, adapter=None, queue_size: int = 64,
                 restart_delay_s: float = 1.0, restart_attempts: int = 3, max_batch: int = 1,
                 unavailable_timeout_s: float = 60.0, measure_batching: bool = False):
        self.replicas = replicas
        self.limits = limits
        self.defaults = defaults
        self.adapter = adapter
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.restart_delay_s = restart_delay_s
        #: a replica that fails this many restarts in a row is given up ("down"); with every replica down the
        #: queued and new requests are answered 503 instead of waiting for ever
        self.restart_attempts = restart_attempts
        self.failed_restarts = collections.Counter()  # replica index -> restarts failed in a row
        #: waiting requests that differ only in prompt and seed (one picture each) run as one call of up to this
        #: many pictures
        self.max_batch = max_batch
        #: ``--batching auto``: each replica batches only up to the size its own measurement found cheapest, measured
        #: while the service is idle (:meth:`_calibrate`); until then it runs one request a call
        self.measure_batching = measure_batching and max_batch > 1
        self.calibrating: dict[int, str] = {}  # replica index -> the id of its measurement in flight
        self.last_arrival = time.time()
        self.batch_of: dict[str, list[Job]] = {}  # running job id -> the jobs of its call
        #: the measurement /metrics shows (``--batching always``: the start-up one; auto: the first replica's)
        self.batching: dict | None = None
        self.last_restart_error = ""
        #: no replica able to serve for longer than this: waiting and new jobs are answered 503 (module docstring)
        self.unavailable_timeout_s = unavailable_timeout_s
        self.unavailable_since: float | None = None  # since when no replica is ready or busy (the watchdog's)
        self.refusing = False  # past unavailable_timeout_s without a replica (said once in the log)
        self.faults: dict[int, str] = {}  # replica index -> its last fault or failed restart, for the 503 and /health
        self.stopping = threading.Event()
        self.retired: set[int] = set()  # replicas taken out of service (scaled down): their dispatchers leave
        self.counts = collections.Counter()  # images, failures by kind, restarts, requests
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.phase_seconds = collections.Counter()  # phase -> seconds summed over the requests answered ok
        #: PNG encoding off the dispatchers: a replica takes its next job while its last pictures are encoded
        self.encoders = ThreadPoolExecutor(max(2, len(replicas)), thread_name_prefix="encode")
        self.threads = [threading.Thread(target=self._dispatch, args=(r,), daemon=True, name=f"dispatch-{r.index}")
                        for r in replicas]
        self.watchdog = threading.Thread(target=self._watch, daemon=True, name="watchdog")

    def start(self) -> None:
        for t in self.threads:
            t.start()
        self.watchdog.start()

    def shutdown(self, reason: str) -> int:
        """Take no more jobs and answer every waiting and running one 503, naming it (the server stops because of
        ``reason``, e.g. ``SIGTERM``); the ranks are stopped by :meth:`stop`. Returns how many were answered."""
        self.stopping.set()
        with self.lock:
            open_jobs = [job for job in self.jobs.values() if not job.future.done()]
        for job in open_jobs:
            where = f"at step {job.step} of {job.steps}" if job.state == "running" else "before it ran"
            self._finish(job, "failed", error=(503, f"the server is stopping ({reason}): request {job.id} was "
                                                    f"stopped {where}; send it again once the server is back"))
        while True:  # every queued job is answered: empty the queue for the dispatchers
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return len(open_jobs)

    def stop(self) -> list[tuple[int, int, int, int | None]]:
        """Stop the ranks of every replica, then the dispatchers (a dispatcher waiting on its ranks sees them gone).
        Returns (replica, rank, pid, exit code) of each rank that was running."""
        self.stopping.set()
        stopped = [(r.index, *rank) for r in self.replicas for rank in r.close()]
        for t in [*self.threads, self.watchdog]:
            if t.is_alive():
                t.join(timeout=5)
        self.encoders.shutdown(wait=True, cancel_futures=True)
        return stopped

    # -- jobs --------------------------------------------------------------------------------------------------
    def submit(self, options: dict) -> Job:
        """Queue a job (answered 429 when the queue is full, 503 when every replica is down)."""
        job = Job(options, steps=options.get("steps", self.defaults.steps))
        if self.stopping.is_set():
            self._finish(job, "failed", error=(503, f"the server is stopping: request {job.id} was not run"))
            return job
        if self._all_down():
            self._finish(job, "failed", error=(503, self._down_message()))
            return job
        if self._unavailable_for(time.time()) > self.unavailable_timeout_s and not self._serving():
            self._finish(job, "failed", error=(503, self._unavailable_message(time.time())))
            return job
        with self.lock:
            self.jobs[job.id] = job
            while len(self.jobs) > KEEP_FINISHED + self.queue.maxsize + len(self.replicas):
                oldest = next(iter(self.jobs))
                if self.jobs[oldest].future.done():
                    del self.jobs[oldest]
                else:
                    break
        self.last_arrival = time.time()
        try:
            self.queue.put_nowait(job)
            for index, measuring in list(self.calibrating.items()):  # a job waits: a measurement gives way to it
                self.replicas[index].cancel(measuring)
        except queue.Full:
            self._finish(job, "failed", error=(429, f"the queue is full ({self.queue.maxsize} waiting); try again"))
        if self._all_down():  # the last replica went down while this job was queued: nobody will take it
            self._fail_waiting()
        return job

    def cancel(self, job: Job) -> bool:
        """Cancel a job: one that waits is answered at once (its dispatcher skips it); one that runs is stopped by
        its ranks after their next step and answered then. False once it has finished."""
        with self.lock:
            if job.state == "running":
                batch = self.batch_of.get(job.id, [job])
                if any(j is not job and not j.future.done() for j in batch):  # the others of its call go on
                    job.state = "cancelled"
                    self.counts["cancelled"] += 1
                    job.future.set_result({"error": (499, f"request {job.id} was cancelled; the call it shared "
                                                          f"with {len(batch) - 1} other(s) goes on"), "seconds": 0.0})
                    return True
                return any(r.cancel(batch[0].id) for r in self.replicas)
            if job.state != "queued":
                return False
            job.state = "cancelled"
        self.counts["cancelled"] += 1
        job.future.set_result({"error": (499, f"request {job.id} was cancelled while it waited"), "seconds": 0.0})
        return True

    def _finish(self, job: Job, state: str, result: dict | None = None, error: tuple | None = None) -> None:
        with self.lock:
            if job.future.done():  # cancelled meanwhile: answered already
                return
            job.state = state
            seconds = time.time() - job.arrived
            if error is None:
                self.counts["images"] += len(result["images"])
                self.latency[next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), -1)] += 1
                self.latency_sum += seconds
                self.counts["done"] += 1
                self.counts["timed"] += bool(job.timeline)
                self.phase_seconds.update(job.timeline)
            else:
                self.counts[{429: "failures_queue_full", 500: "failures_fault", 499: "cancelled",
                             503: "failures_unavailable"}.get(
                    error[0], "failures_refused")] += 1
            job.future.set_result(dict(result or {}, error=error, seconds=round(seconds, 4), timeline=job.timeline))

    def _dispatch(self, replica: Replica) -> None:
        while not self.stopping.is_set() and replica.index not in self.retired:
            if replica.state == "failed":
                self._restart(replica)
                if replica.state == "down":
                    if self._all_down():
                        self._fail_waiting()
                    return
                continue
            try:
                job = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.stopping.is_set():
                    return
                try:
                    replica.check()
                    if self._wants_calibration(replica):
                        self._calibrate(replica)
                except RankFault as exc:
                    self.counts["faults"] += 1
                    self.faults[replica.index] = str(exc)
                    if not self.stopping.is_set():
                        log(f"replica {replica.index}: rank fault while idle: {exc}; restarting the replica")
                continue
            with self.lock:
                if job.state != "queued":  # cancelled while it waited
                    continue
                batch = self._batch(job, replica)
                for member in batch:
                    member.state = "running"
                    self.batch_of[member.id] = batch
            self._run(replica, batch)

    def _wants_calibration(self, replica: Replica) -> bool:
        """Whether ``replica`` should measure batching now: ``--batching auto``, not measured since it (re)started,
        ready, nothing waiting and nothing arrived for :data:`CALIBRATE_IDLE_S`."""
        return (self.measure_batching and replica.state == "ready" and getattr(replica, "batching", None) is None
                and not self.stopping.is_set() and self.queue.empty()
                and time.time() - self.last_arrival >= CALIBRATE_IDLE_S)

    def _calibrate(self, replica: Replica) -> None:
        """Measure batching on idle ``replica`` (``Replica.calibrate``; a job that arrives stops it, and it is asked
        again at the next idle moment); RankFault as a request's."""
        measuring = f"calibrate-{uuid.uuid4().hex[:8]}"
        with self.lock:
            self.calibrating[replica.index] = measuring
        start = time.perf_counter()
        try:  # a job that came before the measurement could be cancelled stops it at once (waiting)
            measured = replica.calibrate(measuring, waiting=lambda: not self.queue.empty())
        finally:
            with self.lock:
                self.calibrating.pop(replica.index, None)
        seconds = time.perf_counter() - start
        if measured is None:
            self.counts["calibrations_stopped"] += 1
            log(f"replica {replica.index}: the batching measurement gave way to a request after {seconds:.1f} s; "
                "it goes on at the next idle moment")
            return
        replica.batching = measured = dict(measured, policy="auto")
        self.batching = self.batching or measured
        said = (f"batching off: the measurement failed ({measured['error']})" if measured.get("error")
                else describe_batching(self._limit(replica), measured))
        log(f"replica {replica.index}: {said}; measured while idle in {seconds:.1f} s")

    def _limit(self, replica: Replica) -> int:
        """The most pictures one call of ``replica`` runs: ``max_batch``, or with ``--batching auto`` the size its
        measurement chose (1 until it has measured)."""
        if not self.measure_batching:
            return self.max_batch
        measured = getattr(replica, "batching", None)
        return min(self.max_batch, measured["use"]) if measured else 1

    def _batch(self, first: Job, replica: Replica) -> list[Job]:
        """``first`` and the waiting jobs that may share its call on ``replica`` (caller holds the lock): same options
        but prompt and seed, one picture each, up to :meth:`_limit`; taken out of the queue in their order."""
        batch = [first]
        limit = self._limit(replica)
        if limit == 1 or first.options.get("images_per_prompt", 1) != 1:
            return batch
        key = _batch_key(first.options)
        with self.queue.mutex:
            for job in list(self.queue.queue):
                if len(batch) == limit:
                    break
                if job.state == "queued" and job.options.get("images_per_prompt", 1) == 1 and \
                        _batch_key(job.options) == key:
                    self.queue.queue.remove(job)
                    batch.append(job)
            self.queue.not_full.notify_all()
        return batch

    def _run(self, replica: Replica, batch: list[Job]) -> None:
        """Run ``batch`` as one call on ``replica`` and answer each of its jobs (its own picture, or the error)."""
        first = batch[0]
        options = dict(first.options)
        if len(batch) > 1:  # one call: a prompt and a seed per picture, in the batch's order
            options["prompt"] = [j.options["prompt"] for j in batch]
            options["seed"] = [j.options.get("seed", self.defaults.seed) for j in batch]
            self.counts["batched"] += len(batch)

        def on_step(step, steps):
            for member in batch:
                member.step, member.steps = step, steps

        def fail(state: str, error: tuple) -> None:
            for member in batch:
                self._finish(member, state, error=error)

        dispatched = time.time()
        for member in batch:
            member.timeline["queue"] = round(dispatched - member.arrived, 4)
        try:
            pictures, phases = replica.run(first.id, options, on_step)
        except RequestCancelled as exc:
            return fail("cancelled", (499, str(exc)))
        except RequestFailed as exc:
            return fail("failed", (422, f"the pipeline refused the request: {exc}"))
        except RankFault as exc:
            self.counts["faults"] += 1
            self.faults[replica.index] = str(exc)
            retried, failed = [], []
            for member in batch:
                if member.step == 0 and not member.retried and not member.future.done():
                    self._retry(member)
                    retried.append(member.id)
                else:
                    self._finish(member, "failed", error=(500, f"{exc}; the replica is restarting, send the "
                                                                f"request again"))
                    failed.append(member.id)
            if self.stopping.is_set():  # the server stops its ranks: no fault of theirs (its own lines say so)
                return
            log(f"replica {replica.index}: rank fault: {exc}; "
                + "; ".join(part for part in (f"request {', '.join(failed)} answered 500" if failed else "",
                                              f"request {', '.join(retried)} queued again" if retried else "") if part)
                + "; restarting the replica")
            return  # no pictures: the dispatcher goes on to restart the replica
        except Exception as exc:  # noqa: BLE001  (answer the jobs whatever happened)
            replica.state = "failed"
            log(f"replica {replica.index}: {type(exc).__name__}: {exc}; request {first.id} answered 500; restarting "
                "the replica")
            return fail("failed", (500, f"replica {replica.index}: {type(exc).__name__}: {exc}"))
        finally:
            with self.lock:
                for member in batch:
                    self.batch_of.pop(member.id, None)
        phases = dict(phases, handoff=round(max(0.0, time.time() - dispatched - phases.get("call", 0.0)), 4))
        try:
            self.encoders.submit(self._deliver, batch, pictures, phases)
        except RuntimeError:  # the encoders were shut down: the server stopped (its jobs are answered)
            fail("failed", (503, "the server is stopping"))

    def _deliver(self, batch: list[Job], pictures: list, phases: dict) -> None:
        """Encode a call's pictures and answer each job of ``batch`` with its own (in an encoder thread)."""
        start = time.perf_counter()
        try:
            pictures = [encode_picture(kind, picture) for kind, picture in pictures]
        except Exception as exc:  # noqa: BLE001
            for member in batch:
                self._finish(member, "failed", error=(500, f"encoding the picture failed: {exc}"))
            return
        phases = dict(phases, encode=round(time.perf_counter() - start, 4))
        per_job = [pictures] if len(batch) == 1 else [[picture] for picture in pictures]
        for member, images in zip(batch, per_job):
            member.timeline.update(phases)
            self._finish(member, "done", {"images": images, "batch": len(batch)})

    def _retry(self, job: Job) -> None:
        """Queue ``job`` again, first in line, after its replica failed before its first step (once per job)."""
        with self.lock:
            job.state, job.retried = "queued", True
            self.counts["retried"] += 1
        with self.queue.mutex:  # at the head, past the queue's bound: it was accepted already
            self.queue.queue.appendleft(job)
            self.queue.unfinished_tasks += 1
            self.queue.not_empty.notify()

    def _restart(self, replica: Replica) -> None:
        """Restart a failed replica (queued jobs wait for it, or for another). After ``restart_attempts`` failures in
        a row, each retried after twice the delay of the one before, the replica is given up: state ``down``."""
        if self.stopping.is_set():
            return
        start = time.perf_counter()
        try:
            replica.restart()
            self.counts["restarts"] += 1
            self.failed_restarts[replica.index] = 0
            log(f"replica {replica.index}: restarted in {time.perf_counter() - start:.1f} s")
        except RankFault as exc:
            self.last_restart_error = self.faults[replica.index] = str(exc)
            self.failed_restarts[replica.index] += 1
            failed = self.failed_restarts[replica.index]
            if failed >= self.restart_attempts:
                replica.state = "down"
                self.counts["replicas_down"] += 1
                up = sum(r.state != "down" for r in self.replicas)
                log(f"replica {replica.index}: given up after {failed} failed restarts in a row (last: {exc}); "
                    f"{up} of {len(self.replicas)} replica(s) left"
                    + ("" if up else "; requests are answered 503 until the server is restarted"))
                return
            replica.state = "failed"
            delay = self.restart_delay_s * 2 ** (failed - 1)
            log(f"replica {replica.index}: restart {failed} of {self.restart_attempts} failed: {exc}; trying again "
                f"in {delay:g} s")
            self.stopping.wait(delay)

    def _all_down(self) -> bool:
        return all(r.state == "down" for r in self.replicas)

    def _down_message(self) -> str:
        return (f"no replica is running: each failed {self.restart_attempts} restarts in a row (last: "
                f"{self.last_restart_error}); restart the server once the cause is fixed")

    def _fail_waiting(self, message: str | None = None) -> None:
        """Answer every queued job 503 with ``message`` (default: every replica is down)."""
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            self._finish(job, "failed", error=(503, message or self._down_message()))

    def _serving(self) -> bool:
        """Whether some replica in service can take or is running a job."""
        return any(r.state in SERVING for r in list(self.replicas) if r.index not in self.retired)

    def _unavailable_for(self, now: float) -> float:
        """Seconds since no replica could serve (0 while one can)."""
        since = self.unavailable_since
        return 0.0 if since is None else now - since

    def _replicas_why(self) -> str:
        """Each replica in service: its state, what it waits for, its last fault."""
        why = []
        for r in list(self.replicas):
            if r.index in self.retired:
                continue
            waiting = getattr(r, "waiting", None)  # a Ray replica waiting for a node with room
            fault = self.faults.get(r.index)
            why.append(f"replica {r.index} {r.state}" + (f", {waiting}" if waiting else "")
                       + (f", after: {fault}" if fault else ""))
        return "; ".join(why)

    def _unavailable_why(self, now: float) -> str:
        return (f"no replica has been able to serve for {self._unavailable_for(now):.0f} s (more than "
                f"--unavailable-timeout {self.unavailable_timeout_s:g} s): {self._replicas_why()}")

    def _unavailable_message(self, now: float) -> str:
        return f"{self._unavailable_why(now)}; the request was not run: send it again once /health says ok"

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_S):
            self._check_unavailable(time.time())

    def _check_unavailable(self, now: float) -> None:
        """The watchdog's look (every :data:`WATCH_S`): note since when no replica can serve, and past
        ``unavailable_timeout_s`` answer every waiting job 503."""
        if self._serving():
            if self.refusing:
                log(f"a replica serves again after {now - self.unavailable_since:.1f} s without one")
            self.unavailable_since, self.refusing = None, False
            return
        if self.unavailable_since is None:
            self.unavailable_since = now
        if self._unavailable_for(now) > self.unavailable_timeout_s:
            if not self.refusing:
                self.refusing = True
                log(f"{self._unavailable_why(now)}; waiting and new requests are answered 503 until one serves again")
            if self.queue.qsize():
                self._fail_waiting(self._unavailable_message(now))

    # -- what the routes show ----------------------------------------------------------------------------------
    def health(self) -> dict:
        states = [r.state for r in self.replicas]
        status = "ok" if any(s in SERVING for s in states) else "unavailable"
        why = {} if status == "ok" else {"unavailable_s": round(self._unavailable_for(time.time()), 1),
                                         "reason": self._replicas_why()}
        return {"status": status, **why, "queue": self.queue.qsize(),
                "replicas": [{"index": r.index, "state": r.state, "ranks": r.world, "pids": r.pids(),
                              "restarts": r.restarts, "served": r.served, "load_s": r.load_s, "warm_s": r.warm_s,
                              "batching": getattr(r, "batching", None)}
                             for r in self.replicas]}

    def metrics(self) -> str:
        """Prometheus text exposition of the queue, latencies, images, failures and restarts."""
        c = self.counts
        live = [r for r in list(self.replicas) if r.index not in self.retired]
        lines = [
            "# HELP ditmesh_queue_length Requests waiting for a replica.", "# TYPE ditmesh_queue_length gauge",
            f"ditmesh_queue_length {self.queue.qsize()}",
            "# HELP ditmesh_busy_replicas Replicas running a request.", "# TYPE ditmesh_busy_replicas gauge",
            f"ditmesh_busy_replicas {sum(r.state == 'busy' for r in self.replicas)}",
            "# HELP ditmesh_down_replicas Replicas given up after failed restarts.",
            "# TYPE ditmesh_down_replicas gauge", f"ditmesh_down_replicas {sum(r.state == 'down' for r in self.replicas)}",
            "# HELP ditmesh_images_total Pictures returned.", "# TYPE ditmesh_images_total counter",
            f"ditmesh_images_total {c['images']}",
            "# HELP ditmesh_max_batch Most pictures one call runs now (--max-batch as each replica's measurement "
            "decided; 1 on a replica that has not measured yet).",
            "# TYPE ditmesh_max_batch gauge", f"ditmesh_max_batch {max((self._limit(r) for r in live), default=1)}",
            "# HELP ditmesh_batching_measured_replicas Replicas whose batching measurement is done (--batching "
            "auto measures while the service is idle).", "# TYPE ditmesh_batching_measured_replicas gauge",
            f"ditmesh_batching_measured_replicas {sum(getattr(r, 'batching', None) is not None for r in live)}",
            *(["# HELP ditmesh_batch_call_seconds A whole call's seconds at the default size by batch size (the "
               "first measurement's rank 0).", "# TYPE ditmesh_batch_call_seconds gauge"]
              + [f'ditmesh_batch_call_seconds{{size="{size}"}} {seconds}'
                 for size, seconds in self.batching["seconds"].items()] if self.batching else []),
            "# HELP ditmesh_batched_requests_total Requests that shared a pipeline call with others.",
            "# TYPE ditmesh_batched_requests_total counter", f"ditmesh_batched_requests_total {c['batched']}",
            "# HELP ditmesh_requests_total Requests answered, by outcome.", "# TYPE ditmesh_requests_total counter",
        ]
        outcomes = {"ok": c["done"], "refused": c["failures_refused"], "fault": c["failures_fault"],
                    "queue_full": c["failures_queue_full"], "cancelled": c["cancelled"], "bad_request": c["bad_request"],
                    "unauthorized": c["unauthorized"], "unavailable": c["failures_unavailable"]}
        lines += [f'ditmesh_requests_total{{outcome="{k}"}} {v}' for k, v in outcomes.items()]
        # a failure is the service's: a request it took and could not answer with pictures. Bad requests and missing
        # tokens are the client's, counted by outcome above and not here.
        lines += ["# HELP ditmesh_failures_total Requests the service failed to answer (refused by the pipeline, rank "
                  "faults, full queue, unavailable); bad requests are requests_total{outcome=\"bad_request\"}.",
                  "# TYPE ditmesh_failures_total counter",
                  f"ditmesh_failures_total {sum(outcomes[k] for k in SERVICE_FAILURES)}",
                  "# HELP ditmesh_rank_faults_total Ranks found dead, hung or stopped.",
                  "# TYPE ditmesh_rank_faults_total counter", f"ditmesh_rank_faults_total {c['faults']}",
                  "# HELP ditmesh_retried_requests_total Requests run again after their replica failed before "
                  "their first step.", "# TYPE ditmesh_retried_requests_total counter",
                  f"ditmesh_retried_requests_total {c['retried']}",
                  "# HELP ditmesh_restarts_total Replica restarts.", "# TYPE ditmesh_restarts_total counter",
                  f"ditmesh_restarts_total {c['restarts']}",
                  "# HELP ditmesh_request_phase_seconds_total Seconds of successful requests per phase "
                  "(queue wait, LoRA switch, text encoding, steps, VAE decode, postprocess, the call on rank 0, the "
                  "hand-off to and from the ranks, PNG encoding, building the answer).",
                  "# TYPE ditmesh_request_phase_seconds_total counter",
                  *(f'ditmesh_request_phase_seconds_total{{phase="{p}"}} {self.phase_seconds[p]:.6f}' for p in PHASES),
                  "# HELP ditmesh_timed_requests_total Successful requests whose phases were timed.",
                  "# TYPE ditmesh_timed_requests_total counter", f"ditmesh_timed_requests_total {c['timed']}",
                  "# HELP ditmesh_request_latency_seconds Arrival to answer of successful requests.",
                  "# TYPE ditmesh_request_latency_seconds histogram"]
        total = 0
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.latency[:-1] + [self.latency[-1]]):
            total += count
            lines.append(f'ditmesh_request_latency_seconds_bucket{{le="{bound}"}} {total}')
        lines += [f"ditmesh_request_latency_seconds_sum {self.latency_sum:.6f}",
                  f"ditmesh_request_latency_seconds_count {total}"]
        return "\n".join(lines) + "\n"


def create_app(service: Service, token: str | None = None):
    """The FastAPI application serving ``service``; ``token`` (optional) is the bearer every API call needs."""
    import hmac

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

    app = FastAPI(title="ditmesh serve", docs_url=None, redoc_url=None, openapi_url=None)
    page = (Path(__file__).resolve().parent.parent / "assets" / "serve" / "index.html").read_text()

    def refuse(status: int, message: str, field: str | None = None, job: str | None = None):
        body = {"message": message, "code": status, **({"field": field} if field else {}), **({"job": job} if job else {})}
        return JSONResponse({"error": body}, status_code=status)

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path not in ("/", "/health") and not authorized(request):
            service.counts["unauthorized"] += 1
            return refuse(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')")
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(request, exc: BadRequest):  # noqa: ARG001
        service.counts["bad_request"] += 1
        return refuse(exc.status, str(exc), exc.field)

    @app.exception_handler(_Answered)
    async def answered(request, exc: _Answered):  # noqa: ARG001
        return refuse(exc.status, exc.message, job=exc.job)

    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # an unknown path (404), a wrong method (405): our shape
        if exc.status_code == 404:
            message = (f"no such path: {request.url.path} (the API: POST /v1/images/generations, POST /generate, "
                       "POST /jobs, GET or DELETE /jobs/<id>, GET /jobs/<id>/events, GET /health, GET /metrics, and "
                       "the web page at /)")
        elif exc.status_code == 405:
            allow = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), None)
            message = f"{request.method} is not served at {request.url.path}" + (f" (allowed: {allow})" if allow else "")
        else:
            message = str(exc.detail)
        return refuse(exc.status_code, message)

    async def read_options(request: Request, parse) -> dict:
        if request.headers.get("content-type", "application/json").split(";")[0].strip() != "application/json":
            raise BadRequest("send the body as application/json", 415)
        return parse(parse_json(await request.body()), service.limits, service.defaults, service.adapter)

    async def answer(job: Job) -> dict:
        result = await asyncio.wrap_future(job.future)
        if result["error"] is not None:
            raise _Answered(*result["error"], job.id)
        return result

    def respond(body: dict, key: str, items: list[dict], field: str, pictures: list[bytes]):
        """The answer of a job that made pictures (:func:`json_with_pictures`); the seconds building it count as its
        ``respond`` phase."""
        start = time.perf_counter()
        content = json_with_pictures(body, key, items, field, pictures)
        seconds = time.perf_counter() - start
        with service.lock:
            service.phase_seconds["respond"] += seconds
        return Response(content, media_type="application/json")

    def respond_file(job: Job, result: dict):
        """The answer of a client that asked for the picture itself (:func:`wants_file`): the file as the body (the
        bytes the JSON answer carries in base64), what the JSON answer says besides in ``X-Ditmesh-*`` headers."""
        start = time.perf_counter()
        (kind, data), = result["images"]
        headers = {"X-Ditmesh-Id": job.id, "X-Ditmesh-Seconds": repr(result["seconds"]),
                   "X-Ditmesh-Batch": str(result.get("batch", 1)),
                   "X-Ditmesh-Timeline": json.dumps(result["timeline"], separators=(",", ":")),
                   "X-Ditmesh-Received-At": repr(job.arrived), "X-Ditmesh-Answered-At": repr(time.time())}
        response = Response(data, media_type=kind, headers=headers)
        with service.lock:
            service.phase_seconds["respond"] += time.perf_counter() - start
        return response

    async def pictures(request: Request, parse, answer_json):
        """Run a request of a route that answers with pictures: as JSON (``answer_json(job, result)``), or the file
        itself where the client's ``Accept`` asks for it; a bad ``Accept`` is refused before any work."""
        file = wants_file(request.headers.get("accept"))
        options = await read_options(request, parse)
        if file:
            one_picture(options, service.defaults, request.headers.get("accept"))
        job = service.submit(options)
        result = await answer(job)
        return respond_file(job, result) if file else answer_json(job, result)

    @app.post("/generate")
    async def generate(request: Request):
        # when the request was read and when its answer began (this host's clock): a client on the same host
        # times the way in and the way out from them (scripts/serve_bench.py)
        return await pictures(request, native_options, lambda job, result: respond(
            {"id": job.id, "seconds": result["seconds"], "batch": result.get("batch", 1),
             "timeline": result["timeline"], "received_at": job.arrived, "answered_at": time.time()},
            "images", [{"media_type": kind} for kind, _ in result["images"]], "b64",
            [data for _, data in result["images"]]))

    @app.post("/v1/images/generations")
    async def openai_generations(request: Request):
        return await pictures(request, openai_options, lambda job, result: respond(
            {"created": int(time.time())}, "data", [{} for _ in result["images"]], "b64_json",
            [data for _, data in result["images"]]))

    @app.post("/jobs", status_code=202)
    async def submit_job(request: Request):
        job = service.submit(await read_options(request, native_options))
        return {"id": job.id, "state": job.state}

    def find(job_id: str) -> Job:
        with service.lock:
            job = service.jobs.get(job_id)
        if job is None:
            raise BadRequest(f"no request {job_id!r} (finished requests are kept for a while only)", 404)
        return job

    @app.get("/jobs/{job_id}")
    async def job_state(job_id: str):
        job = find(job_id)
        return {"id": job.id, "state": job.state, "step": job.step, "steps": job.steps}

    @app.delete("/jobs/{job_id}")
    async def cancel_job(job_id: str):
        job = find(job_id)
        if not service.cancel(job):
            raise BadRequest(f"request {job_id} is {job.state}; only waiting and running requests can be cancelled",
                             409)
        return {"id": job.id, "state": "cancelled" if job.state == "cancelled" else "cancelling"}

    @app.get("/jobs/{job_id}/events")
    async def job_events(job_id: str):
        """Server-sent events: ``progress`` ({step, steps}) as steps finish, then ``done`` (the pictures as
        data: URLs) or ``error`` ({status, message})."""
        job = find(job_id)

        async def stream():
            sent = -1
            while not job.future.done():
                if job.step != sent:
                    sent = job.step
                    yield _sse("progress", {"step": job.step, "steps": job.steps, "state": job.state})
                await asyncio.sleep(0.05)
            result = job.future.result()
            if result["error"] is not None:
                yield _sse("error", {"status": result["error"][0], "message": result["error"][1], "job": job.id})
            else:
                yield _sse("done", {"seconds": result["seconds"], "images": [
                    f"data:{kind};base64,{base64.b64encode(data).decode()}" for kind, data in result["images"]]})

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        body = service.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def index():
        defaults = service.defaults
        return HTMLResponse(page.replace("__DEFAULTS__", json.dumps({
            "steps": defaults.steps, "seed": defaults.seed, "height": defaults.height, "width": defaults.width,
            "max_steps": service.limits.max_steps, "token": token is not None})))

    return app


class _Answered(Exception):
    """A job's error answer (status, message), raised out of a route to the handler that sends it."""

    def __init__(self, status: int, message: str, job: str | None = None):
        super().__init__(message)
        self.status, self.message, self.job = status, message, job


def json_with_pictures(body: dict, key: str, items: list[dict], field: str, pictures: list[bytes]) -> bytes:
    """``json.dumps({**body, key: [{**item, field: <base64 of picture>} ...]}).encode()``, byte for byte, with the
    base64 text put in place rather than built as a string and scanned again by the JSON encoder (a 1024² picture is
    ~4 MB of it)."""
    head = json.dumps({**body, key: None}).encode()  # ..., "key": null}
    parts = []
    for item, data in zip(items, pictures):
        opened = json.dumps({**item, field: ""}).encode()  # {..., "field": ""}
        parts.append(opened[:-2] + base64.b64encode(data) + b'"}')
    return head[:-len(b"null}")] + b"[" + b", ".join(parts) + b"]}"


#: media ranges of ``Accept`` that take the JSON answer, and those that take the picture's own file (PNG, GIF for a
#: video): one file, whatever its type
JSON_RANGES = ("application/json", "application/*", "*/*")
FILE_RANGES = ("image/png", "image/gif", "image/*")


def wants_file(accept: str | None) -> bool:
    """Whether the ``Accept`` header ``accept`` prefers the picture's file itself (``image/png``, ``image/gif``,
    ``image/*``) to the JSON answer (``application/json``, ``application/*``, ``*/*``), by their ``q`` values (a tie
    or no header: JSON, the default). A header that accepts neither is refused (406), in one line."""
    if accept is None or not accept.strip():
        return False
    best = {"json": 0.0, "file": 0.0}
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = -1.0
                if not 0 <= q <= 1:
                    raise BadRequest(f"Accept: {accept}: q={value.strip()} must be a number from 0 to 1", 406)
        media = media.lower()
        for kind, ranges in (("json", JSON_RANGES), ("file", FILE_RANGES)):
            if media in ranges:
                best[kind] = max(best[kind], q)
    if not best["json"] and not best["file"]:
        raise BadRequest(f"Accept: {accept}: this route answers application/json (the default), or the picture's "
                         f"file itself for Accept: image/png (one picture: n 1)", 406)
    return best["file"] > best["json"]


def one_picture(options: dict, defaults, accept: str) -> None:
    """A file answer holds one picture: refuse (406) a request for more, before it runs."""
    n = options.get("images_per_prompt", getattr(defaults, "images_per_prompt", 1) or 1)
    if n != 1:
        raise BadRequest(f"n {n} with Accept: {accept}: the file answer holds one picture; ask n 1, or accept "
                         f"application/json for {n} pictures in one answer", 406, "n")


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def encode_picture(kind: str, picture) -> tuple[str, bytes]:
    """A picture as (media type, bytes): pixels (``kind`` "pixels": a ``[height, width, channels]`` uint8 array) or a
    PIL image (``kind`` "image") from the ranks as PNG; bytes as they are."""
    if kind not in ("image", "pixels"):
        return kind, picture
    from .. import png

    return "image/png", png.encode_pixels(picture) if kind == "pixels" else png.encode(picture)
