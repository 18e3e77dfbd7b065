"""HunyuanDiT (``HunyuanDiT2DModel``): image self-attention with 2-D RoPE, cross-attention to CLIP/BERT and T5 text,
long skip connections from the first half of the blocks to the second.

Where the tokens are: ``forward`` patchifies in ``pos_embed`` (no position table: positions are the RoPE tables the
pipeline passes as ``image_rotary_emb``, cos and sin ``[N, head_dim]``), runs the blocks on ``[B, N, D]`` image tokens
and unpatchifies after ``proj_out``. The sequence plan splits the RoPE tables at the entry and the image tokens at the
output of ``pos_embed`` (same stream, same sizes), and gathers at the output of ``proj_out``.

- **Text masks**: the model applies ``text_embedding_mask`` / ``text_embedding_mask_t5`` before any attention, by
  replacing padded text embeddings with its learned ``text_embedding_padding``; the cross-attentions themselves take
  no mask. The text stays whole on every rank, so the masked embeddings are the one-process ones.
- **Attention**: ``attn1`` (self, QK layer-norms per head, RoPE on queries and keys) runs through ``sp.attention``
  with the local RoPE rows (PixArt's processor, ``models/pixart.py``); ``attn2`` (cross, RoPE on the queries only)
  runs the model's own processor on the local queries and their RoPE rows: no communication.
- **Skip connections**: block ``i`` of the second half concatenates the output of a first-half block with its
  input, token by token (``skip_linear``); both are local shards of the same tokens, so nothing travels.

Per block under sequence parallelism: one sequence-parallel attention. Tensor plan: both attentions' Q/K/V
column-parallel and ``to_out.0`` row-parallel, the feed-forward column -> row: 3 all-reduces per block; the skip
projection, adaLN shift and embedders stay replicated. CFG: ``HunyuanDiTPipeline`` runs ``[uncond, cond]`` in one
call (batched). diffusers has no ``_cp_plan`` or ``_tp_plan`` for this class; the plans below are ours.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import KL_VAE_PLAN
from .pixart import _SDXL_VAE, PixArtSequenceParallelProcessor


def hunyuan_rope(model, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D RoPE tables (cos, sin) ``HunyuanDiTPipeline`` builds for an image of ``height`` x ``width`` pixels."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    patch = model.config.patch_size
    grid = (height // 8 // patch, width // 8 // patch)
    crops = get_resize_crop_region_for_grid(grid, 512 // 8 // patch)
    return get_2d_rotary_pos_embed(model.inner_dim // model.num_heads, crops, grid, device=device, output_type="pt")


def hunyuan_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one HunyuanDiTPipeline denoising step: random latents and text embeddings of the model's
    fixed text lengths (``text_len`` CLIP/BERT and ``text_len_t5`` T5 tokens; ``text_len`` here is ignored), masks
    that keep half of each, the size conditions and the RoPE tables."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731

    def half_kept(n):
        mask = torch.zeros(batch, n, dtype=torch.long)
        mask[:, : max(1, n // 2)] = 1
        return mask.to(device)

    cos, sin = hunyuan_rope(model, height, width, "cpu")
    return dict(
        hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states=rand(batch, cfg.text_len, cfg.cross_attention_dim),
        text_embedding_mask=half_kept(cfg.text_len),
        encoder_hidden_states_t5=rand(batch, cfg.text_len_t5, cfg.cross_attention_dim_t5),
        text_embedding_mask_t5=half_kept(cfg.text_len_t5),
        image_meta_size=torch.tensor([[height, width, height, width, 0, 0]] * batch).to(device, dtype),
        style=torch.zeros(batch, dtype=torch.long, device=device),
        image_rotary_emb=(cos.to(device, dtype), sin.to(device, dtype)),
        return_dict=False,
    )


def hunyuan_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a HunyuanDiTPipeline call: the VAE divides by 8, then ``patch_size`` patches; the text (77 + 256
    tokens by default) is cross-attention context only."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"HunyuanDiT (8x VAE, patch {patch})")
    image = (lh // patch) * (lw // patch)
    return Layout(image, text_tokens, image, (config.get("in_channels", 4), lh, lw))


def hunyuan_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first block's self-attention input: ``norm1`` (layer norm shifted by the timestep embedding)."""
    return block.norm1(named["hidden_states"], named["temb"])


#: Tensor plan (plain Megatron): self- and cross-attention Q/K/V column-parallel (the cross-attention's K/V read the
#: whole text), ``to_out.0`` row-parallel, feed-forward column -> row: 3 all-reduces per block. The QK layer-norms act
#: per head. The skip projection (``skip_linear``, second half), ``norm1``'s shift, the text and time embedders and
#: ``proj_out`` stay replicated.
HUNYUAN_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"blocks.*.{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v"))
    + ("blocks.*.ff.net.0.proj",),
    rowwise=("blocks.*.attn1.to_out.0", "blocks.*.attn2.to_out.0", "blocks.*.ff.net.2"),
    per_rank_attrs={"blocks.*.attn1": ("heads", "inner_dim"), "blocks.*.attn2": ("heads", "inner_dim")},
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: HunyuanDiT's DDPM scheduler (v-prediction on the scaled-linear schedule)
_HUNYUAN_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.018, beta_schedule="scaled_linear",
                          prediction_type="v_prediction", steps_offset=1, clip_sample=False)

