"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``): joint image+text attention, MMDiT.

Where the tokens are: the model patchifies inside ``forward`` (``pos_embed`` turns the latent
``[B, C, H, W]`` into ``[B, N, D]`` image tokens and adds the cropped position table), and unpatchifies
after ``proj_out``. So the image stream is split at the output of ``pos_embed`` and gathered at the
output of ``proj_out`` (the plan's ``outputs`` and ``gathers``); positions are already added to the tokens, so
nothing else travels with them. Text tokens (``encoder_hidden_states``) exist at the entry and are split
there as their own stream; ``context_embedder`` is per token.

Attention: ``JointAttnProcessor2_0`` concatenates ``[image, text]`` (image first) for Q, K and V. Each
rank does the same with its local chunks, so the full sequence a rank attends over is
``[rank0 image, rank0 text, rank1 image, ...]``, a permutation of the single-GPU order, which unmasked
softmax attention does not see. SD3.5 adds per-head RMS QK-norms (``norm_q``, ``norm_k``,
``norm_added_q``, ``norm_added_k``: computed on local tokens, they act per token) and, in the blocks of
``dual_attention_layers``, a second image-only self-attention ``attn2``: it attends over the image stream
alone (``streams=("image",)``). The last block is ``context_pre_only``: its text output is dropped.

diffusers has no ``_cp_plan`` for this class; the plan below is ours. This file is everything ditmesh knows
about SD3: the plans, the processor, the blocks, example inputs, the planner's layout, the synthetic
architectures.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, norm1_modulated_input, register, spatial_latent)
from .flux import FLUX_VAE, KL_VAE_PLAN


