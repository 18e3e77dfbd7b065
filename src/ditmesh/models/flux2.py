"""FLUX.2 (``Flux2Transformer2DModel``; ``Flux2Pipeline`` for FLUX.2-dev, ``Flux2KleinPipeline`` for the Klein
models): FLUX.1's layout of double-stream then single-stream blocks, with 4-axis position ids, modulation shared by
all blocks of a kind, and single blocks whose Q, K, V and MLP input are one fused linear.

Sequence plan (diffusers' ``_cp_plan`` with streams): the text (``encoder_hidden_states``, ``txt_ids``) and image
(``hidden_states``, ``img_ids``) tokens are each cut into contiguous chunks at the entry. The ids carry a batch
dimension (``[B, S, 4]``: time, row, column, text position), so they are split on dim 1; the model reads the first
sample's ids and builds the RoPE table of ``cat(text, image)`` from the local ids, so the local positions line up
with the local tokens. The single blocks take ``cat([text, image])`` of the local tokens and the model cuts the text
back off by the local text length. Only image tokens leave the model; ``proj_out``'s output is gathered once. The
pipelines pad the prompt to ``max_sequence_length`` and pass no mask. Reference images (editing) join the image
stream with their ids and are split with it.

Attention: the double blocks' ``Flux2Attention`` runs FLUX.1's processor (the same projections, norms, joint order
and outputs); the single blocks' ``Flux2ParallelSelfAttention`` runs :class:`Flux2SingleSequenceParallelProcessor`.
The Klein KV pipeline's reference K/V cache (``kv_cache_mode``) is refused under sequence parallelism.

Tensor plan: diffusers' ``_tp_plan``. Double blocks as FLUX.1 (4 all-reduces per block), the feed-forwards'
``linear_in`` packed column-parallel (its gate and value halves each split, so SwiGLU pairs stay on one rank);
single blocks: ``to_qkv_mlp_proj`` packed column-parallel over its five parts (Q, K, V, MLP gate, MLP value) and
``to_out`` packed row-parallel over ``[attention, MLP]``: 1 all-reduce per block. The single processor splits the
fused output by the global ratio of its parts, so it runs unchanged on a shard.

Synthetic pipelines: ``Flux2Pipeline`` encodes with Mistral-3 through a ``PixtralProcessor``, which needs
torchvision; the synthetic architectures use ``Flux2KleinPipeline`` instead (a Qwen3 text encoder and a Qwen2
tokenizer, both built locally; true CFG with ``guidance_scale > 1``), around FLUX.2-dev's transformer for
``flux2-dev``.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux2

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import KL_VAE_PLAN, FluxSequenceParallelProcessor


class Flux2SingleSequenceParallelProcessor:
    """Processor for ``Flux2ParallelSelfAttention`` (single blocks) whose core attention runs sequence-parallel.

    The fused projection, its split into Q/K/V and the MLP input (by the global ratio of the parts, so a
    tensor-parallel shard splits the same way), QK-norms, RoPE, the SwiGLU and the fused output projection run on the
    local tokens as diffusers' ``Flux2ParallelSelfAttnProcessor`` does; only the softmax attention goes through
    ``sp.attention``.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None, kv_cache=None,
                 kv_cache_mode=None, num_ref_tokens=0, num_txt_tokens=None):
        if kv_cache_mode is not None:
            raise NotImplementedError("FLUX.2's reference K/V cache (kv_cache_mode, Flux2KleinKVPipeline) does not run "
                                      "under sequence parallelism; use --tp, --cfg or --dp, or the pipeline without "
                                      "the cache")
        fused = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = fused.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = fused.split([local_qkv, fused.shape[-1] - local_qkv], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)
        out = out.flatten(2, 3).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


_SINGLE_PROCESSORS = (transformer_flux2.Flux2ParallelSelfAttnProcessor, transformer_flux2.Flux2KVParallelSelfAttnProcessor)


def flux2_sequence_processor(sp, previous=None):
    """The sequence-parallel processor for an attention layer whose processor is ``previous``: the single blocks'
    fused attention gets :class:`Flux2SingleSequenceParallelProcessor`, the double blocks' joint attention FLUX.1's."""
    if isinstance(previous, _SINGLE_PROCESSORS):
        return Flux2SingleSequenceParallelProcessor(sp, previous)
    return FluxSequenceParallelProcessor(sp, previous)


