"""Start the local ranks of a ditmesh command, and report their failures as one line.

``ditmesh generate --nproc N ...`` runs itself as ``python -m ditmesh ...`` (without ``--nproc``) in N
processes with RANK/WORLD_SIZE/LOCAL_RANK set, as ``torchrun --nproc-per-node N`` would. A run on one host is
started by a launcher of our own that imports neither torch nor diffusers: one process imports them for all ranks
and forks them (:mod:`.forked`; ``DITMESH_LAUNCH=exec``: each rank is its own interpreter). Rank 0 binds the run's store (:func:`rank_store`: ``127.0.0.1:0``, a port the system picks, so no port is
chosen first and taken by someone else before it is bound) and writes its port into the run's folder, where the
other ranks read it; every launch (every ``bench`` row) has a fresh store. A run whose ranks cannot meet at it is
started once more on a fresh store; ``on_retry`` hears why.

With ``--nnodes M --rdzv-endpoint HOST:PORT`` the same command on M hosts meets through torch's elastic agent at
a c10d rendezvous, as ``torchrun --nnodes M --rdzv-backend c10d`` would; a host that does not join within
``--rdzv-timeout`` seconds ends the run with one line.

Errors: a rank that fails writes its one-line message (and its traceback) into the run's folder and leaves
quietly with code 2; the launcher stops the other ranks, prints the earliest failure once and exits 2. Ranks other
than local rank 0 write their output to that folder too, so nothing is printed once per rank. Ctrl-C ends every
rank quietly (exit 130), SIGTERM to the launcher is passed on to its ranks (exit 143). The folder is removed at the
end of every run.

A failing rank leaves with ``os._exit(2)`` (no destructors: a gloo group torn down mid-collective prints
nothing), and the launcher prints the earliest record's message. A launched rank keeps the default action of
SIGINT and SIGTERM (set in ``ditmesh.__main__``, and in the zygote before it imports), so Ctrl-C ends it at once
even inside a blocking collective. ``ditmesh --help`` and argument errors import neither torch nor diffusers
(``ditmesh/__init__.py`` and the sub-commands' parsers load lazily).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import tempfile
import time
import traceback
from pathlib import Path

from ..shared import one_line, share_cpu_threads
from . import forked
from ..timeline import LAUNCH_START_ENV, timeline

#: set by the launcher for its ranks: where a failing rank writes its error
ERROR_DIR_ENV = "DITMESH_ERROR_DIR"
#: set by the local launcher for its ranks: ``HOST:PORT|PORT_FILE|TIMEOUT_S``, where rank 0 binds the run's store
#: (port 0: the system picks one), the file it writes the bound port to, and how long the others wait for it
STORE_ENV = "DITMESH_STORE"


class LaunchError(RuntimeError):
    """One or more ranks exited with an error."""


class Interrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C or a termination signal); ``code`` is the exit code to use. A
    KeyboardInterrupt, so that code catching ``Exception`` (a benchmark row, say) lets it through."""

    def __init__(self, code: int):
        super().__init__(f"interrupted (exit {code})")
        self.code = code


# -- in a rank ---------------------------------------------------------------------------------------------------
def launched_rank() -> bool:
    """Whether this process is a rank started by :func:`launch` (it reports errors through the run folder)."""
    return bool(os.environ.get(ERROR_DIR_ENV)) and "RANK" in os.environ


