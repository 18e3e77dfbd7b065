"""Run functions on N gloo CPU processes and collect per-rank results (the multi-process test harness).

Starting a process costs seconds (importing torch + diffusers), so a :class:`ProcessPool` starts its N
workers once (forked from one server process that imported those modules once, where the platform has one:
``_context``), initializes a real gloo process group in each, and then runs many cases: ``pool.run(fn,
*args)`` calls the module-level function ``fn(*args)`` on every rank and returns the list of results,
rank 0 first. Exceptions on any rank are re-raised in the caller with the rank's traceback. Ranks that have
not answered ``error_grace_s`` after another rank failed are taken to be waiting in a collective the failed rank
never joins: the pool stops them and closes (``closed``), so a failure costs seconds, not a collective timeout.
A worker process that ends without answering (killed, crashed) is a failure of its rank, reported with its exit
code or signal and the stacks Python's fault handler wrote.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback

_STOP = "__stop__"

#: what the workers' server process imports once, so that every pool started after the first starts in moments
#: (each worker still initializes its own torch state: threads, its process group); FLUX's pipeline module (most
#: tests' model) and inductor's compiler entry, each about 2 CPU-seconds a worker otherwise, at its first run (with
#: 8 workers a pool's first run took 11.0 s instead of 21.7 s); neither reads the environment the workers change
PRELOAD = ("torch", "torch.distributed", "diffusers", "transformers", "diffusers.pipelines.flux.pipeline_flux",
           "torch._inductor.compile_fx", "ditmesh.models", "ditmesh.api")


def _context():
    """The multiprocessing context of the workers: ``forkserver`` with :data:`PRELOAD` imported in the server where
    the platform has it, else ``spawn``; ``DITMESH_TEST_START=spawn`` forces spawn (each worker imports everything
    itself), ``DITMESH_TEST_START=fork`` forks the workers from the test process itself (scripts/mutate.py: its
    test processes are forked from one that imported torch and diffusers once, with one thread). The server is
    started by the first pool; each worker takes the environment of the moment its pool starts (``_worker``), but
    what a module read from the environment when the server imported it stays."""
    method = os.environ.get("DITMESH_TEST_START", "forkserver")
    if method not in ("forkserver", "spawn", "fork") or method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def rel_err(out, ref) -> float:
    """Relative error ``|out - ref| / |ref|`` (Frobenius norms): how parallel results are compared with one process."""
    return float((out - ref).norm() / ref.norm())


def free_port() -> int:
    """A TCP port that is free right now on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not count); Linux /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


def _worker(rank: int, world_size: int, port: int, tasks, results, timeout_s: float, environ: dict,
            fault_log: str) -> None:
    import faulthandler

    faulthandler.enable(open(fault_log, "w"))  # a crash's stacks, read back by ProcessPool.run (_dead)
    os.environ.clear()
    os.environ.update(environ)  # the parent's, as the pool starts (a forked worker has its server's otherwise)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    # the pool's own group: its barrier after a case cannot pair with a collective of the case's (a rank that failed
    # before one of the default group's collectives meets the others' barrier only here, so they still wait)
    own = dist.new_group(backend="gloo")
    cpu_log = os.environ.get("DITMESH_TEST_CPU_LOG")
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        module_name, fn_name, args, kwargs = task
        groups = set(_process_groups())
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001  (reported to the parent)
            results.put((rank, False, traceback.format_exc()))
        _destroy_groups_since(groups, own)
        if cpu_log:
            _log_case_cpu(cpu_log, rank, world_size, f"{module_name}.{fn_name}", args, cpu, wall)
    dist.destroy_process_group()


def _log_case_cpu(path: str, rank: int, world_size: int, name: str, args: tuple, cpu: float, wall: float) -> None:
    """One line of ``$DITMESH_TEST_CPU_LOG`` a case a rank: the CPU seconds and the wall seconds it took there, the
    case's function and the start of its arguments (where the suite's CPU time goes: docs/testing.md)."""
    with open(path, "a") as log:
        log.write(f"{world_size}\t{rank}\t{time.process_time() - cpu:.2f}\t{time.perf_counter() - wall:.2f}\t{name}"
                  f"\t{repr(args)[:160]}\n")


def _process_groups() -> list:
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _destroy_groups_since(before: set, own) -> None:
    """Destroy the process groups a case created (its meshes' sub-groups), once every rank has finished it. Each
    gloo group keeps a thread that wakes every 10 ms: a worker that kept the groups of hundreds of cases would
    spend the machine's cores waking them (the whole suite slowed down as it went)."""
    import gc

    import torch.distributed as dist

    new = [g for g in _process_groups() if g not in before and g is not dist.GroupMember.WORLD]
    try:  # every rank, also one that created none (a rank outside every new group): the others wait for it here
        dist.barrier(group=own)  # no rank still uses them
    except RuntimeError:
        return  # a rank failed: the pool closes
    for group in new:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
    if new:
        gc.collect()


class RankError(RuntimeError):
    """A function failed on one or more ranks."""


def fault_stacks(log: str, keep: int = 4000) -> str:
    """The last ``keep`` characters of a fault handler's log without its "Extension modules:" line (a worker that ran
    compiled cases has loaded hundreds of inductor kernels, and that one line would push the stacks out)."""
    lines = [line for line in log.splitlines() if not line.startswith("Extension modules:")]
    return "\n".join(lines)[-keep:]


