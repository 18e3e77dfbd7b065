"""Sequence parallelism on a transformer: split once where tokens appear, gather once before they leave.

The adapter's :class:`SequencePlan` names the split points: forward inputs of the transformer (cut by its
``sequence`` hook, :class:`SequenceEntry`), inputs or outputs of submodules where tokens first exist inside
the model (SD3's ``pos_embed``, Wan's ``rope`` and ``blocks.0``: torch forward hooks), and the module whose
output is gathered (``proj_out``). Inside, every block works on the local shard; attention layers run
through the adapter's processor, which calls :meth:`SequenceParallel.attention`. The chunk sizes of each
stream live in the call's :class:`~ditmesh.hooks.ForwardContext`.

Masks. A processor passes the mask its model built, in the model's own (global) token order: the streams the
attention covers, each whole, in the plan's order (FLUX-like: all text, then all image). The local sequence of
sp rank ``j`` is its chunk of each stream in that order, and Ulysses, ring and USP all see the keys as the ranks'
local sequences one after another (``[text_0, image_0, text_1, image_1, ...]``). :meth:`SequenceParallel.
gathered_mask` reorders the mask's key columns (and its query rows, when it has one per query) into that order,
from the stream sizes of the call, so the attention functions slice it by rank like the keys.

Token grids. A stream whose tokens are the rows of a 2-D grid that a convolution mixes across rows (the plan's
``TokenGrid``: Sana's Mix-FFN) is split in whole rows, from the row width the grid reads off the forward's inputs at
the entry; the int input that counts the rows (a block's ``height``) is replaced by this rank's rows, and each of the
grid's convolutions exchanges the halo rows its window needs with the neighbouring ranks first (the parallel VAE's
``ConvHook`` on a state whose rows per rank are the stream's split). Partial sums over keys (linear attention) are
added over the sp ranks with :meth:`SequenceParallel.sum`.

Cross-rank rules: chunk sizes come from global lengths only (identical on every rank, nothing is
exchanged); every rank runs every attention layer in the same order.
"""

from __future__ import annotations

import dataclasses

import torch
from ..attention.local import QueryChunks, attention_with_lse, score_mask
from ..attention.ring import merge_partial, ring_attention
from ..attention.ulysses import ulysses_attention
from ..attention.usp import ring_chunk_sizes, usp_attention
from ..comm import all_gather_uneven, all_reduce_sum, group_name, offsets, split_sizes
from ..config import ConfigError
from ..hooks import ForwardContext, Hook, add_hook, bind_kwargs
from ..mesh import ParallelMesh
from ..models.base import Gather, ModelAdapter, Split, is_attention, name_pattern
from .chunk import dispatched_attention
from .vae import ConvHook, ConvRows, VaeParallel


