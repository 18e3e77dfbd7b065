"""Cosmos (``CosmosTransformer3DModel``; Cosmos Predict 1 / 2 / 2.5 and Transfer pipelines): video self-attention with
3-D RoPE, cross-attention to T5 text (and, in 2.5, image context), AdaLN modulation per sample or per frame.

Where the tokens are: ``forward`` concatenates the condition and padding masks on channels, builds the RoPE table
(``rope``: cos and sin ``[N, D]``) and the learnable position embedding (``learnable_pos_embed``, ``[B, N, D]``),
patchifies and flattens to ``[B, N, D]``, embeds the timestep (one per sample, or one per latent frame ``[B, 1, T, 1,
1]``, expanded to ``[B, N, D]``), runs the blocks and unpatchifies after ``proj_out``. The sequence plan splits the
RoPE table and the position embedding at their modules' output, the video tokens at the first block and, at every
block, a per-token modulation and a ControlNet residual (``forward`` hands each block the whole ones); it gathers the
tokens after the last block, because ``norm_out`` reads the per-token modulation whole.

Attention: ``attn1`` is self-attention over the video: projections, per-head QK-norms, the RoPE rotation and the
grouped-query repeat on local tokens, the softmax through ``sp.attention``. ``attn2`` (cross-attention to the whole
text and image context, under the text mask) runs as diffusers' processor. CFG: two calls a step (sequential). Tensor
plan: Q/K/V column- and ``to_out.0`` row-parallel in both attentions, the feed-forward column -> row: 3 all-reduces a
block; the QK-norms act per head.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, spatial_latent, temporal_latent, transformer_only)


class CosmosSequenceParallelProcessor(SequenceProcessor):
    """Processor for Cosmos' attention layers: self-attention sequence-parallel, cross-attention as diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise NotImplementedError("Cosmos' self-attention takes no mask; its blocks pass none")
        q, k, v = (linear(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                   for linear in (attn.to_q, attn.to_k, attn.to_v))  # [B, H, N, D]
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
            k = apply_rotary_emb(k, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
        k = k.repeat_interleave(q.size(3) // k.size(3), dim=3)
        v = v.repeat_interleave(q.size(3) // v.size(3), dim=3)
        out = self.sp.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                backend=self._attention_backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


def cosmos_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one CosmosTextToWorldPipeline step: latents of ``(frames - 1) // 8 + 1`` latent frames 8x
    smaller (the Cosmos tokenizer; default 121 frames), the condition mask where the model reads one, the T5 text and
    its mask, the frame rate, an empty padding mask."""
    cfg = model.config
    latent_frames = ((frames or 121) - 1) // 8 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    channels = cfg.in_channels - (1 if cfg.concat_padding_mask else 0)
    inputs = dict(hidden_states=rand(batch, channels, latent_frames, height // 8, width // 8),
                  timestep=torch.full((batch,), 700.0).to(device, dtype),
                  encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
                  attention_mask=torch.ones(batch, text_len, device=device), fps=24, return_dict=False)
    if cfg.concat_padding_mask:
        inputs["padding_mask"] = torch.zeros(1, 1, height, width, device=device, dtype=dtype)
    return inputs


def cosmos_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Cosmos call: 8x spatial and 8x temporal tokenizer, 1x2x2 patches; the text is whole."""
    pt, ph, pw = config.get("patch_size", (1, 2, 2))
    lh, lw = spatial_latent(height, width, 8 * ph, "Cosmos (8x tokenizer, 2x2 patches)")
    latent_frames = temporal_latent(frames, 8, "Cosmos' 8x temporal tokenizer")
    video = latent_frames // pt * (lh // ph) * (lw // pw)
    return Layout(video, text_tokens, video, (config.get("in_channels", 16), latent_frames, lh, lw))


_PER_TOKEN = Split(dim=1, stream="video", ndim=3)

COSMOS_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"transformer_blocks.*.{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v"))
    + ("transformer_blocks.*.attn2.q_img?", "transformer_blocks.*.attn2.k_img?", "transformer_blocks.*.attn2.v_img?",
       "transformer_blocks.*.ff.net.0.proj"),
    rowwise=("transformer_blocks.*.attn1.to_out.0", "transformer_blocks.*.attn2.to_out.0", "transformer_blocks.*.ff.net.2"),
    per_rank_attrs={"transformer_blocks.*.attn1": ("heads", "inner_dim"),
                    "transformer_blocks.*.attn2": ("heads", "inner_dim")},
)

# -- synthetic architectures ---------------------------------------------------------------------------------
COSMOS_7B = SynthArch(
    name="cosmos-1.0-7b",
    description="Cosmos-1.0-Diffusion-7B-Text2World transformer (28 blocks, 32 heads x 128); the transformer alone",
    pipeline="CosmosTextToWorldPipeline",
    transformer_class="CosmosTransformer3DModel",
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=32, attention_head_dim=128, num_layers=28,
                     mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=[128, 240, 240],
                     patch_size=[1, 2, 2], rope_scale=[2.0, 1.0, 1.0], concat_padding_mask=False,
                     extra_pos_embed_type="learnable"),
    vae={},
    clip={},
    t5={},
    scheduler={},
    default_dtype="bfloat16",
    default_size=(704, 1280),
    max_sequence_length=512,
    default_frames=121,
)

#: diffusers' test configuration of the class, without the padding mask's channel (its resize needs torchvision)
COSMOS_TINY = dataclasses.replace(
    COSMOS_7B,
    name="cosmos-tiny",
    description="Cosmos shrunk for CPU tests: diffusers' test config (2 blocks, 2 heads x 12, learnable position "
                "embedding) without the padding-mask channel; the transformer alone",
    transformer=dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
                     mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=[4, 32, 32], patch_size=[1, 2, 2],
                     rope_scale=[2.0, 1.0, 1.0], concat_padding_mask=False, extra_pos_embed_type="learnable"),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=12,
    default_frames=9,
)

COSMOS = register(
    ModelAdapter(
        name="cosmos",
        class_names=("CosmosTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"transformer_blocks.0": {"hidden_states": _PER_TOKEN},
                    "transformer_blocks.*": {"embedded_timestep": _PER_TOKEN, "temb": _PER_TOKEN,
                                             "controlnet_residual": _PER_TOKEN}},
            outputs={"rope": {0: Split(dim=0, stream="video", ndim=2), 1: Split(dim=0, stream="video", ndim=2)},
                     "learnable_pos_embed": {None: _PER_TOKEN}},
            gathers={"transformer_blocks.-1": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1", "transformer_blocks.*.attn2")),
        sequence_processor=CosmosSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("transformer_blocks.*.ff",),
        example_inputs=cosmos_example_inputs,
        layout=cosmos_layout,
        text_tokens=512,
        tensor_plan=COSMOS_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "attention_mask", "condition_mask"),
        cfg_mode="sequential",
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=8,
        fps=24,
        pipelines=("CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline", "Cosmos2TextToImagePipeline",
                   "Cosmos2VideoToWorldPipeline", "Cosmos2_5_PredictBasePipeline", "Cosmos2_5_TransferPipeline"),
        synth_archs=(COSMOS_7B, COSMOS_TINY),
        synth_components=transformer_only("Cosmos", "NVIDIA's cosmos_guardrail safety checker, which its pipelines "
                                                    "build whenever none is given: a package and downloaded weights"),
        pp_refusal="its blocks take the per-token modulation whole from forward, cut per block; PipeFusion is not "
                   "tested on it",
    )
)
