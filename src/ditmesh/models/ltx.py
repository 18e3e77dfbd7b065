"""LTX-Video (``LTXVideoTransformer3DModel``; ``LTXPipeline``, ``LTXImageToVideoPipeline``, ``LTXConditionPipeline``):
video self-attention with a per-channel 3-D RoPE, cross-attention to T5 text under its padding mask.

Where the tokens are: the pipeline packs the latent video into tokens before the transformer (``[B, N, 128]``,
patch 1), so ``hidden_states`` already holds the video tokens. ``forward`` builds the RoPE tables (``rope``: cos and
sin ``[B, N, inner_dim]``) from the latent's frames, height and width and the pipeline's ``rope_interpolation_scale``
(or from ``video_coords``, LTXConditionPipeline), embeds the timestep (one per sample, or one per token when frames
condition the call: ``[B, N]`` in LTXImageToVideoPipeline, ``[B, 1]`` or ``[B, N]`` in LTXConditionPipeline), runs the
blocks and projects out (``proj_out``) token by token. The sequence plan therefore splits, like diffusers'
``_cp_plan``,

- ``hidden_states`` and a per-token ``timestep`` at the entry (a ``[B, 1]`` timestep stays whole);
- the RoPE tables at the output of ``rope``;

and gathers at the output of ``proj_out``. diffusers' plan also splits the text and its mask, for a ring over the
cross-attention; here the text stays whole on every rank (``whole``), so the cross-attention needs no communication.

Attention: ``attn1`` is self-attention over the video tokens: projections, the QK-norms (RMS over all heads of one
token) and the RoPE rotation on local tokens, then ``sp.attention``. ``attn2`` is cross-attention to the whole text
under ``encoder_attention_mask`` (the prompt's padding): local queries against every text key give exactly the local
rows, so the model's own processor runs it.

CFG: every LTX pipeline runs ``[uncond, cond]`` in one call (batched) when ``guidance_scale > 1``. Tensor plan: Q/K/V
column-parallel, ``to_out.0`` row-parallel, feed-forward column -> row (3 row-parallel all-reduces per block); the
QK-norms normalize over all heads, so they are sharded norms (4 small all-reduces per block: 7 per block); the RoPE
tables hold one angle per channel of the whole inner dim (each head its own frequencies), so each rank keeps its
heads' share of them (``head_outputs``). The frame rule is the LTX VAE's 8x time compression: ``8k + 1`` frames.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers import transformer_ltx

from .base import (AttentionSelector, BlockList, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan, Split,
                   SynthArch, TensorPlan, VaePlan, register, vae_and_t5)


class LTXSequenceParallelProcessor:
    """Processor for ``LTXAttention``: self-attention sequence-parallel, cross-attention local.

    Self-attention projects, normalizes (RMS over the whole inner dim) and rotates the local tokens as diffusers'
    ``LTXVideoAttnProcessor`` does, with the RoPE rows of those tokens; only the softmax attention runs through
    ``sp.attention``. Cross-attention (``encoder_hidden_states`` given) goes to the previous processor unchanged:
    local queries against the whole, replicated text and its mask.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise NotImplementedError("LTX-Video's self-attention takes no attention_mask; its blocks pass none")
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(hidden_states))
        v = attn.to_v(hidden_states)
        if image_rotary_emb is not None:
            q = transformer_ltx.apply_rotary_emb(q, image_rotary_emb)
            k = transformer_ltx.apply_rotary_emb(k, image_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))


#: the LTX VAE's compression: 32x in height and width, 8x in time (``8k + 1`` frames give ``k + 1`` latent frames)
LTX_SPATIAL, LTX_TEMPORAL = 32, 8


def ltx_latent_size(height: int, width: int, frames: int) -> tuple[int, int, int]:
    """(latent frames, rows, columns) of an LTX pipeline call, as its ``prepare_latents`` computes them."""
    return (frames - 1) // LTX_TEMPORAL + 1, height // LTX_SPATIAL, width // LTX_SPATIAL


def ltx_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one LTXPipeline denoising step: packed latent tokens (patch 1), T5 text embeddings with a
    mask over a prompt filling half the padded text, one timestep per sample and the pipeline's RoPE interpolation
    scale at 25 fps (default 161 frames)."""
    cfg = model.config
    latent_frames, rows, cols = ltx_latent_size(height, width, frames or 161)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.zeros(batch, text_len)
    mask[:, : max(1, text_len // 2)] = 1
    return dict(
        hidden_states=rand(batch, latent_frames * rows * cols, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_attention_mask=mask.to(device, dtype),
        num_frames=latent_frames, height=rows, width=cols,
        rope_interpolation_scale=(LTX_TEMPORAL / 25, LTX_SPATIAL, LTX_SPATIAL),
        return_dict=False,
    )


def ltx_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an LTX pipeline call: 32x spatial and 8x temporal VAE, patch 1. Text is cross-attention context
    only, so the split sequence is the video tokens."""
    for name, value in (("height", height), ("width", width)):
        if value < LTX_SPATIAL or value % LTX_SPATIAL:
            raise ValueError(f"{name}={value} is not a positive multiple of 32, which LTX-Video (32x VAE) needs; try "
                             f"{max(LTX_SPATIAL, value // LTX_SPATIAL * LTX_SPATIAL)}")
    if frames < 1:
        raise ValueError(f"frames={frames} must be >= 1")
    latent_frames, rows, cols = ltx_latent_size(height, width, frames)
    video = latent_frames * rows * cols
    return Layout(video, text_tokens, video, (config.get("in_channels", 128), latent_frames, rows, cols))


