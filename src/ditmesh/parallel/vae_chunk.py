"""Chunked VAE decode on one process, exact: the widest layers run on pieces of rows with halo rows.

A KL decoder's peak is at the top resolution: the last up-sampler's nearest-upsampled input and its convolution's
output, then the first residual block there, which holds its input, the group norm's output and the activation's
output at once (3 tensors of 256 channels at the image's full size for FLUX's VAE), besides the convolution's own
output. ``apply(vae, rows)`` puts a ``vae_chunk`` hook on

- every ``ResnetBlock2D`` (no time embedding, no up/down sampling inside, group norms): it runs as
  ``h = conv1(act(norm1(x)))``, ``out = conv2(act(norm2(h)))``, ``out = (shortcut(x) + out) / scale`` where each
  norm-activation-convolution runs on pieces of at most ``rows`` rows, the norm's statistics computed first over all
  rows (per piece, combined exactly with Chan's formula: ``parallel.vae.combine_stats``) and each piece extended by
  the convolution's halo rows (``parallel.vae.conv_windows`` with one row per unit); the second one writes over
  ``h``, keeping a copy of the halo rows the next piece reads. Alive at once: the input, ``h`` and one piece's
  temporaries, instead of the input and two full-size temporaries;
- every ``Upsample2D`` that upsamples by nearest interpolation and then convolves (3x3, padding 1): the module runs on
  pieces of its input rows with one halo row each side, and keeps the rows of its output that the piece owns: the
  upsampled tensor never exists whole.

Each piece's result is written into one preallocated output, so no concatenation doubles it. The numbers are those
of the whole decode up to float rounding (the norms' statistics are combined in float64; the normalisation runs in
float32 for half-precision inputs, as the parallel VAE's group norm does).

``rows="auto"`` (CUDA) sizes the pieces per layer so that one piece's temporaries (3 tensors of the layer's widest
channel count) take at most ``parallel.chunk.AUTO_SHARE`` of the memory free when the hooks are installed.

Only calls that run whole use the pieces: in a call split over ranks (``parallel.vae``) the hooks step aside (each
rank already holds its own rows only). Wan's causal 3-D VAE (frame by frame, RMS norms) is not covered.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import offsets, split_sizes
from ..config import ConfigError
from ..hooks import Hook, add_hook
from .chunk import budget_of
from .vae import ConvRows, combine_stats, conv_windows, group_normalize, group_stats


class Pieces:
    """How a chunked layer splits its input rows: at most ``rows`` rows a piece, or (``rows`` None) as many as keep
    one piece's temporaries within ``budget`` bytes. ``split_calls`` counts the calls that ran in more than one
    piece; ``split_call()`` says whether the call in progress is split over ranks (the hooks then step aside)."""

    def __init__(self, rows: int | None = None, budget: int | None = None, split_call=None):
        self.rows, self.budget = rows, budget
        self.split_call = split_call or (lambda: False)
        self.split_calls = 0

    def sizes(self, x: torch.Tensor, row_elements: int) -> list[int]:
        """Rows of each piece of ``x``'s rows (dim -2), when one input row's temporaries hold ``row_elements``
        elements of ``x``'s dtype."""
        height = x.shape[-2]
        per_piece = self.rows or max(1, self.budget // (row_elements * x.element_size()))
        return split_sizes(height, -(-height // per_piece))


def _conv_rows(conv: nn.Conv2d) -> ConvRows:
    kernel = conv.dilation[-2] * (conv.kernel_size[-2] - 1) + 1
    return ConvRows(kernel, conv.stride[-2], conv.padding[-2], conv.padding[-2])


def _same_rows(conv: nn.Module) -> bool:
    """Whether ``conv`` is a zero-padded, unstrided 2-D convolution that keeps the number of rows."""
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return False
    rows = _conv_rows(conv)
    return rows.stride == 1 and rows.pad_top + rows.pad_bottom == rows.kernel - 1


def piecewise(x: torch.Tensor, out_rows: int, out_channels: int, sizes: list[int], conv: ConvRows, scale: int, run,
              in_place: bool = False):
    """``run(x[lo:hi])`` for each piece of ``sizes`` rows extended by the halo of ``conv`` (a row window over ``x``'s
    rows; ``scale`` output rows per input row), each piece's own output rows written into one output
    ``[N, out_channels, out_rows, W * scale]``. ``in_place`` (same shape in and out, ``scale`` 1): the output is
    ``x`` itself, top to bottom, and the input rows a later piece still reads are copied before they are
    overwritten (its upper halo: at most a few rows)."""
    windows, _ = conv_windows(sizes, 1, conv)
    in_place = in_place and conv.pad_top <= min(sizes)  # a halo within the previous piece: one copy suffices
    out = x if in_place else None
    kept = None  # (first row, copy) of input rows already overwritten that the next piece reads
    for p, (window, start, size) in enumerate(zip(windows, offsets(sizes), sizes)):
        source = x.narrow(-2, window.lo, window.hi - window.lo)
        if kept is not None:
            first, rows = kept
            source = torch.cat([rows, x.narrow(-2, first + rows.shape[-2], window.hi - first - rows.shape[-2])], -2)
        piece = run(source).narrow(-2, window.first * scale, size * scale)
        if out is None:
            out = piece.new_empty(*piece.shape[:-3], out_channels, out_rows, piece.shape[-1])
        if in_place and p + 1 < len(sizes):
            following = windows[p + 1].lo
            kept = None
            if following < start + size:
                kept = (following, x.narrow(-2, following, start + size - following).clone())
        out.narrow(-2, start * scale, size * scale).copy_(piece)
    return out


def _norm_act_conv(x: torch.Tensor, norm: nn.GroupNorm, act, conv: nn.Conv2d, sizes: list[int],
                   in_place: bool = False) -> torch.Tensor:
    """``conv(act(norm(x)))`` on pieces of ``sizes`` rows, the norm's statistics over all rows first; ``in_place``:
    written over ``x`` (which must then have the output's channels)."""
    mean, var = combine_stats(torch.stack([group_stats(x.narrow(-2, a, n), norm.num_groups)
                                           for a, n in zip(offsets(sizes), sizes)]))
    return piecewise(x, x.shape[-2], conv.out_channels, sizes, _conv_rows(conv), 1,
                     lambda piece: conv(act(group_normalize(piece, norm, mean, var))), in_place)


class PiecesHook(Hook):
    """Around a layer that runs on pieces of rows: the call's input (first argument, or ``input_name``), and a second
    argument (``extra_name``) that must be None for the pieces to apply; subclasses say how many elements one input
    row's temporaries hold (:meth:`row_elements`) and run the pieces (:meth:`run`)."""

    name = "vae_chunk"
    input_name = extra_name = ""

    def __init__(self, pieces: Pieces):
        self.pieces = pieces

    def __call__(self, module, call_next, args, kwargs):
        x = args[0] if args else kwargs.get(self.input_name)
        extra = args[1] if len(args) > 1 else kwargs.get(self.extra_name)
        if extra is not None or self.pieces.split_call() or not isinstance(x, torch.Tensor) or x.ndim != 4:
            return call_next(args, kwargs)
        sizes = self.pieces.sizes(x, self.row_elements(module, x))
        if len(sizes) == 1:
            return call_next(args, kwargs)
        self.pieces.split_calls += 1
        return self.run(module, call_next, x, sizes)

    def row_elements(self, module, x: torch.Tensor) -> int:
        raise NotImplementedError

    def run(self, module, call_next, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        raise NotImplementedError


class ResnetPieces(PiecesHook):
    """Around a ``ResnetBlock2D`` called without a time embedding: its forward on pieces of rows, in two passes
    (module docstring)."""

    input_name, extra_name = "input_tensor", "temb"

    def row_elements(self, block, x):
        # the norm's and the activation's output, and the convolution's, at the wider channel count
        return 3 * x.shape[0] * max(x.shape[1], block.conv1.out_channels) * x.shape[-1]

    def run(self, block, call_next, x, sizes):
        h = _norm_act_conv(x, block.norm1, block.nonlinearity, block.conv1, sizes)
        # conv2 keeps the channels: its output takes h's place, so x, h and one piece are all that is alive
        out = _norm_act_conv(h, block.norm2, lambda t: block.dropout(block.nonlinearity(t)), block.conv2, sizes,
                             in_place=True)
        for start, size in zip(offsets(sizes), sizes):  # the shortcut, piece by piece, into the output
            own = x.narrow(-2, start, size)
            shortcut = own if block.conv_shortcut is None else block.conv_shortcut(own)
            rows = out.narrow(-2, start, size)
            rows.copy_((shortcut + rows) / block.output_scale_factor)
        return out


def resnet_chunkable(block: nn.Module) -> bool:
    """Whether a ``ResnetBlock2D`` has the shape :class:`ResnetPieces` runs: group norms, no up/down sampling, a
    row-local (1x1) or absent shortcut, convolutions that keep the rows, and (without a time embedding, which the
    hook leaves to the block) the plain norm after ``conv1``: not ``scale_shift``."""
    shortcut = block.conv_shortcut
    return (isinstance(block.norm1, nn.GroupNorm) and isinstance(block.norm2, nn.GroupNorm)
            and block.upsample is None and block.downsample is None and block.time_embedding_norm != "scale_shift"
            and _same_rows(block.conv1) and _same_rows(block.conv2)
            and (shortcut is None or (isinstance(shortcut, nn.Conv2d) and shortcut.kernel_size == (1, 1)
                                      and shortcut.stride == (1, 1))))


class UpsamplePieces(PiecesHook):
    """Around an ``Upsample2D`` (nearest x2, then a 3x3 convolution) called without ``output_size``: its forward on
    pieces of input rows with one halo row each side; the upsampled tensor exists one piece at a time."""

    input_name, extra_name = "hidden_states", "output_size"

    def row_elements(self, up, x):
        # two upsampled rows, and the convolution's two output rows
        return 2 * x.shape[0] * (x.shape[1] + up.conv.out_channels) * 2 * x.shape[-1]

    def run(self, up, call_next, x, sizes):
        # in input rows, nearest x2 then a 3-row window is a 3-row window with 2 output rows per input row
        return piecewise(x, 2 * x.shape[-2], up.conv.out_channels, sizes, ConvRows(3, 1, 1, 1), 2,
                         lambda piece: call_next((piece,), {}))


def upsample_chunkable(up: nn.Module) -> bool:
    """Whether an ``Upsample2D`` is nearest x2 then a 3x3, padding-1 convolution, with no norm."""
    conv = getattr(up, "conv", None)
    return (up.interpolate and up.use_conv and not up.use_conv_transpose and up.norm is None
            and getattr(up, "name", "conv") == "conv" and _same_rows(conv) and _conv_rows(conv).kernel == 3)


def apply(vae: nn.Module, rows, device: torch.device, split_call=None) -> list:
    """Put the ``vae_chunk`` hooks on ``vae``'s residual blocks and up-samplers (module docstring); returns undo
    callables. ``rows``: rows per piece (int), ``"auto"`` (CUDA: from free memory; elsewhere nothing), or None
    (nothing). ``split_call``: () -> whether the call in progress is split over ranks (the hooks then step aside).
    :class:`ConfigError` when ``vae`` has no layer to chunk."""
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.upsampling import Upsample2D

    if rows is None or (rows == "auto" and device.type != "cuda"):
        return []
    pieces = Pieces(None if rows == "auto" else rows, budget_of(rows, device), split_call)
    undo = []
    for module in vae.modules():
        if isinstance(module, ResnetBlock2D) and resnet_chunkable(module):
            undo.append(add_hook(module, ResnetPieces(pieces)))
        elif isinstance(module, Upsample2D) and upsample_chunkable(module):
            undo.append(add_hook(module, UpsamplePieces(pieces)))
    if not undo:
        raise ConfigError(f"vae_chunk: {type(vae).__name__} has no residual block or up-sampler ditmesh can run in "
                          "pieces of rows (a 2-D KL VAE has); leave vae_chunk off")
    return undo


def pieces_of(vae: nn.Module) -> Pieces | None:
    """The :class:`Pieces` the ``vae_chunk`` hooks of ``vae`` share, or None."""
    from ..hooks import find_hook

    for module in vae.modules():
        hook = find_hook(module, "vae_chunk")
        if hook is not None:
            return hook.pieces
    return None
