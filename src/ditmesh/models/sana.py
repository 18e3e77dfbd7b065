"""Sana (``SanaTransformer2DModel``): linear self-attention over the image tokens, cross-attention to Gemma text under
its padding mask, and a Mix-FFN whose depthwise 3x3 convolution mixes neighbouring tokens of the image grid.

Where the tokens are: ``forward`` patchifies in ``patch_embed`` (with the sin-cos table only where the checkpoint
sets ``interpolation_scale``), runs ``SanaTransformerBlock``s on ``[B, N, D]`` image tokens (row-major over the
latent grid) and unpatchifies after ``proj_out``. The sequence plan splits the image stream at the output of
``patch_embed`` and gathers it at the output of ``proj_out``; the text stays whole on every rank.

- **Linear attention** (``attn1``, diffusers' ``SanaLinearAttnProcessor2_0``): ``out_q = (sum_k v_k relu(k)^T)
  relu(q) / (sum_k relu(k))^T relu(q)``. The two sums over keys are one ``[B, H, D + 1, D]`` tensor per layer (the
  value padded with a row of ones); each rank sums its own keys and one all-reduce over the sequence-parallel ranks
  adds them, which is exact: there is no softmax, so the ring's log-sum-exp merge does not apply, and no K/V needs
  to travel. Ulysses, ring and USP configurations all run this one all-reduce per layer.
- **Cross-attention** (``attn2``) to the whole text under ``encoder_attention_mask``: the model's own processor on
  the local queries, no communication.
- **Mix-FFN** (``GLUMBConv``): the block unflattens its tokens to ``[B, C, height, width]`` and runs a depthwise 3x3
  convolution between two pointwise ones. The image stream is therefore split in whole rows of the latent grid
  (the plan's :class:`~ditmesh.models.base.TokenGrid`; uneven by at most one row, at least one row per rank), each
  block's ``height`` becomes this rank's rows, and the 3x3 convolution exchanges one halo row with each neighbour
  before it runs (the parallel VAE's halo exchange, ``parallel/vae.py``): exact.

Per block under sequence parallelism: 1 all-reduce (linear attention) and 1 halo exchange (the convolution); 1
all-gather per call. Tensor plan: both attentions' Q/K/V column-parallel and ``to_out.0`` row-parallel (linear
attention acts per head): 2 all-reduces per block. The Mix-FFN's convolutions stay whole on every tp rank (the
tensor plans shard linears only). CFG: ``SanaPipeline`` runs ``[uncond, cond]`` in one call (batched).

diffusers has no ``_cp_plan`` or ``_tp_plan`` for this class; the plans below are ours. This file is everything
ditmesh knows about Sana.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, TokenGrid, register, spatial_latent)
from .pixart import pixart_modulated_input


class SanaSequenceParallelProcessor:
    """Processor for Sana's ``Attention`` layers: linear self-attention with its key sums added over the
    sequence-parallel ranks (one all-reduce), cross-attention local.

    Projections, QK-norms, ReLU feature maps and the float32 products follow diffusers' ``SanaLinearAttnProcessor2_0``
    on the local tokens; the key sums (``[B, H, D + 1, D]``: ``sum v k^T`` and, in the last row, ``sum k``) go
    through ``sp.sum`` before the local queries read them.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous

    @staticmethod
    def projections(attn, hidden_states):
        """Q, K, V of the local tokens ``[B, N, H * D]``, the QK-norms applied where the layer has them."""
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        return (attn.norm_q(q) if attn.norm_q is not None else q), (attn.norm_k(k) if attn.norm_k is not None else k), v

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask)
        if attention_mask is not None:
            raise NotImplementedError("ditmesh: Sana's linear self-attention takes no attention mask")
        dtype = hidden_states.dtype
        q, k, v = self.projections(attn, hidden_states)
        # [B, N, H * D] -> [B, H, D, N] (keys [B, H, N, D]), as diffusers' processor lays them out
        q, k, v = (t.transpose(1, 2).unflatten(1, (attn.heads, -1)) for t in (q, k, v))
        q, k, v = F.relu(q).float(), F.relu(k).transpose(2, 3).float(), v.float()
        v = F.pad(v, (0, 0, 0, 1), mode="constant", value=1.0)  # a row of ones: its product with k sums the keys
        key_sums = self.sp.sum(torch.matmul(v, k))  # [B, H, D + 1, D] over every rank's keys
        out = torch.matmul(key_sums, q)
        out = out[:, :, :-1] / (out[:, :, -1:] + 1e-15)
        out = out.flatten(1, 2).transpose(1, 2).to(dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out.clip(-65504, 65504) if dtype == torch.float16 else out


#: the DC-AE's spatial compression (Sana's latents are 32x smaller than the image)
SANA_VAE_FACTOR = 32


def sana_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one SanaPipeline denoising step (random latents and text embeddings), with the text mask
    of a prompt that fills half of the padded text."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.zeros(batch, text_len)
    mask[:, : max(1, text_len // 2)] = 1
    inputs = dict(
        hidden_states=rand(batch, cfg.in_channels, height // SANA_VAE_FACTOR, width // SANA_VAE_FACTOR),
        encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
        encoder_attention_mask=mask.to(device, dtype),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        return_dict=False,
    )
    if cfg.guidance_embeds:  # Sana Sprint: the guidance scale as an input
        inputs["guidance"] = torch.full((batch,), 4.5).to(device, dtype)
    return inputs


def sana_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a SanaPipeline call: the DC-AE divides by 32, then ``patch_size`` patches. Text is
    cross-attention context only, so the split sequence is the image tokens."""
    patch = config.get("patch_size", 1)
    spatial_latent(height, width, SANA_VAE_FACTOR * patch, f"Sana (32x DC-AE, patch {patch})")
    rows, cols = height // SANA_VAE_FACTOR // patch, width // SANA_VAE_FACTOR // patch
    return Layout(rows * cols, text_tokens, rows * cols,
                  (config.get("in_channels", 32), height // SANA_VAE_FACTOR, width // SANA_VAE_FACTOR))


def sana_grid_width(model, inputs: dict) -> int:
    """Tokens per row of Sana's latent grid: the latent's width over the patch size."""
    return inputs["hidden_states"].shape[-1] // model.config.patch_size


def sana_sequence_traffic(config: dict, layout: Layout, bpe: int, tp: int) -> list:
    """What Sana's sequence parallelism exchanges per sample and transformer call (the planner's count): per block,
    the linear attention's key sums (``[H / tp, D + 1, D]`` in float32, all-reduced) and one latent row from each
    neighbour for the Mix-FFN's 3x3 convolution (``2 x mlp_ratio x inner`` channels)."""
    heads, dim, layers = config["num_attention_heads"] // tp, config["attention_head_dim"], config["num_layers"]
    channels = 2 * int(config.get("mlp_ratio", 2.5) * config["num_attention_heads"] * dim)
    width = layout.latent_shape[-1] // config.get("patch_size", 1)
    return [("all_reduce", layers * heads * (dim + 1) * dim * 4, layers),
            ("halo", layers * 2 * width * channels * bpe, layers)]


#: Tensor plan: both attentions' Q/K/V column-parallel and ``to_out.0`` row-parallel, ``heads`` and ``inner_dim``
#: divided: 2 all-reduces per block. The Mix-FFN (convolutions), adaLN-single, the caption projection and norm and
#: ``proj_out`` stay replicated.
SANA_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"transformer_blocks.*.{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v")),
    rowwise=("transformer_blocks.*.attn1.to_out.0", "transformer_blocks.*.attn2.to_out.0"),
    per_rank_attrs={"transformer_blocks.*.attn1": ("heads", "inner_dim"),
                    "transformer_blocks.*.attn2": ("heads", "inner_dim")},
)