def run_rank(fn) -> int:
    """Run ``fn()`` as a launched rank: an error becomes one record in the run folder and exit code 2. Never
    returns on failure (the process leaves without destructors, so a process group torn down mid-collective
    prints nothing). Ctrl-C and SIGTERM keep their default action, set in ``ditmesh.__main__``: they end the
    process at once, also inside a blocking collective."""
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001  (every failure of a rank is reported the same way)
        record = {"time": time.time(), "rank": int(os.environ.get("RANK", 0)), "type": type(exc).__name__,
                  "message": one_line(exc), "traceback": traceback.format_exc()}
        path = Path(os.environ[ERROR_DIR_ENV]) / f"error-rank{record['rank']}.json"
        try:
            path.write_text(json.dumps(record))
        except OSError:
            print(f"ditmesh: error: {record['message']}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)


class StoreUnreachable(RuntimeError):
    """A rank could not bind or reach its run's store (the launcher starts the run once more on a fresh one)."""


def rank_store():
    """The store a rank of the local launcher meets the others at (``None`` outside such a rank): rank 0 binds it
    where :data:`STORE_ENV` says and writes the port it got into the run's folder; the others wait for that file
    (as long as rank 0's imports may take: the launch's rendezvous timeout) and connect. Raises
    :class:`StoreUnreachable` with the store's own message when it cannot be bound or reached."""
    spec = os.environ.get(STORE_ENV)
    if not spec:
        return None
    import datetime

    from torch.distributed import TCPStore

    endpoint, port_file, wait_s = spec.split("|")
    host, port = endpoint.rsplit(":", 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=max(float(wait_s), STORE_TIMEOUT_S))
    try:
        if rank == 0:
            store = TCPStore(host, int(port), world, is_master=True, timeout=timeout, wait_for_workers=False)
            Path(port_file + ".tmp").write_text(str(store.port))
            os.replace(port_file + ".tmp", port_file)  # whole, or not there
            return store
        deadline = time.monotonic() + float(wait_s)
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not open the run's store within {float(wait_s):.0f} s")
            time.sleep(0.01)
        return TCPStore(host, int(Path(port_file).read_text()), world, is_master=False, timeout=timeout)
    except (RuntimeError, OSError, TimeoutError) as exc:
        raise StoreUnreachable(f"the run's store at {endpoint}: {one_line(exc)}") from None


# -- the launcher ------------------------------------------------------------------------------------------------
#: errors a user can fix: the line alone says what to do; others also name where the traceback was kept
USER_ERRORS = ("ConfigError", "FileNotFoundError", "PermissionError", "NotImplementedError", "ValueError",
               "OSError", "SafetensorError", "HeaderTooLarge", "EnvironmentError")


class RendezvousFailed(LaunchError):
    """The local ranks could not meet at their store (``cause``: the store's or the rendezvous' own message)."""

    def __init__(self, cause: str):
        super().__init__(f"the local ranks could not meet ({cause})")
        self.cause = cause


#: tries of a local run's rendezvous: the first, and one more on a fresh store when the first cannot connect
LOCAL_TRIES = 2
#: seconds a rank waits for the store to answer (the c10d rendezvous' ``read_timeout``)
STORE_TIMEOUT_S = 60


def local_endpoint(attempt: int) -> str:
    """Where the ranks of a local run's ``attempt`` (0, 1, ...) meet: a port the store's own bind picks."""
    return "127.0.0.1:0"


def launch(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str | None = None,
           rdzv_timeout: int = 300, log_dir: str | None = None, on_retry=None, timeout_s: float | None = None) -> int:
    """Run ``python -m ditmesh <argv>`` on ``nproc`` local ranks (of ``nnodes`` hosts meeting at
    ``rdzv_endpoint``); return 0, or raise :class:`LaunchError` with the first rank's one-line error, or
    :class:`Interrupted`. The run's folder is created in ``log_dir`` (default: the temporary directory) and
    removed at the end. A local run (no ``rdzv_endpoint``) whose ranks cannot meet is started once more on a fresh
    store, after ``on_retry(cause)``; a second failure raises :class:`RendezvousFailed` naming both causes. A local
    run still going after ``timeout_s`` seconds is stopped (:class:`LaunchError` saying so)."""
    if rdzv_endpoint:
        return _launch_hosts(nproc, argv, nnodes, rdzv_endpoint, rdzv_timeout, log_dir)
    causes = []
    for attempt in range(LOCAL_TRIES):
        try:
            return _launch_local(nproc, argv, local_endpoint(attempt), rdzv_timeout, log_dir, timeout_s)
        except RendezvousFailed as exc:
            causes.append(exc.cause)
            if attempt + 1 == LOCAL_TRIES:
                raise RendezvousFailed("; then, on a fresh store: ".join(causes)) from None
            if on_retry is not None:
                on_retry(exc.cause)
    raise AssertionError("unreachable")


def _run_dir(log_dir: str | None) -> Path:
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="ditmesh-run-", dir=log_dir))


