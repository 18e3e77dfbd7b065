"""FLUX.1 (``FluxTransformer2DModel``): joint text+image attention.

Sequence plan (diffusers' ``_cp_plan`` with streams): text tokens (``encoder_hidden_states``, ``txt_ids``)
and image tokens (``hidden_states``, ``img_ids``) are each split into contiguous chunks over the
sequence-parallel ranks at the entry. The model builds RoPE from ``cat(txt_ids, img_ids)`` and every
attention concatenates ``[text, image]``, so the local positions line up with the local tokens without any
change to the model. Only image tokens leave the model, and ``proj_out``'s output is gathered once.

This file is everything ditmesh knows about FLUX.1: the plans, the processor, the blocks, example inputs,
the planner's layout, and the synthetic architectures.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux

from .base import (AttentionSelector, BlockList, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan, Split,
                   SynthArch, TensorPlan, VaePlan, norm1_modulated_input, register, spatial_latent)


class FluxSequenceParallelProcessor:
    """Attention processor for ``FluxAttention`` whose core attention runs sequence-parallel.

    Projections, QK-norms and RoPE are computed on the local tokens exactly as diffusers'
    ``FluxAttnProcessor`` does; only the softmax attention itself goes through ``sp.attention``, with the
    ``attention_mask`` the model passes (global ``[text, image]`` order, as diffusers' processor takes it).
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        q, k, v, eq, ek, ev = transformer_flux._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        # diffusers' generic ``Attention`` (Bria-FIBO's single blocks) has no ``head_dim``: its heads (divided under
        # tensor parallelism) split the projection
        head_dim = getattr(attn, "head_dim", None) or q.shape[-1] // attn.heads
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        joint = attn.added_kv_proj_dim is not None and encoder_hidden_states is not None
        if joint:
            eq, ek, ev = (t.unflatten(-1, (-1, head_dim)) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)

        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)
        out = out.flatten(2, 3).to(q.dtype)

        if not joint:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        text_out = attn.to_add_out(text_out.contiguous())
        return image_out, text_out


def flux_image_ids(h: int, w: int) -> torch.Tensor:
    """FLUX's image position ids of an ``h`` x ``w`` token grid, ``[h * w, 3]``: (0, row, column)."""
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] += torch.arange(h)[:, None]
    img_ids[..., 2] += torch.arange(w)[None, :]
    return img_ids.reshape(h * w, 3)


def flux_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one FluxPipeline denoising step (random latents and text embeddings)."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    img_ids = flux_image_ids(h, w)
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        pooled_projections=rand(batch, cfg.pooled_projection_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        guidance=torch.full((batch,), 3.5).to(device, dtype) if cfg.guidance_embeds else None,
        img_ids=img_ids.to(device, dtype),
        txt_ids=torch.zeros(text_len, 3).to(device, dtype),
        return_dict=False,
    )


