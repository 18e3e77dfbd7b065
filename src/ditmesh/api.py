"""``parallelize(pipe, config)``: the one entry point, and ``remove(pipe)``: the way back.

Dimensions are applied in a fixed, logged order: tensor -> (fused Q/K/V) -> LoRA loading -> (chunked
feed-forwards and attention) -> (8-bit attention on one process) -> sequence -> (displaced attention) -> pipefusion -> cfg/data -> (cache) -> VAE -> (VAE pieces) -> (8-bit linears) -> (compile) -> (CUDA graph), to every transformer of the pipeline (``transformer``, and ``transformer_2`` where a
pipeline has two, as Wan 2.2 A14B does). The pipeline object is changed in place through named hooks
(``ditmesh.hooks``), attention processors and swapped modules; no pipeline class is forked. Every rank
calls ``pipe(...)`` with the same arguments and gets the same result. The runtime of a parallelized
pipeline hangs on its transformers' ``context`` hooks, not on an attribute of the user's objects, so it lives
exactly as long as they do.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import cache as step_cache
from . import fusion, symm
from . import models as _models  # noqa: F401  (registers adapters)
from .config import AXIS_ORDER, ConfigError, ParallelConfig
from .hooks import ContextHook, ForwardContext, add_hook, bind_kwargs, find_hook, registry
from .mesh import ParallelMesh
from .options import RunOptions
from .models.base import ModelAdapter, adapter_for, vae_plan_for
from .parallel import batch, chunk, consistency, displaced as displaced_attention, eight, graph, lora, pipefusion, sequence, tensor
from .parallel import quant as quantized
from .parallel import vae as parallel_vae
from .parallel import vae_chunk as chunked_vae

log = logging.getLogger("ditmesh")

@dataclass
class ParallelRuntime:
    """What :func:`parallelize` did to a pipeline: the mesh, the per-call context, and how to undo it."""

    config: ParallelConfig
    mesh: ParallelMesh
    #: what it was asked to do
    options: RunOptions = field(default_factory=RunOptions)
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
    """The pipeline's transformers by component name: ``transformer``, any ``transformer_*`` and any ``*_transformer``
    (Ideogram 4's ``unconditional_transformer``) that is set."""
    components = getattr(pipe, "components", None) or {"transformer": getattr(pipe, "transformer", None)}
    return {name: module for name, module in sorted(components.items())
            if (name.startswith("transformer") or name.endswith("_transformer")) and isinstance(module, torch.nn.Module)}


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


def compile_blocks(model: torch.nn.Module, adapter: ModelAdapter | None = None, artifacts=None,
                   artifact_mode: str = "off") -> list:
    """Regional compilation: ``torch.compile`` every repeated transformer block, in place.

    The blocks are the adapter's ordered block lists; compiling blocks rather than the whole model keeps
    compile time to one graph per block type and leaves ditmesh's entry/exit hooks outside the graphs. With
    the copy-engine transport, inductor's buffer reuse is off (``symm.COMPILE_OPTIONS``); with fp8 linears the
    rounding kernels are tuned (``parallel.quant.COMPILE_OPTIONS``). ``artifacts``: the folder
    of this run's compiled blocks kept between processes, read (``artifact_mode`` ``load``) and written
    (``save``) by :mod:`ditmesh.aot`. Returns undo callables.
    """
    from . import aot

    adapter = adapter or adapter_for(model)
    blocks = adapter.block_modules(model)
    hook = find_hook(model, "sequence")
    # the copy-engine transport returns views of persistent receive buffers: inductor must not reuse them
    options = dict(symm.COMPILE_OPTIONS) if hook is not None and hook.sp.transport == "symm" else {}
    # fp8 linears: the activations' rounding kernels tuned (parallel.quant.COMPILE_OPTIONS)
    options.update(next((o for o in map(quantized.compile_options, blocks) if o), {}))
    quantized.install_compile_heuristics(blocks)  # DITMESH_FP8_WIDE_ROWS: their rows reduced in one pass
    options = options or None
    per_class = aot.compilers(blocks, artifacts, artifact_mode, options) if artifacts and artifact_mode != "off" else {}
    inner, routed = [], []
    for block in blocks:
        if find_hook(block, "cache") is not None or find_hook(block, "pipefusion") is not None:
            # a step cache decides on the host around the block, PipeFusion skips it or passes its activations
            # between stages: compile the block's own forward, inside its hooks
            reg = registry(block)
            reg.inner = (functools.partial(per_class[type(block)], block) if type(block) in per_class
                         else torch.compile(reg.original(block), options=options))
            inner.append(reg)
        elif type(block) in per_class and "forward" not in vars(block):
            # no hook of its own: the block's forward runs from the artifact of its class (hooks stay outside)
            block.forward = functools.partial(per_class[type(block)], block)
            routed.append(block)
        else:
            block.compile(options=options)

    handles = [model.get_submodule(spec.path)[0].register_forward_pre_hook(_packed_inputs(spec.packed), with_kwargs=True)
               for spec in adapter.blocks if spec.packed and len(model.get_submodule(spec.path))]

    def undo():
        for block in blocks:
            block._compiled_call_impl = None
        for block in routed:
            vars(block).pop("forward", None)
        for reg in inner:
            reg.inner = None
        for handle in handles:
            handle.remove()

    return [undo]


def _packed_inputs(names: tuple[str, ...]):
    """A forward pre-hook for the first block of a list with ``packed`` inputs (``models.base.BlockList``): those
    inputs copied into one tensor (dim 1, in order) and passed as its slices, the layout every later block of the
    list receives, so that the list's compiled graph is traced once rather than again for the first block's
    contiguous inputs. Runs outside the compiled graph; the values are unchanged."""

    @torch.compiler.disable
    def pre_hook(module, args, kwargs):
        named = dict(bind_kwargs(module.forward, args, kwargs))
        parts = [named.get(name) for name in names]
        if any(not isinstance(p, torch.Tensor) or p.dim() < 2 for p in parts):
            return None
        packed = torch.cat(parts, dim=1)
        at = 0
        for name, part in zip(names, parts):
            named[name] = packed[:, at:at + part.shape[1]]
            at += part.shape[1]
        return (), named

    return pre_hook


def split_vae(pipe, mesh: ParallelMesh, mode: str) -> list:
    """Split the pipeline's VAE along height over every rank (``ditmesh.parallel.vae``); returns undo callables.

    Every rank holds the same final latents (the pipeline call runs whole on each rank; only the transformer call
    is divided), so the ranks that share an image are all of them. ``auto``: on when there are several ranks and
    the family's adapter has a VAE plan for this VAE class, with calls that cannot be split run whole (logged);
    ``on``: the same, but a VAE or a call that cannot be split raises :class:`ConfigError`; ``tiled`` (also on one
    process): diffusers' tiled decode turned on, its tiles spread over every rank and blended as one process blends
    them (``parallel.vae.apply_tiled``); ``off``: nothing.
    """
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


def load_loras(pipe, options: RunOptions, keep) -> None:
    """Load ``options.loras`` into the parallelized pipeline (``parallel.lora``), fused if ``options.fuse_lora``;
    ``keep`` takes the undo (unfused adapters are unloaded; fused ones stay in the weights, as fusing is meant)."""
    if not options.loras:
        return
    lora.load(pipe, options.loras)
    if options.fuse_lora:
        lora.fuse(pipe)
    else:
        keep([pipe.unload_lora_weights])


def quantize_step(pipe, runtime: ParallelRuntime, keep) -> None:
    """The ``quant`` step (``parallel.quant``): every transformer's block linears in 8 bits, each tensor-parallel
    shard on its own with the scales of one process. Fused LoRAs are loaded and fused first, so their sum with the
    base weights is what is quantized (the ``loras`` step then has nothing left to do)."""
    options, mesh = runtime.options, runtime.mesh
    load_loras(pipe, options, keep)
    group = mesh.group("tp") if mesh.size("tp") > 1 else None
    for model in runtime.transformers.values():
        keep(quantized.apply(model, adapter_for(model), options.quant, tp_group=group,
                             quantize_modulation=options.quantized_modulation, backend=options.quant_backend))


def parallelize(pipe, options: RunOptions | ParallelConfig | None = None, *, device=None,
                **keywords) -> ParallelRuntime:
    """Make a diffusers pipeline run as ``options`` describe across the ranks of the default process group.

    Call it on every rank, after ``torch.distributed.init_process_group`` (not needed for one
    process) and after moving the pipeline to this rank's device.

    Args:
        pipe: a diffusers pipeline with a ``transformer`` (e.g. ``FluxPipeline``); a second transformer
            (``transformer_2``) is parallelized the same way. A pipeline is parallelized once: call
            :func:`remove` before parallelizing it again.
        options: a :class:`~ditmesh.options.RunOptions` (``RunOptions.create(ParallelConfig(ulysses=2),
            compile=True)``), checked again here against the device and the transformers. The keyword form
            ``parallelize(pipe, ParallelConfig(...), compile=True, ...)`` builds it from the degrees and the
            options below.
        device: this rank's device (default: the transformer's).

    The options (fields of ``RunOptions``):
        config: the degrees; their product must equal the world size.
        check_consistency: debug mode: before every transformer call, verify that timestep, latents
            and text embeddings are bit-identical on every rank (raises on the first mismatch).
        compile: ``torch.compile`` each transformer block (regional), after the parallel dimensions.
        compile_artifacts: with ``compile``, ``"save"`` the compiled blocks or ``"load"`` those a save left, so a
            later process traces nothing (``ditmesh.aot``); default ``"off"``.
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
        cache: step caching (``ditmesh.cache``): a :class:`~ditmesh.options.CacheConfig` or its text form, e.g.
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
        loras: LoRA adapters (``PATH[:SCALE]`` or ``NAME=PATH[:SCALE]``) loaded once the pipeline is parallelized
            (under tensor parallelism each rank keeps its shard: ``ditmesh.parallel.lora``); ``fuse_lora``: fused
            into the weights with their scales and peft's layers taken out.
        comm_dtype: ``"auto"`` (default: payloads in the activations' dtype) or ``"fp8"``: the Ulysses all-to-alls (Q/K/V
            in, the attention output back) and the ring's K/V chunks travel as float8_e4m3fn with a float32 scale per
            token and head, dequantized on arrival (``comm.fp8_pack``); needs ulysses or ring > 1; not with pp,
            displaced or transport=symm (docs/quantization.md).
        attention: ``"default"`` (the backend's exact kernels), ``"fp8"``: Q, K, V and P in float8 with one scale
            per sample, cuDNN's fused fp8 attention (Hopper or newer; ``attention.fp8``), or ``"fp8-emulated"``: its
            rounding in float32 math (any device; for tests and quality measurements). On one process or under
            ulysses alone; no attention masks. (``"int8"`` was retired: slower than the exact attention.)
        attention_bf16_steps: with the 8-bit attention, the first and last this many steps of each run attend exactly
            (default 0); not with CUDA graphs.
    """
    if not isinstance(options, RunOptions):  # the keyword form: degrees and options as keywords
        options = RunOptions.create(options, **keywords)
    elif keywords:
        raise TypeError(f"parallelize(pipe, options) takes the options in the RunOptions; got also "
                        f"{', '.join(sorted(keywords))} (use options.replace(...))")
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
    first = next(iter(models.values()))
    if device is None:
        device = next(first.parameters()).device
    device = torch.device(device)
    options.validate(device=device, models=models)
    config, cache_config = options.config, options.cache
    (compile, cuda_graph, ulysses_chunks, fuse_qkv, transport, vae_parallel, chunk_tokens, vae_chunk, pp_patches,
     pp_warmup, pp_chunk_bytes, displaced, displaced_warmup) = (
        options.compile, options.cuda_graph, options.ulysses_chunks, options.fuse_qkv, options.transport,
        options.vae_parallel, options.chunk_tokens, options.vae_chunk, options.pp_patches, options.pp_warmup,
        options.pp_chunk_bytes, options.displaced, options.displaced_warmup)
    mesh = ParallelMesh.build(config, torch.device(device))
    runtime = ParallelRuntime(config=config, mesh=mesh, transformers=models, options=options)
    ctx = runtime.context
    pieces = chunk.query_chunks(chunk_tokens, torch.device(device))  # attention's query pieces, shared by the models
    eight_local = (None if options.attention == "default" else
                   eight.EightBitAttention(options.attention, options.attention_bf16_steps, ctx, chunks=pieces,
                                           group=eight.scale_group(mesh)))
    check = options.check_consistency and dist.is_initialized() and dist.get_world_size() > 1

    def each(step):
        """``step(model, adapter)`` on every transformer; each one's undo callables are kept as soon as they exist,
        so a failure on a later transformer (or a later part of the step) still undoes the earlier ones."""
        for model in models.values():
            runtime._undo.extend(step(model, adapter_for(model)))

    def keep(undo):
        runtime._undo.extend(undo)

    def compile_step(name, model):
        folder = None
        if options.compile_artifacts != "off":
            from .aot import artifact_folder

            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            folder = artifact_folder(model, options.as_dict(), rank, world, name)
        return compile_blocks(model, adapter_for(model), folder, options.compile_artifacts)

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
        (f"attention({options.attention}, exact steps={options.attention_bf16_steps})",
         lambda: each(lambda m, a: eight.apply(m, a, eight.OneProcessAttention(eight_local, pieces)))
         if eight_local is not None and config.sp == 1 else None),
        (f"sequence(ring={config.ring}, ulysses={config.ulysses}, comm={options.comm_dtype})",
         lambda: each(lambda m, a: sequence.apply(m, mesh, a, ctx, ulysses_chunks, compile, transport, pieces,
                                                  options.comm_dtype, eight_local))),
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
        (f"quant({options.quant})", lambda: quantize_step(pipe, runtime, keep) if options.quant != "off" else None),
        ("compile(blocks)", lambda: [keep(compile_step(name, m)) for name, m in models.items()] if compile else None),
        ("cuda-graph", lambda: each(graph_step) if cuda_graph else None),
        ("loras", lambda: load_loras(pipe, options, keep) if options.quant == "off" else None),  # quant loaded them
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
