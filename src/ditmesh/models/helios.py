"""Helios (``HeliosTransformer3DModel``, HeliosPipeline): Wan's blocks over a window of frames with its history before
it, long, mid and short (patchified 4x, 2x and 1x coarser), in one sequence.

Where the tokens are: ``forward`` patchifies the window and each history, builds each one's RoPE table (``[B, N, C]``)
and concatenates ``[long, mid, short, window]``, tokens and tables; it embeds the timestep per token (zero for the
history, ``zero_history_timestep``): the blocks get ``temb`` as ``[B, N, 6, D]``. Every block and the output norm take
``original_context_length``, the window's token count, and find the history as the tokens before it: the blocks keep
the history out of the text cross-attention (``guidance_cross_attn``), the self-attention scales its keys
(``is_amplify_history``), the output norm keeps the window.

Sequence plan: the sequence (``video``) split at the first block; its RoPE table and per-token modulation at every
block; ``original_context_length`` at every block replaced by the window tokens this rank holds (``Split.count``): the
history comes first, so each rank's history tokens are the first of its chunk and the blocks' own split by that count
is the rank's part of the model's. The tokens gathered after the last block, before the output norm. Attention:
``attn1`` (self) through ``sp.attention``, its history keys scaled as diffusers' processor does by the local count;
``attn2`` (cross, to the whole text) as diffusers'.

Tensor plan: Wan's (the attentions' Q/K/V column-, ``to_out.0`` row-parallel, the QK-norms over all heads sharded, the
feed-forward column -> row): 7 all-reduces a block; refused for a checkpoint that scales its history keys per head
(``is_amplify_history``), whose scale the plan does not cut. CFG: the prompt's call, then the negative prompt's.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_helios import _get_qkv_projections, apply_rotary_emb_transposed

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   register, replace_forward, spatial_latent, vae_and_t5)
from .wan import WAN21_14B, WAN_TENSOR_PLAN, WAN_VAE_PLAN, ftfy_setup


class HeliosSequenceParallelProcessor(SequenceProcessor):
    """Processor for ``HeliosAttention``: the self-attention as diffusers' ``HeliosAttnProcessor`` on local tokens (its
    ``original_context_length`` already this rank's window count), the softmax through ``sp.attention``; the
    cross-attention as diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 original_context_length=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                                 original_context_length)
        if attention_mask is not None:
            raise NotImplementedError("Helios' self-attention takes no mask; its blocks pass none")
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = apply_rotary_emb_transposed(q, rotary_emb), apply_rotary_emb_transposed(k, rotary_emb)
        history = hidden_states.shape[1] - original_context_length  # this rank's history tokens, first in its chunk
        if attn.is_amplify_history and history > 0:
            scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
            if attn.history_scale_mode == "per_head":
                scale = scale.view(1, 1, -1, 1)
            k = torch.cat([k[:, :history] * scale, k[:, history:]], dim=1)
        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))


def helios_inputs(model, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                  history: tuple[int, int, int]) -> dict:
    """A HeliosPipeline call's inputs for the window ``latents`` ``[B, C, F, H, W]``: ``history`` (long, mid, short)
    latent frames of the same size before it, random, and every frame's index in order (the history's first)."""
    batch, channels, frames, height, width = latents.shape
    long, mid, short = history
    indices = torch.arange(long + mid + short + frames).expand(batch, -1)
    gen = torch.Generator().manual_seed(1)
    past = [torch.randn(batch, channels, n, height, width, generator=gen).to(latents) for n in history]
    return dict(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                indices_latents_history_long=indices[:, :long], indices_latents_history_mid=indices[:, long:long + mid],
                indices_latents_history_short=indices[:, long + mid:long + mid + short],
                indices_hidden_states=indices[:, long + mid + short:], latents_history_long=past[0],
                latents_history_mid=past[1], latents_history_short=past[2], return_dict=False)


#: HeliosPipeline's default history (long, mid, short latent frames) and window (latent frames of a chunk)
HISTORY, WINDOW = (16, 2, 2), 9


