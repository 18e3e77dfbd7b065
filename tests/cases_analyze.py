"""Functions run on every rank of a gloo worker pool for the redundancy-analysis tests."""

from __future__ import annotations

import torch


def probe_records(model: str, config: dict, steps: int = 3, prompts: tuple = ("a red circle",), cfg: bool = False,
                  **extra) -> dict:
    """Run the pipeline in ``model`` under ``config`` with a RedundancyProbe; returns its records."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.redundancy import RedundancyProbe

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    runtime = parallelize(pipe, ParallelConfig(**config))
    probe = RedundancyProbe(runtime)
    kwargs = dict(height=32, width=32, num_inference_steps=steps, max_sequence_length=32, output_type="latent",
                  generator=torch.Generator().manual_seed(42))
    if cfg:
        kwargs.update(negative_prompt="", true_cfg_scale=2.0)
    kwargs.update(extra)
    pipe(list(prompts), **kwargs)
    records = probe.records()
    probe.remove()
    return records


def probe_refusal(model: str, config: dict, **kwargs) -> str | None:
    """:func:`probe_records`' ConfigError message (``None`` when the run went through)."""
    from ditmesh.config import ConfigError

    try:
        probe_records(model, config, **kwargs)
    except ConfigError as exc:
        return str(exc)
    return None
