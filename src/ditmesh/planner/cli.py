"""``ditmesh plan`` command line: ``add_plan_parser(subparsers)`` and ``run_plan(args) -> int``."""

from __future__ import annotations

import argparse
import json
import sys


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``plan`` sub-command on an ``argparse`` subparsers object and return its parser."""
    from .hardware import DEVICES, LINKS

    p = subparsers.add_parser(
        "plan", help="rank parallel configurations by predicted step latency and memory",
        description="Predict step latency, per-GPU memory and communication of every valid parallel "
                    "configuration (dp, cfg, pp, ring, ulysses, tp) and recommend one.")
    p.add_argument("--model", default=None, help="a ditmesh synth architecture (e.g. flux-dev) or a checkpoint folder")
    p.add_argument("--height", type=int, default=None,
                   help="image height (default: a synthetic architecture's default size, else 1024)")
    p.add_argument("--width", type=int, default=None,
                   help="image width, or an audio architecture's latent samples (default: as --height)")
    p.add_argument("--frames", type=int, default=None,
                   help="video frames (the family's frame rule applies, e.g. 4k+1; default: a video architecture's "
                        "default, else 1)")
    p.add_argument("--batch", type=int, default=1, help="prompts per call")
    p.add_argument("--cfg", action="store_true", help="classifier-free guidance on (two branches per step)")
    p.add_argument("--gpus", type=int, default=None, help="total GPUs")
    p.add_argument("--nodes", type=int, default=1, help="hosts the GPUs are spread over (default 1)")
    p.add_argument("--device", default=None, help=f"GPU preset: {', '.join(DEVICES)} (default: the link's card, else h100)")
    p.add_argument("--link", default=None, help=f"link inside a node: {', '.join(LINKS)}, or custom")
    p.add_argument("--link-gbps", type=float, default=None, help="override the link bandwidth (GB/s per GPU per direction)")
    p.add_argument("--link-latency-us", type=float, default=None, help="override the latency per collective (us)")
    p.add_argument("--inter-link", default=None, help="link between nodes (default infiniband-ndr when --nodes > 1)")
    p.add_argument("--memory-gib", type=float, default=None, help="usable memory per GPU (default: the device's)")
    p.add_argument("--tflops", type=float, default=None, help="measured bf16 matrix TFLOP/s per GPU (ditmesh bench)")
    p.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--cuda-graph", action="store_true",
                   help="each transformer call replays from a CUDA graph (no host time; rules out dp, cfg and pp)")
    p.add_argument("--steps", type=int, default=28, help="denoising steps of the run (latency is per step; a PipeFusion row is a stale step, its exact warm-up step is exact_step_ms in --json)")
    p.add_argument("--chunk", type=int, default=None, metavar="TOKENS",
                   help="count the transformer with feed-forwards and attention in pieces (generate --chunk)")
    p.add_argument("--vae-parallel", default="auto", choices=("auto", "on", "tiled", "off"),
                   help="count the VAE decode as generate --vae-parallel runs it (default auto: split over the GPUs)")
    p.add_argument("--vae-chunk", type=int, default=None, metavar="ROWS",
                   help="count a whole VAE decode in pieces of ROWS rows (generate --vae-chunk)")
    p.add_argument("--pp-patches", type=int, default=None, metavar="M",
                   help="count PipeFusion with M patches (generate --pp-patches; default: pp, the runtime's)")
    p.add_argument("--displaced", action="store_true",
                   help="also rank displaced attention (stale K/V, approximate) on every ulysses configuration it runs on")
    from ..shared import add_quant_flags

    add_quant_flags(p)
    p.add_argument("--attention", default=None, metavar="KERNEL",
                   help="the run's attention kernel: with fp8 (cuDNN's kernel, counted faster on calls of 8,192 keys or "
                        "more, measured) its rows are ranked beside the exact ones; the 8-bit kernel "
                        "keeps the layouts it runs on (one GPU, ulysses, tp)")
    p.add_argument("--only", default=None, help="comma-separated axes the runtime implements, e.g. ulysses,cfg")
    p.add_argument("--top", type=int, default=20, help="rows to print (0 = all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--validate", nargs="+", default=None, metavar="RESULTS",
                   help="instead of planning: predict every ditmesh row of these `ditmesh bench` results and compare "
                        "(hardware from --device/--link, else each file's card)")
    p.add_argument("--holdout", action="store_true",
                   help="with --validate: also refit the implementation constants on part of the rows, score the rest")
    return p


def format_table(result, top: int = 20) -> str:
    """The ranked table and the recommendation as text."""
    s, hw = result.stats, result.hardware
    lines = [
        f"{s.spec.name} ({s.spec.transformer_class}, {s.params_total / 1e9:.2f}B params, "
        f"{s.total_flops / 1e12:.1f} TFLOP/step) at {s.width}x{s.height}"
        + (f"x{s.frames}f" if s.frames > 1 else "")
        + f": {s.layout.split_tokens} tokens; {hw.gpus}x {hw.device.name} ({hw.usable_gib:.1f} GiB), {hw.intra.name}"
        + (f", {hw.nodes} nodes over {hw.inter.name}" if hw.nodes > 1 and hw.inter else "")
        + f", {result.workload.mode}" + (" + CUDA graph" if result.workload.cuda_graph else ""),
        "",
        f"{'#':>3}  {'config':<28} {'step ms':>9} {'speedup':>8} {'GiB/GPU':>8} {'comm MB':>9}  fits",
    ]
    rows = result.predictions if top <= 0 else result.predictions[:top]
    for i, p in enumerate(rows, 1):
        ms = f"{p.effective_ms:9.1f}"
        lines.append(f"{i:>3}  {p.describe():<28} {ms} {p.speedup:7.2f}x {p.memory['total']:8.1f} "
                     f"{p.comm_bytes['total'] / 1e6:9.0f}  {p.fits}")
    if len(rows) < len(result.predictions):
        lines.append(f"     ... {len(result.predictions) - len(rows)} more (--top 0 shows all)")
    for why, configs in result.refused.items():  # what the family does not run, not ranked
        lines.append(f"     left out ({len(configs)}: {', '.join(configs[:3])}{', ...' if len(configs) > 3 else ''}): "
                     f"{why}")
    lines += ["", f"recommended: {result.best.describe()}  "
              + " ".join(f"--{k} {v}" for k, v in result.best.config.as_dict().items() if v > 1)
              + (" --displaced" if result.best.displaced else "")
              + (f" --quant {result.best.quant}" if result.best.quant != "off" else "")
              + (f" --attention {result.best.attention}" if result.best.attention else ""),
              f"why: {result.reason()}.",
              largest_line(result),
              "fits: yes (in the GPU's memory), offload (the weights that do not fit stream from host memory every "
              "step; its step ms counts that), no."]
    return "\n".join(lines)


def largest_line(result) -> str:
    """One line on the largest size the recommendation holds (:meth:`PlanResult.largest`)."""
    big, best = result.largest(), result.best
    decode = f", VAE decode {best.memory['decode']:.1f} GiB" if "decode" in best.memory else ""
    here = (f"memory at this size: step {best.memory['total']:.1f} GiB{decode} "
            f"(VAE: {result.workload.vae_parallel}" + (f", pieces of {result.workload.vae_chunk} rows"
                                                        if result.workload.vae_chunk else "") + ")")
    if big["height"] is None:
        return f"largest: not bounded by activations; {here}"
    size = f"{big['height']}x{big['width']}" + (f"x{big['frames']}f" if big["frames"] > 1 else "")
    return f"largest: about {size} fits with {big['config']} ({here})"


def run_plan(args: argparse.Namespace) -> int:
    """Run ``ditmesh plan``; bad input prints one line to stderr and returns 2."""
    from ..config import ConfigError
    from ..options import RunOptions

    for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes)):  # before anything loads
        if value is not None and value < 1:
            print(f"ditmesh plan: error: {flag} {value} must be >= 1 (e.g. {flag} 4)", file=sys.stderr)
            return 2
    try:  # the run's options as generate takes them (checked before torch loads); the planner counts their cost
        options = RunOptions.create(compile=args.mode == "compiled", cuda_graph=args.cuda_graph, chunk_tokens=args.chunk,
                                    vae_parallel=args.vae_parallel, vae_chunk=args.vae_chunk,
                                    pp_patches=args.pp_patches, quant=args.quant or "off",
                                    quant_modulation=args.quant_modulation, attention=args.attention or "default",
                                    cli=True)
    except ConfigError as exc:
        print(f"ditmesh plan: error: {exc}", file=sys.stderr)
        return 2
    from . import PlannerError, plan

    if args.validate:
        from .validate import report

        try:
            print(report(args.validate, device=args.device, link=args.link, with_holdout=args.holdout,
                         as_json=args.json))
        except PlannerError as exc:
            print(f"ditmesh plan: error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.top < 0:
        print(f"ditmesh plan: error: --top {args.top}: give 0 (all rows) or a positive row count", file=sys.stderr)
        return 2
    missing = [flag for flag, value in (("--model", args.model), ("--gpus", args.gpus)) if value is None]
    if missing:
        print(f"ditmesh plan: error: {' and '.join(missing)} required (e.g. --model flux-dev --gpus 4), "
              "or --validate RESULTS.json", file=sys.stderr)
        return 2
    if args.frames is None:  # a video architecture plans its default clip, not one frame
        args.frames = _default_frames(args.model)
    size = _default_size(args.model)  # a synthetic architecture plans the size generate makes of it
    args.height = size[0] if args.height is None else args.height
    args.width = size[1] if args.width is None else args.width
    supported = None
    if args.only:
        supported = {a.strip() for a in args.only.split(",") if a.strip()}
    try:
        result = plan(args.model, args.height, args.width, args.gpus, frames=args.frames, batch=args.batch,
                      cfg=args.cfg, device=args.device, link=args.link, nodes=args.nodes, inter_link=args.inter_link,
                      memory_gib=args.memory_gib, link_gbps=args.link_gbps, link_latency_us=args.link_latency_us,
                      tflops=args.tflops, steps=args.steps, supported=supported, displaced=args.displaced,
                      options=options)
    except PlannerError as exc:
        print(f"ditmesh plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(format_table(result, args.top))
    return 0


def _synth_defaults(model: str) -> dict:
    """What a run of ``model`` makes by default: a synthetic architecture's ``default_size`` and ``default_frames``, or
    a folder's (``ditmesh_synth.json``); {} otherwise."""
    from pathlib import Path

    from ..models.registry import ARCHS

    if model in ARCHS:
        arch = ARCHS[model]
        return {"default_size": list(arch.default_size), "default_frames": arch.default_frames}
    meta = Path(model) / "ditmesh_synth.json"
    try:
        return json.loads(meta.read_text()) if meta.is_file() else {}
    except (OSError, ValueError):
        return {}


def _default_frames(model: str) -> int:
    """The frames a run of ``model`` makes without ``--frames``: a synthetic video architecture's default, or a
    folder's (``ditmesh_synth.json``); 1 otherwise."""
    try:
        return int(_synth_defaults(model).get("default_frames") or 1)
    except (TypeError, ValueError):
        return 1


def _default_size(model: str) -> tuple[int, int]:
    """The (height, width) a run of ``model`` makes without ``--height``/``--width``: a synthetic architecture's default
    (what ``generate`` makes of it; a tiny one's positional tables may not reach 1024), or a folder's; 1024 x 1024
    otherwise."""
    try:
        height, width = _synth_defaults(model).get("default_size") or (1024, 1024)
        return int(height), int(width)
    except (TypeError, ValueError):
        return 1024, 1024


def main(argv=None) -> int:
    """Stand-alone entry (``python -m ditmesh.planner.cli``); ``ditmesh plan`` is the same command."""
    parser = argparse.ArgumentParser(prog="ditmesh")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
