"""LTX-2 (``LTX2VideoTransformer3DModel``): video and audio streams side by side, each with self-attention and text
cross-attention, and cross-attention between them in every block (audio-to-video and video-to-audio).

Where the tokens are: the pipelines pack the video latents into tokens (``hidden_states`` ``[B, N, C]``, patch 1) and
the audio latents into ``audio_hidden_states`` ``[B, A, C]``. ``forward`` builds RoPE tables from per-token
coordinates (``rope`` and ``cross_attn_rope`` for the video, ``audio_rope`` and ``cross_attn_audio_rope`` for the
audio), embeds the timesteps (one per sample, or one per video token: ``[B, N]`` when frames condition the call),
runs the blocks and projects each stream out (``proj_out``, ``audio_proj_out``).

Only the video is split: it is the long stream (tens of thousands of tokens); the audio is a few hundred tokens (25 a
second) and stays whole on every rank, computed alike everywhere. The sequence plan splits, like diffusers'
``_cp_plan``, the video tokens and a per-token timestep at the entry (a ``[B, 1]`` timestep stays whole), and the
video RoPE tables at the output of both video RoPE modules (tokens next to last in either layout), and gathers
``proj_out``'s output. diffusers' plan also splits the text for a ring over the cross-attention; here the text stays
whole (``whole``).

Attention, per block:

- ``attn1``, video self-attention: projections, QK-norms (RMS over all heads of a token), RoPE and the gates on local
  tokens, the softmax attention through ``sp.attention`` (with the video self-attention mask of IC-LoRA, in the
  model's order, where given). Spatio-temporal guidance (``perturbed_attn``) skips the softmax for the perturbed
  samples, as diffusers' processor does.
- ``video_to_audio_attn``: the whole audio queries attend to the split video keys: each rank attends to its keys and
  keeps the log-sum-exp, one all-gather of the partial results, merged in rank order on every rank
  (``SequenceParallel.whole_query_attention``), so every rank holds the same audio.
- ``attn2``, ``audio_attn2`` (text), ``audio_attn1`` (audio self-attention) and ``audio_to_video_attn`` (local video
  queries, whole audio keys) run as diffusers' processors do: their keys are whole on every rank
  (``whole_attention``).

So a block issues one Ulysses attention (or ring) and one all-gather of ``[B, A, H, D + 1]``.

The CFG of its pipelines is batched (``[uncond, cond]`` in one call), but cfg and dp are refused: the transformer
returns the audio beside the video and the batch hook gathers the first output only. Tensor parallelism, the step
caches and PipeFusion are not offered either: the six attentions of a block have their own head counts and RoPE
layouts (not planned yet), the blocks carry the whole audio beside the split video, and PipeFusion's stages would
send only the video.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers import transformer_ltx2

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, register)
from .ltx import LTX_SPATIAL, LTX_TEMPORAL, ltx_latent_size


def rotate(attn, x: torch.Tensor, table) -> torch.Tensor:
    """``x`` rotated by the RoPE ``table`` in the layer's layout (``interleaved`` or ``split``), as diffusers does."""
    if attn.rope_type == "split":
        return transformer_ltx2.apply_split_rotary_emb(x, table)
    return transformer_ltx2.apply_interleaved_rotary_emb(x, table)


class LTX2SequenceParallelProcessor(SequenceProcessor):
    """Processor for ``LTX2Attention``'s ``attn1`` (video self-attention over the split video) and
    ``video_to_audio_attn`` (the whole audio against the split video); see the module docstring."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(context)
        if all_perturbed is None:
            all_perturbed = torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
        if all_perturbed:  # spatio-temporal guidance: every sample skips the softmax (decided alike on every rank)
            out = value
        else:
            q, k = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(context))
            if query_rotary_emb is not None:
                q = rotate(attn, q, query_rotary_emb)
                k = rotate(attn, k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, value))
            if encoder_hidden_states is None:  # video self-attention over the split video
                mask = attention_mask.unsqueeze(1) if attention_mask is not None and attention_mask.ndim == 3 \
                    else attention_mask
                out = self.sp.attention(q, k, v, backend=self._attention_backend, streams=("video",), mask=mask)
            else:
                if attention_mask is not None:
                    raise NotImplementedError("a mask on LTX-2's video-to-audio attention is not split with the "
                                              "video; its blocks pass none")
                whole_query_attention = getattr(self.sp, "whole_query_attention", None)
                if whole_query_attention is None:
                    raise NotImplementedError(f"LTX-2's video-to-audio attention needs every rank's video keys, which "
                                              f"{type(self.sp).__name__} does not give; use ulysses or ring")
                out = whole_query_attention(q, k, v)
            out = out.flatten(2, 3).to(q.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if gate_logits is not None:
            out = (out.unflatten(2, (attn.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


#: the audio latents a second: 16 kHz, hop 160, 4x compressed (the LTX-2 audio VAE)
AUDIO_LATENTS_PER_SECOND = 16000 / 160 / 4


def ltx2_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one LTX2Pipeline step: the packed video latents of ``frames`` frames (default 121; 32x
    smaller frames, 8x fewer), the audio latents of the same duration at 24 fps, the text of ``text_len`` tokens for
    both streams, one timestep per sample."""
    cfg = model.config
    latent_frames, rows, cols = ltx_latent_size(height, width, frames or 121)
    audio = max(1, round((frames or 121) / 24 * AUDIO_LATENTS_PER_SECOND))
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, latent_frames * rows * cols, cfg.in_channels),
        audio_hidden_states=rand(batch, audio, cfg.audio_in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
        audio_encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        sigma=torch.full((batch,), 0.7).to(device, dtype),
        encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.int64, device=device),
        audio_encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.int64, device=device),
        num_frames=latent_frames, height=rows, width=cols, fps=24.0, audio_num_frames=audio, return_dict=False,
    )


