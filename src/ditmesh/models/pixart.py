"""PixArt-Σ and PixArt-α (``PixArtTransformer2DModel``): image self-attention, cross-attention to T5 text under a
text padding mask, adaLN-single modulation.

Where the tokens are: ``forward`` patchifies inside ``pos_embed`` (which adds the sin-cos position table of the
latent's size), runs ``BasicTransformerBlock``s on ``[B, N, D]`` image tokens and unpatchifies after
``proj_out``. The sequence plan splits the image stream at the output of ``pos_embed`` (positions already added)
and gathers it at the output of ``proj_out``; the text (``encoder_hidden_states``, projected per token by
``caption_projection``) stays whole on every rank. The timestep modulation (``adaln_single``) is one vector per
sample, the same for every token.

Attention: ``attn1`` is self-attention over the image tokens and runs through ``sp.attention`` (with the model's
optional ``attention_mask`` over image keys, which the pipelines do not pass). ``attn2`` is cross-attention from
the image tokens to the whole text under ``encoder_attention_mask`` (the prompt's padding): a rank's query shard
against every text key gives exactly its rows of the one-process result, whatever the mask, so ``attn2`` runs the
model's own processor with no communication and no head split (Ulysses moves heads only where keys are split).

CFG: ``PixArtSigmaPipeline`` runs ``[uncond, cond]`` in one call (batched) when ``guidance_scale > 1``, the masks
of both prompts stacked like the embeddings. Tensor plan: both attentions' Q/K/V column-parallel and ``to_out.0``
row-parallel, the feed-forward column -> row: 3 all-reduces per block; the cross-attention mask applies per head,
so it fits any head count.

diffusers has no ``_cp_plan`` or ``_tp_plan`` for this class; the plans below are ours. This file is everything
ditmesh knows about PixArt: the plans, the processor, the blocks, example inputs, the planner's layout, the
synthetic architectures.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import FLUX_VAE, KL_VAE_PLAN


class PixArtSequenceParallelProcessor:
    """Processor for the ``Attention`` layers of ``BasicTransformerBlock`` (and of HunyuanDiT's blocks):
    self-attention sequence-parallel, cross-attention local.

    Self-attention projects the local tokens as diffusers' ``AttnProcessor2_0`` (``HunyuanAttnProcessor2_0``) does,
    with per-head QK-norms and, where the model passes them, RoPE tables split with the tokens; only the softmax
    attention runs through ``sp.attention``, with the model's ``attention_mask`` (a bias over the image keys, global
    order) if any. Cross-attention (``encoder_hidden_states`` given) goes to the previous processor unchanged: local
    queries (and their RoPE rows) against the whole, replicated text and its mask.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None):
        if encoder_hidden_states is not None:
            rope = {} if image_rotary_emb is None else {"image_rotary_emb": image_rotary_emb}
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, temb, **rope)
        residual = hidden_states
        head_dim = attn.inner_dim // attn.heads  # unchanged by tensor parallelism, which divides both
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def pixart_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one PixArtSigmaPipeline denoising step (random latents and text embeddings), with the
    text mask of a prompt that fills half of the padded text."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.zeros(batch, text_len)
    mask[:, : max(1, text_len // 2)] = 1
    conditions = {"resolution": None, "aspect_ratio": None}
    if model.use_additional_conditions:  # PixArt-α 1024: the image size and aspect ratio as micro-conditions
        conditions = {"resolution": torch.tensor([[height, width]] * batch).to(device, dtype),
                      "aspect_ratio": torch.tensor([[height / width]] * batch).to(device, dtype)}
    return dict(
        hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
        encoder_hidden_states=rand(batch, text_len, cfg.caption_channels or cfg.cross_attention_dim),
        encoder_attention_mask=mask.to(device, dtype),
        timestep=torch.full((batch,), 700, dtype=torch.long, device=device),
        added_cond_kwargs=conditions,
        return_dict=False,
    )


def pixart_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a PixArt pipeline call: the VAE divides by 8, then ``patch_size`` patches. Text is
    cross-attention context only, so the split sequence is the image tokens."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"PixArt (8x VAE, patch {patch})")
    image = (lh // patch) * (lw // patch)
    return Layout(image, text_tokens, image, (config.get("in_channels", 4), lh, lw))


def pixart_text_tokens(model_index: dict) -> int | None:
    """PixArtAlphaPipeline pads its prompts to 120 T5 tokens; PixArt-Σ's 300 is the default."""
    return 120 if model_index.get("_class_name") == "PixArtAlphaPipeline" else None


def pixart_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of a block's self-attention: ``norm1`` shifted and scaled by the first two of the block's six
    adaLN-single modulations (its ``scale_shift_table`` plus the model's per-sample timestep vector)."""
    hidden = named["hidden_states"]
    modulation = block.scale_shift_table[None] + named["timestep"].reshape(hidden.shape[0], 6, -1)
    shift, scale = modulation[:, 0:1], modulation[:, 1:2]
    return block.norm1(hidden) * (1 + scale) + shift


#: Tensor plan (plain Megatron): self- and cross-attention Q/K/V column-parallel (the cross-attention's K/V read the
#: whole text), ``to_out.0`` row-parallel; feed-forward up column / down row: 3 all-reduces per block. ``heads`` and
#: ``inner_dim`` are divided so that ``inner_dim // heads`` stays the head dim. adaLN-single, the caption projection,
#: the patch embedding and ``proj_out`` stay replicated.
PIXART_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"transformer_blocks.*.{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v"))
    + ("transformer_blocks.*.ff.net.0.proj",),
    rowwise=("transformer_blocks.*.attn1.to_out.0", "transformer_blocks.*.attn2.to_out.0", "transformer_blocks.*.ff.net.2"),
    per_rank_attrs={"transformer_blocks.*.attn1": ("heads", "inner_dim"),
                    "transformer_blocks.*.attn2": ("heads", "inner_dim")},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: PixArt-Σ's VAE: SDXL's AutoencoderKL (4 latent channels, quant convs)
_SDXL_VAE = dict(FLUX_VAE, latent_channels=4, scaling_factor=0.13025, shift_factor=None, use_quant_conv=True,
                 use_post_quant_conv=True)

#: the DPM-Solver++ scheduler PixArt-Σ ships, on the linear beta schedule of its training
_PIXART_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                         prediction_type="epsilon", solver_order=2)

PIXART_SIGMA = SynthArch(
    name="pixart-sigma",
    description="PixArt-Σ XL-2-1024-MS transformer (28 blocks, 16 heads x 72, 0.6B params), SDXL VAE, one-layer T5",
    pipeline="PixArtSigmaPipeline",
    transformer_class="PixArtTransformer2DModel",
    transformer=dict(
        sample_size=128,
        num_layers=28,
        attention_head_dim=72,
        num_attention_heads=16,
        in_channels=4,
        out_channels=8,  # learned sigma: noise and variance
        patch_size=2,
        cross_attention_dim=1152,
        caption_channels=4096,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        interpolation_scale=2,
        use_additional_conditions=False,
    ),
    vae=_SDXL_VAE,
    clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # T5-XXL's width, one layer
    scheduler=_PIXART_SCHEDULER,
    scheduler_class="DPMSolverMultistepScheduler",
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=300,
)

#: diffusers' own test configuration scaled to ditmesh's tiny sizes (2 blocks, heads of 16): sample_size 32 is the
#: smallest one PixArtSigmaPipeline's resolution binning knows (256 px)
_PIXART_TINY = dataclasses.replace(
    PIXART_SIGMA,
    name="pixart-sigma-tiny",
    description="PixArt-Σ architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, cross-attention to 64-wide T5",
    transformer=dict(PIXART_SIGMA.transformer, sample_size=32, num_layers=2, attention_head_dim=16,
                     num_attention_heads=6, cross_attention_dim=96, caption_channels=64, interpolation_scale=None),
    vae=dict(_SDXL_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)

PIXART_ARCHS = (
    PIXART_SIGMA,
    _PIXART_TINY,
    dataclasses.replace(
        _PIXART_TINY,
        name="pixart-sigma-tiny-tp",
        description="pixart-sigma-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads",
        transformer=dict(_PIXART_TINY.transformer, num_attention_heads=4, cross_attention_dim=64),
    ),
    dataclasses.replace(
        _PIXART_TINY,
        name="pixart-alpha-tiny",
        description="pixart-sigma-tiny as PixArt-α 1024 reads it: the image size and aspect ratio as micro-conditions "
                    "(added_cond_kwargs), PixArtAlphaPipeline",
        pipeline="PixArtAlphaPipeline",
        transformer=dict(_PIXART_TINY.transformer, use_additional_conditions=True),
    ),
)


def pixart_components(arch: SynthArch, kit) -> dict:
    """PixArtSigmaPipeline's other components: AutoencoderKL (SDXL's layout) and the T5 text encoder."""
    import diffusers
    import transformers

    t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer=t5_tok)


PIXART = register(
    ModelAdapter(
        name="pixart",
        class_names=("PixArtTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image",),
            outputs={"pos_embed": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
        ),
        attention=AttentionSelector(class_names=("Attention",)),
        sequence_processor=PixArtSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",)),),
        token_wise=("transformer_blocks.*.ff",),
        modulated_input=pixart_modulated_input,
        example_inputs=pixart_example_inputs,
        layout=pixart_layout,
        text_tokens=300,  # PixArtSigmaPipeline's max_sequence_length
        checkpoint_text_tokens=pixart_text_tokens,
        tensor_plan=PIXART_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_attention_mask", "attention_mask", "timestep",
                      "added_cond_kwargs"),
        cfg_mode="batched",  # PixArtSigmaPipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("PixArtSigmaPipeline", "PixArtAlphaPipeline"),
        synth_archs=PIXART_ARCHS,
        synth_components=pixart_components,
        vae=KL_VAE_PLAN,
    )
)
