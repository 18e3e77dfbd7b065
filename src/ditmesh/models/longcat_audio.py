"""LongCat-Audio-DiT (``LongCatAudioDiTTransformer``, LongCatAudioDiTPipeline): a DiT over audio latent frames with
self-attention, cross-attention to the text and one padding mask used two ways.

Where the tokens are: ``forward`` embeds the latent frames (``[B, T, C]``, zeroed where the mask ``[B, T]`` is
False) and the text, builds the RoPE tables of both (cos and sin ``[T, d]`` and ``[L, d]``), keeps a copy of the
tokens for the long skip, runs the blocks, adds the skip, normalizes, projects and zeroes the masked frames. In every
block the mask is the self-attention's key mask and, after the self- and the cross-attention, a multiplier zeroing
the masked frames' rows.

Sequence plan: the frames (``audio``) split at the first block and their RoPE table at every block (the text's stays
whole); the mask stays whole: the processor hands it to ``sp.attention`` as the key mask (one stream: the ranks'
order is the model's) and cuts this rank's rows from it for the multipliers (``base.token_range``). The last block's
output gathered, so the skip, the norm and the projection run on the whole sequence. Attention: the self-attention's
projections, QK-norms (over all heads) and RoPE on local tokens, the softmax through ``sp.attention``; the
cross-attention (local queries against the whole text) as diffusers', with its row multiplier made local.

Tensor plan: both attentions' Q/K/V column- and ``to_out.0`` row-parallel, their QK-norms sharded, the feed-forward
column -> row: 7 all-reduces a block. CFG: the prompt's call, then the negative prompt's (sequential).

Sizes: an audio family has no image; ``width`` is the latent's length in frames (``height`` is ignored), and the
"text" is the cross-attention context, which is not split.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_longcat_audio_dit import _apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, token_range, vae_and_t5)


class LongCatAudioSequenceParallelProcessor(SequenceProcessor):
    """Processor for ``AudioDiTAttention``: the self-attention as diffusers' ``AudioDiTSelfAttnProcessor`` on local
    tokens with the softmax through ``sp.attention`` under the whole key mask; both attentions' row multipliers cut to
    this rank's frames."""

    def local_rows(self, mask, local: int):
        """This rank's rows of the whole frame mask ``[B, T]`` (None stays None)."""
        if mask is None:
            return None
        first, _ = token_range(self.sp, "audio", local)
        return mask[:, first:first + local]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, post_attention_mask=None, attention_mask=None,
                 audio_rotary_emb=None, prompt_rotary_emb=None):
        local = hidden_states.shape[1]
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 post_attention_mask=self.local_rows(post_attention_mask, local),
                                 attention_mask=attention_mask, audio_rotary_emb=audio_rotary_emb,
                                 prompt_rotary_emb=prompt_rotary_emb)
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        head_dim = attn.inner_dim // attn.heads
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
        if audio_rotary_emb is not None:
            q, k = _apply_rotary_emb(q, audio_rotary_emb), _apply_rotary_emb(k, audio_rotary_emb)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)
        if attention_mask is not None:
            out = out * self.local_rows(attention_mask, local)[:, :, None, None].to(out.dtype)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))


def longcat_audio_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one LongCatAudioDiTPipeline step: ``width`` latent frames (all valid), ``text_len``
    text states and their mask, a timestep in [0, 1]."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, width, cfg.latent_dim), encoder_hidden_states=rand(batch, text_len,
                                                                                             cfg.dit_text_dim),
                encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.bool, device=device),
                timestep=torch.full((batch,), 0.7).to(device, dtype),
                attention_mask=torch.ones(batch, width, dtype=torch.bool, device=device), return_dict=False)


