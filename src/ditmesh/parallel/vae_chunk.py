"""Chunked VAE decode on one process, exact: the widest layers run on pieces of rows with halo rows.

A KL decoder's peak is at the top resolution: the last up-sampler's nearest-upsampled input and its convolution's
output, then the first residual block there, which holds its input, the group norm's output and the activation's
output at once (3 tensors of 256 channels at the image's full size for FLUX's VAE), besides the convolution's own
output. ``apply(vae, rows)`` puts a ``vae_chunk`` hook on

- every ``ResnetBlock2D`` (no time embedding, no up/down sampling inside, group norms): it runs as
  ``h = conv1(act(norm1(x)))``, ``out = conv2(act(norm2(h)))``, ``out = (shortcut(x) + out) / scale`` where each
  norm-activation-convolution runs on pieces of at most ``rows`` rows, the norm's statistics computed first over all
  rows (per piece, merged exactly with Chan's formula: ``parallel.vae.merge_stats``) and each piece extended by
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

The layers are ``parallel.vae``'s :class:`~ditmesh.parallel.vae.ResnetPieces` and
:class:`~ditmesh.parallel.vae.UpsamplePieces`, run by a :class:`WholeCall` state (one process holds every row, no
collective). Only calls that run whole use these hooks: a call split over ranks (``parallel.vae``) runs the same
layers in pieces of each rank's rows under the split's own hooks (``parallel.vae.PIECE_BYTES``), and these step
aside. Wan's causal 3-D VAE (frame by frame, RMS norms) is not covered.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from ..hooks import add_hook
from .chunk import budget_of
from .vae import VaeParallel, pieces_hooks


class WholeCall(VaeParallel):
    """The pieces' state of a call that runs whole: one process holds every row; at most ``rows`` rows a piece, or
    (``rows`` None) as many as keep one piece's temporaries within ``budget`` bytes. ``split_calls`` counts the
    calls that ran in more than one piece; ``split_call()`` says whether the call in progress is split over ranks
    (the hooks then step aside)."""

    def __init__(self, rows: int | None = None, budget: int | None = None, split_call=None):
        super().__init__(None, piece_bytes=budget or 0, piece_rows=rows)
        self.split_call = split_call or (lambda: False)

    @property
    def active(self) -> bool:
        return not self.whole_depth and not self.split_call()


def apply(vae: nn.Module, rows, device: torch.device, split_call=None) -> list:
    """Put the ``vae_chunk`` hooks on ``vae``'s residual blocks and up-samplers (module docstring); returns undo
    callables. ``rows``: rows per piece (int), ``"auto"`` (CUDA: from free memory; elsewhere nothing), or None
    (nothing). ``split_call``: () -> whether the call in progress is split over ranks (the hooks then step aside).
    :class:`ConfigError` when ``vae`` has no layer to chunk."""
    if rows is None or (rows == "auto" and device.type != "cuda"):
        return []
    state = WholeCall(None if rows == "auto" else rows, budget_of(rows, device), split_call)
    undo = [add_hook(module, hook) for module, hook in pieces_hooks(vae, state, "vae_chunk")]
    if not undo:
        raise ConfigError(f"vae_chunk: {type(vae).__name__} has no residual block or up-sampler ditmesh can run in "
                          "pieces of rows (a 2-D KL VAE has); leave vae_chunk off")
    return undo


def pieces_of(vae: nn.Module) -> WholeCall | None:
    """The :class:`WholeCall` state the ``vae_chunk`` hooks of ``vae`` share, or None."""
    from ..hooks import find_hook

    for module in vae.modules():
        hook = find_hook(module, "vae_chunk")
        if hook is not None:
            return hook.state
    return None
