"""``parallelize(pipe, config)``: the one entry point, and ``remove(pipe)``: the way back.

Dimensions are applied in a fixed, logged order: tensor -> (fused Q/K/V) -> LoRA loading -> (chunked
feed-forwards and attention) -> (8-bit attention on one process) -> sequence -> (displaced attention) -> pipefusion -> cfg/data -> (cache) -> VAE -> (VAE pieces) -> (compile) -> (CUDA graph), to every transformer of the pipeline (``transformer``, and ``transformer_2`` where a
pipeline has two, as Wan 2.2 A14B does). The pipeline object is changed in place through named hooks
(``ditmesh.hooks``), attention processors and swapped modules; no pipeline class is forked. Every rank
calls ``pipe(...)`` with the same arguments and gets the same result. The runtime of a parallelized
pipeline hangs on its transformers' ``context`` hooks, not on an attribute of the user's objects, so it lives
exactly as long as they do.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import cache as step_cache
from . import fusion, symm
from . import models as _models  # noqa: F401  (registers adapters)
from .attention.ulysses import TRANSPORTS
from .config import (AXIS_ORDER, PP_CHUNK_BYTES, ConfigError, ParallelConfig,  # noqa: F401
                     check_chunk, check_displaced, check_eight_bit, check_pipefusion, check_vae_chunk,
                     check_vae_parallel)
from .hooks import ContextHook, ForwardContext, add_hook, find_hook, registry
from .mesh import ParallelMesh
from .models.base import ModelAdapter, adapter_for, vae_plan_for
from .parallel import batch, chunk, consistency, displaced as displaced_attention, eight, graph, lora, pipefusion, sequence, tensor
from .parallel import vae as parallel_vae
from .parallel import vae_chunk as chunked_vae

log = logging.getLogger("ditmesh")

@dataclass
class ParallelRuntime:
    """What :func:`parallelize` did to a pipeline: the mesh, the per-call context, and how to undo it."""

    config: ParallelConfig
    mesh: ParallelMesh
    #: per-call state shared by every transformer of the pipeline and every dimension
    context: ForwardContext = field(default_factory=ForwardContext)
    #: the parallelized transformers by pipeline component name (``transformer``, ``transformer_2``)
    transformers: dict[str, torch.nn.Module] = field(default_factory=dict)
    #: the step caches by transformer (``ditmesh.cache.StepCache``; empty when caching is off)
    caches: dict = field(default_factory=dict)
    #: the displaced attention runtimes by transformer (``parallel.displaced.Displaced``; empty without displaced)
    displaced: dict = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list)

    def sequence(self, component: str = "transformer"):
        """The sequence-parallel runtime (:class:`~ditmesh.parallel.sequence.SequenceParallel`) of a transformer,
        or None when the sequence-parallel degree is 1."""
        hook = find_hook(self.transformers[component], "sequence")
        return hook.sp if hook is not None else None

    def remove(self) -> None:
        """Give back the pipeline as it was: hooks and processors removed, tensor-parallel shards gathered back
        (packed parts reordered, head counts restored), text encoders put back, compiled blocks uncompiled.

        A transformer loaded as a shard (``load_sharded_transformer``) never held its whole weights: its
        collectives are removed and a RuntimeError says so.
        """
        errors = []
        for fn in reversed(self._undo):
            try:
                fn()
            except RuntimeError as exc:  # undo the rest before reporting
                errors.append(exc)
        self._undo.clear()
        if errors:
            raise errors[0]


def _runtime_of_model(model: torch.nn.Module) -> ParallelRuntime | None:
    # the runtime hangs on the model's own `context` hook, so it lives exactly as long as the model
    hook = find_hook(model, "context")
    return hook.runtime if hook is not None else None


def transformers_of(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's transformers by component name: ``transformer`` and any ``transformer_*`` that is set."""
    components = getattr(pipe, "components", None) or {"transformer": getattr(pipe, "transformer", None)}
    return {name: module for name, module in sorted(components.items())
            if name.startswith("transformer") and isinstance(module, torch.nn.Module)}


def runtime_of(pipe) -> ParallelRuntime | None:
    """The runtime of a pipeline :func:`parallelize` changed, or None."""
    for model in transformers_of(pipe).values():
        runtime = _runtime_of_model(model)
        if runtime is not None:
            return runtime
    return None


