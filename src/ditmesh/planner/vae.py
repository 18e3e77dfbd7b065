"""VAE decode memory, measured from the VAE on the meta device.

The VAE is built from its diffusers class and config under ``torch.device("meta")`` and its ``decode`` traced with
the transformer trace's observers (live activation bytes; SDPA answered as a fused kernel, without scores): once
whole and once with the ``vae_chunk`` pieces (``parallel.vae_chunk``), at the requested size or, above
:data:`REFERENCE_PIXELS`, at a reference size of the same shape, scaled by the pixels (the decoder's activations grow
with the pixels; the chunked trace cuts the same number of pieces as the full size would), and for
a video with at most 2 latent frames, the rest of the video's output added. The modes the runtime has are counted
from those traces:

* **whole** (one GPU, or ``--vae-parallel off``): the traced peak;
* **split** over ``n`` ranks (``--vae-parallel auto|on`` with ``n > 1`` and at least ``n`` latent rows): rank 0's
  share traced at the requested size itself, with ``parallel.vae``'s hooks installed on a state whose collectives
  only make tensors of the shapes they would return (:class:`TracedRank`): its rows (the most, under an uneven
  split), the large layers in pieces of ``parallel.vae.PIECE_BYTES`` as the runtime cuts them, the mid-block
  attention's gathered keys and values and the gathered picture included. A VAE the hooks cannot split counts as
  the traced whole peak divided by ``n`` plus what every rank holds whole (the gathered mid-block attention's input
  and the picture twice);
* **tiled** (``--vae-parallel tiled``, diffusers' tiling, on one rank or spread): one tile's peak (the traced peak
  per pixel times a tile's pixels) plus the
  decoded tiles and the blended rows and picture (about 3.6 pictures at a quarter overlap);
* **chunked** (``--vae-chunk ROWS``, a decode that runs whole): the traced peak with the pieces installed.

The whole, tiled and chunked traces are live-tensor peaks: the allocator's caching and the convolutions'
workspaces come on top (the planner's 1 GiB reserve covers part of it). Measured on one H100 with FLUX's VAE in
bf16, the whole decode took 9.7 GiB at 2048² and 38.2 GiB at 4096² where the trace says 6.0 and 24.0 GiB: the
ratio, 1.6, is applied to those traces (``ALLOCATOR_FACTOR``). The split trace counts the workspace itself: while a
convolution runs it holds as much again as its input and output (cuDNN's layout copies). With no layer in pieces
(``piece_bytes`` larger than any layer) that model gives 11.5 and 46.0 GiB for FLUX's VAE split over 4 H100s at
4096² and 8192², where ``scripts/vae_bench.py`` measured 11.82 and 46.3 GiB before the split decode cut its large
layers into pieces.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError
from ..parallel.vae import PIECE_BYTES, VaeParallel

#: measured peak / traced live peak of FLUX's VAE decode on one H100 (38.2 / 24.0 GiB at 4096², 9.7 / 6.0 at 2048²)
ALLOCATOR_FACTOR = 1.6
#: the largest picture traced as it is; larger ones are traced at this size and scaled
REFERENCE_PIXELS = 512 * 512


class TracedRank(VaeParallel):
    """Rank ``rank`` of ``world`` of a split VAE call, run alone (on the meta device): each collective makes an empty
    tensor of the shape it would return (the halo rows stay as allocated), so the rank's share runs as it would."""

    def __init__(self, rank: int, world: int, piece_bytes: int = PIECE_BYTES):
        super().__init__(None, piece_bytes=piece_bytes)
        self.rank, self.world = rank, world

    def all_gather(self, t, dim, sizes):
        return t.new_empty(*t.shape[:dim], sum(sizes), *t.shape[dim + 1:])

    def exchange(self, sends, recvs):
        pass


@dataclass(frozen=True)
class VaeDecode:
    """Bytes of one VAE decode at one size: the weights and each mode's activation peak (live tensors x
    :data:`ALLOCATOR_FACTOR`); ``latent_rows`` decides whether a split over ranks applies."""

    class_name: str
    weight_bytes: int
    whole: float
    chunked: float
    gathered: float  # held whole on every rank of a split decode (the mid-block attention's input, the picture)
    tile: float | None  # one tile's decode and the tiled decode's buffers; None: no tiled decode
    latent_rows: int
    #: (spec, height, width, frames, batch): what :func:`split_peak` traces for a split over some ranks
    source: tuple = field(default=(), compare=False)

    def peak(self, mode: str, world: int, chunked: bool = False) -> float:
        """Activation bytes of ``mode`` (``whole``, ``split``, ``tiled``, ``chunked``) on ``world`` ranks; a split
        with fewer latent rows than ranks, or a tiled decode of a VAE without one, runs whole (in pieces when
        ``chunked``), as the runtime does."""
        if mode == "split" and world > 1 and self.latent_rows >= world:
            traced = split_peak(*self.source, world) if self.source else None
            return self.whole / world + self.gathered if traced is None else traced
        if mode == "tiled" and self.tile is not None:
            return self.tile
        return self.chunked if chunked or mode == "chunked" else self.whole


def _vae_source(spec) -> tuple[str, dict] | None:
    """(class name, config) of the VAE of a synth architecture or a checkpoint folder; None when it has none."""
    from ..models.base import adapter_for_class
    from ..models.registry import ARCHS

    if spec.name in ARCHS:
        adapter = adapter_for_class(spec.transformer_class)
        if adapter.vae is None:
            return None
        return adapter.vae.class_names[0], dict(ARCHS[spec.name].vae)
    path = Path(spec.name) / "vae" / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return config.get("_class_name"), {k: v for k, v in config.items() if not k.startswith("_")}


