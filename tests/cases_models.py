"""Functions run on every rank of a gloo worker pool for the SD3 and Wan sequence-parallel tests.

Each takes the parallel configuration as a dict of degrees (``{"ulysses": 2}``, ``{"ring": 2}``,
``{"ring": 2, "ulysses": 2}``), so the test matrix grows by adding parameters, not functions.
"""

from __future__ import annotations

import inspect
import math

import torch


def pipeline_generate(model: str, config: dict, steps: int = 2, height: int = 64, width: int = 64, frames: int | None = None,
                      max_sequence_length: int = 32, guidance_scale: float = 5.0, prompt: str = "a red circle",
                      fuse_qkv: bool = False, extra: dict | None = None):
    """Run the pipeline in folder ``model`` with ditmesh ``config`` on this rank (``extra``: more call kwargs).

    Returns ``(final latents, collectives issued during the call, number of transformer calls)``. Works
    for image pipelines (SD3) and video pipelines (Wan, with ``frames``); a pipeline without
    ``callback_on_step_end`` (PixArt) returns its final latents as its output.
    """
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    parallelize(pipe, ParallelConfig(**config), fuse_qkv=fuse_qkv)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    final = {}
    kwargs = dict(call_kwargs(final, steps, height, width, frames, max_sequence_length, guidance_scale), **(extra or {}))
    accepted = inspect.signature(pipe.__call__).parameters
    if "callback_on_step_end" not in accepted:
        del kwargs["callback_on_step_end"]
    if "max_sequence_length" not in accepted:  # HunyuanDiT: its text lengths are the model's
        del kwargs["max_sequence_length"]
    with count_collectives() as counts:
        out = pipe(prompt, **kwargs)
    return final.get("latents", getattr(out, "images", None)), dict(counts), len(calls)


def generate_on(pools, path: str, config: dict, **kwargs) -> list:
    """:func:`pipeline_generate` of the folder ``path`` under ``config`` on every rank of the pool of its world size
    (``pools(n)``), or in this process when ``pools`` is None; a list of per-rank results either way."""
    if pools is None:
        return [pipeline_generate(path, config, **kwargs)]
    return pools(math.prod(config.values())).run(pipeline_generate, path, config, **kwargs)


def call_kwargs(final: dict, steps: int, height: int, width: int, frames: int | None, max_sequence_length: int,
                guidance_scale: float) -> dict:
    """Pipeline-call kwargs of the model tests (seed 42, latents out); the final latents land in ``final``."""

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    kwargs = dict(height=height, width=width, num_inference_steps=steps, guidance_scale=guidance_scale,
                  generator=torch.Generator().manual_seed(42), max_sequence_length=max_sequence_length,
                  output_type="latent", callback_on_step_end=grab)
    if frames is not None:
        kwargs["num_frames"] = frames
    return kwargs


def transformer_call(arch: str, config: dict, inputs: dict):
    """One call of the synthetic ``arch`` transformer (seed 0) on ``inputs`` under ``config`` on this rank (``{}``:
    one process, not parallelized). Returns (output sample, collectives of the call)."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.synth import build_transformer

    model = build_transformer(arch, seed=0, dtype=torch.float32)
    if config:
        class Pipe:  # parallelize() needs only `.transformer`
            transformer = model

        parallelize(Pipe, ParallelConfig(**config))
    with torch.no_grad(), count_collectives() as counts:
        out = model(**inputs)[0]
    return out, dict(counts)
