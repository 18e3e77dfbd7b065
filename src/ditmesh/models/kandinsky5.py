"""Kandinsky 5 (``Kandinsky5Transformer3DModel``; ``Kandinsky5T2VPipeline`` and its image-to-video, text-to-image and
image-to-image forms): a text encoder stack, then visual blocks with self-attention over the video and cross-attention
to the encoded text.

Where the tokens are: the pipeline hands the latent channels-last (``[B, F, H, W, C]``); ``forward`` embeds the text
(``text_embeddings``) and runs the text blocks over the whole text (their self-attention is left as it is:
``whole_attention``), patchifies the latent (``visual_embeddings``, ``[B, F, H/2, W/2, D]``), builds the 3-D RoPE
table and flattens both to tokens (``fractal_flatten``: ``[B, N, D]`` and ``[B, N, 1, D/2, 2, 2]``), runs the visual
blocks and unflattens before ``out_layer``. The sequence plan splits the video tokens at the first visual block and the
RoPE table at every visual block (``forward`` hands each block the whole table), and gathers the video at the output
of the last visual block (``visual_transformer_blocks.-1``), before the unflatten.

Attention: the visual self-attention computes projections, per-head QK-norms and the rotation on local tokens (the
rotation rounds through bfloat16, as diffusers' processor does) and runs the softmax through ``sp.attention``; the
cross-attention to the whole text runs as diffusers' processor (local queries, whole keys). Its sparse "nabla"
attention (``attention_type="nabla"``, the Pro checkpoints' long videos) builds a block mask per sample and per head
from that head's queries and keys over the whole sequence, as Kandinsky 6 SR's NABLA does: under Ulysses each rank
builds its heads' masks after the all-to-all (the attention's ``local``); ring and USP are refused for it. CFG: two calls a step (sequential). Tensor plan: Q/K/V column- and the output row-parallel
in every attention, the feed-forward column -> row: 3 all-reduces a visual block (self, cross, feed-forward), 2 a text
block; the QK-norms act per head.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers import transformer_kandinsky

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, spatial_latent, temporal_latent)
from .hunyuan_video import HUNYUAN_VIDEO


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Kandinsky 5's rotation of ``x`` ``[B, N, H, D]`` by the 2x2 matrices of ``rope``, through bfloat16 as diffusers'
    processor does."""
    pairs = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    return (rope * pairs).sum(dim=-1).reshape(*x.shape).to(torch.bfloat16).type_as(x)


class Kandinsky5SequenceParallelProcessor(SequenceProcessor):
    """Processor for ``Kandinsky5Attention`` of the visual blocks: self-attention sequence-parallel, cross-attention to
    the whole text as diffusers' processor (see the module docstring)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 rotary_emb=rotary_emb, sparse_params=sparse_params)
        q, k, v = (linear(hidden_states).unflatten(-1, (attn.num_heads, -1))
                   for linear in (attn.to_query, attn.to_key, attn.to_value))
        q, k = attn.query_norm(q.float()).type_as(q), attn.key_norm(k.float()).type_as(k)
        if rotary_emb is not None:
            q, k = rotate(q, rotary_emb), rotate(k, rotary_emb)
        if sparse_params is None:
            out = self.sp.attention(q, k, v, backend=self._attention_backend)
        elif self.sp.ring_degree > 1:
            raise NotImplementedError("Kandinsky 5's nabla attention chooses each query block's keys from every key "
                                      "block of the sequence, which ring attention does not take; use ulysses")
        else:  # nabla: each head's block mask from its own queries and keys over the whole sequence
            out = self.sp.attention(q, k, v, local=lambda q, k, v: self.nabla(q, k, v, sparse_params))
        return attn.out_layer(out.flatten(-2, -1))

    def nabla(self, query, key, value, sparse_params):
        """Nabla attention of ``[B, S, h, D]`` holding every token of ``h`` heads (after the Ulysses all-to-all), as
        diffusers' processor runs it: each head's block mask (``nablaT_v2``), then the layer's backend (flex)."""
        mask = transformer_kandinsky.nablaT_v2(query, key, sparse_params["sta_mask"], thr=sparse_params["P"])
        return dispatch_attention_fn(query, key, value, attn_mask=mask, backend=self._attention_backend)


