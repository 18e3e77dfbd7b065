"""HunyuanImage 2.1 (``HunyuanImageTransformer2DModel``, ``HunyuanImagePipeline`` and its refiner pipeline): HunyuanVideo's
transformer over an image.

The same layout as HunyuanVideo (``models/hunyuan_video.py``): the RoPE table of the image tokens from the latent's
shape (``rope``), a patch embedding, a token refiner over the whole text (``context_embedder``, its own self-attention),
a key mask ``[B, 1, 1, image + text]`` that drops each prompt's padding, dual-stream and single-stream blocks over
``[image, text]`` whose attention rotates the image tokens only, and ``proj_out`` before the unpatchify. Beyond it:
a second text stream (ByT5 glyph embeddings, ``encoder_hidden_states_2``) that ``forward`` interleaves with the first
per sample (valid tokens first) before the blocks, which the plan's split at the input of ``transformer_blocks.0``
takes as it is, and a 2-D (image) or 3-D (the refiner pipeline's latent) patch. So HunyuanVideo's adapter serves it:
its sequence plan with ``image`` for ``video``, its processor (the single blocks hand image and text apart), FLUX.1's
tensor plan. CFG: the pipelines' guiders run the conditional call, then the unconditional one (sequential).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import Gather, Layout, SequencePlan, Split, SynthArch, register, spatial_latent
from .hunyuan_variants import byt5_encoder
from .hunyuan_video import HUNYUAN_VIDEO_ADAPTER


def hunyuan_image_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one HunyuanImagePipeline step: latents 32x smaller than the image (HunyuanImage's VAE), the
    Qwen2.5-VL text embeddings with a mask of ones; with a glyph encoder (``text_embed_2_dim``) ByT5 embeddings of 8
    tokens whose last 3 are padding; distilled guidance where the checkpoint takes it."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    inputs = dict(
        hidden_states=rand(batch, cfg.in_channels, height // 32, width // 32),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
        encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.int64, device=device),
        return_dict=False,
    )
    if cfg.text_embed_2_dim:
        glyph_mask = torch.ones(batch, 8, dtype=torch.int64, device=device)
        glyph_mask[:, 5:] = 0
        inputs.update(encoder_hidden_states_2=rand(batch, 8, cfg.text_embed_2_dim), encoder_attention_mask_2=glyph_mask)
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3250.0).to(device, dtype)
    return inputs


def hunyuan_image_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a HunyuanImagePipeline call: the VAE divides by 32, one token per latent pixel (2048 x 2048:
    4,096 image tokens); the text is the Qwen prompt (and the glyph tokens, when the prompt has any)."""
    spatial_latent(height, width, 32, "HunyuanImage (32x VAE)")
    image = (height // 32) * (width // 32)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 64), height // 32, width // 32))


def hunyuan_image_meta_trace(model: torch.nn.Module):
    """Make ``model`` traceable on the meta device for the planner: the glyph stream is left out (``forward`` interleaves
    it with the text by each sample's mask, which the meta device cannot read; it adds a few dozen text tokens to a
    prompt of up to 1,000). Returns the undo callable."""
    glyph = model.context_embedder_2
    model.context_embedder_2 = None

    def undo() -> None:
        model.context_embedder_2 = glyph

    return undo


HUNYUAN_IMAGE = SynthArch(
    name="hunyuan-image-2.1",
    description="HunyuanImage 2.1 transformer (20 dual + 40 single blocks, 28 heads x 128, 2 refiner blocks, text width "
                "3584, ByT5 glyph stream 1472), its 32x VAE, a three-layer Qwen2.5-VL of Qwen2.5-VL-7B's width, a one-layer "
                "ByT5-small, the adaptive projected guider",
    pipeline="HunyuanImagePipeline",
    transformer_class="HunyuanImageTransformer2DModel",
    transformer=dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, patch_size=[1, 1], text_embed_dim=3584,
                     text_embed_2_dim=1472, rope_axes_dim=[64, 64], guidance_embeds=False),
    vae=dict(in_channels=3, out_channels=3, latent_channels=64, block_out_channels=[128, 256, 512, 512, 1024, 1024],
             layers_per_block=2, spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289),
    clip={},
    # three layers: the pipeline reads the hidden state two layers before the last
    t5=dict(text=dict(hidden_size=3584, intermediate_size=64, num_hidden_layers=3, num_attention_heads=28,
                      num_key_value_heads=4, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                           "type": "default"}),
            vision=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=3584)),
    extra=dict(byt5=dict(d_model=1472, d_kv=64, d_ff=64, num_layers=1, num_heads=6)),
    scheduler=dict(num_train_timesteps=1000, shift=4.0),
    default_dtype="bfloat16",
    default_size=(2048, 2048),
    max_sequence_length=1000,
)

