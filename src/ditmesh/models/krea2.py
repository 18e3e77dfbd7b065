"""Krea 2 (``Krea2Transformer2DModel``, ``Krea2Pipeline``): one ``[text, image]`` sequence through single-stream blocks.

``forward`` fuses the stacked text-encoder layers into one text sequence (``text_fusion``: blocks over the layer axis
per token, then over the tokens, all whole on every rank), concatenates it before the image tokens, builds one RoPE
table from ``position_ids`` (text rows zero) and a key mask ``[B, 1, 1, text + image]`` from the prompt padding, runs
the blocks and keeps the image tokens (``hidden_states[:, text:]``) for the final layer.

Sequence plan: one stream, ``joint``, the concatenated sequence, split at the input of ``transformer_blocks.0``; the
RoPE table split with it at every block; the last block's output gathered (``transformer_blocks.-1``), so the model
cuts the image tokens from the whole sequence as it does. The key mask stays whole: in one stream the ranks' local
sequences one after another are the global order, so ``sp.attention`` takes it as the model builds it. Attention is
grouped-query: the processor repeats the key/value heads to the query heads before the exchange, as diffusers' does.

Tensor plan: Q/K/V, the output gate and the SwiGLU's gate and up projections column-parallel, the attention output and
the SwiGLU's down projection row-parallel (2 all-reduces per block); query and key/value head counts divided, so tp
must divide the key/value heads. CFG: the prompt's call, then the negative prompt's (sequential).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .qwenimage import QWENIMAGE, QWENIMAGE_SCHEDULER, qwen3vl_sizes, qwen3vl_text_encoder


class Krea2SequenceParallelProcessor:
    """Attention processor for ``Krea2Attention`` (the blocks' joint attention) whose attention runs
    sequence-parallel: diffusers' ``Krea2AttnProcessor`` on the local tokens, the softmax attention through
    ``sp.attention`` with the model's key mask."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        query = attn.to_q(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        gate = attn.to_gate(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        groups = attn.num_heads // attn.num_kv_heads
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=attention_mask)
        return attn.to_out[0](out.flatten(2, 3) * torch.sigmoid(gate))


def krea2_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one Krea2Pipeline step: 2x2-packed latents of a 16x VAE grid (the VAE divides by 8), the
    stacked text-encoder layers of ``text_len`` tokens, and the positions (text rows zero, image rows their grid)."""
    cfg = model.config
    h, w = height // 16, width // 16
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    positions = torch.zeros(text_len + h * w, 3)
    positions[text_len:, 1] = torch.arange(h).repeat_interleave(w)
    positions[text_len:, 2] = torch.arange(w).repeat(h)
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.num_text_layers, cfg.text_hidden_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        position_ids=positions.to(device),
        encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.bool, device=device),
        return_dict=False,
    )


def krea2_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Krea2Pipeline call: the VAE divides by 8, 2x2 latent patches become one token; text and image
    are one sequence, split together."""
    lh, lw = spatial_latent(height, width, 16, "Krea 2 (8x VAE, 2x2 packing)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (image, config.get("in_channels", 64)))


KREA2_TENSOR_PLAN = TensorPlan(
    colwise=("transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v",
             "transformer_blocks.*.attn.to_gate", "transformer_blocks.*.ff.gate", "transformer_blocks.*.ff.up"),
    rowwise=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.down"),
    per_rank_attrs={"transformer_blocks.*.attn": ("num_heads", "num_kv_heads")},
)

KREA2 = SynthArch(
    name="krea2",
    description="Krea 2 transformer as diffusers' defaults (28 blocks, 48 query / 12 key-value heads x 128, FFN 16384, "
                "12 tapped text layers of 2560), the QwenImage VAE, a 12-layer Qwen3-VL of Qwen3-VL-4B's width whose 12 "
                "layers are the tapped ones",
    pipeline="Krea2Pipeline",
    transformer_class="Krea2Transformer2DModel",
    transformer=dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48,
                     num_key_value_heads=12, intermediate_size=16384, text_hidden_dim=2560, num_text_layers=12,
                     axes_dims_rope=[32, 48, 48]),
    vae=QWENIMAGE.vae, clip={},
    # narrow inside (4 heads, a 64-wide MLP), Qwen3-VL-4B's width outside
    t5=qwen3vl_sizes(2560, 12, 128, [24, 20, 20], heads=4, kv_heads=2),
    # the released pipeline taps 12 of Qwen3-VL-4B's 36 layers; the synthetic encoder has only those 12
    pipeline_config=dict(text_encoder_select_layers=tuple(range(1, 13))),
    scheduler=QWENIMAGE_SCHEDULER,
    default_dtype="bfloat16",
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_krea2.py): 2 blocks, 4 query / 2
#: key-value heads of 8, 3 tapped text layers of 16, one layer-wise and one refiner text block
KREA2_TINY = dataclasses.replace(
    KREA2, name="krea2-tiny",
    description="Krea 2 at diffusers' test configuration: 2 blocks, 4 query / 2 key-value heads x 8, 3 tapped text "
                "layers of 16; a tiny QwenImage VAE and a 3-layer Qwen3-VL",
    transformer=dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3,
                     text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
                     num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=[4, 2, 2]),
    vae=dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
             latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
    t5=qwen3vl_sizes(16, 3, 8, [2, 1, 1], intermediate_size=16),
    pipeline_config=dict(text_encoder_select_layers=(1, 2, 3)),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


def krea2_components(arch: SynthArch, kit) -> dict:
    """Krea2Pipeline's other components: the QwenImage VAE (``arch.vae``) and a Qwen3-VL model (``arch.t5``) with a
    local Qwen2 tokenizer that knows the chat template's special tokens (the pipeline writes the template itself)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKLQwenImage, arch.vae, 1), **qwen3vl_text_encoder(arch, kit))


KREA2_ADAPTER = register(
    ModelAdapter(
        name="krea2",
        class_names=("Krea2Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="joint", ndim=3)},
                    "transformer_blocks.*": {"image_rotary_emb": Split(dim=0, stream="joint", ndim=2)}},
            gathers={"transformer_blocks.-1": Gather(dim=1, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; the joined [text, image] sequence is split where the "
                                 "blocks start and gathered where they end, before the model keeps the image tokens",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn",)),
        whole_attention=AttentionSelector(paths=("text_fusion.*.*.attn",)),
        sequence_processor=Krea2SequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",)),),
        token_wise=("transformer_blocks.*.ff",),
        example_inputs=krea2_example_inputs,
        layout=krea2_layout,
        text_tokens=512,
        tensor_plan=KREA2_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=-1,
        out_channels=lambda model: model.config.in_channels,
        pipelines=("Krea2Pipeline",),
        synth_archs=(KREA2_TINY, KREA2),
        synth_components=krea2_components,
        pp_refusal="Krea 2's blocks carry one joined [text, image] sequence whose key mask PipeFusion does not take",
    )
)
