"""Motif-Video (``MotifVideoTransformer3DModel``, MotifVideoPipeline, MotifVideoImage2VideoPipeline): FLUX-shaped
dual- and single-stream blocks over video and text, a text key mask, optional per-block text cross-attention, and
optional decoder blocks.

Where the tokens are: ``forward`` builds the RoPE tables of the video (``rope``: cos and sin, ``[N, D]`` each) from the
latent ``[B, C, F, H, W]``, patchifies it (``x_embedder``: ``[B, N, D]``), projects the text and, for image to video,
prepends the projected image embeddings to it (one context ``[image embeds, text]``, ``I + L`` tokens, with the mask
extended by ones). Its attention mask is the key mask over ``[video, context]`` (``[B, 1, 1, N + I + L]``, ones over the
video), built from the video tokens it holds. The dual blocks attend jointly over ``[video, context]`` (the context with
its own projections); the single blocks concatenate the two and project them together, RoPE on the video part. Where
enabled, a cross-attention after the joint one reads the text part of the context alone (RoPE on the video queries
only). Decoder blocks (the last ``num_decoder_layers`` single blocks) attend from a copy of the embedded video to the
encoder's output video tokens, with no mask.

Sequence plan: the video split where it is embedded (``x_embedder``) and its RoPE tables where they are made
(``rope``); the context (image embeds and text as one stream, ``text``) where the first dual block takes it; the
video gathered at ``proj_out``. The processor rebuilds the key mask over the whole sequence (the video's ones at its
global length, then the context's columns, which the forward keeps whole) and hands it to ``sp.attention``. The
cross-attention gathers the normalized context (one all-gather a layer, ``I + L`` tokens) and runs diffusers' processor
on the local video queries. A decoder block's copy of the embedded video is taken after the split, so it is the
rank's part of the video too: its attention runs over ``[decoder video, encoder output]``, each rank's two parts in
turn, with no mask, exact in the ranks' order. From inside, that attention looks like an encoder single block's over
the text, so the adapter names the decoder layers to their processors (``processor_args``: the streams of the keys).

Tensor plan: FLUX.1's (the same module names), plus the dual blocks' cross-attention (Q, K, V column-parallel, its
output row-parallel). The single blocks' cross-attention adds its projected output to the attention's heads before
``proj_out`` and is refused under tp. CFG: the guider's two calls a step (sequential). The VAE is Wan's
(``AutoencoderKLWan``), split as Wan's; the synthetic checkpoint holds what both pipelines take (a T5Gemma 2 encoder,
whose vision tower gives image to video its image features, and a SigLIP image processor).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan, SequenceProcessor,
                   Split, SynthArch, register, spatial_latent, token_range)
from .flux import FLUX_TENSOR_PLAN
from .wan import WAN_VAE_PLAN


class MotifVideoSequenceParallelProcessor(SequenceProcessor):
    """Processor for Motif-Video's attention layers (module docstring): the joint attention of the dual and single
    blocks through ``sp.attention`` over ``[video, context]`` with the rebuilt key mask, or, in a decoder block
    (``streams``: ``("image", "image")``), over the decoder's video and the encoder's output video, both split like
    the video; the text cross-attention by the layer's own processor on the gathered context."""

    def __init__(self, sp, previous=None, streams=("image", "text")):
        super().__init__(sp, previous)
        self.streams = streams

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 image_embed_seq_len: int = 0):
        if not hasattr(attn, "add_q_proj"):  # the cross-attention: local video queries, the whole context as keys
            sizes = getattr(getattr(self.sp, "ctx", None), "stream_sizes", {}).get("text")
            if sizes is not None and sum(sizes) != encoder_hidden_states.shape[1]:
                encoder_hidden_states = self.sp.gather(encoder_hidden_states, 1, "text")
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                 image_embed_seq_len)
        video, context = hidden_states.shape[1], encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None
        tokens = torch.cat([hidden_states, encoder_hidden_states], 1) if single else hidden_states
        q, k, v = (proj(tokens).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if single:
            q, k = (torch.cat([apply_rotary_emb(t[:, :video], image_rotary_emb, sequence_dim=1), t[:, video:]], 1)
                    for t in (q, k))
        else:
            q, k = (apply_rotary_emb(t, image_rotary_emb, sequence_dim=1) for t in (q, k))
            cq, ck, cv = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            q, k, v = (torch.cat([a, b], 1) for a, b in ((q, attn.norm_added_q(cq)), (k, attn.norm_added_k(ck)),
                                                          (v, cv)))
        # the forward's key mask spans this rank's video, then the whole context: ones over the whole video instead
        # (a decoder block has none)
        mask = None
        if attention_mask is not None:
            total = token_range(self.sp, "image", video)[1]
            whole = attention_mask[..., video:]
            mask = torch.cat([whole.new_ones(*whole.shape[:-1], total), whole], -1)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, streams=self.streams, mask=mask)
        out = out.flatten(2, 3).to(q.dtype)
        out, context_out = out[:, :video], out[:, video:video + context]
        if attn.to_out is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if attn.to_add_out is not None:
            context_out = attn.to_add_out(context_out)
        return out, context_out