def flux2_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one FLUX.2 denoising step (random latents and text embeddings) with the pipelines'
    4-axis ids (time, row, column, text position) for every sample."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 patches
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    zero, rows, cols, pos = (torch.arange(n, dtype=torch.float32) for n in (1, h, w, text_len))
    img_ids = torch.cartesian_prod(zero, rows, cols, zero)
    txt_ids = torch.cartesian_prod(zero, zero, zero, pos)
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        guidance=torch.full((batch,), 4.0).to(device, dtype) if cfg.guidance_embeds else None,
        img_ids=img_ids.expand(batch, -1, -1).to(device, dtype),
        txt_ids=txt_ids.expand(batch, -1, -1).to(device, dtype),
        return_dict=False,
    )


def flux2_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a FLUX.2 pipeline call: the VAE divides by 8, then 2x2 latent patches become one token."""
    lh, lw = spatial_latent(height, width, 16, "FLUX.2 (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (image, config.get("in_channels", 128)))


def flux2_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first double block's modulated image stream: ``norm1`` scaled and shifted by the shared image modulation."""
    (shift, scale, _), _ = transformer_flux2.Flux2Modulation.split(named["temb_mod_img"], 2)
    return (1 + scale) * block.norm1(named["hidden_states"]) + shift


#: diffusers' ``_tp_plan`` (see the module docstring); head counts divided, ``inner_dim`` kept (the single
#: processor's split ratio reads it)
FLUX2_TENSOR_PLAN = TensorPlan(
    colwise=(
        "transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v",
        "transformer_blocks.*.attn.add_q_proj", "transformer_blocks.*.attn.add_k_proj",
        "transformer_blocks.*.attn.add_v_proj",
    ),
    rowwise=(
        "transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.attn.to_add_out",
        "transformer_blocks.*.ff.linear_out", "transformer_blocks.*.ff_context.linear_out",
    ),
    packed_colwise={
        "transformer_blocks.*.ff.linear_in": ("linear_out.in_features", "linear_out.in_features"),
        "transformer_blocks.*.ff_context.linear_in": ("linear_out.in_features", "linear_out.in_features"),
        "single_transformer_blocks.*.attn.to_qkv_mlp_proj": ("inner_dim", "inner_dim", "inner_dim", "mlp_hidden_dim",
                                                             "mlp_hidden_dim"),
    },
    packed_rowwise={"single_transformer_blocks.*.attn.to_out": ("inner_dim", "mlp_hidden_dim")},
    per_rank_attrs={"transformer_blocks.*.attn": ("heads",), "single_transformer_blocks.*.attn": ("heads",)},
)


#: FLUX.2's VAE (``AutoencoderKLFlux2``): FLUX.1's 2-D KL encoder and decoder (32 latent channels), split along height
#: as FLUX.1's; the pipelines' 2x2 patches and batch-norm statistics act on the latents outside the VAE's calls
FLUX2_VAE_PLAN = dataclasses.replace(KL_VAE_PLAN, class_names=("AutoencoderKLFlux2",))


# -- synthetic architectures ---------------------------------------------------------------------------------
#: flow-matching Euler with dynamic shifting (the FLUX.2 pipelines compute the shift ``mu`` from the image size and steps)
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                       base_image_seq_len=256, max_image_seq_len=4096)

FLUX2_DEV = SynthArch(
    name="flux2-dev",
    description="FLUX.2-dev transformer (8 double + 48 single blocks, 48 heads x 128, text width 15360, 32B params), "
                "full VAE; in Flux2KleinPipeline with a 27-layer, one-head Qwen3 text encoder 5120 wide",
    pipeline="Flux2KleinPipeline",
    transformer_class="Flux2Transformer2DModel",
    transformer=dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                     num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                     axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, guidance_embeds=True),
    vae=dict(),  # AutoencoderKLFlux2's defaults are FLUX.2's VAE
    clip={},
    # the Qwen3 text encoder (``t5``: the family's text encoder): the pipeline stacks hidden states 9, 18 and 27,
    # so 27 layers, 3 x 5120 = the transformer's text width
    t5=dict(hidden_size=5120, intermediate_size=64, num_hidden_layers=27, num_attention_heads=1,
            num_key_value_heads=1, head_dim=128, max_position_embeddings=1024),
    scheduler=FLUX2_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/pipelines/flux2), with 2 + 2 blocks and 4 heads so that tp 2 and 4 divide them
