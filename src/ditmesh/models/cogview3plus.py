"""CogView3-Plus (``CogView3PlusTransformer2DModel``, ``CogView3PlusPipeline``): CogVideoX's joint attention over an
image.

``forward`` embeds text and image patches together (``patch_embed``: ``[text, image]`` with the image's positional
embedding added), cuts them apart again, runs the blocks (each normalizes and modulates both streams, attends over
``cat([text, image])`` through diffusers' ``CogVideoXAttnProcessor2_0`` and runs the feed-forward on both) and
unpatchifies ``proj_out``'s output. So CogVideoX's processor and tensor plan serve it (the same module names); the
sequence plan splits the image (``hidden_states``) and the text (``encoder_hidden_states``) at the input of
``transformer_blocks.0``, each on its own stream, and gathers ``proj_out``'s output. No mask, no RoPE. CFG: one call on
``[uncond, cond]`` (batched).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch, register,
                   spatial_latent, vae_and_t5)
from .cogvideox import COGVIDEOX_TENSOR_PLAN, CogVideoXSequenceParallelProcessor
from .flux import FLUX_VAE


def cogview3plus_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one CogView3PlusPipeline step: latents 8x smaller than the image, ``text_len`` T5 tokens,
    SDXL-like size conditioning."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    size = torch.tensor([[height, width]] * batch, dtype=dtype, device=device)
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
                encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
                timestep=torch.full((batch,), 700.0).to(device, dtype), original_size=size, target_size=size,
                crop_coords=torch.zeros(batch, 2, dtype=dtype, device=device), return_dict=False)


def cogview3plus_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a CogView3PlusPipeline call: the VAE divides by 8, 2x2 patches become one token."""
    lh, lw = spatial_latent(height, width, 16, "CogView3-Plus (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 16), lh, lw))


#: the 16-channel AutoencoderKL CogView3-Plus decodes with (no latent shift, no quant convs)
_VAE = dict(FLUX_VAE, scaling_factor=1.0, shift_factor=None)
#: the v-prediction DDIM scheduler CogView3-Plus-3B ships (zero terminal SNR, trailing timesteps)
_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  prediction_type="v_prediction", rescale_betas_zero_snr=True, snr_shift_scale=4.0,
                  timestep_spacing="trailing", clip_sample=False, set_alpha_to_one=True)

COGVIEW3PLUS = SynthArch(
    name="cogview3plus",
    description="CogView3-Plus-3B transformer as diffusers' defaults (30 blocks, 64 heads x 40, text width 4096), a "
                "16-channel AutoencoderKL, a one-layer T5-XXL-wide encoder",
    pipeline="CogView3PlusPipeline",
    transformer_class="CogView3PlusTransformer2DModel",
    transformer=dict(patch_size=2, in_channels=16, num_layers=30, attention_head_dim=40, num_attention_heads=64,
                     out_channels=16, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                     pos_embed_max_size=128, sample_size=128),
    vae=_VAE, clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
    scheduler=_SCHEDULER,
    scheduler_class="CogVideoXDDIMScheduler",
    default_dtype="bfloat16",
    max_sequence_length=224,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_cogview3plus.py): 2 blocks, 2
#: heads of 4, text width 8, positions for up to 8 x 8 patches
COGVIEW3PLUS_TINY = dataclasses.replace(
    COGVIEW3PLUS, name="cogview3plus-tiny",
    description="CogView3-Plus at diffusers' test configuration: 2 blocks, 2 heads x 4, text width 8; a tiny VAE and "
                "T5",
    transformer=dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
                     out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=8,
                     sample_size=8),
    vae=dict(_VAE, latent_channels=4, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8,
             sample_size=64),
    t5=dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


COGVIEW3PLUS_ADAPTER = register(
    ModelAdapter(
        name="cogview3plus",
        class_names=("CogView3PlusTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="image", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the class has no _cp_plan; text and image split where the blocks start (the patch "
                                 "embedding takes them together), each on its own stream",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1",)),
        sequence_processor=CogVideoXSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states"), ("image", "text")),),
        token_wise=("transformer_blocks.*.ff",),
        example_inputs=cogview3plus_example_inputs,
        layout=cogview3plus_layout,
        text_tokens=224,
        tensor_plan=COGVIDEOX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                      "crop_coords"),
        cfg_mode="batched",  # one call on [uncond, cond]
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("CogView3PlusPipeline",),
        synth_archs=(COGVIEW3PLUS_TINY, COGVIEW3PLUS),
        synth_components=vae_and_t5("AutoencoderKL"),
    )
)
