"""Kandinsky 6 (``Kandinsky6Transformer3DModel``): Kandinsky 5's layout (text encoder stacks, patchified channels-last
video, 3-D RoPE of 2x2 rotation matrices) with an audio stream fused into every visual block, as in LTX-2.

Where the tokens are: ``forward`` runs a video and an audio text stack over the whole text (left as they are:
``whole_attention``), patchifies and flattens the video (``[B, N, D]``, its RoPE table ``[N, 1, D/2, 2, 2]``) and
embeds the audio (``[B, A, D_a]``), then runs the fused blocks, each returning ``(video, audio)``. As for LTX-2, only
the video is split (the long stream); the audio stays whole on every rank. The sequence plan splits the video at the
first fused block and the RoPE table at every one (``forward`` hands each the whole table), and gathers the video (the
first element of the last block's output) before it is reshaped to the frame grid.

Attention, per fused block: the video self-attention (``video_dec_block.self_attention``) runs through
``sp.attention``; the audio-to-video cross-attention of the audio queries over the video keys
(``av_cross_attention``) through ``SequenceParallel.whole_query_attention`` (every rank's partial result and
log-sum-exp in one all-gather, merged in rank order); the others (text cross-attentions, the audio self-attention,
the video queries over the whole audio, ``va_cross_attention``) run as diffusers' processors (``whole_attention``).

CFG: two calls a step (sequential). cfg and dp are refused while the transformer returns the audio beside the video
(the batch hook gathers the first output only); tp, the step caches and PipeFusion are not offered (the fused block's
six attentions are not planned yet; the blocks carry the whole audio).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers import transformer_kandinsky6

from .base import (AttentionSelector, BlockList, Gather, ModelAdapter, SequencePlan, SequenceProcessor, Split, SynthArch,
                   register)
from .kandinsky5 import (KANDINSKY5_LITE, KANDINSKY5_TINY, kandinsky5_components, kandinsky5_example_inputs,
                         kandinsky5_layout)
from .ltx2 import WHOLE_AUDIO_REFUSALS


class Kandinsky6SequenceParallelProcessor(SequenceProcessor):
    """Processor for the fused blocks' video self-attention (split video) and audio-to-video cross-attention (whole
    audio queries, split video keys); see the module docstring."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, rotary_emb_kv=None,
                 attn_mask=None):
        if attn_mask is not None:
            raise NotImplementedError("a mask on Kandinsky 6's video attention is not split with the video; its "
                                      "blocks pass none")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = attn.query_norm(attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1)))
        k = attn.key_norm(attn.to_key(context).unflatten(-1, (attn.num_heads, -1)))
        v = attn.to_value(context).unflatten(-1, (attn.num_heads, -1))
        if rotary_emb is not None:
            q = transformer_kandinsky6.apply_rotary(q, rotary_emb).to(dtype=q.dtype)
        if rotary_emb_kv is not None:
            k = transformer_kandinsky6.apply_rotary(k, rotary_emb_kv).to(dtype=k.dtype)
        if encoder_hidden_states is None:
            out = self.sp.attention(q, k, v, backend=self._attention_backend)
        else:
            whole_query_attention = getattr(self.sp, "whole_query_attention", None)
            if whole_query_attention is None:
                raise NotImplementedError(f"Kandinsky 6's audio-to-video attention needs every rank's video keys, which "
                                          f"{type(self.sp).__name__} does not give; use ulysses or ring")
            out = whole_query_attention(q, k, v)
        return attn.out_layer(out.flatten(-2, -1))


