"""GLM-Image (``GlmImageTransformer2DModel``, GlmImagePipeline): CogView4's joint ``[text, image]`` blocks over the
glyph text and image tokens, the image tokens shifted by the autoregressive prior's tokens.

Where the tokens are: ``forward`` builds the image's RoPE table (``rope``: cos and sin ``[N, D]``), patchifies the
latents (``image_projector``), projects the glyph text (``glyph_projector``) and the prior's token embeddings
(``prior_projector``, one per image token), adds the prior to the image, runs the blocks and projects the image. The
sequence plan splits the three projectors' outputs (image, text, prior with the image) and the RoPE table, and gathers
at ``proj_out``; a prior of one token (``[B, D]``, diffusers' test inputs) stays whole. Attention: CogView4's processor
(the image rows of the local tokens rotated, the text mask's whole ``[N, N]`` 0/1 score matrix built from the global
lengths and reordered like the keys by ``sp.attention``).

The pipeline's condition-image K/V cache (image-to-image: a written pass over the condition images, read in the
prompt's call) is refused under sequence parallelism in one line; text-to-image passes an empty cache, which changes
nothing. Tensor plan: CogView4's: 3 all-reduces a block. CFG: the prompt's call, then the negative prompt's.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import BlockList, Gather, Layout, SequencePlan, Split, SynthArch, register, spatial_latent, transformer_only
from .cogview4 import COGVIEW4_ADAPTER, CogView4SequenceParallelProcessor, cogview4_modulated_input


class GlmImageSequenceParallelProcessor(CogView4SequenceParallelProcessor):
    """CogView4's processor with GLM-Image's K/V cache argument: an empty cache (text-to-image) or one in ``skip``
    mode runs; one holding condition images' keys, or being written, is refused."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                 kv_cache=None):
        if kv_cache is not None and (kv_cache.mode == "write" or (kv_cache.mode == "read" and kv_cache.k_caches)):
            raise NotImplementedError("GLM-Image's condition-image K/V cache (image-to-image) does not run under "
                                      "sequence parallelism yet: run text-to-image, or image-to-image with cfg or tp")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def glm_image_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one GlmImagePipeline text-to-image step: latents 8x smaller, the glyph encoder's states,
    one prior token per image token (2x2 patches), the timestep and the SDXL-style size conditions."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    tokens = (height // 8 // cfg.patch_size) * (width // 8 // cfg.patch_size)
    size = torch.tensor([[height, width]] * batch, dtype=dtype, device=device)
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
                encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
                prior_token_id=torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (batch, tokens),
                                             generator=generator).to(device),
                # on the host: the model drops prior tokens by boolean indexing, which the planner's meta device
                # cannot (a host mask indexes a tensor on any device)
                prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool),
                timestep=torch.full((batch,), 700.0).to(device, dtype), target_size=size,
                crop_coords=torch.zeros_like(size), return_dict=False)


def glm_image_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a GlmImagePipeline call: the VAE divides by 8, then 2x2 patches; text and image split
    together."""
    lh, lw = spatial_latent(height, width, 16, "GLM-Image (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 16), lh, lw))


# -- synthetic architectures ---------------------------------------------------------------------------------
GLM_IMAGE = SynthArch(
    name="glm-image",
    description="GLM-Image's diffusion transformer as diffusers' defaults (30 blocks, 64 heads x 40, glyph text 1472 "
                "wide, a 16384-token prior codebook), the transformer alone",
    pipeline="GlmImagePipeline",
    transformer_class="GlmImageTransformer2DModel",
    transformer=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=30, attention_head_dim=40,
                     num_attention_heads=64, text_embed_dim=1472, time_embed_dim=512, condition_dim=256,
                     prior_vq_quantizer_codebook_size=16384),
    vae={}, clip={}, t5={}, scheduler={},
    default_dtype="bfloat16",
    max_sequence_length=256,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_glm_image.py) with 2 blocks
GLM_IMAGE_TINY = dataclasses.replace(
    GLM_IMAGE,
    name="glm-image-tiny",
    description="GLM-Image at diffusers' test configuration (2 heads x 8, text width 32, a 64-token prior codebook) "
                "with 2 blocks; the transformer alone",
    transformer=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                     num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
                     prior_vq_quantizer_codebook_size=64),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=12,
)

_IMAGE = Split(dim=1, stream="image", ndim=3)

GLM_IMAGE_ADAPTER = register(dataclasses.replace(
    COGVIEW4_ADAPTER,
    name="glm-image",
    class_names=("GlmImageTransformer2DModel",),
    sequence_plan=SequencePlan(
        streams=("text", "image"),
        outputs={"image_projector": {None: _IMAGE}, "prior_projector": {None: _IMAGE},
                 "glyph_projector": {None: Split(dim=1, stream="text", ndim=3)},
                 "rope": {0: Split(dim=0, stream="image", ndim=2), 1: Split(dim=0, stream="image", ndim=2)}},
        gathers={"proj_out": Gather(dim=1, stream="image")},
    ),
    sequence_processor=GlmImageSequenceParallelProcessor,
    blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                      ("hidden_states", "encoder_hidden_states"), ("image", "text")),),
    modulated_input=cogview4_modulated_input,
    example_inputs=glm_image_example_inputs,
    layout=glm_image_layout,
    text_tokens=256,
    batch_inputs=("hidden_states", "encoder_hidden_states", "prior_token_id", "prior_token_drop", "timestep",
                  "target_size", "crop_coords", "attention_mask"),
    pipelines=("GlmImagePipeline",),
    synth_archs=(GLM_IMAGE_TINY, GLM_IMAGE),
    synth_components=transformer_only("GLM-Image", "its autoregressive vision-language model, ByT5 and its processor"),
    pp_refusal="PipeFusion is not tested on GLM-Image",
))
