"""Functions executed on every rank of a gloo worker pool (module-level so workers can import them), and `load_script`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """The module of ``scripts/<name>.py``, imported from its file (the scripts folder is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def world_info():
    return dist.get_rank(), dist.get_world_size()


def rank_zero_fails_case():
    """Rank 0 raises; every other rank then waits in a barrier rank 0 never joins."""
    if dist.get_rank() == 0:
        raise ValueError("rank 0 fails before the barrier")
    dist.barrier()


def rank_one_dies_case(how: str):
    """Rank 1's process ends without an answer (``kill``: SIGKILL, as the out-of-memory killer sends; ``crash``: a
    segmentation fault); rank 0 waits in a barrier rank 1 never reaches."""
    if dist.get_rank() == 1:
        import faulthandler
        import os
        import signal

        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        faulthandler._sigsegv()
    dist.barrier()


def os_threads() -> int:
    """This process's threads (/proc: gloo's own threads count too)."""
    import os

    return len(os.listdir("/proc/self/task"))


def new_groups_case(n: int) -> float:
    """Create ``n`` process groups over every rank and all-reduce on each; returns the last sum."""
    total = torch.ones(1)
    for _ in range(n):
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(total, group=group)
    return float(total)


def gathers_case():
    """``all_gather_start`` over this rank's own one-rank group and over the default group, and
    ``all_gather_object``: each one's result and the collectives it counted."""
    from ditmesh.comm import all_gather_object, all_gather_start, count_collectives, wait

    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group, in order
    x = torch.full((1, 3), float(rank))
    with count_collectives() as counts:
        own = wait(all_gather_start(x, alone))
        every = wait(all_gather_start(x, None))
        objects = all_gather_object({"rank": rank})
    return own.tolist(), every.tolist(), objects, dict(counts)


def ulysses_attention_case(seq_len: int, heads: int, seed: int = 0, chunks: int = 1, batch: int = 2):
    """Ulysses attention on random shards vs full attention computed locally.

    Returns the rel. error, the collective counts, the heads of each local attention call (one per head
    group), and the number of ``aten.cat`` calls inside (the copies that join received chunks).
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    import torch.nn.functional as F

    from ditmesh.attention.ulysses import ulysses_attention
    from ditmesh.comm import count_collectives, split_sizes

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, 8, generator=g) for _ in range(3))
    sizes = split_sizes(seq_len, world)
    start = sum(sizes[:rank])
    shard = lambda t: t[:, start : start + sizes[rank]]  # noqa: E731

    calls, cats = [], []

    class CountCats(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.cat.default:
                cats.append(1)
            return func(*args, **(kwargs or {}))

    def local(q_, k_, v_):
        calls.append(q_.shape[-2])
        return F.scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2)).transpose(1, 2)

    with count_collectives() as counts, CountCats():
        out = ulysses_attention(shard(q), shard(k), shard(v), sizes, rank, dist.group.WORLD, local, chunks)
    ref = shard(local(q, k, v))
    return float((out - ref).norm() / ref.norm()), dict(counts), calls[:-1], len(cats)


def flux_generate(model: str, config: dict, steps: int = 2, height: int = 64, width: int = 64, prompt: str = "a red circle",
                  check_consistency: bool = False, count: bool = False, compile: bool = False, chunks: int = 1,
                  fuse_qkv: bool = False, options: dict | None = None, emulate: dict | None = None):
    """Run a FluxPipeline with ditmesh on this rank; returns (final latents, collective counts per transformer call).

    ``options``: more keywords of ``parallelize``; then the bytes sent by (kind, dtype) are returned third.
    ``emulate``: keywords of ``parallel.eight.emulate_fp8_comm`` (one process emulating fp8 payloads)."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import BYTES, count_collectives
    from ditmesh.parallel.eight import emulate_fp8_comm

    torch.manual_seed(0)
    pipe = FluxPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    runtime = parallelize(pipe, ParallelConfig(**config), check_consistency=check_consistency, compile=compile,
                          ulysses_chunks=chunks, fuse_qkv=fuse_qkv, **(options or {}))
    if emulate:
        emulate_fp8_comm(runtime, **emulate)
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    with count_collectives() as counts, count_collectives(BYTES) as sent:
        pipe(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=3.5,
             generator=torch.Generator().manual_seed(42), max_sequence_length=32, output_type="latent",
             callback_on_step_end=grab)
    if options is not None:
        return final["latents"], dict(counts), dict(sent)
    return final["latents"], dict(counts)


def diverging_ranks_case(model: str):
    """Each rank uses a different seed: the consistency check must stop the run on every rank."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.parallel.consistency import RankDivergenceError

    pipe = FluxPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    parallelize(pipe, ParallelConfig(ulysses=dist.get_world_size()), check_consistency=True)
    try:
        pipe("a red circle", height=64, width=64, num_inference_steps=1, max_sequence_length=32, output_type="latent",
             generator=torch.Generator().manual_seed(dist.get_rank()))
    except RankDivergenceError as exc:
        return str(exc)
    return None


def rerun_capture(fn):
    """A stand-in for CUDA graph capture on CPU: each replay re-runs ``fn`` on the captured input buffers
    and writes the result into the captured output in place, as a graph replay does."""
    from torch.utils import _pytree as pytree

    out = fn()

    def replay():
        for dst, src in zip(pytree.tree_leaves(out), pytree.tree_leaves(fn())):
            dst.copy_(src)

    return replay, out


def flux_graphed_generate(model: str, config: dict, steps: int = 3):
    """flux_generate with the transformer call wrapped by GraphedCall (capture = rerun_capture)."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.hooks import add_hook
    from ditmesh.parallel.graph import GraphHook

    torch.manual_seed(0)
    pipe = FluxPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    parallelize(pipe, ParallelConfig(**config))
    hook = GraphHook(capture=rerun_capture, devices=("cpu",))
    add_hook(pipe.transformer, hook)
    latents = pipe("a red circle", height=48, width=48, num_inference_steps=steps, guidance_scale=3.5,
                   generator=torch.Generator().manual_seed(42), max_sequence_length=32, output_type="latent").images
    entries = [(e.calls, e.replay is not None, e.failed) for e in hook.graphed.entries.values()]
    return latents, entries
