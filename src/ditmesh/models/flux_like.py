"""The FLUX.1-shaped image transformers: LongCat-Image (``LongCatImageTransformer2DModel``), Ovis-Image
(``OvisImageTransformer2DModel``), Bria 3.x (``BriaTransformer2DModel``) and Bria FIBO (``BriaFiboTransformer2DModel``).

Each is FLUX.1's transformer under other class names: double blocks over ``[text, image]`` (``transformer_blocks``),
then single blocks that concatenate the two streams (``single_transformer_blocks``), one RoPE table built from
``cat(txt_ids, img_ids)``, and attention layers with FLUX's projections, QK-norms and processor (diffusers copied
``FluxAttnProcessor`` into each). So one adapter serves them: FLUX's sequence plan, processor, block lists and tensor
plan (:data:`~ditmesh.models.flux.FLUX`), with per class only what differs:

- the forward's inputs (no pooled projection; Bria's ids may come batched, ``[B, N, 3]``, so the ids are split along
  their second-to-last dim, which is the token dim either way);
- Ovis-Image's feed-forwards are SwiGLUs (the fused value and gate halves of ``ff.net.0.proj`` and of the single
  blocks' ``proj_mlp`` split each on its own under tp, and ``mlp_hidden_dim`` divided);
- the pipelines: LongCat-Image and Ovis-Image run true CFG as two calls a step (``guidance_scale > 1``), Bria as one
  batched call on ``[uncond, cond]``; the text encoders (Qwen2.5-VL, Qwen3, T5).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from .base import AttentionSelector, BlockList, ModelAdapter, SequencePlan, Split, SynthArch, TensorPlan, register
from .flux import FLUX, FLUX_DEV, FLUX_SCHEDULER, FLUX_TENSOR_PLAN, _FLUX_TINY, flux_components, flux_image_ids

#: the split points of every FLUX-shaped family: text and image tokens and their ids, each on its own stream (the ids
#: ``[N, 3]`` or batched ``[B, N, 3]``: dim -2 is the token dim of both)
FLUX_LIKE_PLAN = dataclasses.replace(
    FLUX.sequence_plan,
    inputs={"": {
        "hidden_states": Split(dim=1, stream="image", ndim=3),
        "img_ids": Split(dim=-2, stream="image"),
        "encoder_hidden_states": Split(dim=1, stream="text", ndim=3),
        "txt_ids": Split(dim=-2, stream="text"),
    }},
    differs_from_cp_plan="the class has no _cp_plan; FLUX.1's split and gather points, text and image on their own "
                         "streams (any token count)",
)


def flux_like_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one denoising step of a FLUX-shaped pipeline (random latents and text embeddings), as
    FLUX's, keeping only the inputs the class's forward takes."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    txt_ids = torch.zeros(text_len, 3)
    txt_ids[:, 1:] += torch.arange(text_len)[:, None]  # LongCat-Image and Ovis-Image count the text positions
    inputs = dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        img_ids=flux_image_ids(h, w).to(device, dtype),
        txt_ids=txt_ids.to(device, dtype),
        return_dict=False,
    )
    if cfg.get("guidance_embeds"):
        inputs["guidance"] = torch.full((batch,), 3.5).to(device, dtype)
    if "text_encoder_dim" in cfg:  # Bria-FIBO: one text-encoder layer per block, projected into half the text stream
        inputs["text_encoder_layers"] = [rand(batch, text_len, cfg.text_encoder_dim)
                                         for _ in range(cfg.num_layers + cfg.num_single_layers)]
    accepted = inspect.signature(model.forward).parameters
    return {name: value for name, value in inputs.items() if name in accepted}


def flux_like(name: str, class_name: str, attention: AttentionSelector, pipeline: str, archs: tuple, components,
              tensor_plan: TensorPlan = FLUX_TENSOR_PLAN, batched_cfg: bool = False, text_tokens: int = 512,
              batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "guidance"),
              sequence_plan: SequencePlan = FLUX_LIKE_PLAN, **fields) -> ModelAdapter:
    """The adapter of a FLUX.1-shaped class: FLUX's plans, processor and blocks under ``class_name`` (whose attention
    layers ``attention`` selects), with its own pipeline, CFG mode, synthetic architectures and components (``fields``:
    any other adapter field that differs)."""
    return dataclasses.replace(
        FLUX,
        name=name,
        class_names=(class_name,),
        sequence_plan=sequence_plan,
        attention=attention,
        example_inputs=flux_like_example_inputs,
        text_tokens=text_tokens,
        checkpoint_text_tokens=None,
        tensor_plan=tensor_plan,
        batch_inputs=batch_inputs,
        cfg_mode="batched" if batched_cfg else "sequential",
        cfg_switch="guidance_scale",
        cfg_hint="--guidance > 1 (e.g. --guidance 5)",
        pipelines=(pipeline,),
        synth_archs=archs,
        synth_components=components,
        image_pipelines=(),
        **fields,
    )


# -- synthetic architectures ---------------------------------------------------------------------------------
#: diffusers' test configuration of these classes (tests/models/transformers: one double and one single block, 2 heads
#: of 16, text width 32, RoPE axes 4 + 4 + 8), reading 64 channels (FLUX's 16-channel VAE, 2x2 packed)
TINY_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8])
_TINY = dict(vae=_FLUX_TINY.vae, clip={}, default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


def _qwen25vl_components(arch: SynthArch, kit) -> dict:
    """LongCatImagePipeline's other components: FLUX's VAE and QwenImage's Qwen2.5-VL text encoder and Qwen2 tokenizer.
    No ``text_processor``: the pipeline uses it only to rewrite prompts (``enable_prompt_rewrite``), and a Qwen2-VL
    processor needs torchvision's video processor."""
    import diffusers

    from .qwenimage import qwen25vl_text_encoder

    return dict(qwen25vl_text_encoder(arch, kit), vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), text_processor=None)


