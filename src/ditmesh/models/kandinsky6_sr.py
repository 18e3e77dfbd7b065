"""Kandinsky 6 SR (``Kandinsky6SRTransformer3DModel``, ``Kandinsky6SRPipeline``): Kandinsky 6's video blocks without
text or audio (self-attention and a feed-forward under AdaLN), over latent tiles of a video being upscaled, its
self-attention always NABLA sparse attention.

Where the tokens are: ``forward`` patchifies the channels-last tile (``[B, T, H, W, C]``), builds the 3-D RoPE table,
reorders both into 8 x 8 spatial token blocks (``_local_patch``: ``[B, S, D]`` and ``[S, 1, D/2, 2, 2]``) and runs the
blocks, then undoes the order before ``out_layer``. As for Kandinsky 5 and 6, the sequence plan splits the tokens at
the first block and the RoPE table at every block (``forward`` hands each the whole table), and gathers the tokens at
the output of the last block (``visual_transformer_blocks.-1``).

NABLA: each attention builds a flex-attention ``BlockMask`` over 64-token blocks from the call's own queries and keys:
per sample and **per head**, the softmax of the block-mean queries against the block-mean keys, the blocks that carry
``nabla_threshold`` of each row's mass, or'ed with a sliding-tile prior. A head's mask reads that head's queries and
keys of the whole sequence and nothing of the other heads. Under Ulysses, after the all-to-all a rank holds every token
of its heads, so it builds exactly its heads' masks (``nabla_attention``, the attention's ``local``) and runs flex
attention on them; under tp a rank holds every token of its heads anyway (diffusers' processor, fewer heads). Ring and
USP are refused (``ring_refusal``): a row of the mask needs every key block's mean, and ring attention merges partial
results under dense masks only, which would materialize the S x S mask that flex attention keeps as blocks.

No CFG: the pipeline makes one call per batch of tiles, which data parallelism splits (``cfg_refusal``). PipeFusion is
refused (its K/V buffers would be attended without the block mask). The pipeline upscales a video, which ``generate``
does not take: the transformer alone is synthesized.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from diffusers.models.transformers import transformer_kandinsky6_sr

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, spatial_latent, temporal_latent, transformer_only)
from .kandinsky5 import NABLA_REFUSAL

_BLOCKS = "visual_transformer_blocks"
_SIDE = transformer_kandinsky6_sr.FRACTAL_BLOCK_SIZE  # tokens per side of NABLA's 8 x 8 spatial blocks


def nabla_attention(query, key, value, sparse_params: dict):
    """NABLA sparse attention of ``[B, S, h, D]`` queries, keys and values holding every token of ``h`` heads: each
    head's block mask from its own queries and keys (diffusers' ``nabla_block_mask``), then flex attention."""
    mask = transformer_kandinsky6_sr.nabla_block_mask(query.transpose(1, 2), key.transpose(1, 2),
                                                      sparse_params["sta_mask"], thr=sparse_params["threshold"])
    return dispatch_attention_fn(query, key, value, attn_mask=mask, backend=AttentionBackendName.FLEX)


class Kandinsky6SRSequenceParallelProcessor(SequenceProcessor):
    """The self-attention on local tokens (projections, per-head RMS norms, the rotation, as diffusers' processor), the
    NABLA attention over the whole sequence of this rank's heads after the Ulysses all-to-all (module docstring)."""

    def __call__(self, attn, hidden_states, rotary_emb, sparse_params):
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.num_heads, -1))
                   for proj in (attn.to_query, attn.to_key, attn.to_value))
        q = transformer_kandinsky6_sr.apply_rotary(attn.query_norm(q.float()).type_as(q), rotary_emb)
        k = transformer_kandinsky6_sr.apply_rotary(attn.key_norm(k.float()).type_as(k), rotary_emb)
        out = self.sp.attention(q, k, v, local=lambda q, k, v: nabla_attention(q, k, v, sparse_params))
        return attn.out_layer(out.flatten(2, 3))


class _DenseAttention:
    """The ``sp`` of the planner's meta-device trace (:func:`kandinsky6_sr_meta_trace`): every key attended."""

    @staticmethod
    def attention(query, key, value, local=None):
        return dispatch_attention_fn(query, key, value)


def kandinsky6_sr_meta_trace(model):
    """The planner's trace: flex attention does not run on the meta device, so each self-attention is traced dense
    (the family's processor over :class:`_DenseAttention`), an upper bound on NABLA's cost, which attends to the blocks
    that hold ``nabla_threshold`` of each row's mass and the sliding-tile prior. Returns the undo."""
    return KANDINSKY6_SR_ADAPTER.set_processors(model, _DenseAttention())


def kandinsky6_sr_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """One tile's transformer inputs: the noisy latent, the anchor latent and its mask (``2 * in_visual_dim + 1``
    channels, channels last) of a ``height`` x ``width`` tile (the K-VAE: 16x in space, 4x in time), one timestep per
    tile."""
    cfg = model.config
    latent_frames = temporal_latent(frames or 1, 4, "Kandinsky 6 SR (4x temporal K-VAE)")
    latent = torch.randn(batch, latent_frames, height // 16, width // 16, 2 * cfg.in_visual_dim + 1,
                         generator=generator)
    return dict(hidden_states=latent.to(device, dtype), timestep=torch.full((batch,), 500.0, device=device),
                return_dict=False)


