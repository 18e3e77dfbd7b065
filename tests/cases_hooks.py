"""Functions run on every rank of a gloo worker pool for the hook, context and remove() tests."""

from __future__ import annotations

import os

import torch


def _load(model: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe, **extra):
    kwargs = dict(height=48, width=48, num_inference_steps=2, max_sequence_length=32, output_type="latent",
                  generator=torch.Generator().manual_seed(42))
    kwargs.update(extra)
    out = pipe(prompt="a red circle", **kwargs)  # by name: SanaWMPipeline takes its first frame first
    return out.images if hasattr(out, "images") else out.frames


def _snapshot(pipe) -> dict:
    """Everything a pipeline is: each component's state dict, and each module's attribute names and processor type."""
    snap = {}
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            snap[name] = type(component).__name__
            continue
        snap[name] = {
            "state": {k: v.detach().clone() for k, v in component.state_dict().items()},
            "modules": {n: (type(m).__name__, tuple(sorted(vars(m))), type(getattr(m, "processor", None)).__name__)
                        for n, m in component.named_modules()},
        }
    return snap


def _same(a: dict, b: dict) -> list[str]:
    """Where two snapshots differ (empty: the same)."""
    diffs = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if isinstance(x, dict) and isinstance(y, dict):
            if x["modules"] != y["modules"]:
                changed = [n for n in x["modules"] if x["modules"][n] != y["modules"].get(n)]
                diffs.append(f"{name}: modules differ at {changed[:3]}")
            if set(x["state"]) != set(y["state"]) or not all(torch.equal(x["state"][k], y["state"][k]) for k in x["state"]):
                diffs.append(f"{name}: state dict differs")
        elif x != y:
            diffs.append(f"{name}: {x} vs {y}")
    return diffs


def remove_restores_case(model: str, config: dict, fuse_qkv: bool = False, broadcast_text: bool = True,
                         extra: dict | None = None, options: dict | None = None, pipe_attrs: dict | None = None):
    """parallelize (with more ``options``), run, remove: the pipeline must equal one never parallelized, and give the
    same outputs (``pipe_attrs``: attributes set on the loaded pipeline, as HiDream's ``default_sample_size``).

    Returns (differences after remove, rel err of the parallel run, max abs diff of the run after remove
    against the run before parallelize).
    """
    from ditmesh import ParallelConfig, parallelize, remove
    from ditmesh.parallel import tensor
    from ditmesh.testing import rel_err

    extra = extra or {}
    torch.manual_seed(0)
    pipe = _load(model)
    for name, value in (pipe_attrs or {}).items():
        setattr(pipe, name, value)
    reference = _call(pipe, **extra)
    before = _snapshot(pipe)  # after a call: diffusers' own cache_context leaves its hook registry on the model
    if broadcast_text:
        os.environ[tensor.TEXT_ENCODERS_ENV] = "broadcast"
    try:
        parallelize(pipe, ParallelConfig(**config), fuse_qkv=fuse_qkv, **(options or {}))
    finally:
        os.environ.pop(tensor.TEXT_ENCODERS_ENV, None)
    parallel = _call(pipe, **extra)
    remove(pipe)
    after = _snapshot(pipe)
    again = _call(pipe, **extra)
    return _same(before, after), rel_err(parallel, reference), float((again - reference).abs().max())


def remove_sharded_load_case(model: str):
    """A transformer loaded as a shard cannot come back whole: remove() says so in one message."""
    import torch.distributed as dist

    from ditmesh import ParallelConfig, parallelize, remove
    from ditmesh.parallel import tensor

    pipe = _load(model)
    tp = dist.get_world_size()
    pipe.transformer = tensor.load_sharded_transformer(model, dist.get_rank(), tp, "cpu", torch.float32)
    parallelize(pipe, ParallelConfig(tp=tp))
    try:
        remove(pipe)
    except RuntimeError as exc:
        # the collectives are gone: a second parallelize is accepted
        parallelize(pipe, ParallelConfig(tp=tp))
        return str(exc)
    return None


