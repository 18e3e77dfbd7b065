"""The ``serve`` command: the options of ``generate`` (the same definitions and checks), the address, the token
and the limits of one request; everything is checked before a rank starts."""

from __future__ import annotations

import math
import os
import sys

#: where the bearer token may come from instead of ``--token`` (kept out of the process list)
TOKEN_ENV = "DITMESH_SERVE_TOKEN"


def add_serve_parser(sub) -> None:
    """Add ``ditmesh serve`` to the sub-command parsers (imports neither torch nor diffusers)."""
    from ..cli import _finite_float, _positive_int, add_run_options

    def _non_negative_int(text: str) -> int:
        return 0 if text.strip() == "0" else _positive_int(text)

    s = sub.add_parser(
        "serve", help="serve a pipeline over HTTP, loaded once on its ranks (OpenAI-shaped API, a web page)",
        description="Load a pipeline once on --nproc ranks per replica, parallelize and warm it up, then answer "
                    "HTTP requests: POST /v1/images/generations, POST /generate, GET /health, GET /metrics, and a "
                    "web page at /. The generation options below are the defaults of every request.")
    add_run_options(s)
    s._option_string_actions["--nproc"].help = ("ranks of one replica (default: the product of the degrees); with "
                                                 "--dp, of all replicas")
    s._option_string_actions["--dp"].help = ("N replicas, each its own group with dp = 1 (as --replicas N); a "
                                              "request goes to a free one")
    group = s.add_argument_group("service")
    group.add_argument("--replicas", type=_positive_int, default=1, metavar="N",
                       help="independent groups of --nproc ranks, each its own process group; a request goes to a "
                            "free one (default 1)")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    group.add_argument("--token", default=None,
                       help=f"bearer token every API call must send (default: ${TOKEN_ENV}, else none)")
    group.add_argument("--max-pixels", type=_positive_int, default=2048 * 2048, metavar="N",
                       help="largest width x height a request may ask for (default 2048*2048)")
    group.add_argument("--max-steps", type=_positive_int, default=100, metavar="N", help="most steps (default 100)")
    group.add_argument("--max-frames", type=_positive_int, default=129, metavar="N",
                       help="most video frames (default 129)")
    group.add_argument("--max-n", type=_positive_int, default=4, metavar="N",
                       help="most pictures per request (default 4)")
    group.add_argument("--queue-size", type=_positive_int, default=64, metavar="N",
                       help="requests that may wait; more are answered 429 (default 64)")
    group.add_argument("--warmup-sizes", default=None, metavar="WxH,...",
                       help="sizes to warm up at start besides the default one (one step each): with --compile, "
                            "their kernels are compiled before the first client, e.g. 512x512,1024x768")
    group.add_argument("--step-timeout", type=_finite_float, default=60.0, metavar="S",
                       help="a rank that finishes no step (or sends no heartbeat) for S seconds is taken as hung: "
                            "the request fails and the replica restarts (default 60; loading and warm-up have "
                            "--load-timeout)")
    group.add_argument("--load-timeout", type=_finite_float, default=1800.0, metavar="S",
                       help="seconds a replica may take to load, compile and warm up (default 1800)")
    group.add_argument("--unavailable-timeout", type=_finite_float, default=60.0, metavar="S",
                       help="no replica able to serve for S seconds (each failed, restarting, or on a Ray cluster "
                            "waiting for a node with room): waiting and new requests are answered 503 naming why, "
                            "until one serves again (default 60)")
    group.add_argument("--max-batch", type=_positive_int, default=1, metavar="N",
                       help="waiting requests that differ only in prompt and seed (one picture each) run as one "
                            "pipeline call of up to N pictures (default 1: one request per call)")
    group.add_argument("--batching", choices=("auto", "always"), default="auto",
                       help="with --max-batch N > 1: auto (default): each replica, once the service is idle "
                            "for 2 s, warms up and times the batch shapes (a request that comes meanwhile stops it "
                            "and runs at once) and batches only up to the size whose picture came out cheapest, not "
                            "at all where no batch beat one picture a call (one request a call until it has "
                            "measured); always: every shape warmed up and timed before the service is ready, and "
                            "up to N whatever the measurement (said in the start-up line, the log and /metrics)")
    group.add_argument("--vae-tune", type=_vae_tunes, default=(), metavar="WAYS",
                       help="ways to speed up the VAE decode, comma-separated: cudnn (cuDNN picks its fastest "
                            "convolution per shape, timed at the warm-up), channels-last (the decoder's weights and "
                            "input in channels-last layout), compile (torch.compile of the decoder, compiled at the "
                            "warm-up); or off (the default). Each may change the pictures' last bits on a GPU, where "
                            "another kernel rounds differently")
    group.add_argument("--prompt-cache", type=_non_negative_int, default=16, metavar="N",
                       help="text encodings of the last N distinct prompts kept on the ranks: a prompt sent again is "
                            "not encoded again (default 16; 0: none)")
    group.add_argument("--restart-attempts", type=_positive_int, default=3, metavar="N",
                       help="a replica that fails N restarts in a row (retried after 1, 2, 4, ... s) is given up; "
                            "with every replica given up, requests are answered 503 (default 3)")
    from .ray_backend import add_ray_options

    add_ray_options(s)


