"""Chroma (``ChromaTransformer2DModel``, ``ChromaPipeline``): FLUX.1's joint text+image attention with a mask over
padded T5 text, no pooled CLIP, and timestep modulation from a distilled approximator.

The pipeline pads the prompt to ``max_sequence_length`` and passes ``attention_mask [B, text + image]`` (1 for the
prompt's tokens and its first padding token, 0 for the rest, 1 for every image token); each block turns it into
``m_q * m_k`` over the whole ``[text, image]`` sequence, ``[B, 1, N, N]``, a floating mask that SDPA adds to the
scores. Under sequence parallelism the mask stays whole on every rank (it is not split) and the processor, FLUX's,
hands it to ``sp.attention``, which reorders it like the keys (``parallel.sequence``): the result equals the
one-process model's exactly.

Sequence plan: FLUX's (text and image streams, split at the entry, ``proj_out`` gathered). The single-stream blocks
get ``cat([text, image])`` of the local tokens, in the same order. Tensor plan: FLUX's (the same attention and MLP
linears; Chroma's AdaLN layers have no weights). CFG: ``ChromaPipeline`` calls the transformer for the prompt and
then for the negative prompt when ``guidance_scale > 1`` (sequential).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import AttentionSelector, BlockList, SynthArch, register
from .flux import FLUX, FLUX_DEV, FLUX_TENSOR_PLAN, FluxSequenceParallelProcessor


def chroma_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one ChromaPipeline denoising step (random latents and text embeddings), with the
    attention mask of a prompt that fills half of the padded text (plus the one padding token Chroma keeps)."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.zeros(h, w), rows, cols], dim=-1).reshape(h * w, 3)
    mask = torch.ones(batch, text_len + h * w)
    mask[:, text_len // 2 + 1 : text_len] = 0
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        img_ids=img_ids.to(device, dtype),
        txt_ids=torch.zeros(text_len, 3).to(device, dtype),
        attention_mask=mask.to(device, dtype),
        return_dict=False,
    )


def chroma_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first double block's modulated image stream: ``norm1`` with the image half of its modulation."""
    return block.norm1(named["hidden_states"], emb=named["temb"][:, :6])[0]


# -- synthetic architectures ---------------------------------------------------------------------------------
#: FLUX.1-dev's synthetic pipeline (VAE, T5, scheduler, sizes) around the Chroma1-HD transformer, without CLIP
CHROMA1_HD = dataclasses.replace(
    FLUX_DEV,
    name="chroma1-hd",
    description="Chroma1-HD transformer (19 double + 38 single blocks, 24 heads x 128, approximator 5120 x 5), "
                "FLUX.1's VAE",
    pipeline="ChromaPipeline",
    transformer_class="ChromaTransformer2DModel",
    transformer=dict({k: v for k, v in FLUX_DEV.transformer.items() if k not in ("pooled_projection_dim", "guidance_embeds")},
                     approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5),
    clip={},
)

_FLUX_TINY = FLUX.synth_archs[0]
CHROMA_TINY = dataclasses.replace(
    _FLUX_TINY,
    name="chroma-tiny",
    description="Chroma architecture shrunk for CPU tests: 2 double + 2 single blocks, 6 heads x 16",
    pipeline=CHROMA1_HD.pipeline,
    transformer_class=CHROMA1_HD.transformer_class,
    transformer=dict(CHROMA1_HD.transformer, num_layers=2, num_single_layers=2, attention_head_dim=16,
                     num_attention_heads=6, joint_attention_dim=64, axes_dims_rope=[4, 6, 6],
                     approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2),
    clip={},
)


def chroma_components(arch: SynthArch, kit) -> dict:
    """ChromaPipeline's other components: AutoencoderKL and the T5 text encoder (no CLIP, no image encoder)."""
    import diffusers
    import transformers

    t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer=t5_tok, image_encoder=None, feature_extractor=None)


CHROMA = register(
    dataclasses.replace(
        FLUX,
        name="chroma",
        class_names=("ChromaTransformer2DModel",),
        # FLUX's split and gather points; the mask (``attention_mask``) is not split: every rank keeps it whole
        sequence_plan=FLUX.sequence_plan,
        attention=AttentionSelector(class_names=("FluxAttention",)),
        sequence_processor=FluxSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states")),
                # the single-stream blocks carry one sequence, cat([text, image])
                BlockList("single_transformer_blocks", ("hidden_states",), ("hidden_states",),
                          joins=("encoder_hidden_states", "hidden_states"))),
        modulated_input=chroma_modulated_input,
        example_inputs=chroma_example_inputs,
        text_tokens=512,
        checkpoint_text_tokens=None,
        tensor_plan=FLUX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "attention_mask"),
        cfg_mode="sequential",  # ChromaPipeline calls the transformer for the prompt, then the negative prompt
        cfg_switch="guidance_scale",  # true CFG whenever guidance_scale > 1 (the negative prompt defaults to "")
        cfg_hint="--guidance > 1 (e.g. --guidance 5)",
        pipelines=("ChromaPipeline",),
        synth_archs=(CHROMA_TINY, CHROMA1_HD),
        synth_components=chroma_components,
    )
)