class SD3SequenceParallelProcessor:
    """Attention processor for SD3's ``Attention`` layers whose core attention runs sequence-parallel.

    Projections and QK-norms are computed on local tokens as in diffusers' ``JointAttnProcessor2_0``;
    only the softmax attention goes through ``sp.attention``.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError("ditmesh sequence parallelism does not support an attention_mask for SD3")

        # By head_dim (a ratio tensor parallelism leaves unchanged), so the local heads of a tp rank unflatten
        # right whatever width the projections have.
        head_dim = attn.inner_dim // attn.heads

        def heads(t):
            return t.unflatten(-1, (-1, head_dim))  # [B, S, H, D]

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        joint = encoder_hidden_states is not None
        if joint:
            eq = heads(attn.add_q_proj(encoder_hidden_states))
            ek = heads(attn.add_k_proj(encoder_hidden_states))
            ev = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)

        streams = None if joint else ("image",)  # attn2 of SD3.5's dual-attention blocks: image tokens only
        out = self.sp.attention(q, k, v, backend=self._attention_backend, streams=streams)
        out = out.flatten(2, 3).to(q.dtype)

        image_len = hidden_states.shape[1]
        image_out = attn.to_out[1](attn.to_out[0](out[:, :image_len].contiguous()))
        if not joint:
            return image_out
        text_out = out[:, image_len:].contiguous()
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out


def sd3_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one StableDiffusion3Pipeline denoising step (random latents and text embeddings)."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        pooled_projections=rand(batch, cfg.pooled_projection_dim),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        return_dict=False,
    )


def sd3_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a StableDiffusion3Pipeline call: the VAE divides by 8, then ``patch_size`` patches."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"SD3 (8x VAE, patch {patch})")
    image = (lh // patch) * (lw // patch)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 16), lh, lw))


#: Tensor plan (plain Megatron). Joint attention: image Q/K/V and the text-stream ``add_{q,k,v}_proj`` column-
#: parallel, ``to_out.0`` and ``to_add_out`` row-parallel; both FFNs column -> row. SD3.5's dual-attention
#: ``attn2`` (image-only) likewise. The last block is ``context_pre_only``: it has no ``to_add_out`` and no
#: ``ff_context`` (its text output is dropped), so the patterns simply match nothing there, and its add_*
#: projections stay column-parallel (text keys/values of the local heads). Per block: 4 all-reduces, 5 with
#: ``attn2``, 2 for the ``context_pre_only`` block. AdaLN (``norm1``, ``norm1_context``, ``norm_out``), the
#: embedders and ``proj_out`` stay replicated; SD3.5's QK-norms are per head. ``inner_dim`` is divided with
#: ``heads`` so that ``inner_dim // heads`` stays the head dim. Patterns ending in ``?`` may match nothing
#: (SD3 medium has no ``attn2``).
SD3_TENSOR_PLAN = TensorPlan(
    colwise=tuple(
        f"transformer_blocks.*.{attn}.{proj}"
        for attn, projs in (("attn", ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")),
                            ("attn2", ("to_q?", "to_k?", "to_v?")))
        for proj in projs
    ) + ("transformer_blocks.*.ff.net.0.proj", "transformer_blocks.*.ff_context.net.0.proj"),
    rowwise=(
        "transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.attn.to_add_out",
        "transformer_blocks.*.attn2.to_out.0?",
        "transformer_blocks.*.ff.net.2", "transformer_blocks.*.ff_context.net.2",
    ),
    per_rank_attrs={"transformer_blocks.*.attn": ("heads", "inner_dim"),
                    "transformer_blocks.*.attn2?": ("heads", "inner_dim")},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
_SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)

#: SD3's VAE: FLUX's AutoencoderKL layout (16 latent channels) with SD3's latent scaling
_SD3_VAE = dict(FLUX_VAE, scaling_factor=1.5305, shift_factor=0.0609)

SD35_LARGE = SynthArch(
    name="sd3.5-large",
    description="SD3.5-Large transformer (38 joint blocks, 38 heads x 64, RMS QK-norm, 8.1B params), full SD3 VAE",
    pipeline="StableDiffusion3Pipeline",
    transformer_class="SD3Transformer2DModel",
    transformer=dict(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=38,
        attention_head_dim=64,
        num_attention_heads=38,
        joint_attention_dim=4096,
        caption_projection_dim=2432,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=192,
        dual_attention_layers=[],
        qk_norm="rms_norm",
    ),
    vae=_SD3_VAE,
    # real widths: CLIP-L 768 (pooled 768), CLIP-G 1280 (pooled 1280), T5-XXL 4096; 2 CLIP layers (SD3 reads
    # CLIP's penultimate layer), 1 T5 layer
    clip=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=12, projection_dim=768),
    clip_2=dict(hidden_size=1280, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=20,
                projection_dim=1280),
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
    scheduler=_SD3_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=256,
)

_SD3_TINY = dataclasses.replace(
    SD35_LARGE,
    name="sd3-tiny",
    description="SD3.5 architecture shrunk for CPU tests: 3 joint blocks (block 0 dual-attention, "
                "RMS QK-norm, last context_pre_only), 6 heads x 16",
    transformer=dict(SD35_LARGE.transformer, sample_size=8, num_layers=3, attention_head_dim=16, num_attention_heads=6,
                     joint_attention_dim=64, caption_projection_dim=96, pooled_projection_dim=32,
                     pos_embed_max_size=16, dual_attention_layers=[0]),
    vae=dict(_SD3_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    # CLIP-L and CLIP-G: hidden 16 + 32 = 48 <= T5 width 64 (the pipeline zero-pads CLIP to T5's width);
    # pooled 16 + 16 = 32 = pooled_projection_dim
    clip=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, projection_dim=16),
    clip_2=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=16),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)

SD3_ARCHS = (
    SD35_LARGE,
    _SD3_TINY,
    dataclasses.replace(
        _SD3_TINY,
        name="sd3-tiny-tp",
        description="sd3-tiny with 4 heads x 16 (64 wide, caption_projection_dim 64), so tensor parallelism of "
                    "degree 4 divides the heads",
        transformer=dict(_SD3_TINY.transformer, num_attention_heads=4, caption_projection_dim=64),
    ),
)


def sd3_components(arch: SynthArch, kit) -> dict:
    """StableDiffusion3Pipeline's other components: AutoencoderKL, CLIP-L and CLIP-G (with projections), T5."""
    import diffusers
    import transformers

    clip_tok, t5_tok = kit.clip_tokenizer(), kit.t5_tokenizer(arch.max_sequence_length)
    clip = transformers.CLIPTextModelWithProjection
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(clip, kit.clip_config(clip_tok, arch.clip), 2), tokenizer=clip_tok,
                text_encoder_2=kit.make(clip, kit.clip_config(clip_tok, arch.clip_2), 4), tokenizer_2=clip_tok,
                text_encoder_3=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer_3=t5_tok)


SD3 = register(
    ModelAdapter(
        name="sd3",
        class_names=("SD3Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        # The model patchifies inside forward: image tokens exist at the output of pos_embed (positions added)
        # and are gathered at the output of proj_out, before unpatchify. ControlNet residuals carry image tokens
        # too and are split with the same sizes at the entry.
        sequence_plan=SequencePlan(
            streams=("image", "text"),
            inputs={"": {
                "encoder_hidden_states": Split(dim=1, stream="text", ndim=3),
                "block_controlnet_hidden_states": Split(dim=1, stream="image", ndim=3),
            }},
            outputs={"pos_embed": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
        ),
        attention=AttentionSelector(class_names=("Attention",)),
        sequence_processor=SD3SequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states"), ("image", "text")),),
        token_wise=("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
        modulated_input=norm1_modulated_input,
        example_inputs=sd3_example_inputs,
        layout=sd3_layout,
        text_tokens=333,  # 77 CLIP + 256 T5
        tensor_plan=SD3_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                      "block_controlnet_hidden_states"),
        cfg_mode="batched",  # StableDiffusion3Pipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("StableDiffusion3Pipeline",),
        synth_archs=SD3_ARCHS,
        synth_components=sd3_components,
        vae=KL_VAE_PLAN,
    )
)
