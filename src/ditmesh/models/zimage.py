"""Z-Image (``ZImageTransformer2DModel``, ``ZImagePipeline``): refiners per stream, then one joint sequence per
sample, the transformer taking and returning lists of samples.

The model takes one latent ``[C, 1, H, W]`` and one caption ``[L_i, D]`` (its valid tokens only) per sample, as
lists. It patchifies each image and pads each image and each caption to a multiple of 32 tokens with learned pad
tokens (those count as valid keys), refines the image tokens (``noise_refiner``) and the caption tokens
(``context_refiner``) on their own, batched with key-padding masks, then packs each sample as ``[its image tokens,
its caption tokens]`` into one joint sequence as long as the longest sample, padded with zeros and a key-padding mask
``[B, N]`` when the samples' lengths differ (captions of different lengths in 32-token steps), and runs the main
``layers`` over it; ``all_final_layer`` projects to patches and the model unpacks each sample's image from its row.
The RoPE table (``freqs_cis``, ``[B, N, D/2]`` complex) is built per sample from position ids and packed like the
tokens; the forward hands it, the mask and the joint sequence to every layer positionally.

Sequence plan: one stream, ``joint``. The joint sequence is split where it enters ``layers.0`` and the RoPE table
where it enters each layer (the forward passes the same whole table to all of them); the final layer's output (the
projection to patches) is gathered once, so the model's own unpacking sees the whole sequence. The joint length is a
sum of multiples of 32, so it divides by 2 and 4 whatever the image size; other degrees split it unevenly, which is
exact too. The refiners run whole on every rank (``whole_attention``: 4 of Z-Image's 34 blocks, on the shorter
per-stream sequences, before the joint sequence exists); the key-padding mask stays whole and is handed to
``sp.attention`` with the keys.

Tensor plan (refiners and main layers alike): Q, K, V and the SwiGLU's ``w1``/``w3`` column-parallel, the attention
output and ``w2`` row-parallel: 2 all-reduces per block. CFG: ``ZImagePipeline`` runs both branches in one call on
the list ``[prompts..., negative prompts...]`` (batched); data and CFG parallelism slice the lists
(``sample_lists``) and gather the per-sample outputs stacked.

Not covered: the Omni variant (per-token noise masks and SigLIP features) and the ControlNet pipelines (block
residuals over the whole joint sequence) are neither split nor tested; step caches and PipeFusion are not offered
(the blocks take ``x``, not ``hidden_states``, so no block list is declared).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import AttentionSelector, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch, register, \
    spatial_latent
from .flux import FLUX_VAE, KL_VAE_PLAN
from .flux2 import qwen3_text_encoder
from .lumina2 import swiglu_blocks_plan

#: diffusers pads every image and every caption of a sample to a multiple of this many tokens
SEQ_MULTIPLE = 32


class ZImageSequenceParallelProcessor:
    """Attention processor for Z-Image's main layers whose core attention runs sequence-parallel: projections,
    per-head RMS norms and RoPE on the local tokens as diffusers' ``ZSingleStreamAttnProcessor`` does; the attention
    through ``sp.attention`` with the key-padding mask."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if freqs_cis is not None:
            q = apply_rotary_emb(q, freqs_cis, use_real=False)
            k = apply_rotary_emb(k, freqs_cis, use_real=False)
        mask = None if attention_mask is None else attention_mask.bool()
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=mask)
        out = attn.to_out[0](out.flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def zimage_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one ZImagePipeline denoising step: lists of random latents and captions (every caption
    token valid)."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        x=[rand(cfg.in_channels, 1, height // 8, width // 8) for _ in range(batch)],
        t=torch.full((batch,), 0.3).to(device, dtype),
        cap_feats=[rand(text_len, cfg.cap_feat_dim) for _ in range(batch)],
        return_dict=False,
    )