def sana_heads(model) -> int:
    """Heads both attentions can be divided by: the greatest common divisor of the self- and cross-attention heads
    (tp must divide both)."""
    import math

    cfg = model.config
    return math.gcd(cfg.num_attention_heads, cfg.num_cross_attention_heads or cfg.num_attention_heads)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: DC-AE f32c32 (Sana 1.0's VAE): six levels, 32x spatial compression, 32 latent channels
_DC_AE = dict(
    in_channels=3,
    latent_channels=32,
    attention_head_dim=32,
    encoder_block_types=["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock",
                         "EfficientViTBlock"],
    decoder_block_types=["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock",
                         "EfficientViTBlock"],
    encoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
    decoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
    encoder_layers_per_block=[2, 2, 2, 3, 3, 3],
    decoder_layers_per_block=[3, 3, 3, 3, 3, 3],
    encoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
    decoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
    downsample_block_type="Conv",
    upsample_block_type="interpolate",
    decoder_norm_types=["batch_norm", "batch_norm", "batch_norm", "rms_norm", "rms_norm", "rms_norm"],
    decoder_act_fns=["relu", "relu", "relu", "silu", "silu", "silu"],
    scaling_factor=0.41407,
)

#: Sana's flow-matching DPM-Solver++ scheduler
_SANA_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)

