"""PRX (``PRXTransformer2DModel``, ``PRXPipeline`` and its pixel-space pipeline): image queries over ``[text, image]``
keys, the text never updated.

``forward`` projects the text once (``txt_in``), patchifies the image, builds its RoPE table (``pe_embedder``,
``[B, 1, L_img, D / 2, 2, 2]``) and runs the blocks: each attends from the image tokens to the keys and values of the
text (its own projection, the same text in every block) and of the image, under the prompts' key padding, then a
gated MLP; ``final_layer`` projects the image tokens.

Sequence plan: the image tokens split at the input of ``blocks.0``, their RoPE table at ``pe_embedder``'s output, the
text at every block's input (each block takes the whole projected text), each on its own stream; ``final_layer``'s
output gathered. The attention's queries are the image tokens only, while sequence parallelism exchanges queries with
the keys: the processor gives the local text tokens queries too (their keys, which are never read back) and drops
their rows of the output, so the image rows are exactly the model's. The key padding is extended over the global image
length and reordered like the keys.

Tensor plan: the fused image Q/K/V and text K/V projections column-parallel part by part, the attention output
row-parallel, the gated MLP column -> row (2 all-reduces per block). CFG: one call on ``[uncond, cond]`` (batched).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_prx import apply_rope

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import FLUX_VAE
from .wan import ftfy_setup


class PRXSequenceParallelProcessor:
    """Attention processor for ``PRXAttention`` whose attention runs sequence-parallel (module docstring)."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if encoder_hidden_states is None:
            raise ValueError("PRX's attention takes the text tokens (encoder_hidden_states)")
        q, k, v = attn.img_qkv_proj(hidden_states).unflatten(-1, (3, attn.heads, attn.head_dim)).unbind(2)
        q, k = attn.norm_q(q), attn.norm_k(k)
        tk, tv = attn.txt_kv_proj(encoder_hidden_states).unflatten(-1, (2, attn.heads, attn.head_dim)).unbind(2)
        tk = attn.norm_added_k(tk)
        if image_rotary_emb is not None:  # [B, 1, L, D / 2, 2, 2] rotates [B, H, L, D]
            q, k = (apply_rope(t.transpose(1, 2), image_rotary_emb).transpose(1, 2) for t in (q, k))
        mask = None
        if attention_mask is not None:  # key padding over [text, image], global order
            image = attention_mask.new_ones(hidden_states.shape[0], self.sp.stream_length("image"))
            mask = torch.cat([attention_mask.bool(), image.bool()], dim=1)
        text = tk.shape[1]
        out = self.sp.attention(torch.cat([tk, q], dim=1), torch.cat([tk, k], dim=1), torch.cat([tv, v], dim=1),
                                backend=self._attention_backend, mask=mask)
        out = attn.to_out[0](out[:, text:].flatten(2, 3))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def prx_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one PRXPipeline step: latents 8x smaller than the image, ``text_len`` text tokens with the
    first sample's last 3 padded."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    mask = torch.ones(batch, text_len, dtype=torch.bool, device=device)
    mask[0, max(1, text_len - 3):] = False
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
                timestep=torch.full((batch,), 0.7).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.context_in_dim), attention_mask=mask, return_dict=False)


