"""AuraFlow (``AuraFlowTransformer2DModel``, ``AuraFlowPipeline``): MMDiT joint blocks, then single blocks over the
concatenated sequence.

``forward`` patchifies the latent and adds its positional embedding (``pos_embed``), projects the text and puts 8
learned register tokens before it, runs the joint blocks over ``[text, image]`` (each stream with its own projections)
and the single blocks over ``cat([text, image])``, whose image part it keeps by the text's length before ``proj_out``.

Sequence plan: the image tokens split at ``pos_embed``'s output, the text (registers included) at the input of
``joint_transformer_blocks.0``, each on its own stream; the single blocks' concatenation is then each rank's
``[text, image]`` chunks, and the model cuts its image part by the local text length, so nothing else changes;
``proj_out``'s output is gathered. No mask, no RoPE (the positions are added in ``pos_embed``).

Tensor plan: Q/K/V (both streams) and the SwiGLU's two input projections column-parallel, the attention outputs and
the SwiGLU's ``out_projection`` row-parallel: 4 all-reduces per joint block, 2 per single block. CFG: one call on
``[uncond, cond]`` (batched).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent, vae_and_t5)
from .pixart import _SDXL_VAE


class AuraFlowSequenceParallelProcessor:
    """Attention processor for AuraFlow's attention layers whose attention runs sequence-parallel: diffusers'
    ``AuraFlowAttnProcessor2_0`` on the local tokens, the softmax attention over ``[text, image]`` (joint blocks) or
    the concatenated sequence (single blocks) through ``sp.attention``."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        def heads(linear, x, norm=None):
            out = linear(x).unflatten(-1, (attn.heads, -1))
            return norm(out) if norm is not None else out

        q, k = heads(attn.to_q, hidden_states, attn.norm_q), heads(attn.to_k, hidden_states, attn.norm_k)
        v = heads(attn.to_v, hidden_states)
        if encoder_hidden_states is not None:
            eq = heads(attn.add_q_proj, encoder_hidden_states, attn.norm_added_q)
            ek = heads(attn.add_k_proj, encoder_hidden_states, attn.norm_added_k)
            q, k = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1)
            v = torch.cat([heads(attn.add_v_proj, encoder_hidden_states), v], dim=1)
        out = self.sp.attention(q, k, v, backend=self._attention_backend).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        text, image = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        return attn.to_out[1](attn.to_out[0](image.contiguous())), attn.to_add_out(text.contiguous())


def auraflow_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one AuraFlowPipeline step: latents 8x smaller than the image, ``text_len`` text tokens."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
                encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
                timestep=torch.full((batch,), 0.7).to(device, dtype), return_dict=False)


def auraflow_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an AuraFlowPipeline call: the VAE divides by 8, 2x2 patches become one token; the text has 8
    register tokens before the prompt's."""
    lh, lw = spatial_latent(height, width, 16, "AuraFlow (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens + 8, image + text_tokens + 8, (config.get("in_channels", 4), lh, lw))


def _blocks(prefix: str, joint: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(column-parallel, row-parallel) patterns of one block list."""
    attn, ff = f"{prefix}.*.attn", f"{prefix}.*.ff"
    colwise = [f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v", f"{ff}.linear_1", f"{ff}.linear_2"]
    rowwise = [f"{attn}.to_out.0", f"{ff}.out_projection"]
    if joint:
        context = f"{prefix}.*.ff_context"
        colwise += [f"{attn}.add_q_proj", f"{attn}.add_k_proj", f"{attn}.add_v_proj", f"{context}.linear_1",
                    f"{context}.linear_2"]
        rowwise += [f"{attn}.to_add_out", f"{context}.out_projection"]
    return tuple(colwise), tuple(rowwise)


_JOINT, _SINGLE = _blocks("joint_transformer_blocks", True), _blocks("single_transformer_blocks", False)
AURAFLOW_TENSOR_PLAN = TensorPlan(
    colwise=_JOINT[0] + _SINGLE[0], rowwise=_JOINT[1] + _SINGLE[1],
    per_rank_attrs={"joint_transformer_blocks.*.attn": ("heads",), "single_transformer_blocks.*.attn": ("heads",)},
)

AURAFLOW = SynthArch(
    name="auraflow",
    description="AuraFlow v0.3 transformer as diffusers' defaults (4 joint + 32 single blocks, 12 heads x 256, text "
                "width 2048), the SDXL VAE, a one-layer UMT5 of Pile-T5-XL's width",
    pipeline="AuraFlowPipeline",
    transformer_class="AuraFlowTransformer2DModel",
    transformer=dict(sample_size=64, patch_size=2, in_channels=4, num_mmdit_layers=4, num_single_dit_layers=32,
                     attention_head_dim=256, num_attention_heads=12, joint_attention_dim=2048,
                     caption_projection_dim=3072, out_channels=4, pos_embed_max_size=1024),
    vae=_SDXL_VAE, clip={},
    t5=dict(d_model=2048, d_kv=64, d_ff=1024, num_layers=1, num_heads=32),
    scheduler=dict(num_train_timesteps=1000, shift=1.73),
    default_dtype="bfloat16",
    max_sequence_length=256,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_aura_flow.py): 1 joint + 1 single
#: block, 4 heads of 8, text width 32
AURAFLOW_TINY = dataclasses.replace(
    AURAFLOW, name="auraflow-tiny",
    description="AuraFlow at diffusers' test configuration: 1 joint + 1 single block, 4 heads x 8, text width 32; a "
                "tiny VAE and UMT5",
    transformer=dict(sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
                     attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                     out_channels=4, pos_embed_max_size=256),
    vae=dict(_SDXL_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    t5=dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


AURAFLOW_ADAPTER = register(
    ModelAdapter(
        name="auraflow",
        class_names=("AuraFlowTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            inputs={"joint_transformer_blocks.0": {"encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            outputs={"pos_embed": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the class has no _cp_plan; image tokens split where they appear, the text with its "
                                 "register tokens where the joint blocks start",
        ),
        attention=AttentionSelector(paths=("joint_transformer_blocks.*.attn", "single_transformer_blocks.*.attn")),
        sequence_processor=AuraFlowSequenceParallelProcessor,
        blocks=(BlockList("joint_transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states")),
                BlockList("single_transformer_blocks", ("hidden_states",), ("hidden_states",),
                          joins=("encoder_hidden_states", "hidden_states"))),
        token_wise=("joint_transformer_blocks.*.ff", "joint_transformer_blocks.*.ff_context",
                    "single_transformer_blocks.*.ff"),
        example_inputs=auraflow_example_inputs,
        layout=auraflow_layout,
        text_tokens=256,
        tensor_plan=AURAFLOW_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep"),
        cfg_mode="batched",  # one call on [uncond, cond]
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("AuraFlowPipeline",),
        synth_archs=(AURAFLOW_TINY, AURAFLOW),
        synth_components=vae_and_t5("AutoencoderKL", "UMT5EncoderModel", "UMT5Config"),
    )
)