def _launch_local(nproc: int, argv: list[str], endpoint: str, rdzv_timeout: int, log_dir: str | None,
                  timeout_s: float | None = None) -> int:
    """One start of the ranks of a run on this host, their store bound by rank 0 at ``endpoint`` (see
    :func:`launch`). Imports nothing heavy: the ranks start at once."""
    run_dir = _run_dir(log_dir)
    (run_dir / "logs").mkdir()
    env = dict(os.environ)
    share_cpu_threads(env, nproc)
    env.update({ERROR_DIR_ENV: str(run_dir), LAUNCH_START_ENV: str(timeline().process_start_unix),
                STORE_ENV: f"{endpoint}|{run_dir / 'store-port'}|{rdzv_timeout}", "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": endpoint.rsplit(":", 1)[0]})
    procs: list[subprocess.Popen] = []
    logs = []
    signalled: list[int] = []
    zygote = None

    def on_signal(signum, frame):
        signalled.append(signum)
        raise Interrupted(128 + signum)

    handle = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_signal) if handle else None
    try:
        # no signal between a rank's fork and its place in ``procs`` (an unknown rank would outlive the run):
        # SIGINT and SIGTERM wait until every rank is started, then arrive
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            zygote = _start_ranks(procs, logs, nproc, argv, env, run_dir)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if zygote is not None and not zygote.adopt(procs, deadline):
            _dump_stacks(procs, run_dir, who="imports")
            raise LaunchError(f"stopped after {timeout_s:g} s: the ranks were still importing (where: the Python "
                              "stacks printed above)")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        failures = _wait_ranks(procs, left, on_timeout=lambda: _dump_stacks(procs, run_dir))
        if failures is None:
            raise LaunchError(f"stopped after {timeout_s:g} s: the ranks had not finished (where each one was: "
                              "the Python stacks printed above)")
        if failures:
            record = _earliest_record(run_dir)
            if record is not None and record["type"] == StoreUnreachable.__name__:
                raise RendezvousFailed(record["message"])
            if record is None and zygote is not None and procs[0] is zygote.process:  # killed (out of memory?)
                raise LaunchError(f"the process that imports torch and diffusers for the ranks exited with code "
                                  f"{failures[0]} before it forked them; DITMESH_LAUNCH=exec starts each rank as its "
                                  "own interpreter")
            raise LaunchError(_first_failure(run_dir, failures, nproc))
    except KeyboardInterrupt as exc:  # a rank still starting ignores SIGINT: the SIGTERM after it ends that one
        _stop(procs, signal.SIGTERM if signalled else signal.SIGINT, grace_s=2.0)
        raise exc if isinstance(exc, Interrupted) else Interrupted(130) from None
    finally:
        if handle:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if zygote is not None:  # given up on while it imported: stopped, and the ranks it forked put in procs
            zygote.close(procs)
        _stop(procs, signal.SIGTERM)
        for out in logs:
            out.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _start_ranks(procs: list, logs: list, nproc: int, argv: list[str], env: dict, run_dir: Path):
    """Start the ``nproc`` ranks: forked from a zygote (:mod:`.forked`; returned, its process in ``procs`` until it
    has forked them), or each its own interpreter (appended to ``procs``; the log files of ranks 1.. to ``logs``;
    returns None)."""
    if forked.wanted():
        zygote = forked.Zygote.start(nproc, argv, env, run_dir, _rank_signals)
        if zygote is not None:
            procs.append(zygote.process)
            return zygote
    for rank in range(nproc):
        out = None
        if rank:  # local rank 0 keeps the console (progress bar, result line)
            out = open(run_dir / "logs" / f"rank{rank}.log", "wb")
            logs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "ditmesh", *argv],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=out,
                                      stderr=subprocess.STDOUT if out is not None else None, preexec_fn=_rank_signals))


