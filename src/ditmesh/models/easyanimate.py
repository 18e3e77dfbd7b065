"""EasyAnimate (``EasyAnimateTransformer3DModel``; ``EasyAnimatePipeline`` and its control and inpaint forms): joint
attention over ``[text, video]``, its first ``mmdit_layers`` blocks with the text's own projections (MMDiT), the rest
with shared ones.

Where the tokens are: ``forward`` builds the 3-D RoPE table of the video (``rope_embedding``: cos and sin ``[N, D]``),
patchifies each frame (``proj``) and flattens to ``[B, N, D]``, projects the text, runs the blocks over both streams
and unpatchifies after ``proj_out``. The sequence plan splits the RoPE table at its module's output, the video and the
text (each on its own) at the first block, and gathers the video at ``proj_out``.

Attention: HunyuanVideo's processor (``models/hunyuan_video.py``) with the text first: video and text projected by
their own linears in MMDiT blocks and by the same ones elsewhere, per-head QK-norms, the RoPE rotation on the video,
the softmax over the joint sequence through ``sp.attention`` (no mask). CFG: batched (``[uncond, cond]`` in one call).
Tensor plan: Q/K/V and the text's projections column-, the outputs and feed-forwards row-parallel (4 all-reduces an
MMDiT block); a checkpoint with shared-projection blocks is refused under tp (their text attention output has no
output projection to sum the heads' shares).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent, temporal_latent)
from .hunyuan_video import HunyuanVideoSequenceParallelProcessor


class EasyAnimateSequenceParallelProcessor(HunyuanVideoSequenceParallelProcessor):
    """HunyuanVideo's joint-attention processor over ``[text, video]``."""

    text_first = True


def easyanimate_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one EasyAnimatePipeline step: latents of ``(frames - 1) // 4 + 1`` latent frames 8x
    smaller (default 49 frames), the Qwen2-VL text (``text_len`` tokens)."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, cfg.in_channels, ((frames or 49) - 1) // 4 + 1, height // 8, width // 8),
                timestep=torch.full((batch,), 700.0).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim), return_dict=False)


