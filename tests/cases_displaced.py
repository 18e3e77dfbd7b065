"""Functions run on every rank of a gloo worker pool for the displaced attention tests (``tests/test_displaced.py``)."""

from __future__ import annotations

import torch


def buffer_bytes_after_first_step(model: str, config: dict, steps: int = 3, height: int = 64, width: int = 64,
                                  max_sequence_length: int = 16) -> list[int]:
    """Bytes of the displaced K/V buffers held after each step of a run (``ForwardContext.kv_buffers``) under
    ``config`` with ``displaced=True``."""
    from diffusers import DiffusionPipeline

    from cases_models import call_kwargs
    from ditmesh import ParallelConfig, parallelize

    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    runtime = parallelize(pipe, ParallelConfig(**config), displaced=True)
    held = []
    kwargs = call_kwargs({}, steps, height, width, None, max_sequence_length, 5.0)

    def count(p, i, t, kw):
        held.append(sum(raw.numel() * raw.element_size() for _, _, raw in runtime.context.kv_buffers.values()))
        return kw

    kwargs["callback_on_step_end"] = count
    pipe("a red circle", **kwargs)
    return held
