"""Stable Audio 3 (``StableAudio3DiTModel``; its text-to-audio, audio-to-audio and inpainting pipelines): a DiT over
audio latent samples with learned memory tokens before them and differential attention.

Where the tokens are: ``forward`` turns the prompt and duration into a cross-attention context and one global
modulation, projects the latent's samples (``[B, C, T]``, after a zero-initialized convolution) to tokens, puts the
``num_memory_tokens`` learned tokens before them, builds one partial RoPE table over the whole sequence (``[N, r]``),
runs the blocks, drops the memory tokens and projects back. For inpainting each block adds its projection of the
local conditioning (``local_seq``, ``[B, T, c]``) to the audio tokens, found after the first ``num_memory_tokens``.

Sequence plan: one stream, ``joint`` (memory then audio), split at the first block; at every block the RoPE table
with it, ``num_memory_tokens`` replaced by the memory tokens this rank holds and ``local_seq`` cut to the audio tokens
it holds (``Split.count``), so the block's own slicing finds this rank's audio; the last block's output gathered, so
the model drops the memory from the whole sequence. Attention: the self-attention's one or two attentions
(differential: ``Attn(Q1, K1, V) - Attn(Q2, K2, V)``) each through ``sp.attention``; the cross-attention (local
queries against the whole context) as diffusers'. CFG: one call on ``[uncond, cond]`` (batched). Tensor plan: every
attention by heads, its fused projections cut part by part whatever their count (three or five for the self-attention's
Q/K/V by checkpoint, ``use_differential_attention``), the SwiGLU by width (``STABLE_AUDIO3_TENSOR_PLAN``).

Sizes: an audio family has no image; ``width`` is the latent's length in samples (``height`` is ignored), and the
"text" is the cross-attention context, which is not split.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_stable_audio3 import _apply_rotary_partial

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register)


class StableAudio3SequenceParallelProcessor(SequenceProcessor):
    """Processor for Stable Audio 3's attention layers: the self-attention as diffusers'
    ``StableAudio3SelfAttnProcessor`` on local tokens, each softmax through ``sp.attention``; the cross-attention
    (``context`` given) as diffusers'."""

    def __call__(self, attn, hidden_states, rope=None, context=None, context_mask=None):
        if context is not None:
            return self.previous(attn, hidden_states, context=context, context_mask=context_mask)
        parts = attn.to_qkv(hidden_states).chunk(5 if attn.use_differential else 3, dim=-1)
        *qs_ks, v = (t.unflatten(-1, (attn.heads, attn.dim_heads)) for t in parts)
        pairs = len(qs_ks) // 2  # (q1, q2, k1, k2) or (q, k)
        qs = [_apply_rotary_partial(attn.q_norm(q), rope) for q in qs_ks[:pairs]]
        ks = [_apply_rotary_partial(attn.k_norm(k), rope) for k in qs_ks[pairs:]]
        outs = [self.sp.attention(q, k, v, backend=self._attention_backend) for q, k in zip(qs, ks)]
        out = outs[0] - outs[1] if attn.use_differential else outs[0]
        return attn.to_out(out.flatten(2, 3))


def stable_audio3_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one StableAudio3Pipeline step: ``width`` latent samples, ``text_len`` context tokens, the
    duration's global states and a timestep in [0, 1]."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, cfg.io_channels, width), timestep=torch.full((batch,), 0.7).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.cond_token_dim),
                global_hidden_states=rand(batch, cfg.global_cond_dim), return_dict=False)


