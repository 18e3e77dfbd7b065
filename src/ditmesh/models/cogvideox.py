"""CogVideoX 1.0 / 1.5 (``CogVideoXTransformer3DModel``): one attention over ``[text, video]`` in every block.

Where the tokens are: ``patch_embed`` projects the text embeddings and patchifies the latent, joins them as
``[text, video]`` (CogVideoX 1.0 without RoPE, e.g. 2B, adds its sine-cosine positions there, over the whole
sequence) and ``forward`` cuts them apart again before the blocks; each block modulates both streams, attends over
their concatenation, rotates only the video tokens (``image_rotary_emb``, a table the pipeline computes for the video
tokens, CogVideoX 1.0 5B and 1.5) and runs one feed-forward over both. ``proj_out``'s output is unpatchified
(1.5 also in time, ``patch_size_t``). diffusers gives the class no ``_cp_plan``. The sequence plan splits

- the RoPE table (``image_rotary_emb``, cos and sin ``[video, D]``) at the entry, with the video stream;
- the video (``hidden_states``) and text (``encoder_hidden_states``) tokens at the input of ``transformer_blocks.0``,
  each stream on its own (480x720x49 has 17,550 video tokens and 226 text tokens);

and gathers ``proj_out``'s output. ``patch_embed`` runs whole on every rank (its positions cover the whole joined
sequence). No mask: the pipeline pads every prompt to ``max_sequence_length`` and attends over the padding.

Tensor plan (diffusers gives none): Q/K/V and the feed-forward's first linear column-parallel, ``to_out.0`` and the
feed-forward's second linear row-parallel: 2 all-reduces per block; the QK-norms are LayerNorms over one head. CFG:
one call on ``[uncond, cond]`` per step (batched), on with ``guidance_scale > 1``.

The VAE (``AutoencoderKLCogVideoX``) decodes split along height (``COGVIDEOX_VAE_PLAN``); it encodes whole.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, VaePlan, register, spatial_latent, temporal_latent)


class CogVideoXSequenceParallelProcessor:
    """Attention processor for CogVideoX's joint attention whose core attention runs sequence-parallel.

    Projections of the local ``[text, video]`` tokens, per-head QK LayerNorms and RoPE on the local video tokens as
    diffusers' ``CogVideoXAttnProcessor2_0`` computes them; only the softmax attention goes through ``sp.attention``.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("CogVideoX's pipelines pass no attention mask; ditmesh's CogVideoX processor "
                                      "takes none")
        text_len = encoder_hidden_states.shape[1]
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        q, k, v = (linear(joint).unflatten(2, (attn.heads, -1)) for linear in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:  # the video tokens only, after the text
            q = torch.cat([q[:, :text_len], apply_rotary_emb(q[:, text_len:], image_rotary_emb, sequence_dim=1)], dim=1)
            k = torch.cat([k[:, :text_len], apply_rotary_emb(k[:, text_len:], image_rotary_emb, sequence_dim=1)], dim=1)
        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))
        text_out, video_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        return video_out, text_out


def cogvideox_rotary_table(model, height: int, width: int, latent_frames: int, device):
    """The RoPE table CogVideoXPipeline passes for a ``height`` x ``width`` video of ``latent_frames`` latent frames
    (the pipeline's own function, on the model's config), or None for a checkpoint without RoPE (CogVideoX 1.0 2B)."""
    from diffusers import CogVideoXPipeline

    if not model.config.use_rotary_positional_embeddings:
        return None
    owner = types.SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(owner, height, width, latent_frames, device)


def cogvideox_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one CogVideoXPipeline denoising step: random latents ``[B, frames, C, H/8, W/8]`` with
    ``(frames - 1) // 4 + 1`` latent frames (default 49 frames; 1.5 pads them to a multiple of ``patch_size_t`` as its
    pipeline does), text embeddings (``max_text_seq_length`` of them where the model adds positions over the text,
    CogVideoX 1.0 2B) and the pipeline's RoPE table."""
    cfg = model.config
    text_len = cogvideox_text_tokens(cfg, text_len)
    frames = frames or 49
    latent_frames = (frames - 1) // 4 + 1
    if cfg.patch_size_t is not None:
        latent_frames += -latent_frames % cfg.patch_size_t
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    rope = cogvideox_rotary_table(model, height, width, latent_frames, device)
    return dict(
        hidden_states=rand(batch, latent_frames, cfg.in_channels, height // 8, width // 8),
        encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
        timestep=torch.full((batch,), 700, dtype=torch.int64, device=device),
        image_rotary_emb=None if rope is None else tuple(t.to(device, dtype) for t in rope),
        return_dict=False,
    )


def cogvideox_text_tokens(config, text_tokens: int) -> int:
    """The text tokens a checkpoint takes: without RoPE (CogVideoX 1.0 2B) ``patch_embed`` adds sine-cosine positions
    over exactly ``max_text_seq_length`` text tokens; with RoPE any count."""
    if config.get("use_rotary_positional_embeddings", False):
        return text_tokens
    return config.get("max_text_seq_length", 226)


def cogvideox_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a CogVideoXPipeline call: 8x spatial and 4x temporal VAE, ``patch_size`` patches (and
    ``patch_size_t`` frames in 1.5, after the pipeline pads the latent frames). 480x720x49: 13 x 30 x 45 = 17,550
    video tokens. Text and video are both split (joint attention)."""
    p, pt = config.get("patch_size", 2), config.get("patch_size_t") or 1
    lh, lw = spatial_latent(height, width, 8 * p, f"CogVideoX (8x VAE, {p}x{p} patches)")
    latent_frames = temporal_latent(frames, 4, "CogVideoX's 4x temporal VAE")
    latent_frames += -latent_frames % pt
    video = (latent_frames // pt) * (lh // p) * (lw // p)
    text_tokens = cogvideox_text_tokens(config, text_tokens)
    return Layout(video, text_tokens, video + text_tokens, (latent_frames, config.get("in_channels", 16), lh, lw))


def cogvideox_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first block's modulated video stream: ``norm1``'s first output."""
    return block.norm1(named["hidden_states"], named["encoder_hidden_states"], named["temb"])[0]


COGVIDEOX_TENSOR_PLAN = TensorPlan(
    colwise=("transformer_blocks.*.attn1.to_q", "transformer_blocks.*.attn1.to_k", "transformer_blocks.*.attn1.to_v",
             "transformer_blocks.*.ff.net.0.proj"),
    rowwise=("transformer_blocks.*.attn1.to_out.0", "transformer_blocks.*.ff.net.2"),
    per_rank_attrs={"transformer_blocks.*.attn1": ("heads",)},
)


#: The CogVideoX VAE's decode split along height. It decodes two latent frames at a time with a causal temporal cache
#: that each rank keeps for its own rows (the cache is joined to the input in time, before the convolution whose rows
#: the halos extend); its causal convolutions pad height through ``conv.padding``, its group norms (also inside the
#: decoder's spatial norms) take statistics over the ranks, and the spatial norms' nearest resize of the latent to a
#: level's rows maps local rows to local rows. Encode runs whole on every rank (``encode_method`` names no method):
#: its downsamplers zero-pad the bottom row before their convolution inside a parent module, which the parallel VAE
#: finds only for diffusers' ``Downsample2D``.
COGVIDEOX_VAE_PLAN = VaePlan(
    class_names=("AutoencoderKLCogVideoX",),
    spatial_factor=lambda vae: 2 ** (len(vae.config.block_out_channels) - 1),
    encode_method="",
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: CogVideoX-5b's scheduler (THUDM/CogVideoX-5b ``scheduler_config.json``)
COGVIDEOX_SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                           num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                           set_alpha_to_one=True, snr_shift_scale=1.0, steps_offset=0, timestep_spacing="trailing")

COGVIDEOX_5B = SynthArch(
    name="cogvideox-5b",
    description="CogVideoX-5B transformer (42 blocks, 48 heads x 64, 3-D RoPE), full CogVideoX VAE, small T5",
    pipeline="CogVideoXPipeline",
    transformer_class="CogVideoXTransformer3DModel",
    transformer=dict(activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64, dropout=0.0,
                     flip_sin_to_cos=True, freq_shift=0, in_channels=16, max_text_seq_length=226,
                     norm_elementwise_affine=True, norm_eps=1e-5, num_attention_heads=48, num_layers=42,
                     out_channels=16, patch_size=2, sample_frames=49, sample_height=60, sample_width=90,
                     spatial_interpolation_scale=1.875, temporal_compression_ratio=4, temporal_interpolation_scale=1.0,
                     text_embed_dim=4096, time_embed_dim=512, timestep_activation_fn="silu",
                     use_learned_positional_embeddings=False, use_rotary_positional_embeddings=True),
    vae=dict(scaling_factor=0.7),  # AutoencoderKLCogVideoX's defaults otherwise
    clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # T5-XXL's width, one layer
    scheduler=COGVIDEOX_SCHEDULER,
    scheduler_class="CogVideoXDDIMScheduler",
    default_dtype="bfloat16",
    default_size=(480, 720),
    max_sequence_length=226,
    default_frames=49,
)

#: diffusers' test configuration (tests/pipelines/cogvideo) with 4 heads of 16, so that tp 2 and 4 divide them
COGVIDEOX_TINY = dataclasses.replace(
    COGVIDEOX_5B,
    name="cogvideox-tiny",
    description="CogVideoX-5B architecture shrunk for CPU tests: 2 blocks, 4 heads x 16, 3-D RoPE, a tiny CogVideoX "
                "VAE and T5",
    transformer=dict(COGVIDEOX_5B.transformer, num_attention_heads=4, attention_head_dim=16, in_channels=4,
                     out_channels=4, time_embed_dim=8, text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8,
                     sample_frames=9, max_text_seq_length=32),
    vae=dict(down_block_types=["CogVideoXDownBlock3D"] * 4, up_block_types=["CogVideoXUpBlock3D"] * 4,
             block_out_channels=[8, 8, 8, 8], latent_channels=4, layers_per_block=1, norm_num_groups=2,
             temporal_compression_ratio=4),
    t5=dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
    default_frames=5,
)


COGVIDEOX_ARCHS = (
    COGVIDEOX_5B,
    COGVIDEOX_TINY,
    dataclasses.replace(
        COGVIDEOX_TINY,
        name="cogvideox-2b-tiny",
        description="cogvideox-tiny as CogVideoX 1.0 2B: no RoPE, sine-cosine positions added in patch_embed",
        transformer=dict(COGVIDEOX_TINY.transformer, use_rotary_positional_embeddings=False),
    ),
    dataclasses.replace(
        COGVIDEOX_TINY,
        name="cogvideox1.5-tiny",
        description="cogvideox-tiny as CogVideoX 1.5: 2 latent frames a patch (patch_size_t), RoPE over the patches",
        transformer=dict(COGVIDEOX_TINY.transformer, patch_size_t=2),
    ),
)


def cogvideox_components(arch: SynthArch, kit) -> dict:
    """CogVideoXPipeline's other components: AutoencoderKLCogVideoX and a T5 text encoder with a T5 tokenizer."""
    import diffusers
    import transformers

    t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
    return dict(vae=kit.make(diffusers.AutoencoderKLCogVideoX, arch.vae, 1),
                text_encoder=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer=t5_tok)


COGVIDEOX = register(
    ModelAdapter(
        name="cogvideox",
        class_names=("CogVideoXTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "video"),
            inputs={"": {"image_rotary_emb": Split(dim=0, stream="video", ndim=2)},
                    "transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1",)),
        sequence_processor=CogVideoXSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states"), ("video", "text")),),
        token_wise=("transformer_blocks.*.ff",),
        modulated_input=cogvideox_modulated_input,
        example_inputs=cogvideox_example_inputs,
        layout=cogvideox_layout,
        text_tokens=226,  # T5, every prompt padded to max_sequence_length
        tensor_plan=COGVIDEOX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep"),
        cfg_mode="batched",  # one call on [uncond, cond]
        output_channel_dim=2,  # [B, frames, C, H, W]
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,  # the CogVideoX VAE compresses time 4x: 4k+1 frames
        fps=8,  # CogVideoX 1.0 is trained on 8 fps clips (49 frames, 6 s)
        pipelines=("CogVideoXPipeline",),
        synth_archs=COGVIDEOX_ARCHS,
        synth_components=cogvideox_components,
        vae=COGVIDEOX_VAE_PLAN,
    )
)