def _qwen3_components(arch: SynthArch, kit) -> dict:
    """OvisImagePipeline's other components: FLUX's VAE, a Qwen3 base model (``arch.t5``) and its Qwen2 tokenizer."""
    import diffusers

    from .flux2 import qwen3_text_encoder

    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), **qwen3_text_encoder(arch, kit, "Qwen3Model"))


def _t5_components(arch: SynthArch, kit) -> dict:
    """BriaPipeline's other components: FLUX's VAE and a T5 encoder with its tokenizer (no image encoder)."""
    parts = flux_components(arch, kit)
    return dict(vae=parts["vae"], text_encoder=parts["text_encoder_2"], tokenizer=parts["tokenizer_2"],
                image_encoder=None, feature_extractor=None)


def _smollm3_components(arch: SynthArch, kit) -> dict:
    """BriaFiboPipeline's other components: the Wan 2.2 VAE (``arch.vae``) and a SmolLM3 (``arch.t5``) with a local
    byte-level BPE tokenizer. The model keeps SmolLM3's 128,256-row vocabulary: the pipeline encodes an empty prompt as
    token 128000 (SmolLM3's ``<|begin_of_text|>``) whatever the tokenizer."""
    import diffusers
    import transformers

    vocab, merges = kit.byte_bpe(("<|end_of_text|>",))
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, pad_token="<|end_of_text|>",
                                            eos_token="<|end_of_text|>", unk_token=None)
    config = transformers.SmolLM3Config(vocab_size=128256, pad_token_id=tokenizer.pad_token_id, bos_token_id=128000,
                                        eos_token_id=tokenizer.eos_token_id, attn_implementation="eager", **arch.t5)
    return dict(vae=kit.make(diffusers.AutoencoderKLWan, arch.vae, 1), tokenizer=tokenizer,
                text_encoder=kit.make(transformers.SmolLM3ForCausalLM, config, 3))


_QWEN25VL_TINY = dict(text=dict(hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default",
                                                                     "type": "default"}, rope_theta=1000000.0),
                      vision=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32))

LONGCAT_IMAGE = SynthArch(
    name="longcat-image",
    description="LongCat-Image transformer (19 double + 38 single blocks, 24 heads x 128, text width 3584), FLUX.1's "
                "VAE, a one-layer Qwen2.5-VL text encoder",
    pipeline="LongCatImagePipeline",
    transformer_class="LongCatImageTransformer2DModel",
    transformer=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=3584, pooled_projection_dim=3584,
                     axes_dims_rope=[16, 56, 56]),
    vae=FLUX_DEV.vae,
    clip={},
    t5=dict(text=dict(_QWEN25VL_TINY["text"], hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                      rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}),
            vision=dict(_QWEN25VL_TINY["vision"], out_hidden_size=3584)),
    scheduler=FLUX_SCHEDULER,
    default_dtype="bfloat16",
    max_sequence_length=512,
)