def stable_audio3_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Stable Audio 3 call: ``width`` latent samples in patches, after the memory tokens, one
    sequence; the context (``text_tokens``) is not split."""
    audio = width // config.get("patch_size", 1)
    memory = config.get("num_memory_tokens", 64)
    return Layout(audio, text_tokens, audio + memory, (config.get("io_channels", 256), width))


#: Megatron-style: each attention column-parallel by heads and row-parallel at ``to_out``; its fused projections
#: (the self-attention's Q/K/V, the cross-attention's queries and keys/values: two or three parts without differential
#: attention, three or five with it) cut part by part, each part as wide as ``to_out``; the SwiGLU's value and gate
#: halves each cut on its own, ``proj_out`` row-parallel. Three all-reduces a block.
STABLE_AUDIO3_TENSOR_PLAN = TensorPlan(
    colwise=(),
    rowwise=("transformer_blocks.*.self_attn.to_out", "transformer_blocks.*.cross_attn.to_out",
             "transformer_blocks.*.ff.proj_out"),
    packed_colwise={"transformer_blocks.*.ff.proj_in": ("proj_out.in_features", "proj_out.in_features")},
    equal_parts_colwise={f"transformer_blocks.*.{name}": "to_out"
                         for name in ("self_attn.to_qkv", "cross_attn.to_q", "cross_attn.to_kv")},
    per_rank_attrs={"transformer_blocks.*.self_attn": ("heads",), "transformer_blocks.*.cross_attn": ("heads",)},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
STABLE_AUDIO3 = SynthArch(
    name="stable-audio-3",
    description="Stable Audio 3 transformer as diffusers' defaults (24 blocks, 24 heads x 64, differential attention, "
                "64 memory tokens), the SAME audio autoencoder, a one-layer T5Gemma encoder 768 wide, the duration "
                "embedder",
    pipeline="StableAudio3Pipeline",
    transformer_class="StableAudio3DiTModel",
    transformer=dict(io_channels=256, patch_size=1, embed_dim=1536, depth=24, num_heads=24, cond_token_dim=768,
                     global_cond_dim=768, num_memory_tokens=64, use_differential_attention=True),
    vae={},  # AutoencoderSAME's defaults
    clip={},
    # the T5Gemma encoder's one stack (its width the transformer's cond_token_dim)
    t5=dict(hidden_size=768, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            head_dim=96),
    extra=dict(duration=dict(output_dim=768)),  # the duration embedder (its width the transformer's global_cond_dim)
    scheduler=dict(shift=1.0, stochastic_sampling=False),
    default_dtype="bfloat16",
    default_size=(1, 1024),
    max_sequence_length=128,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_stable_audio3.py)
STABLE_AUDIO3_TINY = dataclasses.replace(
    STABLE_AUDIO3,
    name="stable-audio-3-tiny",
    description="Stable Audio 3 at diffusers' pipeline test configuration: 2 blocks, 4 heads x 8, 3 memory tokens, "
                "plain attention; its tiny SAME autoencoder (16 Hz stereo), T5Gemma and duration embedder",
    transformer=dict(io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4, cond_token_dim=16,
                     global_cond_dim=16, local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2,
                     num_memory_tokens=3, use_differential_attention=False),
    vae=dict(audio_channels=2, patch_size=2, encoder_channels=8, encoder_c_mults=[2], encoder_strides=[2],
             encoder_transformer_depths=[1], latent_dim=8, use_differential_attention=False, dim_heads=4, ff_mult=2,
             sampling_rate=16),
    t5=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8),
    extra=dict(duration=dict(output_dim=16, fourier_dim=16)),
    default_dtype="float32",
    default_size=(1, 16),
    max_sequence_length=8,
)

def stable_audio3_components(arch: SynthArch, kit) -> dict:
    """StableAudio3Pipeline's other components: AutoencoderSAME (``arch.vae``), a T5Gemma encoder (``arch.t5``: its one
    stack, as its pipeline test builds it) with a local Gemma tokenizer, and the duration embedder
    (``arch.extra["duration"]``)."""
    import diffusers
    import transformers
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder

    tokenizer = kit.gemma_tokenizer(arch.max_sequence_length, add_bos=True)
    stack = transformers.T5GemmaModuleConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=8192,
        layer_types=["full_attention"] * arch.t5["num_hidden_layers"], **arch.t5).to_dict()
    config = transformers.T5GemmaConfig(encoder=stack, decoder=stack, is_encoder_decoder=False,
                                        attn_implementation="eager")
    return dict(vae=kit.make(diffusers.AutoencoderSAME, arch.vae, 1), tokenizer=tokenizer,
                text_encoder=kit.make(transformers.T5GemmaEncoderModel, config, 3),
                duration_embedder=kit.make(StableAudio3DurationEmbedder, arch.extra["duration"], 2))


_JOINT = Split(dim=1, stream="joint", ndim=3)

STABLE_AUDIO3_ADAPTER = register(
    ModelAdapter(
        name="stable-audio-3",
        class_names=("StableAudio3DiTModel",),
        num_heads=lambda model: model.config.num_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"transformer_blocks.0": {"hidden_states": _JOINT},
                    "transformer_blocks.*": {"rope": Split(dim=0, stream="joint", ndim=2),
                                             "num_memory_tokens": Split(dim=1, stream="joint", count="first"),
                                             "local_seq": dataclasses.replace(_JOINT, count="last")}},
            gathers={"transformer_blocks.-1": Gather(dim=1, stream="joint")},
        ),
        attention=AttentionSelector(class_names=("StableAudio3SelfAttention", "StableAudio3CrossAttention")),
        sequence_processor=StableAudio3SequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",)),),
        token_wise=("transformer_blocks.*.ff",),
        tensor_plan=STABLE_AUDIO3_TENSOR_PLAN,
        example_inputs=stable_audio3_example_inputs,
        layout=stable_audio3_layout,
        text_tokens=128,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "global_hidden_states",
                      "encoder_attention_mask", "local_add_cond"),
        cfg_mode="batched",
        output_channel_dim=1,
        out_channels=lambda model: model.config.io_channels,
        pipelines=("StableAudio3Pipeline", "StableAudio3AudioToAudioPipeline", "StableAudio3InpaintPipeline"),
        synth_archs=(STABLE_AUDIO3_TINY, STABLE_AUDIO3),
        synth_components=stable_audio3_components,
        pp_refusal="Stable Audio 3's blocks find the audio after the memory tokens by a count; PipeFusion is not "
                   "tested on it",
    )
)