def kandinsky6_sr_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of one tile: 16x smaller latent frames (4x fewer in time), ``patch_size`` patches, a token grid
    whose sides NABLA groups by 8; no text."""
    patch = config.get("patch_size", (1, 1, 1))
    spatial_latent(height, width, 16 * patch[1] * _SIDE, f"Kandinsky 6 SR (16x K-VAE, patch {patch[1]}, NABLA's "
                                                         f"{_SIDE} x {_SIDE} token blocks)")
    latent_frames = temporal_latent(frames, 4, "Kandinsky 6 SR (4x temporal K-VAE)")
    tokens = latent_frames // patch[0] * (height // 16 // patch[1]) * (width // 16 // patch[2])
    channels = 2 * config.get("in_visual_dim", 64) + 1
    return Layout(tokens, 0, tokens, (latent_frames, height // 16, width // 16, channels))


# -- synthetic architectures ---------------------------------------------------------------------------------
KANDINSKY6_SR = SynthArch(
    name="kandinsky6-sr",
    description="Kandinsky 6 SR transformer as diffusers' defaults (32 blocks, 28 heads x 64, 640 output channels: the "
                "distilled checkpoints' head), the transformer alone",
    pipeline="Kandinsky6SRPipeline",
    transformer_class="Kandinsky6SRTransformer3DModel",
    transformer={},
    vae={}, clip={}, t5={},
    scheduler={},
    default_dtype="bfloat16",
    default_size=(512, 512),
    max_sequence_length=0,
    default_frames=121,  # Kandinsky 6's 5 s at 24 fps
)

#: diffusers' test configuration of the class (2 blocks, 2 heads x 12, patch 1 x 2 x 2): a 16 x 16 latent is one 8 x 8
#: token block a frame
KANDINSKY6_SR_TINY = dataclasses.replace(
    KANDINSKY6_SR,
    name="kandinsky6-sr-tiny",
    description="Kandinsky 6 SR at diffusers' test configuration: 2 blocks, 2 heads x 12, patch 1 x 2 x 2; the "
                "transformer alone",
    transformer=dict(in_visual_dim=4, out_visual_dim=8, time_dim=16, patch_size=(1, 2, 2), model_dim=24, ff_dim=32,
                     num_visual_blocks=2, axes_dims=(4, 4, 4)),
    default_dtype="float32",
    default_size=(256, 256),
    default_frames=5,
)

#: an awkward one of ours: 3 heads (2 + 1 over two ranks), and a NABLA that drops blocks (the sliding-tile prior only
#: the block itself, half of each row's mass kept), so that a mask built from the wrong heads or tokens changes the
#: result
KANDINSKY6_SR_TINY_SPARSE = dataclasses.replace(
    KANDINSKY6_SR_TINY,
    name="kandinsky6-sr-tiny-sparse",
    description="kandinsky6-sr-tiny with 3 heads and a sparse NABLA (window 1 x 1 x 1, threshold 0.5)",
    transformer=dict(KANDINSKY6_SR_TINY.transformer, model_dim=36, ff_dim=48, nabla_window=(1, 1, 1),
                     nabla_threshold=0.5),
)

KANDINSKY6_SR_ADAPTER = register(
    ModelAdapter(
        name="kandinsky6-sr",
        class_names=("Kandinsky6SRTransformer3DModel",),
        num_heads=lambda model: model.config.model_dim // sum(model.config.axes_dims),
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={f"{_BLOCKS}.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)},
                    f"{_BLOCKS}.*": {"rotary_emb": Split(dim=0, stream="video")}},
            gathers={f"{_BLOCKS}.-1": Gather(dim=1, stream="video")},
            differs_from_cp_plan="the class has no _cp_plan; tokens split after forward's 8 x 8 block order",
        ),
        attention=AttentionSelector(paths=(f"{_BLOCKS}.*.self_attention",)),
        sequence_processor=Kandinsky6SRSequenceParallelProcessor,
        blocks=(BlockList(_BLOCKS, ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=(f"{_BLOCKS}.*.feed_forward",),
        example_inputs=kandinsky6_sr_example_inputs,
        layout=kandinsky6_sr_layout,
        text_tokens=0,
        tensor_plan=TensorPlan(
            colwise=tuple(f"{_BLOCKS}.*.self_attention.{proj}" for proj in ("to_query", "to_key", "to_value"))
            + (f"{_BLOCKS}.*.feed_forward.net.0.proj",),
            rowwise=(f"{_BLOCKS}.*.self_attention.out_layer", f"{_BLOCKS}.*.feed_forward.net.2"),
            per_rank_attrs={f"{_BLOCKS}.*.self_attention": ("num_heads",)},
        ),
        attention_refusal=lambda model: f"Kandinsky 6 SR's NABLA {NABLA_REFUSAL}",
        ring_refusal="its NABLA attention chooses each query block's keys from every key block of the sequence and "
                     "runs as a flex-attention block mask, which ring attention (dense masks, merged partial results) "
                     "does not take",
        batch_inputs=("hidden_states", "timestep"),
        cfg_refusal="Kandinsky6SRPipeline runs no classifier-free guidance (one call per batch of tiles, which dp "
                    "splits)",
        output_channel_dim=-1,
        out_channels=lambda model: model.config.out_visual_dim,
        frame_step=4,
        fps=24,
        pp_refusal="PipeFusion's K/V buffers would be attended without NABLA's block mask",
        meta_trace=kandinsky6_sr_meta_trace,
        pipelines=("Kandinsky6SRPipeline",),
        synth_archs=(KANDINSKY6_SR_TINY, KANDINSKY6_SR_TINY_SPARSE, KANDINSKY6_SR),
        synth_components=transformer_only("Kandinsky 6 SR", "a low-resolution video to upscale, which generate does "
                                                            "not take"),
    )
)