#: HunyuanVideo's tiny test sizes: 2 dual + 2 single blocks, 1 refiner block, 4 heads of 16, a glyph stream of 24
HUNYUAN_IMAGE_TINY = dataclasses.replace(
    HUNYUAN_IMAGE, name="hunyuan-image-tiny",
    description="HunyuanImage 2.1 shrunk for CPU tests: 2 dual + 2 single blocks, 1 refiner block, 4 heads x 16, a "
                "24-wide glyph stream; a tiny 32x VAE, Qwen2.5-VL and ByT5",
    transformer=dict(HUNYUAN_IMAGE.transformer, in_channels=4, out_channels=4, num_attention_heads=4,
                     attention_head_dim=16, num_layers=2, num_single_layers=2, num_refiner_layers=1, text_embed_dim=32,
                     text_embed_2_dim=24, rope_axes_dim=[8, 8]),
    vae=dict(HUNYUAN_IMAGE.vae, latent_channels=4, block_out_channels=[32] * 6, layers_per_block=1, sample_size=128),
    t5=dict(text=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=2, rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default",
                                                         "type": "default"}),
            vision=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)),
    extra=dict(byt5=dict(d_model=24, d_kv=8, d_ff=32, num_layers=1, num_heads=3)),
    default_dtype="float32", default_size=(128, 128), max_sequence_length=32)


def hunyuan_image_components(arch: SynthArch, kit) -> dict:
    """HunyuanImagePipeline's other components: AutoencoderKLHunyuanImage (``arch.vae``), a Qwen2.5-VL (``arch.t5``)
    with a local Qwen2 tokenizer, a ByT5 glyph encoder (``arch.extra["byt5"]``) and the adaptive projected guider at
    its defaults (CFG 3.5: two transformer calls a step). No OCR guider (optional): prompts with quoted text take the
    same guider."""
    import diffusers

    from .qwenimage import qwen25vl_text_encoder

    return dict(vae=kit.make(diffusers.AutoencoderKLHunyuanImage, arch.vae, 1), **qwen25vl_text_encoder(arch, kit),
                **byt5_encoder(arch, kit), guider=diffusers.AdaptiveProjectedMixGuidance(), ocr_guider=None)


HUNYUAN_IMAGE_ADAPTER = register(dataclasses.replace(
    HUNYUAN_VIDEO_ADAPTER,
    name="hunyuan-image",
    class_names=("HunyuanImageTransformer2DModel",),
    sequence_plan=SequencePlan(
        streams=("image", "text"),
        inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="image", ndim=3),
                                         "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
        outputs={"rope": {0: Split(dim=0, stream="image", ndim=2), 1: Split(dim=0, stream="image", ndim=2)}},
        gathers={"proj_out": Gather(dim=1, stream="image")},
        differs_from_cp_plan="the class has no _cp_plan; HunyuanVideo's split points, image and text on their own "
                             "streams, the text split after the glyph tokens are interleaved into it",
    ),
    example_inputs=hunyuan_image_example_inputs,
    layout=hunyuan_image_layout,
    text_tokens=1000,  # the Qwen prompt's max_sequence_length
    batch_inputs=("hidden_states", "timestep", "timestep_r", "encoder_hidden_states", "encoder_attention_mask",
                  "encoder_hidden_states_2", "encoder_attention_mask_2", "guidance"),
    cfg_switch="guidance_scale",
    cfg_hint="the pipeline's guider (guidance_scale > 1 on a non-distilled checkpoint)",
    frame_step=None,
    fps=16,
    pipelines=("HunyuanImagePipeline", "HunyuanImageRefinerPipeline"),
    synth_archs=(HUNYUAN_IMAGE_TINY, HUNYUAN_IMAGE),
    synth_components=hunyuan_image_components,
    unsupported=None,
    meta_trace=hunyuan_image_meta_trace,
    pp_refusal="HunyuanImage's attention always takes the padded-text key mask, which PipeFusion does not take",
))