def ltx_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of a block's self-attention: ``norm1`` shifted and scaled by the first two of its six modulations (its
    ``scale_shift_table`` plus the timestep embedding, per sample or per token)."""
    hidden, temb = named["hidden_states"], named["temb"]
    ada = block.scale_shift_table[None, None] + temb.reshape(hidden.shape[0], temb.shape[1], 6, -1)
    return block.norm1(hidden) * (1 + ada[:, :, 1]) + ada[:, :, 0]


_ATTENTIONS = ("attn1", "attn2")
LTX_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"transformer_blocks.*.{a}.{p}" for a in _ATTENTIONS for p in ("to_q", "to_k", "to_v"))
    + ("transformer_blocks.*.ff.net.0.proj",),
    rowwise=tuple(f"transformer_blocks.*.{a}.to_out.0" for a in _ATTENTIONS) + ("transformer_blocks.*.ff.net.2",),
    per_rank_attrs={f"transformer_blocks.*.{a}": ("heads", "inner_dim", "inner_kv_dim") for a in _ATTENTIONS},
    sharded_norms=tuple(f"transformer_blocks.*.{a}.{n}" for a in _ATTENTIONS for n in ("norm_q", "norm_k")),
    head_outputs={"rope": -1},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: the scheduler LTX-Video ships: flow matching with a resolution-dependent shift and a terminal shift
_LTX_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                      base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)

LTX_VIDEO = SynthArch(
    name="ltx-video",
    description="LTX-Video 2B transformer (28 blocks, 32 heads x 64, 0.9.x), LTX video VAE (32x, 8x time), one-layer "
                "T5-XXL-wide encoder",
    pipeline="LTXPipeline",
    transformer_class="LTXVideoTransformer3DModel",
    transformer=dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                     attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                     qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                     caption_channels=4096, attention_bias=True, attention_out_bias=True),
    vae={},  # AutoencoderKLLTXVideo's defaults are the LTX-Video 0.9.0 VAE
    clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # T5-XXL's width, one layer
    scheduler=_LTX_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(480, 704),
    max_sequence_length=128,
    default_frames=161,
)

#: diffusers' test VAE with the real compression (patch 4 and three space-time scalings: 32x, 8x time), 8 wide
_LTX_TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                     decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                     decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
                     decoder_spatio_temporal_scaling=(True, True, True, False),
                     decoder_inject_noise=(False, False, False, False, False),
                     upsample_residual=(False, False, False, False),
                     upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=4, patch_size_t=1)

_LTX_TINY = dataclasses.replace(
    LTX_VIDEO,
    name="ltx-video-tiny",
    description="LTX-Video architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, per-channel RoPE, tiny LTX VAE",
    transformer=dict(LTX_VIDEO.transformer, in_channels=8, out_channels=8, num_attention_heads=6, attention_head_dim=16,
                     cross_attention_dim=96, num_layers=2, caption_channels=64),
    vae=_LTX_TINY_VAE,
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
    default_frames=9,
)

LTX_ARCHS = (
    LTX_VIDEO,
    _LTX_TINY,
    dataclasses.replace(
        _LTX_TINY,
        name="ltx-video-tiny-tp",
        description="ltx-video-tiny with 4 heads x 24 (96 wide), so tensor parallelism of degree 4 divides the heads "
                    "and each rank's RoPE share keeps whole rotation pairs",
        transformer=dict(_LTX_TINY.transformer, num_attention_heads=4, attention_head_dim=24),
    ),
)


#: The LTX video VAE split along height. Frames stay whole. Its convolutions pad height with zeros through
#: ``conv.padding`` (only time is padded in ``forward``, by repeating frames); its norms are per-position RMS and layer
#: norms over channels (no statistics across rows); the patchify around it and the depth-to-space upsamplers map each
#: latent row to its own image rows; no attention.
LTX_VAE_PLAN = VaePlan(class_names=("AutoencoderKLLTXVideo",), spatial_factor=lambda vae: vae.spatial_compression_ratio)


#: Image-to-video: the condition image is VAE-encoded into the first latent frame and the timestep becomes one per
#: token (0 where the frame is given), which the plan splits with the tokens. No strength: every run starts from noise.
LTX_IMAGE_PIPELINES = (ImagePipeline("i2v", "LTXImageToVideoPipeline", strength=False),)


LTX = register(
    ModelAdapter(
        name="ltx-video",
        class_names=("LTXVideoTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                         "timestep": Split(dim=1, stream="video", ndim=2, broadcast=True)}},
            outputs={"rope": {0: Split(dim=1, stream="video", ndim=3), 1: Split(dim=1, stream="video", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
            differs_from_cp_plan="the text and its mask stay whole on every rank (diffusers splits them for a ring "
                                 "over the cross-attention; whole, it needs no communication); a per-token timestep "
                                 "is split with its tokens; chunks may be uneven",
            whole=("encoder_hidden_states", "encoder_attention_mask"),
        ),
        attention=AttentionSelector(class_names=("LTXAttention",)),
        sequence_processor=LTXSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("transformer_blocks.*.ff",),
        modulated_input=ltx_modulated_input,
        example_inputs=ltx_example_inputs,
        layout=ltx_layout,
        text_tokens=128,  # the LTX pipelines' max_sequence_length
        tensor_plan=LTX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "video_coords"),
        cfg_mode="batched",  # the LTX pipelines run [uncond, cond] in one transformer call
        output_channel_dim=-1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=LTX_TEMPORAL,
        fps=25,  # LTXPipeline's frame_rate
        pipelines=("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline"),
        image_pipelines=LTX_IMAGE_PIPELINES,
        synth_archs=LTX_ARCHS,
        synth_components=vae_and_t5("AutoencoderKLLTXVideo"),
        vae=LTX_VAE_PLAN,
    )
)
