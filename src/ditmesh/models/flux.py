"""FLUX.1 (``FluxTransformer2DModel``): joint text+image attention.

Sequence plan: text tokens (``encoder_hidden_states``, ``txt_ids``) and image tokens (``hidden_states``,
``img_ids``) are each split into contiguous chunks over the sequence-parallel ranks. The model builds
RoPE from ``cat(txt_ids, img_ids)`` and every attention concatenates ``[text, image]``, so the local
positions line up with the local tokens without any change to the model. Only image tokens leave the
model (``proj_out``), and they are gathered once at the exit.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux

from .base import ModelAdapter, SeqInput, SequencePlan, TensorPlan, register


class FluxSequenceParallelProcessor:
    """Attention processor for ``FluxAttention`` whose core attention runs sequence-parallel.

    Projections, QK-norms and RoPE are computed on the local tokens exactly as diffusers'
    ``FluxAttnProcessor`` does; only the softmax attention itself goes through ``sp.attention``.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("ditmesh sequence parallelism does not support an attention_mask for FLUX")
        q, k, v, eq, ek, ev = transformer_flux._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        joint = attn.added_kv_proj_dim is not None and encoder_hidden_states is not None
        if joint:
            eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)

        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        out = out.flatten(2, 3).to(q.dtype)

        if not joint:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        text_out = attn.to_add_out(text_out.contiguous())
        return image_out, text_out


def flux_example_inputs(model, height, width, batch, text_len, generator, device, dtype) -> dict:
    """Transformer inputs of one FluxPipeline denoising step (random latents and text embeddings)."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] += torch.arange(h)[:, None]
    img_ids[..., 2] += torch.arange(w)[None, :]
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        pooled_projections=rand(batch, cfg.pooled_projection_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        guidance=torch.full((batch,), 3.5).to(device, dtype) if cfg.guidance_embeds else None,
        img_ids=img_ids.reshape(h * w, 3).to(device, dtype),
        txt_ids=torch.zeros(text_len, 3).to(device, dtype),
        return_dict=False,
    )


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


FLUX = register(
    ModelAdapter(
        name="flux",
        class_names=("FluxTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            inputs={
                "hidden_states": SeqInput(dim=1, stream="image", ndim=3),
                "img_ids": SeqInput(dim=0, stream="image", ndim=2),
                "encoder_hidden_states": SeqInput(dim=1, stream="text", ndim=3),
                "txt_ids": SeqInput(dim=0, stream="text", ndim=2),
            },
            streams=("text", "image"),
            output_stream="image",
            output_dim=1,
        ),
        attention_class_names=("FluxAttention",),
        sequence_processor=FluxSequenceParallelProcessor,
        example_inputs=flux_example_inputs,
        tensor_plan=FLUX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
        cfg_mode="sequential",  # FluxPipeline's true CFG calls the transformer twice per step
        output_channel_dim=-1,
        fuse_qkv=True,
        out_channels=lambda model: model.proj_out.out_features,
    )
)
