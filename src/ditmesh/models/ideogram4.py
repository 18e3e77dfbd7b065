"""Ideogram 4 (``Ideogram4Transformer2DModel``, ``Ideogram4Pipeline``): one packed sequence of text and image tokens.

Every input of ``forward`` is per token: the image latents and the text features each in their own positions of one
``[B, L, ...]`` sequence (the other positions zeroed by the model through ``indicator``), the (t, h, w) positions of the
multi-axis RoPE, the per-token timestep where it is ``[B, L]``. The only mixing across tokens is the blocks' attention,
masked block-diagonally by ``segment_ids`` (the samples packed in one row), and the output is per token too.

Sequence plan: one stream, ``joint``, cut at the entry in every per-token input; ``segment_ids`` stays whole, so the
model builds the global ``[B, 1, L, L]`` mask, which the processor hands to ``sp.attention`` (in one stream the ranks'
local sequences one after another are the global order); the final layer's output is gathered.

Tensor plan: Q/K/V and the SwiGLU's ``w1``/``w3`` column-parallel, the attention output and ``w2`` row-parallel (2
all-reduces per block), the head count divided. CFG: the pipeline runs the unconditional branch on a second transformer
(``unconditional_transformer``), which ditmesh parallelizes like the first, but cfg parallelism pairs two calls of one
transformer: refused.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_ideogram4 import (IMAGE_POSITION_OFFSET, LLM_TOKEN_INDICATOR,
                                                                  OUTPUT_IMAGE_INDICATOR, _rotate_half)

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, replace_forward, spatial_latent)
from .qwenimage import qwen3vl_sizes, qwen3vl_text_encoder


class Ideogram4SequenceParallelProcessor:
    """Attention processor for ``Ideogram4Attention`` whose attention runs sequence-parallel: diffusers'
    ``Ideogram4AttnProcessor`` on the local tokens, the softmax attention through ``sp.attention`` with the segment
    mask the model builds."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        def heads(linear):
            return linear(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))

        query, key, value = attn.norm_q(heads(attn.to_q)), attn.norm_k(heads(attn.to_k)), heads(attn.to_v)
        cos, sin = (t.unsqueeze(2) for t in image_rotary_emb)
        query, key = query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
        out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=attention_mask)
        return attn.to_out[0](out.flatten(2, 3))


