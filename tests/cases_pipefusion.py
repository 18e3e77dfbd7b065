"""Functions run on every rank of a gloo worker pool for the PipeFusion tests (``tests/test_pipefusion.py``)."""

from __future__ import annotations

import torch


def pipeline_run(model: str, config: dict, steps: int = 3, height: int = 64, width: int = 64, frames: int | None = None,
                 guidance_scale: float = 5.0, max_sequence_length: int = 16, per_step: bool = False, remove: bool = False,
                 **options):
    """Run the pipeline in folder ``model`` under ``config`` (``{}``: one process, not parallelized) with the
    PipeFusion ``options`` (``pp_patches``, ``pp_warmup``, ``pp_chunk_bytes``).

    Returns ``(final latents, collectives of the call, collectives per step if per_step, state dict after remove if
    remove)``.
    """
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.api import remove as ditmesh_remove
    from ditmesh.comm import COUNTS, count_collectives

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if config:
        parallelize(pipe, ParallelConfig(**config), **options)
    final, steps_counts = {}, []
    marks = [dict(COUNTS)]

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        now = dict(COUNTS)
        steps_counts.append({k: now.get(k, 0) - marks[-1].get(k, 0) for k in now if now.get(k, 0) != marks[-1].get(k, 0)})
        marks.append(now)
        return kw

    kwargs = dict(height=height, width=width, num_inference_steps=steps, guidance_scale=guidance_scale,
                  generator=torch.Generator().manual_seed(42), max_sequence_length=max_sequence_length,
                  output_type="latent", callback_on_step_end=grab)
    if frames is not None:
        kwargs["num_frames"] = frames
    with count_collectives() as counts:
        pipe("a red circle", **kwargs)
    state = None
    if remove:
        ditmesh_remove(pipe)
        state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    return final["latents"], dict(counts), steps_counts if per_step else None, state