LONGCAT_IMAGE_TINY = dataclasses.replace(
    LONGCAT_IMAGE, name="longcat-image-tiny",
    description="LongCat-Image shrunk for CPU tests: diffusers' test configuration (1 double + 1 single block, 2 heads "
                "x 16), a tiny VAE and Qwen2.5-VL",
    transformer=dict(TINY_TRANSFORMER, pooled_projection_dim=32), t5=_QWEN25VL_TINY, **_TINY)

OVIS_IMAGE = SynthArch(
    name="ovis-image",
    description="Ovis-Image 7B transformer (6 double + 27 single blocks, 24 heads x 128, SwiGLU, text width 2048), "
                "FLUX.1's VAE, a one-layer Qwen3 text encoder of Qwen3-1.7B's width",
    pipeline="OvisImagePipeline",
    transformer_class="OvisImageTransformer2DModel",
    transformer=dict(patch_size=1, in_channels=64, out_channels=64, num_layers=6, num_single_layers=27,
                     attention_head_dim=128, num_attention_heads=24, joint_attention_dim=2048,
                     axes_dims_rope=[16, 56, 56]),
    vae=FLUX_DEV.vae,
    clip={},
    t5=dict(hidden_size=2048, intermediate_size=64, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=1024),
    scheduler=FLUX_SCHEDULER,
    default_dtype="bfloat16",
    max_sequence_length=256,
)

OVIS_IMAGE_TINY = dataclasses.replace(
    OVIS_IMAGE, name="ovis-image-tiny",
    description="Ovis-Image shrunk for CPU tests: diffusers' test configuration (1 double + 1 single block, 2 heads x "
                "16, SwiGLU), a tiny VAE and Qwen3",
    transformer=dict(TINY_TRANSFORMER, out_channels=64),
    t5=dict(hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024), **_TINY)

BRIA = SynthArch(
    name="bria-3.2",
    description="Bria 3.2 transformer as diffusers' defaults (19 double + 38 single blocks, 24 heads x 128, text width "
                "4096), FLUX.1's VAE, a one-layer T5-XXL-wide encoder",
    pipeline="BriaPipeline",
    transformer_class="BriaTransformer2DModel",
    transformer=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=[16, 56, 56]),
    vae=FLUX_DEV.vae,
    clip={},
    t5=FLUX_DEV.t5,
    scheduler=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
    default_dtype="bfloat16",
    max_sequence_length=128,
)

BRIA_TINY = dataclasses.replace(
    BRIA, name="bria-tiny",
    description="Bria shrunk for CPU tests: diffusers' test configuration (1 double + 1 single block, 2 heads x 16, "
                "RoPE axes 0 + 8 + 8, text width 64), a tiny VAE and T5",
    transformer=dict(TINY_TRANSFORMER, axes_dims_rope=[0, 8, 8], joint_attention_dim=_FLUX_TINY.t5["d_model"]),
    t5=_FLUX_TINY.t5, **_TINY)


#: Ovis-Image: FLUX's plan with SwiGLU feed-forwards, whose fused linears hold a value and a gate half each
OVIS_IMAGE_TENSOR_PLAN = TensorPlan(
    colwise=tuple(p for p in FLUX_TENSOR_PLAN.colwise if not p.endswith(("net.0.proj", "proj_mlp"))),
    rowwise=FLUX_TENSOR_PLAN.rowwise,
    packed_colwise={"transformer_blocks.*.ff.net.0.proj": ("../2.in_features", "../2.in_features"),
                    "transformer_blocks.*.ff_context.net.0.proj": ("../2.in_features", "../2.in_features"),
                    "single_transformer_blocks.*.proj_mlp": ("mlp_hidden_dim", "mlp_hidden_dim")},
    packed_rowwise={"single_transformer_blocks.*.proj_out": ("attn.to_q", "mlp_hidden_dim")},
    per_rank_attrs=dict(FLUX_TENSOR_PLAN.per_rank_attrs, **{"single_transformer_blocks.*": ("mlp_hidden_dim",)}),
)

LONGCAT_IMAGE_ADAPTER = register(flux_like("longcat-image", "LongCatImageTransformer2DModel",
                                           AttentionSelector(class_names=("LongCatImageAttention",)),
                                           "LongCatImagePipeline", (LONGCAT_IMAGE_TINY, LONGCAT_IMAGE),
                                           _qwen25vl_components))