SANA_1600M = SynthArch(
    name="sana-1600m",
    description="Sana 1600M 1024px transformer (20 blocks, linear attention 70 heads x 32, cross-attention 20 x 112, "
                "Mix-FFN 2.5x, 1.6B params), DC-AE f32c32, one-layer Gemma-2",
    pipeline="SanaPipeline",
    transformer_class="SanaTransformer2DModel",
    transformer=dict(
        in_channels=32,
        out_channels=32,
        num_attention_heads=70,
        attention_head_dim=32,
        num_layers=20,
        num_cross_attention_heads=20,
        cross_attention_head_dim=112,
        cross_attention_dim=2240,
        caption_channels=2304,
        mlp_ratio=2.5,
        attention_bias=False,
        sample_size=32,
        patch_size=1,
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    ),
    vae=_DC_AE,
    clip={},
    # Gemma-2 2B's width (2304), one layer
    t5=dict(hidden_size=2304, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            head_dim=256),
    scheduler=_SANA_SCHEDULER,
    scheduler_class="DPMSolverMultistepScheduler",
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=300,
)

#: diffusers' own test configuration at ditmesh's tiny sizes; the DC-AE keeps its six levels (32x), one narrow
#: ResBlock each. sample_size 16 is the smallest SanaPipeline's resolution binning knows (512 px: a 16 x 16 latent).
_SANA_TINY = dataclasses.replace(
    SANA_1600M,
    name="sana-tiny",
    description="Sana architecture shrunk for CPU tests: 2 blocks, linear attention 6 heads x 16, cross-attention "
                "6 x 16, a six-level 32x DC-AE of 8-channel ResBlocks",
    transformer=dict(SANA_1600M.transformer, in_channels=4, out_channels=4, num_attention_heads=6, attention_head_dim=16,
                     num_layers=2, num_cross_attention_heads=6, cross_attention_head_dim=16, cross_attention_dim=96,
                     caption_channels=32, sample_size=16),
    vae=dict(_DC_AE, latent_channels=4, attention_head_dim=8, encoder_block_types="ResBlock",
             decoder_block_types="ResBlock", encoder_block_out_channels=[8] * 6, decoder_block_out_channels=[8] * 6,
             encoder_layers_per_block=[1] * 6, decoder_layers_per_block=[1] * 6, encoder_qkv_multiscales=[[]] * 6,
             decoder_qkv_multiscales=[[]] * 6, decoder_norm_types="rms_norm", decoder_act_fns="silu"),
    t5=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16),
    default_dtype="float32",
    default_size=(256, 256),
    max_sequence_length=32,
)

SANA_ARCHS = (
    SANA_1600M,
    _SANA_TINY,
    dataclasses.replace(
        _SANA_TINY,
        name="sana-tiny-tp",
        description="sana-tiny with 4 heads x 16 in both attentions (64 wide), so tensor parallelism of degree 4 "
                    "divides the heads",
        transformer=dict(_SANA_TINY.transformer, num_attention_heads=4, num_cross_attention_heads=4,
                         cross_attention_dim=64),
    ),
)


def sana_components(arch: SynthArch, kit) -> dict:
    """SanaPipeline's other components: the DC-AE (``AutoencoderDC``) and a Gemma-2 text encoder with a Gemma
    tokenizer (``arch.t5`` holds the text encoder's sizes)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderDC, arch.vae, 1), **kit.gemma2_text_encoder(arch))


SANA = register(
    ModelAdapter(
        name="sana",
        class_names=("SanaTransformer2DModel",),
        num_heads=sana_heads,
        sequence_plan=SequencePlan(
            streams=("image",),
            outputs={"patch_embed": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            grid=TokenGrid("image", width=sana_grid_width, rows={"transformer_blocks.*": "height"},
                           convs=("transformer_blocks.*.ff.conv_depth",)),
        ),
        attention=AttentionSelector(class_names=("Attention",)),
        sequence_processor=SanaSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",)),),
        sequence_traffic=sana_sequence_traffic,
        modulated_input=pixart_modulated_input,  # the same adaLN-single modulation of norm1
        example_inputs=sana_example_inputs,
        layout=sana_layout,
        text_tokens=300,  # SanaPipeline's max_sequence_length
        tensor_plan=SANA_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_attention_mask", "attention_mask", "timestep",
                      "guidance"),
        cfg_mode="batched",  # SanaPipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("SanaPipeline", "SanaSprintPipeline"),
        synth_archs=SANA_ARCHS,
        synth_components=sana_components,
    )
)