def remove(pipe) -> None:
    """Undo :func:`parallelize` on ``pipe`` (see :meth:`ParallelRuntime.remove`); nothing to do is an error."""
    runtime = runtime_of(pipe)
    if runtime is None:
        raise ValueError(f"this {type(pipe).__name__} is not parallelized by ditmesh; nothing to remove")
    runtime.remove()


def check_model(config: ParallelConfig, transformer: torch.nn.Module) -> None:
    """Validate ``config`` against a transformer (head counts); raises :class:`ConfigError`."""
    adapter = adapter_for(transformer)
    config.check_heads(adapter.num_heads(transformer), type(transformer).__name__)
    reason = adapter.unsupported(transformer, config) if adapter.unsupported is not None else None
    if reason:
        raise ConfigError(reason)


def compile_blocks(model: torch.nn.Module, adapter: ModelAdapter | None = None) -> list:
    """Regional compilation: ``torch.compile`` every repeated transformer block, in place.

    The blocks are the adapter's ordered block lists; compiling blocks rather than the whole model keeps
    compile time to one graph per block type and leaves ditmesh's entry/exit hooks outside the graphs. With
    the copy-engine transport, inductor's buffer reuse is off (``symm.COMPILE_OPTIONS``). Returns undo
    callables.
    """
    adapter = adapter or adapter_for(model)
    blocks = adapter.block_modules(model)
    hook = find_hook(model, "sequence")
    # the copy-engine transport returns views of persistent receive buffers: inductor must not reuse them
    options = symm.COMPILE_OPTIONS if hook is not None and hook.sp.transport == "symm" else None
    inner = []
    for block in blocks:
        if find_hook(block, "cache") is not None or find_hook(block, "pipefusion") is not None:
            # a step cache decides on the host around the block, PipeFusion skips it or passes its activations
            # between stages: compile the block's own forward, inside its hooks
            reg = registry(block)
            reg.inner = torch.compile(reg.original(block), options=options)
            inner.append(reg)
        else:
            block.compile(options=options)

    def undo():
        for block in blocks:
            block._compiled_call_impl = None
        for reg in inner:
            reg.inner = None

    return [undo]


def check_cuda_graph(config: ParallelConfig, device: torch.device, check_consistency: bool = False) -> None:
    """Raise :class:`ConfigError` where CUDA graphs cannot run (see ``ditmesh.parallel.graph``)."""
    if device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA device, but this rank runs on {device.type}; drop the graph option")
    if config.dp > 1 or config.cfg > 1:
        raise ConfigError(f"CUDA graphs do not run with dp={config.dp}, cfg={config.cfg} (their hooks choose per call "
                          "what to run); use dp=1 and cfg=1, or drop the graph option")
    if check_consistency:
        raise ConfigError("CUDA graphs do not run with the consistency check (it reads values on the host); "
                          "use one or the other")


def check_pipefusion_options(config: ParallelConfig, *, fuse_qkv: bool = False, cache=None,
                             cuda_graph: bool = False, transport: str = "nccl", displaced: bool = False) -> None:
    """Raise :class:`ConfigError` for an option PipeFusion (pp > 1), or displaced attention (``displaced``), does
    not run with yet. ``cache``: the step cache's :class:`~ditmesh.cache.CacheConfig` (or its text), or None:
    PipeFusion runs static and taylor, displaced attention none."""
    mode, off = ("displaced attention", "drop displaced") if displaced else (f"PipeFusion (pp={config.pp})", "use pp=1")
    policy = step_cache.CacheConfig.parse(cache).policy if isinstance(cache, (str, type(None))) else cache.policy
    for on, option in ((fuse_qkv, "fuse_qkv"), (displaced and policy != "off", "step caching"),
                       (cuda_graph and not displaced, "CUDA graphs"), (transport != "nccl", f"transport={transport}")):
        if on:
            raise ConfigError(f"{option} does not run with {mode} yet; drop it or {off}")
    if policy not in ("off", "static", "taylor"):
        raise ConfigError(f"cache {policy} does not run with PipeFusion (pp={config.pp}): its statistic covers the "
                          "whole image after the first blocks, which no stage holds while patches flow; use static or "
                          "taylor (--cache default is taylor), or pp=1")


def check_ulysses_chunks(chunks: int | None, flag: str = "ulysses_chunks=") -> None:
    """Raise :class:`ConfigError` unless ``chunks`` is None (the default) or at least 1."""
    if chunks is not None and chunks < 1:
        raise ConfigError(f"{flag}{chunks} must be >= 1 (1 = no pipelining)")


