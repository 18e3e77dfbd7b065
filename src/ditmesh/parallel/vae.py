"""Parallel VAE decode and encode, exact: the image split along height over the ranks that hold it.

Every rank of a parallelized pipeline holds the same final latents (the whole pipeline call runs on every rank;
only the transformer call is divided), so all of them decode together. At the entry of ``decode`` (and of
``_encode``) the latent rows (image rows, in whole latent rows) are split into contiguous chunks, uneven where the
count does not divide; every layer then works on this rank's rows, and the output is all-gathered once at the exit.
Each rank holds ``units[r]`` latent rows; at any layer it holds ``units[r] * m`` rows, where ``m`` (rows per latent
row) follows from the local height, so no layer needs to be told where it sits.

- **Convolutions** (``nn.Conv2d``, ``nn.Conv3d`` and subclasses such as Wan's causal 3-D convolution): before each
  one, the rows its window needs from the other ranks (the halo: one row each side for a 3x3 convolution) travel
  point-to-point (``comm.exchange_rows``, one ``halo`` round), the convolution runs with its own padding on the
  extended rows, and the rows that belong to this rank are kept. A strided convolution's outputs are split in the
  same proportion as its inputs, so the layout stays proportional through diffusers' ``Downsample2D`` (which pads
  one zero row at the bottom first: that row is kept only where it is the image's bottom edge) and through a zero
  pad in front of a convolution in an ``nn.Sequential`` (Wan's down-sampling). Nearest up-sampling needs nothing.
  A convolution's other tensor inputs with the rows of its input (Wan's temporal cache) are extended the same way,
  so each rank's cache holds exactly its own rows.
- **Group norms** are exact: each rank computes, per sample and group, its count, mean and centred sum of squares
  (float64), one all-gather collects them, and Chan's combination adds the between-rank term
  ``sum n_r (mean_r - mean)^2`` that a norm over local rows (or a sum of local variances) misses.
- **Modules that mix all rows** (the plan's ``gathered``: the mid-block attention). diffusers' plain ``Attention``
  (the KL VAE's) is split by its queries: each rank's rows attend to the all-gathered keys and values of every row
  (:class:`RowsAttentionHook`), so each rank does its share of the attention. Other such modules (Wan's attention
  block) run on the all-gathered rows, and each rank keeps its own rows of the result. Memory: either way a rank
  holds the whole frame's key and value input.

A call that cannot be split runs whole on every rank (``auto``) or raises (``on``), decided from global shapes,
so every rank takes the same path: tiling on, fewer latent rows than ranks, or an image height that is not a
multiple of the VAE's spatial factor.

Cross-rank rule: every rank calls the VAE with the same shapes; the split sizes, the halo sizes and the output
sizes are derived from the global height only, and each rank exchanges rows with exactly the ranks that need
them (usually its neighbours).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import all_gather_uneven, exchange_rows, offsets, split_sizes
from ..config import ConfigError
from ..hooks import Hook, add_hook

log = logging.getLogger("ditmesh")


# -- the geometry of one convolution along height ------------------------------------------------------------
@dataclass(frozen=True)
class ConvRows:
    """A convolution along height: effective kernel (dilation included), stride, its own zero padding (top,
    bottom), and the zero rows its caller padded in front of it (top, bottom), which belong to the image's edges."""

    kernel: int
    stride: int
    pad_top: int
    pad_bottom: int
    pre_top: int = 0
    pre_bottom: int = 0


@dataclass(frozen=True)
class Window:
    """What one rank computes of a convolution: it holds input rows ``[start, end)`` (of the input with the
    caller's padding), needs ``[lo, hi)``, and keeps outputs ``[first, first + count)`` of its local result."""

    start: int
    end: int
    lo: int
    hi: int
    first: int
    count: int


