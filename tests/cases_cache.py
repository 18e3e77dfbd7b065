"""Functions run on every rank of a gloo worker pool for the step-cache tests."""

from __future__ import annotations

import torch

TINY_PROMPTS = ("a red circle at the top left on a white background", "a blue square at the bottom on a gray background")


def tiny_model() -> str:
    from ditmesh.tiny import default_model_path

    return default_model_path()


def cached_run(model: str | None, config: dict, cache: str | None, steps: int = 10, prompts=TINY_PROMPTS[:1],
               cfg: bool = False, size: int = 64, compile: bool = False, pipe_attrs: dict | None = None, **extra):
    """Final latents, the cache's decisions and the collectives of the call, for ``model`` (default: the tiny
    trained pipeline, whose steps repeat themselves as a real model's do) under ``config`` with ``cache``
    (``pipe_attrs``: attributes set on the loaded pipeline)."""
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model or tiny_model(), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, value in (pipe_attrs or {}).items():
        setattr(pipe, name, value)
    runtime = parallelize(pipe, ParallelConfig(**config), cache=cache, compile=compile)
    for step_cache in runtime.caches.values():
        step_cache.record_local = True
    kwargs = dict(height=size, width=size, num_inference_steps=steps, max_sequence_length=16, output_type="latent",
                  generator=torch.Generator().manual_seed(7))
    if cfg:
        kwargs.update(negative_prompt="", true_cfg_scale=2.0)
    kwargs.update(extra)
    with count_collectives() as counts:
        latents = pipe(prompt=list(prompts), **kwargs).images if "num_frames" not in extra else \
            pipe(prompt=list(prompts), **kwargs).frames
    history = {name: c.history for name, c in runtime.caches.items()}
    return latents, history, dict(counts)


def _python_state(step_cache) -> list:
    """What a step cache keeps on the host between calls: a replayed CUDA graph runs no Python, so none of it may
    change inside a call whose path was planned before it."""
    return [len(step_cache.history)] + [
        (key, s.computed, s.middle_step, s.earlier_step, s.skips_in_a_row,
         sorted((n, id(t)) for n, t in s.middle.items()), sorted((n, id(t)) for n, t in s.earlier.items()))
        for key, s in sorted(step_cache.branches.items())]


