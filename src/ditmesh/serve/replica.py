"""The front end's side of one replica: a group of rank processes (its own process group), started, watched
and restarted.

The ranks are ``multiprocessing`` (spawn) children of the front end rather than an elastic agent's: the front
end must see each rank's process (alive? its exit code, its pid for ``/health``), kill and restart one group
while the others serve, and hand requests to rank 0 through a queue. Every (re)start makes fresh queues and a
fresh rendezvous port, so nothing of a dead group's traffic reaches the new one.

Faults, and how they are found within a bounded time:

- a rank process that exits (killed, out of memory): its exit code, checked every :data:`POLL_S`;
- a rank that hangs in a request (a collective that never completes, a stuck kernel): no finished step from it
  within ``step_timeout`` seconds (the first step's clock starts when the request is sent; loading and the
  warm-up have ``load_timeout`` of their own);
- a rank that stops (no heartbeat for ``step_timeout`` seconds), also while the group is idle.

The request in flight fails with a :class:`RankFault` naming the rank and what it was doing; the caller
restarts the group.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import signal
import time
from dataclasses import dataclass, field

from ..testing import free_port

#: how often the front end looks at its ranks while it waits (seconds)
POLL_S = 0.2
#: after a rank reports a failed collective, how long to look for the peer that died (seconds)
FAULT_GRACE_S = 2.0


class RankFault(RuntimeError):
    """A rank of the replica died, hung or stopped; the message names the rank and what it was doing."""


class RequestFailed(RuntimeError):
    """The pipeline refused the request on every rank alike (the group is fine)."""


class RequestCancelled(RuntimeError):
    """The request was cancelled while it ran; every rank stopped after the same step (the group is fine)."""


@dataclass
class RankState:
    """What the front end knows of one rank."""

    process: object
    beat: float = field(default_factory=time.time)  # last heartbeat
    step: int = 0  # steps finished of the request in flight
    progress: float = field(default_factory=time.time)  # when the last step (or the request) began


class Replica:
    """``world`` rank processes running ``options`` (the server's ``generate`` options) as one process group."""

    def __init__(self, index: int, world: int, options: dict, step_timeout: float, load_timeout: float):
        self.index = index
        self.world = world
        self.options = options
        self.step_timeout = step_timeout
        self.load_timeout = load_timeout
        self.ranks: list[RankState] = []
        self.restarts = 0
        self.served = 0  # requests answered with pictures
        self.state = "stopped"  # starting, ready, busy, restarting, failed, down (given up by the service)
        self.load_s: list[float] = []
        self.warm_s: dict[str, float] = {}
        self.batching: dict | None = None
        self._in_request = False  # between sending a request and its answer
        self._calibrating = False  # the request in flight is calibrate's
        self._requests = self._events = self._cancel = None  # the channels of the running group
        self.closing = False  # the server stops: no (re)start
        self._early = False  # prestarted: the ranks wait for their options

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks (or, after :meth:`prestart`, send them ``options``) and wait until every one has loaded
        and warmed up; RankFault otherwise."""
        self._in_request = False
        if self._early:
            self._early = False
            for _ in range(self.world):  # each rank reads one before it reads anything else
                self._requests.put(("options", self.options))
        else:
            self._launch()
        self._await_ready()

    def prestart(self) -> None:
        """Start the rank processes before the options are final: they import torch and diffusers while the front
        end runs the checks that need them, then wait for :meth:`start` to send the options (or :meth:`close`)."""
        self._launch(early=True)
        self._early = True

    def _launch(self, early: bool = False) -> None:
        """Start the rank processes with fresh channels (``_requests``, ``_events``, ``_cancel``) and ``ranks``
        (``early``: without their options, see :meth:`prestart`)."""
        from .worker import rank_main

        ctx = mp.get_context("spawn")
        self._requests = ctx.Queue()
        self._events = ctx.Queue()
        self._cancel = ctx.Event()
        port = free_port()
        self.ranks = []
        # the ranks are born with SIGINT and SIGTERM blocked (a spawned process keeps the signal mask of the thread
        # that started it; each rank ignores both before it unblocks them): Ctrl-C in a terminal reaches the whole
        # process group, and the front end alone answers the clients and stops the ranks (a rank whose front end
        # is gone leaves by itself: worker._heartbeat)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for rank in range(self.world):
                process = ctx.Process(target=rank_main, daemon=True, name=f"ditmesh-serve-r{self.index}-rank{rank}",
                                      args=(rank, self.world, self.index * self.world + rank, port,
                                            None if early else self.options,
                                            self._requests, self._events, self._cancel))
                process.start()
                self.ranks.append(RankState(process))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if self.closing:
            self.stop()
            raise RankFault(f"replica {self.index} was stopped while it started")

    def _await_ready(self) -> None:
        """Wait until every rank reported "ready" (loaded and warmed up); RankFault otherwise."""
        ready = {}
        deadline = time.time() + self.load_timeout
        while len(ready) < self.world:
            event = self._next_event(deadline, "loading the pipeline")
            if event is None:
                continue
            if event[0] == "load_error":
                self.stop()
                self.state = "failed"
                raise RankFault(f"rank {event[1]} of replica {self.index} failed loading the pipeline: {event[2]}")
            if event[0] == "ready":
                ready[event[1]] = event[2:]
        self.load_s = [ready[r][0] for r in range(self.world)]
        self.warm_s = ready[0][1]  # rank 0's seconds per warmed-up size
        #: rank 0's start-up measurement of the batch shapes (worker._measure_batching), None without --max-batch
        self.batching = ready[0][2] if len(ready[0]) > 2 else None
        self.state = "ready"

    def stop(self) -> list[tuple[int, int, int | None]]:
        """Kill every rank (they hold nothing to save), wait for them and release the queues' semaphores (their
        names would otherwise be reported leaked by multiprocessing's resource tracker at exit). Returns (rank,
        pid, exit code) of each rank that was running."""
        running = [rank for rank, r in enumerate(self.ranks) if r.process.is_alive()]
        for rank in running:
            self.ranks[rank].process.kill()
        for r in self.ranks:
            r.process.join(timeout=10)
        for name in ("_requests", "_events"):
            channel = getattr(self, name, None)
            if channel is not None:
                channel.cancel_join_thread()  # what a dead rank did not read is dropped
                channel.close()
        self._requests = self._events = self._cancel = None
        gc.collect()  # the semaphores are unlinked when their last reference goes
        return [(rank, self.ranks[rank].process.pid, self.ranks[rank].process.exitcode) for rank in running]

    def close(self) -> list[tuple[int, int, int | None]]:
        """Stop the ranks for good (the server stops): a start under way gives up. As :meth:`stop`."""
        self.closing = True
        return self.stop()

    def restart(self) -> None:
        """Stop the group and start it again (RankFault when it cannot start)."""
        self.state = "restarting"
        self.stop()
        self.restarts += 1
        self.start()

    def pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks]

    # -- requests ----------------------------------------------------------------------------------------------
    def run(self, job_id: str, options: dict, on_step=None) -> tuple[list, dict]:
        """Run one request on the group: returns its pictures (``("pixels", uint8 array)``, ``("image", PIL image)``
        or ``(media type, bytes)``: ``worker._pictures``) and rank 0's timeline of it (``phases.Timeline.report``;
        ``call``: its seconds there). Raises RankFault (restart the group) or RequestFailed (the pipeline refused
        it)."""
        now = time.time()
        for r in self.ranks:
            r.step, r.progress = 0, now
        self.state = "busy"
        self._job, self._steps = job_id, options.get("steps", self.options["steps"])
        self._in_request = True
        self._cancel.clear()
        self._requests.put({"id": job_id, "options": options})
        while True:
            event = self._next_event(None, None)
            if event is None:
                continue
            kind, rank = event[0], event[1]
            if kind == "step" and event[2] == job_id:
                self.ranks[rank].step, self.ranks[rank].progress = event[3], time.time()
                if rank == 0 and on_step is not None:
                    on_step(event[3], event[4])
            elif kind == "cancelled" and event[2] == job_id:
                self.state, self._in_request = "ready", False
                raise RequestCancelled(f"request {job_id} was cancelled after step {event[3]} of {event[4]}")
            elif kind == "done" and event[2] == job_id:
                self.state, self._in_request = "ready", False
                _, _, _, ok, payload, _, phases = event
                if not ok:
                    if self.world > 1:  # a peer's death can reach rank 0 as an error of the call: look first
                        deadline = time.time() + FAULT_GRACE_S / 4
                        while time.time() < deadline:
                            self._check_alive(None)
                            time.sleep(POLL_S / 4)
                    raise RequestFailed(payload)
                # requests answered with pictures: a batched call answers one request per prompt
                prompts = options.get("prompt")
                self.served += len(prompts) if isinstance(prompts, list) else 1
                return payload, phases

    def calibrate(self, job_id: str, waiting=lambda: False) -> dict | None:
        """Measure batching on the idle group (``worker._calibrate``), as request ``job_id`` that :meth:`cancel`
        stops between two of its calls: returns the measurement (the front end keeps it as ``batching``), or None when
        it was cancelled. ``waiting()``, asked once it is sent: a job came meanwhile (its cancel may have come before this
        measurement could take it). State ``calibrating`` meanwhile (it takes the next request as soon as it stops).
        RankFault as :meth:`run`."""
        self.state, self._calibrating = "calibrating", True
        self._job, self._steps = job_id, 0
        self._in_request = True
        self._cancel.clear()
        self._requests.put({"id": job_id, "calibrate": True})
        if waiting():
            self._cancel.set()
        try:
            while True:
                event = self._next_event(None, None)
                if event is not None and event[0] == "calibrated" and event[2] == job_id:
                    return event[3]
        finally:
            self._in_request = self._calibrating = False
            if self.state == "calibrating":
                self.state = "ready"

    def cancel(self, job_id: str) -> bool:
        """Ask the ranks to stop ``job_id`` if it is the request in flight (they stop after the next step)."""
        if self._in_request and self._job == job_id:
            self._cancel.set()
            return True
        return False

    def check(self) -> None:
        """While idle: take the heartbeats and raise RankFault for a rank that died or stopped."""
        while self._next_event(time.time(), None) is not None:
            pass

    def _next_event(self, deadline: float | None, loading: str | None):
        """The next event of the ranks (None after :data:`POLL_S`), after checking that every rank lives, beats,
        and (in a request) steps; heartbeats are taken here."""
        self._check_alive(loading)
        if self._events is None:  # stopped by the front end
            raise RankFault(f"replica {self.index} was stopped")
        now = time.time()
        if deadline is not None and loading and now > deadline:
            self.state = "failed"
            raise RankFault(f"replica {self.index} did not finish {loading} within {self.load_timeout:.0f} s")
        if not loading:
            stale = [rank for rank, r in enumerate(self.ranks) if now - r.beat > self.step_timeout]
            if stale:
                self.state = "failed"
                raise RankFault(f"rank {stale[0]} of replica {self.index} stopped answering (no heartbeat for "
                                f"{self.step_timeout:g} s) while {self._doing(stale[0])}")
            if self.state == "busy":
                slow = min(range(self.world), key=lambda k: (self.ranks[k].step, self.ranks[k].progress))
                if now - self.ranks[slow].progress > self.step_timeout:
                    self.state = "failed"
                    raise RankFault(f"rank {slow} of replica {self.index} hung: no step finished within "
                                    f"{self.step_timeout:g} s while {self._doing(slow)}")
        try:
            event = self._events.get(timeout=POLL_S)
        except queue.Empty:
            return None
        if event[0] == "beat":
            self.ranks[event[1]].beat = time.time()
            return None
        if event[0] == "fault":  # a collective failed on this rank: name the peer that died if one did
            deadline = time.time() + FAULT_GRACE_S
            while time.time() < deadline:
                self._check_alive(loading)
                time.sleep(POLL_S / 4)
            self.state = "failed"
            raise RankFault(f"rank {event[1]} of replica {self.index} lost its peers ({event[3]}) while "
                            f"{loading or self._doing(event[1])}")
        return event

    def _check_alive(self, loading: str | None) -> None:
        """RankFault naming a rank that exited (one killed by a signal first: the others may have followed it)."""
        dead = [rank for rank, r in enumerate(self.ranks) if not r.process.is_alive()]
        if not dead:
            return
        rank = min(dead, key=lambda k: (self.ranks[k].process.exitcode or 0) >= 0)
        self.state = "failed"
        raise RankFault(f"rank {rank} of replica {self.index} {self._death(rank)} while {loading or self._doing(rank)}")

    def _death(self, rank: int) -> str:
        """How a dead rank died, as its fault message says it."""
        process = self.ranks[rank].process
        return f"(pid {process.pid}) died with exit code {process.exitcode}"

    def _doing(self, rank: int) -> str:
        if not self._in_request:
            return "idle"
        if self._calibrating:
            return "measuring batching while the service was idle"
        step = self.ranks[rank].step
        if step >= self._steps:
            return f"decoding the pictures of request {self._job}"
        return f"running step {step + 1} of {self._steps} of request {self._job}"
