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


def _host_state(displaced) -> tuple:
    """What a displaced runtime keeps on the host, and its buffers by address: a replayed CUDA graph runs no Python,
    so a call must leave all of it as the plan before the call set it."""
    buffers = sorted((repr(key), value.data_ptr()) for key, value in displaced.ctx.kv_buffers.items())
    return displaced.planned, dict(displaced.written), displaced.layers, list(displaced.started), buffers


def graphed_runs(model: str, config: dict, steps: int, runs: int, graphed: bool = True, call: dict | None = None,
                 **options) -> tuple:
    """``runs`` pipeline runs of ``model`` under ``config`` with displaced attention (and ``options`` of
    ``parallelize``; ``call``: more pipeline arguments), each transformer call replayed from one graph per planned call
    (``graph.apply`` with the displaced runtime, as ``parallelize(cuda_graph=True)`` builds it) unless ``graphed`` is
    False. Returns (final latents of each run, collectives of each step of each run, {graph key (call in step, exact,
    parity, last): (captured, replays)}).

    The CPU stand-in for capture runs the call once for its output and then puts back the buffers and collective
    counts it changed (a CUDA capture records the kernels and runs none of them); each replay re-runs the call on the
    captured inputs and checks that the runtime's host state (plan, booked runs, layer count, pending gathers, the
    buffers and their addresses) is what it was before the replay, as a graph replay could change none of it."""
    from cases import rerun_capture
    from cases_models import call_kwargs
    from cases_pipefusion import load
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import COUNTS
    from ditmesh.hooks import find_hook
    from ditmesh.parallel import graph

    torch.manual_seed(0)
    pipe = load(model, config)
    pipe.set_progress_bar_config(disable=True)
    displaced = parallelize(pipe, ParallelConfig(**config), displaced=True, **options).displaced["transformer"]

    def emulated_capture(fn):
        buffers = {key: value.clone() for key, value in displaced.ctx.kv_buffers.items()}
        counts = dict(COUNTS)
        replay, out = rerun_capture(fn)
        for key, value in buffers.items():
            displaced.ctx.kv_buffers[key].copy_(value)
        COUNTS.clear()
        COUNTS.update(counts)

        def checked():
            before = _host_state(displaced)
            replay()
            assert _host_state(displaced) == before, "host state changed inside a replayed call"

        return checked, out

    if graphed:
        displaced.graphed = True  # what parallelize(cuda_graph=True) builds on a GPU
        graph.apply(pipe.transformer, capture=emulated_capture, devices=("cpu",), displaced=displaced)
    latents, per_step = [], []
    for _ in range(runs):
        final, marks = {}, [dict(COUNTS)]
        kwargs = call_kwargs(final, steps, 64, 64, None, 16, 3.5)
        grab = kwargs["callback_on_step_end"]

        def count_step(p, i, t, kw):
            now = dict(COUNTS)
            per_step.append({k: v - marks[-1].get(k, 0) for k, v in now.items() if v != marks[-1].get(k, 0)})
            marks.append(now)
            return grab(p, i, t, kw)

        kwargs.update(call or {}, callback_on_step_end=count_step)
        pipe("a red circle", **kwargs)
        latents.append(final["latents"])
    hook = find_hook(pipe.transformer, "graph")
    entries = {} if hook is None else {key[2]: (e.replay is not None, e.replays)
                                       for key, e in hook.graphed.entries.items()}
    return latents, per_step, entries