def conv_windows(units: list[int], m: int, conv: ConvRows) -> tuple[list[Window], int]:
    """Every rank's :class:`Window` of ``conv`` when rank ``r`` holds ``units[r] * m`` rows, and the output's
    rows per latent row. Outputs are split in proportion to ``units`` (so the next layer sees the same layout);
    ValueError when the output height is not a whole multiple of the latent rows."""
    total = sum(units)
    height = total * m + conv.pre_top + conv.pre_bottom
    outputs = (height + conv.pad_top + conv.pad_bottom - conv.kernel) // conv.stride + 1
    if outputs % total:
        raise ValueError(f"a convolution (kernel {conv.kernel}, stride {conv.stride}) turns {total * m} rows into "
                         f"{outputs}, which is not a multiple of the {total} latent rows")
    m_out = outputs // total
    starts = offsets(units)
    extra = (-conv.pad_top) % conv.stride  # rows above the window so that the output grid lines up
    windows = []
    for r, (start, size) in enumerate(zip(starts, units)):
        first_row = start * m + (conv.pre_top if r else 0)
        last_row = (start + size) * m + conv.pre_top + (conv.pre_bottom if r == len(units) - 1 else 0)
        g0, g1 = start * m_out, (start + size) * m_out
        lo = max(0, g0 * conv.stride - conv.pad_top - extra)
        hi = min(height, (g1 - 1) * conv.stride - conv.pad_top + conv.kernel)
        windows.append(Window(first_row, last_row, lo, hi, (g0 * conv.stride - lo) // conv.stride, g1 - g0))
    return windows, m_out


# -- the state of one parallel VAE ---------------------------------------------------------------------------
class VaeParallel:
    """One VAE's group, this rank's place in it, and the split of the call in progress (None between calls)."""

    def __init__(self, group, strict: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.strict = strict
        #: latent rows of each rank during a split call; None between calls
        self.units: list[int] | None = None
        #: how deep inside gathered modules the call is (their contents run on whole rows)
        self.whole_depth = 0
        self._reported: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether the layers now run on this rank's rows (a split call, outside gathered modules)."""
        return self.units is not None and not self.whole_depth

    def scale(self, rows: int, units: list[int] | None = None) -> int:
        """Rows per latent row of a local tensor with ``rows`` own rows (under the split ``units``, default the
        call's)."""
        unit = (units or self.units)[self.rank]
        m, rest = divmod(rows, unit)
        if rest or not m:
            raise RuntimeError(f"ditmesh parallel VAE: {rows} rows on rank {self.rank} are not a whole multiple of its "
                               f"{unit} latent rows; this layer does not keep the row layout")
        return m

    def sizes(self, m: int) -> list[int]:
        """Every rank's rows at ``m`` rows per latent row."""
        return [u * m for u in self.units]

    def whole(self, reason: str) -> None:
        """A call that runs whole on every rank: an error under ``on``, a log line (once per reason) otherwise."""
        if self.strict:
            raise ConfigError(f"the parallel VAE cannot split this call: {reason}; use vae_parallel auto (runs it whole "
                              "on every rank) or off")
        if reason not in self._reported:
            self._reported.add(reason)
            log.info("ditmesh: the VAE runs whole on every rank: %s", reason)


# -- hooks -----------------------------------------------------------------------------------------------------
def _row_tensors(x: torch.Tensor, args: tuple, kwargs: dict) -> tuple[list, list]:
    """Positions (int for args, str for kwargs) of the call's tensors that carry ``x``'s rows: ``x`` itself and any
    tensor of the same rank and height (a temporal cache)."""
    def carries(t):
        return isinstance(t, torch.Tensor) and t.ndim == x.ndim and t.shape[-2] == x.shape[-2]

    return ([i for i, a in enumerate(args) if carries(a)], [k for k, v in kwargs.items() if carries(v)])


class SplitHook(Hook):
    """Around the VAE's decode (or encode) method: split the input's rows, run, gather the output's rows once."""

    name = "vae"

    def __init__(self, state: VaeParallel, factor, what: str, input_name: str):
        self.state = state
        self.factor = factor  # (vae) -> input rows per latent row: 1 for decode, the spatial factor for encode
        self.what = what
        self.input_name = input_name  # the method's first parameter (``z``, ``x``), when it is passed by name

    def __call__(self, vae, call_next, args, kwargs):
        state = self.state
        if not args and self.input_name in kwargs:
            kwargs = dict(kwargs)
            args = (kwargs.pop(self.input_name),)
        if state.units is not None or not args:  # nested, or no input: leave it alone
            return call_next(args, kwargs)
        x = args[0]
        factor = self.factor(vae)
        reason = self.whole_reason(vae, x, factor)
        if reason:
            state.whole(reason)
            return call_next(args, kwargs)
        dim = x.ndim - 2
        units = split_sizes(x.shape[dim] // factor, state.world)
        local = x.narrow(dim, offsets(units)[state.rank] * factor, units[state.rank] * factor)
        state.units = units
        try:
            out = call_next((local, *args[1:]), kwargs)
        finally:
            state.units = None
        return self.gather(out, units)

    def whole_reason(self, vae, x: torch.Tensor, factor: int) -> str | None:
        """Why this call cannot be split (the same on every rank: global shapes and settings only), or None."""
        height = x.shape[-2]
        if getattr(vae, "use_tiling", False):
            return f"{self.what}: tiling is on (enable_tiling); tiles are not split"
        if height % factor:
            return f"{self.what}: height {height} is not a multiple of the VAE's {factor} rows per latent row"
        if height // factor < self.state.world:
            return (f"{self.what}: {height // factor} latent rows leave some of the {self.state.world} ranks without a "
                    "row")
        return None

    def gather(self, out, units: list[int]):
        """``out`` with its sample (a tensor, the first item of a tuple, or ``.sample``) all-gathered along height."""
        def whole(t):
            dim = t.ndim - 2
            m = self.state.scale(t.shape[dim], units)
            return all_gather_uneven(t, dim, [u * m for u in units], self.state.group)

        if isinstance(out, torch.Tensor):
            return whole(out)
        if isinstance(out, tuple):
            return (whole(out[0]), *out[1:])
        out.sample = whole(out.sample)
        return out


class ConvHook(Hook):
    """Around one convolution: exchange the halo rows, convolve the extended rows, keep this rank's outputs."""

    name = "vae"

    def __init__(self, state: VaeParallel, rows: ConvRows):
        self.state = state
        self.rows = rows
        self._windows: dict[tuple, tuple[list[Window], int]] = {}

    def __call__(self, conv, call_next, args, kwargs):
        state, rows = self.state, self.rows
        if not state.active:
            return call_next(args, kwargs)
        rank, last = state.rank, state.world - 1
        x = args[0]
        arg_pos, kw_names = _row_tensors(x, args, kwargs)
        args, kwargs = list(args), dict(kwargs)
        tensors = [args[i] for i in arg_pos] + [kwargs[k] for k in kw_names]
        # the caller's pad rows are the image's edges: keep them only on the edge ranks
        cut_top = rows.pre_top if rank else 0
        cut_bottom = rows.pre_bottom if rank != last else 0
        tensors = [t.narrow(-2, cut_top, t.shape[-2] - cut_top - cut_bottom) for t in tensors]
        own = tensors[0].shape[-2] - (0 if rank else rows.pre_top) - (rows.pre_bottom if rank == last else 0)
        key = (tuple(state.units), state.scale(own))
        if key not in self._windows:
            self._windows[key] = conv_windows(state.units, key[1], rows)
        windows, _ = self._windows[key]
        tensors = self.extend(tensors, windows)
        for i, t in zip(arg_pos + kw_names, tensors):
            if isinstance(i, int):
                args[i] = t
            else:
                kwargs[i] = t
        out = call_next(tuple(args), kwargs)
        mine = windows[rank]
        return out.narrow(-2, mine.first, mine.count)

    def extend(self, tensors: list[torch.Tensor], windows: list[Window]) -> list[torch.Tensor]:
        """``tensors`` (this rank's rows) cut or extended to the rows ``[lo, hi)`` its window needs, the missing
        rows received from the ranks that hold them (one exchange for all tensors)."""
        rank, mine = self.state.rank, windows[self.state.rank]

        def overlap(holder: Window, needer: Window):
            return max(holder.start, needer.lo), min(holder.end, needer.hi)

        def rows_of(t, a, b):  # global rows [a, b) of a tensor holding mine.start..mine.end
            return t.narrow(-2, a - mine.start, b - a)

        sends, recvs, pieces = {}, {}, {}
        for q, other in enumerate(windows):
            if q == rank:
                continue
            a, b = overlap(mine, other)
            if b > a:
                sends[q] = torch.cat([rows_of(t, a, b).reshape(-1) for t in tensors])
            a, b = overlap(other, mine)
            if b > a:
                shapes = [(*t.shape[:-2], b - a, t.shape[-1]) for t in tensors]
                recvs[q] = tensors[0].new_empty(sum(torch.Size(s).numel() for s in shapes))
                pieces[q] = (a, shapes)
        exchange_rows(sends, recvs, self.state.group)
        a, b = overlap(mine, mine)
        parts = [[] for _ in tensors]  # per tensor: (first row, rows) pieces
        for i, t in enumerate(tensors):
            if b > a:
                parts[i].append((a, rows_of(t, a, b)))
        for q, (start, shapes) in pieces.items():
            for i, chunk in enumerate(recvs[q].split([torch.Size(s).numel() for s in shapes])):
                parts[i].append((start, chunk.view(shapes[i])))
        return [torch.cat([p for _, p in sorted(ps, key=lambda item: item[0])], dim=-2) for ps in parts]


#: values per piece of the float32 work of a group norm's statistics on half-precision rows: a few groups at a time,
#: so their float32 temporaries stay this small whatever the activation's size (a 128-channel 4096 x 2048 half of a
#: FLUX decode would otherwise make several 4 GiB float32 copies); the normalization itself needs none
#: (:func:`group_normalize`)
GROUP_PIECE = 1 << 24


def group_pieces(v: torch.Tensor):
    """``(first, last)`` group ranges of ``v`` (``[N, G, ...]``) whose values number about :data:`GROUP_PIECE`."""
    per_group = v[:, :1].numel()
    step = max(1, GROUP_PIECE // max(1, per_group))
    return [(g, min(g + step, v.shape[1])) for g in range(0, v.shape[1], step)]


def group_stats(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[3, N, groups]`` float64: per sample and group, the count, mean and centred sum of squares (M2) of ``x``'s
    values (computed in float32 for half-precision inputs, a few groups at a time: :func:`group_pieces`)."""
    v = x.reshape(x.shape[0], groups, -1)
    count = torch.full((x.shape[0], groups), float(v.shape[-1]), dtype=torch.float64, device=x.device)
    mean = torch.empty_like(count)
    m2 = torch.empty_like(count)
    for a, b in group_pieces(v):
        piece = v[:, a:b]
        compute = piece if piece.dtype in (torch.float32, torch.float64) else piece.float()
        mean[:, a:b] = compute.sum(-1, dtype=torch.float64) / count[:, a:b]
        m2[:, a:b] = (compute - mean[:, a:b].to(compute.dtype)[..., None]).square().sum(-1, dtype=torch.float64)
    return torch.stack([count, mean, m2])


def combine_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of the union of parts, from their :func:`group_stats` stacked ``[P, 3, N, G]``:
    Chan's combination, which adds the spread of the parts' means ``sum n_p (mean_p - mean)^2`` to their M2s."""
    counts, means, m2s = stats.unbind(1)
    total = counts.sum(0)
    mean_all = (counts * means).sum(0) / total
    var = (m2s.sum(0) + (counts * (means - mean_all).square()).sum(0)) / total
    return mean_all, var


def group_normalize(x: torch.Tensor, norm: nn.GroupNorm, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``norm`` applied to ``x`` (any rows of the tensor the statistics describe) with the given per (sample, group)
    ``mean`` and ``var``: one inference-mode batch norm over ``x`` viewed as ``[1, samples x groups, values]``, whose
    kernel works in float32 for half-precision inputs and writes ``x``'s dtype (no float32 copy of ``x``), then the
    affine part in that dtype."""
    rows = x.shape[0] * norm.num_groups
    stats = torch.float32 if x.dtype != torch.float64 else torch.float64
    out = F.batch_norm(x.reshape(1, rows, -1), mean.reshape(rows).to(stats), var.reshape(rows).to(stats),
                       training=False, eps=norm.eps).view(x.shape)
    if norm.affine:
        shape = (1, -1) + (1,) * (x.ndim - 2)
        out.mul_(norm.weight.view(shape)).add_(norm.bias.view(shape))
    return out


class GroupNormHook(Hook):
    """Around one ``nn.GroupNorm``: statistics over every rank's rows, exact (Chan's parallel variance)."""

    name = "vae"

    def __init__(self, state: VaeParallel):
        self.state = state

    def __call__(self, norm, call_next, args, kwargs):
        if not self.state.active:
            return call_next(args, kwargs)
        x = args[0]
        mean, var = self.statistics(x, norm.num_groups)
        return group_normalize(x, norm, mean, var)

    def statistics(self, x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance per (sample, group) over every rank's rows of ``x`` (one all-gather)."""
        own = group_stats(x, groups)
        stats = all_gather_uneven(own, 0, [3] * self.state.world, self.state.group)
        return combine_stats(stats.view(self.state.world, *own.shape))


class GatherHook(Hook):
    """Around a module that mixes all rows (the mid-block attention): run it on the gathered rows, keep ours."""

    name = "vae"

    def __init__(self, state: VaeParallel):
        self.state = state

    def __call__(self, module, call_next, args, kwargs):
        state = self.state
        if not state.active:
            return call_next(args, kwargs)
        x = args[0]
        dim = x.ndim - 2
        m = state.scale(x.shape[dim])
        full = all_gather_uneven(x, dim, state.sizes(m), state.group)
        state.whole_depth += 1
        try:
            out = call_next((full, *args[1:]), kwargs)
        finally:
            state.whole_depth -= 1
        return out.narrow(dim, offsets(state.units)[state.rank] * m, state.units[state.rank] * m)


#: widest head SDPA's fused kernels take (flash, cuDNN); a wider one (the KL VAE's single 512-wide head) falls back to
#: the memory-efficient kernel, which on an H100 runs at a quarter of the speed of :func:`attend`'s matrix products
FUSED_HEAD_DIM = 256
#: query rows of one piece in :func:`attend`: scores of at most this many values (times the key count) at a time
ATTEND_PIECE = 1 << 28


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Softmax attention ``[B, H, N, D]``: SDPA, or for heads wider than :data:`FUSED_HEAD_DIM` two matrix products with a float32 softmax between them, a piece of query rows at a time (the scores of one piece
    stay under :data:`ATTEND_PIECE` values)."""
    if query.shape[-1] <= FUSED_HEAD_DIM:
        return F.scaled_dot_product_attention(query, key, value)
    out = torch.empty_like(query)
    rows = max(1, ATTEND_PIECE // max(1, key.shape[-2] * query.shape[0] * query.shape[1]))
    scale = query.shape[-1] ** -0.5
    for a in range(0, query.shape[-2], rows):
        scores = torch.matmul(query[..., a:a + rows, :], key.transpose(-1, -2)).mul_(scale)
        out[..., a:a + rows, :] = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)
    return out


class RowsAttentionHook(GatherHook):
    """Around diffusers' ``Attention`` over one frame's rows (the KL VAE's mid-block): this rank's rows are the
    queries, every rank's rows the keys and values.

    The input's group norm runs on the own rows with statistics over every rank's rows (its ``GroupNormHook``), the
    normalized rows are all-gathered once (the keys' and values' input), and the attention, output projection,
    residual and rescale run on the own rows only: a ``1 / world`` share of the attention's work on each rank,
    where running the module on the gathered rows would repeat all of it on every rank (at 4096² the mid-block
    attention over 262,144 positions is most of a FLUX decode). Calls it does not cover (a mask, a cross-attention
    input, a processor other than diffusers' plain one, a spatial norm) run as :class:`GatherHook` runs them.
    """

    def __call__(self, attn, call_next, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        plain = (len(args) <= 1 and not any(v is not None for k, v in kwargs.items() if k != "hidden_states")
                 and x is not None and x.ndim == 4)
        if not (self.state.active and plain):
            return super().__call__(attn, call_next, args, kwargs)
        state = self.state
        batch, channels, rows, width = x.shape
        m = state.scale(rows)
        own = attn.group_norm(x.reshape(batch, channels, rows * width))  # [B, C, own positions]
        every = all_gather_uneven(own, 2, [r * width for r in state.sizes(m)], state.group)
        query = attn.to_q(own.transpose(1, 2))
        key, value = attn.to_k(every.transpose(1, 2)), attn.to_v(every.transpose(1, 2))
        heads = lambda t: t.unflatten(-1, (attn.heads, -1)).transpose(1, 2)  # noqa: E731
        out = attend(heads(query), heads(key), heads(value))
        out = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2).to(query.dtype)))
        out = out.transpose(1, 2).reshape(batch, channels, rows, width)
        if attn.residual_connection:
            out = out + x
        return out / attn.rescale_output_factor

    @staticmethod
    def covers(module: nn.Module) -> bool:
        """Whether ``module`` is a diffusers ``Attention`` this hook computes (group norm in front, diffusers' plain
        processor, no spatial or cross norm, no query/key norms)."""
        from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

        return (isinstance(module, Attention) and type(module.processor) in (AttnProcessor, AttnProcessor2_0)
                and isinstance(module.group_norm, nn.GroupNorm) and module.spatial_norm is None
                and not module.norm_cross and module.norm_q is None and module.norm_k is None)


# -- rank-parallel tiled decode ----------------------------------------------------------------------------------
class TiledDecode:
    """The state of one tiled decode spread over ranks: the tile calls seen so far and this rank's decoded tiles.

    diffusers' ``tiled_decode`` calls the tile decoder once per tile (row-major), all tiles first, and blends them
    after. Tile ``k`` of ``n`` belongs to the rank whose contiguous block of ``split_sizes(n, world)`` holds it: that
    rank decodes it, the others get a placeholder of its shape. At the last tile call one all-gather fills every
    placeholder in place, so diffusers' own blending runs on the tiles one process would have decoded.
    """

    def __init__(self, group, factor: int, channels: int):
        self.group = group
        alone = group is None or not dist.is_initialized()  # one process: diffusers' tiling, nothing to gather
        self.rank, self.world = (0, 1) if alone else (dist.get_rank(group), dist.get_world_size(group))
        self.factor, self.channels = factor, channels
        #: per call in progress: the tile count expected, the tiles (decoded or placeholders), and this rank's range
        self.expected: int | None = None
        self.tiles: list[torch.Tensor] = []
        self.gathered = False

    def begin(self, vae, z: torch.Tensor) -> None:
        """A tiled decode of ``z`` starts: the count of its tiles, from the grid diffusers walks."""
        step = int(vae.tile_latent_min_size * (1 - vae.tile_overlap_factor))
        self.expected = len(range(0, z.shape[-2], step)) * len(range(0, z.shape[-1], step))
        self.tiles, self.gathered = [], False

    def mine(self) -> range:
        sizes = split_sizes(self.expected, self.world)
        return range(offsets(sizes)[self.rank], offsets(sizes)[self.rank] + sizes[self.rank])

    def tile(self, decoder, call_next, args, kwargs) -> torch.Tensor:
        """Tile call ``len(self.tiles)``: decoded here or a placeholder; the last one gathers every tile."""
        k = len(self.tiles)
        if k >= self.expected:
            raise RuntimeError(f"ditmesh tiled VAE: diffusers' tiled decode called its decoder more than the {self.expected} "
                               "tiles of its grid; vae_parallel='tiled' does not fit this diffusers version")
        if k in self.mine():
            out = call_next(args, kwargs)
        else:
            z = args[0]
            weight = next(decoder.parameters())
            out = weight.new_empty(z.shape[0], self.channels, z.shape[-2] * self.factor, z.shape[-1] * self.factor)
        self.tiles.append(out)
        if k == self.expected - 1:
            self.gather()
        return out

    def gather(self) -> None:
        """Fill every placeholder with the tile its owner decoded (one all-gather of all tiles, flattened; none on one
        process)."""
        self.gathered = True
        if self.world == 1:
            return
        numels = [t.numel() for t in self.tiles]
        sizes = split_sizes(self.expected, self.world)
        starts = offsets(sizes)
        per_rank = [sum(numels[a:a + n]) for a, n in zip(starts, sizes)]
        own = [self.tiles[k].reshape(-1) for k in self.mine()]
        local = torch.cat(own) if own else self.tiles[0].new_empty(0)
        flat = all_gather_uneven(local, 0, per_rank, self.group)
        for k, piece in enumerate(flat.split(numels)):
            if k not in self.mine():
                self.tiles[k].copy_(piece.view(self.tiles[k].shape))


class TiledDecodeHook(Hook):
    """Around the VAE's tiled decode method: start the grid's count, check that every tile was gathered."""

    name = "vae"

    def __init__(self, state: TiledDecode):
        self.state = state

    def __call__(self, vae, call_next, args, kwargs):
        z = args[0] if args else kwargs["z"]
        self.state.begin(vae, z)
        try:
            out = call_next(args, kwargs)
            if not self.state.gathered:
                raise RuntimeError(f"ditmesh tiled VAE: diffusers' tiled decode decoded {len(self.state.tiles)} tiles, "
                                   f"not the {self.state.expected} of its grid; vae_parallel='tiled' does not fit this "
                                   "diffusers version")
            return out
        finally:
            self.state.expected, self.state.tiles = None, []


class TileHook(Hook):
    """Around the tile decoder: inside a tiled decode, one tile call (:meth:`TiledDecode.tile`)."""

    name = "vae"

    def __init__(self, state: TiledDecode):
        self.state = state

    def __call__(self, decoder, call_next, args, kwargs):
        if self.state.expected is None:  # a whole decode: every rank runs it
            return call_next(args, kwargs)
        return self.state.tile(decoder, call_next, args, kwargs)


def apply_tiled(vae: nn.Module, plan, group) -> list:
    """Turn on ``vae``'s tiled decode (diffusers' ``enable_tiling``) with its tiles spread over ``group`` and
    blended as on one process (:class:`TiledDecode`); returns the undo callables (tiling set back as it was, hooks
    removed). :class:`ConfigError` for a VAE whose plan has no ``tile_decoder``."""
    if plan.tile_decoder is None or not callable(getattr(vae, plan.tiled_method, None)):
        raise ConfigError(f"vae_parallel='tiled': {type(vae).__name__}'s tiled decode cannot be spread over ranks; use "
                          "auto (split along height) or off")
    state = TiledDecode(group, plan.spatial_factor(vae), vae.config.out_channels)
    was_tiling = vae.use_tiling
    vae.enable_tiling()
    undo = [lambda: setattr(vae, "use_tiling", was_tiling)]
    undo.append(add_hook(vae, TiledDecodeHook(state), plan.tiled_method))
    undo.append(add_hook(vae.get_submodule(plan.tile_decoder), TileHook(state)))
    return undo


# -- finding the layers ----------------------------------------------------------------------------------------
def _height_padding(conv: nn.Module, plan) -> tuple[int, int]:
    custom = plan.conv_padding(conv) if plan.conv_padding is not None else None
    if custom is not None:
        return custom
    if isinstance(conv.padding, str):
        raise NotImplementedError(f"padding={conv.padding!r}")
    return conv.padding[-2], conv.padding[-2]


def _pre_padded(vae: nn.Module) -> dict[int, tuple[int, int]]:
    """Convolutions whose input their caller zero-pads first, by id: (top, bottom) rows. diffusers' ``Downsample2D``
    with ``padding=0`` pads (0, 1, 0, 1) inside its forward; a ``nn.ZeroPad2d`` in front of a convolution in an
    ``nn.Sequential`` pads ``(left, right, top, bottom)``. NotImplementedError for a zero pad anywhere else."""
    from diffusers.models.downsampling import Downsample2D

    found, pads_seen = {}, set()
    for module in vae.modules():
        if isinstance(module, Downsample2D) and module.use_conv and module.padding == 0:
            found[id(module.conv)] = (0, 1)
        if isinstance(module, nn.Sequential):
            children = list(module)
            for pad, conv in zip(children, children[1:]):
                if isinstance(pad, nn.ZeroPad2d) and isinstance(conv, (nn.Conv2d, nn.Conv3d)):
                    found[id(conv)] = (pad.padding[2], pad.padding[3])
                    pads_seen.add(id(pad))
    stray = [type(m).__name__ for m in vae.modules() if isinstance(m, nn.ZeroPad2d) and id(m) not in pads_seen]
    if stray:
        raise NotImplementedError(f"a zero pad that does not feed a convolution ({stray[0]})")
    return found


def layer_hooks(vae: nn.Module, plan, state: VaeParallel) -> list[tuple[nn.Module, Hook]]:
    """(module, hook) for every layer of ``vae`` that needs one; NotImplementedError naming a layer it cannot split."""
    gathered = [m for m in vae.modules() if type(m).__name__ in plan.gathered]
    rows_attention = [g for g in gathered if RowsAttentionHook.covers(g)]
    inside = {id(sub) for g in gathered for sub in g.modules()} - {id(g.group_norm) for g in rows_attention}
    pre = _pre_padded(vae)
    if plan.pre_padding is not None:  # modules that pad their convolution's input themselves (the family knows them)
        pre.update((id(conv), rows) for conv, rows in filter(None, map(plan.pre_padding, vae.modules())))
    hooks = [(g, RowsAttentionHook(state) if g in rows_attention else GatherHook(state)) for g in gathered]
    for name, module in vae.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            if module.padding_mode != "zeros":
                raise NotImplementedError(f"{name}: padding_mode={module.padding_mode!r}")
            top, bottom = _height_padding(module, plan)
            kernel = module.dilation[-2] * (module.kernel_size[-2] - 1) + 1
            rows = ConvRows(kernel, module.stride[-2], top, bottom, *pre.get(id(module), (0, 0)))
            if rows != ConvRows(1, 1, 0, 0):  # a 1-row, unpadded, unstrided convolution works on any rows
                hooks.append((module, ConvHook(state, rows)))
        elif isinstance(module, nn.GroupNorm):
            hooks.append((module, GroupNormHook(state)))
        elif isinstance(module, nn.modules.batchnorm._NormBase) and (module.training or module.running_mean is None):
            # batch and instance norms that take statistics of their input; in eval mode with running statistics
            # (FLUX.2's latent batch norm) a norm is a per-channel affine map, exact on any rows
            raise NotImplementedError(f"{name}: {type(module).__name__} (statistics across rows)")
    return hooks


def apply(vae: nn.Module, plan, group, strict: bool = False) -> list:
    """Split ``vae``'s decode and encode along height over ``group`` (see the module docstring); returns the undo
    callables (``remove`` gives back the VAE as it was: hooks only, no module or parameter is replaced).

    ``plan`` is the family's :class:`~ditmesh.models.base.VaePlan`. ``strict`` (``vae_parallel="on"``): a VAE with a
    layer that cannot be split, or a call that cannot be split, raises :class:`ConfigError`; otherwise the VAE (or
    the call) runs whole on every rank and a log line says why.
    """
    state = VaeParallel(group, strict)
    try:
        hooks = layer_hooks(vae, plan, state)
    except NotImplementedError as exc:
        reason = f"{type(vae).__name__} has a layer the parallel VAE cannot split ({exc})"
        if strict:
            raise ConfigError(f"{reason}; use vae_parallel auto or off") from exc
        log.info("ditmesh: the VAE runs whole on every rank: %s", reason)
        return []
    undo = []
    try:
        for module, hook in hooks:
            undo.append(add_hook(module, hook))
        entries = ((plan.decode_method, lambda v: 1, "decode"), (plan.encode_method, plan.spatial_factor, "encode"))
        for method, factor, what in entries:
            if callable(getattr(vae, method, None)):
                first = next(iter(inspect.signature(getattr(vae, method)).parameters))
                undo.append(add_hook(vae, SplitHook(state, factor, what, first), method))
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
    return undo
