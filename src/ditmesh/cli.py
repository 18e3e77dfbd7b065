"""The ``ditmesh`` command: ``generate``, ``serve``, ``synth``, ``bench``, ``plan``, ``train-tiny``, ``eval-tiny``.

Errors a user can fix are printed as ONE line on stderr (``ditmesh: error: ...``) with exit code 2;
nothing is half-written (outputs are written to temporary files and renamed).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .config import AXIS_HELP, AXIS_ORDER, ConfigError
from .shared import one_line
from .shared import add_quant_flags, quiet_libraries, share_cpu_threads, strip_option


def add_degree_flags(parser: argparse.ArgumentParser) -> None:
    """The degree flags --dp --cfg --pp --ring --ulysses --tp, one line of help each."""
    group = parser.add_argument_group(
        "parallel degrees", "their product must equal the number of processes (--nproc, or torchrun's world size)"
    )
    for axis in AXIS_ORDER:
        group.add_argument(f"--{axis}", type=int, default=1, metavar="N", help=f"{AXIS_HELP[axis]} (default 1)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of one pipeline call and of the ranks that run it (model, request defaults, degrees,
    --nproc, compile, cache, LoRA): ``generate`` and ``serve`` share them."""
    parser.add_argument("--model", default=None, help="pipeline folder, hub id, or synthetic architecture name "
                                                      "(default: the embedded tiny pipeline)")
    parser.add_argument("--prompt", action="append", default=None, help="prompt (repeat for several)")
    parser.add_argument("--images-per-prompt", type=_positive_int, default=1, metavar="N",
                        help="images per prompt (default 1); with --dp they are spread over the data-parallel groups")
    parser.add_argument("--negative-prompt", default=None, help="negative prompt (with --true-cfg-scale > 1, turns on CFG where the family uses true CFG)")
    parser.add_argument("--true-cfg-scale", type=_finite_float, default=4.0, help="true CFG scale used with --negative-prompt (default 4.0)")
    parser.add_argument("--height", type=int, default=None, help="image height, multiple of 16 (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="image width, multiple of 16 (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, metavar="N",
                        help="video pipelines: frames to generate (default: the model's; the family's frame rule applies, e.g. 4k+1); writes a video")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps (default 28)")
    parser.add_argument("--guidance", type=_finite_float, default=3.5, help="guidance scale (default 3.5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    parser.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (default: the model's)")
    add_degree_flags(parser)
    parser.add_argument("--pp-patches", type=int, default=None, metavar="M",
                        help="PipeFusion (--pp > 1): cut the image (video) tokens into M patches, M >= pp (default: pp)")
    parser.add_argument("--pp-warmup", type=int, default=1, metavar="W",
                        help="PipeFusion: compute the first W steps of a run exactly (default 1, at least 1); later steps "
                             "read one-step-stale K/V for the patches not yet computed in the step (approximate)")
    parser.add_argument("--pp-chunk-mb", type=_positive_int, default=64, metavar="MB",
                        help="PipeFusion: the largest single point-to-point message in MiB (default 64); larger "
                             "activations travel in pieces")
    parser.add_argument("--displaced", action="store_true",
                        help="displaced patch parallelism over the --ulysses ranks: each rank attends to the other "
                             "ranks' K/V of the previous step, gathered while the step computes (approximate after the "
                             "warm-up; not with --ring, --pp, --cache)")
    parser.add_argument("--displaced-warmup", type=int, default=1, metavar="W",
                        help="--displaced: compute the first W steps of a run exactly (default 1, at least 1)")
    parser.add_argument("--plan", choices=["auto"], default=None,
                        help="auto: let `ditmesh plan` pick the degrees for the process count (leave the degree flags at 1)")
    parser.add_argument("--allow-stale", action="store_true",
                        help="with --plan auto: let it pick approximate modes (PipeFusion's and displaced attention's "
                             "stale K/V); off, it picks only exact ones")
    parser.add_argument("--nproc", type=_positive_int, default=None, metavar="N",
                        help="launch N local processes (default: run as one rank of an outer torchrun, or alone)")
    parser.add_argument("--lora", action="append", default=None, metavar="PATH[:SCALE]",
                        help="load a LoRA (a .safetensors file or folder in diffusers' or peft's format, or a hub id) with "
                             "weight SCALE (default 1.0); repeat for several. Loaded after parallelizing: under --tp each "
                             "rank keeps its shard of it")
    parser.add_argument("--fuse-lora", action="store_true",
                        help="with --lora: fuse the adapters (with their scales) into the weights and take peft's LoRA "
                             "layers out, so a step costs what the base model's does (under --tp, into each rank's "
                             "shard); the adapters cannot be switched afterwards")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every transformer block (regional; the first steps pay the compile time)")
    parser.add_argument("--compile-artifacts", default="off", metavar="MODE",
                        help="with --compile, the compiled blocks kept between processes (docs/usage.md): off "
                             "(default), save (a warm-up: each block class compiled whole and saved, without "
                             "inductor's cache), load (a later run or service runs them, tracing nothing)")
    parser.add_argument("--cache", default=None, metavar="POLICY",
                        help="step caching: default, fbcache:T, dbcache:threshold=T,first=F,last=B,..., teacache:threshold=T,"
                             "poly=..., static:skip=2-4+6, taylor:interval=N,warmup=W (decisions shared by every rank; "
                             "docs/caching.md). See `ditmesh analyze`")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay each transformer call from a CUDA graph (CUDA only; not with --dp/--cfg > 1 "
                             "or --check-consistency)")
    parser.add_argument("--transport", default="nccl",
                        help="how Ulysses all-to-alls travel: nccl (NCCL kernels), or symm (copy engines writing into the "
                             "peers' symmetric memory; CUDA GPUs of one host)")
    parser.add_argument("--vae-parallel", default="auto", metavar="MODE",
                        help="decode with the VAE split along height over the ranks, exact: auto (default: on with more "
                             "than one process; a size that cannot be split runs whole), on (an error instead), tiled "
                             "(diffusers' tiled decode, its tiles spread over the ranks; equals one process's tiled "
                             "decode), off")
    parser.add_argument("--chunk", default=None, metavar="TOKENS",
                        help="run each block's feed-forward on pieces of at most TOKENS tokens and its attention on "
                             "pieces of at most TOKENS queries (exact; caps the widest activations of long sequences), "
                             "or auto: sized from free GPU memory (default: whole)")
    parser.add_argument("--vae-chunk", default=None, metavar="ROWS",
                        help="decode with the VAE's residual blocks and up-samplers run on pieces of at most ROWS rows "
                             "of their input, with halo rows (exact; lowers the decode's peak memory on one GPU; "
                             "2-D KL VAEs), or auto: sized from free GPU memory (default: whole)")
    parser.add_argument("--comm-dtype", default=None, metavar="DTYPE",
                        help="sequence-parallel payloads: auto (default: the activations' dtype) or fp8 (Ulysses "
                             "all-to-alls and ring K/V as float8 with a scale per token and head; docs/quantization.md)")
    parser.add_argument("--attention", default=None, metavar="KERNEL",
                        help="default (exact), fp8 (Q, K, V and P in float8: cuDNN's fp8 attention, Hopper or newer, "
                             "pip install 'ditmesh[fp8]'), or fp8-emulated (its rounding in float32 math, slow); the "
                             "8-bit kernel runs on one GPU or under --ulysses alone")
    parser.add_argument("--attention-bf16-steps", type=int, default=None, metavar="W",
                        help="with an 8-bit --attention: the first and last W steps of a run attend exactly (default 0)")
    parser.add_argument("--check-consistency", action="store_true",
                        help="debug: verify every rank sees identical timesteps, latents and text embeddings each step")
    add_quant_flags(parser)
    parser.add_argument("--quant-backend", default=None, metavar="NAME",
                        help="with --quant, who does the 8-bit work: auto (default: on CUDA scaled-mm for fp8, torchao for the "
                             "weight-only modes), torchao, "
                             "scaled-mm (ditmesh's own layer, torch._scaled_mm on plain tensors), emulated")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit code 2, and no abbreviated options (a launcher strips
    options by their full name before it starts the ranks)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ditmesh`` parser; ``command`` names the sub-command whose own parser must be complete."""
    parser = _Parser(prog="ditmesh", description="Run diffusers DiT pipelines across many GPUs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate an image with a (parallel) diffusers pipeline",
                       description="Generate with a diffusers pipeline on one or more processes. Without --nproc, "
                                   "runs as one rank of an outer torchrun (multi-node included).")
    add_run_options(g)
    g.add_argument("--image", default=None, metavar="PATH",
                   help="condition image: runs the family's image-conditioned pipeline on the same checkpoint "
                        "(img2img by default, the checkpoint's own for an editing or fill checkpoint; see --image-mode); "
                        "for a video family, image-to-video with the image as the first frame")
    g.add_argument("--mask", default=None, metavar="PATH",
                   help="with --image: inpainting mask (white = repaint); picks the family's masked pipeline")
    g.add_argument("--strength", type=float, default=None, metavar="S",
                   help="with --image: how much of the schedule runs, in (0, 1] (1 = from noise; default: the "
                        "pipeline's, e.g. 0.6 for img2img)")
    g.add_argument("--image-mode", default=None, metavar="MODE",
                   help="with --image: the family's image pipeline by name (FLUX: img2img, kontext, inpaint, fill; video: i2v)")
    g.add_argument("--nnodes", type=_positive_int, default=1, metavar="M",
                   help="with --nproc: hosts in the run; start the same command on each (default 1)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --nnodes > 1: where the hosts meet (c10d rendezvous, as torchrun's); one host's address")
    g.add_argument("--rdzv-timeout", type=_positive_int, default=300, metavar="S",
                   help="seconds to wait for every host to join (default 300)")
    g.add_argument("--out", default=None, help="output path (default out/image.png; out/video.mp4 for video: "
                                               ".mp4 needs ditmesh[video], .gif and .png frames need nothing)")
    g.add_argument("--report", default=None, help="JSON report path (default: the output path + .json, e.g. out/image.png.json)")
    g.add_argument("--save-latents", default=None, metavar="FILE", help="save final latents (safetensors, key 'latents')")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="write the run's timeline (every rank's phases, from the command's start) as a Chrome trace "
                        "(JSON) that chrome://tracing or ui.perfetto.dev opens; the report has it too (key timeline)")
    g.add_argument("--warmup-only", action="store_true",
                   help="load, compile and run one step at this shape and configuration, then exit: later runs "
                        "of the same shape find their compiled kernels in the cache ($DITMESH_CACHE/compile)")

    s = sub.add_parser("synth", help="write a synthetic checkpoint (random weights, real architecture)")
    s.add_argument("--arch", default=None, help="architecture name (e.g. flux-tiny, flux-dev; --list names them all)")
    s.add_argument("--out", default=None, help="output folder (must not exist or be empty)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=None, help="device to initialize on (default: cuda if present, else cpu)")
    s.add_argument("--dtype", default=None, help="weights dtype (default: the architecture's; float32 for tiny ones)")
    s.add_argument("--list", action="store_true", help="print every architecture's name and description, then exit")
    s.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="instead of a pipeline, write a synthetic rank-RANK LoRA on every attention linear of --model's "
                        "transformer to --out/lora.safetensors (for generate --lora)")
    s.add_argument("--model", default=None, metavar="DIR", help="with --lora: the pipeline folder the LoRA adapts")

    for name, (module, add, run, help_text) in EXTRA_COMMANDS.items():
        if name == command:  # only the chosen command imports its module (and torch)
            mod = importlib.import_module(module, __package__)
            getattr(mod, add)(sub)
            sub.choices[name].set_defaults(func=getattr(mod, run))
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


#: commands whose parsers live in their own modules: name -> (module, add-parser function, run function, help).
#: ``--help`` and argument errors of other commands never import them.
EXTRA_COMMANDS = {
    "bench": (".bench", "add_bench_parser", "run_bench",
              "benchmark parallel configurations (per-step latency, memory, accuracy)"),
    "plan": (".planner.cli", "add_plan_parser", "run_plan",
             "predict memory, communication and latency of every configuration and recommend one"),
    "analyze": (".analyze", "add_analyze_parser", "run_analyze",
                "measure step-to-step redundancy per block (for step caching)"),
    "serve": (".serve", "add_serve_parser", "run_serve",
              "serve a pipeline over HTTP, loaded once on its ranks (OpenAI-shaped API, a web page)"),
    "quantize": (".quantize", "add_quantize_parser", "run_quantize",
                 "write a pipeline with 8-bit transformer weights, loaded without the originals"),
    "train-tiny": (".tiny.train", "add_train_parser", "run_train", "retrain the shipped tiny FLUX pipeline (resumable)"),
    "eval-tiny": (".tiny.evaluate", "add_eval_parser", "run_eval", "score the tiny pipeline on held-out captions"),
}


def _cmd_generate(args, argv: list[str]) -> int:
    from .runtime import generate
    from .timeline import phase

    if args.compile:
        generate.persist_compile_caches()  # before torch loads: inductor fixes its cache folder on first use
    if not args.prompt:
        args.prompt = ["a red circle at the top left on a white background"]
    if args.nnodes > 1 and not (args.nproc and args.rdzv_endpoint):
        raise ConfigError(f"--nnodes {args.nnodes} needs --nproc (processes per host) and --rdzv-endpoint HOST:PORT "
                          "(the address every host can reach)")
    world = args.nproc * args.nnodes if args.nproc else int(os.environ.get("WORLD_SIZE", "1"))
    if args.plan == "auto":
        config = generate.apply_auto_plan(args, world)
        argv = strip_option(argv, "--plan") + [f"--{a}={d}" for a, d in config.degrees().items()]
        if args.displaced and "--displaced" not in argv:  # the planner chose displaced attention (--allow-stale)
            argv.append("--displaced")
    with phase("checks"):
        options, model = generate.validate_arguments(args, world)  # torch-free: a bad value is refused at once
        from .runtime.launch import launched_rank

        if not launched_rank():  # the family's rules from the registry's table (the launcher checked them already)
            generate.validate_family_early(args, options, model)
    if args.nproc and "RANK" not in os.environ and args.nnodes == 1 and not args.rdzv_endpoint:
        # The launcher of a run on this host imports neither torch nor diffusers: the ranks (forked from one process
        # that imported them) run the family's checks themselves (a refusal is their first error, printed once); the
        # heads, a JSON file or a table away, are checked before any rank starts
        with phase("checks"):
            generate.validate_heads(options, model)
        return _launch(args, argv)
    if not args.nproc or "RANK" in os.environ:  # this process runs a rank: its imports are a phase of their own
        # the threads of every CPU path: this host's cores shared by its ranks (one process: all of them)
        share_cpu_threads(os.environ, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        from .shared import imports_without_gc

        with phase("imports"), imports_without_gc():
            import diffusers  # noqa: F401
            import torch  # noqa: F401
            from diffusers import DiffusionPipeline  # noqa: F401
    with phase("family checks"):
        generate.validate_family(args, options, model)
    if args.nproc and "RANK" not in os.environ:
        return _launch(args, argv)
    return generate.run(args)


def _launch(args, argv: list[str]) -> int:
    """Start the ranks of ``generate --nproc N`` (the command without the launcher's options)."""
    from .runtime.launch import launch

    child = argv
    for option in ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-timeout"):
        child = strip_option(child, option)
    return launch(args.nproc, child, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                  rdzv_timeout=args.rdzv_timeout)


def _cmd_synth(args) -> int:
    if args.list:  # from the registry's table: no family (nor torch) is imported
        from .models.registry import SYNTH

        width = max(len(name) for name in SYNTH)
        try:
            for name, (_, description) in sorted(SYNTH.items()):
                print(f"{name:<{width}}  {description}", flush=True)
        except BrokenPipeError:  # the reader went away (`ditmesh synth --list | head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.lora is None and args.arch is not None and args.out is not None:
        # what needs no model is checked before torch and diffusers are imported: a bad --arch or --out answers at once
        from .models.registry import check_arch
        from .shared import empty_output

        check_arch(args.arch)
        empty_output(args.out)
    from .synth import ARCHS, write_checkpoint, write_lora

    if args.lora is not None:
        if args.model is None or args.out is None or args.arch is not None:
            raise ConfigError("synth --lora RANK needs --model DIR (the pipeline it adapts) and --out DIR, and no --arch")
        path, linears = write_lora(args.model, args.lora, args.out, seed=args.seed)
        print(f"ditmesh: wrote a rank-{args.lora} LoRA on {linears} attention linears to {path}")
        return 0
    if args.arch is None or args.out is None:
        raise ConfigError("synth needs --arch NAME and --out DIR (ditmesh synth --list names the architectures)")
    path = write_checkpoint(args.arch, args.out, seed=args.seed, device=args.device, dtype=args.dtype)
    print(f"ditmesh: wrote {ARCHS[args.arch].name} checkpoint to {path}")
    return 0


def _interruptible() -> None:
    """Ctrl-C (SIGINT) stops a command also when a shell started it in the background, which starts it with SIGINT
    ignored: as ``serve`` does, the command takes SIGINT back as KeyboardInterrupt (its launcher then stops the
    ranks and exits 130)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ditmesh`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .timeline import timeline

    start = timeline()
    start.add("interpreter start", start.process_start_unix - start.origin_unix, start.now())
    quiet_libraries()
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    args.argv = argv  # the command as typed, for the tools that record it (bench)
    if args.command is None:
        parser.print_help()
        return 2
    from .runtime.launch import launched_rank, run_rank

    if launched_rank():  # a rank of our own launcher: its errors go to the launcher, once
        return run_rank(lambda: _dispatch(args, argv))
    _interruptible()
    try:
        return _dispatch(args, argv)
    except (ConfigError, OSError, NotImplementedError, ValueError) as exc:
        print(f"ditmesh: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C here, or the launcher's Interrupted (with the signal's code)
        return getattr(exc, "code", 130)
    except Exception as exc:  # noqa: BLE001
        from .runtime.launch import LaunchError

        if isinstance(exc, LaunchError):  # on a fresh line: a rank's progress bar may have been cut short
            print(f"\nditmesh: error: {one_line(exc)}", file=sys.stderr)
            return 2
        raise


def _dispatch(args, argv: list[str]) -> int:
    if args.command == "generate":
        return _cmd_generate(args, argv)
    if args.command == "synth":
        return _cmd_synth(args)
    return args.func(args)
