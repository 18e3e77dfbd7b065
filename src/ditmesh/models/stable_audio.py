"""Stable Audio Open (``StableAudioDiTModel``, ``StableAudioPipeline``): a DiT over audio latent samples.

``forward`` projects the latent's samples (``[B, C, L]``, after a pointwise convolution) to tokens, puts one global
token (the duration and timestep conditioning) before them, runs the blocks (self-attention over ``[global, audio]``
with a partial RoPE the pipeline computes over ``1 + L`` positions, cross-attention to the text and duration tokens, a
SwiGLU), projects, drops the global token and applies a pointwise convolution.

Sequence plan: one stream, ``joint`` (the global token and the audio samples), split at the input of
``transformer_blocks.0`` with the RoPE table at every block, and gathered at the last block's output
(``transformer_blocks.-1``), so that the model drops the global token from the whole sequence. The self-attention
runs through ``sp.attention``; the cross-attention keeps diffusers' processor: local queries against the text every
rank holds whole. Tensor plan: both attentions' Q/K/V column-parallel (the cross-attention's key/value heads divided
too) and their outputs row-parallel, the SwiGLU's fused value and gate halves column-parallel and its output row-parallel
(3 all-reduces per block). CFG: one call on ``[uncond, cond]`` (batched).

Sizes: an audio family has no image; ``width`` is the latent's length in samples (``height`` is ignored), and the
"text" is the cross-attention context, which is not split.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register)


class StableAudioSequenceParallelProcessor:
    """Processor for Stable Audio's attention layers: the self-attention (``attn1``) sequence-parallel, diffusers'
    ``StableAudioAttnProcessor2_0`` on the local tokens with the softmax attention through ``sp.attention``; the
    cross-attention (``encoder_hidden_states`` given) handed to the previous processor unchanged."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        residual = hidden_states
        query = attn.to_q(hidden_states)
        head_dim = query.shape[-1] // attn.heads
        query = query.unflatten(-1, (attn.heads, head_dim))
        key, value = (linear(hidden_states).unflatten(-1, (-1, head_dim)) for linear in (attn.to_k, attn.to_v))
        if key.shape[2] != attn.heads:
            groups = attn.heads // key.shape[2]
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if rotary_emb is not None:
            query, key = (_partial_rotary(t, rotary_emb) for t in (query, key))
        out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=attention_mask)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(query.dtype)))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def _partial_rotary(x: torch.Tensor, freqs) -> torch.Tensor:
    """Stable Audio's RoPE on the first ``freqs[0].shape[-1]`` channels of each head (in float32), ``[B, S, H, D]``."""
    width = freqs[0].shape[-1]
    rotated = apply_rotary_emb(x[..., :width].float(), freqs, use_real=True, use_real_unbind_dim=-2, sequence_dim=1)
    return torch.cat((rotated, x[..., width:].float()), dim=-1).to(x.dtype)


def stable_audio_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one StableAudioPipeline step: ``width`` latent samples, ``text_len`` context tokens, one
    global token, and the RoPE table the pipeline builds over ``1 + width`` positions."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    rope = get_1d_rotary_pos_embed(cfg.attention_head_dim // 2, width + 1, use_real=True, repeat_interleave_real=False)
    return dict(hidden_states=rand(batch, cfg.in_channels, width),
                timestep=torch.full((1,), 0.7).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.cross_attention_input_dim),
                global_hidden_states=rand(batch, 1, cfg.global_states_input_dim),
                rotary_embedding=tuple(t.to(device) for t in rope), return_dict=False)