def longcat_audio_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a LongCat-Audio-DiT call: ``width`` latent frames, one token each; the text is not split."""
    return Layout(width, text_tokens, width, (width, config.get("latent_dim", 64)))


def _each(*suffixes: str) -> tuple[str, ...]:
    return tuple(f"blocks.*.{suffix}" for suffix in suffixes)


#: the ``?`` patterns: a checkpoint without cross-attention or without QK-norms
LONGCAT_AUDIO_TENSOR_PLAN = TensorPlan(
    colwise=_each("self_attn.to_q", "self_attn.to_k", "self_attn.to_v", "cross_attn.to_q?", "cross_attn.to_k?",
                  "cross_attn.to_v?", "ffn.ff.0"),
    rowwise=_each("self_attn.to_out.0", "cross_attn.to_out.0?", "ffn.ff.3"),
    per_rank_attrs={pattern: ("heads", "inner_dim") for pattern in _each("self_attn", "cross_attn?")},
    sharded_norms=_each("self_attn.q_norm?", "self_attn.k_norm?", "cross_attn.q_norm?", "cross_attn.k_norm?"),
)

# -- synthetic architectures ---------------------------------------------------------------------------------
LONGCAT_AUDIO = SynthArch(
    name="longcat-audio-dit",
    description="LongCat-Audio-DiT transformer as diffusers' defaults (24 blocks, 24 heads x 64, text width 768, long "
                "skip, text ConvNeXt), its audio VAE (24 kHz mono, 2048x), a one-layer UMT5 of UMT5-base's width",
    pipeline="LongCatAudioDiTPipeline",
    transformer_class="LongCatAudioDiTTransformer",
    transformer=dict(dit_dim=1536, dit_depth=24, dit_heads=24, dit_text_dim=768, latent_dim=64),
    vae={},  # LongCatAudioDiTVae's defaults
    clip={},
    t5=dict(d_model=768, d_kv=64, d_ff=256, num_layers=1, num_heads=12),
    # the pipeline's own (it replaces any other with this one)
    scheduler=dict(shift=1.0, invert_sigmas=True),
    default_dtype="bfloat16",
    default_size=(1, 1024),
    max_sequence_length=256,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_longcat_audio_dit.py)
LONGCAT_AUDIO_TINY = dataclasses.replace(
    LONGCAT_AUDIO,
    name="longcat-audio-dit-tiny",
    description="LongCat-Audio-DiT at diffusers' test configuration: 2 blocks, 4 heads x 16, text width 32, no text "
                "ConvNeXt; its pipeline test's VAE at 8 Hz, UMT5",
    transformer=dict(dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8, text_conv=False),
    # the pipeline test's VAE (2x) at 8 samples a second: the clip's length, which the pipeline reads off the prompt
    # (0.082 s a character), is then some 4 latent frames a second of speech
    vae=dict(in_channels=1, channels=16, c_mults=[1, 2], strides=[2], latent_dim=8, encoder_latent_dim=16,
             downsampling_ratio=2, sample_rate=8),
    t5=dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(1, 16),
    max_sequence_length=10,
)

LONGCAT_AUDIO_ADAPTER = register(
    ModelAdapter(
        name="longcat-audio-dit",
        class_names=("LongCatAudioDiTTransformer",),
        num_heads=lambda model: model.config.dit_heads,
        sequence_plan=SequencePlan(
            streams=("audio",),
            inputs={"blocks.0": {"hidden_states": Split(dim=1, stream="audio", ndim=3)},
                    "blocks.*": {"rope": Split(dim=0, stream="audio", ndim=2)}},
            gathers={"blocks.-1": Gather(dim=1, stream="audio")},
        ),
        attention=AttentionSelector(class_names=("AudioDiTAttention",)),
        sequence_processor=LongCatAudioSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",), ("audio",)),),
        token_wise=("blocks.*.ffn",),
        example_inputs=longcat_audio_example_inputs,
        layout=longcat_audio_layout,
        text_tokens=256,
        tensor_plan=LONGCAT_AUDIO_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_attention_mask", "timestep", "attention_mask",
                      "latent_cond"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=-1,
        out_channels=lambda model: model.config.latent_dim,
        pipelines=("LongCatAudioDiTPipeline",),
        synth_archs=(LONGCAT_AUDIO_TINY, LONGCAT_AUDIO),
        synth_components=vae_and_t5("LongCatAudioDiTVae", "UMT5EncoderModel", "UMT5Config"),
        pp_refusal="LongCat-Audio-DiT's long skip adds the embedded input after its blocks; PipeFusion is not tested "
                   "on it",
    )
)