def check_transport(transport: str, device: torch.device, flag: str = "transport=",
                    config: ParallelConfig | None = None, local_world: int | None = None) -> None:
    """Raise :class:`ConfigError` unless ``transport`` is one of ``ulysses.TRANSPORTS`` and can run here.

    ``"symm"`` needs CUDA, applies to Ulysses alone (ring and USP move their data through the process
    group), and needs every Ulysses group on one host: the inner mesh axis, so ``ulysses`` must divide the
    ``local_world`` processes of a host (default: torchrun's ``LOCAL_WORLD_SIZE``).
    """
    if transport not in TRANSPORTS:
        raise ConfigError(f"{flag}{transport!r} is not a transport; use one of {', '.join(TRANSPORTS)}")
    if transport != "symm":
        return
    if device.type != "cuda":
        raise ConfigError(f"{flag}symm needs CUDA GPUs (copy engines), not {device.type}; use nccl")
    if config is None:
        return
    if config.ring > 1:
        raise ConfigError(f"{flag}symm moves Ulysses all-to-alls only, and ring={config.ring} is set; use nccl, "
                          "or ring=1")
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
    if local_world % config.ulysses:
        raise ConfigError(f"{flag}symm needs each ulysses={config.ulysses} group on one host, but a host runs "
                          f"{local_world} processes; use nccl across hosts")


def split_vae(pipe, mesh: ParallelMesh, mode: str) -> list:
    """Split the pipeline's VAE along height over every rank (``ditmesh.parallel.vae``); returns undo callables.

    Every rank holds the same final latents (the pipeline call runs whole on each rank; only the transformer call
    is divided), so the ranks that share an image are all of them. ``auto``: on when there are several ranks and
    the family's adapter has a VAE plan for this VAE class, with calls that cannot be split run whole (logged);
    ``on``: the same, but a VAE or a call that cannot be split raises :class:`ConfigError`; ``tiled`` (also on one
    process): diffusers' tiled decode turned on, its tiles spread over every rank and blended as one process blends
    them (``parallel.vae.apply_tiled``); ``off``: nothing.
    """
    check_vae_parallel(mode)
    vae = getattr(pipe, "vae", None)
    if mode == "off" or (mesh.config.world_size == 1 and mode != "tiled"):
        return []
    if not isinstance(vae, torch.nn.Module):
        if mode in ("on", "tiled"):
            raise ConfigError(f"vae_parallel={mode!r}, but {type(pipe).__name__} has no VAE; use auto or off")
        return []
    plan = vae_plan_for(vae)
    if plan is None:
        reason = f"no model adapter has a parallel plan for {type(vae).__name__}"
        if mode in ("on", "tiled"):
            raise ConfigError(f"vae_parallel={mode!r}: {reason}; use auto (runs it whole on every rank) or off")
        log.info("ditmesh: the VAE runs whole on every rank: %s", reason)
        return []
    group = mesh.group_of(*AXIS_ORDER)
    if mode == "tiled":
        return parallel_vae.apply_tiled(vae, plan, group)
    return parallel_vae.apply(vae, plan, group, strict=mode == "on")


def chunk_vae(pipe, rows, device: torch.device) -> list:
    """Run the pipeline's VAE residual blocks and up-samplers on pieces of rows (``ditmesh.parallel.vae_chunk``) in
    the calls the VAE runs whole; returns undo callables. A call split over ranks (:func:`split_vae`, whose hooks are
    installed first) leaves the pieces aside."""
    vae = getattr(pipe, "vae", None)
    if rows is None:
        return []
    if not isinstance(vae, torch.nn.Module):
        raise ConfigError(f"vae_chunk={rows!r}, but {type(pipe).__name__} has no VAE; leave vae_chunk off")
    split = [h for h in (find_hook(vae, "vae", m) for m in ("decode", "_encode")) if h is not None]
    return chunked_vae.apply(vae, rows, device, lambda: any(h.state.units is not None for h in split))


