"""Wan's variants: ChronoEdit, Wan VACE and Wan 2.2 Animate, each Wan's adapter (``models/wan.py``) with what differs.

All three run Wan's blocks (self-attention with 3-D RoPE over the video tokens, cross-attention to a replicated text
context), so the sequence processor, the split points (the RoPE table's output, the video tokens at the first block,
the gather at ``proj_out``), the tensor plan of a block, the VAE plan, the frame rule and the synthetic components are
Wan's. What differs:

- **ChronoEdit** (``ChronoEditTransformer3DModel``): only its RoPE table (two latent frames take the positions of the
  first and the last of ``rope_temporal_skip_len``), which is split like Wan's. Its pipeline edits an image: the
  image is the first frame of a five-frame video (Wan 2.1 I2V's layout: 36 channels in, CLIP image tokens in the
  cross-attention), and ``generate --image`` runs it.
- **Wan VACE** (``WanVACETransformer3DModel``): a control branch, ``vace_blocks`` (Wan blocks reading the patchified
  control video, ``control_hidden_states``, plus the video tokens), runs first; each returns a hint that the forward
  adds to the video tokens after block ``vace_layers[i]``. Both token sequences hold the same video tokens, so both
  are split at the entry of the first block of each list (the video tokens are cut again at ``blocks.0`` because the
  forward hands the blocks its own, whole, variable), and the hints are local like the tokens they are added to. The
  tensor plan is Wan's for both lists: 7 all-reduces per block of either.
- **Wan Animate** (``WanAnimateTransformer3DModel``): every ``inject_face_latents_blocks``-th block is followed by a
  face adapter, a cross-attention of each latent frame's video tokens to the motion tokens of the same frame (computed
  from the face video, replicated). Under sequence parallelism a rank's tokens need not be whole frames, so its
  processor finds the frame of each local token from the rank's offset in the video stream and attends each run of
  one frame's tokens to that frame's motion tokens: no communication. Under tp its Q/K/V are column- and its output
  row-parallel (one all-reduce per adapter). The pose latents are added to the video tokens before they are split.

Neither VACE nor Animate is one stack of blocks: their hints and face outputs are added between blocks by the
forward, so PipeFusion (stages of one stack) and the step caches (a skipped span of blocks would add them twice)
are refused for them.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers import transformer_wan_animate

from .base import (AttentionSelector, BlockList, ImagePipeline, Layout, SequencePlan, Split, TensorPlan,
                   register, token_range)
from .wan import (_WAN_TINY, WAN, WAN21_14B, WanSequenceParallelProcessor, ftfy_setup, wan_example_inputs, wan_layout,
                  wan_tensor_plan)

_NOT_ONE_STACK = "{what} between blocks, outside them"


# -- ChronoEdit -----------------------------------------------------------------------------------------------
def chronoedit_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one ChronoEditPipeline step: Wan's, at five frames (two latent frames: the image and the
    edit) unless more are asked (temporal reasoning)."""
    return wan_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames or 5)


#: ChronoEdit-14B: Wan2.1-I2V-14B's transformer (36 channels in, CLIP image tokens) with ChronoEdit's RoPE
CHRONOEDIT_14B = dataclasses.replace(
    WAN21_14B,
    name="chronoedit-14b",
    description="ChronoEdit-14B transformer (Wan2.1-I2V-14B's: 40 blocks, 40 heads x 128, 36 channels in, CLIP image "
                "tokens), full Wan VAE, small UMT5, a one-layer CLIP vision encoder",
    pipeline="ChronoEditPipeline",
    transformer_class="ChronoEditTransformer3DModel",
    transformer=dict(WAN21_14B.transformer, in_channels=36, image_dim=1280, added_kv_proj_dim=5120,
                     rope_temporal_skip_len=8),
    clip=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=1, num_attention_heads=16, image_size=224,
              patch_size=14),
    scheduler=dict(num_train_timesteps=1000, shift=5.0),
    scheduler_class="FlowMatchEulerDiscreteScheduler",
    default_size=(720, 1280),
    default_frames=5,
)

#: diffusers' test configuration of the class (2 heads x 8, 2 blocks, text 32 wide), as the edit pipeline needs it: 36
#: channels in and a CLIP image context (image_dim 32, projected to the 16-wide added K/V)
_CHRONOEDIT_TINY = dataclasses.replace(
    CHRONOEDIT_14B,
    name="chronoedit-tiny",
    description="ChronoEdit shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads x 8) reading 36 channels "
                "and a tiny CLIP vision encoder's tokens, tiny Wan VAE",
    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=8, in_channels=36, out_channels=16,
                     text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=32, added_kv_proj_dim=16,
                     rope_max_seq_len=64, rope_temporal_skip_len=8),
    vae=_WAN_TINY.vae,
    t5=dict(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2),
    clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=16),
    default_dtype="float32",
    default_size=(48, 48),
    max_sequence_length=16,
)

