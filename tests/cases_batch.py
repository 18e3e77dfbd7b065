"""Rank functions for data and CFG parallelism tests (module-level so gloo workers can import them)."""

from __future__ import annotations

import torch


def flux_call(model: str, config: dict, call: dict, steps: int = 2):
    """FluxPipeline at 64x64 with ``call`` kwargs under ``config``; returns (latents, counts) or "error: ..."."""
    from ditmesh import ConfigError

    try:
        return pipe_call(model, config, dict(call, height=64, width=64, max_sequence_length=32), steps)
    except ConfigError as exc:
        return "error: " + str(exc)


def pipe_call(model: str, config: dict, call: dict, steps: int = 2, pipe_attrs: dict | None = None):
    """Any DiffusionPipeline folder with ``call`` kwargs under ``config`` (``pipe_attrs``: attributes set on the loaded
    pipeline); returns (final latents, collective counts)."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives

    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, value in (pipe_attrs or {}).items():
        setattr(pipe, name, value)
    parallelize(pipe, ParallelConfig(**config))
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    with count_collectives() as counts:
        pipe(**call, num_inference_steps=steps, generator=torch.Generator().manual_seed(7), output_type="latent",
             callback_on_step_end=grab)
    return final["latents"], dict(counts)