def stable_audio_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a StableAudioPipeline call: ``width`` latent samples and the global token, one sequence; the
    context (``text_tokens``) is not split."""
    return Layout(width, text_tokens, width + 1, (config.get("in_channels", 64), width))


def _attention_plan(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    attn = f"transformer_blocks.*.{name}"
    return (f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v"), (f"{attn}.to_out.0",)


_SELF, _CROSS = _attention_plan("attn1"), _attention_plan("attn2")
STABLE_AUDIO_TENSOR_PLAN = TensorPlan(
    colwise=_SELF[0] + _CROSS[0],
    rowwise=_SELF[1] + _CROSS[1] + ("transformer_blocks.*.ff.net.2",),
    packed_colwise={"transformer_blocks.*.ff.net.0.proj": ("../2.in_features", "../2.in_features")},
    per_rank_attrs={"transformer_blocks.*.attn1": ("heads",), "transformer_blocks.*.attn2": ("heads",)},
)

STABLE_AUDIO = SynthArch(
    name="stable-audio-open",
    description="Stable Audio Open 1.0 transformer as diffusers' defaults (24 blocks, 24 heads x 64, 12 key-value "
                "heads in the cross-attention, 1024 latent samples), the Oobleck VAE, a one-layer T5 of T5-base's width, "
                "the duration projection",
    pipeline="StableAudioPipeline",
    transformer_class="StableAudioDiTModel",
    transformer=dict(sample_size=1024, in_channels=64, num_layers=24, attention_head_dim=64, num_attention_heads=24,
                     num_key_value_attention_heads=12, out_channels=64, cross_attention_dim=768, time_proj_dim=256,
                     global_states_input_dim=1536, cross_attention_input_dim=768),
    vae={},  # AutoencoderOobleck's defaults are Stable Audio Open's VAE (44.1 kHz stereo, 2048x)
    clip={},
    t5=dict(d_model=768, d_kv=64, d_ff=256, num_layers=1, num_heads=12),
    # the projection of the text and of the start and end seconds (conditioning width, largest number of seconds)
    extra=dict(projection=dict(conditioning_dim=768, min_value=0, max_value=512)),
    scheduler=dict(num_train_timesteps=1000, sigma_min=0.3, sigma_max=500, sigma_data=1.0,
                   sigma_schedule="exponential", solver_order=2, prediction_type="v_prediction", rho=7.0,
                   final_sigmas_type="zero"),
    # Stable Audio Open ships CosineDPMSolverMultistepScheduler, which needs torchsde; the pipeline's declared scheduler
    # class, EDM DPM-Solver++ on the same sigmas, needs nothing more
    scheduler_class="EDMDPMSolverMultistepScheduler",
    default_dtype="float16",
    default_size=(1, 1024),
    max_sequence_length=128,
)

#: diffusers' test configuration (tests/pipelines/stable_audio): 2 blocks, 24 heads of 4, 2 key-value heads in the
#: cross-attention, 3 channels
STABLE_AUDIO_TINY = dataclasses.replace(
    STABLE_AUDIO, name="stable-audio-tiny",
    description="Stable Audio at diffusers' test configuration: 2 blocks, 24 heads x 4, 2 key-value heads; its tiny "
                "Oobleck VAE (4 Hz stereo), T5 and projection",
    transformer=dict(sample_size=4, in_channels=3, num_layers=2, attention_head_dim=4, num_attention_heads=24,
                     num_key_value_attention_heads=2,
                     out_channels=3, cross_attention_dim=4, time_proj_dim=8, global_states_input_dim=8,
                     cross_attention_input_dim=4),
    vae=dict(encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=3, decoder_input_channels=3,
             audio_channels=2, channel_multiples=[2, 4], sampling_rate=4),
    t5=dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2),
    extra=dict(projection=dict(conditioning_dim=4, min_value=0, max_value=32)),
    default_dtype="float32", default_size=(1, 16), max_sequence_length=8)

def stable_audio_components(arch: SynthArch, kit) -> dict:
    """StableAudioPipeline's other components: AutoencoderOobleck (``arch.vae``), a T5 encoder (``arch.t5``) with a
    local tokenizer, and the projection of the text and of the start and end seconds (``arch.extra["projection"]``)."""
    import diffusers
    import transformers
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel

    t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
    return dict(vae=kit.make(diffusers.AutoencoderOobleck, arch.vae, 1), tokenizer=t5_tok,
                text_encoder=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                projection_model=kit.make(StableAudioProjectionModel,
                                          dict(text_encoder_dim=arch.t5["d_model"], **arch.extra["projection"]), 2))


STABLE_AUDIO_ADAPTER = register(
    ModelAdapter(
        name="stable-audio",
        class_names=("StableAudioDiTModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="joint", ndim=3)},
                    "transformer_blocks.*": {"rotary_embedding": Split(dim=0, stream="joint", ndim=2)}},
            gathers={"transformer_blocks.-1": Gather(dim=1, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; the global token and the audio samples split where the "
                                 "blocks start, gathered where they end (the model drops the global token after)",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1", "transformer_blocks.*.attn2")),
        sequence_processor=StableAudioSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",)),),
        token_wise=("transformer_blocks.*.ff",),
        example_inputs=stable_audio_example_inputs,
        layout=stable_audio_layout,
        text_tokens=130,  # the T5 prompt (128) and the two duration tokens
        tensor_plan=STABLE_AUDIO_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "global_hidden_states"),
        cfg_mode="batched",  # one call on [uncond, cond]
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("StableAudioPipeline",),
        synth_archs=(STABLE_AUDIO_TINY, STABLE_AUDIO),
        synth_components=stable_audio_components,
        pp_refusal="Stable Audio's blocks carry one [global, audio] sequence split where they start and gathered "
                   "where they end, not streams PipeFusion patches",
    )
)
