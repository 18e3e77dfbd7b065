"""8-bit attention in a run, and the one-process emulation of fp8 payloads.

:class:`EightBitAttention` is the local attention of ``attention="fp8"`` (cuDNN's fp8 kernel) or ``"fp8-emulated"``
(``attention.fp8``), with the first and last ``bf16_steps`` steps of each run in exact attention (diffusers' dispatcher); the step comes from the call's
:class:`~ditmesh.hooks.ForwardContext`, which every rank holds alike. Under Ulysses the sequence step runs it after
the all-to-all, and it reduces its per-sample amaxes over the Ulysses and tp axes (``group``,
:func:`scale_group`), so every rank takes one process's scales; at sequence degree 1 :func:`apply` installs the adapter's processor with a
:class:`OneProcessAttention` that calls it.

:func:`emulate_fp8_comm` is the one-process reference of ``comm_dtype="fp8"``: a :class:`OneProcessAttention` that
rounds Q, K, V and the output with :func:`~ditmesh.comm.fp8_round` where the parallel layout sends them (Ulysses:
Q, K, V in and the output back; ring: K and V; USP: both, K and V twice). Its scales are per token and head, the same
whether a rank cuts the row from its shard or one process from the whole tensor, so a parallel run with fp8
payloads equals this run where the values before each rounding are the same.
"""

from __future__ import annotations

import torch

from ..attention import fp8
from ..attention.local import QueryChunks
from ..comm import fp8_round
from ..hooks import ForwardContext
from .chunk import dispatched_attention

#: where each sequence-parallel layout rounds (how many times) under ``comm_dtype="fp8"``
FP8_POINTS = {
    "ulysses": {"q": 1, "k": 1, "v": 1, "out": 1},
    "ring": {"k": 1, "v": 1},
    "usp": {"q": 1, "k": 2, "v": 2, "out": 1},
}


class EightBitAttention:
    """``attention`` (``fp8`` or ``fp8-emulated``) as a local attention ``(q, k, v, mask=None)`` on
    ``[B, S, H, D]``, exact (diffusers' dispatcher with ``backend``) in the first and last ``bf16_steps`` steps of a
    run. ``group``: the process group (or its name) the scales are reduced over, every rank that holds
    heads of the same tokens (Ulysses and tp; None on one process). It quantizes once per call and cuts
    only the attention of the quantized queries into ``chunks``' pieces, so every rank makes one all-reduce per
    call whatever its pieces."""

    KERNELS = {"fp8": fp8.fp8_attention, "fp8-emulated": fp8.emulated_attention}

    def __init__(self, attention: str, bf16_steps: int = 0, ctx: ForwardContext | None = None, backend=None,
                 chunks: QueryChunks | None = None, group=None):
        self.attention, self.group = attention, group
        self.bf16_steps, self.ctx, self.backend, self.chunks = bf16_steps, ctx, backend, chunks
        #: calls that ran in 8 bits and exactly (for tests and reports)
        self.calls = {"8-bit": 0, "exact": 0}

    def exact_now(self) -> bool:
        """Whether this call is in the first or last ``bf16_steps`` steps of the run."""
        ctx = self.ctx
        if not self.bf16_steps or ctx is None or ctx.step_index is None:
            return False
        total = ctx.run_steps
        return ctx.run_step < self.bf16_steps or (total is not None and ctx.run_step >= total - self.bf16_steps)

    def _count(self, kind: str) -> None:
        # not while torch.compile traces: a counter on the processor is a static int to dynamo, and each new value
        # would recompile the block
        if not torch.compiler.is_compiling():
            self.calls[kind] += 1

    def __call__(self, q, k, v, mask=None):
        if self.exact_now() or (self.attention == "fp8" and k.shape[1] < fp8.MIN_KEYS):
            self._count("exact")
            return dispatched_attention(q, k, v, mask, self.backend, self.chunks)
        self._count("8-bit")
        return self.KERNELS[self.attention](q, k, v, mask=mask, group=self.group, pieces=self.chunks)


class OneProcessAttention:
    """The runtime the adapters' processors call at sequence degree 1: :meth:`attention` has
    :meth:`~ditmesh.parallel.sequence.SequenceParallel.attention`'s signature and runs ``local`` (an
    :class:`EightBitAttention`, or None: diffusers' dispatcher) on pieces of the queries, with Q, K, V and the output
    rounded by :func:`~ditmesh.comm.fp8_round` as often as ``points`` says (:data:`FP8_POINTS`)."""

    def __init__(self, local: EightBitAttention | None = None, chunks: QueryChunks | None = None,
                 points: dict | None = None):
        self.local, self.query_chunks, self.points = local, chunks, points or {}

    def _round(self, x: torch.Tensor, point: str) -> torch.Tensor:
        for _ in range(self.points.get(point, 0)):
            x = fp8_round(x)
        return x

    def attention(self, query, key, value, backend=None, streams=None, mask=None):
        query, key, value = (self._round(t, p) for t, p in ((query, "q"), (key, "k"), (value, "v")))
        if self.local is None:
            out = dispatched_attention(query, key, value, mask, backend, self.query_chunks)
        else:
            self.local.backend = backend
            out = self.local(query, key, value, mask)
        return self._round(out, "out")


def scale_group(mesh) -> str | None:
    """The name of the group the fp8 attention reduces its amaxes over: every rank holding heads of the same tokens
    (the Ulysses and tp axes; ring and pp do not take it); None when that is this rank alone. Creating a group that
    spans both axes is a collective: every rank calls this, in the same order (``parallelize``)."""
    from ..comm import group_name

    group = mesh.group_of("ulysses", "tp")
    return None if group is None else group_name(group)


def apply(model: torch.nn.Module, adapter, runtime: OneProcessAttention) -> list:
    """Install the adapter's processor on ``model``'s attention layers with ``runtime``; returns undo callables."""
    return [adapter.set_processors(model, runtime)]


def emulate_fp8_comm(runtime, layout: str, attention: str = "default", bf16_steps: int = 0) -> None:
    """Make a one-process parallelized pipeline (``runtime``: what ``parallelize(pipe, ParallelConfig())`` returned)
    round where ``layout`` (``ulysses``, ``ring`` or ``usp``, :data:`FP8_POINTS`) sends fp8 payloads, optionally with
    the 8-bit ``attention``; ``runtime.remove()`` takes it off with the rest."""
    from ..models.base import adapter_for

    if runtime.config.world_size != 1:
        raise ValueError(f"emulate_fp8_comm emulates on one process; this runtime runs {runtime.config.describe()}")
    for model in runtime.transformers.values():
        local = None if attention == "default" else EightBitAttention(attention, bf16_steps, runtime.context)
        runtime._undo.extend(apply(model, adapter_for(model), OneProcessAttention(local, points=FP8_POINTS[layout])))
