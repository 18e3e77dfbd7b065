"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``): joint image+text attention, MMDiT.

Where the tokens are: the model patchifies inside ``forward`` (``pos_embed`` turns the latent
``[B, C, H, W]`` into ``[B, N, D]`` image tokens and adds the cropped position table), and unpatchifies
after ``proj_out``. So the image stream is split at the output of ``pos_embed`` and gathered at the
output of ``proj_out`` (:func:`sd3_sequence_hooks`); positions are already added to the tokens, so
nothing else travels with them. Text tokens (``encoder_hidden_states``) exist at the entry and are split
there as their own stream; ``context_embedder`` is per token.

Attention: ``JointAttnProcessor2_0`` concatenates ``[image, text]`` (image first) for Q, K and V. Each
rank does the same with its local chunks, so the full sequence a rank attends over is
``[rank0 image, rank0 text, rank1 image, ...]``, a permutation of the single-GPU order, which unmasked
softmax attention does not see. SD3.5 adds per-head RMS QK-norms (``norm_q``, ``norm_k``,
``norm_added_q``, ``norm_added_k``: computed on local tokens, they act per token) and, in the blocks of
``dual_attention_layers``, a second image-only self-attention ``attn2``: it attends over the image stream
alone (``streams=("image",)``). The last block is ``context_pre_only``: its text output is dropped.
"""

from __future__ import annotations

import torch

from .base import ModelAdapter, SeqInput, SequencePlan, TensorPlan, register


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


def sd3_sequence_hooks(model, sp) -> list:
    """Split image tokens after ``pos_embed``, gather them after ``proj_out`` (before unpatchify).

    ControlNet residuals (``block_controlnet_hidden_states``, one ``[B, N, D]`` per block group) carry
    image tokens too and are split with the same sizes at the entry.
    """

    def split_controlnet(module, args, kwargs):
        residuals = kwargs.get("block_controlnet_hidden_states")
        if not residuals:
            return None
        return args, dict(kwargs, block_controlnet_hidden_states=[sp.split(r, 1, "image") for r in residuals])

    return [
        model.register_forward_pre_hook(split_controlnet, with_kwargs=True),
        model.pos_embed.register_forward_hook(lambda module, args, out: sp.split(out, 1, "image")),
        model.proj_out.register_forward_hook(lambda module, args, out: sp.gather(out, 1, "image")),
    ]


def sd3_example_inputs(model, height, width, batch, text_len, generator, device, dtype) -> dict:
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


SD3 = register(
    ModelAdapter(
        name="sd3",
        class_names=("SD3Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            inputs={"encoder_hidden_states": SeqInput(dim=1, stream="text", ndim=3)},
            streams=("image", "text"),
            output_stream=None,  # gathered before unpatchify by sd3_sequence_hooks
        ),
        attention_class_names=("Attention",),
        sequence_processor=SD3SequenceParallelProcessor,
        sequence_hooks=sd3_sequence_hooks,
        example_inputs=sd3_example_inputs,
        tensor_plan=SD3_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
        cfg_mode="batched",  # StableDiffusion3Pipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
    )
)
