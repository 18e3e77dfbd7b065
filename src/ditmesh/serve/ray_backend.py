"""``ditmesh serve --ray ADDRESS|auto``: the service's replicas on a Ray cluster (``ray_replica.py``: a placement
group per replica, an actor per rank), its front door in this process.

The front door is the single-host service's own (``app.py``: the HTTP API, the web page, ``/metrics``, the queue,
cancellation, progress events), routing through Ray actor handles, rather than Ray Serve. A replica here is a group
of N actors that must form one torch.distributed group, start together and die together; Ray Serve's unit is one
actor per replica behind its own HTTP proxy and router, so a group would hide behind one actor anyway, and the
queue, the job states that ``GET /jobs/<id>`` and the progress events read, cancellation of a running request and
the retry rule would have to be rebuilt across its proxy. With our front door a client sees one service, the same
on one host and on a cluster, and the cluster adds no HTTP hop and no extra package (``ray`` alone, no
``ray[serve]``). The cost: the front door is one process (as on one host); put it behind a load balancer of its own
to run several.
Routing and scaling: ``ray_scaling.py``.
"""

from __future__ import annotations

import functools


def add_ray_options(parser) -> None:
    """The ``serve`` options of a Ray cluster (imports nothing heavy)."""
    from ..cli import _finite_float, _positive_int

    group = parser.add_argument_group("Ray cluster (pip install 'ditmesh[ray]'; docs/ray.md)")
    group.add_argument("--ray", default=None, metavar="ADDRESS|auto",
                       help="run the replicas on the Ray cluster at ADDRESS (HOST:PORT of its head, or auto: the one "
                            "`ray start` runs on this machine): each replica a placement group on one node, one actor "
                            "per rank; this process is the front door")
    group.add_argument("--min-replicas", type=_positive_int, default=None, metavar="N",
                       help="with --ray: replicas kept running however idle (default: --replicas)")
    group.add_argument("--max-replicas", type=_positive_int, default=None, metavar="N",
                       help="with --ray: replicas started while requests wait (default: --min-replicas)")
    group.add_argument("--scale-down-idle", type=_finite_float, default=60.0, metavar="S",
                       help="with --ray: a replica above --min-replicas that served nothing for S seconds while no "
                            "request waits is stopped (default 60)")
    group.add_argument("--ray-cpus-per-rank", type=_finite_float, default=1.0, metavar="C",
                       help="with --ray: CPUs each rank reserves on its node (default 1; on GPU nodes each rank also "
                            "takes one GPU)")


def check_ray_options(args) -> None:
    """Check the Ray options before anything loads (ConfigError, one line); with --ray fill ``min_replicas`` and
    ``max_replicas`` and set ``replicas`` to the number started first."""
    from ..config import ConfigError, require_extra

    if args.ray is None:
        for flag, value in (("--min-replicas", args.min_replicas), ("--max-replicas", args.max_replicas)):
            if value is not None:
                raise ConfigError(f"{flag} {value} scales replicas on a Ray cluster: add --ray ADDRESS (or --ray auto), "
                                  f"or use --replicas N on this machine")
        return
    if args.ray != "auto":
        host, _, port = args.ray.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--ray {args.ray} must be HOST:PORT of the cluster's head (e.g. 10.0.0.1:6379) or auto")
    require_extra("--ray", "ray", ("ray",))
    if args.min_replicas is not None and args.replicas > 1 and args.min_replicas != args.replicas:
        raise ConfigError(f"--replicas {args.replicas} and --min-replicas {args.min_replicas} disagree; with --ray give "
                          f"--min-replicas (and --max-replicas)")
    args.min_replicas = args.min_replicas or args.replicas
    args.max_replicas = args.max_replicas or args.min_replicas
    if args.max_replicas < args.min_replicas:
        raise ConfigError(f"--max-replicas {args.max_replicas} is below --min-replicas {args.min_replicas}")
    if not args.scale_down_idle > 0:
        raise ConfigError(f"--scale-down-idle {args.scale_down_idle} must be > 0 seconds (e.g. 60)")
    if not args.ray_cpus_per_rank > 0:
        raise ConfigError(f"--ray-cpus-per-rank {args.ray_cpus_per_rank} must be > 0 (e.g. 1, or 0.5 to put two ranks "
                          f"on one CPU)")
    args.replicas = args.min_replicas


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` as its driver (ConfigError when none answers)."""
    import ray

    from ..config import ConfigError
    from ..shared import one_line

    if address != "auto":  # Ray itself retries an address that does not answer for minutes: ask once first
        import socket

        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
        except OSError as exc:
            raise ConfigError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); start one with "
                              f"`ray start --head` and give its HOST:PORT, or auto on one of its nodes") from None
    try:
        ray.init(address=address, namespace="ditmesh", log_to_driver=False, logging_level="warning",
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--ray {address}: no Ray cluster answers ({one_line(exc)}); start one with `ray start "
                          f"--head` and give its address, or auto on one of its nodes") from None


def rank_bundle(world: int, cpus_per_rank: float) -> dict:
    """One rank's resources: a GPU (and CPUs) where the cluster has GPUs, else CPUs; ConfigError when no node of
    the cluster could ever hold ``world`` of them."""
    import ray

    from ..config import ConfigError

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    has_gpus = any(n["Resources"].get("GPU", 0) for n in nodes)
    bundle = {"CPU": cpus_per_rank, **({"GPU": 1} if has_gpus else {})}
    if not any(all(n["Resources"].get(k, 0) >= v * world for k, v in bundle.items()) for n in nodes):
        sizes = ", ".join(sorted({f"{n['Resources'].get('GPU', 0):g} GPU / {n['Resources'].get('CPU', 0):g} CPU"
                                  for n in nodes})) or "none"
        raise ConfigError(f"no node of the Ray cluster holds a replica of {world} rank(s) x {bundle} (its nodes: "
                          f"{sizes}); ask for fewer ranks per replica (--nproc / the degrees), or lower "
                          f"--ray-cpus-per-rank")
    return bundle


def ray_service(args, world: int, options: dict):
    """Connect to the cluster; returns the first replicas (not started) and the Service class to build with them
    (a :class:`RayService` that scales between ``--min-replicas`` and ``--max-replicas``)."""
    from .ray_replica import RayReplica
    from .ray_scaling import RayService

    connect(args.ray)
    bundle = rank_bundle(world, args.ray_cpus_per_rank)
    new_replica = functools.partial(RayReplica, world=world, options=options, step_timeout=args.step_timeout,
                                    load_timeout=args.load_timeout, bundle=bundle)
    replicas = [new_replica(index=i) for i in range(args.min_replicas)]
    return replicas, functools.partial(RayService, new_replica=new_replica, min_replicas=args.min_replicas,
                                       max_replicas=args.max_replicas, scale_down_idle_s=args.scale_down_idle)
