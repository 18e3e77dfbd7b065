"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``, ``QwenImage21Pipeline``): one joint sequence under a block-causal
mask, with a prefix K/V cache across steps.

The model interleaves the text (the vision-language encoder's sequence) and the images (condition images first, the
target image last, each ``2 x 2`` latent tokens per encoder slot) into ONE sequence, which every single-stream block
attends over with the mask ``(q >= k) or same image block``: text is causal, each image block bidirectional, the
target sees everything. With ``causal_condition`` the text and condition-image tokens are modulated from ``t = 0``, so
their keys and values do not change between steps: the pipeline's first call (``kv_cache_mode="extract"``) stores
them per layer, later calls (``"cached"``) run the target tokens alone against that prefix.

Sequence plan: one stream, ``joint``. Its tokens are split at the input of ``transformer_blocks.0`` (the model builds
the sequence before it), the RoPE table and the per-token modulation row selector (``target_token_mask``) at every
block's input and at ``norm_out``'s, and ``proj_out``'s output is gathered. In a cached call the model has already cut
the sequence, the table and the selector to the target tokens, so the same points split the target alone.

The processor (:class:`QwenImage21SequenceParallelProcessor`) projects, normalizes and rotates the local tokens as
diffusers' does, and then

- in a full call (and the extracting one): builds the block-causal mask over the global sequence from the prefix
  segments and key padding the model passes (the same mask diffusers' per-segment attention applies) and hands it to
  ``sp.attention``; when extracting, it all-gathers this layer's keys and values over the sequence-parallel ranks (one
  all-gather of K and V together) and stores the global prefix, so every rank holds the whole cached prefix;
- in a cached call: the target tokens' keys and values go through ``sp.attention`` with a ``local`` attention that
  puts the cached prefix (of the heads this rank attends with) before the gathered target keys, under the key padding
  mask the model passes over ``[prefix, target]``.

Tensor plan: diffusers' ``_tp_plan`` (Q/K/V and both SwiGLU inputs column-parallel, the attention output and the SwiGLU
output row-parallel: 2 all-reduces per block). The processor splits heads by ``inner_dim // heads``, which stays the
head dim, so no head count changes. CFG: true CFG, two calls a step, each branch with its own cache.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

from ..comm import offsets, split_sizes
from .base import (AttentionSelector, BlockList, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan, Split,
                   SynthArch, TensorPlan, register, spatial_latent, with_torchvision)
from .qwenimage import QWENIMAGE_SCHEDULER, qwen3vl_processor, qwen3vl_sizes


def block_causal_mask(segments, key_valid, length: int, device) -> torch.Tensor:
    """The prefill mask of Qwen-Image 2.1 over the global sequence of ``length`` tokens, ``[1 or B, 1, N, N]`` boolean:
    query ``q`` sees the keys before ``end(q)``, where ``end`` is ``q + 1`` for a text token, its block's end for a
    condition-image token and ``length`` for a target token (``segments``: the prefix's ``(start, end, is_text)`` runs);
    ``key_valid`` ``[B, N]`` (or None) drops padded text keys."""
    end = torch.full((length,), length, dtype=torch.long, device=device)
    for start, stop, is_text in segments:
        end[start:stop] = torch.arange(start + 1, stop + 1, device=device) if is_text else stop
    mask = (torch.arange(length, device=device)[None, :] < end[:, None])[None, None]
    return mask if key_valid is None else mask & key_valid.bool()[:, None, None, :]