class SequenceParallel:
    """Runtime state of sequence parallelism for one model: groups, degrees, and the current split.

    The sequence-parallel (sp) ranks are the ``ring x ulysses`` sub-mesh, ring-major:
    ``rank = ring_rank * ulysses_degree + ulysses_rank``, the DeviceMesh's own row-major order (ulysses
    is the inner axis). Chunk ``rank`` of every stream lives on this rank; ``group`` spans all sp ranks
    in that order and gathers the output at the exit.
    """

    def __init__(self, mesh: ParallelMesh, adapter: ModelAdapter, ctx: ForwardContext, chunks: int | None = None,
                 compiled: bool = False, transport: str = "nccl", query_chunks: QueryChunks | None = None,
                 comm_dtype: str = "auto", eight=None):
        self.adapter = adapter
        self.ctx = ctx
        self.plan = adapter.sequence_plan
        self.ring_degree = mesh.size("ring")
        self.ulysses_degree = mesh.size("ulysses")
        self.ring_rank = mesh.rank("ring")
        self.ulysses_rank = mesh.rank("ulysses")
        self.ring_group = mesh.group("ring")
        self.ulysses_group = mesh.group("ulysses")
        self.degree = self.ring_degree * self.ulysses_degree
        self.rank = mesh.flat_rank("ring", "ulysses")
        self.group = mesh.group_of("ring", "ulysses")
        # functional collectives take group names; resolved here, outside any compiled region
        self.ulysses_group_name = group_name(self.ulysses_group) if self.ulysses_degree > 1 else None
        self.ring_group_name = group_name(self.ring_group) if self.ring_degree > 1 else None
        #: head groups pipelined against the Ulysses all-to-alls (see ``attention.ulysses``)
        self.ulysses_chunks = default_chunks(mesh.device, compiled) if chunks is None else chunks
        #: how Ulysses-only attention moves its all-to-alls (``options.TRANSPORTS``)
        self.transport = transport
        #: pieces of the queries the local attention runs on, after the all-to-all (``parallel.chunk``); None: whole
        self.query_chunks = query_chunks
        #: what the Ulysses all-to-alls and the ring's K/V travel as (``options.COMM_DTYPES``)
        self.comm_dtype = comm_dtype
        #: the 8-bit local attention after the Ulysses all-to-all (``parallel.eight.EightBitAttention``), or None
        self.eight = eight
        #: local attention sequence length of each sp rank (sum over the streams split so far in this call)
        self.seq_sizes: list[int] = []
        #: (streams, their chunk sizes, device) -> (tokens, the mask reorder index or None) (:meth:`gathered_mask`)
        self._orders: dict[tuple, tuple] = {}
        #: the plan's token grid (a stream split in whole rows), its row width in this call, and the rows each rank
        #: holds, which the grid's convolutions read to exchange their halo rows (the parallel VAE's ``ConvHook``)
        self.grid = self.plan.grid
        self.grid_width: int | None = None
        self.grid_rows = VaeParallel(self.group, strict=True) if self.grid is not None else None

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the sp ranks (one all-reduce): the exact merge of per-rank partial sums over keys,
        such as linear attention's ``sum_k v k^T`` and ``sum_k k`` (``models/sana.py``), under ulysses, ring or USP."""
        return all_reduce_sum(tensor, self.group)

    def attention(self, query, key, value, backend=None, streams=None, mask=None, local=None):
        """Full-sequence attention from local shards ``[B, S_local, H, D]``; returns the same layout.

        Ulysses alone runs the local attention through diffusers' dispatcher with ``backend``. Ring and
        USP need the log-sum-exp of each partial result, so they run :func:`attention_with_lse` (fused
        flash / memory-efficient kernels on CUDA, float32 math on CPU) whatever ``backend`` says.
        ``mask``: optional, in the model's global token order (:meth:`gathered_mask`), boolean (True keeps)
        or floating (added to the scores), as SDPA takes it. With ``query_chunks`` the local attention (after the
        all-to-all, or each ring round's) runs on pieces of the queries; the collectives are the same.
        ``local``: what attends over the gathered tokens (``local(q, k, v)`` on ``[B, S, h, D]``, the keys and
        values of every sp rank in the sp ranks' order, :meth:`gathered_order`) instead of the dispatcher:
        PipeFusion's attention over its K/V buffer; it gets all of this rank's heads at once (one head group). Under
        ring (and USP) its keys and values are all-gathered over the ring group (:meth:`ring_gathered`) and its
        queries are this ring rank's tokens. ``comm_dtype`` and the 8-bit attention (``eight``) apply to the
        Ulysses, ring and USP paths; ``local``'s gathers travel in the activations' dtype.
        """
        # ``streams``: the streams this attention runs over (default: all, e.g. joint text+image); an
        # image-only attention inside a joint model (SD3.5 ``attn2``) passes ``("image",)``.
        seq_sizes = self.seq_sizes if streams is None else self.local_lengths(streams)
        if mask is not None:
            mask = self.gathered_mask(mask, self.plan.streams if streams is None else streams)
        if local is not None and self.eight is not None:  # never an exact attention where 8 bits were asked for
            raise NotImplementedError("the 8-bit attention does not run a layer that attends through its own kernel "
                                      "(a cached prefix, a block-sparse mask); use the default attention")
        if local is not None and self.ring_degree > 1:
            return self.ring_gathered(query, key, value, seq_sizes, local)
        if self.ring_degree == 1:
            # the fp8 attention reduces its scales over the group: one call of every rank, never a head group that
            # leaves a rank without heads (and so without its all-reduce)
            chunks = self.ulysses_chunks if local is None and self.eight is None else 1

            def dispatched(q, k, v, mask=None):
                return dispatched_attention(q, k, v, mask, backend, self.query_chunks)

            if local is None and self.eight is not None:
                self.eight.backend = backend
                local = self.eight
            return ulysses_attention(query, key, value, seq_sizes, self.ulysses_rank, self.ulysses_group_name,
                                     local or dispatched, chunks=chunks, transport=self.transport, mask=mask,
                                     comm_dtype=self.comm_dtype)
        if self.ulysses_degree == 1:
            return ring_attention(query, key, value, seq_sizes, self.ring_rank, self.ring_group_name, mask=mask,
                                  chunks=self.query_chunks, comm_dtype=self.comm_dtype)
        return usp_attention(query, key, value, seq_sizes, self.ulysses_degree, self.ring_rank, self.ulysses_rank,
                             self.ring_group_name, self.ulysses_group_name, mask=mask, chunks=self.query_chunks,
                             comm_dtype=self.comm_dtype)

    def whole_query_attention(self, query, key, value):
        """Queries every sp rank holds whole (``[B, S_q, H, D]``: LTX-2's audio) against keys and values split over the
        sp ranks (this rank's part of a stream: the video), all heads. Each rank attends to its own keys, keeping the
        log-sum-exp; one all-gather of every rank's partial output and log-sum-exp (packed as one tensor), merged in
        rank order. Cross-rank rule: every rank merges the same pieces in the same order, so every rank ends with the
        same result, bit for bit. Exact up to the merge's rounding (as ring attention)."""
        out, lse = attention_with_lse(query, key, value)
        packed = torch.cat([out.float(), lse.transpose(1, 2).unsqueeze(-1)], dim=-1)  # [B, S_q, H, D + 1]
        batch = packed.shape[0]
        gathered = all_gather_uneven(packed, 0, [batch] * self.degree, self.group)
        merged, merged_lse = None, None
        for part in gathered.split(batch, dim=0):
            merged, merged_lse = merge_partial(merged, merged_lse, part[..., :-1], part[..., -1].transpose(1, 2))
        return merged.to(query.dtype)

    def ring_gathered(self, query, key, value, seq_sizes: list[int], local):
        """``local`` over every sp rank's keys and values under ring or USP: after the Ulysses all-to-all (USP) the
        ring ranks' keys and values are all-gathered (one all-gather, K and V together), and ``local`` attends this
        ring rank's queries to all of them. PipeFusion's K/V buffer holds the whole sequence on every rank, so the
        ring's rounds and their log-sum-exp merge have nothing to add; the bytes moved are the ring's."""
        ring_sizes = ring_chunk_sizes(seq_sizes, self.ulysses_degree)

        def gathered(q, k, v):
            kv = all_gather_uneven(torch.cat([k, v], dim=-1), 1, ring_sizes, self.ring_group)
            return local(q, *kv.chunk(2, dim=-1))

        if self.ulysses_degree == 1:
            return gathered(query, key, value)
        first = self.ring_rank * self.ulysses_degree
        return ulysses_attention(query, key, value, seq_sizes[first:first + self.ulysses_degree], self.ulysses_rank,
                                 self.ulysses_group_name, gathered, chunks=1, transport=self.transport)

    def gathered_order(self, streams) -> list[int]:
        """Global positions of the tokens of ``streams`` in the sp ranks' order: rank 0's chunk of each stream (in
        ``streams``' order), then rank 1's, ... The global order is the streams whole, one after another."""
        sizes = self.ctx.stream_sizes
        present = [s for s in streams if s in sizes]
        starts = dict(zip(present, offsets([sum(sizes[s]) for s in present])))
        order: list[int] = []
        for j in range(self.degree):
            for s in present:
                first = starts[s] + sum(sizes[s][:j])
                order.extend(range(first, first + sizes[s][j]))
        return order

    def gathered_mask(self, mask: torch.Tensor, streams) -> torch.Tensor:
        """``mask`` (``[B, S]`` key padding or ``[B, 1 or H, S or 1, S]``, global token order over ``streams``) with
        its key columns, and its query rows when it has one per query, in the sp ranks' order."""
        mask = score_mask(mask)
        sizes = self.ctx.stream_sizes
        key = (tuple(streams), tuple(tuple(sizes.get(s, ())) for s in streams), mask.device)
        if key not in self._orders:  # once per shape: every layer of a call reuses it
            order = self.gathered_order(streams)
            identity = order == list(range(len(order)))  # one stream: the ranks' order is the model's
            self._orders[key] = (len(order), None if identity else torch.tensor(order, device=mask.device))
        length, index = self._orders[key]
        if mask.shape[-1] != length or mask.shape[-2] not in (1, length):
            raise ValueError(f"the attention mask covers {mask.shape[-2]} queries x {mask.shape[-1]} keys but the "
                             f"attention runs over {length} tokens of {tuple(streams)}")
        if index is None:
            return mask
        mask = mask.index_select(-1, index)
        return mask.index_select(-2, index) if mask.shape[-2] != 1 else mask

    # -- split points ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a transformer call: no stream has been split yet (its sizes come from its first split)."""
        self.ctx.stream_sizes = {}
        self.seq_sizes = []
        self.grid_width = None
        if self.grid_rows is not None:
            self.grid_rows.units = None

    def stream_length(self, stream: str) -> int:
        """The global token count of ``stream`` in this call (it must have been split already)."""
        return sum(self.ctx.stream_sizes[stream])

    def local_range(self, stream: str) -> tuple[int, int]:
        """(global index of this rank's first token of ``stream``, its token count) in this call (split already)."""
        sizes = self.ctx.stream_sizes[stream]
        return sum(sizes[: self.rank]), sizes[self.rank]

    def local_lengths(self, streams) -> list[int]:
        """Local attention length of each sp rank over ``streams`` (those split so far in this call)."""
        sizes = self.ctx.stream_sizes
        return [sum(sizes[s][j] for s in streams if s in sizes) for j in range(self.degree)]

    def split(self, tensor: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """This rank's contiguous chunk of ``tensor`` along ``dim``, a part of token stream ``stream``.

        The first split of a stream in a call fixes its chunk sizes (from the global length, so every rank
        agrees); later splits of the same stream (its RoPE table, its positions) must have that length.
        """
        n = tensor.shape[dim]
        if stream not in self.ctx.stream_sizes:
            self.ctx.stream_sizes[stream] = self.chunk_sizes(stream, n)
        sizes = self.ctx.stream_sizes[stream]
        if sum(sizes) != n:
            raise ValueError(f"stream {stream!r} has {sum(sizes)} tokens but a split point sees {n}")
        self.seq_sizes = self.local_lengths(self.plan.streams)
        return tensor.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])

    def chunk_sizes(self, stream: str, n: int) -> list[int]:
        """Tokens of ``stream`` on each sp rank: contiguous, uneven by at most one token; a grid stream
        (:class:`~ditmesh.models.base.TokenGrid`) in whole rows, uneven by at most one row."""
        if self.grid is None or stream != self.grid.stream:
            return split_sizes(n, self.degree)
        width = self.grid_width
        rows, rest = divmod(n, width)
        if rest or rows < self.degree:
            raise ValueError(f"{self.adapter.name} splits its {stream} tokens in whole grid rows, one or more per rank: "
                             f"{n} tokens in rows of {width} cannot go to {self.degree} sequence-parallel ranks; use "
                             f"{self.grid.enough.format(n=self.degree)} or fewer ranks")
        self.grid_rows.units = split_sizes(rows, self.degree)
        return [r * width for r in self.grid_rows.units]

    def local_rows(self) -> int:
        """Grid rows of this rank in this call (after the grid stream's first split)."""
        return self.grid_rows.units[self.rank]

    def split_value(self, value, spec: Split):
        """``value`` split by ``spec``: a tensor of the expected ndim, or each tensor of a list/tuple; else as is."""
        return split_value(self, value, spec)

    def gather(self, tensor: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """Every rank's chunk of ``stream`` concatenated along ``dim`` (one all-gather)."""
        return all_gather_uneven(tensor, dim, self.ctx.stream_sizes[stream], self.group)


def split_value(splitter, value, spec: Split):
    """``value`` cut by ``spec`` through ``splitter.split(tensor, dim, stream)``: a tensor of the expected ndim, or each
    tensor of a list or tuple (of its element ``spec.item`` only, when given), each value of a dict (AnyFlow's RoPE
    table for the queries and the keys); anything else as is."""
    if isinstance(value, dict):
        return {key: split_value(splitter, v, spec) for key, v in value.items()}
    if spec.count is not None and isinstance(value, int) and not isinstance(value, bool):
        return _counted(splitter, value, spec)[1]
    if isinstance(value, (list, tuple)):
        if spec.item is not None:
            whole = dataclasses.replace(spec, item=None)
            return type(value)(split_value(splitter, v, whole) if i == spec.item else v for i, v in enumerate(value))
        return type(value)(split_value(splitter, v, spec) for v in value)
    if not isinstance(value, torch.Tensor) or (spec.ndim is not None and value.ndim != spec.ndim):
        return value
    if spec.broadcast and value.shape[spec.dim] == 1:
        return value
    if spec.count is not None:  # over the stream's first or last tokens: this rank's part of them
        return value.narrow(spec.dim, *_counted(splitter, value.shape[spec.dim], spec))
    if spec.folded:  # groups of the stream's tokens, one per entry of an outer axis folded into dim: each group cut
        first, size = splitter.local_range(spec.stream)
        groups = value.unflatten(spec.dim, (-1, splitter.stream_length(spec.stream)))
        return groups.narrow(spec.dim + 1, first, size).flatten(spec.dim, spec.dim + 1)
    if spec.leading:  # the stream's tokens first, then tokens already local: only the former are cut
        n = splitter.stream_length(spec.stream)
        rest = value.narrow(spec.dim, n, value.shape[spec.dim] - n)
        return torch.cat([splitter.split(value.narrow(spec.dim, 0, n), spec.dim, spec.stream), rest], dim=spec.dim)
    return splitter.split(value, spec.dim, spec.stream)


def _counted(splitter, n: int, spec: Split) -> tuple[int, int]:
    """(offset, length) of this rank's part among the stream's first or last ``n`` tokens (``spec.count``)."""
    first, size = splitter.local_range(spec.stream)
    total = splitter.stream_length(spec.stream)
    lo = 0 if spec.count == "first" else total - n
    start, end = max(first, lo), min(first + size, lo + n)
    return (start - lo, end - start) if end > start else (0, 0)


class AtPath:
    """A torch hook on whichever module is at ``path`` of the model: :meth:`follow` moves it when another module
    has taken that place (peft wraps a linear in a LoRA layer when an adapter is loaded, and puts the linear back
    when it is unloaded), so a split or gather point stays where the plan names it."""

    def __init__(self, model: torch.nn.Module, path: str, register):
        self.path, self.register = path, register
        self.module = model.get_submodule(path)
        self.handle = register(self.module)

    def follow(self, model: torch.nn.Module) -> None:
        """Re-register the hook if the module at ``path`` is no longer the one holding it."""
        module = model.get_submodule(self.path)
        if module is not self.module:
            self.handle.remove()
            self.module, self.handle = module, self.register(module)

    def remove(self) -> None:
        self.handle.remove()


class SequenceEntry(Hook):
    """The transformer's ``sequence`` hook: starts the call's split and cuts the entry inputs of the plan."""

    name = "sequence"

    def __init__(self, sp: SequenceParallel, splits: dict[str, Split], forward):
        self.sp, self.splits, self.forward = sp, splits, forward
        #: the split and gather points inside the model (:class:`AtPath`)
        self.points: list[AtPath] = []

    def __call__(self, owner, call_next, args, kwargs):
        for point in self.points:
            point.follow(owner)
        self.sp.begin()
        kwargs = bind_kwargs(self.forward, args, kwargs)
        if self.sp.grid is not None:
            self.sp.grid_width = self.sp.grid.width(owner, kwargs)
        kwargs = {k: (self.sp.split_value(v, self.splits[k]) if k in self.splits else v) for k, v in kwargs.items()}
        return call_next((), kwargs)


def _split_inputs_hook(sp: SequenceParallel, module: torch.nn.Module, splits: dict[str, Split], first: bool = False):
    forward = module.forward

    def pre_hook(mod, args, kwargs):
        named = bind_kwargs(forward, args, kwargs)
        if not any(k in named for k in splits):
            return None
        return (), {k: (sp.split_value(v, splits[k]) if k in splits else v) for k, v in named.items()}

    return module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=first)