def ideogram4_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Inputs of one Ideogram4Pipeline conditional call: ``text_len`` text positions, then the image's 2x2-packed tokens
    (the VAE divides by 8), one segment per sample, as the pipeline packs them."""
    cfg = model.config
    h, w = height // 16, width // 16
    length = text_len + h * w
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    hidden = torch.zeros(batch, length, cfg.in_channels, device=device, dtype=dtype)
    hidden[:, text_len:] = rand(batch, h * w, cfg.in_channels)
    text = torch.zeros(batch, length, cfg.llm_features_dim, device=device, dtype=dtype)
    text[:, :text_len] = rand(batch, text_len, cfg.llm_features_dim)
    positions = torch.zeros(batch, length, 3, dtype=torch.long)
    positions[:, :text_len] = torch.arange(text_len)[:, None]
    positions[:, text_len:, 0] = IMAGE_POSITION_OFFSET
    positions[:, text_len:, 1] = torch.arange(h).repeat_interleave(w) + IMAGE_POSITION_OFFSET
    positions[:, text_len:, 2] = torch.arange(w).repeat(h) + IMAGE_POSITION_OFFSET
    indicator = torch.full((batch, length), OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :text_len] = LLM_TOKEN_INDICATOR
    return dict(hidden_states=hidden, timestep=torch.full((batch,), 0.3).to(device, dtype), encoder_hidden_states=text,
                position_ids=positions.to(device), segment_ids=torch.ones(batch, length, dtype=torch.long, device=device),
                indicator=indicator.to(device), return_dict=False)


def ideogram4_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an Ideogram4Pipeline conditional call: the VAE divides by 8, 2x2 latent patches become one token,
    after the text positions; all one sequence."""
    lh, lw = spatial_latent(height, width, 16, "Ideogram 4 (8x VAE, 2x2 packing)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (text_tokens + image, config.get("in_channels", 128)))


def ideogram4_meta_trace(model: torch.nn.Module):
    """Make ``model`` traceable on the meta device for the planner: the multi-axis RoPE (which turns autocast off on the
    positions' device, which the meta device does not have) returns empty tables of its shape. Returns the undo."""
    def tables(position_ids):
        empty = position_ids.new_empty(*position_ids.shape[:2], model.rotary_emb.head_dim, dtype=torch.float32)
        return empty, empty

    return replace_forward(model.rotary_emb, tables)


IDEOGRAM4 = SynthArch(
    name="ideogram4",
    description="Ideogram 4 transformer as diffusers' defaults (34 blocks, 18 heads x 256, FFN 12288, text features "
                "53248 wide) and its unconditional twin, FLUX.2's VAE, a 36-layer Qwen3-VL of Qwen3-VL-8B's width",
    pipeline="Ideogram4Pipeline",
    transformer_class="Ideogram4Transformer2DModel",
    transformer=dict(in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18,
                     intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, mrope_section=[24, 20, 20]),
    vae={},  # AutoencoderKLFlux2's defaults are FLUX.2's VAE
    clip={},
    # the pipeline taps 13 of 36 layers (13 x 4096 = the text features' width); narrow inside
    t5=qwen3vl_sizes(4096, 36, 128, [24, 20, 20]),
    scheduler=dict(num_train_timesteps=1000, shift=3.0),
    default_dtype="bfloat16",
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_ideogram4.py: 2 blocks, 4 heads of
#: 8) with text features 26 wide instead of 24: the pipeline concatenates 13 tapped layers of its text encoder (of 2)
IDEOGRAM4_TINY = dataclasses.replace(
    IDEOGRAM4, name="ideogram4-tiny",
    description="Ideogram 4 at diffusers' test configuration (2 blocks, 4 heads x 8) with text features 26 wide (13 "
                "tapped layers of 2); a tiny FLUX.2 VAE and 36-layer Qwen3-VL",
    transformer=dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, intermediate_size=32,
                     adaln_dim=16, llm_features_dim=26, rope_theta=10_000, mrope_section=[2, 1, 1]),
    vae=dict(block_out_channels=[4, 4, 4, 4], layers_per_block=1, latent_channels=4, norm_num_groups=2),
    t5=qwen3vl_sizes(2, 36, 8, [2, 1, 1], intermediate_size=8),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


def ideogram4_components(arch: SynthArch, kit) -> dict:
    """Ideogram4Pipeline's other components: AutoencoderKLFlux2 (``arch.vae``), a Qwen3-VL (``arch.t5``, whose layers
    the pipeline taps) with a local Qwen2 tokenizer and chat template, and the unconditional transformer (``arch``'s
    transformer, seeded apart). No prompt enhancer head (optional)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKLFlux2, arch.vae, 1), **qwen3vl_text_encoder(arch, kit),
                unconditional_transformer=kit.make(diffusers.Ideogram4Transformer2DModel, arch.transformer, 5),
                prompt_enhancer_head=None)


def ideogram4_call_arguments(pipe, kwargs: dict) -> dict:
    """``generate``'s ``--guidance`` as a constant guidance scale: the pipeline takes it or a per-step schedule (its
    default, 48 steps long), not both."""
    return dict(kwargs, guidance_schedule=None) if "guidance_scale" in kwargs else kwargs


IDEOGRAM4_ADAPTER = register(
    ModelAdapter(
        name="ideogram4",
        class_names=("Ideogram4Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"": {"hidden_states": Split(dim=1, stream="joint", ndim=3),
                         "encoder_hidden_states": Split(dim=1, stream="joint", ndim=3),
                         "position_ids": Split(dim=1, stream="joint", ndim=3),
                         "indicator": Split(dim=1, stream="joint", ndim=2),
                         "timestep": Split(dim=1, stream="joint", ndim=2)}},
            gathers={"final_layer": Gather(dim=1, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; every per-token input is cut at the entry, the segment ids "
                                 "stay whole so that the model builds the global segment mask",
        ),
        attention=AttentionSelector(class_names=("Ideogram4Attention",)),
        sequence_processor=Ideogram4SequenceParallelProcessor,
        blocks=(BlockList("layers", ("hidden_states",), ("hidden_states",)),),
        token_wise=("layers.*.feed_forward",),
        example_inputs=ideogram4_example_inputs,
        layout=ideogram4_layout,
        text_tokens=512,
        tensor_plan=TensorPlan(
            colwise=("layers.*.attention.to_q", "layers.*.attention.to_k", "layers.*.attention.to_v",
                     "layers.*.feed_forward.w1", "layers.*.feed_forward.w3"),
            rowwise=("layers.*.attention.to_out.0", "layers.*.feed_forward.w2"),
            per_rank_attrs={"layers.*.attention": ("num_heads",)},
        ),
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "position_ids", "segment_ids", "indicator"),
        cfg_refusal="its pipeline runs the unconditional branch on a second transformer (unconditional_transformer), "
                    "one call of each per step, which cfg's exchange between two calls of one transformer does not pair",
        output_channel_dim=-1,
        out_channels=lambda model: model.config.in_channels,
        pipelines=("Ideogram4Pipeline",),
        synth_archs=(IDEOGRAM4_TINY, IDEOGRAM4),
        synth_components=ideogram4_components,
        call_arguments=ideogram4_call_arguments,
        meta_trace=ideogram4_meta_trace,
        pp_refusal="Ideogram 4's attention always takes its segment mask, which PipeFusion does not take",
    )
)
