"""SkyReels-V2 (``SkyReelsV2Transformer3DModel``): Wan's architecture with diffusion forcing.

The blocks, attentions, RoPE, VAE and text encoder are Wan 2.1's (``models/wan.py``), so the processor, the tensor
plan, the layout, the VAE plan and the synthetic components are Wan's. Two things differ, both from diffusion
forcing (``SkyReelsV2DiffusionForcingPipeline``, ``enable_diffusion_forcing=True``):

- **Per-frame timesteps.** ``timestep`` is ``[B, F]``, one value per latent frame. The model embeds it per frame and
  repeats each frame's embedding over that frame's ``H x W`` tokens inside ``forward``: the blocks get ``temb`` as
  ``[B, 6, N, D]`` (one modulation per token) and the final norm a ``[B, N, D]`` shift and scale. The timestep
  itself stays whole (a frame's tokens may lie on two ranks); the plan splits the blocks' per-token ``temb`` along
  its token dim (2) at every block, with the video tokens, and gathers the tokens at the output of ``norm_out`` (a
  per-token LayerNorm), so the final modulation and ``proj_out`` run on the whole sequence with the whole per-token
  shift and scale. One timestep per sample (``[B]``: the T2V and I2V pipelines) gives ``temb`` ``[B, 6, D]``, which
  stays whole.
- **A block-causal mask** (``num_frame_per_block`` > 1, the pipelines' ``causal_block_size``): a boolean
  ``[1, 1, N, N]`` mask over the video tokens, each block of frames attending to itself and the blocks before it.
  The self-attention passes it to ``sp.attention`` in the model's order; sequence parallelism reorders it like the
  keys (one stream: the ranks' order is the model's) and cuts its query rows where the queries are local (ring).

The gather at ``norm_out`` moves ``D``-wide tokens instead of ``proj_out``'s ``4 x 16``-wide ones, once per call:
about ``P / 4`` of one layer's Ulysses all-to-alls of degree ``P``.

``fps`` (``inject_sample_info``, the 1.3B DF checkpoint) is one embedding per sample added to every token's
modulation: replicated, as the model computes it.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, ModelAdapter, SequencePlan, Split, register)
from .wan import (_WAN_TINY, WAN21_14B, WAN_TENSOR_PLAN, WAN_VAE_PLAN, WanSequenceParallelProcessor, wan_components,
                  wan_layout)


def skyreels_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one SkyReelsV2DiffusionForcingPipeline step: random latents and text embeddings, a
    timestep per latent frame (each frame at its own noise level, as asynchronous diffusion forcing runs them) and
    the 24 fps flag where the checkpoint takes it. ``frames`` (default 97) become ``(frames - 1) // 4 + 1`` latent
    frames; height and width shrink 8x."""
    cfg = model.config
    latent_frames = ((frames or 97) - 1) // 4 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    inputs = dict(
        hidden_states=rand(batch, cfg.in_channels, latent_frames, height // 8, width // 8),
        timestep=torch.linspace(999.0, 500.0, latent_frames).expand(batch, -1).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.text_dim),
        enable_diffusion_forcing=True,
        return_dict=False,
    )
    if cfg.inject_sample_info:
        inputs["fps"] = [1] * batch  # the pipeline's flag: 0 for 16 fps, 1 otherwise
    if cfg.image_dim:  # image-to-video: the condition image's 257 CLIP tokens, one timestep per sample
        inputs.update(encoder_hidden_states_image=rand(batch, 257, cfg.image_dim), enable_diffusion_forcing=False,
                      timestep=torch.full((batch,), 700.0).to(device, dtype))
    return inputs


