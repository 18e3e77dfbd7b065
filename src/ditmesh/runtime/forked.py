"""Local ranks forked from one process that imported torch, diffusers and ditmesh once.

A rank that is its own ``python -m ditmesh`` imports torch, transformers and diffusers itself: about 8 CPU-seconds
each, paid N times by a run of N ranks (and again by every ``bench`` row). The local launcher starts one *zygote*
instead, ``python -m ditmesh.runtime.forked SPEC``, which imports them once (:data:`PRELOAD`, touching no device
and starting no process group), then forks the N ranks. Each rank takes its ``RANK`` and ``LOCAL_RANK``, its output
(local rank 0 keeps the console, the others write to the run's folder), and runs ``ditmesh.__main__`` as
``python -m ditmesh`` would (which sets a launched rank's signals), leaving with ``os._exit``.

The zygote writes each rank's pid to a pipe as it forks it and then leaves. While it lives, the launcher is a
*child subreaper* (Linux ``prctl``): the ranks the zygote leaves behind become the launcher's own children, so it
waits for them, reads their exit codes and signals them as it would processes it started itself
(:class:`AdoptedRank`). SIGINT and SIGTERM are ignored in the zygote from its first fork until it leaves, so every
rank it forks has its pid written; stopped while it imports, it dies at once and has forked nothing.

A zygote that fails to import writes its error as rank 0's record and exits 2, as a rank would; one that ends
after forking some of the ranks but not all is the run's error (:meth:`Zygote.adopt`). ``DITMESH_LAUNCH=exec``
(or a platform without ``prctl``) starts every rank as its own interpreter instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

#: set to ``exec`` to start every local rank as its own interpreter (each importing everything itself)
LAUNCH_ENV = "DITMESH_LAUNCH"
#: what the zygote imports before it forks (and ``serve``'s fork server): everything a rank of ``generate``,
#: ``bench``, ``analyze`` or ``serve`` needs before its model's own modules (ditmesh first: it quiets torchao's logger)
PRELOAD = ("ditmesh", "torch", "torch.distributed", "diffusers", "transformers", "ditmesh.models", "ditmesh.api",
           "ditmesh.runtime.generate")
#: set in a forked rank: when the zygote's imports began and ended (seconds since the epoch, ``START END``), so that
#: the rank's timeline shows them
IMPORTS_ENV = "DITMESH_ZYGOTE_IMPORTS"

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _subreaper(on: bool) -> bool | None:
    """Make this process the child subreaper of its descendants (or stop being one). Returns whether it was one
    before, or None where it cannot be made one."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
            return None
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return bool(was.value)
    except (OSError, AttributeError):
        return None


def wanted() -> bool:
    """Whether local ranks are forked from a zygote (``DITMESH_LAUNCH`` unset or ``fork``, and the platform can adopt
    them); any other value than ``fork`` or ``exec`` is refused."""
    way = os.environ.get(LAUNCH_ENV, "fork")
    if way not in ("fork", "exec"):
        from ..config import ConfigError

        raise ConfigError(f"{LAUNCH_ENV}={way!r}: give fork (the default: ranks forked from one import) or exec "
                          "(each rank its own interpreter)")
    return way == "fork" and sys.platform.startswith("linux")


class AdoptedRank:
    """A rank forked by the zygote and adopted by this process: the part of :class:`subprocess.Popen` the launcher
    uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours after all: it can only be known gone
                self.returncode = 0 if not os.path.exists(f"/proc/{self.pid}") else None
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's side of one zygote: started by :meth:`start`, its ranks taken in by :meth:`adopt`."""

    def __init__(self, process: subprocess.Popen, read_fd: int, nproc: int, was_subreaper: bool):
        self.process = process
        self.read_fd = read_fd
        self.nproc = nproc
        self.was_subreaper = was_subreaper
        self._buffer = b""

    @classmethod
    def start(cls, nproc: int, argv: list[str], env: dict, run_dir, preexec_fn) -> Zygote | None:
        """Start the zygote of a run of ``nproc`` ranks (``env``: theirs, without RANK); ``None`` where this process
        cannot adopt its ranks (then the caller starts them itself)."""
        was = _subreaper(True)
        if was is None:
            return None
        read_fd, write_fd = os.pipe()
        spec = json.dumps({"nproc": nproc, "argv": argv, "run_dir": str(run_dir), "fd": write_fd})
        try:
            process = subprocess.Popen([sys.executable, "-m", "ditmesh.runtime.forked", spec], env=env,
                                       pass_fds=(write_fd,), preexec_fn=preexec_fn)
        except BaseException:
            os.close(read_fd)
            _subreaper(was)
            raise
        finally:
            os.close(write_fd)
        return cls(process, read_fd, nproc, was)

    def _read(self, timeout: float) -> bool:
        """Read what the zygote wrote within ``timeout`` seconds; True at the end of its pipe."""
        poller = select.poll()
        poller.register(self.read_fd, select.POLLIN)
        if not poller.poll(max(0.0, timeout) * 1000):
            return False
        chunk = os.read(self.read_fd, 4096)
        self._buffer += chunk
        return not chunk

    def _pids(self) -> list[int]:
        return [int(p) for p in self._buffer.decode().split()]

    def adopt(self, procs: list, deadline: float | None) -> bool:
        """Wait for the zygote to import and fork, then put its ranks in place of it in ``procs`` (it stays there if
        it forked none: it failed, and its exit code is the run's). False when ``deadline`` (monotonic) passed
        first, the zygote still in ``procs`` (the caller asks it for its stacks, then calls :meth:`close`).
        Interrupted (Ctrl-C, a signal's exception), the zygote is stopped and the ranks it forked are put in
        ``procs`` before the exception goes on, so that the caller stops them."""
        procs[:] = [self.process]
        try:
            while not self._read(0.1 if deadline is None else min(0.1, deadline - time.monotonic())):
                if deadline is not None and time.monotonic() > deadline:
                    return False
        except BaseException:
            self.close(procs)
            raise
        self.close(procs)
        started = len(procs) if procs and procs[0] is not self.process else 0
        if 0 < started < self.nproc:  # it died while forking: the ranks it started wait for peers that never come
            from .launch import LaunchError

            raise LaunchError(f"the process the ranks are forked from ended (exit code {self.process.returncode}) "
                              f"after starting {started} of {self.nproc} ranks")
        return True

    def close(self, procs: list, grace_s: float = 10.0) -> None:
        """Stop the zygote if it still runs (importing: it dies; forking: it forks every rank, then leaves; killed
        after ``grace_s``), wait for it, and put the ranks it forked in ``procs``. Once; a later call does
        nothing."""
        if self.read_fd is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # gone: its ranks are this process's children now; the pipe's end comes with the zygote's (its ranks
        # closed their copies), or, should something else hold it, the pids written by then are taken
        deadline = time.monotonic() + grace_s
        while not self._read(0.1) and time.monotonic() < deadline:
            pass
        pids = self._pids()
        if pids:
            procs[:] = [AdoptedRank(pid) for pid in pids]
        os.close(self.read_fd)
        self.read_fd = None
        _subreaper(self.was_subreaper)