def helios_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one HeliosPipeline step: a window of 9 latent frames 8x smaller (the Wan VAE) after the
    pipeline's default history of 16, 2 and 2 frames, UMT5 text."""
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    latents = rand(batch, model.config.in_channels, WINDOW, height // 8, width // 8)
    return helios_inputs(model, latents, torch.full((batch,), 700.0).to(device, dtype),
                         rand(batch, text_len, model.config.text_dim), HISTORY)


def helios_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a HeliosPipeline step (its window and default history): the Wan VAE divides by 8, 1x2x2 patches;
    the mid and long histories are patchified 2x and 4x coarser in every dimension (padded up)."""
    lh, lw = spatial_latent(height, width, 16, "Helios (8x VAE, 2x2 patches)")
    rows, cols = lh // 2, lw // 2
    up = lambda n, k: -(-n // k)  # noqa: E731
    long, mid, short = HISTORY
    tokens = (WINDOW + short) * rows * cols + up(mid, 2) * up(rows, 2) * up(cols, 2)
    tokens += up(long, 4) * up(rows, 4) * up(cols, 4)
    return Layout(tokens, text_tokens, tokens, (config.get("in_channels", 16), WINDOW, lh, lw))


def helios_meta_trace(model):
    """The planner's meta-device trace: the RoPE module turns autocast off on its positions' device, which the meta
    device has not; answered with an empty table of its shape ``[B, 2 * sum(rope_dim), T, H, W]``."""
    channels = 2 * sum(model.config.rope_dim)

    def table(frame_indices, height, width, device):
        return torch.empty(frame_indices.shape[0], channels, frame_indices.shape[1], height, width, device=device)

    return replace_forward(model.rope, table)


def helios_unsupported(transformer, config) -> str | None:
    """tp on a checkpoint whose history keys are scaled per head: the plan does not cut that scale."""
    if config.tp > 1 and transformer.config.is_amplify_history and transformer.config.history_scale_mode == "per_head":
        return ("Helios' per-head history key scale (is_amplify_history) is not cut by its tensor plan: run it with "
                "ulysses, ring or cfg instead of tp")
    return None


# -- synthetic architectures ---------------------------------------------------------------------------------
HELIOS_14B = dataclasses.replace(
    WAN21_14B,
    name="helios-14b",
    description="Helios 14B transformer as diffusers' defaults (Wan2.1-14B's 40 blocks, 40 heads x 128, FFN 13824; "
                "long, mid and short history), the Wan 2.1 VAE, a one-layer UMT5 of UMT5-XXL's width",
    pipeline="HeliosPipeline",
    transformer_class="HeliosTransformer3DModel",
    transformer={k: v for k, v in WAN21_14B.transformer.items() if k != "rope_max_seq_len"},
    # HeliosPipeline's one stage (HeliosPyramidPipeline's are the scheduler's default three), as its pipeline test
    scheduler=dict(stage_range=[0, 1], stages=1, use_dynamic_shifting=True),
    scheduler_class="HeliosScheduler",
    default_frames=33,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_helios.py)
HELIOS_TINY = dataclasses.replace(
    HELIOS_14B,
    name="helios-tiny",
    description="Helios at diffusers' test configuration: 2 blocks, 2 heads x 12, text width 16; a tiny Wan VAE of 4 "
                "latent channels, UMT5",
    transformer=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                     text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", rope_dim=[4, 4, 4], has_multi_term_memory_patch=True,
                     guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=False),
    # the Wan VAE at the transformer's 4 channels (its latent statistics cut to them), a UMT5 of the text width
    vae=dict(base_dim=8, num_res_blocks=1, z_dim=4, latents_mean=[0.0, 0.1, -0.1, 0.2], latents_std=[1.0, 1.5, 2.0, 2.5]),
    t5=dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
    default_frames=5,
)

HELIOS = register(
    ModelAdapter(
        name="helios",
        class_names=("HeliosTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)},
                    "blocks.*": {"temb": Split(dim=1, stream="video", ndim=4),
                                 "rotary_emb": Split(dim=1, stream="video", ndim=3),
                                 "original_context_length": Split(dim=1, stream="video", count="last")}},
            gathers={"blocks.-1": Gather(dim=1, stream="video")},
            differs_from_cp_plan="diffusers' plan splits and gathers around each attention and feed-forward (6 "
                                 "exchanges a block); this one splits once at the first block and gathers after the "
                                 "last, the window count made local for the blocks' own history split",
            replaces_cp_plan=("blocks.*.attn1", "blocks.*.attn2", "blocks.*.ffn"),
        ),
        attention=AttentionSelector(class_names=("HeliosAttention",)),
        sequence_processor=HeliosSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("blocks.*.ffn",),
        example_inputs=helios_example_inputs,
        layout=helios_layout,
        text_tokens=512,  # UMT5, cross-attention only
        tensor_plan=WAN_TENSOR_PLAN,
        unsupported=helios_unsupported,
        meta_trace=helios_meta_trace,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "indices_hidden_states",
                      "indices_latents_history_short", "indices_latents_history_mid", "indices_latents_history_long",
                      "latents_history_short", "latents_history_mid", "latents_history_long"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,
        fps=24,
        pipelines=("HeliosPipeline", "HeliosPyramidPipeline"),
        synth_archs=(HELIOS_TINY, HELIOS_14B),
        synth_components=vae_and_t5("AutoencoderKLWan", "UMT5EncoderModel", "UMT5Config"),
        vae=WAN_VAE_PLAN,
        pipeline_setup=ftfy_setup("helios.pipeline_helios"),  # HeliosPipeline cleans prompts with ftfy unconditionally
        pp_refusal="Helios' blocks take the per-token modulation whole from forward, cut per block; PipeFusion is not "
                   "tested on it",
    )
)
