"""Tensor-parallel cases for SD3 and Wan, run on every rank of a gloo worker pool (module-level for the workers)."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist


def _blocks(transformer) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of the transformer's blocks, in forward order (its adapter's block lists)."""
    from ditmesh.models.base import adapter_for

    return [(f"{spec.path}.{i}", b) for spec in adapter_for(transformer).blocks
            for i, b in enumerate(transformer.get_submodule(spec.path))]


def _counters(transformer):
    """Hooks recording the collectives of every transformer call, and of each block during the first call."""
    from ditmesh.comm import COUNTS

    calls: list[dict] = []
    per_block: dict[str, dict] = {}
    before: dict[str, collections.Counter] = {}
    handles = []
    for name, module in _blocks(transformer) + [("transformer", transformer)]:
        def pre(m, args, name=name):
            before[name] = collections.Counter(COUNTS)

        def post(m, args, out, name=name):
            diff = {k: v - before[name].get(k, 0) for k, v in COUNTS.items() if v - before[name].get(k, 0)}
            if name == "transformer":
                calls.append(diff)
            elif name not in per_block:
                per_block[name] = diff

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return calls, per_block, handles


def tp_model_case(model: str, config: dict, steps: int = 2, height: int = 64, width: int = 64, frames: int | None = None,
                  max_sequence_length: int = 32, guidance_scale: float = 5.0, sharded_load: bool = False,
                  pipe_attrs: dict | None = None):
    """The pipeline in folder ``model`` (SD3, Wan or HiDream) under ``config`` on this rank (``pipe_attrs``: attributes
    set on the loaded pipeline).

    Returns a dict: final latents, collectives of the whole call, collectives of each transformer call and of
    each block during the first call, this rank's parameter bytes and ``replicated + sharded // tp``.
    """
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.models.base import adapter_for
    from ditmesh.parallel import tensor

    tp = config.get("tp", 1)
    torch.manual_seed(0)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, value in (pipe_attrs or {}).items():
        setattr(pipe, name, value)
    replicated, sharded = tensor.partition_bytes(pipe.transformer, adapter_for(pipe.transformer).tensor_plan, tp)
    if sharded_load:
        pipe.transformer = tensor.load_sharded_transformer(model, dist.get_rank() % tp, tp, "cpu", torch.float32)
    parallelize(pipe, ParallelConfig(**config))
    param_bytes = tensor.parameter_bytes(pipe.transformer)
    calls, per_block, handles = _counters(pipe.transformer)
    from cases_models import call_kwargs

    final = {}
    kwargs = call_kwargs(final, steps, height, width, frames, max_sequence_length, guidance_scale)
    with count_collectives() as counts:
        pipe(prompt="a red circle", **kwargs)
    for h in handles:
        h.remove()
    return dict(latents=final["latents"], counts=dict(counts), calls=calls, per_block=per_block,
                param_bytes=param_bytes, expected_bytes=replicated + sharded // tp,
                sharded_norm_bytes=sum(p.numel() * p.element_size() for n, p in pipe.transformer.named_parameters()
                                       if ".norm_q." in n or ".norm_k." in n))


def sharded_rms_norm_case(width: int = 48, eps: float = 1e-6):
    """A Wan-style RMSNorm over ``width`` features split over the world: the sharded norm (mean square summed over
    ranks) vs a per-rank local norm, both against the full norm's slice. Returns (rel err sharded, rel err local,
    all-reduces issued by the sharded norm)."""
    from ditmesh.comm import count_collectives
    from ditmesh.parallel.tensor import LinearShard, ShardedRMSNorm, take

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    full = torch.nn.RMSNorm(width, eps=eps)
    with torch.no_grad():
        full.weight.copy_(torch.randn(width, generator=g))
    # channels with very different scales per rank, so a local mean square is visibly wrong
    x = torch.randn(2, 7, width, generator=g) * torch.linspace(0.1, 3.0, width)
    ranges = LinearShard("norm", (width,)).ranges(rank, world)
    ref = take(full(x), -1, ranges)
    local = torch.nn.RMSNorm(width // world, eps=eps)
    with torch.no_grad():
        local.weight.copy_(take(full.weight, 0, ranges))
    sharded = ShardedRMSNorm(local, width, dist.group.WORLD)
    xr = take(x, -1, ranges)
    with torch.no_grad(), count_collectives() as counts:
        out = sharded(xr)
    err = lambda y: float((y - ref).norm() / ref.norm())  # noqa: E731
    with torch.no_grad():
        return err(out), err(local(xr)), dict(counts)