def _local_rows_hook(sp: SequenceParallel, module: torch.nn.Module, name: str):
    """Replace the int input ``name`` (the grid's row count, e.g. Sana's block ``height``) by this rank's rows."""
    forward = module.forward

    def pre_hook(mod, args, kwargs):
        named = bind_kwargs(forward, args, kwargs)
        return (), dict(named, **{name: sp.local_rows()})

    return module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _grid_hooks(model: torch.nn.Module, sp: SequenceParallel) -> list:
    """The token grid's hooks: its row counts made local (torch pre-hooks that follow the module at their path) and
    its convolutions given the parallel VAE's halo exchange (``ConvHook``). Returns (points, undo callables)."""
    grid, points, undo = sp.grid, [], []
    for pattern, name in grid.rows.items():
        for path, _ in _modules_at(model, pattern):
            points.append(AtPath(model, path, lambda m, name=name: _local_rows_hook(sp, m, name)))
    for pattern in grid.convs:
        for path, conv in _modules_at(model, pattern):
            if not isinstance(conv, torch.nn.Conv2d) or isinstance(conv.padding, str) or conv.padding_mode != "zeros":
                raise NotImplementedError(f"{path}: the token grid's halo exchange takes zero-padded nn.Conv2d layers, "
                                          f"not {type(conv).__name__} (padding {conv.padding!r})")
            kernel = conv.dilation[0] * (conv.kernel_size[0] - 1) + 1
            rows = ConvRows(kernel, conv.stride[0], conv.padding[0], conv.padding[0])
            undo.append(add_hook(conv, ConvHook(sp.grid_rows, rows)))
    return points, undo