def ltx2_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an LTX2Pipeline call: the LTX VAE's 32x spatial and 8x temporal compression, patch 1; only the
    video is split (the audio and the text are whole on every rank)."""
    for name, value in (("height", height), ("width", width)):
        if value < LTX_SPATIAL or value % LTX_SPATIAL:
            raise ValueError(f"{name}={value} is not a positive multiple of {LTX_SPATIAL}, which LTX-2's 32x VAE needs")
    if frames < 1 or (frames - 1) % LTX_TEMPORAL:
        raise ValueError(f"frames={frames} must be {LTX_TEMPORAL}k+1 for LTX-2's VAE; try "
                         f"{max(1, (frames - 1) // LTX_TEMPORAL * LTX_TEMPORAL + 1)}")
    latent_frames, rows, cols = ltx_latent_size(height, width, frames)
    video = latent_frames * rows * cols
    return Layout(video, text_tokens, video, (config.get("in_channels", 128), latent_frames, rows, cols))


#: what a family whose blocks carry a whole audio stream beside the split video refuses (LTX-2, Kandinsky 6)
WHOLE_AUDIO_REFUSALS = dict(
    batch_refusal="its transformer returns the audio beside the video, and cfg and dp gather the first output only",
    cache_refusal="its blocks carry the whole audio beside the split video, which the caches' statistics and residuals "
                  "are not tested on",
    pp_refusal="its blocks carry the whole audio beside the split video, which PipeFusion's stages do not send",
)


# -- synthetic architectures ---------------------------------------------------------------------------------
LTX2 = SynthArch(
    name="ltx-2",
    description="LTX-2 transformer (48 blocks, video 32 heads x 128 and audio 32 heads x 64 streams, 19B params), "
                "the LTX-2 video and audio VAEs, connectors and vocoder, a 48-layer Gemma 3 of Gemma-3-12B's width",
    pipeline="LTX2Pipeline",
    transformer_class="LTX2VideoTransformer3DModel",
    transformer=dict(in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128,
                     cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128,
                     audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                     num_layers=48, caption_channels=3840),
    vae={},  # AutoencoderKLLTX2Video's defaults are LTX-2's VAE, as are the audio VAE's, the connectors' and vocoder's
    clip={},
    # every hidden state is read (the connectors project 49 of them): Gemma-3-12B's 48 layers, narrow inside
    t5=dict(text=dict(hidden_size=3840, intermediate_size=64, num_hidden_layers=48, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=128),
            vision=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)),
    extra=dict(audio_vae={}, connectors={}, vocoder={}),
    scheduler={},
    default_dtype="bfloat16",
    default_size=(512, 768),
    max_sequence_length=1024,
    default_frames=121,
)

#: diffusers' test configuration of the class (video 2 heads x 8, audio 2 heads x 4, 2 blocks)
LTX2_TINY = dataclasses.replace(
    LTX2,
    name="ltx-2-tiny",
    description="LTX-2 shrunk for CPU tests: diffusers' test config (2 blocks, video 2 heads x 8, audio 2 heads x 4), "
                "its pipeline test's VAEs, connectors and vocoder, a two-layer Gemma 3",
    transformer=dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
                     attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
                     audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
                     num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16, rope_double_precision=False),
    vae=dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8], decoder_block_out_channels=[8],
             layers_per_block=[1], decoder_layers_per_block=[1, 1], spatio_temporal_scaling=[True],
             decoder_spatio_temporal_scaling=[True], decoder_inject_noise=[False, False], downsample_type=["spatial"],
             upsample_residual=[False], upsample_factor=[1], timestep_conditioning=False, patch_size=1,
             patch_size_t=1, encoder_causal=True, decoder_causal=False),
    t5=dict(text=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8),
            vision=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)),
    extra=dict(audio_vae=dict(base_channels=4, output_channels=2, ch_mult=[1], num_res_blocks=1, attn_resolutions=None,
                              in_channels=2, resolution=32, latent_channels=2, norm_type="pixel",
                              causality_axis="height", dropout=0.0, mid_block_add_attention=False, sample_rate=16000,
                              mel_hop_length=160, is_causal=True, mel_bins=8),
               connectors=dict(video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
                               video_connector_num_layers=1, video_connector_num_learnable_registers=None,
                               audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
                               audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
                               connector_rope_base_seq_len=32, rope_double_precision=False),
               vocoder=dict(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                            output_sampling_rate=16000)),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=16,
    default_frames=9,
)


def ltx2_components(arch: SynthArch, kit) -> dict:
    """LTX2Pipeline's other components: AutoencoderKLLTX2Video (``arch.vae``), the audio VAE, the text connectors and
    the vocoder (``arch.extra``), and a Gemma 3 (``arch.t5``: its text model and a small SigLIP tower the pipeline does
    not call) with a local Gemma tokenizer that starts texts with ``<bos>``. No prompt enhancer, processor or duration
    head (optional)."""
    import diffusers
    import transformers
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    text = arch.t5["text"]
    tokenizer = kit.gemma_tokenizer(arch.max_sequence_length, add_bos=True)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    config = transformers.Gemma3Config(text_config=dict(text, **ids), mm_tokens_per_image=4,
                                       vision_config=dict(arch.t5["vision"], image_size=28, patch_size=14))
    # the connectors project every hidden state of the text model (its layers and the embedding) and its width
    connectors = dict(arch.extra["connectors"], caption_channels=text["hidden_size"],
                      text_proj_in_factor=text["num_hidden_layers"] + 1)
    return dict(vae=kit.make(diffusers.AutoencoderKLLTX2Video, arch.vae, 1), tokenizer=tokenizer,
                audio_vae=kit.make(diffusers.AutoencoderKLLTX2Audio, arch.extra["audio_vae"], 4),
                text_encoder=kit.make(transformers.Gemma3ForConditionalGeneration, config, 3),
                connectors=kit.make(LTX2TextConnectors, connectors, 6),
                vocoder=kit.make(LTX2Vocoder, arch.extra["vocoder"], 7),
                processor=None, prompt_enhancer=None, duration_head=None)


LTX2_ADAPTER = register(
    ModelAdapter(
        name="ltx-2",
        class_names=("LTX2VideoTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                         "timestep": Split(dim=1, stream="video", ndim=2, broadcast=True),
                         "video_keyframes_mask": Split(dim=1, stream="video", ndim=3)}},
            # the video RoPE tables, cos and sin: tokens next to last in both layouts ([B, N, D] interleaved,
            # [B, H, N, D / 2] split); the cross-attention's table rotates the audio-to-video queries
            outputs={path: {0: Split(dim=-2, stream="video"), 1: Split(dim=-2, stream="video")}
                     for path in ("rope", "cross_attn_rope")},
            gathers={"proj_out": Gather(dim=1, stream="video")},
            whole=("encoder_hidden_states", "encoder_attention_mask"),
            differs_from_cp_plan="the tables are cut in both RoPE layouts (diffusers' plan takes the interleaved one) "
                                 "and the cross-attention's video table too; the text and its mask stay whole (the "
                                 "cross-attentions need no communication); the audio stays whole",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1", "transformer_blocks.*.video_to_audio_attn")),
        whole_attention=AttentionSelector(paths=("transformer_blocks.*.attn2", "transformer_blocks.*.audio_attn1",
                                                 "transformer_blocks.*.audio_attn2",
                                                 "transformer_blocks.*.audio_to_video_attn")),
        sequence_processor=LTX2SequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "audio_hidden_states"),
                          ("hidden_states", "audio_hidden_states")),),
        example_inputs=ltx2_example_inputs,
        layout=ltx2_layout,
        text_tokens=1024,
        batch_inputs=("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
                      "timestep", "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask",
                      "audio_encoder_attention_mask"),
        cfg_mode="batched",
        frame_step=LTX_TEMPORAL,
        fps=24,
        pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline"),
        synth_archs=(LTX2, LTX2_TINY),
        synth_components=ltx2_components,
        **WHOLE_AUDIO_REFUSALS,
    )
)