class QwenImage21SequenceParallelProcessor:
    """Attention processor for ``QwenImage21Attention`` whose attention runs sequence-parallel (module docstring)."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, attention_mask=None, rotary_emb=None, layer_cache=None,
                 kv_cache_mode=None, cache_write_slice=None, segments=None, key_valid=None):
        head_dim = attn.inner_dim // attn.heads  # unchanged by tensor parallelism

        def heads(linear):
            return linear(hidden_states).unflatten(-1, (-1, head_dim))

        query, key, value = heads(attn.to_q), heads(attn.to_k), heads(attn.to_v)
        query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
        if rotary_emb is not None:
            query, key = (apply_rotary_emb_qwen(t, rotary_emb, use_real=False) for t in (query, key))

        if kv_cache_mode == "cached":
            out = self._cached(query, key, value, layer_cache, attention_mask)
        else:
            if segments is None:
                raise ValueError("Qwen-Image 2.1 under sequence parallelism needs the prefix segments the model "
                                 "passes to its non-flex processors")
            length = self.sp.stream_length("joint")
            mask = block_causal_mask(segments, key_valid, length, query.device)
            out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=mask)
            if layer_cache is not None and kv_cache_mode == "extract" and cache_write_slice is not None:
                both = self.sp.gather(torch.cat([key, value], dim=-1), 1, "joint")[:, cache_write_slice]
                layer_cache.store(*(t.clone() for t in both.chunk(2, dim=-1)))
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))

    def _cached(self, query, key, value, layer_cache, attention_mask):
        """The target's local tokens against the cached prefix (whole on every rank) and every rank's target keys."""
        cached_k, cached_v = layer_cache.get()
        heads = query.shape[-2]
        sizes = split_sizes(heads, self.sp.ulysses_degree)  # the heads each Ulysses rank attends with
        first, count = offsets(sizes)[self.sp.ulysses_rank], sizes[self.sp.ulysses_rank]
        backend = self._attention_backend

        def local(q, k, v):
            k = torch.cat([cached_k.narrow(-2, first, count), k], dim=1)
            v = torch.cat([cached_v.narrow(-2, first, count), v], dim=1)
            return dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, backend=backend)

        return self.sp.attention(query, key, value, backend=backend, local=local)


def qwenimage21_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one full (uncached) QwenImage21Pipeline step: ``text_len`` encoder positions of text, then
    the target image's slots (one per ``2 x 2`` latent tokens; the VAE divides by 16 and the latents are not packed)."""
    cfg = model.config
    h, w = height // 16, width // 16
    if h % 2 or w % 2:
        raise ValueError(f"Qwen-Image 2.1 needs an even latent grid (2x2 tokens per encoder slot): {height}x{width} "
                         f"gives {h}x{w}; use multiples of 32")
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    slots = h * w // 4
    img_mask = torch.cat([torch.zeros(batch, text_len, dtype=torch.bool), torch.ones(batch, slots, dtype=torch.bool)], 1)
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.context_in_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        img_shapes=[[(1, h, w)]] * batch,
        img_mask=img_mask.to(device),
        return_dict=False,
    )


def qwenimage21_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a QwenImage21Pipeline call: the VAE divides by 16 and each latent pixel is one token (1024 x
    1024: 4,096); text and image are one sequence, split together."""
    spatial_latent(height, width, 32, "Qwen-Image 2.1 (16x VAE, 2x2 tokens per encoder slot)")
    image = (height // 16) * (width // 16)
    return Layout(image, text_tokens, image + text_tokens, (image, config.get("in_channels", 64)))


def qwenimage21_output_tokens(model, kwargs: dict) -> int:
    """Tokens of a call's output: the whole joint sequence (text and every image), or the target alone in a cached
    call. The pipeline keeps the target's tail."""
    target = torch.tensor(kwargs["img_shapes"][0][-1]).prod().item()
    if kwargs.get("kv_cache_mode") == "cached":
        return target
    img_mask = kwargs["img_mask"][0]
    return int(img_mask.numel() + 3 * int(img_mask.sum()))


def qwenimage21_meta_trace(model: torch.nn.Module):
    """Make ``model``'s forward traceable on the meta device for the planner: the sequence it builds from the image
    slots (``repeat_interleave`` by the mask, an index put, positions read on the host) is built as the example inputs
    lay it out, the text then the target image, with a RoPE table of its shape; the blocks, the norm and the projection
    run as they are, each attention as one call over the whole sequence (what the sequence-parallel processor runs,
    under the block-causal mask). Returns the undo callable."""
    import types

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask, **ignored):
        text = encoder_hidden_states.shape[1]
        joint = torch.cat([self.txt_in(encoder_hidden_states), self.img_in(hidden_states)], dim=1)
        length = joint.shape[1]
        rotary = joint.new_empty(length, sum(self.config.axes_dims_rope) // 2, dtype=torch.complex64)
        target = torch.arange(length, device=joint.device) >= text
        temb = self.time_text_embed(torch.cat([timestep, timestep.new_zeros(1)]).to(joint.dtype), joint)
        modulation = self.modulation(temb)
        for block in self.transformer_blocks:
            joint = block(hidden_states=joint, modulation=modulation, rotary_emb=rotary, target_token_mask=target)
        return (self.proj_out(self.norm_out(joint, temb, target)),)

    model.forward = types.MethodType(forward, model)
    return lambda: delattr(model, "forward")


QWENIMAGE21_TENSOR_PLAN = TensorPlan(
    colwise=("transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v",
             "transformer_blocks.*.img_mlp.proj", "transformer_blocks.*.img_mlp.gate_layer"),
    rowwise=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.img_mlp.out"),
)

def qwenimage21_components(arch: SynthArch, kit) -> dict:
    """QwenImage21Pipeline's other components: its 16x VAE (``arch.vae``) and a Qwen3-VL for conditional generation
    (``arch.t5``) with its processor (:func:`~ditmesh.models.qwenimage.qwen3vl_processor`: the pipeline calls it on
    the prompt and the condition images, and reads its tokenizer)."""
    import diffusers

    encoder = qwen3vl_processor(arch, kit)
    return dict(vae=kit.make(diffusers.AutoencoderKLQwenImage21, arch.vae, 1), text_encoder=encoder["text_encoder"],
                processor=encoder["processor"])


#: 16x VAE, latents not packed; the pipeline's dynamic shift
QWENIMAGE21 = SynthArch(
    name="qwenimage21",
    description="Qwen-Image 2.1 transformer as diffusers' defaults (32 single-stream blocks, 32 heads x 128, text "
                "width 4096, block-causal attention), its VAE, a two-layer Qwen3-VL of Qwen3-VL-8B's width",
    pipeline="QwenImage21Pipeline",
    transformer_class="QwenImage21Transformer2DModel",
    transformer=dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                     num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=[16, 56, 56]),
    vae={},
    clip={},
    t5=qwen3vl_sizes(4096, 2, 128, [24, 20, 20]),
    scheduler=QWENIMAGE_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=512,
)