CHRONOEDIT = register(dataclasses.replace(
    WAN,
    name="chronoedit",
    class_names=("ChronoEditTransformer3DModel",),
    example_inputs=chronoedit_example_inputs,
    pipelines=("ChronoEditPipeline",),
    # the image is the video's first frame; every run starts from noise
    image_pipelines=(ImagePipeline("edit", "ChronoEditPipeline", strength=False,
                                   setup=ftfy_setup("chronoedit.pipeline_chronoedit")),),
    synth_archs=(CHRONOEDIT_14B, _CHRONOEDIT_TINY),
))


# -- Wan VACE -------------------------------------------------------------------------------------------------
def vace_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one WanVACEPipeline step: Wan's, and the control latents (``vace_in_channels``: the
    inactive and reactive video latents and the 8x8-unshuffled mask) at the latent's size."""
    inputs = wan_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames)
    _, _, f, h, w = inputs["hidden_states"].shape
    control = torch.randn(batch, model.config.vace_in_channels, f, h, w, generator=generator)
    return dict(inputs, control_hidden_states=control.to(device, dtype))


_WAN_BLOCK = ("hidden_states",), ("hidden_states",), ("video",)

WAN_VACE_14B = dataclasses.replace(
    WAN21_14B,
    name="wan2.1-vace-14b",
    description="Wan2.1-VACE-14B transformer (40 blocks and 8 VACE blocks, 40 heads x 128), full Wan VAE, small UMT5",
    pipeline="WanVACEPipeline",
    transformer_class="WanVACETransformer3DModel",
    transformer=dict(WAN21_14B.transformer, vace_layers=list(range(0, 40, 5)), vace_in_channels=96),
)

#: diffusers' test configuration of the class (2 heads x 12, 4 blocks, VACE at 0 and 2, text 32 wide) with the
#: pipeline's 96 control channels (16 + 16 latent channels and the 64 of the 8x8-unshuffled mask; the test's 48 are
#: for the transformer alone)
_WAN_VACE_TINY = dataclasses.replace(
    WAN_VACE_14B,
    name="wan-vace-tiny",
    description="Wan VACE shrunk for CPU tests: diffusers' test config (4 blocks, VACE blocks at 0 and 2, 2 heads x "
                "12) with 96 control channels, tiny Wan VAE",
    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=4, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=96),
    vae=_WAN_TINY.vae,
    t5=dict(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2),
    default_dtype="float32",
    default_size=(48, 48),
    max_sequence_length=16,
    default_frames=5,
)

