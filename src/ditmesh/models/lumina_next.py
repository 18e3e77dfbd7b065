"""Lumina-Next (``LuminaNextDiT2DModel``, ``LuminaPipeline``): image tokens with a self-attention and a gated
cross-attention to the text in every block.

``forward`` patchifies the latent (``patch_embedder``: the tokens, a mask of ones over them, the sizes, and the slice of
the pipeline's 2-D RoPE table for this grid), runs the blocks (``attn1``: self-attention over the image tokens with
RoPE on queries and keys and a softmax scale that grows with the sequence's length against the pipeline's
``base_sequence_length``; ``attn2``: the image queries, rotated, against the whole text; their outputs mixed and projected
by ``attn2.to_out``), and ``norm_out``, before it keeps the image's tokens and unpatchifies.

Sequence plan: the tokens and their RoPE rows split at ``patch_embedder``'s output (its mask of ones stays whole: the
self-attention's key mask, global order), ``norm_out``'s output gathered. The self-attention runs through
``sp.attention`` with the scale of the GLOBAL length (the model's processor reads the local one), applied to the
queries; the cross-attention keeps diffusers' processor (local queries, whole text). No tensor plan: the QK-norms are
LayerNorms across all heads. CFG: one call on ``[cond, uncond]`` (batched).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from diffusers.models.embeddings import apply_rotary_emb, get_2d_rotary_pos_embed_lumina

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   register, spatial_latent)
from .pixart import _SDXL_VAE


class LuminaNextSequenceParallelProcessor:
    """Processor for Lumina-Next's attention layers: ``attn1`` (keys rotated) sequence-parallel with the global
    length's softmax scale; ``attn2`` (no key rotation: the text) handed to the previous processor unchanged."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, base_sequence_length=None):
        if key_rotary_emb is None:  # the cross-attention to the whole text
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                 key_rotary_emb, base_sequence_length)
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = query.shape[-1] // attn.heads
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, key, value = (t.unflatten(-1, (-1, head_dim)) for t in (query, key, value))
        dtype = query.dtype
        query = apply_rotary_emb(query, query_rotary_emb, use_real=False).to(dtype)
        key = apply_rotary_emb(key, key_rotary_emb, use_real=False).to(dtype)
        if base_sequence_length is not None:  # SDPA's own scale is attn.scale: the queries carry the rest
            query = query * math.sqrt(math.log(self.sp.stream_length("image"), base_sequence_length))
        repeats = attn.heads // key.shape[2]
        key, value = key.repeat_interleave(repeats, dim=2), value.repeat_interleave(repeats, dim=2)
        mask = None if attention_mask is None else attention_mask.bool()
        out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=mask)
        return out.to(dtype)


def lumina_next_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one LuminaPipeline step: latents 8x smaller than the image, ``text_len`` Gemma tokens (the
    first sample's last 3 padded), the pipeline's RoPE table and ``base_sequence_length`` (a 1024 px image's tokens)."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.ones(batch, text_len, dtype=torch.long, device=device)
    mask[0, max(1, text_len - 3):] = 0
    rope = get_2d_rotary_pos_embed_lumina(cfg.hidden_size // cfg.num_attention_heads, 64, 64)
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
                timestep=torch.full((batch,), 0.3).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.cross_attention_dim), encoder_mask=mask,
                image_rotary_emb=rope.to(device), cross_attention_kwargs={"base_sequence_length": 4096},
                return_dict=False)


def lumina_next_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a LuminaPipeline call: the VAE divides by 8, 2x2 patches become one token; the text is not
    split (cross-attention)."""
    lh, lw = spatial_latent(height, width, 16, "Lumina-Next (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image, (config.get("in_channels", 4), lh, lw))


LUMINA_NEXT = SynthArch(
    name="lumina-next-sft",
    description="Lumina-Next-SFT 2B transformer (24 blocks, 32 query / 8 key-value heads x 72, Gemma-2B text), the "
                "SDXL VAE, a one-layer Gemma of Gemma-2B's width",
    pipeline="LuminaPipeline",
    transformer_class="LuminaNextDiT2DModel",
    transformer=dict(sample_size=128, patch_size=2, in_channels=4, hidden_size=2304, num_layers=24,
                     num_attention_heads=32, num_kv_heads=8, multiple_of=256, norm_eps=1e-5, learn_sigma=True,
                     qk_norm=True, cross_attention_dim=2048, scaling_factor=1.0),
    vae=_SDXL_VAE, clip={},
    t5=dict(hidden_size=2048, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=1,
            head_dim=256),
    scheduler=dict(num_train_timesteps=1000),
    default_dtype="bfloat16",
    max_sequence_length=256,
)

#: diffusers' pipeline test configuration (tests/pipelines/lumina) has one 4-wide head; ours keeps its layout at 4
#: query / 2 key-value heads of 8, so that Ulysses and grouped-query heads are exercised
LUMINA_NEXT_TINY = dataclasses.replace(
    LUMINA_NEXT, name="lumina-next-tiny",
    description="Lumina-Next shrunk for CPU tests: 2 blocks, 4 query / 2 key-value heads x 8, text width 8; a tiny "
                "VAE and Gemma",
    transformer=dict(sample_size=4, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_attention_heads=4,
                     num_kv_heads=2, multiple_of=16, norm_eps=1e-5, learn_sigma=True, qk_norm=True,
                     cross_attention_dim=8, scaling_factor=1.0),
    vae=dict(_SDXL_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    t5=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=4),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)

def lumina_next_components(arch: SynthArch, kit) -> dict:
    """LuminaPipeline's other components: SDXL's AutoencoderKL layout and a Gemma text encoder with its tokenizer,
    which starts every text with ``<bos>`` (the transformer pools the text over its mask: an empty negative prompt of
    no tokens would give NaN)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), **kit.gemma2_text_encoder(arch, "Gemma", True))


LUMINA_NEXT_ADAPTER = register(
    ModelAdapter(
        name="lumina-next",
        class_names=("LuminaNextDiT2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image",),
            outputs={"patch_embedder": {0: Split(dim=1, stream="image", ndim=3), 3: Split(dim=1, stream="image",
                                                                                          ndim=3)}},
            gathers={"norm_out": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the class has no _cp_plan; image tokens and their RoPE rows split where they appear, "
                                 "the self-attention's softmax scale taken from the global length",
        ),
        attention=AttentionSelector(paths=("layers.*.attn1", "layers.*.attn2")),
        sequence_processor=LuminaNextSequenceParallelProcessor,
        blocks=(BlockList("layers", ("hidden_states",), ("hidden_states",), ("image",)),),
        token_wise=("layers.*.feed_forward",),
        example_inputs=lumina_next_example_inputs,
        layout=lumina_next_layout,
        text_tokens=256,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_mask"),
        cfg_mode="batched",  # one call on [cond, uncond]
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("LuminaPipeline",),
        synth_archs=(LUMINA_NEXT_TINY, LUMINA_NEXT),
        synth_components=lumina_next_components,
    )
)
