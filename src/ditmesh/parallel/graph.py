"""CUDA graphs of the whole transformer call: the GPU runs a denoising step without waiting on the host.

Why: at 1024^2 on 4 GPUs a FLUX step is ~1,700 to 2,200 kernels of ~20 us each. Launching them from
Python takes longer than running them, and every rank launches at its own pace, so each all-to-all waits
for the slowest rank's host (measured on 4x H200, compiled ulysses4 with 2 head groups: 88.9 ms per step
without a graph, 46.1 ms with one; see docs/lab/ulysses-overlap.md). A graph is launched once per step, so
the ranks meet at the collectives at GPU speed.

How: the transformer's ``graph`` hook (``hooks.ORDER``: inside ``context``, outside every other hook, so
ditmesh's split/gather hooks and the compiled blocks are captured) runs the rest of the call through a
:class:`GraphedCall`. Each distinct call signature (argument names, tensor shapes, dtypes and
devices, and the values of the non-tensor arguments) gets its own graph: the first call runs normally (it compiles,
autotunes and opens the NCCL communicators); the second runs once on a side stream and is then
captured; later calls copy their tensors into the captured input buffers, replay, and return a copy of
the output. A call that cannot be captured (a host synchronisation inside the model, for example) logs
one warning and runs normally from then on.

Calls run normally (no graph) when autograd is on, when a tensor argument is not on a CUDA device, when
two tensor arguments share memory, or when a non-tensor argument is not a plain value (None, bool, int,
float, str, dtype, device, or tuples of these), since such a signature cannot be told apart safely.

Limits: the call must not depend on Python state that changes between steps and is not an argument
(autocast or attention-backend contexts, stateful hooks such as step caches). A step cache that knows each
call's path before the call (static, taylor) takes its decision in this hook, and the path is part of the graph's
key: one whole-call graph per path, the cache's kept residuals in buffers written in place. A cache that decides
inside the call (dbcache, teacache) gets :func:`apply_blocks` instead: each block's own forward graphed inside the
cache's hook (one memory pool shared by the blocks' graphs), so the host takes the decision between block replays
and a skipped block launches nothing. ditmesh's data- and
CFG-parallel hooks choose per call what to run, so graphs are refused with ``dp`` or ``cfg`` > 1 (and with
the consistency check, which reads values on the host). Graphs are kept for the life of the wrapper, one
memory pool each.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from ..hooks import Hook, add_hook

log = logging.getLogger("ditmesh")


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _leaf_key(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, str(leaf.device))
    return ("value", type(leaf), leaf)


def signature(leaves, devices: tuple[str, ...] = ("cuda",), aliased_ok: bool = False) -> tuple | None:
    """The graph key of a call's flattened arguments, or None when the call must run without a graph.
    ``aliased_ok``: inputs that share memory may get buffers of their own (the callee never writes its inputs)."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if any(t.device.type not in devices for t in tensors) or not all(
            _plain(leaf) for leaf in leaves if not isinstance(leaf, torch.Tensor)):
        return None
    storages = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
    if not aliased_ok and len(set(storages)) != len(storages):  # aliased inputs: separate static buffers would break the aliasing
        return None
    return tuple(_leaf_key(leaf) for leaf in leaves)


