"""Start the replicas, then serve HTTP on the bound socket until interrupted; the ranks go with the front end."""

from __future__ import annotations

import signal
import sys
import threading
import time


def serve(args, world: int, config, model: str, limits, adapter, sock) -> int:
    """Start ``args.replicas`` groups of ``world`` ranks (in parallel), wait until each has loaded and warmed
    up, then answer HTTP on ``sock``. Returns the exit code (a replica that cannot start is a one-line error)."""
    import uvicorn

    from ..runtime.launch import LaunchError
    from .app import Service, create_app
    from .replica import RankFault, Replica

    import os

    # a service stops on Ctrl-C and on SIGTERM, also when a shell started it in the background (SIGINT then arrives
    # ignored, and children inherit that): until uvicorn takes both over for its graceful shutdown, each raises
    # KeyboardInterrupt here, which stops the replicas' ranks
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # as the launcher does: the CPU threads of this machine shared by all ranks of all replicas
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (world * args.replicas))))
    options = {k: v for k, v in vars(args).items() if k not in ("func", "argv", "token")}
    if args.ray:  # the replicas on a Ray cluster (ray_backend.py), the front door here
        from .ray_backend import ray_service

        replicas, service_class = ray_service(args, world, options)
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

    threads = [threading.Thread(target=start, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        for r in replicas:
            r.stop()
        raise
    if errors:
        for r in replicas:
            r.stop()
        raise LaunchError(errors[0])
    service = service_class(replicas, limits, args, adapter, queue_size=args.queue_size,
                            restart_attempts=args.restart_attempts, max_batch=args.max_batch)
    service.start()
    host, port = sock.getsockname()[:2]
    print(f"ditmesh: serving {model} on http://{host}:{port} ({args.replicas} replica(s) of {config.describe()} "
          f"on {world} process(es); ready in {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(service, args.token), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
    return 0
