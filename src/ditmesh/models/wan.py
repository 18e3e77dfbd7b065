"""Wan 2.1 / 2.2 (``WanTransformer3DModel``): video self-attention with 3-D RoPE, separate text cross-attention.

Where the tokens are: ``forward`` computes the RoPE table from the latent's shape (``rope``), patchifies
with a Conv3d (``patch_embedding``), flattens to ``[B, N, D]`` video tokens, runs the blocks, and
unpatchifies after ``proj_out``. The sequence plan (diffusers' ``_cp_plan`` for this class, with a stream)
therefore splits

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

This file is everything ditmesh knows about Wan: the plans, the processor, the blocks, example inputs, the
planner's layout, the frame rule, the image-to-video pipeline and the synthetic architectures (Wan 2.1, Wan 2.2
A14B's pair of transformers, and its image-to-video form).
"""

from __future__ import annotations

import torch
from diffusers.models.autoencoders import autoencoder_kl_wan
from diffusers.models.transformers import transformer_wan

import dataclasses

from .base import (AttentionSelector, BlockList, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan, Split,
                   SynthArch, TensorPlan, VaePlan, register, spatial_latent)


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
    ``sp.attention``, with the layer's ``attention_mask`` over the whole video (None in Wan; SkyReels-V2's
    block-causal mask, ``models/skyreels_v2.py``). Cross-attention is handed to the previous processor
    unchanged: local queries against the full, replicated context give exactly the local rows of the
    single-GPU result.
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        q, k, v = transformer_wan._get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        head_dim = attn.inner_dim // attn.heads  # unchanged by tensor parallelism, which divides both
        q, k, v = (t.unflatten(2, (-1, head_dim)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate_pairs(q, *rotary_emb), rotate_pairs(k, *rotary_emb)
        # a mask over the video tokens (SkyReels-V2's block-causal [1, 1, N, N]) in the model's order; sp reorders it
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def wan_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one WanPipeline denoising step (random latents and text embeddings).

    ``frames`` video frames (default 81) become ``(frames - 1) // 4 + 1`` latent frames (the Wan VAE's 4x
    temporal compression); height and width shrink 8x. I2V checkpoints (``image_dim``) also get the 257 CLIP
    image tokens.
    """
    cfg = model.config
    frames = frames or 81
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    inputs = dict(
        hidden_states=rand(batch, cfg.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.text_dim),
        return_dict=False,
    )
    if cfg.get("image_dim"):
        inputs["encoder_hidden_states_image"] = rand(batch, 257, cfg.image_dim)
    return inputs


def wan_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The input of a Wan block's self-attention: ``norm1`` shifted and scaled by the block's timestep modulation
    (per token where ``temb`` has a token dim, Wan 2.2 TI2V), as the block computes it."""
    temb = named["temb"].float()
    if temb.ndim == 4:
        shift, scale = (block.scale_shift_table.unsqueeze(0) + temb)[:, :, :2].unbind(2)
    else:
        shift, scale = (block.scale_shift_table + temb)[:, :2].unbind(1)
        shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
    hidden = named["hidden_states"]
    return (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)


def wan_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a WanPipeline call: 8x spatial and 4x temporal VAE, then ``patch_size`` patches. Text
    is cross-attention context only, so the split sequence is the video tokens."""
    pt, ph, pw = config.get("patch_size", (1, 2, 2))
    lh, lw = spatial_latent(height, width, 8 * max(ph, pw), "Wan (8x VAE, 2x2 patches)")
    if frames < 1 or (frames - 1) % 4:
        raise ValueError(f"frames={frames} must be 4k+1 for Wan's 4x temporal VAE; try {max(1, (frames - 1) // 4 * 4 + 1)}")
    latent_frames = (frames - 1) // 4 + 1
    video = (latent_frames // pt) * (lh // ph) * (lw // pw)
    return Layout(video, text_tokens, video, (config.get("in_channels", 16), latent_frames, lh, lw))


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
def wan_tensor_plan(*lists: str) -> TensorPlan:
    """The plan below for the Wan blocks of each ``ModuleList`` named in ``lists`` (Wan VACE's ``vace_blocks`` are Wan
    blocks too)."""
    def each(*suffixes: str) -> tuple[str, ...]:
        return tuple(f"{path}.*.{suffix}" for path in lists for suffix in suffixes)

    heads = ("heads", "inner_dim", "kv_inner_dim")
    return TensorPlan(
        colwise=each("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                     "attn2.add_k_proj?", "attn2.add_v_proj?", "ffn.net.0.proj"),
        rowwise=each("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"),
        per_rank_attrs={pattern: heads for pattern in each("attn1", "attn2")},
        sharded_norms=each("attn1.norm_q", "attn1.norm_k", "attn2.norm_q", "attn2.norm_k", "attn2.norm_added_k?"),
    )


WAN_TENSOR_PLAN = wan_tensor_plan("blocks")


# -- synthetic architectures ---------------------------------------------------------------------------------
#: Wan 2.1's scheduler as its diffusers checkpoints ship it (UniPC on flow-matching sigmas)
_WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)

WAN21_14B = SynthArch(
    name="wan2.1-14b",
    description="Wan2.1-T2V-14B transformer (40 blocks, 40 heads x 128, FFN 13824), full Wan VAE, small UMT5",
    pipeline="WanPipeline",
    transformer_class="WanTransformer3DModel",
    transformer=dict(
        patch_size=[1, 2, 2],
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    vae={},  # AutoencoderKLWan's defaults are the Wan 2.1 VAE
    clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),  # UMT5-XXL's width, one layer
    scheduler=_WAN_SCHEDULER,
    scheduler_class="UniPCMultistepScheduler",
    default_dtype="bfloat16",
    default_size=(480, 832),
    max_sequence_length=512,
    default_frames=81,
)

_WAN_TINY = dataclasses.replace(
    WAN21_14B,
    name="wan-tiny",
    description="Wan 2.1 architecture shrunk for CPU tests: 2 blocks, 6 heads x 16, 3-D RoPE, tiny Wan VAE",
    transformer=dict(WAN21_14B.transformer, num_attention_heads=6, attention_head_dim=16, text_dim=64, freq_dim=32,
                     ffn_dim=128, num_layers=2, rope_max_seq_len=64),
    vae=dict(base_dim=8, num_res_blocks=1),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
    default_frames=5,
)

#: wan-tiny as an image-to-video transformer: the pipeline VAE-encodes the condition video (the image, then zero
#: frames) and concatenates a 4-channel first-frame mask and those latents to the noise: 16 + 4 + 16 = 36 in
_WAN_I2V_TRANSFORMER = dict(_WAN_TINY.transformer, in_channels=36)

WAN_ARCHS = (
    WAN21_14B,
    _WAN_TINY,
    dataclasses.replace(
        _WAN_TINY,
        name="wan-tiny-tp",
        description="wan-tiny with 4 heads x 16 (64 wide), so tensor parallelism of degree 4 divides the heads",
        transformer=dict(_WAN_TINY.transformer, num_attention_heads=4),
    ),
    # Wan 2.2 A14B: two experts of one architecture; `transformer` denoises the high-noise steps (timestep >=
    # boundary_ratio * 1000) and `transformer_2` the rest. Here 2 steps of 3 fall to each side at shift 3.
    dataclasses.replace(
        _WAN_TINY,
        name="wan2.2-tiny",
        description="Wan 2.2 A14B layout shrunk for CPU tests: two wan-tiny transformers (high- and low-noise "
                    "experts) switched at boundary_ratio 0.9",
        transformer_2=_WAN_TINY.transformer,
        pipeline_config=dict(boundary_ratio=0.9),
    ),
    # Wan 2.2 I2V-A14B: no image encoder (see _WAN_I2V_TRANSFORMER)
    dataclasses.replace(
        _WAN_TINY,
        name="wan2.2-i2v-tiny",
        description="Wan 2.2 I2V-A14B layout shrunk for CPU tests: two wan-tiny transformers reading the noise, the "
                    "first-frame mask and the encoded condition video (36 in, 16 out), WanImageToVideoPipeline",
        pipeline="WanImageToVideoPipeline",
        transformer=_WAN_I2V_TRANSFORMER,
        transformer_2=_WAN_I2V_TRANSFORMER,
        pipeline_config=dict(boundary_ratio=0.9),
    ),
    # Wan 2.1 I2V: one transformer that also cross-attends to the condition image's CLIP tokens (the image encoder's
    # second-to-last hidden states: image_dim wide, projected by attn2's add_k_proj / add_v_proj)
    dataclasses.replace(
        _WAN_TINY,
        name="wan2.1-i2v-tiny",
        description="Wan 2.1 I2V layout shrunk for CPU tests: wan-tiny reading 36 channels and cross-attending to "
                    "the image tokens of a tiny CLIP vision encoder (5 tokens of 32), WanImageToVideoPipeline",
        pipeline="WanImageToVideoPipeline",
        transformer=dict(_WAN_I2V_TRANSFORMER, image_dim=32, added_kv_proj_dim=96),
        clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=16),
    ),
)


def causal_conv_padding(causal_conv_class):
    """The ``VaePlan.conv_padding`` of a VAE whose causal 3-D convolution (``causal_conv_class``: Wan's, and the copy
    in QwenImage's VAE) keeps its padding in ``_padding`` (width, width, height top, height bottom, time front, time
    back) and pads itself in ``forward``: (top, bottom) zero rows for such a convolution, None for any other (its
    ``padding``)."""

    def conv_padding(conv) -> tuple[int, int] | None:
        if isinstance(conv, causal_conv_class):
            return conv._padding[2], conv._padding[3]
        return None

    return conv_padding


#: The Wan causal 3-D VAE split along height. Frames stay whole: it decodes (and encodes) chunk by chunk with a
#: causal temporal cache, and each rank's cache holds its own rows. Its norms are RMS norms over the channels of
#: one position (no statistics across rows); the mid-block attention is per frame over all positions and runs on
#: the gathered rows. Wan 2.2's VAE (patch size 2, 16x) patchifies the local rows, which stay aligned.
WAN_VAE_PLAN = VaePlan(
    class_names=("AutoencoderKLWan",),
    spatial_factor=lambda vae: vae.spatial_compression_ratio,
    gathered=("WanAttentionBlock",),
    conv_padding=causal_conv_padding(autoencoder_kl_wan.WanCausalConv3d),
)


# -- image-conditioned pipelines ------------------------------------------------------------------------------
def _needs_i2v(config: dict) -> str | None:
    """Why this transformer cannot run WanImageToVideoPipeline, or None. The pipeline concatenates to the noise
    (``out_channels``) a first-frame mask (the VAE's 4x temporal factor: 4 channels) and the encoded condition
    video: ``in_channels = 2 * out_channels + 4`` (Wan 2.1 I2V, Wan 2.2 I2V-A14B). Wan 2.2 TI2V (one transformer,
    ``in_channels == out_channels`` with the 48-channel Wan 2.2 VAE) writes the encoded frame over the first latent
    frame instead."""
    cin, cout = config.get("in_channels"), config.get("out_channels")
    if cin is None or cout is None or cin == 2 * cout + 4 or cin == cout == 48:
        return None
    return (f"i2v needs an image-to-video checkpoint (transformer in_channels = 2 x out_channels + 4: the noise, "
            f"the first-frame mask and the encoded image); this one reads {cin} channels (text-to-video)")


def ftfy_setup(pipeline_module: str):
    """A ``setup`` for a pipeline module (``diffusers.pipelines.<pipeline_module>``) that cleans prompts with ``ftfy``
    unconditionally (WanImageToVideoPipeline, ChronoEditPipeline; WanPipeline only when it is installed): without ftfy,
    give the module an ``ftfy`` that leaves text as it is, which is what WanPipeline does then."""

    def setup() -> None:
        import importlib
        import types

        from diffusers.utils import is_ftfy_available

        module = importlib.import_module(f"diffusers.pipelines.{pipeline_module}")
        if not is_ftfy_available() and not hasattr(module, "ftfy"):
            module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)

    return setup


#: Image-to-video: the condition image is VAE-encoded (as the first frame of an otherwise black video, split over
#: the ranks like any encode) and joins the transformer's input on channels, so the tokens, the sequence plan and
#: the tensor plan are those of text-to-video; Wan 2.1 I2V checkpoints also cross-attend to CLIP image tokens
#: (``add_k_proj``/``add_v_proj``, in the tensor plan). No strength: every run starts from noise.
WAN_IMAGE_PIPELINES = (ImagePipeline("i2v", "WanImageToVideoPipeline", strength=False, check=_needs_i2v,
                                     setup=ftfy_setup("wan.pipeline_wan_i2v")),)


def wan_components(arch: SynthArch, kit) -> dict:
    """WanPipeline's other components: AutoencoderKLWan (video VAE) and a UMT5 text encoder with a T5 tokenizer;
    for a transformer with ``image_dim`` (Wan 2.1 I2V) also a CLIP vision encoder (``arch.clip``) and its image
    processor (CLIP's normalization, resized and cropped to the encoder's image size)."""
    import diffusers
    import transformers

    t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
    components = dict(vae=kit.make(diffusers.AutoencoderKLWan, arch.vae, 1),
                      text_encoder=kit.make(transformers.UMT5EncoderModel,
                                            kit.t5_config(t5_tok, arch.t5, transformers.UMT5Config), 3),
                      tokenizer=t5_tok)
    if arch.transformer.get("image_dim"):
        side = arch.clip["image_size"]
        components["image_encoder"] = kit.make(transformers.CLIPVisionModel, transformers.CLIPVisionConfig(**arch.clip), 2)
        components["image_processor"] = transformers.CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return components


WAN = register(
    ModelAdapter(
        name="wan",
        class_names=("WanTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            # Wan 2.2 TI2V's per-token timesteps ([B, N]) are split with their tokens; one per sample stays whole
            inputs={"": {"timestep": Split(dim=1, stream="video", ndim=2)},
                    "blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3)}},
            outputs={"rope": {0: Split(dim=1, stream="video", ndim=4), 1: Split(dim=1, stream="video", ndim=4)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
            differs_from_cp_plan="the same split and gather points; chunks may be uneven (diffusers needs the token "
                                 "count divisible by the degree)",
        ),
        attention=AttentionSelector(class_names=("WanAttention",)),
        sequence_processor=WanSequenceParallelProcessor,
        blocks=(BlockList("blocks", ("hidden_states",), ("hidden_states",), ("video",)),),
        token_wise=("blocks.*.ffn",),
        modulated_input=wan_modulated_input,
        example_inputs=wan_example_inputs,
        layout=wan_layout,
        text_tokens=512,  # umT5, cross-attention only
        tensor_plan=WAN_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        cfg_mode="sequential",  # WanPipeline calls the transformer once for cond, once for uncond
        output_channel_dim=1,
        fuse_qkv=True,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,  # the Wan VAE compresses time 4x: 4k+1 frames
        fps=16,  # Wan 2.1 is trained on 16 fps clips
        pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
        image_pipelines=WAN_IMAGE_PIPELINES,
        synth_archs=WAN_ARCHS,
        synth_components=wan_components,
        vae=WAN_VAE_PLAN,
    )
)
