"""Start the replicas, then serve HTTP on the bound socket until Ctrl-C or SIGTERM; the ranks go with the front end.

A stop is quiet and complete: every waiting and running request is answered 503 with its id, the ranks are
stopped (they ignore the terminal's SIGINT: ``replica.py``), each named on one line of the log, and the process
exits 0 with no traceback and nothing left behind (processes, queues' semaphores).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def serve(args, world: int, config, model: str, limits, adapter, sock, early: list | None = None) -> int:
    """Start ``args.replicas`` groups of ``world`` ranks (in parallel; ``early``: replicas whose ranks were
    prestarted, sent their options here), wait until each has loaded and warmed up, then answer HTTP on ``sock``.
    Returns the exit code (a replica that cannot start is a one-line error)."""
    import uvicorn

    from ..runtime.launch import LaunchError
    from ..shared import share_cpu_threads
    from ..timeline import timeline
    from .app import CALIBRATE_IDLE_S, Service, create_app, describe_batching
    from .replica import RankFault, Replica

    stop_on_signals()
    share_cpu_threads(os.environ, world * args.replicas)  # as the launcher does: all ranks of all replicas
    options = {k: v for k, v in vars(args).items() if k not in ("func", "argv", "token")}
    if args.ray:  # the replicas on a Ray cluster (ray_backend.py), the front door here
        from .ray_backend import ray_service

        replicas, service_class = ray_service(args, world, options)
    elif early:
        replicas = early
        for replica in replicas:
            replica.options = options
        service_class = Service
    else:
        replicas = [Replica(i, world, options, args.step_timeout, args.load_timeout) for i in range(args.replicas)]
        service_class = Service
    t0 = time.perf_counter()
    errors = []

    def start(replica):
        try:
            replica.start()
        except RankFault as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=start, args=(r,), daemon=True) for r in replicas]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        _ignore_signals()  # a second Ctrl-C must not cut the stop short
        _say_stopped([(r.index, *rank) for r in replicas for rank in r.close()], "while starting")
        return 0
    if errors:
        for r in replicas:
            r.close()
        raise LaunchError(errors[0])
    max_batch, batching = batch_policy(args.max_batch, args.batching, [r.batching for r in replicas])
    service = service_class(replicas, limits, args, adapter, queue_size=args.queue_size,
                            restart_attempts=args.restart_attempts, max_batch=max_batch,
                            unavailable_timeout_s=args.unavailable_timeout,
                            measure_batching=args.batching == "auto")
    service.batching = batching
    service.start()
    from ..shared import freeze_heap

    freeze_heap()  # what start-up imported and built serves to the end: a request's full collections skip it
    host, port = sock.getsockname()[:2]
    print(f"ditmesh: serving {model} on http://{host}:{port} ({args.replicas} replica(s) of {config.describe()} "
          f"on {world} process(es); ready {timeline().now():.1f} s after launch, {time.perf_counter() - t0:.1f} s of "
          f"it after the checks)" + (f"; {describe_batching(max_batch, batching)}" if batching else "")
          + (f"; batching up to {max_batch} pictures a call where a measurement finds it pays, measured once the "
             f"service is idle for {CALIBRATE_IDLE_S:g} s (one request a call until then)"
             if service.measure_batching else ""),
          file=sys.stderr, flush=True)
    server = _Server(service, uvicorn.Config(create_app(service, args.token), log_level="warning", access_log=False,
                                             timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a signal before the HTTP server took them over, or after it gave them back
        service.shutdown("interrupted")
    finally:
        _ignore_signals()
        _say_stopped(service.stop(), f"on {server.reason}" if server.reason else "")
    return 0


def batch_policy(max_batch: int, policy: str, measured: list) -> tuple[int, dict | None]:
    """The most pictures a call may hold from ``--max-batch``, ``--batching`` and each replica's start-up
    measurement (``worker._measure_batching``: seconds of a whole call by batch size; ``always`` alone measures at
    start-up): ``always``: ``max_batch``; ``auto``: ``max_batch`` as the bound of what each replica's own measurement,
    made while the service is idle (``app.Service._calibrate``), chooses. Returns it and the start-up measurement the
    start-up line and /metrics show (the first replica's, with ``policy``), None without one."""
    measured = [m for m in measured if m]
    if max_batch <= 1:
        return 1, None
    return max_batch, (dict(measured[0], policy=policy) if measured else None)


def stop_on_signals() -> None:
    """A service stops on Ctrl-C and on SIGTERM, also when a shell started it in the background (SIGINT then arrives
    ignored, and children inherit that): until the HTTP server takes both over, each raises KeyboardInterrupt, which
    stops the replicas' ranks."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server whose first Ctrl-C or SIGTERM answers every open request 503 (then uvicorn sends those
        answers and closes); the signal is not raised again once the server is down (uvicorn does by default, which
        would end the process with a traceback)."""

        def __init__(self, service, config):
            super().__init__(config)
            self.service, self.reason, self.answered = service, "", 0

        def handle_exit(self, sig, frame):
            if not self.reason:
                self.reason = signal.Signals(sig).name
                self.answered = self.service.shutdown(self.reason)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


def _Server(service, config):  # noqa: N802  (a class built when uvicorn is imported)
    return _server_class()(service, config)


def _say_stopped(stopped: list[tuple[int, int, int, int | None]], why: str) -> None:
    """One line per rank stopped."""
    for replica, rank, pid, code in stopped:
        print(f"ditmesh: stopped rank {rank} of replica {replica} (pid {pid}, exit code {code})"
              + (f" {why}" if why else ""), file=sys.stderr, flush=True)