def motif_video_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one MotifVideoPipeline step: the latent of the Wan VAE (8x, 4x in time) with the
    condition channels, the text states and their mask, the timestep (and image embeddings where the checkpoint
    takes them, as image to video)."""
    cfg = model.config
    frames = 1 if frames is None else (frames - 1) // 4 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    inputs = dict(hidden_states=rand(batch, cfg.in_channels, frames, height // 8, width // 8),
                  timestep=torch.full((batch,), 700.0).to(device, dtype),
                  encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
                  encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.long, device=device),
                  return_dict=False)
    if cfg.image_embed_dim is not None:
        inputs["image_embeds"] = rand(batch, 8, cfg.image_embed_dim)
    return inputs


def motif_video_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a Motif-Video call: the Wan VAE divides by 8 (4 in time), patches of ``patch_size``; the video
    and the context are split together."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"Motif-Video (8x VAE, {patch}x{patch} patches)")
    video = ((max(frames, 1) - 1) // 4 + 1) // config.get("patch_size_t", 1) * (lh // patch) * (lw // patch)
    return Layout(video, text_tokens, video + text_tokens,
                  (config.get("in_channels", 33), (max(frames, 1) - 1) // 4 + 1, lh, lw))


def motif_video_unsupported(model, config) -> str | None:
    """A checkpoint this configuration cannot run exactly (module docstring), in one line; or None."""
    cfg = model.config
    if config.sp > 1 and not cfg.num_layers:
        return "Motif-Video without dual blocks (num_layers=0) takes its text split at the first one; use tp, cfg or dp"
    if config.tp > 1 and cfg.enable_text_cross_attention_single:
        return ("Motif-Video's single blocks add their text cross-attention to the attention heads before proj_out, "
                "which tp does not shard; use ulysses, ring, cfg or dp with this checkpoint")
    return None


def motif_video_processor_args(model, name: str) -> dict:
    """The decoder blocks' attention layers (the last ``num_decoder_layers`` single blocks) run over two video streams
    split alike: the decoder's and the encoder's output."""
    first_decoder = model.config.num_single_layers - model.config.num_decoder_layers
    parts = name.split(".")
    decoder = parts[0] == "single_transformer_blocks" and parts[2] == "attn" and int(parts[1]) >= first_decoder
    return {"streams": ("image", "image")} if decoder else {}


#: FLUX.1's plan (the same module names), with the dual blocks' text cross-attention where a checkpoint has it
MOTIF_VIDEO_TENSOR_PLAN = dataclasses.replace(
    FLUX_TENSOR_PLAN,
    colwise=FLUX_TENSOR_PLAN.colwise
    + tuple(f"transformer_blocks.*.cross_attn.{p}?" for p in ("to_q", "to_k", "to_v")),
    rowwise=FLUX_TENSOR_PLAN.rowwise + ("transformer_blocks.*.cross_attn.to_out.0?",),
    per_rank_attrs=dict(FLUX_TENSOR_PLAN.per_rank_attrs, **{"transformer_blocks.*.cross_attn?": ("heads",)}),
)

_IMAGE = Split(dim=1, stream="image", ndim=3)
_TABLE = Split(dim=0, stream="image", ndim=2)

# -- synthetic architectures ---------------------------------------------------------------------------------
MOTIF_VIDEO = SynthArch(
    name="motif-video",
    description="Motif-Video-2B's block layout (12 dual + 16 single + 8 decoder blocks, as diffusers' docs give it) at "
                "diffusers' default width (24 heads x 128, text width 4096, 33 input channels), the Wan 2.1 VAE, a "
                "one-layer T5Gemma 2 encoder of that width",
    pipeline="MotifVideoPipeline",
    transformer_class="MotifVideoTransformer3DModel",
    transformer=dict(num_attention_heads=24, attention_head_dim=128, num_layers=12, num_single_layers=24,
                     num_decoder_layers=8),
    vae={},  # AutoencoderKLWan's defaults are the Wan 2.1 VAE
    clip={},
    t5=dict(hidden_size=4096, intermediate_size=64, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
            head_dim=256),
    scheduler=dict(shift=7.0),
    extra=dict(guidance_scale=5.0),
    default_dtype="bfloat16",
    default_size=(736, 1280),  # the size of diffusers' examples
    default_frames=121,
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_motif_video.py)
MOTIF_VIDEO_TINY = dataclasses.replace(
    MOTIF_VIDEO, name="motif-video-tiny",
    description="Motif-Video at diffusers' test configuration: 1 dual + 1 single block, 2 heads x 12, 1x1 patches, "
                "text width 32, image embeddings 4 wide; a tiny Wan VAE and T5Gemma 2 encoder",
    transformer=dict(in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=1,
                     num_single_layers=1, num_decoder_layers=0, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                     qk_norm="rms_norm", norm_type="layer_norm", text_embed_dim=32, image_embed_dim=4,
                     rope_theta=256.0, rope_axes_dim=(4, 4, 4), enable_text_cross_attention_dual=False,
                     enable_text_cross_attention_single=False),
    vae=dict(base_dim=8, num_res_blocks=1),
    t5=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16),
    default_dtype="float32", default_size=(64, 64), default_frames=5, max_sequence_length=32)

def motif_video_components(arch: SynthArch, kit) -> dict:
    """MotifVideoPipeline's other components: the Wan VAE (``arch.vae``), a T5Gemma 2 encoder (``arch.t5``) with a local
    Gemma tokenizer, the CFG guider (``arch.extra["guidance_scale"]``), and for MotifVideoImage2VideoPipeline on the
    same folder a SigLIP image processor (its PIL path: no torchvision) for the encoder's vision tower, one small layer
    whose width is the transformer's ``image_embed_dim``."""
    import diffusers
    import transformers

    tokenizer = kit.gemma_tokenizer(arch.max_sequence_length, add_bos=True)
    text = transformers.T5Gemma2TextConfig(vocab_size=len(tokenizer), max_position_embeddings=1024, dropout_rate=0.0,
                                           **arch.t5)
    vision = dict(hidden_size=arch.transformer.get("image_embed_dim") or 16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.T5Gemma2EncoderConfig(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    extractor = transformers.SiglipImageProcessor(size={"height": 28, "width": 28})
    return dict(vae=kit.make(diffusers.AutoencoderKLWan, arch.vae, 1), tokenizer=tokenizer,
                text_encoder=kit.make(transformers.T5Gemma2Encoder, config, 3), feature_extractor=extractor,
                guider=diffusers.ClassifierFreeGuidance(guidance_scale=arch.extra["guidance_scale"]))


MOTIF_VIDEO_ADAPTER = register(
    ModelAdapter(
        name="motif-video",
        class_names=("MotifVideoTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image", "text"),
            inputs={"transformer_blocks.0": {"encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            outputs={"rope": {0: _TABLE, 1: _TABLE}, "x_embedder": {None: _IMAGE}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the class has no _cp_plan; the video split where it is embedded (its RoPE tables "
                                 "where they are made), the image embeds and text as one stream at the first block",
        ),
        attention=AttentionSelector(class_names=("MotifVideoAttention", "MotifVideoCrossAttention")),
        sequence_processor=MotifVideoSequenceParallelProcessor,
        blocks=(),
        example_inputs=motif_video_example_inputs,
        layout=motif_video_layout,
        text_tokens=512,
        tensor_plan=MOTIF_VIDEO_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "image_embeds"),
        cfg_mode="sequential",  # the guider's conditional and unconditional calls
        cfg_switch="guidance_scale",
        cfg_hint="the checkpoint's guider (guider/config.json guidance_scale > 1)",
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,
        fps=24,
        pipelines=("MotifVideoPipeline", "MotifVideoImage2VideoPipeline"),
        image_pipelines=(ImagePipeline("i2v", "MotifVideoImage2VideoPipeline", strength=False),),
        synth_archs=(MOTIF_VIDEO_TINY, MOTIF_VIDEO),
        synth_components=motif_video_components,
        vae=WAN_VAE_PLAN,
        unsupported=motif_video_unsupported,
        processor_args=motif_video_processor_args,
        pp_refusal="Motif-Video's blocks take the text key mask, which PipeFusion does not take",
    )
)