OVIS_IMAGE_ADAPTER = register(flux_like("ovis-image", "OvisImageTransformer2DModel",
                                        AttentionSelector(class_names=("OvisImageAttention",)), "OvisImagePipeline",
                                        (OVIS_IMAGE_TINY, OVIS_IMAGE), _qwen3_components,
                                        tensor_plan=OVIS_IMAGE_TENSOR_PLAN, text_tokens=256))
BRIA_ADAPTER = register(flux_like("bria", "BriaTransformer2DModel", AttentionSelector(class_names=("BriaAttention",)),
                                  "BriaPipeline", (BRIA_TINY, BRIA), _t5_components, batched_cfg=True, text_tokens=128))

# -- Bria-FIBO ----------------------------------------------------------------------------------------------------
#: FIBO's single blocks take one joined sequence, cat([text, image]) (FLUX.2's and Chroma's layout); before every block
#: the model rewrites half the text stream's width from that block's text-encoder layer (``text_encoder_layers``: one
#: ``[B, text, D]`` per block, split with the text). The pipeline's text padding mask arrives as
#: ``joint_attention_kwargs["attention_mask"]`` ``[B, 1, 1, text + image]``, whole on every rank: FLUX's processor passes
#: it to ``sp.attention``, which reorders it like the keys. The single blocks' attention is diffusers' generic
#: ``Attention``.
FIBO_PLAN = dataclasses.replace(
    FLUX_LIKE_PLAN,
    inputs={"": dict(FLUX_LIKE_PLAN.inputs[""], text_encoder_layers=Split(dim=1, stream="text", ndim=3))},
)

#: the Wan 2.2 VAE (48 latent channels, 2x2 patches: 16x), with normalization statistics 0 and 1 (random weights have
#: none of their own)
_WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                  patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48,
                  latents_std=[1.0] * 48)

BRIA_FIBO = SynthArch(
    name="bria-fibo",
    description="Bria FIBO transformer as diffusers' defaults (19 double + 38 single blocks, 24 heads x 128, text "
                "width 4096, text-encoder layers 2048 wide), the Wan 2.2 VAE, a two-layer SmolLM3 of SmolLM3-3B's width",
    pipeline="BriaFiboPipeline",
    transformer_class="BriaFiboTransformer2DModel",
    transformer=dict(patch_size=1, in_channels=48, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, text_encoder_dim=2048,
                     axes_dims_rope=[16, 56, 56]),
    vae=_WAN22_VAE, clip={},
    t5=dict(hidden_size=2048, intermediate_size=64, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4),
    scheduler=BRIA.scheduler,
    default_dtype="bfloat16",
    max_sequence_length=512,
)

BRIA_FIBO_TINY = dataclasses.replace(
    BRIA_FIBO, name="bria-fibo-tiny",
    description="Bria FIBO shrunk for CPU tests: diffusers' test configuration (1 double + 1 single block, 2 heads x 8, "
                "text width 64, text-encoder layers 32 wide), a tiny Wan 2.2 VAE and SmolLM3",
    transformer=dict(patch_size=1, in_channels=48, num_layers=1, num_single_layers=1, attention_head_dim=8,
                     num_attention_heads=2, joint_attention_dim=64, text_encoder_dim=32, axes_dims_rope=[0, 4, 4]),
    vae=dict(_WAN22_VAE, base_dim=8, decoder_base_dim=8, num_res_blocks=1),
    t5=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


BRIA_FIBO_ADAPTER = register(flux_like(
    "bria-fibo", "BriaFiboTransformer2DModel",
    AttentionSelector(class_names=("BriaFiboAttention",), paths=("single_transformer_blocks.*.attn",)),
    "BriaFiboPipeline", (BRIA_FIBO_TINY, BRIA_FIBO),
    _smollm3_components,
    batched_cfg=True,
    batch_inputs=("hidden_states", "encoder_hidden_states", "text_encoder_layers", "timestep", "guidance",
                  "joint_attention_kwargs"),
    sequence_plan=FIBO_PLAN,
    blocks=(FLUX.blocks[0], BlockList("single_transformer_blocks", ("hidden_states",), ("hidden_states",),
                                      joins=("encoder_hidden_states", "hidden_states"))),
    vae=None,
    pp_refusal="Bria FIBO rewrites its text stream between blocks from per-block encoder layers, which PipeFusion's "
               "stages do not pass on",
))
