"""ACE-Step 1.5 (``AceStepTransformer1DModel``, ``AceStepPipeline``): a DiT over audio latent frames with sliding-window
layers.

``forward`` concatenates the noisy latents with the context latents on channels, pads the frames to the patch size,
patchifies them with a strided convolution (``proj_in_conv``), builds the RoPE tables and, for the sliding-window
layers, a dense band mask ``[1, 1, N, N]``, runs the blocks (grouped-query self-attention, cross-attention to the
condition encoder's tokens, an MLP), then modulates, un-patchifies with a transposed convolution and cuts the padding.

Sequence plan: one stream of patch tokens, split at the input of ``layers.0``, the RoPE tables split with it at every
layer; the last layer's output gathered (``layers.-1``), so the output convolution and the cut see every token. The
band mask stays whole: one stream's local sequences one after another are the global order, so ``sp.attention`` takes
it, rows and columns, as the model builds it. The cross-attention keeps diffusers' processor (local queries against the
whole context). No tensor plan yet. CFG: one call on ``[cond, uncond]`` (batched).

Sizes: an audio family has no image; ``width`` is the latent's length in frames (``height`` is ignored).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   register)


class AceStepSequenceParallelProcessor:
    """Processor for ACE-Step's attention layers: the self-attention sequence-parallel (diffusers'
    ``AceStepAttnProcessor2_0`` on the local tokens, its key/value heads repeated, the softmax attention through
    ``sp.attention`` under the model's band mask); the cross-attention handed to the previous processor."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attn.is_cross_attention and encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (attn.heads, attn.head_dim)))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, (attn.kv_heads, attn.head_dim)))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.kv_heads, attn.head_dim))
        if image_rotary_emb is not None:
            query, key = (apply_rotary_emb(t, image_rotary_emb, use_real=True, use_real_unbind_dim=-2, sequence_dim=1)
                          for t in (query, key))
        groups = attn.heads // attn.kv_heads
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        query = query * (attn.scaling * attn.head_dim ** 0.5)  # SDPA's own scale is head_dim ** -0.5
        out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=attention_mask)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(query.dtype)))


def ace_step_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one AceStepPipeline step: ``width`` latent frames, the context latents (twice the acoustic
    width), ``text_len`` condition tokens, ``t`` and ``r`` equal."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    acoustic = cfg.audio_acoustic_hidden_dim
    t = torch.full((batch,), 0.6).to(device, dtype)
    return dict(hidden_states=rand(batch, width, acoustic), timestep=t, timestep_r=t,
                encoder_hidden_states=rand(batch, text_len, cfg.encoder_hidden_size or cfg.hidden_size),
                context_latents=rand(batch, width, cfg.in_channels - acoustic), return_dict=False)


def ace_step_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an AceStepPipeline call: ``width`` latent frames, ``patch_size`` frames a token; the condition
    tokens are not split."""
    tokens = -(-width // config.get("patch_size", 2))
    return Layout(tokens, text_tokens, tokens, (width, config.get("audio_acoustic_hidden_dim", 64)))


ACE_STEP = SynthArch(
    name="ace-step-1.5",
    description="ACE-Step 1.5 transformer as diffusers' defaults (24 layers, 16 query / 8 key-value heads x 128, "
                "sliding windows of 128), its condition encoder, a one-layer Qwen3 of Qwen3-Embedding-0.6B's width, an "
                "Oobleck VAE of 64 channels",
    pipeline="AceStepPipeline",
    transformer_class="AceStepTransformer1DModel",
    transformer=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, in_channels=192, audio_acoustic_hidden_dim=64, patch_size=2,
                     sliding_window=128),
    vae=dict(decoder_input_channels=64),  # AutoencoderOobleck's defaults otherwise
    clip={},
    t5=dict(hidden_size=1024, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=128),
    extra=dict(condition_encoder=dict(text_hidden_dim=1024)),  # AceStepConditionEncoder's defaults otherwise
    scheduler=dict(num_train_timesteps=1000),
    default_dtype="bfloat16",
    default_size=(1, 1500),
    max_sequence_length=256,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_ace_step.py): 2 layers, 4 query / 2
#: key-value heads of 8, patch 2, windows of 16
ACE_STEP_TINY = dataclasses.replace(
    ACE_STEP, name="ace-step-tiny",
    description="ACE-Step at diffusers' test configuration: 2 layers, 4 query / 2 key-value heads x 8, windows of 16; "
                "its pipeline test's condition encoder, Qwen3 and Oobleck VAE",
    transformer=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2,
                     rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=16),
    vae=dict(encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=3, decoder_input_channels=8,
             audio_channels=2, channel_multiples=[2, 4], sampling_rate=4),
    t5=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8),
    extra=dict(condition_encoder=dict(hidden_size=32, intermediate_size=64, text_hidden_dim=32, timbre_hidden_dim=8,
                                      num_lyric_encoder_hidden_layers=2, num_timbre_encoder_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                                      sliding_window=16)),
    default_dtype="float32", default_size=(1, 16), max_sequence_length=16)

def ace_step_components(arch: SynthArch, kit) -> dict:
    """AceStepPipeline's other components: the Oobleck VAE (``arch.vae``), a Qwen3 text model (``arch.t5``; the lyrics
    go through its embedding only) with a local Qwen2 tokenizer, and the condition encoder (``arch.extra``). No audio
    tokenizer or detokenizer (optional: cover and repaint tasks)."""
    import diffusers
    import transformers
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder

    from .qwenimage import qwen_tokenizer

    tokenizer = qwen_tokenizer(kit)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      max_position_embeddings=4096, **arch.t5)
    return dict(vae=kit.make(diffusers.AutoencoderOobleck, arch.vae, 1), tokenizer=tokenizer,
                text_encoder=kit.make(transformers.Qwen3Model, config, 3),
                condition_encoder=kit.make(AceStepConditionEncoder, arch.extra["condition_encoder"], 2),
                audio_tokenizer=None, audio_token_detokenizer=None)


ACE_STEP_ADAPTER = register(
    ModelAdapter(
        name="ace-step",
        class_names=("AceStepTransformer1DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("audio",),
            inputs={"layers.0": {"hidden_states": Split(dim=1, stream="audio", ndim=3)},
                    "layers.*": {"position_embeddings": Split(dim=0, stream="audio", ndim=2)}},
            gathers={"layers.-1": Gather(dim=1, stream="audio")},
            differs_from_cp_plan="the class has no _cp_plan; the patch tokens split where the layers start and "
                                 "gathered where they end, the band mask whole",
        ),
        attention=AttentionSelector(paths=("layers.*.self_attn", "layers.*.cross_attn")),
        sequence_processor=AceStepSequenceParallelProcessor,
        blocks=(BlockList("layers", ("hidden_states",), ("hidden_states",)),),
        example_inputs=ace_step_example_inputs,
        layout=ace_step_layout,
        text_tokens=256,
        batch_inputs=("hidden_states", "timestep", "timestep_r", "encoder_hidden_states", "context_latents"),
        cfg_mode="batched",  # one call on [cond, uncond]
        output_channel_dim=-1,
        out_channels=lambda model: model.config.audio_acoustic_hidden_dim,
        pipelines=("AceStepPipeline",),
        synth_archs=(ACE_STEP_TINY, ACE_STEP),
        synth_components=ace_step_components,
        pp_refusal="ACE-Step's layers carry one sequence split where they start and gathered where they end, under a "
                   "band mask PipeFusion does not take",
    )
)