#: the ways ``--vae-tune`` names (``worker.tune_vae``)
VAE_TUNES = ("cudnn", "channels-last", "compile")


def _vae_tunes(text: str) -> tuple[str, ...]:
    """``--vae-tune``: ``off`` or a comma-separated set of :data:`VAE_TUNES`."""
    import argparse

    ways = tuple(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    if ways == ("off",):
        return ()
    unknown = [w for w in ways if w not in VAE_TUNES]
    if unknown or not ways:
        raise argparse.ArgumentTypeError(f"{text!r}: give off, or some of {', '.join(VAE_TUNES)} comma-separated "
                                         f"(e.g. cudnn,channels-last)")
    return ways


def run_serve(args) -> int:
    """Check the options, start the replicas (load, parallelize, warm up) and serve until interrupted."""
    from ..config import AXIS_ORDER, ConfigError, require_extra
    from ..runtime import generate
    from ..runtime.models import read_adapter, read_defaults, read_family_facts
    from .requests import Limits

    for flag, value, example in (("--step-timeout", args.step_timeout, 60), ("--load-timeout", args.load_timeout, 1800),
                                 ("--unavailable-timeout", args.unavailable_timeout, 60)):
        if not value > 0:
            raise ConfigError(f"{flag} {value} must be > 0 seconds (e.g. {example})")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} must be between 0 and 65535")
    if args.dp > 1:  # a service runs data parallelism as replicas: independent groups, each with dp = 1
        if args.replicas > 1:
            raise ConfigError(f"--dp {args.dp} and --replicas {args.replicas} both ask for replicas (the service "
                              f"runs --dp as replicas); give one of them")
        if args.nproc and args.nproc % args.dp:
            raise ConfigError(f"--nproc {args.nproc} is not a multiple of --dp {args.dp} (with --dp, --nproc counts "
                              f"the ranks of all replicas)")
        args.replicas, args.nproc, args.dp = args.dp, args.nproc and args.nproc // args.dp, 1
    from .ray_backend import check_ray_options

    check_ray_options(args)
    world = args.nproc or math.prod(getattr(args, axis) for axis in AXIS_ORDER)
    if args.plan == "auto":
        if not args.nproc:
            raise ConfigError("--plan auto needs --nproc (the ranks of one replica)")
        generate.apply_auto_plan(args, world)
    if not args.prompt:
        args.prompt = ["a red circle at the top left on a white background"]  # the warm-up's prompt
    args.token = args.token or os.environ.get(TOKEN_ENV) or None
    # compiled kernels go to $DITMESH_CACHE/compile, read back by the next start of the same shape; set without
    # --compile too, so that nothing of torch's (its inductor folder) is left in the temporary folder
    generate.persist_compile_caches()
    options, model = generate.validate_arguments(args, world)  # torch-free
    # adapters with a name are chosen per request (none by default); those without stay on, as generate runs them
    args.lora_names = [lora.name for lora in options.loras if lora.name]
    if args.lora_names and options.fuse_lora:
        raise ConfigError(f"--fuse-lora fuses the adapters into the weights, but the named ones "
                          f"({', '.join(args.lora_names)}) are chosen per request; drop --fuse-lora, or the names")
    defaults = read_defaults(model)
    size = defaults.get("default_size") or [None, None]
    args.height, args.width = args.height or size[0], args.width or size[1]
    limits = Limits(args.max_pixels, args.max_steps, args.max_frames, args.max_n)
    # Every check that needs no torch runs before a rank starts, each refusal at once: the family's rules from the
    # registry's table, the server's own defaults against its limits, the warm-up sizes, the port, the front end's
    # packages
    generate.validate_family_early(args, options, model)
    _check_limits(limits, args, read_family_facts(model))
    sock = _bind(args.host, args.port)
    try:
        require_extra("ditmesh serve", "ray" if args.ray else "serve", ("fastapi", "uvicorn"), load=True)
        # The ranks start now and import torch and diffusers while this process runs the checks that need them
        # (the model's family); a refusal stops them and is the one-line error it was.
        print(f"ditmesh: bound http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
        early = _prestart(args, world)
    except BaseException:
        sock.close()
        raise
    try:
        generate.validate_family(args, options, model)
        adapter = read_adapter(model)
        _check_limits(limits, args, adapter)
        from .server import serve

        return serve(args, world, options.config, model, limits, adapter, sock, early=early)
    except BaseException as exc:
        stopped = [(r.index, *rank) for r in early for rank in r.close()]
        sock.close()
        if isinstance(exc, KeyboardInterrupt):
            from .server import _ignore_signals, _say_stopped

            _ignore_signals()
            _say_stopped(stopped, "while starting")
            return 0
        raise


def _check_limits(limits, args, family) -> None:
    """The server's own defaults against its limits, and ``--warmup-sizes`` (set as (height, width) pairs), for the
    model's ``family`` (its adapter, or the registry's torch-free facts; None for a hub id)."""
    from ..config import ConfigError
    from .requests import BadRequest, check_options

    try:
        check_options({}, limits, args, family)
        if args.frames is not None:
            check_options({"frames": args.frames}, limits, args, family)
    except BadRequest as exc:
        raise ConfigError(f"the server's own defaults break its limits: {exc}") from None
    sizes = args.warmup_sizes if isinstance(args.warmup_sizes, list) else (args.warmup_sizes or "").split(",")
    args.warmup_sizes = [size if isinstance(size, tuple) else _size(size, limits, args, family) for size in sizes
                         if size]


def _prestart(args, world: int) -> list:
    """The replicas of a service on this host, their rank processes started without options
    (:meth:`Replica.prestart`); none for a Ray service (its actors start on the cluster)."""
    if args.ray:
        return []
    from .replica import Replica
    from ..shared import share_cpu_threads
    from .server import stop_on_signals

    stop_on_signals()
    share_cpu_threads(os.environ, world * args.replicas)  # as the launcher does: all ranks of all replicas
    replicas = [Replica(i, world, {}, args.step_timeout, args.load_timeout) for i in range(args.replicas)]
    for replica in replicas:
        replica.prestart()
    return replicas


def _size(text: str, limits, defaults, adapter) -> tuple[int, int]:
    """``WxH`` of ``--warmup-sizes`` as (height, width), checked as a request's size is."""
    from ..config import ConfigError
    from .requests import BadRequest, openai_options

    try:
        options = openai_options({"prompt": "x", "size": text.strip()}, limits, defaults, adapter)
    except BadRequest as exc:
        raise ConfigError(f"--warmup-sizes {text}: {exc}") from None
    return options["height"], options["width"]


def _bind(host: str, port: int):
    """The listening socket, bound before any rank starts (a port in use is said at once)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); give --host an address of this "
                      "machine (e.g. 127.0.0.1, or 0.0.0.0 for every interface) and a free --port (0: any)") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock

