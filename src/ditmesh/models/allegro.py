"""Allegro (``AllegroTransformer3DModel``, ``AllegroPipeline``): video self-attention with a 3-D RoPE, cross-attention
to T5 text under its padding mask, adaLN-single modulation, all through diffusers' generic ``Attention``.

Where the tokens are: ``forward`` patchifies each latent frame (``pos_embed``, a 2-D patch embedding over
``[B * F, C, H, W]``, no position table) and flattens frames and patches into ``[B, N, D]`` video tokens, which
``transformer_blocks.0`` is the first to see; it unpatchifies after ``proj_out``. The pipeline builds the RoPE once per
call: ``image_rotary_emb = ((t, h, w) frequency tables, (t, h, w) token positions)``, the tables indexed by each
token's position, the positions ``[1, N]`` per axis. The sequence plan splits

- the positions at the entry (``Split(item=1)``: the tables stay whole, every rank looks up its tokens' rows);
- the video tokens at the input of ``transformer_blocks.0``;

and gathers at the output of ``proj_out``. diffusers has no ``_cp_plan`` or ``_tp_plan`` for this class.

Attention: ``attn1`` is self-attention over the video tokens (with the model's optional ``attention_mask`` over them,
a key bias the pipeline never passes, handed to ``sp.attention`` whole in the model's order); ``attn2`` is
cross-attention to the whole text under ``encoder_attention_mask``: local queries against every text key give exactly
the local rows, so the model's own processor runs it. CFG: ``AllegroPipeline`` runs ``[uncond, cond]`` in one call
(batched) when ``guidance_scale > 1``. Tensor plan (plain Megatron, as PixArt's): Q/K/V column-parallel, ``to_out.0``
row-parallel, feed-forward column -> row: 3 all-reduces per block; the RoPE rotates within each head, so it fits any
head count.

Frames: the Allegro VAE compresses time 4x and decodes only tiled (``enable_tiling``), in tiles of 24 frames every 16,
so a call's video is whole for ``16k + 24`` frames (88 by default: 22 latent frames).
"""

from __future__ import annotations

import dataclasses
import types

import torch
from diffusers.models.embeddings import apply_rotary_emb_allegro

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent, vae_and_t5)
from .pixart import PixArtSequenceParallelProcessor


class AllegroSequenceParallelProcessor(PixArtSequenceParallelProcessor):
    """Processor for the ``Attention`` layers of ``AllegroTransformerBlock``: self-attention sequence-parallel,
    cross-attention local (PixArt's, with Allegro's RoPE and mask layout).

    Self-attention projects the local tokens as diffusers' ``AllegroAttnProcessor2_0`` does and rotates them with
    their own positions (split at the entry) in the whole frequency tables; only the softmax attention runs through
    ``sp.attention``, with the model's ``attention_mask`` (a ``[B, 1, N]`` bias over every video key, global order) if
    any. Cross-attention (``encoder_hidden_states`` given) goes to the previous processor unchanged.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, temb, image_rotary_emb)
        head_dim = attn.inner_dim // attn.heads  # unchanged by tensor parallelism, which divides both
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if image_rotary_emb is not None:  # diffusers rotates [B, H, S, D]
            q, k = (apply_rotary_emb_allegro(t.transpose(1, 2), *image_rotary_emb).transpose(1, 2) for t in (q, k))
        mask = None if attention_mask is None else attention_mask.unsqueeze(1)  # [B, 1, N] -> [B, 1, 1, N]
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=mask)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor


#: the Allegro VAE's 4x time compression and its tiled decode's first tile (24 frames) and tile stride (16 frames)
ALLEGRO_TEMPORAL, ALLEGRO_FIRST_FRAMES, ALLEGRO_FRAME_STEP = 4, 24, 16


def allegro_latent_frames(frames: int) -> int:
    """Latent frames of an AllegroPipeline call of ``frames`` frames, as its ``prepare_latents`` counts them."""
    if frames % 2 == 0:
        return -(-frames // ALLEGRO_TEMPORAL)
    return -(-(frames - 1) // ALLEGRO_TEMPORAL) + 1


def allegro_rotary_emb(model, height: int, width: int, latent_frames: int, device) -> tuple:
    """The ``image_rotary_emb`` AllegroPipeline builds for a call (its own method, on this transformer's config)."""
    from diffusers import AllegroPipeline

    pipe = types.SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    return AllegroPipeline._prepare_rotary_positional_embeddings(pipe, 1, height, width, latent_frames, device)


def allegro_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one AllegroPipeline denoising step (default 88 frames): latents ``[B, 4, F, H/8, W/8]``,
    T5 text embeddings with a mask over a prompt filling half the padded text, the pipeline's RoPE tables and
    positions."""
    cfg = model.config
    latent_frames = allegro_latent_frames(frames or 88)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.zeros(batch, text_len)
    mask[:, : max(1, text_len // 2)] = 1
    return dict(
        hidden_states=rand(batch, cfg.in_channels, latent_frames, height // 8, width // 8),
        encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
        timestep=torch.full((batch,), 700, dtype=torch.long, device=device),
        encoder_attention_mask=mask.to(device, dtype),
        image_rotary_emb=allegro_rotary_emb(model, height, width, latent_frames, device),
        return_dict=False,
    )


def allegro_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an AllegroPipeline call: 8x spatial and 4x temporal VAE, then ``patch_size`` patches. Text is
    cross-attention context only, so the split sequence is the video tokens."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"Allegro (8x VAE, patch {patch})")
    if frames < 1:
        raise ValueError(f"frames={frames} must be >= 1")
    latent_frames = allegro_latent_frames(frames)
    video = latent_frames // config.get("patch_size_t", 1) * (lh // patch) * (lw // patch)
    return Layout(video, text_tokens, video, (config.get("in_channels", 4), latent_frames, lh, lw))


def allegro_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of a block's self-attention: ``norm1`` shifted and scaled by the first two of the block's six
    adaLN-single modulations (its ``scale_shift_table`` plus the model's per-sample timestep vector)."""
    hidden = named["hidden_states"]
    modulation = block.scale_shift_table[None] + named["temb"].reshape(hidden.shape[0], 6, -1)
    return block.norm1(hidden) * (1 + modulation[:, 1:2]) + modulation[:, 0:1]


_ATTENTIONS = ("attn1", "attn2")
ALLEGRO_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"transformer_blocks.*.{a}.{p}" for a in _ATTENTIONS for p in ("to_q", "to_k", "to_v"))
    + ("transformer_blocks.*.ff.net.0.proj",),
    rowwise=tuple(f"transformer_blocks.*.{a}.to_out.0" for a in _ATTENTIONS) + ("transformer_blocks.*.ff.net.2",),
    per_rank_attrs={f"transformer_blocks.*.{a}": ("heads", "inner_dim") for a in _ATTENTIONS},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: the scheduler rhymes-ai/Allegro ships: Euler ancestral, v-prediction on the linear beta schedule
_ALLEGRO_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                          prediction_type="v_prediction", timestep_spacing="linspace", steps_offset=0)

ALLEGRO = SynthArch(
    name="allegro",
    description="Allegro transformer (32 blocks, 24 heads x 96, 2.8B params), full Allegro VAE, one-layer "
                "T5-XXL-wide encoder",
    pipeline="AllegroPipeline",
    transformer_class="AllegroTransformer3DModel",
    transformer=dict(patch_size=2, patch_size_t=1, num_attention_heads=24, attention_head_dim=96, in_channels=4,
                     out_channels=4, num_layers=32, dropout=0.0, cross_attention_dim=2304, attention_bias=True,
                     sample_height=90, sample_width=160, sample_frames=22, activation_fn="gelu-approximate",
                     norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096, interpolation_scale_h=2.0,
                     interpolation_scale_w=2.0, interpolation_scale_t=2.2),
    vae={},  # AutoencoderKLAllegro's defaults are rhymes-ai/Allegro's VAE
    clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # T5-XXL's width, one layer
    scheduler=_ALLEGRO_SCHEDULER,
    scheduler_class="EulerAncestralDiscreteScheduler",
    default_dtype="bfloat16",
    default_size=(720, 1280),
    max_sequence_length=512,
    default_frames=88,
)

_ALLEGRO_TINY = dataclasses.replace(
    ALLEGRO,
    name="allegro-tiny",
    description="Allegro architecture shrunk for CPU tests: 2 blocks, 6 heads x 24 (3-D RoPE of 3 x 8 channels), tiny "
                "Allegro VAE (tiles of 128 px)",
    transformer=dict(ALLEGRO.transformer, num_attention_heads=6, attention_head_dim=24, num_layers=2,
                     cross_attention_dim=144, caption_channels=64, sample_height=16, sample_width=16, sample_frames=6),
    vae=dict(block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1, sample_size=128),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(128, 128),
    max_sequence_length=32,
    default_frames=24,
)

ALLEGRO_ARCHS = (
    ALLEGRO,
    _ALLEGRO_TINY,
    dataclasses.replace(
        _ALLEGRO_TINY,
        name="allegro-tiny-tp",
        description="allegro-tiny with 4 heads x 24 (96 wide), so tensor parallelism of degree 4 divides the heads",
        transformer=dict(_ALLEGRO_TINY.transformer, num_attention_heads=4, cross_attention_dim=96),
    ),
)


ALLEGRO_ADAPTER = register(
    ModelAdapter(
        name="allegro",
        class_names=("AllegroTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"": {"image_rotary_emb": Split(dim=1, stream="video", ndim=2, item=1)},
                    "transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(class_names=("Attention",)),
        sequence_processor=AllegroSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("transformer_blocks.*.ff",),
        modulated_input=allegro_modulated_input,
        example_inputs=allegro_example_inputs,
        layout=allegro_layout,
        text_tokens=512,  # AllegroPipeline's max_sequence_length
        tensor_plan=ALLEGRO_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "attention_mask"),
        cfg_mode="batched",  # AllegroPipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=ALLEGRO_FRAME_STEP,
        first_frames=ALLEGRO_FIRST_FRAMES,
        fps=15,  # Allegro's 88 frames are 6 s at 15 fps
        pipelines=("AllegroPipeline",),
        synth_archs=ALLEGRO_ARCHS,
        synth_components=vae_and_t5("AutoencoderKLAllegro"),
        vae_tiled_only=True,
    )
)