# -- in the zygote -----------------------------------------------------------------------------------------------
def _main(spec: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # stopped while importing: it dies at once, with nothing forked
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher's time limit: where the imports were
    from ..shared import imports_without_gc, quiet_libraries
    from .launch import run_rank

    write_fd, argv, run_dir = spec["fd"], spec["argv"], spec["run_dir"]
    os.set_inheritable(write_fd, False)  # a process an import starts must not hold the pipe open
    quiet_libraries()
    started = time.time()
    try:
        with imports_without_gc():  # frozen before the fork, too: the ranks' collections skip what they share
            _preload()
    except BaseException as exc:  # noqa: BLE001  (every rank would have had it: rank 0's error, reported once)
        failure = exc
        os.environ["RANK"] = "0"
        run_rank(lambda: _raise(failure))
    os.environ[IMPORTS_ENV] = f"{started} {time.time()}"
    sys.stdout.flush()
    sys.stderr.flush()
    # from the first fork on, a stop must not end this process before every rank it forked has its pid written:
    # ignored (for every thread: torch's idle one too) and blocked; each rank takes both back
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    forked = []
    import warnings

    filters = warnings.filters[:]
    warnings.filterwarnings("ignore", message=".*use of fork.*", category=DeprecationWarning)  # torch's idle thread
    for rank in range(spec["nproc"]):
        try:
            pid = os.fork()
        except OSError as exc:
            for p in forked:
                os.kill(p, signal.SIGKILL)
            os.environ["RANK"] = "0"
            message = f"could not start local rank {rank}: {exc.strerror}"
            run_rank(lambda: _raise(OSError(message)))
        if pid == 0:
            os.close(write_fd)
            warnings.filters[:] = filters  # the rank's own forks warn as they would
            _rank(rank, argv, run_dir)
        forked.append(pid)
        os.write(write_fd, f"{pid}\n".encode())
    os._exit(0)


def _raise(exc: BaseException):
    raise exc


#: set while the ranks' modules are imported before a fork: a ``torch.cuda.is_available()`` at import time asks NVML,
#: not the CUDA driver, whose state a forked child could not use (torch's own switch)
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _preload() -> None:
    import importlib
    import warnings

    given = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in PRELOAD:
                importlib.import_module(name)
    finally:
        if given is None:
            del os.environ[NVML_CHECK_ENV]
        else:
            os.environ[NVML_CHECK_ENV] = given
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized while the ranks' modules were imported, before their fork; start "
                           f"the ranks as their own interpreters: {LAUNCH_ENV}=exec")


def _rank(rank: int, argv: list[str], run_dir: str) -> None:
    """The body of a forked rank: never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
        if rank:  # local rank 0 keeps the console (progress bar, result line)
            fd = os.open(os.path.join(run_dir, "logs", f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                         0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        from .. import timeline as timeline_module

        timeline_module._TIMELINE = None  # this process's own, from its fork
        start, end = (float(t) for t in os.environ.pop(IMPORTS_ENV).split())
        line = timeline_module.timeline()
        line.add("shared imports", start - line.origin_unix, end - line.origin_unix, depth=1)
        sys.argv = ["ditmesh", *argv]
        import runpy

        runpy.run_module("ditmesh", run_name="__main__", alter_sys=True)  # what `python -m ditmesh ARGV` runs
        code = 0
    except SystemExit as exc:  # as the interpreter treats it: a number is the exit code, anything else is printed
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (run_rank reports a command's errors; this is what is left)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