def easyanimate_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an EasyAnimate call: 8x spatial and 4x temporal VAE, ``patch_size`` patches per frame; text and
    video both split (joint attention)."""
    p = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * p, f"EasyAnimate (8x VAE, {p}x{p} patches)")
    latent_frames = temporal_latent(frames, 4, "EasyAnimate's 4x temporal VAE")
    video = latent_frames * (lh // p) * (lw // p)
    return Layout(video, text_tokens, video + text_tokens, (config.get("in_channels", 16), latent_frames, lh, lw))


def easyanimate_unsupported(model, config) -> str | None:
    """Tensor parallelism over a checkpoint with shared-projection blocks: their text attention output joins the text
    stream without an output projection, so it would stay split by heads."""
    mmdit, layers = model.config.mmdit_layers, model.config.num_layers
    if config.tp > 1 and mmdit < layers:
        return (f"EasyAnimate's shared-projection blocks (mmdit_layers={mmdit} of num_layers={layers}) add the text's "
                f"attention output with no output projection, which tp={config.tp} leaves split by heads; use ulysses, "
                f"ring, cfg or dp")
    return None


_BLOCK = "transformer_blocks.*"

EASYANIMATE_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"{_BLOCK}.attn1.{proj}" for proj in ("to_q", "to_k", "to_v", "add_q_proj?", "add_k_proj?",
                                                         "add_v_proj?"))
    + (f"{_BLOCK}.ff.net.0.proj", f"{_BLOCK}.txt_ff.net.0.proj?"),
    rowwise=(f"{_BLOCK}.attn1.to_out.0", f"{_BLOCK}.attn1.to_add_out?", f"{_BLOCK}.ff.net.2", f"{_BLOCK}.txt_ff.net.2?"),
    per_rank_attrs={f"{_BLOCK}.attn1": ("heads",)},
)

# -- synthetic architectures ---------------------------------------------------------------------------------
EASYANIMATE_V5 = SynthArch(
    name="easyanimate-v5.1-12b",
    description="EasyAnimateV5.1-12B transformer (48 blocks, 48 heads x 64, MMDiT text projections throughout), the "
                "Magvit VAE, a two-layer Qwen2-VL of Qwen2-VL-7B's width",
    pipeline="EasyAnimatePipeline",
    transformer_class="EasyAnimateTransformer3DModel",
    transformer=dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2,
                     sample_width=84, sample_height=84, time_embed_dim=512, text_embed_dim=3584, num_layers=48,
                     mmdit_layers=48, time_position_encoding_type="3d_rope", timestep_activation_fn="silu",
                     after_norm=False, resize_inpaint_mask_directly=True, enable_text_attention_mask=True,
                     add_noise_in_inpaint_model=True),
    vae={},  # AutoencoderKLMagvit's defaults: EasyAnimate's VAE
    clip={},
    # two layers: the pipeline reads the last hidden state but one
    t5=dict(text=dict(hidden_size=3584, intermediate_size=64, num_hidden_layers=2, num_attention_heads=28,
                      num_key_value_heads=4, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                           "type": "default"}),
            vision=dict(depth=1, embed_dim=32, hidden_size=3584, num_heads=2)),
    scheduler={},
    default_dtype="bfloat16",
    default_size=(512, 512),
    max_sequence_length=256,
    default_frames=49,
)

#: diffusers' test configuration of the class (2 heads x 16, 2 blocks, both MMDiT)
EASYANIMATE_TINY = dataclasses.replace(
    EASYANIMATE_V5,
    name="easyanimate-tiny",
    description="EasyAnimate shrunk for CPU tests: diffusers' test config (2 MMDiT blocks, 2 heads x 16), a tiny "
                "Magvit VAE (diffusers' pipeline test's) and Qwen2-VL",
    transformer=dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2, num_layers=2,
                     out_channels=4, patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16,
                     time_embed_dim=8, time_position_encoding_type="3d_rope", timestep_activation_fn="silu"),
    vae=dict(block_out_channels=[8, 8, 8, 8], latent_channels=4, layers_per_block=1, norm_num_groups=2,
             spatial_group_norm=False),
    t5=dict(text=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default",
                                                         "type": "default"}),
            vision=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2)),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=16,
    default_frames=5,
)

def easyanimate_components(arch: SynthArch, kit) -> dict:
    """EasyAnimatePipeline's other components: AutoencoderKLMagvit (``arch.vae``) and a Qwen2-VL text encoder with a
    local Qwen2 tokenizer and chat template (EasyAnimate V5.1's; V5's BERT and T5 pair is not built)."""
    import diffusers

    from .qwenimage import qwen25vl_text_encoder

    return dict(vae=kit.make(diffusers.AutoencoderKLMagvit, arch.vae, 1), **qwen25vl_text_encoder(arch, kit, "Qwen2VL"))


def easyanimate_call_arguments(pipe, kwargs: dict) -> dict:
    """An empty negative prompt unless one is given: EasyAnimatePipeline iterates over its negative prompt under CFG,
    a missing one too (the other pipelines take a missing one as empty)."""
    return {"negative_prompt": "", **kwargs}


EASYANIMATE = register(
    ModelAdapter(
        name="easyanimate",
        class_names=("EasyAnimateTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "video"),
            inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            outputs={"rope_embedding": {0: Split(dim=0, stream="video", ndim=2), 1: Split(dim=0, stream="video", ndim=2)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=(f"{_BLOCK}.attn1",)),
        sequence_processor=EasyAnimateSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states"), ("video", "text")),),
        example_inputs=easyanimate_example_inputs,
        layout=easyanimate_layout,
        text_tokens=256,
        tensor_plan=EASYANIMATE_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_t5",
                      "inpaint_latents", "control_latents"),
        cfg_mode="batched",
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,
        fps=8,
        pipelines=("EasyAnimatePipeline", "EasyAnimateControlPipeline", "EasyAnimateInpaintPipeline"),
        synth_archs=(EASYANIMATE_V5, EASYANIMATE_TINY),
        synth_components=easyanimate_components,
        call_arguments=easyanimate_call_arguments,
        unsupported=easyanimate_unsupported,
        pp_refusal="PipeFusion is not tested on it",
    )
)