def prx_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a PRXPipeline call: the VAE divides by 8, 2x2 patches become one token."""
    lh, lw = spatial_latent(height, width, 16, "PRX (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 16), lh, lw))


PRX = SynthArch(
    name="prx",
    description="PRX transformer as diffusers' defaults (16 blocks, 28 heads x 64, text width 2304), FLUX.1's VAE, a "
                "one-layer T5Gemma encoder of T5Gemma-2B's width",
    pipeline="PRXPipeline",
    transformer_class="PRXTransformer2DModel",
    transformer=dict(in_channels=16, patch_size=2, context_in_dim=2304, hidden_size=1792, mlp_ratio=3.5, num_heads=28,
                     depth=16, axes_dim=[32, 32]),
    vae=FLUX_VAE, clip={},
    t5=dict(hidden_size=2304, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            head_dim=256),
    scheduler=dict(num_train_timesteps=1000),
    default_dtype="bfloat16",
    max_sequence_length=256,
)

#: diffusers' test configuration (1792 wide, 28 heads, 4 blocks) is 200M parameters, too large for CPU tests: the same
#: layout at 2 blocks of 4 heads x 16
PRX_TINY = dataclasses.replace(
    PRX, name="prx-tiny",
    description="PRX shrunk for CPU tests: 2 blocks, 4 heads x 16, text width 32; a tiny VAE and T5Gemma",
    transformer=dict(in_channels=16, patch_size=2, context_in_dim=32, hidden_size=64, mlp_ratio=3.5, num_heads=4,
                     depth=2, axes_dim=[8, 8]),
    vae=dict(FLUX_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    t5=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)

def prx_components(arch: SynthArch, kit) -> dict:
    """PRXPipeline's other components: FLUX.1's AutoencoderKL layout and a T5Gemma encoder (``arch.t5``: its one
    stack, Gemma-2 layers attending both ways) with a local Gemma tokenizer that starts texts with ``<bos>``."""
    import diffusers
    import transformers
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder  # not exported at the top level

    tokenizer = kit.gemma_tokenizer(arch.max_sequence_length, add_bos=True)
    sizes = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=8192,
                 layer_types=["full_attention"] * arch.t5["num_hidden_layers"], **arch.t5)
    # the encoder is built from its stack's config as the whole model's config completes it (dropout, attention), and
    # keeps the whole config, as released checkpoints store it: diffusers' loader reads it and takes its ``encoder``
    config = transformers.T5GemmaConfig(encoder=transformers.T5GemmaModuleConfig(**sizes), is_encoder_decoder=False,
                                        attn_implementation="eager", **sizes)
    encoder = kit.make(T5GemmaEncoder, config.encoder, 3)
    encoder.config = config
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), tokenizer=tokenizer, text_encoder=encoder)


PRX_ADAPTER = register(
    ModelAdapter(
        name="prx",
        class_names=("PRXTransformer2DModel",),
        num_heads=lambda model: model.config.num_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            inputs={"blocks.0": {"hidden_states": Split(dim=1, stream="image", ndim=3)},
                    "blocks.*": {"encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            outputs={"pe_embedder": {None: Split(dim=2, stream="image", ndim=6)}},
            gathers={"final_layer": Gather(dim=1, stream="image")},
            whole=("attention_mask",),
            differs_from_cp_plan="the class has no _cp_plan; image tokens split where the blocks start, the unchanged "
                                 "text at every block, the text's key padding whole and reordered like the keys",
        ),
        attention=AttentionSelector(class_names=("PRXAttention",)),
        sequence_processor=PRXSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",)),),
        example_inputs=prx_example_inputs,
        layout=prx_layout,
        text_tokens=256,
        tensor_plan=TensorPlan(
            colwise=("blocks.*.gate_proj", "blocks.*.up_proj"),
            rowwise=("blocks.*.attention.to_out.0", "blocks.*.down_proj"),
            packed_colwise={"blocks.*.attention.img_qkv_proj": ("inner_dim", "inner_dim", "inner_dim"),
                            "blocks.*.attention.txt_kv_proj": ("inner_dim", "inner_dim")},
            per_rank_attrs={"blocks.*.attention": ("heads",)},
        ),
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "attention_mask"),
        cfg_mode="batched",  # one call on [uncond, cond]
        output_channel_dim=1,
        out_channels=lambda model: model.config.in_channels,
        pipelines=("PRXPipeline", "PRXPixelPipeline"),
        synth_archs=(PRX_TINY, PRX),
        synth_components=prx_components,
        pipeline_setup=ftfy_setup("prx.pipeline_prx"),  # PRXPipeline cleans prompts with ftfy unless told not to
        pp_refusal="PRX's attention takes image queries over [text, image] keys under the text's key padding, which "
                   "PipeFusion's patches do not carry",
    )
)
