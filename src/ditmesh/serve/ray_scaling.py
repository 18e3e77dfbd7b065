"""The service of ``serve --ray``: the single-host service (``app.py``) whose replicas are started and stopped
with the load.

Routing by queue length: every replica runs one request at a time (its ranks run one pipeline call), so the
shortest queue is an empty one: requests wait in one queue in arrival order, and each replica's dispatcher takes the
next when its replica is free. No request waits behind a slow one while another replica idles, and a request never
sits in a dead replica's queue.

Scaling on queue depth (``--min-replicas`` / ``--max-replicas``): every :data:`SCALE_TICK_S` the scaler adds a
replica (one at a time, placed by Ray wherever a node has room) while more requests wait than replicas are free or
starting, and takes one out (after its request, newest first) once the queue is empty and it has served nothing
for ``--scale-down-idle`` seconds, down to ``--min-replicas``.
"""

from __future__ import annotations

import threading
import time

from .app import Service, log

#: how often the scaler looks at the queue (seconds)
SCALE_TICK_S = 0.5


class RayService(Service):
    """The service whose replicas live on a Ray cluster: scales between ``min_replicas`` and ``max_replicas``
    (module docstring) and shows each replica's node."""

    def __init__(self, replicas, *args, new_replica, min_replicas: int, max_replicas: int,
                 scale_down_idle_s: float, **kwargs):
        super().__init__(replicas, *args, **kwargs)
        self.new_replica = new_replica
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.scale_down_idle_s = scale_down_idle_s
        self.starting = 0  # replicas being started by the scaler
        self.next_index = len(replicas)
        self.dispatchers = dict(zip((r.index for r in replicas), self.threads))
        self.scaler = threading.Thread(target=self._scale, daemon=True, name="scaler")

    def start(self) -> None:
        super().start()
        self.scaler.start()

    def stop(self) -> None:
        self.stopping.set()
        self.scaler.join(timeout=5)
        super().stop()

    # -- scaling -----------------------------------------------------------------------------------------------
    def _scale(self) -> None:
        idle_since: dict[int, float] = {}
        served: dict[int, int] = {}
        while not self.stopping.wait(SCALE_TICK_S):
            live = [r for r in list(self.replicas) if r.index not in self.retired and r.state != "down"]
            waiting = self.queue.qsize()
            free = sum(r.state in ("ready", "calibrating") for r in live)  # a measurement gives way to a job
            if waiting > free + self.starting and len(live) + self.starting < self.max_replicas:
                with self.lock:
                    self.starting += 1
                threading.Thread(target=self._add, daemon=True, name="scale-up").start()
            now = time.time()
            for r in live:  # idle: ready, and nothing served since the last look
                if r.state != "ready" or served.get(r.index) != r.served:
                    idle_since[r.index] = now
                served[r.index] = r.served
            if waiting == 0 and len(live) > self.min_replicas:
                idle = [r for r in live if r.state == "ready" and now - idle_since[r.index] >= self.scale_down_idle_s]
                if idle:
                    self._retire(max(idle, key=lambda r: r.index))

    def _add(self) -> None:
        """Start one more replica and give it a dispatcher (a replica that cannot start is counted and dropped)."""
        from .replica import RankFault

        with self.lock:
            index, self.next_index = self.next_index, self.next_index + 1
        replica = self.new_replica(index=index)
        try:
            replica.start()
        except RankFault as exc:
            self.last_restart_error = str(exc)
            self.counts["scale_up_failures"] += 1
            log(f"replica {index}: could not start while scaling up: {exc}")
            return
        finally:
            with self.lock:
                self.starting -= 1
        if self.stopping.is_set():
            replica.stop()
            return
        thread = threading.Thread(target=self._dispatch, args=(replica,), daemon=True, name=f"dispatch-{index}")
        with self.lock:
            self.replicas.append(replica)
            self.threads.append(thread)
            self.dispatchers[index] = thread
            self.counts["scale_ups"] += 1
        thread.start()

    def _retire(self, replica) -> None:
        """Take ``replica`` out of service: its dispatcher leaves after the request it may hold, then its actors
        stop and it leaves the list."""
        self.retired.add(replica.index)

        def leave():
            self.dispatchers[replica.index].join()
            replica.stop()
            with self.lock:
                self.replicas.remove(replica)
                self.counts["scale_downs"] += 1

        threading.Thread(target=leave, daemon=True, name=f"retire-{replica.index}").start()

    # -- what the routes show ----------------------------------------------------------------------------------
    def health(self) -> dict:
        body = super().health()
        where = {r.index: r for r in list(self.replicas)}
        for entry in body["replicas"]:
            replica = where.get(entry["index"])
            if replica is not None:
                entry.update(node=replica.node, node_ip=replica.node_ip, retired=replica.index in self.retired)
        body["scaling"] = {"min": self.min_replicas, "max": self.max_replicas, "starting": self.starting}
        return body

    def metrics(self) -> str:
        c = self.counts
        live = sum(r.index not in self.retired and r.state != "down" for r in list(self.replicas))
        return super().metrics() + "\n".join([
            "# HELP ditmesh_replicas Replicas serving (Ray).", "# TYPE ditmesh_replicas gauge",
            f"ditmesh_replicas {live}",
            "# HELP ditmesh_starting_replicas Replicas being started by the scaler (Ray).",
            "# TYPE ditmesh_starting_replicas gauge", f"ditmesh_starting_replicas {self.starting}",
            "# HELP ditmesh_scale_ups_total Replicas added on queue depth (Ray).",
            "# TYPE ditmesh_scale_ups_total counter", f"ditmesh_scale_ups_total {c['scale_ups']}",
            "# HELP ditmesh_scale_downs_total Idle replicas stopped (Ray).",
            "# TYPE ditmesh_scale_downs_total counter", f"ditmesh_scale_downs_total {c['scale_downs']}",
        ]) + "\n"
