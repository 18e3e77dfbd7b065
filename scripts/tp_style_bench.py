"""Tensor-parallel styles on one FLUX double block + one single block: ditmesh's plain sliced weights vs DTensor.

Both variants shard the same linears with the same FLUX plan (``ditmesh.models.flux.FLUX_TENSOR_PLAN``):
- ``plain``: ``ditmesh.parallel.tensor`` (sliced ``nn.Linear`` weights, one functional all-reduce per
  row-parallel linear, bias added after it);
- ``dtensor``: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel``; the packed single-block ``proj_out`` gets its input columns permuted to rank-major
  order first, so that a plain ``RowwiseParallel`` splits it correctly.

Prints one JSON line per style and mode: milliseconds per (double + single) block, relative error against the
unsharded blocks, and peak memory. Run on GPUs (every rank builds the same seeded blocks):

    torchrun --nproc-per-node 2 scripts/tp_style_bench.py --arch flux-dev --height 1024 --width 1024
    torchrun --nproc-per-node 4 scripts/tp_style_bench.py --arch flux-dev --height 1024 --width 1024 --compile

and on CPU as a correctness smoke test:  torchrun --nproc-per-node 2 scripts/tp_style_bench.py --arch flux-tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist

from ditmesh.testing import rel_err


def build_blocks(arch_name: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """One double and one single FLUX block named like the full model, so the model's plan matches them."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    from ditmesh.synth import ARCHS

    cfg = ARCHS[arch_name].transformer
    dim, heads, head_dim = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["num_attention_heads"], cfg["attention_head_dim"]
    torch.manual_seed(0)
    blocks = torch.nn.Module()
    blocks.transformer_blocks = torch.nn.ModuleList([FluxTransformerBlock(dim, heads, head_dim)])
    blocks.single_transformer_blocks = torch.nn.ModuleList([FluxSingleTransformerBlock(dim, heads, head_dim)])
    for p in blocks.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.ndim == 2 else 0.02)
    blocks.num_heads, blocks.rope_axes = heads, cfg["axes_dims_rope"]
    return blocks.to(device, dtype).eval().requires_grad_(False)


def make_inputs(blocks, height: int, width: int, text_len: int, dtype, device):
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    dim = blocks.transformer_blocks[0].attn.to_q.in_features
    g = torch.Generator().manual_seed(1)
    image_len = (height // 16) * (width // 16)
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    ids = torch.zeros(text_len + image_len, 3)
    ids[text_len:, 1] = torch.arange(image_len) // (width // 16)
    ids[text_len:, 2] = torch.arange(image_len) % (width // 16)
    rotary = FluxPosEmbed(10000, blocks.rope_axes)(ids.to(device))
    return rand(1, image_len, dim), rand(1, text_len, dim), rand(1, dim), rotary


def run_blocks(blocks, hidden, text, temb, rotary):
    text, hidden = blocks.transformer_blocks[0](hidden, text, temb, rotary)
    text, hidden = blocks.single_transformer_blocks[0](hidden, text, temb, rotary)
    return hidden


def plain_style(blocks, rank, size, group):
    from ditmesh.models.flux import FLUX_TENSOR_PLAN
    from ditmesh.parallel import tensor

    shards = tensor.shard_model(blocks, FLUX_TENSOR_PLAN, rank, size)
    tensor.install_all_reduces(blocks, shards, group)
    return blocks


def dtensor_style(blocks, rank, size, device_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ditmesh.models.flux import FLUX_TENSOR_PLAN
    from ditmesh.parallel import tensor

    shards = tensor.resolve_plan(blocks, FLUX_TENSOR_PLAN, size)
    plan = {}
    for name, shard in shards.items():
        if shard.kind == "packed_rowwise":
            # Rank-major order of the packed columns: [r0 part0, r0 part1, r1 part0, ...]; a contiguous
            # Shard(-1) of that is exactly the packed split.
            linear = blocks.get_submodule(name)
            order = [tensor.take(torch.arange(linear.in_features), 0, shard.ranges(r, size)) for r in range(size)]
            linear.weight.data = linear.weight.data[:, torch.cat(order)].contiguous()
        plan[name] = ColwiseParallel() if shard.kind == "colwise" else RowwiseParallel()
    parallelize_module(blocks, device_mesh, plan)
    for name, module in blocks.named_modules():
        if name.endswith(".attn"):
            module.heads //= size
    return blocks


def time_ms(fn, iters: int, device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1000 / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="flux-dev")
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU by default")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd variants")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("tp",))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)

    full = build_blocks(args.arch, dtype, device)
    inputs = make_inputs(full, args.height, args.width, args.text_len, dtype, device)
    with torch.no_grad():
        ref = run_blocks(full, *inputs).float()
        ref_ms = time_ms(lambda: run_blocks(full, *inputs), args.iters, device)
    variants = {"plain": lambda b: plain_style(b, rank, size, mesh["tp"].get_group()),
                "dtensor": lambda b: dtensor_style(b, rank, size, mesh["tp"])}
    rows = [dict(style="unsharded", mode="eager", ms=round(ref_ms, 3))]
    for style, make in variants.items():
        blocks = make(copy.deepcopy(full))
        modes = {"eager": lambda b=blocks: run_blocks(b, *inputs)}
        if args.compile:
            compiled = torch.compile(lambda *a, b=blocks: run_blocks(b, *a))
            modes["compile"] = lambda: compiled(*inputs)
        for mode, fn in modes.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                out = fn()
                out = (out.full_tensor() if hasattr(out, "full_tensor") else out).float()
                ms = time_ms(fn, args.iters, device)
            rows.append(dict(style=style, mode=mode, ms=round(ms, 3), rel_err=rel_err(out, ref),
                             peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if cuda else None))
        del blocks
    if rank == 0:
        for row in rows:
            print(json.dumps(dict(row, arch=args.arch, tp=size, tokens=inputs[0].shape[1] + args.text_len,
                                  dtype=str(dtype).replace("torch.", ""),
                                  device=torch.cuda.get_device_name(device) if cuda else "cpu")), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