class ProcessPool:
    """``world_size`` long-lived gloo worker processes on this machine."""

    def __init__(self, world_size: int, timeout_s: float = 300.0, error_grace_s: float = 10.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.error_grace_s = error_grace_s
        #: the workers were stopped (by :meth:`close`, or after a failure left ranks waiting); start a new pool
        self.closed = False
        ctx = _context()
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        environ = dict(os.environ)
        self._logs = tempfile.mkdtemp(prefix="ditmesh-pool-")
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results, timeout_s, environ,
                                              os.path.join(self._logs, f"rank{r}.log")), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return results ordered by rank."""
        task = (fn.__module__, fn.__name__, args, kwargs)
        for q in self._tasks:
            q.put(task)
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        died: dict[int, str] = {}

        def note_dead() -> None:
            died.update(self._dead(set(out) | set(errors)))
            errors.update(died)

        while len(out) + len(errors) < self.world_size:
            note_dead()
            wait = self.error_grace_s if errors else self.timeout_s + 30
            try:
                rank, ok, value = self._get(wait)
            except queue.Empty as exc:
                note_dead()
                self.close(force=True)
                if errors:
                    break  # the others wait in a collective the failed rank never joins: report its error
                raise RankError(f"{fn.__name__}: no result from all ranks within {wait:.0f}s") from exc
            (out if ok else errors)[rank] = value
        if died and not self.closed:
            self.close(force=True)  # a pool with a rank gone cannot run another case
        if errors:
            # a rank whose process died is the cause of the others' errors ("Connection reset by peer")
            first = min(errors, key=lambda r: (r not in died, r))
            stopped = " (the other ranks were stopped waiting)" if self.closed else ""
            raise RankError(f"{fn.__name__} failed on rank(s) {sorted(errors)}{stopped}; rank {first}:\n{errors[first]}")
        return [out[r] for r in range(self.world_size)]

    def _get(self, wait: float):
        """The next result, waiting at most ``wait`` seconds, and less as soon as a worker process has died (whose
        result never comes: :meth:`_dead` reports it)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline or any(p.exitcode is not None for p in self._procs):
                    raise

    def _dead(self, answered: set) -> dict[int, str]:
        """The ranks not in ``answered`` whose process has ended, each with its exit code (a signal by name) and
        what the fault handler wrote: a rank killed (by the kernel's out-of-memory killer: -9) or crashed never
        answers."""
        dead = {}
        for rank, p in enumerate(self._procs):
            if rank in answered or p.exitcode is None:
                continue
            code = p.exitcode
            how = f"exit code {code}"
            if code < 0:
                with contextlib.suppress(ValueError):
                    how = f"signal {signal.Signals(-code).name}"
            try:
                with open(os.path.join(self._logs, f"rank{rank}.log")) as f:
                    log = fault_stacks(f.read())
            except OSError:
                log = ""
            dead[rank] = f"the worker process of rank {rank} (pid {p.pid}) ended with {how}\n{log}"
        return dead

    def close(self, force: bool = False) -> None:
        """Stop the workers (``force``: kill them without waiting)."""
        self.closed = True
        if not force:
            for q in self._tasks:
                q.put(_STOP)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._logs, ignore_errors=True)


#: the environment of a Ray cluster on this machine's loopback address only (Ray otherwise takes the address of the
#: default route), without usage reports, and patient with raylets that start slowly on a loaded machine
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DISABLE_USAGE_STATS": "1",
                 "RAY_raylet_start_wait_time_s": "120"}


class PinnedRayCluster:
    """A real Ray cluster on this machine (``ray.cluster_utils.Cluster``): a head that offers no CPU (the front
    door's driver joins there, no rank runs there) and worker nodes of ``num_cpus`` logical CPUs, node ``i`` pinned
    to core ``i mod cores`` (its raylet and every actor it starts inherit the affinity). Sets
    :data:`LOCAL_RAY_ENV` and puts ditmesh's source on the workers' PYTHONPATH. ``address`` is the head's."""

    def __init__(self, nodes: int, num_cpus: float = 1):
        src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        os.environ.update(LOCAL_RAY_ENV, PYTHONPATH=os.pathsep.join(
            [src, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]]))
        from ray.cluster_utils import Cluster

        self.cores = sorted(os.sched_getaffinity(0))
        self.num_cpus = num_cpus
        for attempt in (1, 2):  # Ray gives a node 30 s to register: a loaded machine may need a second start
            self.added = 0
            # node deaths are noticed in about 5 s (Ray's default: 15 s)
            self.cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=0, object_store_memory=80 * 2**20, include_dashboard=False,
                _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 5}))
            try:
                for _ in range(nodes):
                    self.add_node()
                break
            except Exception as exc:
                self.cluster.shutdown()
                if attempt == 2 or "timed out during startup" not in str(exc):
                    raise
        self.address = self.cluster.address

    def add_node(self):
        """One more worker node, pinned to the next core; returns Ray's node object (``node_id``)."""
        os.sched_setaffinity(0, {self.cores[self.added % len(self.cores)]})
        try:
            node = self.cluster.add_node(num_cpus=self.num_cpus, object_store_memory=80 * 2**20)
        finally:
            os.sched_setaffinity(0, self.cores)
        self.added += 1
        return node

    def remove_node(self, node_id: str) -> None:
        """Take the worker node ``node_id`` out as a lost machine: every process of it killed at once."""
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def kill_raylet(self, node_id: str) -> None:
        """Kill the raylet of the worker node ``node_id`` (SIGKILL): its workers follow it, the cluster's health
        checks find the node dead; the node's other processes are removed with it (``remove_node``) at the end."""
        next(n for n in self.cluster.worker_nodes if n.node_id == node_id).kill_raylet()

    def shutdown(self) -> None:
        self.cluster.shutdown()
