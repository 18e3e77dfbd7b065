"""Displaced patch parallelism (``displaced=True`` over the ulysses axis): every rank runs every block on its patch,
its attention reads the other patches' K/V from the previous step, gathered while the step computes.

```
 step t, rank j:  Q_j, K_j, V_j of its patch ──► attention(Q_j, [K/V of step t-1 from the others | K_j, V_j])
                                                  │
                                                  └─► all-gather (K_j, V_j) started ──► waited at this layer in step t+1
```

- **Patches** are sequence parallelism's token chunks: the ``sequence`` step splits every stream of the plan over the
  ulysses ranks (contiguous, uneven by at most one token) and gathers the exit, as for Ulysses; only the attention
  differs. Each rank keeps all of its heads (no all-to-all).
- **Text tokens** of joint-attention families (FLUX, SD3) are split like the image tokens: a rank's own text chunk
  is fresh, the other ranks' text K/V are one step stale like their image K/V. (PipeFusion has every text K/V fresh
  because its patch 0 carries the whole text through one pipeline; here every rank runs every block, and a whole
  text stream on every rank would add its tokens to every rank's work: 512 text tokens beside 1024 image tokens per
  rank for FLUX 1024^2 at 4 ranks.) Wan's cross-attention reads the text embeddings, which every rank holds whole.
- **K/V buffers.** Per transformer, attention layer and call of the step (a CFG branch), ``ForwardContext.
  kv_buffers`` holds the all-gather of the layer's K/V issued in the previous step, not yet waited for: tokens first,
  ``[N x S_max, B, 2, H, D]`` (K and V side by side, each rank's chunk padded to the longest). A stale call waits for
  it (at the layer's next use, a whole step after the start), writes its fresh K/V into its own place, attends, and
  starts the gather the next step reads. The gather writes a fresh output tensor, so the step reading the old one
  never races the transfer filling the new one: one persistent buffer per layer and branch. With even chunks the
  waited gather is the attention's K/V as it is (K and V are strided views of it, no concatenation); uneven chunks
  are trimmed into one transient whole-sequence K/V. The run's last step starts no gather.
- **One runtime for all layers.** Every attention processor of the transformer calls the same :class:`Displaced`;
  the layer is counted at run time (the n-th exchange of a transformer call, ``ctx.calls``), never held by the
  processor, so nothing in a compiled block differs between layers and the compiler traces it once.
- **Exact calls.** The first ``warmup`` steps of a run, and a transformer's first call of a run for each call of the
  step (Wan 2.2's second expert), gather the K/V synchronously and attend to this step's K/V of every rank: the
  result of one process. Their gather is the buffer of the next step. Without a scheduler every call is exact.
- **Keys in rank order.** The attention's keys are the ranks' chunks one after another (``[text_0, image_0, text_1,
  image_1, ...]``), not the model's order: attention without a mask does not depend on the order of its keys. A
  mask is refused.
- **Compile.** The buffer exchange is one custom operator (``ditmesh::displaced_exchange``): a compiled block calls
  it as an opaque kernel, without a graph break, and its host state (the pending gathers, the layer count, exact or
  stale) is not traced, so it adds no guard: its collective is started in one step and waited in the next, across
  graph calls.
- **CUDA graphs** (``graphed``: ``parallelize(..., cuda_graph=True)``). A replay runs none of the operator's Python,
  so every host decision is taken before the call, outside the graph: the ``graph`` hook calls :meth:`Displaced.
  plan_call`, whose plan (call in step, exact, step parity, last step of the run) is the graph's key and is all the
  call's exchanges read; the layer count is reset there and at the call's end, and the runs that wrote the buffers
  are booked there. The buffers sit at fixed addresses, two per layer and call in step, one per step parity: step t
  reads parity t % 2 (the gather of step t-1), writes its own fresh K/V into it, and gathers into parity (t+1) % 2
  (``all_gather_into_tensor_out``), so the next step's graph reads what this step's wrote. A gather never crosses a
  graph's end: each layer's gather starts at its exchange, runs beside the layers after it (NCCL's stream), and the
  ``graph`` hook waits for all of them (:meth:`Displaced.join`) before the call ends. A buffer is made by a call
  without a graph (every key's first call runs without one), never inside a capture. The returned buffer (stale call,
  even chunks) may be reused by a compiled block once the attention has read it: nothing reads it before the gather
  of the next step overwrites it whole.

Collectives per transformer call, per attention layer: one all-gather (``all_gather``, waited at once) in an exact
call, one started all-gather (``kv_async``, waited a step later; under CUDA graphs, at the call's end) in a stale one,
none in a stale call of the run's last step; and the exit's gather as under sequence parallelism.

Cross-rank rule: exact or stale is decided from the step, run and call in step (the same on every rank) and from
which buffers exist (the same on every rank); every rank starts and waits the same gathers in the same layer order.
Under CUDA graphs every rank replays the graph of the same plan, each holding the same collectives in the same order.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .. import comm
from ..config import ConfigError
from ..options import displaced_refusal
from ..hooks import ForwardContext
from ..models.base import ModelAdapter
from .pipefusion import drop_buffers
from .sequence import SequenceParallel

#: the displaced runtimes by id: the exchange op takes its runtime as an integer (an op's arguments are tensors and
#: plain values); weak, so a runtime lives only as long as the processors that hold it
_RUNTIMES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Displaced:
    """Displaced attention's state for one transformer, and the ``sp`` runtime of all of its attention layers'
    processors: its sequence-parallel runtime, the warm-up, the layer count of the current call, its buffers (in the
    shared ``ForwardContext.kv_buffers``, keyed ``(name, layer index, call in step)``; under CUDA graphs by step
    parity and chunk sizes too)."""

    def __init__(self, sp: SequenceParallel, ctx: ForwardContext, name: str, warmup: int, graphed: bool = False):
        self.sp, self.ctx, self.name, self.warmup = sp, ctx, name, warmup
        #: the transformer call (``ctx.calls``) the layer count belongs to, and the attention layers run in it
        self.call, self.layers = -1, 0
        #: replayed from CUDA graphs: buffers at fixed addresses by step parity, each call's gathers joined at its end
        #: (:meth:`plan_call`, :meth:`join`); else the gathers cross the steps
        self.graphed = graphed
        #: graphed: this call's (call in step, exact, step parity, last step of the run), taken before the call
        self.planned: tuple | None = None
        #: graphed: the run whose calls wrote the buffers, by call in step (booked by :meth:`plan_call`)
        self.written: dict[int, int] = {}
        #: graphed: (sent chunk, gather) of each gather started in this call, waited by :meth:`join`
        self.started: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the smallest id no live runtime holds: a process's runtimes are numbered alike run after run, so the
        # compiled blocks kept between processes (ditmesh.aot), whose guards hold the id, fit the next run
        self.id = next(i for i in itertools.count() if i not in _RUNTIMES)
        _RUNTIMES[self.id] = self

    def attention(self, query, key, value, backend=None, streams=None, mask=None):
        """This rank's queries ``[B, S_local, H, D]`` against every rank's K/V: this step's (exact call) or, for the
        other ranks, the previous step's (stale call). The same for every layer: which layer calls it is counted
        by the exchange at run time, so a compiled block traces it once."""
        if mask is not None:
            raise NotImplementedError("displaced attention does not take an attention mask; run this pipeline without "
                                      "displaced (plain ulysses)")
        sizes = self.sp.seq_sizes if streams is None else self.sp.local_lengths(streams)
        whole = torch.ops.ditmesh.displaced_exchange(key, value, self.id, sizes)
        return dispatch_attention_fn(query, whole[:, :, 0].transpose(0, 1), whole[:, :, 1].transpose(0, 1),
                                     backend=backend)

    def exchange(self, key: torch.Tensor, value: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """K/V ``[S, B, 2, H, D]`` over every rank's tokens, in rank order, from this rank's ``key`` and ``value``
        (``[B, S_local, H, D]``): the gather of this step (exact) or the previous step's with this rank's fresh K/V in
        its place (stale); starts the gather the next step reads unless this is the run's last step. The layer is the
        number of exchanges before this one in the transformer call.

        What a compiled caller may reuse is never kept for reading: the gather reads a copy made here (``key`` and
        ``value`` are read at once), and the returned tensor is not a buffer a later step reads before writing it
        whole (the compiler may write over its memory once the attention has read it)."""
        # tokens first, [S_local, B, 2, H, D]: the gather along dim 0 gives every rank's tokens in rank order
        kv = torch.stack([key, value], dim=2).transpose(0, 1).contiguous()
        gathered, exact, last = (self.fixed if self.graphed else self.pending)(kv, sizes)
        longest = max(sizes)
        if min(sizes) == longest:  # no padding: the gather is the whole sequence as it is
            if exact:  # kept as the next step's buffer (a warm-up step's copy)
                return gathered if last else gathered.clone()
            gathered.narrow(0, self.sp.rank * longest, longest).copy_(kv)
            return gathered
        chunks = [gathered.narrow(0, j * longest, n) for j, n in enumerate(sizes)]
        chunks[self.sp.rank] = kv
        return torch.cat(chunks)

    def pending(self, kv: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, bool, bool]:
        """Without graphs: (the gather every rank's K/V are read from, exact, last step of the run). The buffers are
        the pending gathers of the previous step (a fresh tensor each), waited here; a stale call starts the next."""
        ctx = self.ctx
        if self.call != ctx.calls:
            self.call, self.layers = ctx.calls, 0
        slot = (self.name, self.layers, ctx.call_in_step)
        self.layers += 1
        held = ctx.kv_buffers.pop(slot, None)
        exact = ctx.run_step < self.warmup or held is None or held[0] != ctx.run or held[1] != sizes
        if exact and held is not None:
            comm.wait(held[2])  # a gather of an earlier run (or of other sizes), not read: its transfer is finished
        if exact:  # this step's K/V of every rank, waited at once: the next step's buffer as it is
            raw = gathered = comm.wait(comm.all_gather_start(self.padded(kv, sizes), self.sp.group))
        else:  # the previous step's (waited a step after its start), with this rank's fresh K/V in its place
            gathered = comm.wait(held[2])
        last = ctx.run_steps is None or ctx.run_step + 1 >= ctx.run_steps
        if not last:
            if not exact:
                raw = comm.all_gather_start(self.padded(kv, sizes), self.sp.group, "kv_async")
            ctx.kv_buffers[slot] = (ctx.run, sizes, raw)
        return gathered, exact, last

    def plan_call(self) -> tuple:
        """Graphed: decide this call's path before it (the ``graph`` hook calls this outside the graph) and return
        it, for the graph's key: (call in step, exact, step parity, last step of the run). Every host state the call
        reads is set here, and the call leaves all of it as it found it (a replay runs no Python): its layer count
        and started gathers are back to empty at its end (:meth:`join`)."""
        ctx = self.ctx
        exact = ctx.run_step < self.warmup or self.written.get(ctx.call_in_step) != ctx.run
        last = ctx.run_steps is None or ctx.run_step + 1 >= ctx.run_steps
        self.written[ctx.call_in_step] = ctx.run
        self.layers = 0
        self.started.clear()  # left by a capture that failed part-way (its call then runs without a graph)
        self.planned = (ctx.call_in_step, exact, ctx.run_step % 2, last)
        return self.planned

    def end_call(self) -> None:
        self.planned = None

    def fixed(self, kv: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, bool, bool]:
        """Graphed: (the gather every rank's K/V are read from, exact, last step of the run), with the buffers at
        fixed addresses, two per layer by step parity: step t reads the one of parity t % 2 (gathered in step t-1)
        and gathers into the other (read in step t+1), started here and joined at the call's end (:meth:`join`).
        The layer is the count of exchanges since the plan."""
        if self.planned is None:
            raise RuntimeError("displaced attention under CUDA graphs runs a transformer call only through its graph "
                               "hook, which plans the call")
        call_in_step, exact, parity, last = self.planned
        layer = self.layers
        self.layers += 1
        send = self.padded(kv, sizes)
        shape = (len(sizes) * send.shape[0],) + tuple(send.shape[1:])

        def slot(side: int) -> tuple:
            return self.name, layer, call_in_step, side, tuple(sizes), shape, kv.dtype, str(kv.device)

        read = self.ctx.kv_buffers.get(slot(parity))
        exact = exact or read is None  # no buffer of these chunk sizes yet: the sizes changed within the run
        out = None
        if not last:
            out = self.ctx.kv_buffers.get(slot(1 - parity))
            if out is None:  # made by a call without a graph (a key's first call), read by its graphs
                out = self.ctx.kv_buffers[slot(1 - parity)] = send.new_empty(shape)
        if exact:  # this step's K/V of every rank, waited at once (into the next step's buffer)
            return comm.wait(comm.all_gather_start(send, self.sp.group, out=out)), True, last
        if out is not None:
            self.started.append((send, comm.all_gather_start(send, self.sp.group, "kv_async", out)))
        return read, False, last

    def join(self) -> None:
        """Graphed: wait for the gathers this call started (a stream wait: the capturing stream joins them, so no
        gather crosses the end of a graph), at the end of the transformer call."""
        for _, gather in self.started:
            comm.wait(gather)
        self.started.clear()
        self.layers = 0

    @staticmethod
    def padded(kv: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``kv`` padded along its tokens (dim 0) to the longest chunk."""
        longest = max(sizes)
        if kv.shape[0] < longest:
            kv = torch.cat([kv, kv.new_zeros((longest - kv.shape[0],) + tuple(kv.shape[1:]))])
        return kv

    def buffer_bytes(self) -> int:
        """Bytes held between steps by this transformer's buffers (what ``plan`` predicts)."""
        held = [value[-1] if isinstance(value, tuple) else value for key, value in self.ctx.kv_buffers.items()
                if key[0] == self.name]
        return sum(raw.numel() * raw.element_size() for raw in held)


@torch.library.custom_op("ditmesh::displaced_exchange", mutates_args=())
def displaced_exchange(key: torch.Tensor, value: torch.Tensor, runtime: int, sizes: list[int]) -> torch.Tensor:
    """:meth:`Displaced.exchange` of runtime ``runtime`` as one operator: a compiled block calls it as it is (no graph
    break, nothing of it traced), so its host state (the buffers, the pending gathers, the layer count) is no guard
    of the graph."""
    return _RUNTIMES[runtime].exchange(key, value, sizes)


@displaced_exchange.register_fake
def _(key, value, runtime, sizes):
    return key.new_empty((sum(sizes), key.shape[0], 2) + tuple(key.shape[2:]))


def apply(model: torch.nn.Module, sp: SequenceParallel | None, adapter: ModelAdapter, ctx: ForwardContext, name: str,
          warmup: int, graphed: bool = False) -> tuple[Displaced, list]:
    """Make the sequence-parallel ``model``'s attention displaced (see the module docstring); returns its runtime and
    the undo callables. ``sp``: the model's sequence-parallel runtime (``ulysses`` > 1, ``ring`` = 1); ``graphed``:
    its calls are replayed from CUDA graphs (the ``graph`` hook plans each call and joins its gathers)."""
    if sp is None:
        raise ConfigError("displaced attention needs ulysses > 1: its patches are the ulysses ranks' token chunks; "
                          "e.g. ulysses=4 with displaced")
    displaced_refusal(adapter)
    runtime = Displaced(sp, ctx, name, warmup, graphed)
    restore = adapter.set_processors(model, runtime)
    return runtime, [restore, lambda: drop_buffers(ctx, name)]
