"""PipeFusion (``pp``): the transformer's blocks as a pipeline of stages, the image as patches flowing through it.

```
 stage 0 (rank 0): blocks [0, a)   patch 0 ─► patch 1 ─► ... ─► patch M-1
                                      │ isend    │ isend
 stage 1 (rank 1): blocks [a, b)      ▼ patch 0 ─► patch 1 ─► ...            ─► last stage: every patch's output
 ...                                                                            ─► broadcast: every rank's prediction
```

- **Stages.** The adapter's ordered blocks are cut into ``pp`` contiguous stages whose costs are as even as a
  contiguous cut allows (:func:`split_stages`; the cost of a block is its parameter count, a proxy for its
  per-token FLOPs, which its linears dominate). A rank keeps only its stage's block weights: the others' tensors
  are emptied after loading (:func:`free_other_stages`), or never read (:func:`load_stage_transformer`), and are
  broadcast back from their owners by ``remove()``.
- **Patches.** Every transformer call is run ``M`` times (``pp_patches``, default ``pp``), once per patch: the
  split stream of the adapter's sequence plan (image or video tokens, the stream gathered at the exit) is cut
  into ``M`` contiguous patches (uneven where ``M`` does not divide it) at the plan's own split points, so
  positions (RoPE) and per-token timesteps travel with their tokens. Each rank runs the embedders and the exit
  layers for every patch (cheap), skips the blocks of other stages (a skipped block returns its inputs), takes
  its first block's activations from the previous stage and sends its last block's to the next.
- **Text tokens** of joint-attention families (FLUX, SD3) travel with patch 0: its call carries the whole text
  stream through every stage, the others carry none (zero tokens). Every patch's attention reads the text K/V
  from the buffer, where patch 0 has written them fresh in this step. Wan's cross-attention reads the text
  embeddings, which every rank holds whole.
- **K/V buffers.** In every self-attention of a stage, a patch writes its K and V into a per-layer buffer over
  the whole sequence (the plan's streams, in their attention order) and its queries attend to the whole buffer:
  the patches before it hold this step's K/V, the patches after it the previous step's (PipeFusion's one-step
  staleness). The buffers sit in the forward context (``ForwardContext.kv_buffers``), one per transformer,
  attention layer (by index) and call of the step (a CFG branch). The write and the attention run as one operator
  (``ditmesh::pipefusion_attend``) that reads the layer (a 0-dim tensor) and the patch at run time, so a compiled
  block guards on neither and traces once per input shape.
- **Exact calls.** The first ``pp_warmup`` steps of a run, and a transformer's first call of a run for each call
  of the step, run as one patch covering everything: stage after stage, the same result as one process, and they
  fill the buffers. Without a scheduler (a bare model call), every call is exact.
- **Messages.** A patch's activations at a stage boundary travel as one flat buffer, point-to-point, in pieces of
  at most ``pp_chunk_bytes`` (64 MiB by default), on a two-rank group of the two stages
  (:meth:`~ditmesh.mesh.ParallelMesh.neighbour_groups`): a stage's receives and its sends are on different groups,
  so that NCCL, which runs one group's operations in order, never holds a send behind a posted receive. Sends do not wait: a stage computes its next patch while the
  last one travels, and waits for its sends at the end of the call; a receiving stage posts the next patch's
  receive as soon as it has the current one. The last stage's output (the whole noise
  prediction) is broadcast over the pp group in pieces of the same size, so every rank's scheduler steps alike.
- **Ulysses inside a stage.** The patch is cut first (this hook is outside ``sequence``; its inner split hooks are
  prepended, its gather appended), then sequence parallelism cuts the patch; Ulysses' all-to-all gathers the
  patch's tokens with this rank's heads, and :meth:`PipeFusion.attend_buffer` writes them at their positions
  (:meth:`PipeFusion.token_runs`), so each rank's fresh K/V reach its group through the all-to-all it already does.

Per transformer call at ``pp`` stages with ``P`` patches (1 in an exact call): ``P`` sends per stage but the
last, ``P`` receives per stage but the first (times the pieces of each), and one broadcast (times its pieces).

Cross-rank rule: every rank of a pp group takes the same path, decided from the context's step, run and call in
step (the same on every rank) and from global shapes; the patch loop, the sends and receives and the broadcast
happen in the same order on every rank.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from .. import comm
from ..config import PP_CHUNK_BYTES, ConfigError
from ..hooks import ForwardContext, Hook, add_hook, bind_kwargs, find_hook, output_sample, with_output_sample
from ..mesh import ParallelMesh
from ..models.base import ModelAdapter, Split, adapter_for
from .sequence import split_points, split_value
from .tensor import MetaLoad, _load_dtype, _set_param


#: every attention layer's :class:`LayerAttention` by its global id, for the ``ditmesh::pipefusion_attend`` operator
#: (which takes tensors and plain values only); ids are unique over all transformers, so the operator needs no other
#: argument that differs between them (Wan 2.2's two experts trace one graph)
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LAYER_IDS = itertools.count()

#: transformers loaded with one stage's block weights (:func:`load_stage_transformer`) -> (pp rank, pp degree, the full
#: shape of every block tensor left empty, by name); kept here, not on the model
_STAGE_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def named_blocks(model: torch.nn.Module, adapter: ModelAdapter) -> list[tuple[str, torch.nn.Module]]:
    """(module path, block) of every block, in forward order."""
    return [(f"{spec.path}.{i}", block) for spec in adapter.blocks for i, block in enumerate(model.get_submodule(spec.path))]


def full_shape(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Size:
    """The shape of ``model``'s tensor ``name`` in the checkpoint (a stage-loaded model's other blocks are empty)."""
    return _STAGE_LOADED.get(model, (0, 0, {}))[2].get(name, tensor.shape)


def block_costs(model: torch.nn.Module, adapter: ModelAdapter) -> list[int]:
    """The cost of each block, in forward order: its parameter count (a proxy for its per-token FLOPs)."""
    return [sum(full_shape(model, f"{path}.{n}", p).numel() for n, p in block.named_parameters())
            for path, block in named_blocks(model, adapter)]


def split_stages(costs: list[int], stages: int) -> list[range]:
    """Cut the blocks into ``stages`` contiguous, non-empty ranges whose largest total cost is the smallest a
    contiguous cut allows (dynamic programming over the cut points; ties go to the earliest cut)."""
    n = len(costs)
    if stages > n:
        raise ConfigError(f"pp={stages} exceeds the {n} transformer blocks; use pp <= {n}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of the first i blocks in k stages; cut[k][i]: where the last begins
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, end = [], n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k][end], end))
        end = cut[k][end]
    return bounds[::-1]


class PipeFusion:
    """PipeFusion's state for one transformer: its stage, the current call's stream lengths, pending sends.

    It cuts the streams like :class:`~ditmesh.parallel.sequence.SequenceParallel` does (``split_value``,
    ``gather``), into the current patch rather than a rank's chunk, and runs the attention of every
    self-attention layer (:meth:`attend`, through a per-layer :class:`LayerAttention`).
    """

    def __init__(self, model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter, ctx: ForwardContext,
                 name: str, patches: int | None, warmup: int, chunk_bytes: int):
        self.adapter, self.ctx, self.name = adapter, ctx, name
        #: the sequence-parallel runtime of the same model (Ulysses inside each stage), or None
        sequence = find_hook(model, "sequence")
        self.sp = sequence.sp if sequence is not None else None
        self.plan = adapter.sequence_plan
        self.group = mesh.group("pp")
        #: two-rank groups with the previous and the next stage (sends and receives never share a group's stream)
        self.from_previous, self.to_next = mesh.neighbour_groups("pp")
        self.degree = mesh.size("pp")
        self.stage = mesh.rank("pp")
        self.patches = patches or self.degree
        self.warmup = warmup
        self.chunk_bytes = chunk_bytes
        self.stages = split_stages(block_costs(model, adapter), self.degree)
        loaded = _STAGE_LOADED.get(model)
        if loaded is not None and loaded[:2] != (self.stage, self.degree):
            raise ConfigError(f"this transformer was loaded with the blocks of stage {loaded[0]} of pp={loaded[1]}, "
                              f"but this rank is stage {self.stage} of pp={self.degree}; load it with "
                              "load_stage_transformer(..., pp_rank, pp) for this rank's place")
        #: the blocks this rank computes
        self.own = self.stages[self.stage]
        #: the stream cut into patches: the one gathered at the exit (image or video tokens)
        self.patch_stream = next(iter(self.plan.gathers.values())).stream
        #: global length of each stream in the current call (fixed at its first split)
        self.lengths: dict[str, int] = {}
        #: the exit's output over the whole sequence, filled patch by patch (a stale call)
        self.out: torch.Tensor | None = None
        #: (flat buffer, work handles) of the sends not yet waited for
        self.sends: list = []
        #: call in step -> the run whose first call of that kind has filled the K/V buffers
        self.filled: dict[int, int] = {}
        #: (buffer, work handles) of the next patch's receive, posted while this patch is computed
        self.prefetched = None
        #: the attention layers' names, in the order of their indices (:class:`LayerAttention`)
        self.layers: list[str] = []

    # -- the current patch ----------------------------------------------------------------------------------
    def exact(self) -> bool:
        """Whether this call runs as one patch: a warm-up step, or the buffers of this call in step are not filled
        in this run yet (a second transformer's first call of a run, as Wan 2.2's low-noise expert)."""
        ctx = self.ctx
        return ctx.run_step < self.warmup or self.filled.get(ctx.call_in_step) != ctx.run

    def patch_range(self, stream: str, index: int | None = None) -> tuple[int, int]:
        """(offset, length) of the current patch (or patch ``index`` of this call) in ``stream``: a contiguous piece
        of the patch stream; the whole of another stream in patch 0 (text travels with the first patch) and none of
        it in the others."""
        n = self.lengths[stream]
        current, count = self.ctx.patch
        index = current if index is None else index
        if count == 1:
            return 0, n
        if stream == self.patch_stream:
            sizes = comm.split_sizes(n, count)
            return sum(sizes[:index]), sizes[index]
        return (0, n) if index == 0 else (0, 0)

    def split(self, tensor: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """The current patch's part of ``tensor``, a part of ``stream`` along ``dim``."""
        n = tensor.shape[dim]
        known = self.lengths.setdefault(stream, n)
        if known != n:
            raise ValueError(f"stream {stream!r} has {known} tokens but a split point sees {n}")
        if stream == self.patch_stream and self.patches > n:
            raise ConfigError(f"pp_patches={self.patches} exceeds the {n} {stream} tokens of this call; use at most {n} "
                              "patches, or a larger size")
        offset, length = self.patch_range(stream)
        return tensor.narrow(dim, offset, length)

    def split_value(self, value, spec: Split):
        """``value`` cut by ``spec`` into the current patch (``sequence.split_value``)."""
        return split_value(self, value, spec)

    def gather(self, tensor: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """At the exit: the current patch's output written into the whole-sequence output, which is returned (the
        layers after the exit, e.g. an unpatchify, need every token; the last patch's call gives the result)."""
        index, count = self.ctx.patch
        if count == 1:
            return tensor
        if index == 0:
            shape = list(tensor.shape)
            shape[dim] = self.lengths[stream]
            self.out = tensor.new_empty(shape)
        offset, length = self.patch_range(stream)
        self.out.narrow(dim, offset, length).copy_(tensor)
        return self.out

    # -- attention over the K/V buffer ----------------------------------------------------------------------
    def attend(self, layer: torch.Tensor, query, key, value, backend=None, streams=None, mask=None):
        """The current patch's queries ``[B, S, H, D]`` against the K/V buffer of attention layer ``layer`` (its
        :class:`LayerAttention`'s global id as a 0-dim tensor), after writing this patch's ``key`` and ``value`` into
        it (tokens in the order of ``streams``, default the plan's). Under Ulysses the all-to-all gathers the patch's tokens (with this rank's
        heads) first and scatters the output back.

        The buffer's part runs as one operator (``ditmesh::pipefusion_attend``), so a compiled block neither traces
        nor guards on what differs between its calls: the layer (a tensor, not a constant) and the patch, its
        offsets and the buffers (read at run time inside the operator). The block class's forward is traced once
        per input shape, not once per layer and patch."""
        if mask is not None:
            raise NotImplementedError("PipeFusion (pp > 1) does not take an attention mask yet; run this pipeline "
                                      "without pp")
        streams = [s for s in (streams or self.plan.streams) if s in self.lengths]
        backend = None if backend is None else str(getattr(backend, "value", backend))

        def local(q, k, v):
            return torch.ops.ditmesh.pipefusion_attend(q, k, v, layer, backend, ",".join(streams))

        if self.sp is None:
            return local(query, key, value)
        return self.sp.attention(query, key, value, backend=backend, streams=streams, local=local)

    def token_runs(self, streams: list[str]) -> list[tuple[int, int]]:
        """(buffer position, count) of each run of the attention's tokens, in their order: per stream (in the
        buffer's order) the current patch's part; under sequence parallelism, each sp rank's chunk of those parts
        in turn (the order in which Ulysses gathers them)."""
        starts = dict(zip(streams, comm.offsets([self.lengths[s] for s in streams])))
        patch = {s: self.patch_range(s) for s in streams}
        if self.sp is None:
            return [(starts[s] + patch[s][0], patch[s][1]) for s in streams]
        sizes = self.ctx.stream_sizes
        return [(starts[s] + patch[s][0] + sum(sizes[s][:j]), sizes[s][j])
                for j in range(self.sp.degree) for s in streams]

    def attend_buffer(self, layer: int, query, key, value, backend, streams: list[str]):
        """Write ``key`` and ``value`` (the tokens of :meth:`token_runs`) into the buffer of attention layer ``layer``
        (its index in the transformer) and attend to it."""
        total = sum(self.lengths[s] for s in streams)
        shape = (key.shape[0], total) + tuple(key.shape[2:])
        name = (self.name, layer, self.ctx.call_in_step)
        kv = self.ctx.kv_buffers.get(name)
        if kv is None or kv[0].shape != shape or kv[0].dtype != key.dtype:
            if self.ctx.patch[1] != 1:  # cannot happen: a run's first call of each kind is exact
                raise RuntimeError(f"PipeFusion: no K/V buffer of shape {shape} for {layer} in a stale call")
            kv = self.ctx.kv_buffers[name] = (key.new_empty(shape), value.new_empty(shape))
        local = 0
        for start, length in self.token_runs(streams):
            kv[0][:, start:start + length] = key[:, local:local + length]
            kv[1][:, start:start + length] = value[:, local:local + length]
            local += length
        return dispatch_attention_fn(query, kv[0], kv[1], backend=backend)

    # -- between stages ------------------------------------------------------------------------------------
    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        """Send a patch's activations (by name) to the next stage as one flat buffer, without waiting."""
        flat = torch.cat([tensors[n].reshape(-1) for n in sorted(tensors)])
        self.sends.append((flat, comm.send_start(flat, 1, self.to_next, self.chunk_bytes)))

    def receive(self, like: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
        """The previous stage's activations of the current patch, shaped like ``like`` (this rank's own inputs of
        its first block, which have the same shapes). The receive of the next patch is posted at once (sized from
        the block list's ``streams``), so its transfer runs while this patch is computed."""
        names = sorted(like)
        dtypes = {like[n].dtype for n in names}
        if len(dtypes) != 1:
            raise NotImplementedError(f"PipeFusion sends one dtype per message; the carried tensors have {dtypes}")
        first = like[names[0]]
        size = sum(like[n].numel() for n in names)
        flat, works = self.prefetched or self.post_receive(size, first)
        self.prefetched = None
        if flat.numel() != size:
            raise RuntimeError(f"PipeFusion: {flat.numel()} values were received for a patch of {size}")
        for work in works:
            work.wait()
        index, count = self.ctx.patch
        if index + 1 < count and spec.streams:
            streams = dict(zip(spec.carries, spec.streams))
            # [batch, tokens, features...]: the next patch has the same batch and features, its own token counts
            self.prefetched = self.post_receive(sum(like[n].shape[0] * self.local_tokens(streams[n], index + 1)
                                                    * math.prod(like[n].shape[2:]) for n in names), first)
        out, offset = {}, 0
        for n in names:
            out[n] = flat[offset:offset + like[n].numel()].view(like[n].shape)
            offset += like[n].numel()
        return out

    def post_receive(self, size: int, like: torch.Tensor):
        """(buffer, work handles) of a receive of ``size`` values from the previous stage, posted now."""
        flat = torch.empty(size, dtype=like.dtype, device=like.device)
        return flat, comm.recv_start(flat, 0, self.from_previous, self.chunk_bytes)

    def local_tokens(self, stream: str, index: int) -> int:
        """Tokens of ``stream`` this rank holds in patch ``index`` (its sp chunk of the patch under Ulysses)."""
        length = self.patch_range(stream, index)[1]
        return length if self.sp is None else comm.split_sizes(length, self.sp.degree)[self.sp.rank]

    def finish_sends(self) -> None:
        """Wait for every send of this call (their buffers may then be freed)."""
        for _, works in self.sends:
            for work in works:
                work.wait()
        self.sends.clear()


class LayerAttention:
    """What one attention layer's processor calls as ``sp.attention``: the attention over that layer's PipeFusion K/V
    buffer, through ``owner.attend(index, ...)`` (the adapters' sequence-parallel processors compute projections,
    norms and RoPE on local tokens and hand the core attention to this object). The layer is named to the operator
    by a global id in a 0-dim tensor: a compiled block takes it as an input, where a Python value would be a guard
    (one trace per layer, or per transformer)."""

    def __init__(self, owner, layer: str):
        self.owner, self.layer = owner, layer
        #: this layer's index in its transformer (keys its K/V buffers)
        self.position = len(owner.layers)
        owner.layers.append(layer)
        self.id = torch.tensor(next(_LAYER_IDS))
        _LAYERS[int(self.id)] = self

    def attention(self, query, key, value, backend=None, streams=None, mask=None):
        return self.owner.attend(self.id, query, key, value, backend=backend, streams=streams, mask=mask)


@torch.library.custom_op("ditmesh::pipefusion_attend", mutates_args=())
def pipefusion_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor,
                      backend: str | None, streams: str) -> torch.Tensor:
    """:meth:`PipeFusion.attend_buffer` of the attention layer whose :class:`LayerAttention` has id ``int(layer)``,
    as one operator (``streams``: the stream names, comma-separated)."""
    this = _LAYERS[int(layer)]
    return this.owner.attend_buffer(this.position, query, key, value, backend, streams.split(",")).contiguous()


@pipefusion_attend.register_fake
def _(query, key, value, layer, backend, streams):
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


def drop_buffers(ctx: ForwardContext, name: str) -> None:
    """Forget the K/V buffers of transformer ``name`` (``ForwardContext.kv_buffers``, keyed by name first)."""
    for key in [k for k in ctx.kv_buffers if k[0] == name]:
        del ctx.kv_buffers[key]


class PatchLoop(Hook):
    """The transformer's ``pipefusion`` hook: runs the call once per patch and broadcasts the last stage's output."""

    name = "pipefusion"

    def __init__(self, pf: PipeFusion, splits: dict[str, Split], forward):
        self.pf, self.splits, self.forward = pf, splits, forward
        self.points: list = []

    def __call__(self, owner, call_next, args, kwargs):
        pf, ctx = self.pf, self.pf.ctx
        for point in self.points:
            point.follow(owner)
        kwargs = bind_kwargs(self.forward, args, kwargs)
        exact = pf.exact()
        count = 1 if exact else pf.patches
        pf.lengths, pf.out = {}, None
        try:
            for index in range(count):
                ctx.patch = (index, count)
                patch = {k: (pf.split_value(v, self.splits[k]) if k in self.splits else v) for k, v in kwargs.items()}
                output = call_next((), patch)
            pf.finish_sends()
        finally:
            ctx.patch, pf.out, pf.prefetched = None, None, None
            pf.sends.clear()
        if exact:
            pf.filled[ctx.call_in_step] = ctx.run
        sample = output_sample(output).contiguous()
        comm.broadcast_pieces(sample.view(-1), pf.degree - 1, pf.group, pf.chunk_bytes)
        return with_output_sample(output, sample)


class StageBlock(Hook):
    """A block's ``pipefusion`` hook: a block of another stage returns its inputs; this stage's first block takes
    its activations from the previous stage, its last block sends them to the next."""

    name = "pipefusion"

    def __init__(self, pf: PipeFusion, index: int, spec, forward):
        self.pf, self.index, self.spec, self.forward = pf, index, spec, forward

    def __call__(self, owner, call_next, args, kwargs):
        pf, index = self.pf, self.index
        named = bind_kwargs(self.forward, args, kwargs)
        if index not in pf.own:
            outputs = [named.get(name) for name in self.spec.returns]
            return tuple(outputs) if len(outputs) > 1 else outputs[0]
        if index == pf.own.start and pf.stage > 0:
            named.update(pf.receive({n: named[n] for n in self.spec.carries if named.get(n) is not None}, self.spec))
        output = call_next((), named)
        if index == pf.own.stop - 1 and pf.stage < pf.degree - 1:
            outputs = output if isinstance(output, tuple) else (output,)
            pf.send({n: t for n, t in zip(self.spec.returns, outputs) if t is not None})
        return output


def free_other_stages(pf: PipeFusion, model: torch.nn.Module):
    """Empty the parameters and buffers of the blocks of other stages (the Parameter objects stay, so names and
    module types are kept; a stage-loaded model's are empty already); returns the callable that broadcasts them
    back from their owners (every rank of the pp group calls it, in the same order)."""
    owner = {i: s for s, stage in enumerate(pf.stages) for i in stage}
    kept = []
    for i, (path, block) in enumerate(named_blocks(model, pf.adapter)):
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            kept.append((owner[i], t, full_shape(model, f"{path}.{name}", t), t.dtype))
            if owner[i] != pf.stage:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def restore():
        for stage, t, shape, dtype in kept:
            if stage != pf.stage:
                t.data = torch.empty(shape, dtype=dtype, device=t.device)
            comm.broadcast_pieces(t.data.view(-1), stage, pf.group, pf.chunk_bytes)

    return restore


def apply(model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter, ctx: ForwardContext, name: str,
          patches: int | None = None, warmup: int = 1, chunk_bytes: int = PP_CHUNK_BYTES) -> list:
    """Run ``model`` as a PipeFusion pipeline over the mesh's pp axis (see the module docstring); returns undo
    callables. ``name``: the transformer's component name (keys its K/V buffers). Does nothing at pp = 1."""
    if mesh.size("pp") == 1:
        return []
    pf = PipeFusion(model, mesh, adapter, ctx, name, patches, warmup, chunk_bytes)
    undo = []
    loop = PatchLoop(pf, adapter.sequence_plan.inputs.get("", {}), model.forward)
    undo.append(add_hook(model, loop))
    loop.points = split_points(model, adapter.sequence_plan, pf, first=True)
    undo += [p.remove for p in loop.points]
    index = 0
    for spec in adapter.blocks:
        for block in model.get_submodule(spec.path):
            undo.append(add_hook(block, StageBlock(pf, index, spec, block.forward)))
            index += 1
    restore_processors = adapter.set_layer_processors(model, lambda layer: LayerAttention(pf, layer))
    undo += [restore_processors, lambda: drop_buffers(ctx, name), free_other_stages(pf, model)]
    return undo


def load_stage_transformer(folder, pp_rank: int, pp_size: int, device, dtype: torch.dtype,
                           component: str = "transformer") -> torch.nn.Module:
    """Load a pipeline's transformer so that this rank reads only the block weights of its PipeFusion stage (and every
    weight outside the blocks: embedders, exit layers).

    The model is built on the meta device, the stages are cut from its shapes as :func:`apply` cuts them, and the
    other stages' block parameters get empty storage of ``dtype``. ``folder``: as ``tensor.MetaLoad`` takes it.
    Pass the result to the pipeline and :func:`ditmesh.parallelize` it with the same pp degree on this rank's place
    (``ParallelConfig.coordinate(rank, "pp")``); ``remove()`` broadcasts the other stages' weights to it.
    """
    load = MetaLoad(folder, component, device, dtype)
    model = load.model
    adapter = adapter_for(model)
    stage = split_stages(block_costs(model, adapter), pp_size)[pp_rank]
    empty = {}
    for i, (path, block) in enumerate(named_blocks(model, adapter)):
        if i in stage:
            continue
        for name, param in list(block.named_parameters()):
            full = f"{path}.{name}"
            empty[full] = param.shape
            module, _, attr = full.rpartition(".")
            kind = _load_dtype(full, param, dtype, load.keep_fp32)
            _set_param(model.get_submodule(module), attr, torch.empty(0, dtype=kind, device=load.device))
    model = load.finish(set(empty))
    _STAGE_LOADED[model] = (pp_rank, pp_size, empty)
    return model