def renamed_attention_case(model: str, selector: dict):
    """parallelize with an adapter whose attention selection misses layers: refused before any call."""
    import dataclasses

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.models import base
    from ditmesh.models.base import AttentionSelector

    pipe = _load(model)
    name = type(pipe.transformer).__name__
    original = base.adapter_for_class(name)  # imports the family's module where this process has not yet
    base._REGISTRY[name] = dataclasses.replace(original, attention=AttentionSelector(**selector))
    try:
        parallelize(pipe, ParallelConfig(ulysses=2))
    except NotImplementedError as exc:
        return str(exc), "forward" in vars(pipe.transformer)
    finally:
        base._REGISTRY[name] = original
    return None, "forward" in vars(pipe.transformer)


def two_transformers_case(model: str, config: dict, steps: int = 3):
    """A pipeline with ``transformer`` and ``transformer_2`` (Wan 2.2 A14B): final latents, and per transformer
    the number of calls and the collectives issued during its calls."""
    import collections

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import COUNTS

    torch.manual_seed(0)
    pipe = _load(model)
    if config:
        parallelize(pipe, ParallelConfig(**config))
    per_model = {}
    for name in ("transformer", "transformer_2"):
        stats = per_model.setdefault(name, {"calls": 0, "counts": collections.Counter()})

        def pre(mod, args, stats=stats):
            stats["calls"] += 1
            stats["before"] = collections.Counter(COUNTS)

        def post(mod, args, out, stats=stats):
            stats["counts"] += collections.Counter(COUNTS) - stats.pop("before")

        getattr(pipe, name).register_forward_pre_hook(pre)
        getattr(pipe, name).register_forward_hook(post)
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    pipe("a red circle", height=32, width=32, num_frames=5, num_inference_steps=steps, guidance_scale=5.0,
         generator=torch.Generator().manual_seed(42), max_sequence_length=32, output_type="latent",
         callback_on_step_end=grab)
    return final["latents"], {name: {"calls": v["calls"], "counts": dict(v["counts"])} for name, v in per_model.items()}


def step_index_case(model: str, config: dict, runs: tuple = (3,)):
    """(step index, call within step) the context records at each transformer call of true-CFG FLUX runs, one run
    per entry of ``runs`` (its step count), one after the other on the same pipeline."""
    from ditmesh import ParallelConfig, parallelize

    pipe = _load(model)
    runtime = parallelize(pipe, ParallelConfig(**config))
    seen = []
    pipe.transformer.register_forward_hook(
        lambda mod, args, out: seen.append((runtime.context.step_index, runtime.context.call_in_step)))
    for steps in runs:
        pipe("a red circle", negative_prompt="", true_cfg_scale=2.0, height=32, width=32, num_inference_steps=steps,
             max_sequence_length=32, output_type="latent", generator=torch.Generator().manual_seed(1))
    return seen


def failed_parallelize_case(model: str):
    """A parallelize that fails after sharding (a bad text-encoder choice) leaves the pipeline as it was."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.config import ConfigError
    from ditmesh.parallel import tensor

    pipe = _load(model)
    before = _snapshot(pipe)
    os.environ[tensor.TEXT_ENCODERS_ENV] = "bogus"
    try:
        parallelize(pipe, ParallelConfig(tp=2))
    except ConfigError as exc:
        message = str(exc)
    finally:
        os.environ.pop(tensor.TEXT_ENCODERS_ENV, None)
    return message, _same(before, _snapshot(pipe))


def cache_with_an_empty_dp_chunk_case(model: str):
    """One prompt on two dp groups with a step cache: every rank refuses (instead of some waiting forever)."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.config import ConfigError

    pipe = _load(model)
    parallelize(pipe, ParallelConfig(dp=2), cache="fbcache:0.5")
    try:
        _call(pipe, num_inference_steps=3)
    except ConfigError as exc:
        return str(exc)
    return None
