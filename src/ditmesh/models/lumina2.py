"""Lumina-Image 2.0 (``Lumina2Transformer2DModel``, ``Lumina2Pipeline``): refiners per stream, then one joint
sequence per sample with grouped-query attention.

The model refines the caption tokens (``context_refiner``, under the caption mask) and the image tokens
(``noise_refiner``) on their own, then packs each sample as ``[its valid caption tokens, its image tokens, padding]``
into one joint sequence as long as the longest sample, with a key-padding mask when the samples' lengths differ, and
runs the main ``layers`` over it; the output takes each sample's image tokens back out.

Sequence plan: one stream, ``joint``. The joint sequence is split where it enters ``layers.0`` and its RoPE table
(the rope embedder's fourth output, ``[B, N, D/2]`` complex) with it; ``norm_out``'s output (the projection to
patches) is gathered once, so the model's own unpacking sees the whole sequence. The refiners run whole on every rank
(4 of Lumina-Image 2.0's 30 blocks, on the shorter per-stream sequences); the key-padding mask stays whole and is
handed to ``sp.attention`` with the keys. The processor repeats the key/value heads to the query heads before the
attention (as diffusers' processor does), so Ulysses splits the query heads whatever the key/value head count.

Tensor plan (refiners and main layers alike): Q, K, V and the SwiGLU's two input linears column-parallel, the
attention output and the SwiGLU's output linear row-parallel: 2 all-reduces per block; the key/value heads must
divide by tp as the query heads do. CFG: ``Lumina2Pipeline`` calls the transformer for the prompt, then for the
negative prompt (sequential); ``cfg_trunc_ratio`` below 1 drops the second call on the last steps, which ``--cfg 2``
cannot follow.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch, \
    TensorPlan, register, replace_forward, spatial_latent
from .flux import FLUX_VAE, KL_VAE_PLAN


class Lumina2SequenceParallelProcessor:
    """Attention processor for the main layers of Lumina-Image 2.0 whose core attention runs sequence-parallel:
    projections, per-head RMS norms and RoPE on the local tokens as diffusers' ``Lumina2AttnProcessor2_0`` does;
    the key/value heads repeated to the query heads; the attention through ``sp.attention`` with the key-padding
    mask."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                 base_sequence_length=None):
        if base_sequence_length is not None:
            raise ValueError("proportional attention (base_sequence_length) reads the sequence length, which a "
                             "sequence-parallel rank holds only part of; leave it unset")
        batch = hidden_states.shape[0]
        q, k, v = attn.to_q(hidden_states), attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = q.shape[-1] // attn.heads
        dtype = q.dtype
        q = q.view(batch, -1, attn.heads, head_dim)
        k, v = (t.view(batch, -1, t.shape[-1] // head_dim, head_dim) for t in (k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, use_real=False)
            k = apply_rotary_emb(k, image_rotary_emb, use_real=False)
        q, k = q.to(dtype), k.to(dtype)
        repeats = attn.heads // k.shape[2]
        if repeats > 1:  # grouped-query attention: each key/value head serves `repeats` query heads
            k, v = (t.unsqueeze(3).repeat(1, 1, 1, repeats, 1).flatten(2, 3) for t in (k, v))
        mask = None if attention_mask is None else attention_mask.bool()
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=mask)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def lumina2_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first main layer's modulated input (``norm1`` returns it first)."""
    return block.norm1(named["hidden_states"], named["temb"])[0]


def lumina2_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one Lumina2Pipeline denoising step: random latents and caption features, every caption
    token valid."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
        timestep=torch.full((batch,), 0.3).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.cap_feat_dim),
        encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.bool, device=device),
        return_dict=False,
    )


