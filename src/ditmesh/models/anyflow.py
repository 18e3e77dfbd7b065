"""AnyFlow (``AnyFlowTransformer3DModel``, AnyFlowPipeline): Wan 2.1's blocks with a flow-map embedding, one source
and one target timestep per latent frame.

Where the tokens are: ``forward`` takes the latents frames-first (``[B, F, C, H, W]``) and moves the channels ahead,
builds the RoPE table (``rope``: ``{"query": f, "key": f}``, complex ``[1, 1, N, D / 2]``), patchifies and flattens to
``[B, N, D]`` video tokens, and embeds the two timesteps per frame, repeated over each frame's tokens: the blocks get
``temb`` as ``[B, N, 6, D]`` (one modulation per token) and the final norm a ``[B, N, D]`` shift and scale. The
sequence plan splits the RoPE table at ``rope``'s output (both entries), the video tokens at the first block and the
per-token modulation at every block (``forward`` hands each the whole one); it gathers the tokens at the output of
``norm_out`` (a per-token LayerNorm), because the final modulation reads the whole per-token shift and scale.

Attention: ``attn1`` is self-attention over the video: projections, QK-norms (RMS over all heads) and the complex RoPE
on local tokens, the softmax through ``sp.attention``. ``attn2`` is cross-attention to the text (and image) context
every rank holds whole: diffusers' processor, no communication. CFG: one call on ``[uncond, cond]`` (batched); the
released checkpoints fold guidance into their weights (guidance 1). Tensor plan: Wan's (Q/K/V column-, ``to_out.0``
row-parallel in both attentions, the feed-forward column -> row, the QK-norms sharded): 7 all-reduces a block.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_anyflow import apply_rotary_emb

from .base import AttentionSelector, BlockList, Gather, ModelAdapter, SequencePlan, SequenceProcessor, Split, register
from .wan import _WAN_TINY, WAN21_14B, WAN_TENSOR_PLAN, WAN_VAE_PLAN, wan_components, wan_layout


class AnyFlowSequenceParallelProcessor(SequenceProcessor):
    """Processor for AnyFlow's attention layers: the self-attention (``attn1``) as diffusers' ``AnyFlowAttnProcessor``
    on local tokens with the softmax through ``sp.attention``; the cross-attention (``attn2``: local queries against
    the whole context) as diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask)
        if attention_mask is not None:
            raise NotImplementedError("AnyFlow's self-attention takes no mask; its blocks pass none")
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:  # heads-first, as diffusers rotates
            q = apply_rotary_emb(q.transpose(1, 2), rotary_emb["query"]).transpose(1, 2)
            k = apply_rotary_emb(k.transpose(1, 2), rotary_emb["key"]).transpose(1, 2)
        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


def anyflow_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one AnyFlowPipeline step: frames-first latents of ``(frames - 1) // 4 + 1`` latent frames
    8x smaller (the Wan VAE; default 81 frames), the source and target timesteps per latent frame, UMT5 text."""
    cfg = model.config
    latent_frames = ((frames or 81) - 1) // 4 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, latent_frames, cfg.in_channels, height // 8, width // 8),
                timestep=torch.full((batch, latent_frames), 700.0).to(device, dtype),
                r_timestep=torch.full((batch, latent_frames), 400.0).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_dim), return_dict=False)


def anyflow_layout(config: dict, height: int, width: int, frames: int, text_tokens: int):
    """Wan's token counts, the latent shape frames-first as AnyFlow takes it."""
    layout = wan_layout(config, height, width, frames, text_tokens)
    channels, latent_frames, *rest = layout.latent_shape
    return dataclasses.replace(layout, latent_shape=(latent_frames, channels, *rest))


def anyflow_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of an AnyFlow block's self-attention: ``norm1`` shifted and scaled by the per-token modulation
    (``temb`` ``[B, N, 6, D]``, this rank's tokens), as the block computes it."""
    shift, scale = (block.scale_shift_table + named["temb"].float())[:, :, :2].unbind(2)
    hidden = named["hidden_states"]
    return (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)


# -- synthetic architectures ---------------------------------------------------------------------------------
_FLOW_MAP = dict(gate_value=0.25, deltatime_type="r")

ANYFLOW_14B = dataclasses.replace(
    WAN21_14B,
    name="anyflow-14b",
    description="AnyFlow 14B transformer (Wan2.1-T2V-14B's blocks: 40 blocks, 40 heads x 128, FFN 13824; flow-map "
                "timesteps), full Wan VAE, small UMT5",
    pipeline="AnyFlowPipeline",
    transformer_class="AnyFlowTransformer3DModel",
    transformer={**{k: v for k, v in WAN21_14B.transformer.items() if k != "qk_norm"}, **_FLOW_MAP},
    scheduler={},
    scheduler_class="FlowMapEulerDiscreteScheduler",
)

#: diffusers' test configuration of the class (2 blocks, 2 heads x 12), with wan-tiny's VAE and UMT5 narrowed to it:
#: ``generate`` runs AnyFlowPipeline on it end to end
ANYFLOW_TINY = dataclasses.replace(
    _WAN_TINY,
    name="anyflow-tiny",
    description="AnyFlow at diffusers' test configuration (2 blocks, 2 heads x 12, text width 16), a tiny Wan VAE of 4 "
                "latent channels, a 16-wide UMT5",
    pipeline=ANYFLOW_14B.pipeline,
    transformer_class=ANYFLOW_14B.transformer_class,
    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=4,
                     out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     rope_max_seq_len=32, **_FLOW_MAP),
    vae=dict(_WAN_TINY.vae, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),  # the 4 latent channels
    t5=dict(_WAN_TINY.t5, d_model=16),
    scheduler={},
    scheduler_class="FlowMapEulerDiscreteScheduler",
)

_PER_TOKEN = Split(dim=1, stream="video", ndim=4)

ANYFLOW = register(
    ModelAdapter(
        name="anyflow",
        class_names=("AnyFlowTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)},
                    "blocks.*": {"temb": _PER_TOKEN}},
            outputs={"rope": {None: Split(dim=2, stream="video", ndim=4)}},
            gathers={"norm_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=("blocks.*.attn1", "blocks.*.attn2")),
        sequence_processor=AnyFlowSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("blocks.*.ffn",),
        modulated_input=anyflow_modulated_input,
        example_inputs=anyflow_example_inputs,
        layout=anyflow_layout,
        text_tokens=512,  # UMT5, cross-attention only
        tensor_plan=dataclasses.replace(WAN_TENSOR_PLAN, per_rank_attrs={
            f"blocks.*.{attn}": ("heads", "inner_dim") for attn in ("attn1", "attn2")}),
        batch_inputs=("hidden_states", "timestep", "r_timestep", "encoder_hidden_states",
                      "encoder_hidden_states_image"),
        cfg_mode="batched",
        output_channel_dim=2,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,
        pipelines=("AnyFlowPipeline",),
        synth_archs=(ANYFLOW_14B, ANYFLOW_TINY),
        synth_components=wan_components,
        vae=WAN_VAE_PLAN,
        pp_refusal="its blocks take the per-token modulation whole from forward, cut per block; PipeFusion is not "
                   "tested on it",
    )
)