def _rank_signals() -> None:
    """In a rank (or the zygote) between fork and exec: born with SIGINT ignored, so that a Ctrl-C while its
    interpreter starts is no KeyboardInterrupt traceback (``ditmesh.__main__`` or the zygote gives it back its
    default action, the end of the process, first thing), with SIGUSR1 ignored until its stack dump is registered
    (the launcher's time limit must not kill a process that is still starting), and with the launcher's blocked
    signals unblocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _wait_ranks(procs: list[subprocess.Popen], timeout_s: float | None = None,
                on_timeout=None) -> dict[int, int] | None:
    """Wait until every rank has left; at the first that fails, stop the others. Returns ``{rank: exit code}`` of
    the ranks that failed (empty when all succeeded), or ``None`` when ``timeout_s`` passed first (``on_timeout()``
    called, then every rank stopped)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if deadline is not None and time.monotonic() > deadline:
            if on_timeout is not None:
                on_timeout()
            _stop(procs, signal.SIGTERM)
            return None
        codes = [p.poll() for p in procs]
        failed = {rank: code for rank, code in enumerate(codes) if code not in (None, 0)}
        if failed:  # the ranks that failed first: the others are stopped because of them
            _stop(procs, signal.SIGTERM)
            return failed
        if all(code == 0 for code in codes):
            return {}
        time.sleep(0.02)


def _dump_stacks(procs: list[subprocess.Popen], run_dir: Path, wait_s: float = 2.0, who: str = "rank") -> None:
    """Ask the ranks still running for their Python stacks (SIGUSR1: ``faulthandler`` in ``ditmesh.__main__``) and
    print them on stderr: rank 0 writes to the console itself, the others' logs are copied from where they dumped.
    ``who="imports"``: ``procs`` is the zygote, still importing for the ranks (:mod:`.forked`)."""
    marks = {}
    print("ditmesh: the ranks' imports at the time limit (one process, before it forks the ranks)" if who == "imports"
          else "ditmesh: the ranks at the time limit (rank 0's stacks come first, unlabelled)", file=sys.stderr,
          flush=True)
    for rank in range(1, len(procs)):
        log = run_dir / "logs" / f"rank{rank}.log"
        marks[rank] = log.stat().st_size if log.exists() else 0
    # where each process is below Python at the limit itself (read before the stacks' wait, in which a zygote may
    # finish its imports and leave), printed after the stacks
    states = {rank: _native_state(p.pid) for rank, p in enumerate(procs) if p.poll() is None}
    _send(procs, signal.SIGUSR1)
    time.sleep(wait_s)
    for rank in range(1, len(procs)):
        log = run_dir / "logs" / f"rank{rank}.log"
        if log.exists():
            with open(log, "rb") as f:
                f.seek(marks[rank])
                dump = f.read().decode(errors="replace").strip()
            if dump:
                print(f"ditmesh: rank {rank} at the time limit:\n{dump}", file=sys.stderr, flush=True)
    for rank, state in states.items():
        name = "imports" if who == "imports" else f"rank {rank}"
        print(f"ditmesh: {name} (pid {procs[rank].pid}): {state}", file=sys.stderr, flush=True)