def lumina2_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Lumina2Pipeline call: the VAE divides by 8, then 2x2 patches become one token, after the
    caption's tokens in one joint sequence."""
    lh, lw = spatial_latent(height, width, 16, "Lumina-Image 2.0 (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 16), lh, lw))


_BLOCK_LISTS = ("layers", "noise_refiner", "context_refiner")


def swiglu_blocks_plan(block_lists: tuple[str, ...], attn: str, gate: str, value: str, out: str) -> TensorPlan:
    """The tensor plan of blocks of self-attention and a SwiGLU feed-forward in each of ``block_lists``: Q, K, V and
    the SwiGLU's ``gate`` and ``value`` linears column-parallel, the attention output and the SwiGLU's ``out`` linear
    row-parallel (2 all-reduces per block); ``attn``'s ``heads`` counted per rank."""
    return TensorPlan(
        colwise=tuple(f"{blocks}.*.{name}" for blocks in block_lists
                      for name in (f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v", gate, value)),
        rowwise=tuple(f"{blocks}.*.{name}" for blocks in block_lists for name in (f"{attn}.to_out.0", out)),
        per_rank_attrs={f"{blocks}.*.{attn}": ("heads",) for blocks in block_lists},
    )


LUMINA2_TENSOR_PLAN = swiglu_blocks_plan(_BLOCK_LISTS, "attn", "feed_forward.linear_1", "feed_forward.linear_3",
                                         "feed_forward.linear_2")


# -- synthetic architectures ---------------------------------------------------------------------------------
LUMINA2 = SynthArch(
    name="lumina2",
    description="Lumina-Image 2.0 transformer (26 layers + 2 + 2 refiners, 24 query / 8 key-value heads x 96, 2.6B "
                "params), FLUX.1's VAE, a one-layer Gemma-2 text encoder of Gemma-2 2B's width",
    pipeline="Lumina2Pipeline",
    transformer_class="Lumina2Transformer2DModel",
    transformer=dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                     num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                     ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                     axes_lens=(300, 512, 512), cap_feat_dim=2304),
    vae=FLUX_VAE,
    clip={},
    t5=dict(hidden_size=2304, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            head_dim=256),
    scheduler=dict(num_train_timesteps=1000, shift=6.0),
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=256,
)

LUMINA2_TINY = dataclasses.replace(
    LUMINA2,
    name="lumina2-tiny",
    description="Lumina-Image 2.0 shrunk for CPU tests: 2 layers + 1 + 1 refiners, 4 query / 2 key-value heads x 8",
    transformer=dict(LUMINA2.transformer, sample_size=8, in_channels=16, hidden_size=32, num_layers=2,
                     num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
                     axes_dim_rope=(4, 2, 2), cap_feat_dim=32),
    vae=dict(FLUX_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    t5=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=256,  # the pipeline's system prompt comes first and takes about 150 of them
)


def lumina2_components(arch: SynthArch, kit) -> dict:
    """Lumina2Pipeline's other components: AutoencoderKL and a Gemma-2 text encoder with a Gemma tokenizer
    (``arch.t5`` holds the text encoder's sizes)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), **kit.gemma2_text_encoder(arch))


def lumina2_meta_trace(model: torch.nn.Module):
    """Make ``model`` traceable on the meta device for the planner: its RoPE embedder reads each prompt's valid length on
    the host (the mask's sum, as a list), which a meta tensor has not; the planner's prompts are all valid, so it reads
    them from a host mask of ones of the meta mask's shape (the positions and tables are still built on the meta
    device). Returns the undo callable."""
    forward = model.rope_embedder.forward
    return replace_forward(model.rope_embedder, lambda hidden_states, attention_mask: forward(
        hidden_states, torch.ones(attention_mask.shape, dtype=attention_mask.dtype)))


LUMINA2_ADAPTER = register(
    ModelAdapter(
        name="lumina2",
        class_names=("Lumina2Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"layers.0": {"hidden_states": Split(dim=1, stream="joint", ndim=3)}},
            outputs={"rope_embedder": {3: Split(dim=1, stream="joint", ndim=3)}},
            gathers={"norm_out": Gather(dim=1, stream="joint")},
        ),
        attention=AttentionSelector(paths=("layers.*.attn",)),
        # the refiners run on the caption and the image tokens before the joint sequence is split
        whole_attention=AttentionSelector(paths=("noise_refiner.*.attn", "context_refiner.*.attn")),
        sequence_processor=Lumina2SequenceParallelProcessor,
        blocks=(BlockList("layers", ("hidden_states",), ("hidden_states",)),),
        token_wise=tuple(f"{blocks}.*.feed_forward" for blocks in _BLOCK_LISTS),
        modulated_input=lumina2_modulated_input,
        example_inputs=lumina2_example_inputs,
        layout=lumina2_layout,
        text_tokens=256,
        tensor_plan=LUMINA2_TENSOR_PLAN,
        meta_trace=lumina2_meta_trace,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
        cfg_mode="sequential",  # Lumina2Pipeline calls the transformer for the prompt, then the negative prompt
        cfg_switch="guidance_scale",
        cfg_hint="--guidance > 1 (e.g. --guidance 4)",
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("Lumina2Pipeline",),
        synth_archs=(LUMINA2_TINY, LUMINA2),
        synth_components=lumina2_components,
        vae=KL_VAE_PLAN,
    )
)
