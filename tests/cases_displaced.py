"""Functions run on every rank of a gloo worker pool for the displaced attention tests (``tests/test_displaced.py``)."""

from __future__ import annotations

import torch


def buffer_bytes_after_first_step(model: str, config: dict, steps: int = 3, height: int = 64, width: int = 64,
                                  max_sequence_length: int = 16, **options) -> list[int]:
    """Bytes of the stale-K/V buffers held after each step of a run (``ForwardContext.kv_buffers``: displaced
    attention's pending gathers, PipeFusion's per-layer K/V) under ``config``; ``options``: more ``parallelize``
    arguments (default ``displaced=True``)."""
    from diffusers import DiffusionPipeline

    from cases_models import call_kwargs
    from ditmesh import ParallelConfig, parallelize

    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    runtime = parallelize(pipe, ParallelConfig(**config), **({"displaced": True} | options))
    held = []
    kwargs = call_kwargs({}, steps, height, width, None, max_sequence_length, 5.0)

    def count(p, i, t, kw):
        held.append(sum(x.numel() * x.element_size() for entry in runtime.context.kv_buffers.values()
                        for x in entry if isinstance(x, torch.Tensor)))
        return kw

    kwargs["callback_on_step_end"] = count
    pipe("a red circle", **kwargs)
    return held


def compiled_run_graphs(model: str, config: dict, steps: int = 3, **options) -> tuple:
    """A compiled run (``compile=True``) of ``model`` under ``config`` from an empty compiler cache: (final latents,
    collectives per step, {block class: compiled entries of its ``forward``}, {function's qualified name: the guard
    failures that recompiled it} over every function dynamo compiled, graph breaks). A block class compiled once
    for all of its layers has one entry."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters, guard_failures

    from cases_pipefusion import pipeline_run
    from ditmesh.models.base import adapter_for

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    keep = {}
    latents, _, per_step, _, _ = pipeline_run(model, config, steps=steps, per_step=True, compile=True, keep=keep,
                                              **options)
    transformer = keep["pipe"].transformer
    classes = {type(block) for block in adapter_for(transformer).block_modules(transformer)}
    entries = {cls.__name__: len(_debug_get_cache_entry_list(cls.forward.__code__)) for cls in classes}
    failures = {code.co_qualname: list(reasons) for code, reasons in guard_failures.items() if reasons}
    return latents, per_step, entries, failures, sum(counters["graph_break"].values())
