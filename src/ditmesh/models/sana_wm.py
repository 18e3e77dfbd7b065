"""Sana-WM (``SanaWMTransformer3DModel``): a camera-controlled video world model on Sana-Video's block, whose
self-attention is a bidirectional gated delta net (every fourth block softmax attention) with a second, camera branch
that encodes its queries, keys and values with per-token ray transforms (UCPE).

Where the tokens are: ``forward`` patchifies the latent ``[B, C, T, H, W]`` (``x_embedder``, frame-major tokens),
builds the RoPE table, the per-frame modulation ``[B, 1, T, 6D]``, the post-attention Plucker embedding (a token
tensor) and the camera's ray transforms (one 4x4 per token) on every rank, whole; then runs
``SanaVideoMSCamCtrlBlock``s on ``[B, N, D]`` and ``final_layer`` on the whole sequence. The sequence plan splits the
tokens at the first block in whole frames (Sana's token grid with a frame as a row: uneven by at most one frame, at
least one per rank), cuts the Plucker embedding with them at every block, and gathers after the last block; every
block gets this rank's frames of the modulation, of ``frame_valid_mask`` and in its ``THW``
(:func:`sana_wm_sequence_hooks`). The Mix-FFN's depthwise 3x3 convolution stays inside a frame; its temporal ``(3, 1)``
convolution (``mlp.t_conv``) exchanges one halo frame with each neighbour (the grid's halo).

The self-attentions have no processor: their forwards run every projection and hand the tensors to parameter-free
recurrence or SDPA modules. Under sequence parallelism each runs as :class:`SanaWMAttentionHook`: Ulysses-style head
parallelism of everything that mixes tokens.

- **Gated delta net** (``BidirectionalGDNUCPESinglePathLiteLA``): the gates come from this rank's tokens (``beta`` per
  token and head, the decay's gate from each frame's mean: whole frames are local). One all-to-all sends Q, K, V of both
  branches with ``beta``, the gate and the frame mask (one channel each per head) from token shards to head shards: each
  rank holds every token of its heads. There the temporal short convolutions (depthwise: one channel at a time, so the
  rank's channels of the weight over every frame), the QK RMS-norms over all heads (the rank's sums of squares, added
  over the ranks in one all-reduce), the ReLU kernel, the decay and diffusers' own recurrence modules (``attn``,
  ``cam_attn``: forward and backward scans of each head over all frames, the camera branch's ray transforms and their
  per-head, per-frame beta discount) run exactly as in one process. One all-to-all sends both branches' outputs back;
  the camera output projection, the output gate and ``proj`` act per token.
- **Softmax** (``_SoftmaxUCPESinglePathLiteLA``): no convolution, so the QK-norms run on the token shards; one
  all-to-all of both branches' Q, K, V (and the frame mask), diffusers' SDPA modules over all tokens of the rank's
  heads (their bfloat16 rounding, RoPE and the camera transforms per head), one all-to-all back.
- **Cross-attention** (``MultiHeadCrossAttention``) to the whole Gemma text under its mask: the model's own processor
  on the local queries, no communication.

Per call under ulysses: per gated-delta-net block 2 all-to-alls and 1 all-reduce, per softmax block 2 all-to-alls, per
block 1 halo exchange, 1 all-gather. Ring attention and USP are refused (``ring_refusal``): the recurrences have no
log-sum-exp to merge per K/V block, and diffusers runs the softmax blocks as one SDPA in bfloat16 even for float32
weights, which a ring's float32 merge of per-block results does not reproduce (2e-3 apart, measured on random inputs). Tensor parallelism is refused (no tensor plan): the short convolutions' weights
and the per-head gate parameters are not linears the tensor plans shard. PipeFusion is refused; the step caches skip
whole blocks (``tests/test_cache_families.py``). CFG: ``SanaWMPipeline`` runs ``[uncond, cond]`` in one call (batched), split by cfg / dp with its camera inputs.

diffusers has no ``_cp_plan`` or ``_tp_plan`` for this class; the plan below is ours. This file is everything ditmesh
knows about Sana-WM.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..comm import offsets, split_sizes
from ..hooks import Hook, add_hook, bind_kwargs
from .base import (AttentionSelector, BlockList, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan,
                   SequenceProcessor, Split, SynthArch, TokenGrid, register, spatial_latent, temporal_latent)
from .ltx2 import LTX2_TINY
from .sana import _SANA_TINY
from .sana_variants import sana_video_frame_width  # a frame a row of the token grid, as Sana-Video's


class SanaWMCrossProcessor(SequenceProcessor):
    """Sana-WM's cross-attention under sequence parallelism: the local queries attend to the whole text every rank
    holds, through the layer's own processor (no communication)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None):
        return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask=attention_mask)