HUNYUAN_DIT = SynthArch(
    name="hunyuan-dit",
    description="HunyuanDiT v1.2 transformer (40 blocks with long skips, 16 heads x 88, 1.5B params), SDXL's VAE, "
                "one-layer CLIP-shaped first text encoder (1024 wide) and T5 (2048 wide)",
    pipeline="HunyuanDiTPipeline",
    transformer_class="HunyuanDiT2DModel",
    transformer=dict(
        num_attention_heads=16,
        attention_head_dim=88,
        in_channels=4,
        patch_size=2,
        activation_fn="gelu-approximate",
        sample_size=128,
        hidden_size=1408,
        num_layers=40,
        mlp_ratio=4.3637,
        learn_sigma=True,
        cross_attention_dim=1024,
        norm_type="layer_norm",
        cross_attention_dim_t5=2048,
        pooled_projection_dim=1024,
        text_len=77,
        text_len_t5=256,
        use_style_cond_and_image_meta_size=False,
    ),
    vae=_SDXL_VAE,
    # the first text encoder: a CLIP text model of BERT's width (HunyuanDiTPipeline takes BertModel or CLIPTextModel)
    clip=dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16),
    t5=dict(d_model=2048, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # mT5-XL's width, one layer
    scheduler=_HUNYUAN_SCHEDULER,
    scheduler_class="DDPMScheduler",
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=256,
    pipeline_config=dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False),
)

#: diffusers' own test configuration at ditmesh's tiny sizes, with 4 blocks so that one long skip exists (block 0's
#: output into block 3)
_HUNYUAN_TINY = dataclasses.replace(
    HUNYUAN_DIT,
    name="hunyuan-dit-tiny",
    description="HunyuanDiT architecture shrunk for CPU tests: 4 blocks (one long skip), 6 heads x 16",
    transformer=dict(HUNYUAN_DIT.transformer, num_attention_heads=6, attention_head_dim=16, hidden_size=96,
                     num_layers=4, mlp_ratio=2.0, sample_size=16, cross_attention_dim=32, cross_attention_dim_t5=64,
                     pooled_projection_dim=32, use_style_cond_and_image_meta_size=True),
    vae=dict(_SDXL_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
)

HUNYUAN_ARCHS = (
    HUNYUAN_DIT,
    _HUNYUAN_TINY,
    dataclasses.replace(
        _HUNYUAN_TINY,
        name="hunyuan-dit-tiny-tp",
        description="hunyuan-dit-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads",
        transformer=dict(_HUNYUAN_TINY.transformer, num_attention_heads=4, hidden_size=64),
    ),
)


def hunyuan_components(arch: SynthArch, kit) -> dict:
    """HunyuanDiTPipeline's other components: AutoencoderKL (SDXL's layout), a CLIP text model as the first text
    encoder (77 tokens), T5 (256 tokens) and their tokenizers; no safety checker."""
    import diffusers
    import transformers

    clip_tok, t5_tok = kit.clip_tokenizer(), kit.t5_tokenizer(arch.transformer["text_len_t5"])
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(transformers.CLIPTextModel, kit.clip_config(clip_tok, arch.clip), 2),
                tokenizer=clip_tok,
                text_encoder_2=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer_2=t5_tok)


HUNYUAN = register(
    ModelAdapter(
        name="hunyuan-dit",
        class_names=("HunyuanDiT2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image",),
            inputs={"": {"image_rotary_emb": Split(dim=0, stream="image", ndim=2)}},  # cos and sin [N, head_dim]
            outputs={"pos_embed": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
        ),
        attention=AttentionSelector(class_names=("Attention",)),
        sequence_processor=PixArtSequenceParallelProcessor,
        # blocks of the second half also read a first-half block's output (``skip``), a local shard like the rest
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",)),),
        token_wise=("blocks.*.ff",),
        modulated_input=hunyuan_modulated_input,
        example_inputs=hunyuan_example_inputs,
        layout=hunyuan_layout,
        text_tokens=77 + 256,
        tensor_plan=HUNYUAN_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "text_embedding_mask",
                      "encoder_hidden_states_t5", "text_embedding_mask_t5", "image_meta_size", "style"),
        cfg_mode="batched",  # HunyuanDiTPipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("HunyuanDiTPipeline",),
        synth_archs=HUNYUAN_ARCHS,
        synth_components=hunyuan_components,
        vae=KL_VAE_PLAN,
    )
)
