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
- **Large layers in pieces**: a layer whose rows on the busiest rank would need more than ``piece_bytes``
  (:data:`PIECE_BYTES`) of temporaries runs on pieces of whole latent rows, each piece's own output rows written
  into one output: a diffusers ``ResnetBlock2D`` (:class:`ResnetPieces`: its norm statistics and halo rows first,
  then norm, activation and convolution a piece at a time), an ``Upsample2D`` (:class:`UpsamplePieces`: nearest x2
  and its convolution a piece at a time), a plain convolution (:class:`ConvHook`: no halo-extended copy of the
  input). The collectives stay those of the layer run whole, once each, before the pieces.

A call that cannot be split runs whole on every rank (``auto``) or raises (``on``), decided from global shapes,
so every rank takes the same path: tiling on, fewer latent rows than ranks, or an image height that is not a
multiple of the VAE's spatial factor.

Cross-rank rule: every rank calls the VAE with the same shapes; the split sizes, the halo sizes and the output
sizes are derived from the global height only, and each rank exchanges rows with exactly the ranks that need
them (usually its neighbours); whether a layer runs in pieces is decided from the busiest rank's rows, the same on
every rank (the number of pieces is each rank's own).
"""

from __future__ import annotations

import contextlib
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
#: bytes that the temporaries of one piece of a large layer may take (:meth:`VaeParallel.pieces`): a layer whose
#: rows on the busiest rank need more runs on pieces of whole latent rows, so that no temporary of the layer's size
#: (a halo-extended copy, a group norm's or an activation's output, an up-sampled input) exists whole
PIECE_BYTES = 1 << 29


class VaeParallel:
    """One VAE's group, this rank's place in it, and the split of the call in progress (None between calls).

    ``group`` None: one process that holds every row (``parallel.vae_chunk``'s whole calls run its pieces through
    the same code). ``piece_bytes``: :meth:`pieces`' budget; ``piece_rows``: rows per piece instead."""

    def __init__(self, group, strict: bool = False, piece_bytes: int = PIECE_BYTES, piece_rows: int | None = None):
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.strict = strict
        self.piece_bytes, self.piece_rows = piece_bytes, piece_rows
        #: latent rows of each rank during a split call; None between calls
        self.units: list[int] | None = None
        #: how deep inside gathered modules the call is (their contents run on whole rows)
        self.whole_depth = 0
        #: calls of a layer that ran in pieces (:meth:`pieces`)
        self.split_calls = 0
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

    def layout(self, rows: int) -> tuple[list[int], int]:
        """(latent rows of each rank, rows per latent row) of a tensor with ``rows`` own rows; a call that is not
        split holds every row, one row a unit."""
        if self.units is None:
            return [rows], 1
        return self.units, self.scale(rows)

    def sizes(self, m: int) -> list[int]:
        """Every rank's rows at ``m`` rows per latent row."""
        return [u * m for u in self.units]

    @contextlib.contextmanager
    def inside(self):
        """The layers' own hooks step aside (a module that runs on whole rows, or whose pieces the caller runs)."""
        self.whole_depth += 1
        try:
            yield
        finally:
            self.whole_depth -= 1

    def whole(self, reason: str) -> None:
        """A call that runs whole on every rank: an error under ``on``, a log line (once per reason) otherwise."""
        if self.strict:
            raise ConfigError(f"the parallel VAE cannot split this call: {reason}; use vae_parallel auto (runs it whole "
                              "on every rank) or off")
        if reason not in self._reported:
            self._reported.add(reason)
            log.info("ditmesh: the VAE runs whole on every rank: %s", reason)

    # -- the collectives (the planner's trace replaces them with tensors of the same shapes) --
    def all_gather(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``t`` joined along ``dim`` (rank ``r``'s has ``sizes[r]`` there): one all-gather."""
        return all_gather_uneven(t, dim, sizes, self.group)

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """One halo round: ``sends[q]`` to rank ``q``, ``recvs[q]`` filled from it (``comm.exchange_rows``)."""
        exchange_rows(sends, recvs, self.group)

    def statistics(self, x: torch.Tensor, groups: int, rows: list[tuple[int, int]] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance per (sample, group) over every rank's rows of ``x`` (one all-gather, none alone);
        ``rows``: ``(first, count)`` ranges of ``x``'s rows taken one at a time, so that the float32 work stays a
        piece's size."""
        own = group_stats(x, groups) if rows is None else merge_stats(
            torch.stack([group_stats(x.narrow(-2, a, n), groups) for a, n in rows]))
        if self.world == 1:
            return combine_stats(own[None])
        stats = self.all_gather(own, 0, [3] * self.world)
        return combine_stats(stats.view(self.world, *own.shape))

    def extend(self, tensors: list[torch.Tensor], windows: list[Window]) -> list[Band]:
        """``tensors`` (this rank's rows, global rows ``[start, end)`` of its window) as :class:`Band` s that also
        hold the rows ``[lo, hi)`` it needs from the ranks that hold them (one exchange for all tensors)."""
        rank, mine = self.rank, windows[self.rank]

        def overlap(holder: Window, needer: Window):
            return max(holder.start, needer.lo), min(holder.end, needer.hi)

        sends, recvs, pieces = {}, {}, {}
        for q, other in enumerate(windows):
            if q == rank:
                continue
            a, b = overlap(mine, other)
            if b > a:
                sends[q] = torch.cat([t.narrow(-2, a - mine.start, b - a).reshape(-1) for t in tensors])
            a, b = overlap(other, mine)
            if b > a:
                shapes = [(*t.shape[:-2], b - a, t.shape[-1]) for t in tensors]
                recvs[q] = tensors[0].new_empty(sum(torch.Size(s).numel() for s in shapes))
                pieces[q] = (a, shapes)
        self.exchange(sends, recvs)
        bands = [Band([(mine.start, t)]) for t in tensors]
        for q, (start, shapes) in pieces.items():
            for band, chunk, shape in zip(bands, recvs[q].split([torch.Size(s).numel() for s in shapes]), shapes):
                band.parts.append((start, chunk.view(shape)))
        return bands

    # -- pieces of large layers --
    def pieces(self, units: list[int], m: int, row_bytes: int) -> list[int] | None:
        """This rank's latent rows cut into pieces (whole latent rows each) so that one piece's temporaries, at
        ``row_bytes`` a row and ``m`` rows per latent row, take about ``piece_bytes`` (or hold ``piece_rows`` rows);
        None (the layer runs as it is) when the busiest rank's rows fit. Every rank takes the same path (pieces or
        not, even a rank with one piece), decided from the global split, so the collectives of a layer pair up."""
        own, busiest = units[self.rank] * m, max(units) * m
        per_piece = self.piece_rows or max(1, self.piece_bytes // max(1, row_bytes))
        if busiest <= per_piece:
            return None
        return split_sizes(units[self.rank], max(1, min(units[self.rank], -(-own // per_piece))))

    def piece_windows(self, conv: ConvRows, units: list[int], m: int, pieces: list[int]) -> list[Window]:
        """The :class:`Window` of each of this rank's ``pieces`` of ``conv`` (the other ranks' rows unchanged)."""
        split = units[:self.rank] + pieces + units[self.rank + 1:]
        return conv_windows(split, m, conv)[0][self.rank:self.rank + len(pieces)]


class Band:
    """Global rows of a tensor held in parts ``(first row, tensor)``: this rank's own rows and rows received from
    the ranks around it; where parts overlap, the one listed first holds the rows (a saved copy of rows that are
    being overwritten)."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]]):
        self.parts = parts

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Global rows ``[a, b)``: a view when one part holds them, else the parts' rows joined."""
        chunks, cursor = [], a
        while cursor < b:
            for i, (start, t) in enumerate(self.parts):
                if start <= cursor < start + t.shape[-2]:
                    break
            else:
                raise RuntimeError(f"ditmesh parallel VAE: row {cursor} is in no part of this band")
            end = min([b, start + t.shape[-2]] + [s for s, _ in self.parts[:i] if s > cursor])
            chunks.append(t.narrow(-2, cursor - start, end - cursor))
            cursor = end
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, -2)


def piecewise(band: Band, windows: list[Window], run, scale: int = 1, over: torch.Tensor | None = None) -> torch.Tensor:
    """``run(rows [lo, hi) of band)`` for each piece's :class:`Window`; each piece's own outputs (``first``,
    ``count``, times ``scale`` output rows per input row) written one after the other into one output. ``over``
    (the band's first part, with the output's shape; ``scale`` 1): the output is written over it, top to bottom,
    and the rows a later piece still reads are copied before they are overwritten (a halo's few rows)."""
    out, done, base = over, 0, list(band.parts)
    own_start = band.parts[0][0]
    for p, w in enumerate(windows):
        piece = run(band.rows(w.lo, w.hi)).narrow(-2, w.first * scale, w.count * scale)
        if out is None:
            out = piece.new_empty(*piece.shape[:-2], sum(v.count for v in windows) * scale, piece.shape[-1])
        if over is not None and p + 1 < len(windows):
            a, b = windows[p + 1].lo, own_start + done + w.count
            band.parts = base if b <= a else [(a, band.rows(a, b).clone())] + base
        out.narrow(-2, done * scale, w.count * scale).copy_(piece)
        done += w.count
    return out


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
            return self.state.all_gather(t, dim, [u * m for u in units])

        if isinstance(out, torch.Tensor):
            return whole(out)
        if isinstance(out, tuple):
            return (whole(out[0]), *out[1:])
        out.sample = whole(out.sample)
        return out


class ConvHook(Hook):
    """Around one convolution: exchange the halo rows, convolve the extended rows, keep this rank's outputs; a
    plain ``nn.Conv2d`` / ``nn.Conv3d`` whose rows exceed :meth:`VaeParallel.pieces`' budget convolves a piece of
    output rows at a time into one output (no halo-extended copy of its input)."""

    name = "vae"

    def __init__(self, state: VaeParallel, rows: ConvRows, plain: bool = False):
        self.state = state
        self.rows = rows
        self.plain = plain  # torch's own module: its forward is the convolution alone, so it runs on any rows
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
        m = state.scale(own)
        key = (tuple(state.units), m)
        if key not in self._windows:
            self._windows[key] = conv_windows(state.units, m, rows)
        windows, _ = self._windows[key]
        bands = state.extend(tensors, windows)
        mine = windows[rank]
        pieces = None
        if self.plain:  # a piece's input rows (joined at the edges) and its output rows, per input row
            row_bytes = tensors[0][..., :1, :].numel() * x.element_size() * (1 + conv.out_channels / conv.in_channels)
            pieces = state.pieces(state.units, m, int(row_bytes))

        def run(extended):
            for i, t in zip(arg_pos + kw_names, extended):
                if isinstance(i, int):
                    args[i] = t
                else:
                    kwargs[i] = t
            return call_next(tuple(args), kwargs)

        if pieces is None:
            return run([band.rows(mine.lo, mine.hi) for band in bands]).narrow(-2, mine.first, mine.count)
        state.split_calls += 1
        windows = state.piece_windows(rows, state.units, m, pieces)
        return piecewise(bands[0], windows, lambda extended: run([extended]))  # plain: the input is its one tensor


#: values per piece of the float32 work of a group norm's statistics: a few groups, or part of one group, at a time, so
#: their float32 temporaries stay this small whatever the activation's size (a 128-channel 4096 x 2048 half of a FLUX
#: decode would otherwise make several 4 GiB float32 copies); the normalization itself needs none
#: (:func:`group_normalize`)
GROUP_PIECE = 1 << 24


def group_stats(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[3, N, groups]`` float64: per sample and group, the count, mean and centred sum of squares (M2) of ``x``'s
    values (computed in float32 for half-precision inputs, at most about :data:`GROUP_PIECE` values at a time: a few
    groups, or a part of one group, the parts merged with :func:`merge_stats`)."""
    v = x.reshape(x.shape[0], groups, -1)
    per_group = v.shape[-1]
    group_step, value_step = max(1, GROUP_PIECE // max(1, per_group)), min(per_group, GROUP_PIECE)
    out = torch.empty(3, x.shape[0], groups, dtype=torch.float64, device=x.device)
    for a in range(0, groups, group_step):
        parts = []
        for c in range(0, per_group, value_step):
            piece = v[:, a:a + group_step, c:c + value_step]
            compute = piece if piece.dtype in (torch.float32, torch.float64) else piece.float()
            count = torch.full(piece.shape[:2], float(piece.shape[-1]), dtype=torch.float64, device=x.device)
            mean = compute.sum(-1, dtype=torch.float64) / count
            m2 = (compute - mean.to(compute.dtype)[..., None]).square().sum(-1, dtype=torch.float64)
            parts.append(torch.stack([count, mean, m2]))
        out[:, :, a:a + group_step] = parts[0] if len(parts) == 1 else merge_stats(torch.stack(parts))
    return out


def merge_stats(stats: torch.Tensor) -> torch.Tensor:
    """The :func:`group_stats` ``[3, N, G]`` of the union of parts, from theirs stacked ``[P, 3, N, G]``: Chan's
    combination, which adds the spread of the parts' means ``sum n_p (mean_p - mean)^2`` to their M2s."""
    counts, means, m2s = stats.unbind(1)
    total = counts.sum(0)
    mean_all = (counts * means).sum(0) / total
    return torch.stack([total, mean_all, m2s.sum(0) + (counts * (means - mean_all).square()).sum(0)])


def combine_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of the union of parts, from their :func:`group_stats` stacked ``[P, 3, N, G]``."""
    count, mean, m2 = merge_stats(stats)
    return mean, m2 / count


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
        mean, var = self.state.statistics(x, norm.num_groups)
        return group_normalize(x, norm, mean, var)


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
        full = state.all_gather(x, dim, state.sizes(m))
        with state.inside():
            out = call_next((full, *args[1:]), kwargs)
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
        every = state.all_gather(own, 2, [r * width for r in state.sizes(m)])
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


# -- large layers in pieces of rows ------------------------------------------------------------------------------
def conv_rows(conv: nn.Conv2d) -> ConvRows:
    """The :class:`ConvRows` of a 2-D convolution with numeric padding."""
    kernel = conv.dilation[-2] * (conv.kernel_size[-2] - 1) + 1
    return ConvRows(kernel, conv.stride[-2], conv.padding[-2], conv.padding[-2])


def same_rows(conv: nn.Module) -> bool:
    """Whether ``conv`` is a zero-padded, unstrided 2-D convolution that keeps the number of rows."""
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return False
    rows = conv_rows(conv)
    return rows.stride == 1 and rows.pad_top + rows.pad_bottom == rows.kernel - 1


class PiecesHook(Hook):
    """Around a layer that runs on pieces of whole latent rows when its rows exceed the budget
    (:meth:`VaeParallel.pieces`): the call's input (first argument, or ``input_name``), and a second argument
    (``extra_name``) that must be None for the pieces to apply. Subclasses say the bytes of one input row's
    temporaries (:meth:`row_bytes`) and run the pieces (:meth:`run`), with the layer's own hooks stepped aside
    (:meth:`VaeParallel.inside`): the run exchanges the halo rows and gathers the norms' statistics itself, once
    each where the layer's hooks would (the same collectives, in the same order)."""

    name = "vae"
    input_name = extra_name = ""

    def __init__(self, state: VaeParallel, name: str = "vae"):
        self.state = state
        self.name = name

    def __call__(self, module, call_next, args, kwargs):
        state = self.state
        x = args[0] if args else kwargs.get(self.input_name)
        extra = args[1] if len(args) > 1 else kwargs.get(self.extra_name)
        if extra is not None or not state.active or not isinstance(x, torch.Tensor) or x.ndim != 4:
            return call_next(args, kwargs)
        units, m = state.layout(x.shape[-2])
        pieces = state.pieces(units, m, self.row_bytes(module, x))
        if pieces is None:
            return call_next(args, kwargs)
        state.split_calls += 1
        with state.inside():
            return self.run(module, call_next, x, units, m, pieces)

    def row_bytes(self, module, x: torch.Tensor) -> int:
        raise NotImplementedError

    def run(self, module, call_next, x: torch.Tensor, units: list[int], m: int, pieces: list[int]) -> torch.Tensor:
        raise NotImplementedError


class ResnetPieces(PiecesHook):
    """Around a ``ResnetBlock2D`` called without a time embedding: ``h = conv1(act(norm1(x)))``,
    ``out = conv2(act(norm2(h)))``, ``out = (shortcut(x) + out) / scale``, each norm-activation-convolution on pieces
    of rows (the norm's statistics over every row first, the piece extended by the convolution's halo rows), the
    second one written over ``h``. Alive at once: the input, ``h`` and one piece's temporaries, instead of the
    input and two full-size temporaries (the norm's and the activation's outputs) besides a halo-extended copy."""

    input_name, extra_name = "input_tensor", "temb"

    def row_bytes(self, block, x):
        # the norm's and the activation's output, and the convolution's, at the wider channel count
        return 3 * x.shape[0] * max(x.shape[1], block.conv1.out_channels) * x.shape[-1] * x.element_size()

    def run(self, block, call_next, x, units, m, pieces):
        h = self.norm_act_conv(x, block.norm1, block.nonlinearity, block.conv1, units, m, pieces)
        # conv2 keeps the channels: its output takes h's place, so x, h and one piece are all that is alive
        out = self.norm_act_conv(h, block.norm2, lambda t: block.dropout(block.nonlinearity(t)), block.conv2, units, m,
                                 pieces, over=True)
        for start, size in zip(offsets(pieces), pieces):  # the shortcut, piece by piece, into the output
            own = x.narrow(-2, start * m, size * m)
            shortcut = own if block.conv_shortcut is None else block.conv_shortcut(own)
            rows = out.narrow(-2, start * m, size * m)
            rows.copy_((shortcut + rows) / block.output_scale_factor)
        return out

    def norm_act_conv(self, x, norm, act, conv, units, m, pieces, over: bool = False) -> torch.Tensor:
        """``conv(act(norm(x)))`` on ``pieces``, the norm's statistics over every rank's rows (one all-gather) and the
        halo rows of ``x`` from the other ranks (one exchange) first; ``over``: written over ``x``."""
        state, rows = self.state, conv_rows(conv)
        mean, var = state.statistics(x, norm.num_groups, [(a * m, n * m) for a, n in zip(offsets(pieces), pieces)])
        band = state.extend([x], conv_windows(units, m, rows)[0])[0]
        return piecewise(band, state.piece_windows(rows, units, m, pieces),
                         lambda t: conv(act(group_normalize(t, norm, mean, var))), over=x if over else None)

    @staticmethod
    def covers(block: nn.Module) -> bool:
        """Whether a ``ResnetBlock2D`` has the shape :meth:`run` computes: group norms, no up/down sampling, a
        row-local (1x1) or absent shortcut, convolutions that keep the rows, and (without a time embedding, which
        the hook leaves to the block) the plain norm after ``conv1``: not ``scale_shift``."""
        from diffusers.models.resnet import ResnetBlock2D

        shortcut = getattr(block, "conv_shortcut", None)
        return (isinstance(block, ResnetBlock2D) and isinstance(block.norm1, nn.GroupNorm)
                and isinstance(block.norm2, nn.GroupNorm) and block.upsample is None and block.downsample is None
                and block.time_embedding_norm != "scale_shift" and same_rows(block.conv1) and same_rows(block.conv2)
                and (shortcut is None or (isinstance(shortcut, nn.Conv2d) and shortcut.kernel_size == (1, 1)
                                          and shortcut.stride == (1, 1))))


class UpsamplePieces(PiecesHook):
    """Around an ``Upsample2D`` (nearest x2, then a 3x3 convolution) called without ``output_size``: its forward on
    pieces of input rows with one halo row each side (exchanged with the other ranks once, before the pieces); the
    up-sampled tensor exists one piece at a time."""

    input_name, extra_name = "hidden_states", "output_size"

    def row_bytes(self, up, x):
        # two upsampled rows, and the convolution's two output rows
        return 2 * x.shape[0] * (x.shape[1] + up.conv.out_channels) * 2 * x.shape[-1] * x.element_size()

    def run(self, up, call_next, x, units, m, pieces):
        # in input rows, nearest x2 then a 3-row window is a 3-row window with 2 output rows per input row
        state, rows = self.state, ConvRows(3, 1, 1, 1)
        band = state.extend([x], conv_windows(units, m, rows)[0])[0]
        return piecewise(band, state.piece_windows(rows, units, m, pieces), lambda t: call_next((t,), {}), scale=2)

    @staticmethod
    def covers(up: nn.Module) -> bool:
        """Whether ``up`` is an ``Upsample2D`` of nearest x2 then a 3x3, padding-1 convolution, with no norm."""
        from diffusers.models.upsampling import Upsample2D

        conv = getattr(up, "conv", None)
        return (isinstance(up, Upsample2D) and up.interpolate and up.use_conv and not up.use_conv_transpose
                and up.norm is None and getattr(up, "name", "conv") == "conv" and same_rows(conv)
                and conv_rows(conv).kernel == 3)


def pieces_hooks(vae: nn.Module, state: VaeParallel, name: str = "vae") -> list[tuple[nn.Module, Hook]]:
    """(module, hook) for every residual block and up-sampler of ``vae`` that runs in pieces (:class:`PiecesHook`)."""
    kinds = (ResnetPieces, UpsamplePieces)
    return [(m, kind(state, name)) for m in vae.modules() for kind in kinds if kind.covers(m)]


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
                hooks.append((module, ConvHook(state, rows, plain=type(module) in (nn.Conv2d, nn.Conv3d))))
        elif isinstance(module, nn.GroupNorm):
            hooks.append((module, GroupNormHook(state)))
        elif isinstance(module, nn.modules.batchnorm._NormBase) and (module.training or module.running_mean is None):
            # batch and instance norms that take statistics of their input; in eval mode with running statistics
            # (FLUX.2's latent batch norm) a norm is a per-channel affine map, exact on any rows
            raise NotImplementedError(f"{name}: {type(module).__name__} (statistics across rows)")
    return hooks + [(m, hook) for m, hook in pieces_hooks(vae, state) if id(m) not in inside]


def apply(vae: nn.Module, plan, group, strict: bool = False, piece_bytes: int = PIECE_BYTES) -> list:
    """Split ``vae``'s decode and encode along height over ``group`` (see the module docstring); returns the undo
    callables (``remove`` gives back the VAE as it was: hooks only, no module or parameter is replaced).

    ``plan`` is the family's :class:`~ditmesh.models.base.VaePlan`. ``strict`` (``vae_parallel="on"``): a VAE with a
    layer that cannot be split, or a call that cannot be split, raises :class:`ConfigError`; otherwise the VAE (or
    the call) runs whole on every rank and a log line says why. ``piece_bytes``: the temporaries of one piece of a
    large layer (:data:`PIECE_BYTES`).
    """
    return install(vae, plan, VaeParallel(group, strict, piece_bytes))


def install(vae: nn.Module, plan, state: VaeParallel) -> list:
    """:func:`apply` with a given :class:`VaeParallel` (the planner traces one rank's share with collectives that
    only make tensors of the right shapes)."""
    strict = state.strict
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