FLUX2_TINY = dataclasses.replace(
    FLUX2_DEV,
    name="flux2-tiny",
    description="FLUX.2 architecture shrunk for CPU tests: 2 double + 2 single blocks, 4 heads x 16, Klein's pipeline "
                "(true CFG), a 16-wide Qwen3",
    transformer=dict(FLUX2_DEV.transformer, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                     num_attention_heads=4, joint_attention_dim=48, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False),
    vae=dict(block_out_channels=[4, 4, 4, 4], layers_per_block=1, latent_channels=4, norm_num_groups=2,
             sample_size=64, use_quant_conv=False, use_post_quant_conv=False),
    t5=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=1024),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)

#: a chat template of the Qwen2 kind, enough for the pipelines' ``apply_chat_template`` (one user turn)
_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3_text_encoder(arch: SynthArch, kit, model_class: str = "Qwen3ForCausalLM") -> dict:
    """``text_encoder`` (the ``transformers`` Qwen3 class ``model_class`` of ``arch.t5``'s sizes) and its
    ``tokenizer`` (a byte-level BPE Qwen2 tokenizer with a one-turn chat template, built locally), as FLUX.2 Klein's
    and Z-Image's pipelines take them."""
    import transformers

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    vocab, merges = kit.byte_bpe(specials, ("user", "assistant"))
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    tokenizer.chat_template = _CHAT_TEMPLATE
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, **arch.t5)
    return dict(text_encoder=kit.make(getattr(transformers, model_class), config, 3), tokenizer=tokenizer)


def flux2_components(arch: SynthArch, kit) -> dict:
    """Flux2KleinPipeline's other components: the FLUX.2 VAE, a Qwen3 text encoder (``arch.t5``) and a byte-level
    BPE Qwen2 tokenizer with a chat template, built locally."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKLFlux2, arch.vae, 1), **qwen3_text_encoder(arch, kit))


FLUX2 = register(
    ModelAdapter(
        name="flux2",
        class_names=("Flux2Transformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            inputs={"": {
                "hidden_states": Split(dim=1, stream="image", ndim=3),
                "img_ids": Split(dim=1, stream="image", ndim=3),
                "encoder_hidden_states": Split(dim=1, stream="text", ndim=3),
                "txt_ids": Split(dim=1, stream="text", ndim=3),
            }},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the same split and gather points; ours gives text and image their own streams, so "
                                 "each is cut on its own and any token count works (diffusers needs both divisible)",
        ),
        attention=AttentionSelector(class_names=("Flux2Attention", "Flux2ParallelSelfAttention")),
        sequence_processor=flux2_sequence_processor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states")),
                # the single-stream blocks carry one sequence, cat([text, image])
                BlockList("single_transformer_blocks", ("hidden_states",), ("hidden_states",),
                          joins=("encoder_hidden_states", "hidden_states"))),
        token_wise=("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
        modulated_input=flux2_modulated_input,
        example_inputs=flux2_example_inputs,
        layout=flux2_layout,
        text_tokens=512,  # both pipelines pad the prompt to max_sequence_length (512)
        tensor_plan=FLUX2_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "guidance"),
        cfg_mode="sequential",  # Flux2KleinPipeline: the prompt's call, then the negative prompt's
        cfg_switch="guidance_scale",  # Klein (not step-distilled): true CFG when guidance_scale > 1
        cfg_hint="--guidance > 1 with a Klein checkpoint (FLUX.2-dev's guidance is distilled: no second branch)",
        output_channel_dim=-1,
        out_channels=lambda model: model.proj_out.out_features,
        pipelines=("Flux2Pipeline", "Flux2KleinPipeline"),
        synth_archs=(FLUX2_TINY, FLUX2_DEV),
        synth_components=flux2_components,
        vae=FLUX2_VAE_PLAN,
    )
)
