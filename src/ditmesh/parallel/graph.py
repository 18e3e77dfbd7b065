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
inside the call (dbcache, teacache) gets each call captured in graphs cut at its decision (:class:`DecisionCuts`):
the head up to the statistic, the middle blocks, the tail; a replay reads the statistic's one scalar between them
and skips the middle graphs for a cached step. Either way the key holds the call's branch within the step (true
CFG: two calls a step, each with its own residuals). Displaced attention plans each call here the same way (exact or
stale, the step's parity, the run's last step: the key), and this hook waits for the call's gathers before the call
ends (``parallel.displaced``). ditmesh's data- and
CFG-parallel hooks choose per call what to run, so graphs are refused with ``dp`` or ``cfg`` > 1 (and with
the consistency check, which reads values on the host). Graphs are kept for the life of the wrapper, one
memory pool each (displaced attention's graphs: one pool for all of them).
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


class DecisionCuts:
    """One capture of a call cut into CUDA graphs around a step cache's decision (dbcache, teacache): the ``head``
    (the call up to the decision's statistic, its sums reduced over the ranks), the ``middle`` (the blocks a skip
    leaves out: the first of them in a graph of its own, so that the GPU starts on it while the host launches the
    rest) and the ``tail`` (the rest of the call). The step cache calls :meth:`cut` at its statistic,
    :meth:`cut_inside` after the first middle block and :meth:`cut_middle` after the last; memory made in one graph
    and read in a later one stays where it was, because they share one pool and are captured in one pass.

    A replay runs the head, reads the sums on the host (the one host read of the step), lets the cache decide, then
    runs the middle graphs or, for a skip, writes each middle output as its input plus the cached residual (one add
    per stream, outside the graphs), and runs the tail."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list = []
        self.sums = None
        self.middle_end = 0  # graphs [1, middle_end) are the middle's
        self.skip_writes: list = []  # (middle input, cached residual, middle output) per carried stream

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def _next(self) -> None:
        self.end()
        self.begin()

    def cut(self, sums) -> None:
        if len(self.graphs) != 1 or sums is None:
            raise RuntimeError("a call cut for its cache decision needs exactly one statistic")
        self.sums = sums
        self._next()

    def cut_inside(self) -> None:
        if len(self.graphs) != 2:
            raise RuntimeError("the middle blocks' graph is cut after their first block only")
        self._next()

    def cut_middle(self, writes: dict, returns: tuple) -> None:
        """``writes``: stream name -> (middle input, cached residual, middle output); ``returns``: the names the
        last middle block returns, each of which a skip must write."""
        if len(self.graphs) not in (2, 3) or set(writes) != set(returns):
            raise RuntimeError(f"a skip cannot write the middle blocks' outputs {returns} from their carried inputs "
                               f"{tuple(writes)}")
        self.skip_writes = list(writes.values())
        self.middle_end = len(self.graphs)
        self._next()

    def replay(self, cache) -> None:
        self.graphs[0].replay()
        if cache.decide_captured(self.sums):
            for before, residual, out in self.skip_writes:
                torch.add(before, residual, out=out)
        else:
            for graph in self.graphs[1:self.middle_end]:
                graph.replay()
        self.graphs[-1].replay()


def decision_capture(cache) -> Callable:
    """A capture function for :class:`GraphedCall` that cuts each call at ``cache``'s decision
    (:class:`DecisionCuts`)."""

    def capture(fn):
        cuts = DecisionCuts()
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        cache.cuts = cuts
        try:
            with torch.cuda.stream(stream):
                cuts.begin()
                try:
                    out = fn()
                finally:
                    cuts.end()
        finally:
            cache.cuts = None
        torch.cuda.current_stream().wait_stream(stream)
        if not cuts.middle_end:
            raise RuntimeError("the call's capture never reached the end of the cache's middle blocks")
        return (lambda: cuts.replay(cache)), out

    return capture


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

    ``cache``: the transformer's step cache. A policy that knows each call's path before the call (static, taylor)
    takes its decision here, before the call, and the path keys the graph, so each path (computed, or skipped; taylor's
    extrapolation factor is a tensor written before the call) gets a whole-call graph of its own. A policy that
    decides inside the call (dbcache, teacache) gets each call captured in three graphs cut at the decision
    (:class:`DecisionCuts`). Either way the
    graph is keyed by the call's branch within the step too (true CFG calls the transformer twice per step), since
    each branch keeps its own cached residuals.

    ``displaced``: the transformer's displaced attention runtime (``parallel.displaced.Displaced``, built
    ``graphed``): it plans each call here (its plan is the key) and its gathers are waited before the call ends, inside
    the graph; its graphs share one memory pool (:func:`shared_pool_capture`)."""

    name = "graph"

    def __init__(self, capture: Callable = cuda_capture, devices: tuple[str, ...] = ("cuda",), cache=None,
                 displaced=None):
        self._next = None
        self.cache = cache
        self.displaced = displaced
        if cache is not None and not cache.known_in_advance and capture is cuda_capture:
            capture = decision_capture(cache)
        if displaced is not None and capture is cuda_capture:  # four graphs a resolution (exact, stale of each step
            # parity, last step): one pool, since what one graph leaves for the next is in buffers outside it
            capture = shared_pool_capture()
        self.graphed = GraphedCall(self._run_next, capture, devices=devices)

    def _run_next(self, *args, **kwargs):
        out = self._next(args, kwargs)
        if self.displaced is not None:  # inside the graph: the call's gathers end before it does
            self.displaced.join()
        return out

    def __call__(self, owner, call_next, args, kwargs):
        self._next = call_next  # the inner chain is the same on every call; only a warm-up or capture runs it
        if self.cache is not None:
            planned = self.cache.plan_call() if self.cache.known_in_advance else None
            self.graphed.extra_key = (self.cache.ctx.call_in_step, planned)
        if self.displaced is not None:
            self.graphed.extra_key = self.displaced.plan_call()
        try:
            return self.graphed(*args, **kwargs)
        finally:
            self._next = None
            for planner in (self.cache, self.displaced):
                if planner is not None:
                    planner.end_call()


def apply(model: torch.nn.Module, capture: Callable = cuda_capture, devices: tuple[str, ...] = ("cuda",),
          cache=None, displaced=None) -> list:
    """Replay ``model``'s calls from CUDA graphs (a ``graph`` hook, keyed by ``cache``'s planned path where given, or
    by ``displaced``'s planned call: ``parallel.displaced.Displaced``); returns the undo callable."""
    return [add_hook(model, GraphHook(capture, devices, cache, displaced))]
