"""A serving replica on a Ray cluster: one placement group packed on one node (``STRICT_PACK``), one Ray actor per
rank; the actors form the replica's torch.distributed group (NCCL on GPUs, gloo on CPUs) and run the rank code of
``worker.py`` (``run_rank``), the code a replica of rank processes on one host runs.

Only how ranks are started, reached and stopped differs from ``replica.Replica``; the request protocol, the
timeouts and the fault messages are its own:

- rank 0's request queue and cancel flag live in rank 0's actor (``submit`` / ``cancel`` calls);
- each rank's events (ready, steps, heartbeats, results) are collected by one thread per rank in the front end that
  long-polls its actor (``take_events``) and puts them on the replica's event queue;
- a rank is alive until a poll raises Ray's ActorDiedError (its process was killed, its node removed or lost), whose
  cause the fault message names; a rank that hangs or is stopped answers no poll: no heartbeat within
  ``step_timeout``, as on one host.

Every (re)start makes a fresh placement group and fresh actors (the old ones are killed, their group removed), so
a rebuilt replica lands on whichever node has room, and nothing of a dead group's traffic reaches the new one.
A first start waits up to ``load_timeout`` for a node with room; a restart waits for one however long it takes (no
node left: until one joins), saying what it waits for in ``waiting`` (the service's 503 and ``/health`` show it,
and answer the requests meanwhile within ``--unavailable-timeout``), until the replica is closed.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .replica import POLL_S, RankFault, RankState, Replica

#: how long one poll of a rank's events waits for the first one (the heartbeat comes every second)
EVENTS_WAIT_S = 0.5
#: how often a replica waiting for a node with room looks again (and whether it was closed meanwhile), in seconds
PLACE_POLL_S = 0.25
#: methods of a rank actor that may run at once: start, take_events, submit and cancel (the rank's own work runs
#: in a thread of its own)
ACTOR_CONCURRENCY = 4


class RankActor:
    """One rank of a replica, as a Ray actor (``ray.remote`` is applied by :func:`rank_actor_class`)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.requests: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.cancel_flag = threading.Event()

    def where(self) -> dict:
        """The node, address, pid and GPUs of this rank."""
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port of its node for the group's store (MASTER_ADDR, MASTER_PORT)."""
        import socket

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def start(self, master: tuple[str, int], options: dict, visible_gpus: list[str], local_rank: int) -> None:
        """Join the group at ``master`` and run the rank (load, warm up, serve) in a thread of its own. On GPUs
        every rank sees all GPUs of the replica (``visible_gpus``) and uses the ``local_rank``-th, as under torchrun,
        so NCCL finds its peers' devices."""
        from ..shared import quiet_libraries
        from .worker import run_rank

        quiet_libraries()
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(self.world))
        if visible_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        threading.Thread(target=run_rank, daemon=True, name="ditmesh-rank",
                         args=(self.rank, self.world, options, self.requests, self.events, self.cancel_flag, False)
                         ).start()

    def take_events(self, wait_s: float) -> list:
        """The events since the last call: waits up to ``wait_s`` for the first one."""
        try:
            out = [self.events.get(timeout=wait_s)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def submit(self, request: dict) -> None:
        """Rank 0: run ``request`` next (its cancel flag starts clear)."""
        self.cancel_flag.clear()
        self.requests.put(request)

    def cancel(self) -> None:
        """Rank 0: stop the request in flight after its next step."""
        self.cancel_flag.set()


_ACTOR_CLASS = None


def rank_actor_class():
    """:class:`RankActor` as a Ray actor class (made once, after ``ray.init``)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = ray.remote(RankActor)
    return _ACTOR_CLASS


class _ActorRank:
    """A rank actor seen as a process by ``Replica``: alive until a poll finds it dead (``cause``)."""

    def __init__(self, actor, where: dict):
        self.actor, self.where = actor, where
        self.pid = where["pid"]
        self.exitcode = None
        self.cause: str | None = None

    def is_alive(self) -> bool:
        return self.cause is None


class _Submit:
    """``Replica``'s request queue, as rank 0's actor takes it."""

    def __init__(self, actor):
        self.actor = actor

    def put(self, request: dict) -> None:
        self.actor.submit.remote(request)


class _Cancel:
    """``Replica``'s cancel flag, held by rank 0's actor (``submit`` clears it with each request)."""

    def __init__(self, actor):
        self.actor = actor

    def set(self) -> None:
        self.actor.cancel.remote()

    def clear(self) -> None:
        pass


def _placed(group) -> bool:
    """Whether the cluster's control store says ``group`` is placed (False while it cannot be asked)."""
    try:
        return placement_group_table(group).get("state") == "CREATED"
    except Exception:  # noqa: BLE001  (the GCS unreachable for a moment: ask again)
        return False


def death_cause(exc: BaseException) -> str:
    """One line of why Ray says an actor died (its node, its process), from ActorDiedError's message."""
    text = " ".join(str(exc).split())
    lowered = text.lower()
    if "worker process has died" in lowered or "worker died" in lowered:
        return "its process died"
    if "node" in lowered and ("died" in lowered or "dead" in lowered or "removed" in lowered):
        return "its node died or left the cluster"
    if "ray.kill" in lowered or "killed by" in lowered:
        return "it was killed (ray.kill)"
    return text[:200]


class RayReplica(Replica):
    """``world`` rank actors in one placement group of ``world`` bundles (``bundle``: one rank's resources, e.g.
    ``{"CPU": 1}`` or ``{"GPU": 1, "CPU": 1}``) packed on one node, running ``options`` as one process group."""

    def __init__(self, index: int, world: int, options: dict, step_timeout: float, load_timeout: float,
                 bundle: dict):
        super().__init__(index, world, options, step_timeout, load_timeout)
        self.bundle = dict(bundle)
        self.node: str | None = None  # the node id of the running group
        self.node_ip: str | None = None
        self._group = None
        self._pollers: list[threading.Thread] = []
        self._polling = threading.Event()
        #: what the replica waits for while no node has room for it (None when it does not wait)
        self.waiting: str | None = None
        self._wait_for_room = False  # a restart waits for room however long it takes

    def restart(self) -> None:
        """Rebuild the group: a fresh placement group wherever a node has room, waiting until one has."""
        self._wait_for_room = True
        try:
            super().restart()
        finally:
            self._wait_for_room = False

    def _launch(self) -> None:
        """Place the group, start one actor per rank in it, join them into one process group and start the
        pollers; RankFault when no node has room within ``load_timeout``."""
        group = placement_group([dict(self.bundle) for _ in range(self.world)], strategy="STRICT_PACK",
                                name=f"ditmesh-replica-{self.index}-{time.time_ns()}")
        self._group = group
        self._await_room(group)
        cls = rank_actor_class()
        actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r),
                              num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
                              max_concurrency=ACTOR_CONCURRENCY, max_restarts=0, max_task_retries=0,
                              name=f"ditmesh-r{self.index}-rank{r}-{time.time_ns()}").remote(r, self.world)
                  for r in range(self.world)]
        self.ranks = []
        try:
            places = ray.get([a.where.remote() for a in actors], timeout=self.load_timeout)
            master = ray.get(actors[0].rendezvous.remote(), timeout=self.load_timeout)
            gpus = sorted({g for p in places for g in p["gpus"]}, key=lambda g: (len(g), g))
            ray.get([a.start.remote(master, self.options, gpus, gpus.index(p["gpus"][0]) if p["gpus"] else r)
                     for r, (a, p) in enumerate(zip(actors, places))], timeout=self.load_timeout)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            for a in actors:
                ray.kill(a, no_restart=True)
            self.stop()
            self.state = "failed"
            raise RankFault(f"replica {self.index} could not start its rank actors: {death_cause(exc)}") from None
        self.node, self.node_ip = places[0]["node"], places[0]["ip"]
        self.ranks = [RankState(_ActorRank(a, p)) for a, p in zip(actors, places)]
        self._events = queue.Queue()
        self._requests, self._cancel = _Submit(actors[0]), _Cancel(actors[0])
        self._polling = threading.Event()
        self._pollers = [threading.Thread(target=self._poll, args=(r.process, self._events, self._polling),
                                          daemon=True, name=f"ray-poll-r{self.index}-{rank}")
                         for rank, r in enumerate(self.ranks)]
        for t in self._pollers:
            t.start()

    def _await_room(self, group) -> None:
        """Wait until ``group`` is placed: up to ``load_timeout`` on a first start, for ever on a restart
        (``waiting`` says why meanwhile); RankFault when it times out or the replica is closed. The group's state is
        read from the cluster's control store (GCS) rather than through ``group.ready()``, a task, which this
        process's own Ray node would have to run."""
        start = time.time()
        try:
            while not _placed(group):
                time.sleep(PLACE_POLL_S)
                if self.closing:
                    raise RankFault(f"replica {self.index} was stopped while it waited for a node with room")
                if not self._wait_for_room and time.time() - start > self.load_timeout:
                    raise RankFault(f"replica {self.index} could not be placed within {self.load_timeout:g} s: "
                                    f"{self._room_wanted()}")
                if self.waiting is None or int(time.time() - start) % 10 == 0:
                    self.waiting = self._room_wanted()
        except RankFault:
            self.stop()
            self.state = "failed"
            raise
        finally:
            self.waiting = None

    def _room_wanted(self) -> str:
        """What a replica waiting to be placed waits for, the nodes the cluster has, and whether this process's
        own Ray node (the front door's) is among them."""
        try:
            everything = ray.nodes()
            here = ray.get_runtime_context().get_node_id()
        except Exception as exc:  # noqa: BLE001  (the cluster's GCS unreachable)
            return f"waiting for a node of the Ray cluster with room for {self.world} x {self.bundle} ({exc})"
        nodes = [n for n in everything if n.get("Alive")]
        sizes = ", ".join(f"{n['NodeManagerAddress']} {n['Resources'].get('GPU', 0):g} GPU / "
                          f"{n['Resources'].get('CPU', 0):g} CPU" for n in nodes)
        lost = "" if any(n["NodeID"] == here for n in nodes) else (
            f"; the front door's own Ray node {here[:12]} is dead too: replicas cannot hand it their pictures (Ray "
            f"keeps large ones in a node's object store), restart the front door on a live node")
        return (f"waiting for a node of the Ray cluster with room for {self.world} x {self.bundle} (alive nodes: "
                f"{sizes or 'none'}){lost}")

    @staticmethod
    def _poll(rank: _ActorRank, events: queue.Queue, stopped: threading.Event) -> None:
        """Move one rank's events to ``events`` until the replica stops or the actor is found dead."""
        pending = rank.actor.take_events.remote(EVENTS_WAIT_S)
        while not stopped.is_set():
            done, _ = ray.wait([pending], timeout=POLL_S)
            if not done:  # a hung or stopped rank: its heartbeats stop, found by step_timeout
                continue
            try:
                batch = ray.get(pending)
            except ray.exceptions.ActorUnavailableError:  # not known dead yet (e.g. its node is being checked)
                time.sleep(POLL_S)
            except ray.exceptions.RayActorError as exc:
                rank.cause = death_cause(exc)
                return
            else:
                for event in batch:
                    events.put(event)
            pending = rank.actor.take_events.remote(EVENTS_WAIT_S)

    def stop(self) -> None:
        """Stop the pollers, kill the rank actors (they hold nothing to save) and remove their placement group."""
        self._polling.set()
        for r in self.ranks:
            try:
                ray.kill(r.process.actor, no_restart=True)
            except Exception:  # noqa: BLE001  (an actor gone with its node)
                pass
        for t in self._pollers:
            t.join(timeout=5)
        if self._group is not None:
            try:
                remove_placement_group(self._group)
            except Exception:  # noqa: BLE001
                pass
            self._group = None

    def _death(self, rank: int) -> str:
        process = self.ranks[rank].process
        return f"(pid {process.pid} on node {process.where['ip']} {process.where['node'][:12]}) died: {process.cause}"
