"""CogView4 (``CogView4Transformer2DModel``, ``CogView4Pipeline``): joint text+image attention with RoPE on the image
tokens only.

Each block concatenates ``[text, image]`` inside its attention and rotates only the image part (its 2-D RoPE table
covers the image tokens). The transformer takes the latents as ``[B, C, H, W]`` and patchifies them itself, so the
sequence plan splits after the patch embedding: its two outputs (image tokens, text tokens) are each cut into
contiguous chunks over the sequence-parallel ranks, the RoPE table with the image tokens, and ``proj_out``'s output
is gathered once. The processor rotates the local image tokens (the part after the local text tokens) with their own
rows of the table, so every rank's queries and keys equal the one-process model's.

An ``attention_mask`` (``[B, text]``, 1 for a prompt token) is optional in the model (``CogView4Pipeline`` passes
none: its padding tokens attend like the others). Where one is given, the processor builds the model's floating
``[B, 1, N, N]`` mask over the whole ``[text, image]`` sequence (``m_q * m_k``, added to the scores, as diffusers'
processor does) and hands it to ``sp.attention``, which reorders it like the keys.

Tensor plan: Q/K/V and the feed-forward's first linear column-parallel, the attention output and the feed-forward's
second linear row-parallel; the QK LayerNorms act per head. The feed-forward is shared by the two streams and runs
once for each, so a block issues 3 all-reduces. CFG: ``CogView4Pipeline`` calls the transformer for the prompt, then for the negative prompt,
when ``guidance_scale > 1`` (sequential).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch, \
    TensorPlan, register, spatial_latent
from .flux import KL_VAE_PLAN


class CogView4SequenceParallelProcessor:
    """Attention processor for CogView4's blocks whose core attention runs sequence-parallel.

    The projections, the per-head LayerNorms and the rotation of the image tokens follow diffusers'
    ``CogView4AttnProcessor`` on the local tokens; the attention goes through ``sp.attention``."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        dtype = encoder_hidden_states.dtype
        text_len = encoder_hidden_states.shape[1]  # this rank's text tokens
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        q, k, v = (proj(x).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q).to(dtype=dtype)
        if attn.norm_k is not None:
            k = attn.norm_k(k).to(dtype=dtype)
        if image_rotary_emb is not None:  # the image tokens only, with this rank's rows of the table
            q[:, text_len:] = apply_rotary_emb(q[:, text_len:], image_rotary_emb, use_real_unbind_dim=-2,
                                               sequence_dim=1)
            k[:, text_len:] = apply_rotary_emb(k[:, text_len:], image_rotary_emb, use_real_unbind_dim=-2,
                                               sequence_dim=1)
        mask = None if attention_mask is None else self._score_mask(attention_mask, q.dtype)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=mask)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        return image_out, text_out

    def _score_mask(self, text_mask: torch.Tensor, dtype) -> torch.Tensor:
        """The model's ``[B, 1, N, N]`` floating mask over the whole ``[text, image]`` sequence (global order)."""
        image_len = sum(self.sp.ctx.stream_sizes["image"])
        keep = torch.ones(text_mask.shape[0], text_mask.shape[1] + image_len, device=text_mask.device)
        keep[:, : text_mask.shape[1]] = text_mask.float()
        keep = keep.unsqueeze(2)
        return ((keep @ keep.transpose(1, 2)) > 0).unsqueeze(1).to(dtype)


def cogview4_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first block's modulated image stream (``norm1`` returns it first)."""
    return block.norm1(named["hidden_states"], named["encoder_hidden_states"], named["temb"])[0]


def cogview4_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one CogView4Pipeline denoising step (random latents and text embeddings)."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    size = torch.tensor([[height, width]] * batch, dtype=dtype, device=device)
    return dict(
        hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
        encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        original_size=size, target_size=size, crop_coords=torch.zeros_like(size),
        return_dict=False,
    )