def skyreels_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of a SkyReels-V2 block's self-attention: ``norm1`` shifted and scaled by the block's modulation,
    per token under diffusion forcing (``temb`` ``[B, 6, N, D]``, here this rank's tokens), else per sample
    (``[B, 6, D]``)."""
    temb = named["temb"].float()
    if temb.ndim == 4:
        shift, scale = (block.scale_shift_table.unsqueeze(2) + temb)[:, :2].unbind(1)
    else:
        shift, scale = (block.scale_shift_table + temb)[:, :2].unbind(1)
        shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
    hidden = named["hidden_states"]
    return (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)


# -- synthetic architectures ---------------------------------------------------------------------------------
SKYREELS_V2_DF_14B = dataclasses.replace(
    WAN21_14B,
    name="skyreels-v2-df-14b",
    description="SkyReels-V2-DF-14B-540P transformer (Wan2.1-14B's: 40 blocks, 40 heads x 128, FFN 13824; diffusion "
                "forcing), full Wan VAE, small UMT5",
    pipeline="SkyReelsV2DiffusionForcingPipeline",
    transformer_class="SkyReelsV2Transformer3DModel",
    transformer=dict(WAN21_14B.transformer, inject_sample_info=False),
    scheduler=dict(WAN21_14B.scheduler, flow_shift=8.0),  # SkyReels' shift for text-to-video
    default_size=(544, 960),
    default_frames=97,
)

_SKYREELS_TINY = dataclasses.replace(
    _WAN_TINY,
    name="skyreels-v2-tiny",
    description="SkyReels-V2 DF architecture shrunk for CPU tests: wan-tiny's 2 blocks of 6 heads x 16, tiny Wan VAE",
    pipeline=SKYREELS_V2_DF_14B.pipeline,
    transformer_class=SKYREELS_V2_DF_14B.transformer_class,
    transformer=dict(_WAN_TINY.transformer, inject_sample_info=False),
    scheduler=SKYREELS_V2_DF_14B.scheduler,
    default_frames=9,
)

SKYREELS_ARCHS = (
    SKYREELS_V2_DF_14B,
    dataclasses.replace(
        SKYREELS_V2_DF_14B,
        name="skyreels-v2-df-1.3b",
        description="SkyReels-V2-DF-1.3B-540P transformer (30 blocks, 12 heads x 128, FFN 8960, fps conditioning), "
                    "full Wan VAE, small UMT5",
        transformer=dict(SKYREELS_V2_DF_14B.transformer, num_attention_heads=12, ffn_dim=8960, num_layers=30,
                         inject_sample_info=True),
    ),
    _SKYREELS_TINY,
    # SkyReels-V2-I2V: Wan 2.1 I2V's layout (36 channels in: noise, first-frame mask, encoded image; attn2 also
    # cross-attends to the image's CLIP tokens through add_k_proj / add_v_proj); its processor takes the text as the
    # last 512 context tokens
    dataclasses.replace(
        _SKYREELS_TINY,
        name="skyreels-v2-i2v-tiny",
        description="SkyReels-V2 I2V layout shrunk for CPU tests: skyreels-v2-tiny reading 36 channels and "
                    "cross-attending to 257 image tokens of 32 (a tiny CLIP vision encoder), SkyReelsV2ImageToVideoPipeline",
        pipeline="SkyReelsV2ImageToVideoPipeline",
        transformer=dict(_SKYREELS_TINY.transformer, in_channels=36, image_dim=32, added_kv_proj_dim=96),
        clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=16),
        max_sequence_length=512,
    ),
    dataclasses.replace(
        _SKYREELS_TINY,
        name="skyreels-v2-tiny-fps",
        description="skyreels-v2-tiny with the 1.3B checkpoint's fps conditioning (inject_sample_info)",
        transformer=dict(_SKYREELS_TINY.transformer, inject_sample_info=True),
    ),
)


SKYREELS_V2 = register(
    ModelAdapter(
        name="skyreels-v2",
        class_names=("SkyReelsV2Transformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            # diffusion forcing's per-token modulation [B, 6, N, D] is cut at every block (the model builds it
            # whole inside forward); one per sample, [B, 6, D], stays whole
            inputs={"blocks.*": {"temb": Split(dim=2, stream="video", ndim=4)},
                    "blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}},
            outputs={"rope": {0: Split(dim=1, stream="video", ndim=4), 1: Split(dim=1, stream="video", ndim=4)}},
            gathers={"norm_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(class_names=("SkyReelsV2Attention",)),
        sequence_processor=WanSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("blocks.*.ffn",),
        modulated_input=skyreels_modulated_input,
        example_inputs=skyreels_example_inputs,
        layout=wan_layout,
        text_tokens=512,  # umT5, cross-attention only
        tensor_plan=WAN_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        cfg_mode="sequential",  # its pipelines call the transformer once for cond, once for uncond
        output_channel_dim=1,
        fuse_qkv=True,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,  # the Wan VAE compresses time 4x: 4k+1 frames
        fps=24,  # SkyReels-V2 is trained on 24 fps clips
        pipelines=("SkyReelsV2DiffusionForcingPipeline", "SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline",
                   "SkyReelsV2DiffusionForcingImageToVideoPipeline", "SkyReelsV2DiffusionForcingVideoToVideoPipeline"),
        synth_archs=SKYREELS_ARCHS,
        synth_components=wan_components,
        vae=WAN_VAE_PLAN,
    )
)