def cuda_capture(fn: Callable[[], object], pool=None):
    """Capture ``fn()`` in a CUDA graph; returns ``(replay, output)`` (``output`` is written by each replay).
    ``pool``: a memory pool shared with other graphs (``torch.cuda.graph_pool_handle()``)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def shared_pool_capture() -> Callable:
    """A capture function whose graphs share one memory pool. Safe for graphs replayed one after another on one
    stream whose outputs are copied out (:class:`GraphedCall`): a graph's live output buffer is never handed to
    another, and the scratch memory they share is only used while one of them runs."""
    pool = []

    def capture(fn):
        if not pool:
            pool.append(torch.cuda.graph_pool_handle())
        return cuda_capture(fn, pool[0])

    return capture


def side_stream_run(fn):
    """Run ``fn()`` once on a side stream (what capture needs before it: lazy state made off the capture)."""
    if not torch.cuda.is_available():
        return fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return out


class _Entry:
    def __init__(self):
        self.calls = 0
        self.failed = False
        self.replay = None
        self.static: list = []
        self.out = None
        self.capture_s = 0.0  # the side-stream run and the capture, on the host
        self.replays = 0


class GraphedCall:
    """``call(*args, **kwargs)`` replayed from one CUDA graph per call signature (module docstring).

    ``capture(fn) -> (replay, output)`` is :func:`cuda_capture` on GPUs; tests pass a function that
    re-runs ``fn`` on replay, with ``devices=("cpu",)``, which checks the input buffers and signatures
    without a GPU.
    """

    def __init__(self, call: Callable, capture: Callable = cuda_capture, warmup: int = 1,
                 devices: tuple[str, ...] = ("cuda",), aliased_ok: bool = False):
        self.call = call
        self.aliased_ok = aliased_ok
        #: part of the next calls' key that is not in their arguments (the path a step cache planned)
        self.extra_key = None
        self.devices = devices
        self.capture = capture
        self.warmup = warmup
        self.entries: dict = {}

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return self.call(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
        key = signature(leaves, self.devices, self.aliased_ok)
        if key is None:
            return self.call(*args, **kwargs)
        entry = self.entries.setdefault((repr(spec), key, self.extra_key), _Entry())
        if entry.failed:
            return self.call(*args, **kwargs)
        if entry.replay is None:
            entry.calls += 1
            if entry.calls <= self.warmup:
                return self.call(*args, **kwargs)
            return self._capture(entry, leaves, spec, args, kwargs)
        for buf, leaf in zip(entry.static, leaves):
            if isinstance(buf, torch.Tensor):
                buf.copy_(leaf)
        entry.replay()
        entry.replays += 1
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.out)

    def _capture(self, entry: _Entry, leaves, spec, args, kwargs):
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        on = torch.cuda.device(tensors[0].device) if tensors and tensors[0].is_cuda else contextlib.nullcontext()
        with on:  # capture on the inputs' GPU, whatever the current device is
            return self._capture_here(entry, leaves, spec, args, kwargs)

    def _capture_here(self, entry: _Entry, leaves, spec, args, kwargs):
        import time

        start = time.perf_counter()
        try:
            return self._capture_timed(entry, leaves, spec, args, kwargs)
        finally:
            entry.capture_s = time.perf_counter() - start

    def _capture_timed(self, entry: _Entry, leaves, spec, args, kwargs):
        result = side_stream_run(lambda: self.call(*args, **kwargs))
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(static, spec)
        try:
            replay, out = self.capture(lambda: self.call(*static_args, **static_kwargs))
        except Exception as exc:  # noqa: BLE001  (anything the model does that a graph cannot hold)
            entry.failed = True
            log.warning("ditmesh: CUDA graph capture failed (%s: %s); this call signature runs without a graph",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return result
        entry.static, entry.replay, entry.out = static, replay, out
        return result


class GraphHook(Hook):
    """The transformer's ``graph`` hook: everything inside it replayed by one :class:`GraphedCall`.

    ``cache``: a step cache whose policy knows each call's path before the call (static, taylor): its decision is
    taken here, before the call, and keys the graph, so each path (computed, or skipped with each extrapolation
    factor) gets a whole-call graph of its own."""

    name = "graph"

    def __init__(self, capture: Callable = cuda_capture, devices: tuple[str, ...] = ("cuda",), cache=None):
        self._next = None
        self.cache = cache
        self.graphed = GraphedCall(self._run_next, capture, devices=devices)

    def _run_next(self, *args, **kwargs):
        return self._next(args, kwargs)

    def __call__(self, owner, call_next, args, kwargs):
        self._next = call_next  # the inner chain is the same on every call; only a warm-up or capture runs it
        if self.cache is not None:
            self.graphed.extra_key = self.cache.plan_call()
        try:
            return self.graphed(*args, **kwargs)
        finally:
            self._next = None
            if self.cache is not None:
                self.cache.end_call()


def apply(model: torch.nn.Module, capture: Callable = cuda_capture, devices: tuple[str, ...] = ("cuda",),
          cache=None) -> list:
    """Replay ``model``'s calls from CUDA graphs (a ``graph`` hook, keyed by ``cache``'s planned path where given);
    returns the undo callable."""
    return [add_hook(model, GraphHook(capture, devices, cache))]


def apply_blocks(model: torch.nn.Module, adapter, capture: Callable | None = None,
                 devices: tuple[str, ...] = ("cuda",)) -> list:
    """Replay each repeated block's own forward (its registry's ``inner``, compiled or not) from CUDA graphs that
    share one memory pool, leaving the hooks around it (a step cache's) eager. Returns the undo callable."""
    from ..hooks import registry

    capture = capture or shared_pool_capture()
    blocks = adapter.block_modules(model)
    regs = [registry(block) for block in blocks]
    before = [reg.inner for reg in regs]
    for reg, block in zip(regs, blocks):
        # a block never writes its inputs, so streams that are views of one tensor (FLUX's single blocks return
        # text and image as slices of one output) may be copied into buffers of their own
        reg.inner = GraphedCall(reg.inner or reg.original(block), capture, devices=devices, aliased_ok=True)

    def undo():
        for reg, inner in zip(regs, before):
            reg.inner = inner

    return [undo]


def graphed_blocks(model: torch.nn.Module, adapter) -> list[GraphedCall]:
    """The :class:`GraphedCall` of each block that :func:`apply_blocks` graphed, in block order."""
    from ..hooks import registry

    return [reg.inner for reg in map(registry, adapter.block_modules(model)) if isinstance(reg.inner, GraphedCall)]