def _meta_vae(spec):
    """(VAE on the meta device in ``spec``'s dtype, its plan) or None for a model without a VAE the planner can
    build."""
    import diffusers

    from ..models.base import vae_plan_for

    source = _vae_source(spec)
    if source is None or not hasattr(diffusers, source[0] or ""):
        return None
    class_name, config = source
    dtype = getattr(torch, spec.dtype)
    with torch.device("meta"):
        vae = getattr(diffusers, class_name)(**config).eval()
        vae._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    return vae, vae_plan_for(vae)


@functools.lru_cache(maxsize=64)
def split_peak(spec, height: int, width: int, frames: int, batch: int, world: int,
               piece_bytes: int = PIECE_BYTES) -> int | None:
    """Peak bytes of rank 0's share of a decode split over ``world`` ranks (:class:`TracedRank`), traced at this
    size (a picture; videos count the whole decode's share) with each convolution's workspace
    (``_TrafficCounter``'s ``conv_workspace``); None for a VAE the parallel VAE cannot split."""
    from ..parallel import vae as parallel_vae

    built = _meta_vae(spec)
    if built is None or built[1] is None:
        return None
    vae, plan = built
    factor = plan.spatial_factor(vae)
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    undo = parallel_vae.install(vae, plan, TracedRank(0, world, piece_bytes))
    if not undo:
        return None
    try:
        z = torch.empty(batch, channels, height // factor, width // factor, device="meta",
                        dtype=next(vae.parameters()).dtype)
        return _traced_peak(vae, z, conv_workspace=True)
    finally:
        for fn in reversed(undo):
            fn()


def _traced_peak(vae, z: torch.Tensor, conv_workspace: bool = False) -> int:
    from .stats import _AttentionCatcher, _TrafficCounter

    counter = _TrafficCounter(lambda t: "fixed", conv_workspace)
    with torch.no_grad(), _AttentionCatcher([], []), counter:
        vae.decode(z)
    return counter.peak


@functools.lru_cache(maxsize=32)
def vae_decode(spec, height: int, width: int, frames: int = 1, batch: int = 1, chunk_rows: int | None = None
               ) -> VaeDecode | None:
    """:class:`VaeDecode` of ``spec``'s VAE for ``batch`` pictures (videos of ``frames``) of ``height`` x
    ``width``, traced on the meta device (in pieces of ``chunk_rows`` rows too, when given; else ``chunked`` is the
    whole peak); None for a model without a VAE the planner can build."""
    from ..parallel import vae_chunk

    built = _meta_vae(spec)
    if built is None:
        return None
    vae, plan = built
    class_name, dtype = type(vae).__name__, getattr(torch, spec.dtype)
    factor = plan.spatial_factor(vae) if plan is not None else 8
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    # a video VAE: Wan's (4x in time, ``z_dim``) or one that names its time compression (CogVideoX's in its config,
    # LTX-Video's as an attribute, 8x)
    time_factor = (getattr(vae, "temporal_compression_ratio", None) or vae.config.get("temporal_compression_ratio")
                   or (4 if "z_dim" in vae.config else None))
    is_video = time_factor is not None and (getattr(plan, "tile_decoder", "") is None
                                            or "temporal_compression_ratio" in vae.config)
    latent_frames = (frames - 1) // time_factor + 1 if is_video else 1
    traced_frames = min(latent_frames, 2)
    lh, lw = height // factor, width // factor
    shrink = max(1.0, (height * width / REFERENCE_PIXELS) ** 0.5)
    th, tw = max(1, round(lh / shrink)), max(1, round(lw / shrink))
    scale = (lh * lw) / (th * tw)

    def latent(h, w):
        return torch.empty(batch, channels, *((traced_frames,) if is_video else ()), h, w, device="meta", dtype=dtype)

    bpe = torch.empty(0, dtype=dtype).element_size()
    frame_bytes = batch * vae.config.get("out_channels", 3) * height * width * bpe
    picture = frame_bytes * (frames if is_video else 1)
    rest = frame_bytes * max(0, frames - (traced_frames - 1) * time_factor - 1) if is_video else 0  # frames not traced
    traced = _traced_peak(vae, latent(th, tw))
    whole = traced * scale + rest
    chunked = whole  # not asked, or a VAE without layers to cut: the pieces change nothing
    if chunk_rows is not None:
        try:  # the same number of pieces as at the full size, so each piece's temporaries scale with the pixels too
            undo = vae_chunk.apply(vae, max(1, round(chunk_rows / shrink)), torch.device("meta"))
        except ConfigError:
            undo = []
        if undo:
            chunked = _traced_peak(vae, latent(th, tw)) * scale + rest
            for fn in reversed(undo):
                fn()
    widest = max(vae.config.get("block_out_channels") or [vae.config.get("base_dim", 96) * 4])
    gathered = 4 * batch * widest * lh * lw * bpe + 2 * picture
    tile = None
    if plan is not None and plan.tile_decoder is not None and hasattr(vae, "tile_sample_min_size"):
        tile_pixels = min(vae.tile_sample_min_size, height) * min(vae.tile_sample_min_size, width)
        tile = traced * tile_pixels / (th * tw * factor * factor) + 3.6 * picture
    weights = sum(p.numel() for p in vae.parameters()) * bpe
    f = ALLOCATOR_FACTOR
    return VaeDecode(class_name, weights, whole * f, chunked * f, gathered * f, None if tile is None else tile * f, lh,
                     (spec, height, width, frames, batch) if not is_video else ())