#: why the 8-bit attention does not stand in for a nabla attention (``ModelAdapter.attention_refusal``; Kandinsky 6 SR's
#: too)
NABLA_REFUSAL = ("block-sparse attention: each query block's keys chosen from its own scores and run as a "
                 "flex-attention block mask, which the 8-bit kernel (dense, cuDNN's) does not take")


def kandinsky5_unsupported(model, config) -> str | None:
    """Nabla sparse attention under ring (a row of its block mask reads every key block of the sequence)."""
    if model.config.get("attention_type") == "nabla" and config.ring > 1:
        return (f"Kandinsky 5's nabla sparse attention chooses each query block's keys from every key block of the "
                f"sequence, which ring attention does not take (ring={config.ring}); use ulysses, tp, cfg or dp")
    return None


def kandinsky5_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one Kandinsky5T2VPipeline step: channels-last latents of ``(frames - 1) // 4 + 1`` latent
    frames 8x smaller (default 121 frames; with ``visual_cond``, the condition's zeros and mask on channels), the Qwen
    text (``text_len`` tokens) and its positions, the pooled CLIP text, the RoPE positions of the patch grid."""
    cfg = model.config
    latent_frames = ((frames or 121) - 1) // 4 + 1
    rows, cols = height // 8, width // 8
    channels = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, latent_frames, rows, cols, channels),
        encoder_hidden_states=rand(batch, text_len, cfg.in_text_dim),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        pooled_projections=rand(batch, cfg.in_text_dim2),
        visual_rope_pos=[torch.arange(latent_frames, device=device), torch.arange(rows // 2, device=device),
                         torch.arange(cols // 2, device=device)],
        text_rope_pos=torch.arange(text_len, device=device),
        return_dict=False,
    )


def kandinsky5_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Kandinsky 5 video call: 8x spatial and 4x temporal VAE, 1x2x2 patches; the text is whole."""
    lh, lw = spatial_latent(height, width, 16, "Kandinsky 5 (8x VAE, 2x2 patches)")
    latent_frames = temporal_latent(frames, 4, "Kandinsky 5's 4x temporal VAE")
    video = latent_frames * (lh // 2) * (lw // 2)
    return Layout(video, text_tokens, video, (latent_frames, lh, lw, config.get("in_visual_dim", 16)))


def _attention(prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(column-, row-parallel) patterns of the attention at ``prefix``."""
    return tuple(f"{prefix}.{name}" for name in ("to_query", "to_key", "to_value")), (f"{prefix}.out_layer",)


def _tensor_plan() -> TensorPlan:
    colwise, rowwise, heads = [], [], {}
    for prefix in ("text_transformer_blocks.*.self_attention", "visual_transformer_blocks.*.self_attention",
                   "visual_transformer_blocks.*.cross_attention"):
        col, row = _attention(prefix)
        colwise += col
        rowwise += row
        heads[prefix] = ("num_heads",)
    for blocks in ("text_transformer_blocks", "visual_transformer_blocks"):
        colwise.append(f"{blocks}.*.feed_forward.in_layer")
        rowwise.append(f"{blocks}.*.feed_forward.out_layer")
    return TensorPlan(colwise=tuple(colwise), rowwise=tuple(rowwise), per_rank_attrs=heads)


# -- synthetic architectures ---------------------------------------------------------------------------------
KANDINSKY5_LITE = SynthArch(
    name="kandinsky5-lite",
    description="Kandinsky 5.0 Video Lite transformer (2 text + 32 visual blocks, 28 heads x 64, 2B params), the "
                "HunyuanVideo VAE, a two-layer Qwen2.5-VL of Qwen2.5-VL-7B's width, a one-layer CLIP-L",
    pipeline="Kandinsky5T2VPipeline",
    transformer_class="Kandinsky5Transformer3DModel",
    transformer=dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512,
                     patch_size=[1, 2, 2], model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
                     axes_dims=[16, 24, 24], visual_cond=True, attention_type="regular"),
    vae=HUNYUAN_VIDEO.vae,
    clip=HUNYUAN_VIDEO.clip,
    t5=dict(text=dict(hidden_size=3584, intermediate_size=64, num_hidden_layers=2, num_attention_heads=28,
                      num_key_value_heads=4, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                           "type": "default"}),
            vision=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=3584)),
    scheduler=dict(shift=10.0),
    default_dtype="bfloat16",
    default_size=(512, 768),
    max_sequence_length=256,
    default_frames=121,
)

#: diffusers' pipeline test's transformer (tests/pipelines/kandinsky5/test_kandinsky5.py: 1 text + 2 visual blocks,
#: 4 heads x 4, 16 wide)
KANDINSKY5_TINY = dataclasses.replace(
    KANDINSKY5_LITE,
    name="kandinsky5-tiny",
    description="Kandinsky 5 shrunk for CPU tests: diffusers' pipeline test's transformer (1 text + 2 visual blocks, "
                "4 heads x 4), its tiny HunyuanVideo VAE, Qwen2.5-VL and CLIP",
    transformer=dict(in_visual_dim=16, in_text_dim=32, in_text_dim2=16, time_dim=16, out_visual_dim=16,
                     patch_size=[1, 2, 2], model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2,
                     axes_dims=[1, 1, 2], visual_cond=False, attention_type="regular"),
    vae=dict(act_fn="silu", block_out_channels=[32, 64], down_block_types=["HunyuanVideoDownBlock3D"] * 2,
             up_block_types=["HunyuanVideoUpBlock3D"] * 2, latent_channels=16, layers_per_block=1,
             mid_block_add_attention=False, norm_num_groups=32, scaling_factor=0.476986, spatial_compression_ratio=8,
             temporal_compression_ratio=4),
    clip=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, projection_dim=16),
    t5=dict(text=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default",
                                                         "type": "default"}),
            vision=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)),
    default_dtype="float32",
    default_size=(32, 32),
    max_sequence_length=8,
    default_frames=5,
)


def kandinsky5_components(arch: SynthArch, kit) -> dict:
    """Kandinsky5T2VPipeline's other components: AutoencoderKLHunyuanVideo (``arch.vae``), a Qwen2.5-VL (``arch.t5``),
    CLIP (``arch.clip``, pooled) with a local CLIP tokenizer. In the processor's place (``tokenizer``: a Qwen2-VL
    processor, whose video processor needs torchvision) the local Qwen2 tokenizer it wraps: the pipeline calls it on
    text alone, with ``images=None, videos=None``."""
    import diffusers
    import transformers

    from .qwenimage import qwen25vl_text_encoder

    clip_tok = kit.clip_tokenizer()
    return dict(vae=kit.make(diffusers.AutoencoderKLHunyuanVideo, arch.vae, 1), **qwen25vl_text_encoder(arch, kit),
                text_encoder_2=kit.make(transformers.CLIPTextModel, kit.clip_config(clip_tok, arch.clip), 2),
                tokenizer_2=clip_tok)

KANDINSKY5 = register(
    ModelAdapter(
        name="kandinsky5",
        class_names=("Kandinsky5Transformer3DModel",),
        num_heads=lambda model: model.config.model_dim // sum(model.config.axes_dims),
        sequence_plan=SequencePlan(
            streams=("video",),
            inputs={"visual_transformer_blocks.0": {"visual_embed": Split(dim=1, stream="video", ndim=3)},
                    "visual_transformer_blocks.*": {"rope": Split(dim=1, stream="video", ndim=6)}},
            gathers={"visual_transformer_blocks.-1": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=("visual_transformer_blocks.*.self_attention",
                                           "visual_transformer_blocks.*.cross_attention")),
        whole_attention=AttentionSelector(paths=("text_transformer_blocks.*.self_attention",)),
        sequence_processor=Kandinsky5SequenceParallelProcessor,
        blocks=(BlockList("visual_transformer_blocks", ("visual_embed",), ("visual_embed",), ("video",)),),
        token_wise=("visual_transformer_blocks.*.feed_forward",),
        example_inputs=kandinsky5_example_inputs,
        layout=kandinsky5_layout,
        text_tokens=256,
        tensor_plan=_tensor_plan(),
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "pooled_projections"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=-1,
        out_channels=lambda model: model.config.out_visual_dim,
        frame_step=4,
        fps=24,
        pipelines=("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline", "Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"),
        synth_archs=(KANDINSKY5_LITE, KANDINSKY5_TINY),
        synth_components=kandinsky5_components,
        unsupported=kandinsky5_unsupported,
        attention_refusal=lambda model: (f"Kandinsky 5's nabla {NABLA_REFUSAL} (this checkpoint's attention_type)"
                                         if model.config.get("attention_type") == "nabla" else None),
        pp_refusal="its visual blocks take the RoPE table whole from forward, cut per block; PipeFusion is not tested "
                   "on it",
    )
)