WAN_VACE = register(dataclasses.replace(
    WAN,
    name="wan-vace",
    class_names=("WanVACETransformer3DModel",),
    sequence_plan=SequencePlan(
        streams=("video",),
        # the control branch runs first, on the video tokens and the control tokens (both one token per video
        # patch); the main blocks then take the forward's own whole video tokens, cut again
        inputs={"": {"timestep": Split(dim=1, stream="video", ndim=2)},
                "vace_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                  "control_hidden_states": Split(dim=1, stream="video", ndim=3)},
                "blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}},
        outputs=WAN.sequence_plan.outputs,
        gathers=WAN.sequence_plan.gathers,
        differs_from_cp_plan="the class has no _cp_plan; Wan's split points, and the control tokens cut at the first "
                             "VACE block",
    ),
    # the control branch's blocks return (hint, control tokens): the hint is not what a block takes, so only the main
    # blocks are declared (compiled one by one; the VACE blocks run eager)
    blocks=(BlockList("blocks", *_WAN_BLOCK),),
    tensor_plan=wan_tensor_plan("blocks", "vace_blocks"),
    batch_inputs=WAN.batch_inputs + ("control_hidden_states",),
    example_inputs=vace_example_inputs,
    pipelines=("WanVACEPipeline",),
    pipeline_setup=ftfy_setup("wan.pipeline_wan_vace"),
    image_pipelines=(),
    synth_archs=(WAN_VACE_14B, _WAN_VACE_TINY),
    pp_refusal=_NOT_ONE_STACK.format(what="its control hints are added to the video tokens"),
    cache_refusal=_NOT_ONE_STACK.format(what="its control hints are added to the video tokens"),
))


# -- Wan Animate ----------------------------------------------------------------------------------------------
class WanAnimateSequenceParallelProcessor(WanSequenceParallelProcessor):
    """Wan's processor for the blocks' attentions; for a face adapter (``WanAnimateFaceBlockCrossAttention``) each
    local video token attends to the motion tokens of its own latent frame.

    diffusers' face processor cuts the whole video into frames (``S / T`` tokens each, ``T`` the motion frames) and
    runs one attention per frame. Here the rank's tokens are a contiguous range of the video stream starting at
    ``first`` (:func:`~ditmesh.models.base.token_range`), so token ``i`` belongs to frame ``(first + i) // (S / T)``;
    each run of one frame's local tokens attends to that frame's keys. The motion tokens are whole on every rank: no
    communication, and exactly the local rows of the one-process result.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
        if not isinstance(attn, transformer_wan_animate.WanAnimateFaceBlockCrossAttention):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if attention_mask is not None:
            raise NotImplementedError("a mask on Wan Animate's face adapter is not split with the video tokens; the "
                                      "model passes none")
        motion = attn.pre_norm_kv(encoder_hidden_states)
        batch, frames, per_frame, _ = motion.shape
        q, k, v = transformer_wan_animate._get_qkv_projections(attn, attn.pre_norm_q(hidden_states), motion.flatten(1, 2))
        q = attn.norm_q(q.unflatten(2, (attn.heads, -1)))
        k = attn.norm_k(k.view(batch, frames, per_frame, attn.heads, -1))
        v = v.view(batch, frames, per_frame, attn.heads, -1)
        first, total = token_range(self.sp, "video", q.shape[1])
        frame_len = total // frames
        pieces, start = [], first
        while start < first + q.shape[1]:
            frame = start // frame_len
            stop = min(first + q.shape[1], (frame + 1) * frame_len)
            pieces.append(dispatch_attention_fn(q[:, start - first:stop - first], k[:, frame], v[:, frame],
                                                backend=self._attention_backend))
            start = stop
        out = torch.cat(pieces, dim=1).flatten(2, 3).type_as(q)
        return attn.to_out(out)


def animate_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one WanAnimatePipeline step for a segment of ``frames`` video frames (default 77): the
    noise, the reference mask and the reference and conditioning latents (``in_channels``) over ``T + 1`` latent frames
    (the reference image's first), the pose latents over ``T``, the face video (``4T - 3`` frames of
    ``motion_encoder_size`` pixels, which the face encoder brings to ``T``) and 257 CLIP image tokens."""
    cfg = model.config
    latent_frames = ((frames or 77) - 1) // 4 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    side = cfg.motion_encoder_size
    inputs = wan_example_inputs(model, height, width, batch, text_len, generator, device, dtype, 4 * latent_frames + 1)
    return dict(inputs, encoder_hidden_states_image=rand(batch, 257, cfg.image_dim),
                pose_hidden_states=rand(batch, cfg.latent_channels, latent_frames, height // 8, width // 8),
                face_pixel_values=rand(batch, 3, 4 * latent_frames - 3, side, side))


def animate_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Wan's layout of a segment of ``frames`` frames, plus the reference image's latent frame."""
    return wan_layout(config, height, width, frames + 4, text_tokens)


WAN_ANIMATE_14B = dataclasses.replace(
    WAN21_14B,
    name="wan2.2-animate-14b",
    description="Wan2.2-Animate-14B transformer (40 blocks, 40 heads x 128, a face adapter every 5 blocks, motion and "
                "face encoders), full Wan VAE, small UMT5, a one-layer CLIP vision encoder",
    pipeline="WanAnimatePipeline",
    transformer_class="WanAnimateTransformer3DModel",
    transformer=dict(WAN21_14B.transformer, in_channels=36, latent_channels=16, image_dim=1280,
                     added_kv_proj_dim=5120),
    clip=CHRONOEDIT_14B.clip,
    default_size=(720, 1280),
    default_frames=77,
)

#: diffusers' test configuration of the class (2 heads x 12, 2 blocks, a face adapter every 2, small motion encoder)
_WAN_ANIMATE_TINY = dataclasses.replace(
    WAN_ANIMATE_14B,
    name="wan-animate-tiny",
    description="Wan Animate shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads x 12, one face adapter, a "
                "16-pixel motion encoder), tiny Wan VAE",
    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=12,
                     latent_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                     cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=16, rope_max_seq_len=32,
                     motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16,
                     motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                     face_encoder_num_heads=2, inject_face_latents_blocks=2),
    vae=dict(_WAN_TINY.vae, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
    t5=dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    clip=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=16),
    default_dtype="float32",
    default_size=(48, 48),
    max_sequence_length=16,
    default_frames=9,
)

WAN_ANIMATE = register(dataclasses.replace(
    WAN,
    name="wan-animate",
    class_names=("WanAnimateTransformer3DModel",),
    attention=AttentionSelector(class_names=("WanAttention", "WanAnimateFaceBlockCrossAttention")),
    sequence_processor=WanAnimateSequenceParallelProcessor,
    tensor_plan=TensorPlan(
        colwise=WAN.tensor_plan.colwise + ("face_adapter.*.to_q", "face_adapter.*.to_k", "face_adapter.*.to_v"),
        rowwise=WAN.tensor_plan.rowwise + ("face_adapter.*.to_out",),
        per_rank_attrs={**WAN.tensor_plan.per_rank_attrs, "face_adapter.*": ("heads", "inner_dim", "kv_inner_dim")},
        sharded_norms=WAN.tensor_plan.sharded_norms,
    ),
    batch_inputs=WAN.batch_inputs + ("pose_hidden_states", "face_pixel_values"),
    example_inputs=animate_example_inputs,
    layout=animate_layout,
    pipelines=("WanAnimatePipeline",),
    image_pipelines=(),
    synth_archs=(WAN_ANIMATE_14B, _WAN_ANIMATE_TINY),
    pp_refusal=_NOT_ONE_STACK.format(what="its face adapters' outputs are added to the video tokens"),
    cache_refusal=_NOT_ONE_STACK.format(what="its face adapters' outputs are added to the video tokens"),
))
