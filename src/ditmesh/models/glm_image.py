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

from .base import BlockList, Gather, Layout, SequencePlan, Split, SynthArch, register, spatial_latent
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
                "wide, a 16384-token prior codebook), a 16-channel KL VAE, a one-layer ByT5 glyph encoder and a "
                "two-layer autoregressive GLM-Image prior of GLM-4's width",
    pipeline="GlmImagePipeline",
    transformer_class="GlmImageTransformer2DModel",
    transformer=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=30, attention_head_dim=40,
                     num_attention_heads=64, text_embed_dim=1472, time_embed_dim=512, condition_dim=256,
                     prior_vq_quantizer_codebook_size=16384),
    vae=dict(block_out_channels=(128, 256, 512, 512), down_block_types=["DownEncoderBlock2D"] * 4,
             up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16, latents_mean=[0.0] * 16,
             latents_std=[1.0] * 16),
    clip={}, t5=dict(d_model=1472, d_kv=64, d_ff=64, num_layers=1, num_heads=2), scheduler={},
    extra=dict(prior=dict(text=dict(hidden_size=4096, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=128, rope_parameters={"mrope_section": (16, 24, 24)}),
                          vision=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32),
                          vq=dict(embed_dim=32, latent_channels=32))),
    default_dtype="bfloat16",
    max_sequence_length=256,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_glm_image.py) with 2 blocks
GLM_IMAGE_TINY = dataclasses.replace(
    GLM_IMAGE,
    name="glm-image-tiny",
    description="GLM-Image at diffusers' test configuration (2 heads x 8, text width 32, a 64-token prior codebook) "
                "with 2 blocks; its pipeline test's KL VAE and autoregressive prior, a one-layer ByT5",
    transformer=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                     num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
                     prior_vq_quantizer_codebook_size=64),
    vae=dict(block_out_channels=(4, 8, 16, 16), down_block_types=["DownEncoderBlock2D"] * 4,
             up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=4, norm_num_groups=4, latents_mean=[0.0] * 4,
             latents_std=[1.0] * 4),
    t5=dict(d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    extra=dict(prior=dict(text=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=2, rope_parameters={"mrope_section": (4, 2, 2)}),
                          vision=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32),
                          vq=dict(embed_dim=32, latent_channels=32))),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=12,
)

_IMAGE = Split(dim=1, stream="image", ndim=3)

#: the prior's chat template: GLM's prefix, each message's role and parts (an image part as its placeholder between
#: the image's start and end tokens), then the assistant's turn; the processor appends the target grids and the
#: image's start token
GLM_IMAGE_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% for part in m['content'] %}{% if part['type'] == "
    "'text' %}{{ part['text'] }}{% else %}<|begin_of_image|><|image|><|end_of_image|>{% endif %}{% endfor %}"
    "{% endfor %}<|assistant|>\n")


def glm_image_components(arch: SynthArch, kit) -> dict:
    """GlmImagePipeline's other components: a KL VAE (``arch.vae``), a ByT5 glyph encoder (``arch.t5``) with ByT5's
    byte tokenizer, and the autoregressive prior (``GlmImageForConditionalGeneration``, ``arch.extra["prior"]``) with
    its processor built locally: a byte-level BPE tokenizer knowing the processor's special tokens and
    :data:`GLM_IMAGE_CHAT_TEMPLATE`, and the PIL image processor (the default one needs torchvision).

    The prior's vision vocabulary is the transformer's prior codebook, and the first ids of the tokenizer's
    vocabulary (filler tokens where the words are fewer): every token the prior samples is a code the transformer
    embeds, never the image's end token (its end of sequence), so it writes exactly the grids' tokens."""
    import diffusers
    import transformers

    codebook = arch.transformer["prior_vq_quantizer_codebook_size"]
    vocab, merges = kit.byte_bpe(())
    vocab.update((f"<|code_{i}|>", i) for i in range(len(vocab), codebook))
    specials = dict(pad_token="<|endoftext|>", image_token="<|image|>", bos_token="<|begin_of_image|>",
                    eos_token="<|end_of_image|>", grid_bos_token="<|begin_of_grid|>", grid_eos_token="<|end_of_grid|>")
    for token in (*specials.values(), "[gMASK]", "<sop>", "<|user|>", "<|assistant|>"):
        vocab.setdefault(token, len(vocab))
    tokenizer = transformers.Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, **{k: specials[k] for k in ("pad_token", "bos_token", "eos_token")},
        extra_special_tokens={k: specials[k] for k in ("image_token", "grid_bos_token", "grid_eos_token")})
    processor = transformers.GlmImageProcessor(image_processor=transformers.GlmImageImageProcessorPil(),
                                               tokenizer=tokenizer, chat_template=GLM_IMAGE_CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids
    prior = arch.extra["prior"]
    config = transformers.GlmImageConfig(
        text_config=dict(prior["text"], vocab_size=len(vocab), vision_vocab_size=codebook, max_position_embeddings=8192,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=prior["vision"], vq_config=dict(prior["vq"], num_embeddings=codebook),
        image_token_id=ids(specials["image_token"]), image_start_token_id=tokenizer.bos_token_id,
        image_end_token_id=tokenizer.eos_token_id)
    byt5 = transformers.ByT5Tokenizer()
    glyph = transformers.T5Config(vocab_size=len(byt5), pad_token_id=0, eos_token_id=1, **arch.t5)
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), tokenizer=byt5, processor=processor,
                text_encoder=kit.make(transformers.T5EncoderModel, glyph, 3),
                vision_language_encoder=kit.make(transformers.GlmImageForConditionalGeneration, config, 4))

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
    synth_components=glm_image_components,
    pp_refusal="PipeFusion is not tested on GLM-Image",
))