def parallelize(pipe, config: ParallelConfig, *, check_consistency: bool = False, device=None,
                compile: bool = False, cuda_graph: bool = False, ulysses_chunks: int | None = None,
                fuse_qkv: bool = False, transport: str = "nccl", cache=None,
                vae_parallel: str = "auto", chunk_tokens: int | str | None = None,
                vae_chunk: int | str | None = None, pp_patches: int | None = None, pp_warmup: int = 1,
                pp_chunk_bytes: int = PP_CHUNK_BYTES, displaced: bool = False,
                displaced_warmup: int = 1, comm_dtype: str = "auto", attention: str = "exact",
                attention_bf16_steps: int = 0) -> ParallelRuntime:
    """Make a diffusers pipeline run with ``config`` across the ranks of the default process group.

    Call it on every rank, after ``torch.distributed.init_process_group`` (not needed for one
    process) and after moving the pipeline to this rank's device.

    Args:
        pipe: a diffusers pipeline with a ``transformer`` (e.g. ``FluxPipeline``); a second transformer
            (``transformer_2``) is parallelized the same way. A pipeline is parallelized once: call
            :func:`remove` before parallelizing it again.
        config: the degrees; their product must equal the world size.
        check_consistency: debug mode: before every transformer call, verify that timestep, latents
            and text embeddings are bit-identical on every rank (raises on the first mismatch).
        device: this rank's device (default: ``cuda:LOCAL_RANK`` or CPU).
        compile: ``torch.compile`` each transformer block (regional), after the parallel dimensions.
        cuda_graph: replay each transformer call from a CUDA graph (``ditmesh.parallel.graph``), the last
            step of the fixed order; CUDA only, and not with ``dp``/``cfg`` > 1 or ``check_consistency``.
        ulysses_chunks: head groups each Ulysses attention pipelines against its all-to-alls (1 = none;
            default 2 on CUDA in eager mode, else 1: ``sequence.default_chunks``). Ulysses alone: USP's
            Ulysses part runs one group.
        fuse_qkv: compute each self-attention's Q, K and V with one GEMM (``ditmesh.fusion``; FLUX and Wan),
            after tensor parallelism, with no extra weight memory. Off by default: on 4x H200 (FLUX 1024²,
            compiled, CUDA graph) it gained nothing, and with two head groups it lost their overlap
            (docs/lab/ulysses-overlap.md).
        transport: how Ulysses all-to-alls travel: ``"nccl"`` (NCCL kernels; any backend) or ``"symm"``
            (copy engines writing into the peers' symmetric memory, ``ditmesh.symm``; CUDA GPUs of one host;
            Ulysses alone). With ``"symm"``, compile through ``compile=True``: a ``torch.compile`` of your own
            around the model must pass ``options=ditmesh.symm.COMPILE_OPTIONS`` (see that module).
        cache: step caching (``ditmesh.cache``): a :class:`~ditmesh.cache.CacheConfig` or its text form, e.g.
            ``"fbcache:0.08"`` or ``"dbcache:threshold=0.1,first=2,last=1"``; decisions are taken on statistics
            reduced over the ranks that share a computation, so every rank agrees. With ``compile``, each block's
            own forward is compiled inside the cache's hooks. With ``cuda_graph``, static and taylor replay one
            whole-call graph per path; dbcache and teacache replay each call from three graphs cut at the decision
            (``ditmesh.parallel.graph``).
        vae_parallel: ``"auto"`` (default), ``"on"`` or ``"off"``: decode (and encode) with the VAE split along
            height over every rank, exact (``ditmesh.parallel.vae``; see :func:`split_vae`); ``"tiled"``: diffusers'
            tiled decode with its tiles spread over the ranks, equal to the tiled decode of one process.
        chunk_tokens: run each block's feed-forward on pieces of at most this many tokens, and its attention on
            pieces of at most this many queries (each against all keys; after the all-to-all under sequence
            parallelism): exact, and caps the widest activations of a long sequence. ``"auto"`` sizes the pieces from
            free CUDA memory; None (default): whole (``ditmesh.parallel.chunk``).
        vae_chunk: run the VAE's residual blocks and up-samplers on pieces of at most this many rows of their input,
            with halo rows (exact; lowers the peak memory of a decode that runs whole, e.g. on one GPU), ``"auto"``
            to size the pieces from free CUDA memory, or None (default): whole (``ditmesh.parallel.vae_chunk``;
            see :func:`chunk_vae`).
        pp_patches: PipeFusion (``config.pp`` > 1): patches the image (video) tokens are cut into, at least ``pp``
            (default ``pp``; uneven where they do not divide the tokens). ``ditmesh.parallel.pipefusion``.
        pp_warmup: PipeFusion: steps of each run computed exactly (default 1, at least 1); the later steps read
            one-step-stale K/V for the patches not yet computed in the step (an approximation).
        pp_chunk_bytes: PipeFusion: the largest single point-to-point message (default 64 MiB); larger
            activations travel in pieces.
        displaced: displaced patch parallelism over the ulysses axis (``ditmesh.parallel.displaced``): each rank
            attends to the other ranks' K/V of the previous step, gathered while the step computes (an
            approximation after the warm-up); needs ulysses > 1 and ring = 1, not with pp.
        displaced_warmup: displaced: steps of each run computed exactly (default 1, at least 1).
        comm_dtype: ``"auto"`` (default: payloads in the activations' dtype) or ``"fp8"``: the Ulysses all-to-alls (Q/K/V
            in, the attention output back) and the ring's K/V chunks travel as float8_e4m3fn with a float32 scale per
            token and head, dequantized on arrival (``comm.fp8_pack``); needs ulysses or ring > 1; not with pp,
            displaced or transport=symm (docs/quantization.md).
        attention: ``"exact"`` (default), ``"int8"``: Q and K in int8 per token and head, a Triton kernel (CUDA;
            ``attention.int8``), or ``"int8-emulated"``: its rounding in float32 math (any device; for tests and
            quality measurements). On one process or under ulysses alone; no attention masks.
        attention_bf16_steps: with the 8-bit attention, the first and last this many steps of each run attend exactly
            (default 0); not with CUDA graphs.
    """
    models = transformers_of(pipe)
    if not models:
        raise ConfigError(f"{type(pipe).__name__} has no transformer; ditmesh parallelizes DiT pipelines")
    offloaded = [name for name, m in models.items() if any(hasattr(sub, "_hf_hook") for sub in m.modules())]
    if offloaded:
        raise ConfigError(f"{', '.join(offloaded)} carries accelerate offload hooks (enable_model_cpu_offload or "
                          "enable_sequential_cpu_offload), which replace forward; parallelize without offloading "
                          "(ditmesh spreads the model over the GPUs instead)")
    done = [runtime for runtime in map(_runtime_of_model, models.values()) if runtime is not None]
    if done:
        raise ConfigError(f"this pipeline is already parallelized ({done[0].config.describe()}); call "
                          "ditmesh.remove(pipe) first to parallelize it again with another configuration")
    for model in models.values():
        check_model(config, model)
    first = next(iter(models.values()))
    if device is None:
        device = next(first.parameters()).device
    if cuda_graph:
        for model in models.values():
            adapter = adapter_for(model)
            if adapter.graph_refusal:
                raise ConfigError(f"CUDA graphs do not run {adapter.name}: {adapter.graph_refusal}; drop the graph option")
        check_cuda_graph(config, torch.device(device), check_consistency)
    check_ulysses_chunks(ulysses_chunks)
    check_transport(transport, torch.device(device), config=config)
    check_eight_bit(config, comm_dtype, attention, attention_bf16_steps, torch.device(device).type, transport,
                    displaced, cuda_graph)
    if attention == "int8":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ConfigError("attention=int8 runs a Triton kernel and triton is not installed here; install triton "
                              "or use attention=exact") from None
    check_vae_parallel(vae_parallel)
    check_chunk(chunk_tokens, "chunk_tokens=")
    check_vae_chunk(vae_chunk)
    cache_config = cache if isinstance(cache, step_cache.CacheConfig) else step_cache.CacheConfig.parse(cache)
    if config.pp > 1:
        check_pipefusion(config.pp, pp_patches, pp_warmup, pp_chunk_bytes)
        check_pipefusion_options(config, fuse_qkv=fuse_qkv, cache=cache_config, cuda_graph=cuda_graph,
                                 transport=transport)
        for model in models.values():
            pipefusion.check_blocks(adapter_for(model))
    if displaced:
        for model in models.values():
            displaced_attention.check_family(adapter_for(model))
        check_pipefusion_options(config, fuse_qkv=fuse_qkv, cache=cache_config, cuda_graph=cuda_graph,
                                 transport=transport, displaced=True)
        check_displaced(config, displaced_warmup)
    mesh = ParallelMesh.build(config, torch.device(device))
    runtime = ParallelRuntime(config=config, mesh=mesh, transformers=models)
    ctx = runtime.context
    pieces = chunk.query_chunks(chunk_tokens, torch.device(device))  # attention's query pieces, shared by the models
    eight_local = (None if attention == "exact" else
                   eight.EightBitAttention(attention, attention_bf16_steps, ctx, chunks=pieces))
    check = check_consistency and dist.is_initialized() and dist.get_world_size() > 1

    def each(step):
        """``step(model, adapter)`` on every transformer; each one's undo callables are kept as soon as they exist,
        so a failure on a later transformer (or a later part of the step) still undoes the earlier ones."""
        for model in models.values():
            runtime._undo.extend(step(model, adapter_for(model)))

    def keep(undo):
        runtime._undo.extend(undo)

    def graph_step(model, adapter):
        """A whole-call graph per call signature; with a step cache, per branch and planned path (static, taylor), or
        cut in three graphs at the decision where the path is decided inside the call (dbcache, teacache)."""
        cache, shifted = (next((c for name, c in found.items() if runtime.transformers[name] is model), None)
                          for found in (runtime.caches, runtime.displaced))
        return graph.apply(model, cache=cache, displaced=shifted)

    def displaced_step(name, model):
        runtime.displaced[name], undo = displaced_attention.apply(
            model, runtime.sequence(name), adapter_for(model), ctx, name, displaced_warmup, cuda_graph)
        keep(undo)

    # The fixed order: tensor -> (fused projections) -> lora -> chunk -> (8-bit attention) -> sequence -> (displaced) -> pipefusion -> cfg/data -> cache -> vae -> vae_chunk
    # -> compile -> graph. Every step does nothing at degree 1 and leaves the callables that undo it in runtime._undo.
    # The `lora` hooks let an adapter loaded later (pipe.load_lora_weights) fit the shards (ditmesh.parallel.lora). Hooks take
    # their place in the call chain from hooks.ORDER, whatever order they are added in.
    steps = [
        ("context", lambda: each(lambda m, a: [add_hook(m, ContextHook(ctx, pipe, runtime))])),
        (f"tensor(tp={config.tp})", lambda: (each(lambda m, a: tensor.apply(m, mesh, a)),
                                             keep(tensor.encode_once(pipe, mesh)))),
        ("fuse(qkv)", lambda: each(fusion.fuse_qkv) if fuse_qkv else None),
        ("lora", lambda: keep(lora.apply(pipe, models, mesh))),
        (f"chunk({chunk_tokens})", lambda: each(lambda m, a: chunk.apply(
            m, a, chunk_tokens, torch.device(device), pieces if config.sp == 1 and eight_local is None else None))),
        (f"attention({attention}, exact steps={attention_bf16_steps})",
         lambda: each(lambda m, a: eight.apply(m, a, eight.OneProcessAttention(eight_local, pieces)))
         if eight_local is not None and config.sp == 1 else None),
        (f"sequence(ring={config.ring}, ulysses={config.ulysses}, comm={comm_dtype})",
         lambda: each(lambda m, a: sequence.apply(m, mesh, a, ctx, ulysses_chunks, compile, transport, pieces,
                                                  comm_dtype, eight_local))),
        (f"displaced(warmup={displaced_warmup})",
         lambda: [displaced_step(name, m) for name, m in models.items()] if displaced else None),
        (f"pipefusion(pp={config.pp})", lambda: [keep(pipefusion.apply(m, mesh, adapter_for(m), ctx, name, pp_patches,
                                                                       pp_warmup, pp_chunk_bytes))
                                                 for name, m in models.items()]),
        (f"batch(dp={config.dp}, cfg={config.cfg})", lambda: each(lambda m, a: batch.apply(pipe, m, mesh, a, ctx))),
        (f"cache({cache_config.policy})", lambda: keep(step_cache.apply(runtime, cache_config))),
        (f"vae({vae_parallel})", lambda: keep(split_vae(pipe, mesh, vae_parallel))),
        (f"vae_chunk({vae_chunk})", lambda: keep(chunk_vae(pipe, vae_chunk, torch.device(device)))),
        ("consistency-check", lambda: each(lambda m, a: consistency.attach_consistency_check(m, ctx)) if check else None),
        ("compile(blocks)", lambda: each(compile_blocks) if compile else None),
        ("cuda-graph", lambda: each(graph_step) if cuda_graph else None),
    ]
    try:
        for name, step in steps:
            before = len(runtime._undo)
            step()
            if len(runtime._undo) > before and name not in ("context", "lora"):  # hooks alone, nothing changed yet
                runtime.applied.append(name)
    except BaseException:
        try:
            runtime.remove()  # a step that fails leaves the pipeline as it was
        except Exception as cleanup:  # noqa: BLE001  (the original error is the one to report)
            log.warning("ditmesh: undoing a failed parallelize: %s", cleanup)
        raise
    log.info("ditmesh: %s applied to %s: %s", config.describe(), ", ".join(f"{n} ({type(m).__name__})" for n, m in
             models.items()), runtime.applied or ["nothing"])
    return runtime