def path_graphed_cached_run(config: dict, cache: str, steps: int = 10, cfg: bool = False):
    """``cached_run`` with the whole transformer call replayed from one graph per planned path (``graph.apply`` with
    the cache). On CPU the capture re-runs the call on the captured buffers; each such replay checks that the
    cache's host-side state does not change inside the call (as a real replay could not change it)."""
    from diffusers import DiffusionPipeline

    from cases import rerun_capture
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.parallel import graph

    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(tiny_model(), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    runtime = parallelize(pipe, ParallelConfig(**config), cache=cache)
    step_cache = runtime.caches["transformer"]

    def frozen_capture(fn):
        replay, out = rerun_capture(fn)

        def checked():
            before = _python_state(step_cache)
            replay()
            assert _python_state(step_cache) == before, "host state changed inside a replayed call"

        return checked, out

    hook_undo = graph.apply(pipe.transformer, capture=frozen_capture, devices=("cpu",), cache=step_cache)
    kwargs = dict(negative_prompt="", true_cfg_scale=2.0) if cfg else {}
    latents = pipe(list(TINY_PROMPTS[:1]), height=64, width=64, num_inference_steps=steps, max_sequence_length=16,
                   output_type="latent", generator=torch.Generator().manual_seed(7), **kwargs).images
    from ditmesh.hooks import find_hook

    entries = {key[2]: (e.replay is not None, e.replays) for key, e in  # key[2]: (branch, planned path)
               find_hook(pipe.transformer, "graph").graphed.entries.items()}
    hook_undo[0]()
    return latents, {"transformer": step_cache.history}, entries


def assert_cache_decides_as_one_process(pools, model: str, config: dict, setting: str, **kwargs) -> None:
    """``cached_run`` of ``model`` under ``config`` on every rank takes the one-process run's decisions, some of which
    skip and some compute, and gives its latents (relative error <= 1e-5)."""
    from ditmesh.testing import rel_err

    ref_latents, ref_history, _ = cached_run(model, {}, setting, **kwargs)
    skips = [h["skip"] for h in ref_history["transformer"]]
    assert any(skips) and not all(skips), ref_history
    world = 1
    for degree in config.values():
        world *= degree
    for latents, history, _ in pools(world).run(cached_run, model, config, setting, **kwargs):
        assert [h["skip"] for h in history["transformer"]] == skips
        assert rel_err(latents, ref_latents) <= 1e-5


def check_caches_decide_as_one_process(pools, path: str, settings, **kwargs) -> None:
    """For each cache ``setting``: the one-process run of the pipeline in folder ``path`` skips some steps, and under
    ulysses 2 and cfg 2 every rank takes the same decisions and ends with the same latents (``test_cache``)."""
    from test_cache import assert_same_run

    for setting in settings:
        ref = cached_run(path, {}, setting, **kwargs)
        assert any(h["skip"] for h in ref[1]["transformer"]), setting
        for config in ({"ulysses": 2}, {"cfg": 2}):
            for got in pools(2).run(cached_run, path, config, setting, **kwargs):
                assert_same_run(got, ref)


#: the inputs of a family's four cached calls: the example inputs of seed 0 twice, then those of seed 1 twice (a call
#: equal to the one before it, then a changed one)
FAMILY_CALLS = (0, 0, 1, 1)


def family_model(arch: str, layers: dict | None = None):
    """The synthetic ``arch`` transformer (seed 0, float32); ``layers``: config entries in place of the arch's (its
    block counts)."""
    from dataclasses import replace

    from ditmesh.synth import build_transformer, get_arch

    spec = get_arch(arch)
    if layers:
        spec = replace(spec, transformer={**spec.transformer, **layers})
    return build_transformer(spec, seed=0, dtype=torch.float32)


def family_inputs(arch: str, layers: dict | None = None) -> tuple[list[dict], dict]:
    """The synthetic ``arch`` transformer's adapter's example inputs of each call of :data:`FAMILY_CALLS` (drawn from
    its seed; one sample, 8 text tokens, two latent frames of a video family, float32; 32 x 32, or the least power of
    two above it that the family takes and that gives 4 image tokens or more), and the sequence-parallel axis its heads
    take: ulysses 2, or ring 2 where they do not divide."""
    from ditmesh.models import adapter_for

    model = family_model(arch, layers)
    adapter = adapter_for(model)
    frames, size = 1 + (adapter.frame_step or 4), 32

    def tokens(size: int) -> int:  # 0 where the family refuses the size (a multiple it needs: doubled until it fits)
        try:
            return adapter.layout(dict(model.config), size, size, frames, 8).image_tokens
        except ValueError:
            return 0

    while tokens(size) < 4:
        size *= 2
    inputs = [adapter.example_inputs(model, height=size, width=size, batch=1, text_len=8,
                                     generator=torch.Generator().manual_seed(seed), device="cpu", dtype=torch.float32,
                                     frames=frames) for seed in FAMILY_CALLS]
    return inputs, ({"ulysses": 2} if adapter.num_heads(model) % 2 == 0 else {"ring": 2})


def family_cached_calls(arch: str, config: dict, setting: str | None, inputs: list[dict], layers: dict | None = None):
    """The synthetic ``arch`` transformer's calls on ``inputs`` (one a step of a run of ``len(inputs)`` steps, as a
    pipeline's scheduler counts them) under ``config`` with the step cache ``setting`` on this rank. Returns (every
    call's output sample, the cache's decisions, how often each block's own forward ran, the collectives of the
    calls)."""
    import functools
    from types import SimpleNamespace

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.hooks import output_sample
    from ditmesh.models import adapter_for

    model = family_model(arch, layers)
    blocks = adapter_for(model).block_modules(model)
    runs = [0] * len(blocks)
    for i, block in enumerate(blocks):  # wrapped before parallelize: the cache's hook calls this when the block runs
        @functools.wraps(block.forward)  # its signature: the hooks bind positional inputs by name
        def counted(*args, _i=i, _forward=block.forward, **kwargs):
            runs[_i] += 1
            return _forward(*args, **kwargs)
        block.forward = counted
    scheduler = SimpleNamespace(timesteps=torch.arange(len(inputs)), step_index=None, begin_index=None)

    class Pipe:  # what parallelize and the context hook read: the transformer and the scheduler's position
        transformer = model

    Pipe.scheduler = scheduler
    runtime = parallelize(Pipe, ParallelConfig(**config), cache=setting)
    outs = []
    with torch.no_grad(), count_collectives() as counts:
        for step, call in enumerate(inputs):
            scheduler.step_index = step
            out = model(**call)
            out = out if isinstance(out, torch.Tensor) else output_sample(out)  # Kandinsky 5: the tensor
            outs.append(torch.cat([t.flatten() for t in out]) if isinstance(out, list) else out)  # Cosmos 3: per item
    history = [h["skip"] for h in runtime.caches["transformer"].history] if setting else []
    return outs, history, runs, dict(counts)


def family_cached_runs(arch: str, config: dict, settings, inputs: list[dict], layers: dict | None = None) -> dict:
    """:func:`family_cached_calls` of each cache setting in ``settings`` (one pool task for all of them)."""
    return {setting: family_cached_calls(arch, config, setting, inputs, layers) for setting in settings}