#: the transformer's test-sized configuration: 2 blocks, 4 heads of 16 (tp 2 and 4 divide them), RoPE 4 + 6 + 6
QWENIMAGE21_TINY = dataclasses.replace(
    QWENIMAGE21, name="qwenimage21-tiny",
    description="Qwen-Image 2.1 shrunk for CPU tests: 2 single-stream blocks, 4 heads x 16, text width 32; a 16x VAE "
                "4 channels wide without residual blocks, a two-layer Qwen3-VL",
    transformer=dict(QWENIMAGE21.transformer, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                     num_attention_heads=4, context_in_dim=32, axes_dims_rope=[4, 6, 6]),
    vae=dict(base_dim=4, decoder_base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
             latents_mean=[0.0] * 16, latents_std=[1.0] * 16),
    t5=qwen3vl_sizes(32, 2, 8, [1, 1, 2], kv_heads=2, intermediate_size=16),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


QWENIMAGE21_ADAPTER = register(
    ModelAdapter(
        name="qwenimage21",
        class_names=("QwenImage21Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={
                "transformer_blocks.0": {"hidden_states": Split(dim=1, stream="joint", ndim=3)},
                "transformer_blocks.*": {"rotary_emb": Split(dim=0, stream="joint", ndim=2),
                                         "target_token_mask": Split(dim=0, stream="joint", ndim=1)},
                "norm_out": {"target_token_mask": Split(dim=0, stream="joint", ndim=1)},
            },
            gathers={"proj_out": Gather(dim=1, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; the joint sequence is split where the blocks start, its "
                                 "block-causal mask built whole and reordered like the keys, the cached prefix held "
                                 "whole on every rank",
        ),
        attention=AttentionSelector(class_names=("QwenImage21Attention",)),
        sequence_processor=QwenImage21SequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",)),),
        token_wise=("transformer_blocks.*.img_mlp",),
        example_inputs=qwenimage21_inputs,
        layout=qwenimage21_layout,
        text_tokens=512,
        tensor_plan=QWENIMAGE21_TENSOR_PLAN,
        # img_mask stays whole: the model reads its first row only (the samples of a call share one layout)
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"),
        output_tokens=qwenimage21_output_tokens,
        cfg_mode="sequential",  # true CFG: the prompt's call, then the negative prompt's, each with its own cache
        cfg_switch="true_cfg_scale",
        cfg_hint="a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt ' ' --true-cfg-scale 4)",
        output_channel_dim=-1,
        out_channels=lambda model: model.proj_out.out_features,
        pipelines=("QwenImage21Pipeline",),
        # condition images (the pipeline's own class, which also generates from text alone): in the prompt through
        # the Qwen3-VL processor and in the joint sequence as the prefix's image blocks
        image_pipelines=(ImagePipeline("edit", "QwenImage21Pipeline", strength=False, processor="Qwen3VLProcessor"),),
        synth_archs=(QWENIMAGE21_TINY, QWENIMAGE21),
        synth_components=with_torchvision("Qwen-Image 2.1", "QwenImage21Pipeline calls a Qwen3-VL processor on text "
                                          "and images and reads its tokenizer (a tokenizer cannot stand in), and that "
                                          "processor's video processor needs torchvision", qwenimage21_components),
        meta_trace=qwenimage21_meta_trace,
        pp_refusal="Qwen-Image 2.1's prefix K/V cache and block-causal mask are not carried across PipeFusion's patches",
        graph_refusal="Qwen-Image 2.1's forward reads its image layout on the host (tolist) to build the segments",
    )
)
