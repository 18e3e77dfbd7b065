"""``ditmesh analyze``: where a pipeline repeats itself between denoising steps, per block and per step.

Runs the pipeline once on a batch of prompts under any parallel configuration with a
:class:`~ditmesh.redundancy.RedundancyProbe` attached, then writes, into ``--out``:

- ``redundancy.json``: the command, the configuration, and for every transformer and branch (``call0`` = cond,
  ``call1`` = uncond under sequential CFG) the relative L1 change from the previous step of each block's output
  and residual, each attention layer's output, and each attention layer's keys and values, per step;
- ``heatmap.png``: blocks x steps of the block-output change (first branch of the first transformer);
- ``curves.png``: per step, the mean over blocks of each quantity.

Where the family names its first block's modulated input, the JSON also holds ``teacache``: a polynomial fitted
(least squares, degree 4) from that input's change to the change of the last block's output over every step and
branch, and the line prints the ``--cache teacache:...`` setting that uses it.

The statistics are reduced over the ranks that share each computation, so a parallel run writes the numbers a
single process writes (tests/test_analyze.py). The PNGs need matplotlib (``pip install 'ditmesh[plots]'``);
without it the JSON is written and a line says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_analyze_parser(sub) -> None:
    from .cli import add_degree_flags

    a = sub.add_parser("analyze", help="measure step-to-step redundancy per block (for step caching)",
                       description="Run a pipeline once and record, per block and step, how much its output, "
                                   "residual, attention output and K/V change from the previous step.")
    a.add_argument("--model", default=None, help="pipeline folder or synthetic architecture (default: the tiny pipeline)")
    a.add_argument("--prompt", action="append", default=None, help="prompt (repeat for several; run as one batch)")
    a.add_argument("--steps", type=int, default=28, help="denoising steps (default 28)")
    a.add_argument("--height", type=int, default=None)
    a.add_argument("--width", type=int, default=None)
    a.add_argument("--frames", type=int, default=None, help="video pipelines: frames")
    a.add_argument("--guidance", type=float, default=3.5)
    a.add_argument("--negative-prompt", default=None)
    a.add_argument("--true-cfg-scale", type=float, default=4.0)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--max-sequence-length", type=int, default=None)
    add_degree_flags(a)
    a.add_argument("--nproc", type=int, default=None, help="launch N local processes")
    a.add_argument("--out", default="out/analyze", help="output folder (default out/analyze)")
    a.add_argument("--schedule", type=float, default=None, metavar="T",
                   help="also propose a static cache schedule: the steps whose blocks after the first changed by "
                        "less than T on average (print the --cache setting)")
    a.set_defaults(func=run_analyze)


DEFAULT_PROMPTS = ("a red circle at the top left on a white background",
                   "a blue triangle at the bottom right on a gray background")


def run_analyze(args: argparse.Namespace) -> int:
    """Validate, launch ranks when asked, and run one rank of ``ditmesh analyze``."""
    from .config import ConfigError, ParallelConfig
    from .runtime.generate import check_size

    args.prompt = args.prompt or list(DEFAULT_PROMPTS)
    config = ParallelConfig(dp=args.dp, cfg=args.cfg, pp=args.pp, ring=args.ring, ulysses=args.ulysses, tp=args.tp)
    world = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    config.check_world_size(world)
    if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: the analysis compares adjacent steps; use at least 2")
    check_size(args)
    if args.schedule is not None and not args.schedule > 0:
        raise ConfigError(f"--schedule {args.schedule}: give a positive relative change, e.g. 0.05")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; give a folder (new or existing) for the results")
    if config.dp > len(args.prompt):
        raise ConfigError(f"--dp {config.dp} needs at least {config.dp} prompts (one per data-parallel group); "
                          f"give more --prompt or a smaller --dp")
    if args.nproc and "RANK" not in os.environ:
        from .runtime.launch import launch
        from .shared import strip_option

        return launch(args.nproc, strip_option(list(args.argv), "--nproc"))
    return analyze_rank(args, config)


def analyze_rank(args, config) -> int:
    """One rank: load, parallelize, probe, run, and (rank 0) write the results."""
    import torch
    import torch.distributed as dist
    from diffusers import DiffusionPipeline

    from .api import parallelize
    from .mesh import default_device
    from .redundancy import RedundancyProbe
    from .runtime.generate import _call_kwargs, _init_distributed, finish_rank
    from .runtime.models import local_model_path, read_defaults, resolve_model

    device = default_device()
    _init_distributed(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = resolve_model(args.model)
    path = local_model_path(model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=rank != 0, desc=f"analyze ({config.describe()})")
    runtime = parallelize(pipe, config, device=device)
    probe = RedundancyProbe(runtime)
    args.images_per_prompt = 1
    call = _call_kwargs(pipe, args, read_defaults(path))
    call["output_type"] = "latent"
    pipe(**call)
    records = probe.records()
    probe.remove()
    if rank == 0:
        fit = fit_teacache(records)
        write_results(Path(args.out), records, args, config, model, fit)
        if fit is not None:
            print(f"ditmesh: teacache rescaling fitted on {fit['pairs']} steps: --cache {fit['setting']}", flush=True)
        if args.schedule is not None:
            print(f"ditmesh: proposed cache: --cache {suggest_schedule(records, args.schedule)}", flush=True)
    finish_rank()
    return 0


def suggest_schedule(records: dict, threshold: float, first: int = 1, last: int = 0) -> str:
    """A ``static`` cache setting: the steps at which the blocks after the first ``first`` (and before the last
    ``last``) changed from the previous step by less than ``threshold`` on average (first transformer, first
    branch), never two steps before the blocks last ran."""
    component = next(iter(records))
    series = list(records[component]["call0"]["output"].values())
    middle = series[first: len(series) - last if last else None]
    skip, ran = [], 0
    for i in range(len(middle[0])):
        step = i + 1  # the records start at the second step
        change = sum(s[i] for s in middle) / len(middle)
        if change < threshold and step - ran <= 3:
            skip.append(step)
        else:
            ran = step
    return f"static:skip={'+'.join(map(str, skip)) or 'none'},first={first},last={last}"


def fit_teacache(records: dict, degree: int = 4) -> dict | None:
    """The TeaCache-like policy's rescaling polynomial: least squares from the first block's modulated-input change
    to the last block's output change, over every step, branch and transformer; None when nothing was measured.
    The proposed threshold, three times the median output change of a step, computes about one step in three in the
    middle of a run: a starting point for ``eval-tiny --cache-sweep`` or a look at the images."""
    import numpy as np

    xs, ys = [], []
    for branches in records.values():
        for data in branches.values():
            if "modulated" not in data:
                continue
            outputs = list(data["output"].values())
            for series in data["modulated"].values():
                xs += series
                ys += outputs[-1][:len(series)]
    if len(xs) <= degree:
        return None
    poly = [float(c) for c in np.polyfit(np.asarray(xs), np.asarray(ys), degree)]
    text = "/".join(f"{c:.6g}" for c in poly)
    threshold = round(3 * float(np.median(ys)), 4)
    return {"poly": poly, "degree": degree, "pairs": len(xs), "x": xs, "y": ys, "threshold": threshold,
            "setting": f"teacache:threshold={threshold},poly={text}"}


def write_results(out: Path, records: dict, args, config, model: str, teacache: dict | None = None) -> list[str]:
    """The JSON and, where matplotlib is installed, the heat map and curves; returns the paths written."""
    from .shared import write_json

    doc = {"command": ["ditmesh", *getattr(args, "argv", [])], "model": model, "config": config.as_dict(),
           "steps": args.steps, "prompts": args.prompt, "seed": args.seed,
           "quantity": "relative L1 change from the previous step of the same branch: sum|x_t - x_t-1| / sum|x_t-1|",
           "records": records, "teacache": teacache}
    written = [str(out / "redundancy.json")]
    write_json(written[0], doc)
    try:
        written += plot(out, records)
    except ImportError:
        print("ditmesh: analyze: the heat map and curves need matplotlib (pip install 'ditmesh[plots]'); "
              "wrote the JSON only", file=sys.stderr)
    print(f"ditmesh: wrote {', '.join(written)}", flush=True)
    return written


def plot(out: Path, records: dict) -> list[str]:
    """``heatmap.png`` (blocks x steps, block output change) and ``curves.png`` (mean over modules per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    component = next(iter(records))
    branch = next(iter(records[component]))
    data = records[component][branch]
    blocks = list(data["output"])
    grid = [data["output"][b] for b in blocks]
    fig, ax = plt.subplots(figsize=(max(6, len(grid[0]) * 0.35), max(4, len(blocks) * 0.22)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set(xlabel="step (from the second)", ylabel="block", title=f"{component} {branch}: block output change")
    ax.set_yticks(range(len(blocks)), blocks, fontsize=6)
    fig.colorbar(image, ax=ax, label="relative L1 change")
    fig.tight_layout()
    heat = out / "heatmap.png"
    fig.savefig(heat, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for quantity, series in data.items():
        rows = list(series.values())
        steps = len(rows[0])
        ax.plot(range(1, steps + 1), [sum(r[s] for r in rows) / len(rows) for s in range(steps)], marker="o",
                label=quantity)
    ax.set(xlabel="step", ylabel="mean relative L1 change", title=f"{component} {branch}")
    ax.legend()
    fig.tight_layout()
    curves = out / "curves.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    return [str(heat), str(curves)]

