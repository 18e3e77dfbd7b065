"""Parallel VAE cases executed on every rank of a gloo worker pool (module-level so workers can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ditmesh.testing import rel_err

#: tiny VAEs of the real classes: a 3-level AutoencoderKL (4x, two stride-2 down-samplings, mid-block attention)
#: and a Wan 2.1 causal 3-D VAE (8x spatial, 4x temporal)
TINY_VAES = {
    "kl": ("AutoencoderKL", dict(block_out_channels=(8, 8, 16), down_block_types=("DownEncoderBlock2D",) * 3,
                                 up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, norm_num_groups=4,
                                 latent_channels=4)),
    "wan": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, num_res_blocks=1)),
    "qwen": ("AutoencoderKLQwenImage", dict(base_dim=8, z_dim=4, num_res_blocks=1)),
    # Wan 2.2's layout: 2x2 patches around the VAE (16x), residual blocks with pixel-shuffle shortcuts
    "wan22": ("AutoencoderKLWan", dict(base_dim=8, decoder_base_dim=8, z_dim=4, num_res_blocks=1, is_residual=True,
                                       patch_size=2, scale_factor_spatial=16, in_channels=12, out_channels=12,
                                       dim_mult=[1, 2, 2, 2], temperal_downsample=[False, True, True])),
}
#: Mochi's: causal 3-D convolutions replicating their edge rows, per-frame group norms, 8x spatial and 6x temporal
TINY_VAES["mochi"] = ("AutoencoderKLMochi", dict(encoder_block_out_channels=(32, 32, 32, 32),
                                                 decoder_block_out_channels=(32, 32, 32, 32),
                                                 layers_per_block=(1, 1, 1, 1, 1)))
TINY_VAES["flux2"] = ("AutoencoderKLFlux2", TINY_VAES["kl"][1])  # FLUX.2's VAE class, FLUX.1's layout
#: diffusers' test configuration (tests/pipelines/cogvideo): 8x spatial, 4x temporal, frame batches with a cache
TINY_VAES["cogvideox"] = ("AutoencoderKLCogVideoX", dict(
    down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
    block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2))
TINY_VAES["ltx"] = ("AutoencoderKLLTXVideo", dict(  # the real 32x / 8x-time compression, 8 wide, latent_channels 4
    latent_channels=4, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
    layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1)))
#: FLUX's VAE layout (4 levels, 2 residual blocks a level, 16 latent channels) at an eighth of its widths
TINY_VAES["flux-shaped"] = ("AutoencoderKL", dict(
    block_out_channels=(16, 32, 64, 64), down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, norm_num_groups=4, latent_channels=16))
#: the 2-D VAEs (no frames)
IMAGE_VAES = ("kl", "flux2", "flux-shaped")


def tiny_vae(kind: str):
    """A tiny VAE of ``kind`` (see :data:`TINY_VAES`) with seeded random weights, float32, eval mode."""
    import diffusers

    cls_name, config = TINY_VAES[kind]
    torch.manual_seed(0)
    vae = getattr(diffusers, cls_name)(**config).eval()
    with torch.no_grad():  # random norms and biases too, so a missed statistic or a shifted row shows
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return vae


def _inputs(vae, kind: str, what: str, rows: int, cols: int, frames: int, batch: int) -> torch.Tensor:
    from ditmesh.models.base import vae_plan_for

    g = torch.Generator().manual_seed(7)
    factor = 1 if what == "decode" else vae_plan_for(vae).spatial_factor(vae)
    channels = 3 if what == "encode" else vae.config.get("z_dim") or vae.config.latent_channels
    time = () if kind in IMAGE_VAES else (frames,)
    return torch.randn(batch, channels, *time, rows * factor, cols * factor, generator=g)


def _run(vae, what: str, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if what == "decode":
            return vae.decode(z=x).sample  # by name: the split hook finds it there too
        return vae.encode(x).latent_dist.parameters


def vae_case(kind: str, what: str, rows: int, cols: int, frames: int = 1, batch: int = 1, mode: str = "auto",
             piece_bytes: int | None = None):
    """``what`` (decode or encode) of a tiny ``kind`` VAE on ``rows`` x ``cols`` latent rows and columns, whole and
    split over the world (large layers in pieces of ``piece_bytes``, default ``parallel.vae.PIECE_BYTES``). Returns
    the rel err against the whole run, the collectives of the split call, the layer calls that ran in more than one
    piece, and whether removing the hooks gave back the VAE (same state dict, no instance attributes left, same
    output)."""
    from ditmesh.comm import count_collectives
    from ditmesh.hooks import find_hook
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae

    vae = tiny_vae(kind)
    state = {k: v.clone() for k, v in vae.state_dict().items()}
    x = _inputs(vae, kind, what, rows, cols, frames, batch)
    ref = _run(vae, what, x)
    undo = parallel_vae.apply(vae, vae_plan_for(vae), dist.group.WORLD, strict=mode == "on",
                              piece_bytes=piece_bytes or parallel_vae.PIECE_BYTES)
    split = find_hook(vae, "vae", "decode")
    with count_collectives() as counts:
        out = _run(vae, what, x)
    for fn in reversed(undo):
        fn()
    after = vae.state_dict()
    restored = (set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in state)
                and not any(k in vars(m) for m in vae.modules() for k in ("forward", "decode", "_encode"))
                and torch.equal(_run(vae, what, x), ref))
    return dict(err=rel_err(out, ref), shape=tuple(out.shape), counts=dict(counts), restored=restored,
                hooked=len(undo), pieced=split.state.split_calls if split else 0)


def band_peak_case(rows: int, cols: int, budgets=(1 << 60, 1)):
    """The FLUX-shaped VAE's decode of ``rows`` x ``cols`` latents split over the world, once per piece budget
    (default: every layer whole, then pieces of one latent row): this rank's peak of live tensor bytes during the
    decode (the planner's dispatch-mode counter on the real tensors) and the rel err against the whole decode; and
    the planner's meta-device trace of this rank's share (``planner.vae.TracedRank``) for each budget."""
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae
    from ditmesh.planner.stats import _TrafficCounter
    from ditmesh.planner.vae import TracedRank, _traced_peak

    import diffusers

    vae = tiny_vae("flux-shaped")
    z = _inputs(vae, "flux-shaped", "decode", rows, cols, 1, 1)
    ref = _run(vae, "decode", z)
    cls_name, config = TINY_VAES["flux-shaped"]
    with torch.device("meta"):
        meta = getattr(diffusers, cls_name)(**config).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for budget in budgets:
        undo = parallel_vae.apply(vae, vae_plan_for(vae), dist.group.WORLD, piece_bytes=budget)
        counter = _TrafficCounter(lambda t: "fixed")
        with counter:
            picture = _run(vae, "decode", z)
        undo += parallel_vae.install(meta, vae_plan_for(meta), TracedRank(rank, world, budget))
        traced = _traced_peak(meta, torch.empty_like(z, device="meta"))
        for fn in reversed(undo):
            fn()
        out.append(dict(peak=counter.peak, traced=traced, err=rel_err(picture, ref)))
    return out


def local_norms_case(kind: str, rows: int, cols: int):
    """The split decode with each group norm's statistics taken over this rank's rows only (what a patch-wise
    parallel VAE without the between-rank variance term does). Returns the rel err against the whole decode."""
    from torch import nn

    from ditmesh.hooks import Hook, registry
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae

    vae = tiny_vae(kind)
    z = _inputs(vae, kind, "decode", rows, cols, 1, 1)
    ref = _run(vae, "decode", z)
    undo = parallel_vae.apply(vae, vae_plan_for(vae), dist.group.WORLD)
    for module in vae.modules():
        if isinstance(module, nn.GroupNorm) and "vae" in registry(module).hooks:
            registry(module).hooks["vae"] = Hook()  # passes through: the norm sees the local rows alone
    out = _run(vae, "decode", z)
    for fn in reversed(undo):
        fn()
    return rel_err(out, ref)


def chunked_vae_case(what: str, rows: int, cols: int, batch: int, piece_rows: int):
    """``what`` of the tiny KL VAE on ``rows`` x ``cols`` latents, whole and with its residual blocks and up-samplers
    on pieces of ``piece_rows`` rows (``parallel.vae_chunk``). Returns the rel err, the calls that ran in pieces, the
    hooked modules, and whether removing the hooks gave back the VAE."""
    from ditmesh.parallel import vae_chunk

    vae = tiny_vae("kl")
    state = {k: v.clone() for k, v in vae.state_dict().items()}
    x = _inputs(vae, "kl", what, rows, cols, 1, batch)
    ref = _run(vae, what, x)
    undo = vae_chunk.apply(vae, piece_rows, torch.device("cpu"))
    out = _run(vae, what, x)
    split_calls = vae_chunk.pieces_of(vae).split_calls
    for fn in reversed(undo):
        fn()
    after = vae.state_dict()
    restored = (all(torch.equal(after[k], state[k]) for k in state) and vae_chunk.pieces_of(vae) is None
                and not any("forward" in vars(m) for m in vae.modules()) and torch.equal(_run(vae, what, x), ref))
    return dict(err=rel_err(out, ref), split_calls=split_calls, hooked=len(undo), restored=restored)


def tiled_case(rows: int, cols: int, batch: int = 1, tile: int = 32):
    """The tiny KL VAE's tiled decode (tiles of ``tile`` pixels, a quarter overlap) of ``rows`` x ``cols`` latents,
    on one process and with its tiles spread over the world (``vae_parallel="tiled"``). Returns the rel err, the
    tiles decoded on this rank, the collectives, and whether undoing gave back the VAE (tiling off again, no hook)."""
    from ditmesh.comm import count_collectives
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel import vae as parallel_vae

    vae = tiny_vae("kl")
    vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // vae_plan_for(vae).spatial_factor(vae)
    z = _inputs(vae, "kl", "decode", rows, cols, 1, batch)
    vae.enable_tiling()
    ref = _run(vae, "decode", z)
    vae.disable_tiling()
    whole = _run(vae, "decode", z)
    undo = parallel_vae.apply_tiled(vae, vae_plan_for(vae), dist.group.WORLD)
    decoded = []  # tiles this rank really decoded (a placeholder runs no layer of the decoder)
    handle = vae.decoder.conv_in.register_forward_hook(lambda m, a, out: decoded.append(1))
    with count_collectives() as counts:
        out = _run(vae, "decode", z)
    handle.remove()
    for fn in reversed(undo):
        fn()
    restored = (not vae.use_tiling and not any(k in vars(m) for m in vae.modules() for k in ("forward", "tiled_decode"))
                and torch.equal(_run(vae, "decode", z), whole))
    return dict(err=rel_err(out, ref), differs_from_whole=rel_err(ref, whole), decoded=len(decoded),
                counts=dict(counts), restored=restored)


def pipeline_vae_case(model: str, config: dict, mode: str, remove: bool = False, vae_chunk=None, tile=None):
    """A FluxPipeline image (``output_type="pt"``) under ``config`` with ``vae_parallel=mode`` (and ``vae_chunk``;
    ``tile``: the VAE's tiles of that many pixels, and diffusers' tiling turned on unless the mode is ``tiled``, which
    turns it on itself); returns the image, the collectives of the VAE decode, the decode's calls that ran in pieces
    of rows, and (``remove``) whether ``ditmesh.remove`` gave the VAE back unchanged (tiling off again)."""
    from diffusers import FluxPipeline

    from ditmesh import ParallelConfig, parallelize, remove as ditmesh_remove
    from ditmesh.comm import count_collectives

    torch.manual_seed(0)
    pipe = FluxPipeline.from_pretrained(model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    state = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
    types = [type(m) for m in pipe.vae.modules()]
    if tile:
        pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size = tile, tile // 8
        pipe.vae.use_tiling = mode != "tiled"
    from ditmesh.parallel.vae_chunk import pieces_of

    parallelize(pipe, ParallelConfig(**config), vae_parallel=mode, vae_chunk=vae_chunk)
    pieces = pieces_of(pipe.vae)
    decode = pipe.vae.decode
    counts = {}

    def counted(*args, **kwargs):
        with count_collectives() as c:
            out = decode(*args, **kwargs)
        counts.update(c)
        return out

    pipe.vae.decode = counted
    image = pipe("a red circle", height=64, width=48, num_inference_steps=2, guidance_scale=3.5,
                 generator=torch.Generator().manual_seed(42), max_sequence_length=32, output_type="pt").images
    if getattr(decode, "__func__", None) is getattr(type(pipe.vae), "decode"):
        del pipe.vae.decode  # the class's own method (no split hook on it): no instance attribute left
    else:
        pipe.vae.decode = decode
    restored = None
    if remove:
        ditmesh_remove(pipe)
        after = pipe.vae.state_dict()
        restored = (set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in state)
                    and [type(m) for m in pipe.vae.modules()] == types and not pipe.vae.use_tiling
                    and not any(k in vars(m) for m in pipe.vae.modules() for k in ("forward", "decode", "_encode")))
    return dict(image=image, counts=counts, restored=restored, split_calls=pieces.split_calls if pieces else 0)