def _modules_at(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every module of ``model`` whose path matches ``pattern`` (:func:`module_paths`)."""
    return [(path, model.get_submodule(path)) for path in module_paths(model, pattern)]


def _split_outputs_hook(sp: SequenceParallel, module: torch.nn.Module, splits: dict, first: bool = False):
    def hook(mod, args, out):
        if None in splits:
            return sp.split_value(out, splits[None])
        return type(out)(sp.split_value(t, splits[i]) if i in splits else t for i, t in enumerate(out))

    return module.register_forward_hook(hook, prepend=first)


def _gather_hook(sp: SequenceParallel, module: torch.nn.Module, spec: Gather):
    def hook(mod, args, out):
        if spec.item is None:
            return sp.gather(out, spec.dim, spec.stream)
        return type(out)(sp.gather(t, spec.dim, spec.stream) if i == spec.item else t for i, t in enumerate(out))

    return module.register_forward_hook(hook)


def module_paths(model: torch.nn.Module, pattern: str) -> list[str]:
    """The paths of ``model``'s modules that ``pattern`` names: itself when it has no ``*``, else every module it
    matches (``*`` = one path segment; QwenImage's ``transformer_blocks.*`` is every block). A ``-1`` segment is the
    last module of the list before it (Krea 2's and Kandinsky 5's ``transformer_blocks.-1``: the last block, whatever
    the checkpoint's depth)."""
    if "-1" in pattern.split("."):
        resolved: list[str] = []
        for segment in pattern.split("."):
            if segment == "-1":
                segment = str(len(model.get_submodule(".".join(resolved))) - 1)
            resolved.append(segment)
        pattern = ".".join(resolved)
    if "*" not in pattern:
        return [pattern]
    regex = name_pattern(pattern)
    return [name for name, _ in model.named_modules() if regex.match(name)]


def split_points(model: torch.nn.Module, plan, splitter, first: bool = False) -> list[AtPath]:
    """The split and gather points of ``plan`` inside ``model`` (every path but the entry ``""``), as :class:`AtPath`
    hooks that call ``splitter.split_value`` and ``splitter.gather``: a :class:`SequenceParallel`, or PipeFusion's
    patch splitter, which cuts the same streams at the same places into patches. ``first``: its splits run before
    the hooks already on those modules, its gathers after them (PipeFusion cuts a patch, then sequence parallelism
    cuts the patch; sequence parallelism gathers the patch, then PipeFusion places it)."""
    points = []
    for pattern, splits in plan.inputs.items():
        for path in module_paths(model, pattern) if pattern else ():
            points.append(AtPath(model, path,
                                 lambda m, splits=splits: _split_inputs_hook(splitter, m, splits, first)))
    for pattern, splits in plan.outputs.items():
        for path in module_paths(model, pattern):
            points.append(AtPath(model, path,
                                 lambda m, splits=splits: _split_outputs_hook(splitter, m, splits, first)))
    for pattern, spec in plan.gathers.items():
        for path in module_paths(model, pattern):
            points.append(AtPath(model, path, lambda m, spec=spec: _gather_hook(splitter, m, spec)))
    return points


def default_chunks(device: torch.device, compiled: bool = False) -> int:
    """Head groups pipelined per Ulysses attention when none are asked for: 2 on GPUs in eager mode, else 1.

    Measured on 4x H200 (docs/lab/ulysses-overlap.md): in eager mode the all-to-all of one group runs beside the
    attention of the previous one and pays (Wan2.1-14B video hid 35 ms per step). Compiled, the hidden
    transfers ran slower beside the compute and saved nothing (FLUX 1024^2 x4 with CUDA graphs: 44.5 ms with one
    group, 44.8 with two; 2048^2: 198.6 vs 204.3; Wan compiled: 796.6 vs 796.9), so one group is the default
    there. On CPU (gloo) the same cores would do both.
    """
    return 2 if device.type == "cuda" and not compiled else 1


def check_attention_selection(model: torch.nn.Module, adapter: ModelAdapter) -> None:
    """Refuse an adapter whose attention selection misses an attention layer of ``model`` (or matches none).

    A layer left out would attend over its local tokens only and give a wrong result with no error; the layers the
    adapter declares whole (``whole_attention``, run before the split) are not counted.
    """
    selected = {name for name, _ in adapter.attention_modules(model)}
    whole = {name for name, _ in adapter.whole_attention.select(model)} if adapter.whole_attention else set()
    every = [name for name, module in model.named_modules() if is_attention(module) and name not in whole]
    missed = [name for name in every if name not in selected]
    if not selected or missed:
        shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
        raise NotImplementedError(
            f"the {adapter.name} adapter's attention selection {adapter.attention} matches "
            f"{len(selected)} of the {len(every)} attention layers of {type(model).__name__}"
            + (f" (missed: {shown})" if missed else "") + "; sequence parallelism would attend over local tokens "
            "there; fix the adapter's `attention` selector")


def apply(model: torch.nn.Module, mesh: ParallelMesh, adapter: ModelAdapter, ctx: ForwardContext,
          chunks: int | None = None, compiled: bool = False, transport: str = "nccl",
          query_chunks: QueryChunks | None = None, comm_dtype: str = "auto", eight=None) -> list:
    """Make ``model`` sequence-parallel over the mesh's ring and ulysses axes. Returns undo callables.

    Ulysses alone, ring alone, or both (USP) follow from the degrees. ``chunks``: Ulysses head groups
    pipelined against the all-to-alls (default :func:`default_chunks`, which depends on whether the blocks
    will be ``compiled``). ``transport``: how Ulysses-only attention moves its all-to-alls ("nccl" or
    "symm"; ring and USP always use the process group's backend). ``query_chunks``: the local attention runs on
    pieces of the queries (``parallel.chunk``). ``comm_dtype``: what the payloads travel as (``options.COMM_DTYPES``);
    ``eight``: the 8-bit local attention under Ulysses (``parallel.eight``). The runtime state is the ``sequence``
    hook's ``sp`` (``hooks.find_hook(model, "sequence").sp``). Does nothing (and returns ``[]``) when the
    sequence-parallel degree is 1.
    """
    if mesh.config.sp == 1:
        return []
    if compiled and adapter.sequence_plan.grid is not None:
        raise ConfigError(f"{adapter.name}: the halo exchange of its token grid's convolutions does not run inside "
                          "compiled blocks; use compile off with sequence parallelism, or compile with tp, cfg or dp")
    check_attention_selection(model, adapter)
    sp = SequenceParallel(mesh, adapter, ctx, chunks, compiled, transport, query_chunks, comm_dtype, eight)
    plan = adapter.sequence_plan
    entry = SequenceEntry(sp, plan.inputs.get("", {}), model.forward)
    undo = [add_hook(model, entry)]
    entry.points = split_points(model, plan, sp)
    if plan.grid is not None:
        grid_points, grid_undo = _grid_hooks(model, sp)
        entry.points += grid_points
        undo += grid_undo
    if adapter.sequence_hooks is not None:  # after the split points: a hook may read the call's chunk sizes
        undo += adapter.sequence_hooks(model, sp)
    undo += [p.remove for p in entry.points]
    return undo + [adapter.set_processors(model, sp)]