def kandinsky6_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Kandinsky 5's inputs (the video, the text, its pooled form), the video RoPE positions taken from ``forward``, and
    the audio latents of the same duration (24 fps, 25 audio latents a second)."""
    inputs = kandinsky5_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames)
    for name in ("visual_rope_pos", "text_rope_pos"):
        inputs.pop(name)
    audio = max(1, round((frames or 121) / 24 * 25))
    inputs["audio_hidden_states"] = torch.randn(batch, audio, model.config.in_audio_dim,
                                                generator=generator).to(device, dtype)
    return inputs


# -- synthetic architectures ---------------------------------------------------------------------------------
KANDINSKY6 = SynthArch(
    name="kandinsky6",
    description="Kandinsky 6 transformer (4 + 4 text and 60 fused video-audio blocks, video 32 heads x 128), "
                "Kandinsky 5's VAE, Qwen2.5-VL and CLIP-L, the MMAudio VAE (20 latent channels) and vocoder",
    pipeline="Kandinsky6TI2VAPipeline",
    transformer_class="Kandinsky6Transformer3DModel",
    transformer=dict(text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True),
    vae=KANDINSKY5_LITE.vae,
    clip=KANDINSKY5_LITE.clip,
    t5=KANDINSKY5_LITE.t5,
    # MMAudioVAE's and MMAudioVocoder's defaults, the VAE's latent channels the transformer's audio channels
    extra=dict(audio_vae=dict(latent_channels=20), vocoder={}),
    scheduler={},
    default_dtype="bfloat16",
    default_size=(512, 768),
    max_sequence_length=256,
    default_frames=121,
)

#: the class shrunk as diffusers' Kandinsky 5 pipeline test shrinks Kandinsky 5 (16 wide, heads of 4), with an audio
#: stream 8 wide (heads of 4) and the released checkpoints' flags (RoPE in the cross-modal attentions, cross gates)
KANDINSKY6_TINY = dataclasses.replace(
    KANDINSKY6,
    name="kandinsky6-tiny",
    description="Kandinsky 6 shrunk for CPU tests: 1 + 1 text and 2 fused blocks, video 4 heads x 4, audio 2 heads x "
                "4, the released flags; Kandinsky 5's tiny VAE, Qwen2.5-VL and CLIP, a tiny MMAudio VAE and vocoder",
    transformer=dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=32, in_text_dim2=16, time_dim=16,
                     patch_size=[1, 2, 2], model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2,
                     axes_dims=[1, 1, 2], visual_cond=False, in_audio_dim=4, out_audio_dim=4, model_dim_a=8,
                     time_dim_a=8, ff_dim_a=16, axes_dims_a=[1, 1, 2], text_token_padding=True, ca_rope=True,
                     cross_gates=True, fix_modulation=True),
    vae=KANDINSKY5_TINY.vae,
    clip=KANDINSKY5_TINY.clip,
    t5=KANDINSKY5_TINY.t5,
    extra=dict(audio_vae=dict(mel_bins=8, latent_channels=4, hidden_channels=8, channel_multipliers=[1, 2],
                              layers_per_block=1, n_fft=64, hop_length=16, sample_rate=16000),
               vocoder=dict(num_mels=8, upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                            resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]])),
    default_dtype="float32",
    default_size=(32, 32),
    max_sequence_length=8,
    default_frames=5,
)

_FUSED = "visual_transformer_blocks.*"

def kandinsky6_components(arch: SynthArch, kit) -> dict:
    """Kandinsky6TI2VAPipeline's other components: Kandinsky 5's (:func:`~.kandinsky5.kandinsky5_components`: the
    HunyuanVideo VAE, Qwen2.5-VL with the local Qwen2 tokenizer in the processor's place, CLIP), and the MMAudio VAE
    and vocoder (``arch.extra``) that turn the audio latents into a waveform."""
    import diffusers

    return dict(kandinsky5_components(arch, kit),
                audio_vae=kit.make(diffusers.MMAudioVAE, arch.extra["audio_vae"], 4),
                vocoder=kit.make(diffusers.MMAudioVocoder, arch.extra["vocoder"], 7))


KANDINSKY6_ADAPTER = register(
    ModelAdapter(
        name="kandinsky6",
        class_names=("Kandinsky6Transformer3DModel",),
        num_heads=lambda model: model.config.model_dim // sum(model.config.axes_dims),
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"visual_transformer_blocks.0": {"vis": Split(dim=1, stream="video", ndim=3)},
                    _FUSED: {"vis_rope": Split(dim=0, stream="video")}},
            gathers={"visual_transformer_blocks.-1": Gather(dim=1, stream="video", item=0)},
        ),
        attention=AttentionSelector(paths=(f"{_FUSED}.video_dec_block.self_attention", f"{_FUSED}.av_cross_attention")),
        whole_attention=AttentionSelector(paths=(
            "video_text_transformer_blocks.*.attn", "audio_text_transformer_blocks.*.attn",
            f"{_FUSED}.video_dec_block.cross_attention", f"{_FUSED}.audio_dec_block.self_attention",
            f"{_FUSED}.audio_dec_block.cross_attention", f"{_FUSED}.va_cross_attention")),
        sequence_processor=Kandinsky6SequenceParallelProcessor,
        blocks=(BlockList("visual_transformer_blocks", ("vis", "aud"), ("vis", "aud")),),
        example_inputs=kandinsky6_example_inputs,
        layout=kandinsky5_layout,
        text_tokens=256,
        batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                      "audio_hidden_states", "encoder_attention_mask", "visual_token_type_ids"),
        cfg_mode="sequential",
        output_channel_dim=-1,
        out_channels=lambda model: model.config.out_visual_dim,
        frame_step=4,
        fps=24,
        pipelines=("Kandinsky6TI2VAPipeline",),
        synth_archs=(KANDINSKY6, KANDINSKY6_TINY),
        synth_components=kandinsky6_components,
        **WHOLE_AUDIO_REFUSALS,
    )
)