def flux_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a FluxPipeline call: the VAE divides by 8, then 2x2 latent patches become one token."""
    lh, lw = spatial_latent(height, width, 16, "FLUX (8x VAE, 2x2 packing)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (image, config.get("in_channels", 64)))


def flux_text_tokens(model_index: dict) -> int | None:
    """FLUX.1-schnell pipelines are driven with 256 text tokens, dev with the default 512."""
    return 256 if "schnell" in model_index.get("_name_or_path", "") else None


#: Tensor plan. Double blocks: Q/K/V and the text-stream (added) Q/K/V column-parallel, both attention outputs
#: row-parallel, both FFNs column -> row: 4 all-reduces per double block. Single blocks: Q/K/V and ``proj_mlp``
#: column-parallel; ``proj_out`` reads ``cat([attention output, MLP output])`` and is packed row-parallel:
#: 1 all-reduce per single block. AdaLN modulation (``norm1``, ``norm1_context``, ``norm``, ``norm_out``),
#: the embedders and the final ``proj_out`` stay replicated; QK-norms act per head, so they run as-is on the
#: local heads.
FLUX_TENSOR_PLAN = TensorPlan(
    colwise=(
        "transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v",
        "transformer_blocks.*.attn.add_q_proj", "transformer_blocks.*.attn.add_k_proj",
        "transformer_blocks.*.attn.add_v_proj",
        "transformer_blocks.*.ff.net.0.proj", "transformer_blocks.*.ff_context.net.0.proj",
        "single_transformer_blocks.*.attn.to_q", "single_transformer_blocks.*.attn.to_k",
        "single_transformer_blocks.*.attn.to_v", "single_transformer_blocks.*.proj_mlp",
    ),
    rowwise=(
        "transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.attn.to_add_out",
        "transformer_blocks.*.ff.net.2", "transformer_blocks.*.ff_context.net.2",
    ),
    packed_rowwise={"single_transformer_blocks.*.proj_out": ("attn.to_q", "proj_mlp")},
    per_rank_attrs={"transformer_blocks.*.attn": ("heads",), "single_transformer_blocks.*.attn": ("heads",)},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

#: FLUX.1's AutoencoderKL (16 latent channels)
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
)

#: The 2-D KL VAE of FLUX.1 and SD3 (``AutoencoderKL``) split along height: its convolutions, group norms and
#: ``Downsample2D`` pads are found by type; the mid-block self-attention (diffusers' ``Attention`` over all
#: positions) runs on the gathered rows. ``2 ** (levels - 1)`` image rows per latent row. Its ``tiled_decode``
#: decodes every tile with ``decoder`` before it blends them, so the tiles can be spread over ranks.
KL_VAE_PLAN = VaePlan(
    class_names=("AutoencoderKL",),
    spatial_factor=lambda vae: 2 ** (len(vae.config.block_out_channels) - 1),
    gathered=("Attention",),
    tile_decoder="decoder",
)

FLUX_DEV = SynthArch(
    name="flux-dev",
    description="FLUX.1-dev transformer (19 double + 38 single blocks, 24 heads x 128, 11.9B params), full VAE",
    pipeline="FluxPipeline",
    transformer_class="FluxTransformer2DModel",
    transformer=dict(
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=[16, 56, 56],
    ),
    vae=FLUX_VAE,
    clip=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=12, projection_dim=768),
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
    scheduler=FLUX_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=512,
)

_FLUX_TINY = dataclasses.replace(
    FLUX_DEV,
    name="flux-tiny",
    description="FLUX.1 architecture shrunk for CPU tests: 2 double + 2 single blocks, 6 heads x 16",
    transformer=dict(FLUX_DEV.transformer, num_layers=2, num_single_layers=2, attention_head_dim=16,
                     num_attention_heads=6, joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]),
    vae=dict(FLUX_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, projection_dim=32),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)

FLUX_ARCHS = (
    _FLUX_TINY,
    dataclasses.replace(
        _FLUX_TINY,
        name="flux-fill-tiny",
        description="flux-tiny as FLUX.1-Fill: the masked image's latents and the mask concatenated on channels "
                    "(384 in, 64 out), FluxFillPipeline",
        pipeline="FluxFillPipeline",
        transformer=dict(_FLUX_TINY.transformer, in_channels=384, out_channels=64),
    ),
    dataclasses.replace(
        _FLUX_TINY,
        name="flux-tiny-tp",
        description="flux-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads",
        transformer=dict(_FLUX_TINY.transformer, num_attention_heads=4),
    ),
    FLUX_DEV,
)


# -- image-conditioned pipelines ------------------------------------------------------------------------------
def _fill_transformer(config: dict) -> bool:
    """FLUX.1-Fill's transformer reads the latents, the masked image's latents and the mask, concatenated on
    channels: more input channels than output channels."""
    return config.get("out_channels") not in (None, config.get("in_channels"))


def _needs_plain(config: dict) -> str | None:
    return ("this checkpoint's transformer is a Fill one (masked-image channels); use --image-mode fill with --mask"
            if _fill_transformer(config) else None)


def _needs_fill(config: dict) -> str | None:
    return (None if _fill_transformer(config) else
            "fill needs a Fill checkpoint (FLUX.1-Fill: masked-image channels on the transformer's input); "
            "use --image-mode inpaint with this one")


#: img2img and inpaint start part-way into the schedule (``--strength``); Kontext appends the condition image's
#: tokens to the image stream (``hidden_states`` and ``img_ids`` grow, the output is sliced back by the pipeline),
#: so the sequence plan splits the longer stream as it is; Fill concatenates on channels (same tokens).
FLUX_IMAGE_PIPELINES = (
    ImagePipeline("img2img", "FluxImg2ImgPipeline", check=_needs_plain),
    ImagePipeline("kontext", "FluxKontextPipeline", strength=False, check=_needs_plain),
    ImagePipeline("inpaint", "FluxInpaintPipeline", mask=True, check=_needs_plain),
    ImagePipeline("fill", "FluxFillPipeline", mask=True, check=_needs_fill),
)


def flux_components(arch: SynthArch, kit) -> dict:
    """FluxPipeline's other components: AutoencoderKL, CLIP-L (pooled) and T5 text encoders."""
    import diffusers
    import transformers

    clip_tok, t5_tok = kit.clip_tokenizer(), kit.t5_tokenizer(arch.max_sequence_length)
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(transformers.CLIPTextModel, kit.clip_config(clip_tok, arch.clip), 2),
                tokenizer=clip_tok,
                text_encoder_2=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer_2=t5_tok)


FLUX = register(
    ModelAdapter(
        name="flux",
        class_names=("FluxTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            inputs={"": {
                "hidden_states": Split(dim=1, stream="image", ndim=3),
                "img_ids": Split(dim=0, stream="image", ndim=2),
                "encoder_hidden_states": Split(dim=1, stream="text", ndim=3),
                "txt_ids": Split(dim=0, stream="text", ndim=2),
            }},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the same split and gather points; ours gives text and image their own streams, so "
                                 "each is cut on its own and any token count works (diffusers needs both divisible)",
        ),
        attention=AttentionSelector(class_names=("FluxAttention",)),
        sequence_processor=FluxSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states"), ("image", "text")),
                BlockList("single_transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states"), ("image", "text"),
                          packed=("encoder_hidden_states", "hidden_states"))),
        token_wise=("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
        modulated_input=norm1_modulated_input,
        example_inputs=flux_example_inputs,
        layout=flux_layout,
        text_tokens=512,
        checkpoint_text_tokens=flux_text_tokens,
        tensor_plan=FLUX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
        cfg_mode="sequential",  # FluxPipeline's true CFG calls the transformer twice per step
        cfg_switch="true_cfg_scale",  # guidance_scale is FLUX.1-dev's distilled guidance, an input of one call
        cfg_hint="a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt '' --true-cfg-scale 4)",
        output_channel_dim=-1,
        fuse_qkv=True,
        out_channels=lambda model: model.proj_out.out_features,
        pipelines=("FluxPipeline",) + tuple(p.pipeline for p in FLUX_IMAGE_PIPELINES),
        synth_archs=FLUX_ARCHS,
        synth_components=flux_components,
        vae=KL_VAE_PLAN,
        image_pipelines=FLUX_IMAGE_PIPELINES,
    )
)
