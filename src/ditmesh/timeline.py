"""Where a process's seconds go: named phases on one wall clock, from the moment the process started.

Every process keeps one :class:`Timeline` (:func:`timeline`). Its origin is the start of the process, read from
``/proc/self/stat`` so that the interpreter's start-up and every import count; a rank started by ditmesh's own
launcher takes the launcher's start (``$DITMESH_LAUNCH_START``) as its origin, so that its timeline covers what a
user timing the command from outside waits for, the launcher's own start-up included (phase ``launch``).

Phases nest (``with phase("load"): with phase("load transformer"): ...``): a phase's ``depth`` is the number of
phases open around it. Phases of one depth inside one parent never overlap, except those recorded from another
thread (:meth:`Timeline.add` with ``tid``: a rank's rendezvous, beside its checks and its load), which a trace shows
on a row of their own. :func:`chrome_trace` turns the
timelines of all ranks into Chrome's trace format (``traceEvents``, one ``pid`` per rank, complete ``"X"``
events), which chrome://tracing and https://ui.perfetto.dev open.

Torch-free: imported before torch, so the imports themselves can be timed.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

#: set by the launcher for its ranks: the launcher's own process start (seconds since the epoch)
LAUNCH_START_ENV = "DITMESH_LAUNCH_START"

_IMPORTED_AT = time.time()


_START: dict[int, float] = {}  # pid -> start: read once per process (the clocks it is read from tick by 10 ms)


def process_start_unix() -> float:
    """When this process started, in seconds since the epoch (10 ms resolution on Linux; elsewhere, when this
    module was first imported). Read once per process, so every caller sees the same value."""
    pid = os.getpid()
    if pid not in _START:
        _START[pid] = _read_process_start()
    return _START[pid]


def _read_process_start() -> float:
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        # fields after "(comm)": state is field 3, starttime (clock ticks after boot) field 22
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        return now - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


class Timeline:
    """The phases of one process: ``(name, start_s, end_s, depth)`` in seconds after :attr:`origin_unix`."""

    def __init__(self, origin_unix: float | None = None):
        self.process_start_unix = process_start_unix()
        launch = os.environ.get(LAUNCH_START_ENV)
        if origin_unix is None:
            origin_unix = min(float(launch), self.process_start_unix) if launch else self.process_start_unix
        self.origin_unix = origin_unix
        self.phases: list[dict] = []
        self._open = 0
        self._lock = threading.Lock()
        if self.process_start_unix - origin_unix > 0.0:
            self.add("launch", 0.0, self.process_start_unix - origin_unix)

    def now(self) -> float:
        """Seconds since the origin."""
        return time.time() - self.origin_unix

    def add(self, name: str, start_s: float, end_s: float, depth: int | None = None, tid: int = 0, **args) -> None:
        """Record a phase that ran from ``start_s`` to ``end_s`` (seconds after the origin); ``depth`` defaults to
        the phases open now; ``tid``: not 0 for a phase of another thread than the one that opens phases (its own
        row in a trace). ``args`` are shown with the event in a trace viewer."""
        entry = {"name": name, "start_s": round(start_s, 6), "end_s": round(max(end_s, start_s), 6),
                 "depth": self._open if depth is None else depth}
        if tid:
            entry["tid"] = tid
        if args:
            entry["args"] = args
        with self._lock:
            self.phases.append(entry)

    @contextmanager
    def phase(self, name: str, **args):
        """Time the ``with`` body as phase ``name`` (nested in the phases open around it)."""
        start = self.now()
        depth = self._open
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            self.add(name, start, self.now(), depth, **args)

    def as_dict(self, rank: int = 0) -> dict:
        """This timeline as JSON-ready data: the rank, the origin, the process start and the phases by start."""
        return {"rank": rank, "origin_unix": round(self.origin_unix, 6),
                "process_start_s": round(self.process_start_unix - self.origin_unix, 6),
                "phases": sorted(self.phases, key=lambda p: (p["start_s"], p["depth"]))}


_TIMELINE: Timeline | None = None


def timeline() -> Timeline:
    """This process's timeline (created on first use)."""
    global _TIMELINE
    if _TIMELINE is None:
        _TIMELINE = Timeline()
    return _TIMELINE


def phase(name: str, **args):
    """``with phase(name):`` — time the body in this process's timeline."""
    return timeline().phase(name, **args)


def chrome_trace(ranks: list[dict]) -> dict:
    """Chrome's trace format of the timelines ``ranks`` (:meth:`Timeline.as_dict` of each rank): one process per
    rank, its phases as complete events (``ph: "X"``, microseconds) on one clock whose zero is the earliest origin."""
    zero = min(r["origin_unix"] for r in ranks)
    events = []
    for r in ranks:
        shift = r["origin_unix"] - zero
        events.append({"name": "process_name", "ph": "M", "pid": r["rank"], "tid": 0,
                       "args": {"name": f"rank {r['rank']}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r["rank"], "tid": 0,
                       "args": {"sort_index": r["rank"]}})
        for p in r["phases"]:
            event = {"name": p["name"], "ph": "X", "pid": r["rank"], "tid": p.get("tid", 0), "cat": f"depth{p['depth']}",
                     "ts": round((p["start_s"] + shift) * 1e6, 1),
                     "dur": round((p["end_s"] - p["start_s"]) * 1e6, 1)}
            if p.get("args"):
                event["args"] = p["args"]
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
