"""``parallelize(pipe, config)``: the one entry point.

Dimensions are applied in a fixed, logged order: tensor -> (fused Q/K/V) -> sequence -> cfg/data -> (compile)
-> (CUDA graph).
The pipeline object is changed in place through hooks and attention processors; no pipeline class is
forked. Every rank calls ``pipe(...)`` with the same arguments and gets the same result.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import fusion, symm
from . import models as _models  # noqa: F401  (registers adapters)
from .attention.ulysses import TRANSPORTS
from .config import AXIS_ORDER, ConfigError, ParallelConfig
from .mesh import ParallelMesh
from .models.base import adapter_for
from .parallel import batch, graph, sequence, tensor

log = logging.getLogger("ditmesh")

#: degree name -> what is missing while that dimension has not landed
_NOT_YET = {
    "pp": "PipeFusion (pp > 1) is not implemented yet",
}


#: dimensions this build runs
SUPPORTED_AXES = tuple(axis for axis in AXIS_ORDER if axis not in _NOT_YET)


@dataclass
class ParallelRuntime:
    """What :func:`parallelize` did to a pipeline: the mesh, and how to undo it."""

    config: ParallelConfig
    mesh: ParallelMesh
    applied: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list)

    def remove(self) -> None:
        """Restore the pipeline's original forward behaviour."""
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()


def check_supported(config: ParallelConfig) -> None:
    """Raise NotImplementedError naming the first requested dimension this build cannot run yet."""
    for axis, message in _NOT_YET.items():
        if getattr(config, axis) > 1:
            raise NotImplementedError(f"{message}; this build supports: {', '.join(SUPPORTED_AXES)}")


def check_model(config: ParallelConfig, transformer: torch.nn.Module) -> None:
    """Validate ``config`` against a transformer (head counts); raises :class:`ConfigError`."""
    adapter = adapter_for(transformer)
    config.check_heads(adapter.num_heads(transformer), type(transformer).__name__)


def compile_blocks(model: torch.nn.Module) -> list:
    """Regional compilation: ``torch.compile`` every repeated transformer block, in place.

    diffusers lists each model's repeated block classes in ``_repeated_blocks``; compiling blocks rather
    than the whole model keeps compile time to one graph per block type and leaves ditmesh's entry/exit
    hooks outside the graphs. With the copy-engine transport, inductor's buffer reuse is off
    (``symm.COMPILE_OPTIONS``). Returns undo callables.
    """
    names = set(getattr(model, "_repeated_blocks", ()) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise NotImplementedError(f"{type(model).__name__} lists no repeated blocks to compile")
    sp = getattr(model, "_ditmesh_sp", None)
    # the copy-engine transport returns views of persistent receive buffers: inductor must not reuse them
    options = symm.COMPILE_OPTIONS if sp is not None and sp.transport == "symm" else None
    for block in blocks:
        block.compile(options=options)

    def undo():
        for block in blocks:
            block._compiled_call_impl = None

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


def parallelize(pipe, config: ParallelConfig, *, check_consistency: bool = False, device=None,
                compile: bool = False, cuda_graph: bool = False, ulysses_chunks: int | None = None,
                fuse_qkv: bool = False, transport: str = "nccl") -> ParallelRuntime:
    """Make a diffusers pipeline run with ``config`` across the ranks of the default process group.

    Call it on every rank, after ``torch.distributed.init_process_group`` (not needed for one
    process) and after moving the pipeline to this rank's device.

    Args:
        pipe: a diffusers pipeline with a ``transformer`` (e.g. ``FluxPipeline``).
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
            (docs/benchmarks.md).
        transport: how Ulysses all-to-alls travel: ``"nccl"`` (NCCL kernels; any backend) or ``"symm"``
            (copy engines writing into the peers' symmetric memory, ``ditmesh.symm``; CUDA GPUs of one host;
            Ulysses alone). With ``"symm"``, compile through ``compile=True``: a ``torch.compile`` of your own
            around the model must pass ``options=ditmesh.symm.COMPILE_OPTIONS`` (see that module).
    """
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ConfigError(f"{type(pipe).__name__} has no transformer; ditmesh parallelizes DiT pipelines")
    check_supported(config)
    check_model(config, transformer)
    if device is None:
        device = next(transformer.parameters()).device
    if cuda_graph:
        check_cuda_graph(config, torch.device(device), check_consistency)
    check_ulysses_chunks(ulysses_chunks)
    check_transport(transport, torch.device(device), config=config)
    mesh = ParallelMesh.build(config, torch.device(device))
    runtime = ParallelRuntime(config=config, mesh=mesh)
    adapter = adapter_for(transformer)

    # The fixed order: tensor -> (fused projections) -> sequence -> cfg/data. Every step does nothing at degree 1 and returns
    # the callables that undo it.
    steps = [
        (f"tensor(tp={config.tp})", lambda: tensor.apply(transformer, mesh, adapter) + tensor.encode_once(pipe, mesh)),
        ("fuse(qkv)", lambda: fusion.fuse_qkv(transformer, adapter) if fuse_qkv else []),
        (f"sequence(ring={config.ring}, ulysses={config.ulysses})", lambda: sequence.apply(transformer, mesh, adapter, ulysses_chunks, compile, transport)),
        (f"batch(dp={config.dp}, cfg={config.cfg})", lambda: batch.apply(pipe, transformer, mesh, adapter)),
        ("compile(blocks)", lambda: compile_blocks(transformer) if compile else []),
        ("cuda-graph", lambda: graph.apply(transformer) if cuda_graph else []),
    ]
    for name, step in steps:
        undo = step()
        if undo:
            runtime._undo += undo
            runtime.applied.append(name)
    if check_consistency and dist.is_initialized() and dist.get_world_size() > 1:
        # registered last with prepend=True, so it runs first and sees the full, replicated inputs
        from .runtime.consistency import attach_consistency_check

        runtime._undo += attach_consistency_check(transformer)
        runtime.applied.append("consistency-check")
    log.info("ditmesh: %s applied to %s: %s", config.describe(), type(transformer).__name__, runtime.applied or ["nothing"])
    pipe._ditmesh = runtime
    return runtime