def _frame_mask(frame_valid_mask) -> torch.Tensor | None:
    """``frame_valid_mask`` (``[B, 1, T, 1, 1]``, ``[B, 1, T]`` or ``[B, T]``) as ``[B, T]``, or None."""
    if frame_valid_mask is None:
        return None
    if frame_valid_mask.ndim == 5:
        return frame_valid_mask[:, 0, :, 0, 0]
    return frame_valid_mask[:, 0] if frame_valid_mask.ndim == 3 else frame_valid_mask


def _short_conv(conv, x: torch.Tensor, frames: int, channels: slice) -> torch.Tensor:
    """diffusers' ``SanaWMTemporalShortConvolution`` on ``channels`` of its width alone: ``x`` ``[B, N, c]`` (frame-major
    tokens, every frame), the causal depthwise filter run forwards and backwards over the frames, the shared centre
    tap counted once. Depthwise, so each channel sees only its own weights: exact on any slice of the channels."""
    batch, tokens, width = x.shape
    spatial = tokens // frames
    weight = conv.weight[channels].to(x.dtype)
    bias = None if conv.bias is None else conv.bias[channels].to(x.dtype)
    seq = x.reshape(batch, frames, spatial, width).permute(0, 2, 1, 3).contiguous().reshape(-1, frames, width)

    def causal(t):
        return F.conv1d(t.transpose(1, 2), weight, bias, groups=width, padding=conv.kernel_size - 1)[..., :frames]

    out = causal(seq).transpose(1, 2) + causal(seq.flip(1)).flip(-1).transpose(1, 2) - seq * weight[:, 0, -1]
    return out.to(x.dtype).reshape(batch, spatial, frames, width).permute(0, 2, 1, 3).reshape(batch, tokens, width)


def _rms_norms(sp, norms, tensors, full: int, channels: slice) -> list:
    """diffusers' ``RMSNorm`` over all ``full`` channels of each of ``tensors`` (``[B, N, c]``: this rank's ``channels``
    of every token), the sums of squares of all of them added over the ranks in ONE all-reduce; an ``Identity`` norm
    leaves its tensor as is."""
    normed = [i for i, norm in enumerate(norms) if not isinstance(norm, torch.nn.Identity)]
    if not normed:
        return list(tensors)
    squares = torch.cat([tensors[i].float().pow(2).sum(-1, keepdim=True) for i in normed], dim=-1)
    variances = (sp.sum(squares) / full).unbind(-1)
    out = list(tensors)
    for i, variance in zip(normed, variances):
        norm, x = norms[i], tensors[i]
        y = x * torch.rsqrt(variance.unsqueeze(-1) + norm.eps)
        if norm.weight is not None:
            if norm.weight.dtype in (torch.float16, torch.bfloat16):
                y = y.to(norm.weight.dtype)
            y = y * norm.weight[channels]
            if getattr(norm, "bias", None) is not None:
                y = y + norm.bias[channels]
        else:
            y = y.to(x.dtype)
        out[i] = y
    return out