def _native_state(pid: int) -> str:
    """Where a rank's process is below Python: its scheduler state and kernel wait channel (``/proc``), and, when
    ``py-spy`` is on the PATH, its threads' native and Python stacks (a rank blocked in a driver call answers no
    signal, so the fault handler's dump never comes)."""
    parts = []
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        parts.append(next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")),
                          "state unknown"))
        parts.append("waiting in " + (Path(f"/proc/{pid}/wchan").read_text().strip() or "-"))
    except OSError as e:
        parts.append(f"no /proc entry ({e.strerror})")
    spy = shutil.which("py-spy")
    if spy is not None:
        try:
            out = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=20)
            parts.append("py-spy:\n" + (out.stdout + out.stderr).strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            parts.append(f"py-spy failed: {e}")
    return "; ".join(parts[:2]) + ("\n" + "\n".join(parts[2:]) if parts[2:] else "")


def _send(procs: list[subprocess.Popen], signum: int) -> None:
    """Send ``signum`` to the ranks still running (one that just left is no error)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except OSError:
                pass


def _stop(procs: list[subprocess.Popen], signum: int, grace_s: float = 10.0) -> None:
    """Send ``signum`` to the ranks still running and wait for them (killed after ``grace_s``)."""
    _send(procs, signum)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _launch_hosts(nproc: int, argv: list[str], nnodes: int, endpoint: str, rdzv_timeout: int,
                  log_dir: str | None) -> int:
    """One start of the ranks of a run over several hosts, meeting at ``endpoint`` through torch's elastic agent
    (see :func:`launch`)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # torch's elastic loggers set their own levels
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    share_cpu_threads(os.environ, nproc)
    run_dir = _run_dir(log_dir)
    os.environ[ERROR_DIR_ENV] = str(run_dir)  # the ranks inherit it
    os.environ[LAUNCH_START_ENV] = str(timeline().process_start_unix)  # the ranks' timelines start where this did
    quiet = {r: Std.ALL for r in range(1, nproc)}  # local rank 0 keeps the console (progress bar, result line)
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=quiet),
        # every host of one run must agree on the id: derived from the endpoint they share
        run_id=f"ditmesh-{endpoint.replace(':', '-')}",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": rdzv_timeout, "last_call_timeout": 1, "read_timeout": STORE_TIMEOUT_S},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "ditmesh", *argv)
    except ChildFailedError as exc:
        failures = {f.local_rank: f.exitcode for f in exc.failures.values()}
        raise LaunchError(_first_failure(run_dir, failures, nproc)) from None
    except SignalException as exc:
        raise Interrupted(128 + int(exc.sigval)) from None
    except KeyboardInterrupt:
        raise Interrupted(130) from None
    except RendezvousError as exc:
        if nnodes > 1:
            raise LaunchError(f"not all {nnodes} hosts joined the rendezvous at {endpoint} within {rdzv_timeout} s; "
                              f"start the same command on every host (or raise --rdzv-timeout)") from None
        raise RendezvousFailed(_cause(exc)) from None
    finally:
        os.environ.pop(ERROR_DIR_ENV, None)
        os.environ.pop(LAUNCH_START_ENV, None)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _cause(exc: BaseException) -> str:
    """A rendezvous error in one line, with the error under it (the store's own message) when there is one."""
    inner = exc.__cause__ or exc.__context__
    return one_line(exc) + (f": {one_line(inner)}" if inner is not None else "")


def _earliest_record(run_dir: Path) -> dict | None:
    """The earliest error a rank of the run recorded (the others' errors follow from it, e.g. a peer that left
    mid-collective), or ``None``."""
    records = []
    for path in run_dir.glob("error-rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"]) if records else None


def _first_failure(run_dir: Path, failures: dict[int, int], nproc: int) -> str:
    """The line that explains a failed run (``failures``: the exit code of each local rank that failed): a rank
    killed by a signal (the out-of-memory killer's, say: it records nothing, and the others' errors follow from it),
    else the earliest error a rank recorded, else the first failed rank's exit code."""
    killed = sorted(rank for rank, code in failures.items() if code < 0)
    if killed:
        rank = killed[0]
        try:
            name = signal.Signals(-failures[rank]).name
        except ValueError:
            name = f"signal {-failures[rank]}"
        why = " (out of memory, or killed from outside)" if name == "SIGKILL" else ""
        return f"rank {rank} exited with code {failures[rank]}: killed by {name}{why}; the other ranks were stopped"
    first = _earliest_record(run_dir)
    if first is not None:
        if first["type"] in USER_ERRORS:
            return first["message"]
        kept = _keep_traceback(first)
        return f"{first['message']} ({first['type']} on rank {first['rank']}; traceback in {kept})"
    rank = min(failures)
    kept = _keep_logs(run_dir)
    return (f"rank {rank} exited with code {failures[rank]} ({len(failures)} of {nproc} local ranks failed) "
            f"without an error message; the ranks' output is in {kept}")


def _kept(name: str) -> Path:
    """Where something of a failed run is kept after its run folder is gone: ``$DITMESH_CACHE/logs/<time>-<name>``."""
    from .models import cache_dir

    return cache_dir() / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


def _keep_logs(run_dir: Path) -> str:
    """Copy the ranks' output of a run that failed without an error record where it outlives the run folder."""
    target = _kept("run")
    try:
        shutil.copytree(run_dir / "logs", target)
    except OSError:
        return "the ranks' consoles"
    return str(target)


def _keep_traceback(record: dict) -> str:
    """Copy an unexpected error's traceback where it outlives the run folder; returns the path."""
    path = _kept(f"error-rank{record['rank']}.txt")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record["traceback"])
    except OSError:
        return "the rank's output"
    return str(path)


#: the name ``bench`` launches its workers with
launch_local = launch
