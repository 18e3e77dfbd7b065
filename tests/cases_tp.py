"""Tensor-parallel cases executed on every rank of a gloo worker pool (module-level so workers can import them)."""

from __future__ import annotations

import collections
import copy
import os

import torch
import torch.distributed as dist

from ditmesh.testing import rel_err


def _block_counters(transformer):
    """Hooks that record the collectives each transformer block issues during the first transformer call."""
    from ditmesh.comm import COUNTS

    per_block: dict[str, collections.Counter] = {}
    handles, before = [], {}
    blocks = [(f"transformer_blocks.{i}", b) for i, b in enumerate(transformer.transformer_blocks)]
    blocks += [(f"single_transformer_blocks.{i}", b) for i, b in enumerate(transformer.single_transformer_blocks)]
    blocks.append(("transformer", transformer))
    for name, block in blocks:
        def pre(module, args, name=name):
            before[name] = collections.Counter(COUNTS)

        def post(module, args, output, name=name):
            if name not in per_block:
                per_block[name] = collections.Counter({k: v - before[name].get(k, 0) for k, v in COUNTS.items()
                                                       if v - before[name].get(k, 0)})

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return per_block, handles


def tp_pipeline_case(model: str, config: dict, steps: int = 2, height: int = 64, width: int = 64,
                     text_encoders: str | None = None, sharded_load: bool = False, remove: bool = False):
    """FluxPipeline under ``config`` on this rank. Returns a dict with the final latents, collectives of the whole
    call, collectives per block of the first transformer call, parameter bytes (this rank / expected), and
    whether this rank still holds text encoders."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.models.flux import FLUX_TENSOR_PLAN
    from ditmesh.parallel import tensor

    tp = config.get("tp", 1)
    torch.manual_seed(0)
    pipe = FluxPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    replicated, sharded = tensor.partition_bytes(pipe.transformer, FLUX_TENSOR_PLAN, tp)
    full_state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()} if remove else None
    if sharded_load:
        pipe.transformer = tensor.load_sharded_transformer(model, dist.get_rank() % tp, tp, "cpu", torch.float32)
    if text_encoders:
        os.environ[tensor.TEXT_ENCODERS_ENV] = text_encoders
    try:
        runtime = parallelize(pipe, ParallelConfig(**config))
    finally:
        os.environ.pop(tensor.TEXT_ENCODERS_ENV, None)
    param_bytes = tensor.parameter_bytes(pipe.transformer)
    per_block, handles = _block_counters(pipe.transformer)
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    with count_collectives() as counts:
        pipe("a red circle", height=height, width=width, num_inference_steps=steps, guidance_scale=3.5,
             generator=torch.Generator().manual_seed(42), max_sequence_length=32, output_type="latent",
             callback_on_step_end=grab)
    for h in handles:
        h.remove()
    restored = None
    if remove:
        runtime.remove()
        state = pipe.transformer.state_dict()
        restored = set(state) == set(full_state) and all(torch.equal(state[k], full_state[k]) for k in state)
    return dict(latents=final["latents"], counts=dict(counts), per_block={k: dict(v) for k, v in per_block.items()},
                param_bytes=param_bytes, expected_bytes=replicated + sharded // tp,
                has_text_encoders=pipe.text_encoder_2 is not None, restored=restored)


def packed_proj_out_case(model: str):
    """A FLUX single block under tp = world size: the packed split of ``proj_out`` vs a contiguous split.

    Returns (rel err of the packed split, rel err of a contiguous split), both against the unsharded block.
    """
    from diffusers import FluxTransformer2DModel

    from ditmesh import ParallelConfig
    from ditmesh.mesh import ParallelMesh
    from ditmesh.models.flux import FLUX
    from ditmesh.parallel import tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    transformer = FluxTransformer2DModel.from_pretrained(model, subfolder="transformer")
    full = copy.deepcopy(transformer.single_transformer_blocks[0])
    g = torch.Generator().manual_seed(1)
    dim = transformer.inner_dim
    hidden, text = torch.randn(1, 12, dim, generator=g), torch.randn(1, 5, dim, generator=g)
    temb = torch.randn(1, dim, generator=g)
    ids = torch.cat([torch.zeros(5, 3), torch.randint(0, 8, (12, 3), generator=g).float()])
    rotary = transformer.pos_embed(ids)
    with torch.no_grad():
        ref = full(hidden, text, temb, rotary)[1]
        tensor.apply(transformer, ParallelMesh.build(ParallelConfig(tp=world)), FLUX)
        block = transformer.single_transformer_blocks[0]
        packed = block(hidden, text, temb, rotary)[1]
        # The bug a published FLUX TP script shipped: one contiguous range of proj_out's input columns.
        cols = block.proj_out.in_features
        block.proj_out.weight.copy_(full.proj_out.weight[:, rank * cols:(rank + 1) * cols])
        contiguous = block(hidden, text, temb, rotary)[1]
    return rel_err(packed, ref), rel_err(contiguous, ref)


def sharded_load_case(model: str, tp: int):
    """Load this rank's shard from safetensors and compare it with slicing the fully loaded model."""
    from diffusers import FluxTransformer2DModel

    from ditmesh.models.flux import FLUX_TENSOR_PLAN
    from ditmesh.parallel import tensor

    rank = dist.get_rank() % tp
    loaded = tensor.load_sharded_transformer(model, rank, tp, "cpu", torch.float32)
    sliced = FluxTransformer2DModel.from_pretrained(model, subfolder="transformer")
    tensor.shard_model(sliced, FLUX_TENSOR_PLAN, rank, tp)
    a, b = loaded.state_dict(), sliced.state_dict()
    same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    heads = {m.heads for n, m in loaded.named_modules() if n.endswith(".attn")}
    return same, heads, any(p.is_meta for p in loaded.parameters())