class SanaWMAttentionHook(Hook):
    """Around one Sana-WM self-attention (gated delta net or softmax, both with the camera branch): the forward as in
    diffusers, with every op that mixes tokens run on all tokens of this rank's heads between two all-to-alls (module
    docstring). Cross-rank rule: every rank of the group runs every self-attention in the same order with the same
    chunk sizes (the call's split of the video stream) and the same head split (``split_sizes(heads, degree)``)."""

    name = "sequence"

    def __init__(self, sp):
        self.sp = sp

    def __call__(self, attn, call_next, args, kwargs):
        named = bind_kwargs(functools.partial(type(attn).forward, attn), args, kwargs)
        x, (_, height, width) = named["x"], named["HW"]
        cam = named.get("camera_conditions") is not None
        if cam and named.get("ucpe_ray_transforms") is None:
            raise NotImplementedError("ditmesh: a Sana-WM self-attention called with camera conditions but without "
                                      "the transformer's precomputed ray transforms runs only unsplit (sp=1)")
        sp, batch, local, channels = self.sp, *x.shape
        spatial, heads, dim = height * width, attn.heads, attn.dim
        frames_mask = _frame_mask(named.get("frame_valid_mask"))
        valid = None if frames_mask is None else frames_mask.to(x.dtype).repeat_interleave(spatial, 1)[..., None]
        hidden = x if valid is None else x * valid

        def projected(*linears):  # [B, N_local, H, D] each, masked as diffusers masks them
            outs = [linear(hidden) for linear in linears]
            return [(o if valid is None else o * valid).reshape(batch, local, heads, dim) for o in outs]

        gdn = hasattr(attn, "conv_k")
        q, k, v = (t if valid is None else t * valid[..., None]
                   for t in attn.qkv(hidden).reshape(batch, local, 3, heads, dim).unbind(2))
        parts = [q, k, v]
        if cam:
            parts += projected(attn.q_proj_cam, attn.k_proj_cam, attn.v_proj_cam)
        if not gdn:  # no short convolution before the softmax layers' norms: they run on the token shards
            flat = [t.reshape(batch, local, channels) for t in parts]
            norms = [attn.q_norm, attn.k_norm] + ([attn.q_norm_cam, attn.k_norm_cam] if cam else [])
            for i, norm in zip((0, 1, 3, 4), norms):
                parts[i] = norm(flat[i]).reshape(batch, local, heads, dim)
        scalars = []
        if gdn:  # the gates from the whole channels of this rank's tokens: beta per token, the decay's gate per frame
            frame_mean = x.reshape(batch, local // spatial, spatial, channels).mean(dim=2)
            scalars += [attn.beta_proj(x).sigmoid(), attn.gate_proj(frame_mean).repeat_interleave(spatial, 1)]
        if valid is not None:
            scalars.append(valid.expand(batch, local, heads))
        packed = torch.cat(parts + [s.unsqueeze(-1) for s in scalars], dim=-1)
        seq_sizes, rank, group = sp.ctx.stream_sizes[sp.grid.stream], sp.ulysses_rank, sp.ulysses_group_name
        (full,) = seq_to_heads([packed], seq_sizes, rank, group, sp.comm_dtype)  # [B, N, h, width]
        own = split_sizes(heads, sp.ulysses_degree)
        first = offsets(own)[rank]
        outs = self.per_head(attn, named, full, len(parts), gdn, cam, valid is not None, slice(first, first + own[rank]))
        back = heads_to_seq(outs, seq_sizes, heads, rank, group, sp.comm_dtype)  # [B, N_local, H, D or 2D]
        out = back[..., :dim].reshape(batch, local, channels)
        if cam:
            out = out + attn.out_proj_cam(back[..., dim:].reshape(batch, local, channels))
        if attn.use_output_gate and attn.output_gate is not None:
            out = out * F.silu(attn.output_gate(x).to(torch.float32))
        return attn.proj(out.to(x.dtype))

    def per_head(self, attn, named, full, n_parts, gdn, cam, masked, own_heads: slice):
        """Both branches on every token of this rank's heads ``own_heads`` (``full``: ``[B, N, h, n_parts * D + gates
        + mask]``); returns their outputs ``[B, N, h, D]`` (main), with the camera branch's beside it."""
        batch, tokens, h = full.shape[:3]
        dim, (_, height, width) = attn.dim, named["HW"]
        spatial = height * width
        frames = tokens // spatial
        parts = [p.contiguous() for p in full[..., : n_parts * dim].split(dim, dim=-1)]  # RoPE views pairs
        extra = full[..., n_parts * dim:].unbind(-1)
        token_valid = extra[-1][..., 0] if masked else None  # [B, N]
        beta_valid = decay_valid = None
        if masked:
            frame_valid = token_valid.view(batch, frames, spatial)[:, :, 0]
            beta_valid, decay_valid = frame_valid.view(batch, 1, frames, 1), frame_valid.view(batch, 1, frames)
        channels = slice(own_heads.start * dim, own_heads.stop * dim)
        if not gdn:
            out = attn.attn(*parts[:3], rotary_emb=named.get("rotary_emb"), token_valid_mask=token_valid)
            outs = [out.view(batch, tokens, h, dim)]
            if cam:
                cam_out = attn.cam_attn(*parts[3:6], named["ucpe_ray_transforms"], token_valid_mask=token_valid)
                outs.append(cam_out.reshape(batch, tokens, h, dim))
            return torch.cat(outs, dim=-1)
        convs = [attn.conv_q, attn.conv_k, attn.conv_v] + ([attn.conv_q_cam, attn.conv_k_cam, attn.conv_v_cam]
                                                           if cam else [])
        flat = [t.reshape(batch, tokens, h * dim) for t in parts]
        flat = [x if conv is None else _short_conv(conv, x, frames, channels) for x, conv in zip(flat, convs)]
        norms = [attn.q_norm, attn.k_norm] + ([attn.q_norm_cam, attn.k_norm_cam] if cam else [])
        normed = _rms_norms(self.sp, norms, [flat[i] for i in (0, 1, 3, 4)[: len(norms)]], attn.in_dim, channels)
        for i, x in zip((0, 1, 3, 4), normed):
            flat[i] = attn.kernel_func(x)
        q, k, v, *cam_parts = (t.reshape(batch, tokens, h, dim) for t in flat)
        beta = extra[0].reshape(batch, frames, spatial, h).permute(0, 3, 1, 2)
        gate = extra[1].reshape(batch, frames, spatial, h)[:, :, 0].float()
        rate = attn.A_log.float().exp()[own_heads].view(1, 1, -1)
        decay = (-rate * F.softplus(gate + attn.dt_bias.float()[own_heads].view(1, 1, -1))).exp().transpose(1, 2)
        masks = dict(token_valid_mask=token_valid, beta_valid_mask=beta_valid, decay_valid_mask=decay_valid)
        out = attn.attn(q, k, v, beta, decay, attn.recall_gate, frames, rotary_emb=named.get("rotary_emb"), **masks)
        outs = [out.view(batch, tokens, h, dim)]
        if cam:
            cam_out = attn.cam_attn(*cam_parts, named["ucpe_ray_transforms"], beta, decay, frames, **masks)
            outs.append(cam_out.reshape(batch, tokens, h, dim))
        return torch.cat(outs, dim=-1)


def _local_frames_hook(sp):
    """A block's pre-hook: this rank's frames of its per-frame inputs (the modulation ``t`` ``[B, 1, T, 6D]`` and
    ``frame_valid_mask``) and its ``THW`` with this rank's frame count, after the tokens are split in whole frames."""

    def pre_hook(block, args, kwargs):
        named = bind_kwargs(functools.partial(type(block).forward, block), args, kwargs)
        units = sp.grid_rows.units
        first, count = sum(units[: sp.rank]), units[sp.rank]
        frames, height, width = named["THW"]
        named["t"] = named["t"].narrow(2, first, count)
        named["THW"] = (count, height, width)
        mask = named.get("frame_valid_mask")
        if mask is not None:
            named["frame_valid_mask"] = mask.narrow(1 if mask.ndim == 2 else 2, first, count)
        return (), named

    return pre_hook


def sana_wm_sequence_hooks(model, sp) -> list:
    """Sana-WM's hooks under sequence parallelism (module docstring): every block's per-frame inputs cut to this rank's
    frames, every self-attention run as :class:`SanaWMAttentionHook`. Returns the undo callables."""
    undo = []
    for block in model.blocks:
        undo.append(block.register_forward_pre_hook(_local_frames_hook(sp), with_kwargs=True).remove)
        undo.append(add_hook(block.attn, SanaWMAttentionHook(sp)))
    return undo


# -- inputs, sizes -------------------------------------------------------------------------------------------
#: LTX-2's VAE: 32x in space, 8x in time (Sana-WM's latents)
SANA_WM_VAE_SPATIAL, SANA_WM_VAE_TEMPORAL = 32, 8


def camera_conditions(batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """``[B, T, 20]`` camera conditions (a flat camera-to-world pose, then ``fx, fy, cx, cy``) of a camera moving
    forward with a pinhole centred on a ``height x width`` latent grid, as the pipeline builds them per latent frame."""
    c2w = torch.eye(4).repeat(batch, frames, 1, 1)
    c2w[..., 2, 3] = torch.arange(frames, dtype=torch.float32) * 0.1
    c2w[..., 0, 3] = torch.arange(frames, dtype=torch.float32) * 0.03
    intrinsics = torch.tensor([float(width), float(height), width / 2, height / 2]).expand(batch, frames, 4)
    return torch.cat([c2w.flatten(start_dim=-2), intrinsics], dim=-1)


def sana_wm_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one SanaWMPipeline step: LTX-2 latents (``(frames - 1) // 8 + 1`` latent frames; default
    161 frames), per-frame timesteps ``[B, 1, T]`` (the first frame's pinned to 0, as the pipeline's condition frame),
    Gemma text ``[B, 1, L, D]`` under the mask of a prompt filling half of it, the camera conditions and Plucker rays."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    t = ((frames or 161) - 1) // SANA_WM_VAE_TEMPORAL + 1
    h, w = height // SANA_WM_VAE_SPATIAL, width // SANA_WM_VAE_SPATIAL
    mask = torch.zeros(batch, text_len)
    mask[:, : max(1, text_len // 2)] = 1
    timestep = torch.full((batch, 1, t), 700.0)
    timestep[..., 0] = 0.0
    inputs = dict(hidden_states=rand(batch, cfg.in_channels, t, h, w), timestep=timestep.to(device, dtype),
                  encoder_hidden_states=rand(batch, 1, text_len, cfg.caption_channels),
                  encoder_attention_mask=mask.to(device, dtype),
                  camera_conditions=camera_conditions(batch, t, h, w).to(device, dtype), return_dict=False)
    if cfg.use_chunk_plucker_post_attn:
        inputs["chunk_plucker"] = rand(batch, cfg.chunk_plucker_channels, t, h, w)
    return inputs


def sana_wm_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a SanaWMPipeline call: LTX-2's VAE (32x, 8x in time), patch ``(1, 1, 1)``; the text is
    cross-attention context only."""
    spatial_latent(height, width, SANA_WM_VAE_SPATIAL, "SanaWMPipeline (LTX-2's 32x VAE)")
    latent_frames = temporal_latent(frames, SANA_WM_VAE_TEMPORAL, "Sana-WM's 8x temporal VAE (LTX-2's)")
    pt, ph, pw = config.get("patch_size", (1, 1, 1))
    lh, lw = height // SANA_WM_VAE_SPATIAL, width // SANA_WM_VAE_SPATIAL
    if lh // ph * (lw // pw) == 1:  # measured: its gated delta net's RoPE fails on a frame of one token (diffusers')
        raise ValueError(f"{height}x{width} makes frames of one latent token, which Sana-WM's gated delta nets cannot "
                         f"take (diffusers' RoPE there fails on them); try {height}x{2 * width}")
    video = latent_frames // pt * (lh // ph) * (lw // pw)
    return Layout(video, text_tokens, video, (config.get("in_channels", 128), latent_frames, lh, lw))


def sana_wm_sequence_traffic(config: dict, layout: Layout, bpe: int, tp: int) -> list:
    """What Sana-WM's sequence parallelism exchanges beyond its softmax attentions' all-to-alls, per sample and call:
    per gated-delta-net block two all-to-alls (Q, K, V of both branches with three gate channels per head out; both
    branches' outputs back) and the QK-norms' sums of squares (four float32 per token, all-reduced); per block one
    frame of the feed-forward's channels from each neighbour (the temporal convolution's halo)."""
    layers, every = config.get("num_layers", 20), config.get("softmax_every_n", 4)
    gdn = layers - (layers // every if every > 0 else 0)
    width, heads = config.get("hidden_size", 2240), config.get("hidden_size", 2240) // config.get("linear_head_dim", 112)
    tokens = layout.split_tokens
    frame = tokens // layout.latent_shape[1]
    return [("all_to_all", gdn * tokens * (8 * width + 3 * heads) * bpe, 2 * gdn),
            ("all_reduce", gdn * tokens * 4 * 4, gdn),
            ("halo", layers * 2 * frame * width * bpe, layers)]


def sana_wm_call_arguments(pipe, kwargs: dict) -> dict:
    """SanaWMPipeline's camera where generate's options name none: a forward walk over every frame (``action``
    ``w-<frames>``) seen by a pinhole whose focal length is the picture's width, centred on it."""
    width, height, frames = kwargs.get("width"), kwargs.get("height"), kwargs.get("num_frames")
    if None in (width, height, frames):
        raise ValueError("SanaWMPipeline needs --height, --width and --frames for its camera trajectory")
    return dict(kwargs, action=f"w-{frames}", intrinsics=[float(width), float(width), width / 2, height / 2])


def sana_wm_meta_trace(model):
    """The planner's meta-device trace: the camera geometry (diffusers' ``_process_camera_conditions_ucpe``, which turns
    autocast off on its inputs' device, which the meta device has not) answered with empty ray matrices and maps of
    its shapes, a few flops per token beside the blocks'. Returns the undo callable."""
    from diffusers.models.transformers import transformer_sana_wm as module

    geometry = module._process_camera_conditions_ucpe

    def empty(camera_conditions, batch, fhw, patch_size):
        grid = (batch, camera_conditions.shape[1], fhw[1], fhw[2])
        make = functools.partial(torch.empty, device=camera_conditions.device, dtype=camera_conditions.dtype)
        return make(*grid, 4, 4), make(*grid, 3)

    module._process_camera_conditions_ucpe = empty
    return lambda: setattr(module, "_process_camera_conditions_ucpe", geometry)


# -- synthetic architectures ---------------------------------------------------------------------------------
SANA_WM_1600M = SynthArch(
    name="sana-wm-1600m",
    description="Sana-WM 1600M bidirectional transformer (20 blocks of 2240: gated delta nets of 20 heads x 112, "
                "softmax every 4th, UCPE camera branches, Plucker rays), LTX-2 VAE, one-layer Gemma-2",
    pipeline="SanaWMPipeline",
    transformer_class="SanaWMTransformer3DModel",
    transformer=dict(in_channels=128, num_layers=20, hidden_size=2240, num_attention_heads=20, patch_size=[1, 1, 1],
                     softmax_every_n=4, linear_head_dim=112, caption_channels=2304, mlp_ratio=3.0,
                     chunk_plucker_channels=48),
    vae={},  # AutoencoderKLLTX2Video's defaults: LTX-2's VAE (32x, 8x in time, 128 channels)
    clip={},
    t5=dict(_SANA_TINY.t5, hidden_size=2304, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
            head_dim=256),  # Gemma-2 2B's width, one layer
    scheduler=dict(num_train_timesteps=1000, shift=1.0),
    default_dtype="bfloat16",
    default_size=(704, 1280),
    max_sequence_length=300,
    default_frames=161,
)

#: diffusers' test configuration of the class (2 blocks of 32: gated delta net then softmax, 2 heads x 16), LTX-2's
#: tiny test VAE (2x in space and time: 12 Plucker channels, 6 per frame of a chunk)
SANA_WM_TINY = dataclasses.replace(
    SANA_WM_1600M,
    name="sana-wm-tiny",
    description="Sana-WM shrunk for CPU tests: diffusers' test config (2 blocks of 32, gated delta net then softmax, "
                "2 heads x 16), LTX-2's tiny VAE, a 16-wide Gemma-2",
    transformer=dict(in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, patch_size=[1, 1, 1],
                     softmax_every_n=2, linear_head_dim=16, t_kernel_size=3, conv_kernel_size=4, caption_channels=16,
                     mlp_ratio=2.0, chunk_plucker_channels=12, chunk_plucker_post_attn_blocks=2),
    vae=LTX2_TINY.vae,
    t5=dict(_SANA_TINY.t5, hidden_size=16, intermediate_size=32),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=16,
    default_frames=9,
)

#: an awkward one: 3 heads of 16 (they do not divide 2), short convolutions on Q and V too (``k_conv_only`` off)
SANA_WM_TINY_3H = dataclasses.replace(
    SANA_WM_TINY,
    name="sana-wm-tiny-3h",
    description="sana-wm-tiny with 3 heads x 16 in both attentions (48 wide) and short convolutions on Q, K and V",
    transformer=dict(SANA_WM_TINY.transformer, hidden_size=48, num_attention_heads=3, k_conv_only=False),
)


def sana_wm_components(arch: SynthArch, kit) -> dict:
    """SanaWMPipeline's other components: LTX-2's video VAE and a Gemma-2 text encoder with its tokenizer."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKLLTX2Video, arch.vae, 1), **kit.gemma2_text_encoder(arch))


SANA_WM = register(
    ModelAdapter(
        name="sana-wm",
        class_names=("SanaWMTransformer3DModel",),
        num_heads=lambda model: model.config.hidden_size // model.config.linear_head_dim,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"blocks.0": {"x": Split(dim=1, stream="video", ndim=3)},
                    "blocks.*": {"plucker_emb": Split(dim=1, stream="video", ndim=3)}},
            gathers={"blocks.-1": Gather(dim=1, stream="video")},
            grid=TokenGrid("video", width=sana_video_frame_width, convs=("blocks.*.mlp.t_conv",),
                           enough="a video of at least {n} latent frames"),
        ),
        attention=AttentionSelector(class_names=("MultiHeadCrossAttention",)),
        sequence_processor=SanaWMCrossProcessor,
        sequence_hooks=sana_wm_sequence_hooks,
        blocks=(BlockList("blocks", ("x",), ("x",), streams=("video",)),),
        sequence_traffic=sana_wm_sequence_traffic,
        meta_trace=sana_wm_meta_trace,
        example_inputs=sana_wm_example_inputs,
        layout=sana_wm_layout,
        text_tokens=300,  # SanaWMPipeline's max_sequence_length
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "mask",
                      "camera_conditions", "chunk_plucker", "frame_valid_mask"),
        cfg_mode="batched",  # SanaWMPipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.config.in_channels,
        ring_refusal="its gated delta nets scan every frame of a head in order (no log-sum-exp to merge K/V blocks "
                     "by) and its softmax blocks round one whole SDPA to bfloat16 (a ring's merged blocks differ by "
                     "2e-3)",
        pp_refusal="its gated delta nets need every frame's keys of the current step, not PipeFusion's stale K/V of "
                   "other patches",
        frame_step=SANA_WM_VAE_TEMPORAL,
        fps=16,
        pipelines=("SanaWMPipeline",),
        image_pipelines=(ImagePipeline("camera", "SanaWMPipeline", strength=False),),
        call_arguments=sana_wm_call_arguments,
        synth_archs=(SANA_WM_1600M, SANA_WM_TINY, SANA_WM_TINY_3H),
        synth_components=sana_wm_components,
    )
)