def cogview4_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a CogView4Pipeline call: the VAE divides by 8, then 2x2 patches become one token."""
    lh, lw = spatial_latent(height, width, 16, "CogView4 (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 16), lh, lw))


COGVIEW4_TENSOR_PLAN = TensorPlan(
    colwise=("transformer_blocks.*.attn1.to_q", "transformer_blocks.*.attn1.to_k", "transformer_blocks.*.attn1.to_v",
             "transformer_blocks.*.ff.net.0.proj"),
    rowwise=("transformer_blocks.*.attn1.to_out.0", "transformer_blocks.*.ff.net.2"),
    per_rank_attrs={"transformer_blocks.*.attn1": ("heads",)},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: CogView4-6B's VAE: a KL autoencoder with 16 latent channels, no quant convolutions
COGVIEW4_VAE = dict(
    in_channels=3, out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 512, 1024, 1024], layers_per_block=3, latent_channels=16, norm_num_groups=32,
    sample_size=1024, scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
)

COGVIEW4_SCHEDULER = dict(base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True,
                          time_shift_type="linear")

COGVIEW4 = SynthArch(
    name="cogview4",
    description="CogView4-6B transformer (28 blocks, 32 heads x 128, 6.4B params); a one-layer GLM text encoder of "
                "GLM-4's width",
    pipeline="CogView4Pipeline",
    transformer_class="CogView4Transformer2DModel",
    transformer=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=28, attention_head_dim=128,
                     num_attention_heads=32, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                     pos_embed_max_size=128, sample_size=128, rope_axes_dim=(256, 256)),
    vae=COGVIEW4_VAE,
    clip={},
    t5={},
    extra=dict(glm=dict(hidden_size=4096, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=32,
                        num_key_value_heads=2, head_dim=128)),
    scheduler=COGVIEW4_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=1024,
)

COGVIEW4_TINY = dataclasses.replace(
    COGVIEW4,
    name="cogview4-tiny",
    description="CogView4 architecture shrunk for CPU tests: 2 blocks, 4 heads x 8",
    transformer=dict(COGVIEW4.transformer, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                     num_attention_heads=4, text_embed_dim=32, time_embed_dim=16, condition_dim=4,
                     pos_embed_max_size=16, sample_size=16, rope_axes_dim=(16, 16)),
    vae=dict(COGVIEW4_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, latent_channels=4,
             norm_num_groups=8, sample_size=64),
    extra=dict(glm=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8)),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)


def cogview4_components(arch: SynthArch, kit) -> dict:
    """CogView4Pipeline's other components: AutoencoderKL and a GLM text encoder (its second-to-last hidden state
    feeds the transformer) with a tokenizer built locally."""
    import diffusers
    import transformers

    tokenizer = kit.t5_tokenizer(arch.max_sequence_length)
    glm = transformers.GlmConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                 max_position_embeddings=max(2048, arch.max_sequence_length), **arch.extra["glm"])
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(transformers.GlmModel, glm, 3), tokenizer=tokenizer)


COGVIEW4_ADAPTER = register(
    ModelAdapter(
        name="cogview4",
        class_names=("CogView4Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            outputs={"patch_embed": {0: Split(dim=1, stream="image", ndim=3), 1: Split(dim=1, stream="text", ndim=3)},
                     "rope": {0: Split(dim=0, stream="image", ndim=2), 1: Split(dim=0, stream="image", ndim=2)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1",)),
        sequence_processor=CogView4SequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states")),),
        token_wise=("transformer_blocks.*.ff",),
        modulated_input=cogview4_modulated_input,
        example_inputs=cogview4_example_inputs,
        layout=cogview4_layout,
        text_tokens=224,  # the GLM prompt, padded to a multiple of 16 (padding="longest")
        tensor_plan=COGVIEW4_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                      "crop_coords", "attention_mask"),
        cfg_mode="sequential",  # CogView4Pipeline calls the transformer for the prompt, then the negative prompt
        cfg_switch="guidance_scale",
        cfg_hint="--guidance > 1 (e.g. --guidance 5)",
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("CogView4Pipeline",),
        synth_archs=(COGVIEW4_TINY, COGVIEW4),
        synth_components=cogview4_components,
        vae=KL_VAE_PLAN,
    )
)
