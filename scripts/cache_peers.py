"""diffusers' own step caches on a whole pipeline run, for the side-by-side table of docs/caching.md.

Runs one pipeline call (``--steps`` denoising steps, latent output) with one of diffusers' cache hooks
(``FirstBlockCacheConfig``, ``TaylorSeerCacheConfig``, ``MagCacheConfig``) enabled on the transformer, on one
process or under torchrun with diffusers' own context parallelism (``enable_parallelism``, Ulysses over every
rank). Prints one JSON line from rank 0: the hook, the ranks, every step's time (callback at each step's end,
after a device synchronisation), and how many steps computed the last block's attention (a forward hook on its
query projection, which runs only when the attention does: diffusers' hooks replace a skipped module's forward,
and TaylorSeer's default predicts attention outputs only).

    python scripts/cache_peers.py --model /tmp/flux-dev --cache fbcache:0.08
    torchrun --nproc-per-node 4 scripts/cache_peers.py --model /tmp/flux-dev --cache taylorseer:4,3
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def cache_config(text: str, steps: int):
    """``off``, ``fbcache:T``, ``taylorseer:INTERVAL,BEFORE`` or ``magcache:T,MAX_SKIPS`` -> diffusers' config."""
    name, _, rest = text.partition(":")
    values = [v for v in rest.split(",") if v]
    if name == "off":
        return None
    if name == "fbcache":
        from diffusers import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=float(values[0]))
    if name == "taylorseer":
        from diffusers import TaylorSeerCacheConfig

        return TaylorSeerCacheConfig(cache_interval=int(values[0]), disable_cache_before_step=int(values[1]))
    if name == "magcache":
        from diffusers import MagCacheConfig

        # no calibrated ratios exist for synthetic weights: a flat ratio of 1 makes the error estimate grow by the
        # retention rule alone, so the threshold and max_skip_steps set how often it computes
        return MagCacheConfig(threshold=float(values[0]), max_skip_steps=int(values[1]), num_inference_steps=steps,
                              mag_ratios=[1.0] * steps)
    raise SystemExit(f"--cache {text!r}: use off, fbcache:T, taylorseer:INTERVAL,BEFORE or magcache:T,MAX_SKIPS")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--cache", default="off")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    args = p.parse_args()
    import torch.distributed as dist
    from diffusers import DiffusionPipeline

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    pipe = DiffusionPipeline.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
    pipe.set_progress_bar_config(disable=True)
    row = {"peer": "diffusers", "cache": args.cache, "gpus": world, "steps": args.steps}
    try:
        if world > 1:
            from diffusers import ContextParallelConfig

            pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        config = cache_config(args.cache, args.steps)
        if config is not None:
            pipe.transformer.enable_cache(config)
        computed = []
        blocks = getattr(pipe.transformer, "single_transformer_blocks", None) or pipe.transformer.transformer_blocks
        blocks[-1].attn.to_q.register_forward_hook(lambda *a: computed.append(1))
        stamps = []

        def on_step_end(pipe_, step, timestep, kwargs):
            torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())
            return kwargs

        torch.cuda.synchronize(device)
        start = time.perf_counter()
        pipe("a photo of a cat", height=args.height, width=args.width, num_inference_steps=args.steps,
             generator=torch.Generator(device).manual_seed(0), output_type="latent", callback_on_step_end=on_step_end)
        steps = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
        row.update(step_s=[round(s, 5) for s in steps], steps_2_on_s=round(sum(steps[1:]), 4),
                   last_attention_computed=len(computed))
    except Exception as exc:  # noqa: BLE001  (a hook that fails is a row with its error)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    if rank == 0:
        print("cache_peers row: " + json.dumps(row), flush=True)
    if world > 1:  # leave without destructors: a gloo group torn down can abort the interpreter (SIGABRT)
        from ditmesh.runtime.generate import end_rank_process

        end_rank_process(0)


if __name__ == "__main__":
    main()