def _padded(tokens: int) -> int:
    return -(-tokens // SEQ_MULTIPLE) * SEQ_MULTIPLE


def zimage_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a ZImagePipeline call: the VAE divides by 8, then 2x2 patches become one token; the joint
    sequence holds the image and the caption tokens, each padded to a multiple of 32."""
    lh, lw = spatial_latent(height, width, 16, "Z-Image (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, _padded(image) + _padded(text_tokens), (config.get("in_channels", 16), lh, lw))


#: refiners and main layers alike
ZIMAGE_TENSOR_PLAN = swiglu_blocks_plan(("layers", "noise_refiner", "context_refiner"), "attention", "feed_forward.w1",
                                        "feed_forward.w3", "feed_forward.w2")


# -- synthetic architectures ---------------------------------------------------------------------------------
ZIMAGE = SynthArch(
    name="z-image",
    description="Z-Image-Turbo-shaped transformer (30 layers + 2 + 2 refiners, 30 heads x 128, 6.2B params), "
                "FLUX.1's VAE, a two-layer Qwen3 text encoder of Qwen3-4B's width",
    pipeline="ZImagePipeline",
    transformer_class="ZImageTransformer2DModel",
    transformer=dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                     rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512]),
    vae=FLUX_VAE,
    clip={},
    # the pipeline reads the second-to-last hidden state: two layers are the fewest that give one past the embedding
    t5=dict(hidden_size=2560, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
            head_dim=128, max_position_embeddings=1024),
    scheduler=dict(num_train_timesteps=1000, shift=3.0),
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/pipelines/z_image) 48 wide instead of 32: the SwiGLU is int(dim * 8 / 3) wide,
#: 85 at 32, which tp 2 cannot split (128 at 48); its 2 heads (of 24 = the RoPE axes 8 + 8 + 8) divide by tp and ulysses 2
ZIMAGE_TINY = dataclasses.replace(
    ZIMAGE,
    name="z-image-tiny",
    description="Z-Image shrunk for CPU tests: 2 layers + 1 + 1 refiners, 2 heads x 24 (diffusers' own test size, "
                "48 wide)",
    transformer=dict(ZIMAGE.transformer, dim=48, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                     cap_feat_dim=16, axes_dims=[8, 8, 8], axes_lens=[256, 32, 32]),
    vae=dict(FLUX_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    t5=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=512),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=64,
)


def zimage_components(arch: SynthArch, kit) -> dict:
    """ZImagePipeline's other components: AutoencoderKL and a Qwen3 text encoder (``arch.t5``) with a byte-level BPE
    Qwen2 tokenizer and a chat template, built locally."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1), **qwen3_text_encoder(arch, kit, "Qwen3Model"))


ZIMAGE_ADAPTER = register(
    ModelAdapter(
        name="zimage",
        class_names=("ZImageTransformer2DModel",),
        num_heads=lambda model: model.config.n_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"layers.0": {"x": Split(dim=1, stream="joint", ndim=3)},
                    # the forward hands every layer the same whole RoPE table
                    "layers.*": {"freqs_cis": Split(dim=1, stream="joint", ndim=3)}},
            gathers={"all_final_layer.*": Gather(dim=1, stream="joint")},
        ),
        attention=AttentionSelector(paths=("layers.*.attention",)),
        # the refiners run on the image and the caption tokens before the joint sequence exists
        whole_attention=AttentionSelector(paths=("noise_refiner.*.attention", "context_refiner.*.attention")),
        sequence_processor=ZImageSequenceParallelProcessor,
        blocks=(),
        example_inputs=zimage_example_inputs,
        layout=zimage_layout,
        text_tokens=512,  # the pipeline's max_sequence_length; only the prompt's valid tokens reach the transformer
        tensor_plan=ZIMAGE_TENSOR_PLAN,
        batch_inputs=("x", "t", "cap_feats"),
        sample_input="x",
        sample_lists=("x", "cap_feats"),
        cfg_mode="batched",  # ZImagePipeline: one call on [prompts..., negative prompts...]
        cfg_switch="guidance_scale",
        cfg_hint="--guidance > 1 (e.g. --guidance 4; Z-Image-Turbo runs without guidance)",
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("ZImagePipeline",),
        synth_archs=(ZIMAGE_TINY, ZIMAGE),
        synth_components=zimage_components,
        vae=KL_VAE_PLAN,
    )
)
