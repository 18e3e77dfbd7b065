"""Wan 2.1 / 2.2 (``WanTransformer3DModel``): video self-attention with 3-D RoPE, separate text cross-attention.

Where the tokens are: ``forward`` computes the RoPE table from the latent's shape (``rope``), patchifies
with a Conv3d (``patch_embedding``), flattens to ``[B, N, D]`` video tokens, runs the blocks, and
unpatchifies after ``proj_out``. :func:`wan_sequence_hooks` therefore splits

- the RoPE table (``rope``'s output, cos and sin ``[1, N, 1, D]``) on its token dim, so every rank rotates
  its tokens with their own global positions;
- the video tokens at the input of ``blocks.0`` (after patchify, embedding and flatten);
- Wan 2.2's per-token timesteps (``timestep`` of shape ``[B, N]``, TI2V) at the entry, so ``temb`` and the
  per-token modulation are local too;

and gathers once at the output of ``proj_out``, before unpatchify. Token counts need not divide the degree
(e.g. 5 frames give 2 latent frames); chunk sizes come from the global length only.

Attention: ``attn1`` is self-attention over the video tokens and runs through ``sp.attention``. ``attn2``
is cross-attention to the text (and, for I2V, the image) context: the context is replicated on every rank
and the query is local, so it needs no communication at all; the model's own processor runs it.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_wan

from .base import ModelAdapter, SequencePlan, TensorPlan, register


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on ``[B, S, H, D]``: rotate each (even, odd) channel pair by the angle of its frequency.

    ``cos``/``sin`` hold each angle twice (``repeat_interleave``), so the even entries of one table suffice.
    """
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


class WanSequenceParallelProcessor:
    """Processor for ``WanAttention``: self-attention sequence-parallel, cross-attention local.

    Self-attention computes projections, QK-norms (RMS over all heads of one token) and RoPE on local
    tokens as diffusers' ``WanAttnProcessor`` does; only the softmax attention goes through
    ``sp.attention``. Cross-attention is handed to the previous processor unchanged: local queries against
    the full, replicated context give exactly the local rows of the single-GPU result.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if attention_mask is not None:
            raise NotImplementedError("ditmesh sequence parallelism does not support an attention_mask for Wan")
        q, k, v = transformer_wan._get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        head_dim = attn.inner_dim // attn.heads  # unchanged by tensor parallelism, which divides both
        q, k, v = (t.unflatten(2, (-1, head_dim)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate_pairs(q, *rotary_emb), rotate_pairs(k, *rotary_emb)
        out = self.sp.attention(q, k, v, backend=self._attention_backend)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def wan_sequence_hooks(model, sp) -> list:
    """Split RoPE and video tokens where they exist inside ``forward``; gather after ``proj_out``."""

    def split_timestep(module, args, kwargs):
        timestep = kwargs.get("timestep")
        if timestep is None or timestep.ndim != 2:
            return None  # one timestep per sample (Wan 2.1): replicated
        return args, dict(kwargs, timestep=sp.split(timestep, 1, "video"))

    def split_rope(module, args, out):
        return tuple(sp.split(t, 1, "video") for t in out)

    def split_tokens(module, args, kwargs):
        if args:  # the model calls its blocks positionally: (hidden_states, encoder_hidden_states, temb, rotary_emb)
            return (sp.split(args[0], 1, "video"),) + tuple(args[1:]), kwargs
        return args, dict(kwargs, hidden_states=sp.split(kwargs["hidden_states"], 1, "video"))

    return [
        model.register_forward_pre_hook(split_timestep, with_kwargs=True),
        model.rope.register_forward_hook(split_rope),
        model.blocks[0].register_forward_pre_hook(split_tokens, with_kwargs=True),
        model.proj_out.register_forward_hook(lambda module, args, out: sp.gather(out, 1, "video")),
    ]


def wan_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames: int = 81) -> dict:
    """Transformer inputs of one WanPipeline denoising step (random latents and text embeddings).

    ``frames`` video frames become ``(frames - 1) // 4 + 1`` latent frames (the Wan VAE's 4x temporal
    compression); height and width shrink 8x.
    """
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, cfg.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.text_dim),
        return_dict=False,
    )


#: Tensor plan. Self-attention (``attn1``) and cross-attention (``attn2``, queries from the video tokens,
#: keys/values from the replicated text context) Q/K/V column-parallel and ``to_out.0`` row-parallel; FFN
#: up column / down row: 3 row-parallel all-reduces per block. Wan's QK-norms (``norm_q``, ``norm_k``) are
#: RMSNorms over the whole inner dim, applied BEFORE the head split: under tp they are ``sharded_norms``
#: (weight split like the projection's output, mean square summed over the tp group), one small all-reduce
#: each, 4 per block, so 7 all-reduces per block. I2V checkpoints' image-context projections
#: (``add_k_proj``, ``add_v_proj``) and their ``norm_added_k`` likewise (5 norms, 7 + 1 = 8 per block);
#: the ``?`` patterns may match nothing (T2V). The condition embedder (time, text, image), the per-block
#: ``scale_shift_table``, ``norm2`` and ``proj_out`` stay replicated. Fused projections (``fuse_projections``)
#: are not covered by the plan.
WAN_TENSOR_PLAN = TensorPlan(
    colwise=(
        "blocks.*.attn1.to_q", "blocks.*.attn1.to_k", "blocks.*.attn1.to_v",
        "blocks.*.attn2.to_q", "blocks.*.attn2.to_k", "blocks.*.attn2.to_v",
        "blocks.*.attn2.add_k_proj?", "blocks.*.attn2.add_v_proj?",
        "blocks.*.ffn.net.0.proj",
    ),
    rowwise=("blocks.*.attn1.to_out.0", "blocks.*.attn2.to_out.0", "blocks.*.ffn.net.2"),
    per_rank_attrs={"blocks.*.attn1": ("heads", "inner_dim", "kv_inner_dim"),
                    "blocks.*.attn2": ("heads", "inner_dim", "kv_inner_dim")},
    sharded_norms=(
        "blocks.*.attn1.norm_q", "blocks.*.attn1.norm_k",
        "blocks.*.attn2.norm_q", "blocks.*.attn2.norm_k", "blocks.*.attn2.norm_added_k?",
    ),
)


WAN = register(
    ModelAdapter(
        name="wan",
        class_names=("WanTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(inputs={}, streams=("video",), output_stream=None),
        attention_class_names=("WanAttention",),
        sequence_processor=WanSequenceParallelProcessor,
        sequence_hooks=wan_sequence_hooks,
        example_inputs=wan_example_inputs,
        tensor_plan=WAN_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        cfg_mode="sequential",  # WanPipeline calls the transformer once for cond, once for uncond
        output_channel_dim=1,
        fuse_qkv=True,
        out_channels=lambda model: model.config.out_channels,
    )
)
