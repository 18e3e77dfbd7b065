"""HunyuanVideo's variants: HunyuanVideo 1.5 (``HunyuanVideo15Transformer3DModel``), HunyuanVideo's adapter
(``models/hunyuan_video.py``) with what differs.

HunyuanVideo 1.5 keeps 1.0's dual-stream block (video and text projected by their own linears, per-head QK-norms,
RoPE on the video tokens, one joint attention over ``[video, text]``) and drops the single-stream blocks. Its text
stream is three streams joined in ``forward`` before the blocks: the refined Qwen2.5-VL prompt, the ByT5 glyph text
and the SigLIP image tokens, each prompt's valid tokens first and its padding after (image tokens are all padding in
text-to-video). The blocks take that text whole and its key mask ``[B, text]``; diffusers' processor pads the mask
with ones over the video tokens (in front) and masks both queries and keys. Here the processor hands ``sp.attention``
the key mask over ``[video, text]`` (the video's global length from the stream split), in the model's order, which
sequence parallelism reorders like the keys. A padded text token's own row differs from diffusers' (it attends to the
valid keys instead of none), but no valid token reads it (it is masked as a key) and the text is dropped after the
blocks, so the video output is exactly the one-process output.

The sequence plan is 1.0's: the RoPE table split with the video, video and text tokens split at the first block (each
stream on its own), the gather at ``proj_out``; the token refiner attends over the whole Qwen prompt before the split
(``whole_attention``). The tensor plan is 1.0's dual-block part (4 all-reduces a block). The pipeline runs CFG through
diffusers' guider: two calls a step, the prompt's then the negative prompt's (sequential). The VAE
(``AutoencoderKLHunyuanVideo15``, 16x spatial, 4x temporal) runs whole on every rank.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .base import (AttentionSelector, Gather, ImagePipeline, Layout, SequencePlan, Split, SynthArch, TensorPlan, register,
                   spatial_latent, temporal_latent, token_range)
from .hunyuan_video import (HUNYUAN_VIDEO, HUNYUAN_VIDEO_ADAPTER, HUNYUAN_VIDEO_TINY, HunyuanVideoSequenceParallelProcessor,
                            hunyuan_video_components)
from .flux import FLUX_TENSOR_PLAN

#: the pipeline's text stream beyond the Qwen prompt: ByT5 glyph tokens and SigLIP image tokens
BYT5_TOKENS, IMAGE_TOKENS = 256, 729


class HunyuanVideo15SequenceParallelProcessor(HunyuanVideoSequenceParallelProcessor):
    """HunyuanVideo 1.0's processor, given the key mask over ``[video, text]`` built from 1.5's text mask ``[B, text]``
    (see the module docstring)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            _, video = token_range(self.sp, "video", hidden_states.shape[1])
            valid = torch.ones(attention_mask.shape[0], video, dtype=torch.bool, device=attention_mask.device)
            attention_mask = torch.cat([valid, attention_mask.bool()], dim=1)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def hunyuan_video15_example_inputs(model, height, width, batch, text_len, generator, device, dtype,
                                   frames=None) -> dict:
    """Transformer inputs of one HunyuanVideo15Pipeline step: latents (noise, the image condition's latents and its
    mask on channels, ``in_channels``) of ``(frames - 1) // 4 + 1`` latent frames 16x smaller (default 121 frames), a
    Qwen prompt of ``text_len`` tokens, no glyph text (ByT5 tokens all padding) and no image (zeros: text-to-video)."""
    cfg = model.config
    frames = frames or 121
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, cfg.in_channels, (frames - 1) // 4 + 1, height // 16, width // 16),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
        encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.int64, device=device),
        encoder_hidden_states_2=rand(batch, BYT5_TOKENS, cfg.text_embed_2_dim),
        encoder_attention_mask_2=torch.zeros(batch, BYT5_TOKENS, dtype=torch.int64, device=device),
        image_embeds=torch.zeros(batch, IMAGE_TOKENS, cfg.image_embed_dim, device=device, dtype=dtype),
        return_dict=False,
    )


def hunyuan_video15_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a HunyuanVideo15Pipeline call: 16x spatial and 4x temporal VAE, ``patch_size`` patches (1);
    the text stream is the Qwen prompt and the ByT5 and image tokens, all split with the video (joint attention)."""
    p, pt = config.get("patch_size", 1), config.get("patch_size_t", 1)
    lh, lw = spatial_latent(height, width, 16 * p, f"HunyuanVideo 1.5 (16x VAE, {p}x{p} patches)")
    lh, lw = lh // 2, lw // 2  # spatial_latent gives the 8x latent
    latent_frames = temporal_latent(frames, 4, "HunyuanVideo 1.5's 4x temporal VAE")
    video = (latent_frames // pt) * (lh // p) * (lw // p)
    text = text_tokens + BYT5_TOKENS + IMAGE_TOKENS
    return Layout(video, text, video + text, (config.get("in_channels", 65), latent_frames, lh, lw))


def hunyuan_video15_meta_trace(model: torch.nn.Module):
    """Give the planner's ``model`` a forward traceable on the meta device at a real call's cost: diffusers' forward
    reads on the host whether the image tokens are zeros and moves each prompt's valid tokens first with boolean
    indexing, neither of which a meta tensor has; here the three text streams are concatenated as they come (the same
    tokens and shapes), then the embedders, blocks, final norm and projection run as in diffusers' forward. Returns
    the undo callable."""

    def forward(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, timestep_r=None,
                encoder_hidden_states_2=None, encoder_attention_mask_2=None, image_embeds=None, **_):
        rotary = model.rope(hidden_states)
        temb = model.time_embed(timestep, timestep_r=timestep_r)
        tokens = model.x_embedder(hidden_states)
        image = model.image_embedder(image_embeds)
        text = torch.cat([image, model.context_embedder_2(encoder_hidden_states_2),
                          model.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)], dim=1)
        mask = torch.cat([torch.ones(image.shape[:2], dtype=torch.bool, device=image.device),
                          encoder_attention_mask_2.bool(), encoder_attention_mask.bool()], dim=1)
        for block in model.transformer_blocks:
            tokens, text = block(tokens, text, temb, mask, rotary)
        return (model.proj_out(model.norm_out(tokens, temb)),)

    model.forward = forward
    return lambda: vars(model).pop("forward")


# -- synthetic architectures ---------------------------------------------------------------------------------
HUNYUAN_VIDEO15 = SynthArch(
    name="hunyuan-video-1.5",
    description="HunyuanVideo 1.5 (8.3B) transformer (54 dual-stream blocks, 16 heads x 128, 2 refiner blocks; Qwen "
                "prompt, ByT5 glyph and SigLIP image tokens in the text stream)",
    pipeline="HunyuanVideo15Pipeline",
    transformer_class="HunyuanVideo15Transformer3DModel",
    transformer=dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                     num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                     text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                     rope_axes_dim=[16, 56, 56], target_size=480, task_type="t2v"),
    vae={},  # AutoencoderKLHunyuanVideo15's defaults are the 1.5 VAE
    clip={},
    # Qwen2.5-VL-7B's text width, two layers (the pipeline reads the third hidden state from the end)
    t5=dict(hidden_size=3584, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
            rope_scaling=dict(type="mrope", mrope_section=[16, 24, 24])),
    extra=dict(byt5=dict(d_model=1472, d_kv=64, d_ff=1024, num_layers=1, num_heads=6), guidance_scale=6.0),
    scheduler=dict(shift=5.0),
    default_dtype="bfloat16",
    default_size=(480, 848),
    max_sequence_length=1000,
    default_frames=121,
)

#: diffusers' test configuration of the class (2 heads x 8, 2 blocks, 1 refiner block, text 16, ByT5 8, image 12), with
#: the pipeline's 2 x 4 + 1 channels in (the noise, the image condition's latents and its mask; the test's 4 are for
#: the transformer alone)
HUNYUAN_VIDEO15_TINY = dataclasses.replace(
    HUNYUAN_VIDEO15,
    name="hunyuan-video-1.5-tiny",
    description="HunyuanVideo 1.5 shrunk for CPU tests: diffusers' test config (2 blocks, 1 refiner block, 2 heads x "
                "8, patch 1) reading 9 channels, a tiny 16x VAE, Qwen2.5-VL text model and ByT5",
    transformer=dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                     num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                     text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=[2, 2, 4], target_size=16, task_type="t2v"),
    vae=dict(latent_channels=4, block_out_channels=[8, 8, 8, 8, 8], layers_per_block=1),
    t5=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            rope_scaling=dict(type="mrope", mrope_section=[1, 1, 2])),
    extra=dict(byt5=dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2), guidance_scale=6.0),
    default_dtype="float32",
    default_size=(64, 64),
    default_frames=5,
)

#: a chat template of Qwen's form (the pipeline formats the prompt as a system and a user message)
_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hunyuan_video15_components(arch: SynthArch, kit) -> dict:
    """HunyuanVideo15Pipeline's other components: AutoencoderKLHunyuanVideo15, a Qwen2.5-VL text model (``arch.t5``)
    with a locally built byte-level BPE Qwen2 tokenizer and chat template, a ByT5 encoder (``arch.extra["byt5"]``,
    its byte tokenizer needs no vocabulary) and the CFG guider (``arch.extra["guidance_scale"]``)."""
    import diffusers
    import transformers

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    vocab, merges = kit.byte_bpe(specials, ("system", "user", "assistant", "video"))
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    tokenizer.chat_template = _CHAT_TEMPLATE
    qwen = transformers.Qwen2_5_VLTextConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                             eos_token_id=tokenizer.eos_token_id, max_position_embeddings=2048,
                                             **arch.t5)
    return dict(vae=kit.make(diffusers.AutoencoderKLHunyuanVideo15, arch.vae, 1),
                text_encoder=kit.make(transformers.Qwen2_5_VLTextModel, qwen, 3), tokenizer=tokenizer,
                **byt5_encoder(arch, kit),
                guider=diffusers.ClassifierFreeGuidance(guidance_scale=arch.extra["guidance_scale"]))


def byt5_encoder(arch: SynthArch, kit) -> dict:
    """``text_encoder_2`` (a ByT5 encoder of ``arch.extra["byt5"]``'s sizes) and ``tokenizer_2`` (ByT5's byte tokenizer,
    which needs no vocabulary): the glyph encoder of HunyuanVideo 1.5's and HunyuanImage 2.1's pipelines."""
    import transformers

    tokenizer = transformers.ByT5Tokenizer()
    config = transformers.T5Config(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, **arch.extra["byt5"])
    return dict(text_encoder_2=kit.make(transformers.T5EncoderModel, config, 2), tokenizer_2=tokenizer)

HUNYUAN_VIDEO15_ADAPTER = register(dataclasses.replace(
    HUNYUAN_VIDEO_ADAPTER,
    name="hunyuan-video-1.5",
    class_names=("HunyuanVideo15Transformer3DModel",),
    attention=AttentionSelector(paths=("transformer_blocks.*.attn",)),
    sequence_processor=HunyuanVideo15SequenceParallelProcessor,
    blocks=HUNYUAN_VIDEO_ADAPTER.blocks[:1],
    tensor_plan=TensorPlan(
        colwise=tuple(p for p in FLUX_TENSOR_PLAN.colwise if p.startswith("transformer_blocks.")),
        rowwise=FLUX_TENSOR_PLAN.rowwise,
        per_rank_attrs={"transformer_blocks.*.attn": ("heads",)},
    ),
    example_inputs=hunyuan_video15_example_inputs,
    layout=hunyuan_video15_layout,
    text_tokens=1000,  # the Qwen prompt, padded to 1000 tokens after the template is cropped
    batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                  "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds"),
    cfg_switch="guidance_scale",  # the guider's scale (its own component), two calls a step
    cfg_hint="the checkpoint's guider (guider/config.json guidance_scale > 1)",
    fps=24,
    pipelines=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    synth_archs=(HUNYUAN_VIDEO15, HUNYUAN_VIDEO15_TINY),
    synth_components=hunyuan_video15_components,
    unsupported=None,
    meta_trace=hunyuan_video15_meta_trace,
    pp_refusal="its attention always takes the text's key mask, which PipeFusion's attention does not take",
))


# -- HunyuanVideo Framepack ----------------------------------------------------------------------------------------
#: Framepack's video stream: its history latents ``[4x, 2x, clean, noisy]`` packed before the noisy window, each with
#: its RoPE rows (``_pack_history_states``, a method, so the table is cut at every block's input, not at ``rope``); the
#: noisy window is the sequence's end, which ``forward`` slices after the blocks, so the gather is after the last
#: single block (its hidden states). The text and the key mask over ``[video, text]`` are HunyuanVideo's.
FRAMEPACK_PLAN = SequencePlan(
    streams=("video", "text"),
    inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                     "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)},
            "transformer_blocks.*": {"freqs_cis": Split(dim=0, stream="video", ndim=2)},
            "single_transformer_blocks.*": {"image_rotary_emb": Split(dim=0, stream="video", ndim=2)}},
    gathers={"single_transformer_blocks.-1": Gather(dim=1, stream="video", item=0)},
)

#: the pipeline's context of one window: 9 latent frames denoised, 16 + 2 + 1 history frames at 4x, 2x and 1x and the
#: start frame
FRAMEPACK_WINDOW, FRAMEPACK_HISTORY = 9, (16, 2, 1)


def framepack_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one HunyuanVideoFramepackPipeline step (its first window): ``frames`` latent frames
    denoised (default 9: the pipeline's ``latent_window_size``), the history at 4x (16 frames), 2x (2) and 1x with the
    start frame (2), 8x smaller frames, their frame indices, the Llama text and its mask, pooled CLIP and SigLIP image
    tokens, distilled guidance."""
    cfg = model.config
    window = frames or FRAMEPACK_WINDOW
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    h4, h2, h1 = FRAMEPACK_HISTORY
    indices = torch.arange(1 + h4 + h2 + h1 + window, device=device)
    start, i4, i2, i1, noisy = indices.split([1, h4, h2, h1, window])
    latent = lambda n: rand(batch, cfg.in_channels, n, height // 8, width // 8)  # noqa: E731
    return dict(hidden_states=latent(window), timestep=torch.full((batch,), 700.0).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
                encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.int64, device=device),
                pooled_projections=rand(batch, cfg.pooled_projection_dim), image_embeds=rand(batch, 729, cfg.image_proj_dim),
                indices_latents=noisy, guidance=torch.full((batch,), 10000.0).to(device, dtype),
                latents_clean=latent(1 + h1), indices_latents_clean=torch.cat([start, i1]),
                latents_history_2x=latent(h2), indices_latents_history_2x=i2, latents_history_4x=latent(h4),
                indices_latents_history_4x=i4, return_dict=False)


def framepack_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of one Framepack window of ``frames`` latent frames at 8x: the window and the clean frames in 2x2
    patches, the 2x history in 2x4x4 cells and the 4x history in 4x8x8 (each rounded up), all split; the text with
    the 729 image tokens."""
    lh, lw = spatial_latent(height, width, 16, "HunyuanVideo Framepack (8x VAE, 2x2 patches)")
    cells = lambda n, t, s: -(-n // t) * -(-lh // s) * -(-lw // s)  # noqa: E731
    h4, h2, h1 = FRAMEPACK_HISTORY
    video = cells(frames, 1, 2) + cells(1 + h1, 1, 2) + cells(h2, 2, 4) + cells(h4, 4, 8)
    return Layout(video, text_tokens + 729, video + text_tokens + 729, (config.get("in_channels", 16), frames, lh, lw))


def framepack_meta_trace(model: torch.nn.Module):
    """Give the planner's ``model`` a forward traceable on the meta device at a real call's cost: diffusers' forward cuts
    the text of a one-sample call to its mask's valid length (and writes a larger batch's key mask row by row), reading
    each length on the host, which a meta tensor has not; the planner's text is all valid, so here it runs whole
    without a key mask, as diffusers runs a one-sample call. The history is packed and the blocks, final norm,
    projection and unpatchifying run as in diffusers' forward. Returns the undo callable."""

    def forward(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections,
                image_embeds, indices_latents, guidance=None, latents_clean=None, indices_latents_clean=None,
                latents_history_2x=None, indices_latents_history_2x=None, latents_history_4x=None,
                indices_latents_history_4x=None, **_):
        batch, _, frames, height, width = hidden_states.shape
        p, pt = model.config.patch_size, model.config.patch_size_t
        grid = (frames // pt, height // p, width // p)
        rope = lambda frames: model.rope(frame_indices=frames, height=height, width=width,  # noqa: E731
                                         device=hidden_states.device)
        history = model.clean_x_embedder(latents_clean, latents_history_2x, latents_history_4x)
        tokens, rotary = model._pack_history_states(
            model.x_embedder(hidden_states), *history, rope(indices_latents), rope(indices_latents_clean),
            rope(indices_latents_history_2x), rope(indices_latents_history_4x), height // p, width // p)
        temb, _ = model.time_text_embed(timestep, pooled_projections, guidance)
        text = torch.cat([model.image_projection(image_embeds),
                          model.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)], dim=1)
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            tokens, text = block(tokens, text, temb, None, rotary)
        out = model.proj_out(model.norm_out(tokens[:, -math.prod(grid):], temb))
        out = out.reshape(batch, *grid, -1, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)  # back to [B, C, F, H, W]
        return (out.reshape(batch, out.shape[1], frames, height, width),)

    model.forward = forward
    return lambda: vars(model).pop("forward")


HUNYUAN_VIDEO_FRAMEPACK = dataclasses.replace(
    HUNYUAN_VIDEO,
    name="hunyuan-video-framepack",
    description="HunyuanVideo Framepack (FramePackI2V_HY) transformer (HunyuanVideo's 20 dual + 40 single blocks, "
                "24 heads x 128, history patch embedders, SigLIP image projection), HunyuanVideo's VAE, Llama and "
                "CLIP-L, a one-layer SigLIP so400m-wide image encoder",
    pipeline="HunyuanVideoFramepackPipeline",
    transformer_class="HunyuanVideoFramepackTransformer3DModel",
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=[16, 56, 56], image_condition_type=None, has_image_proj=True,
                     image_proj_dim=1152, has_clean_x_embedder=True),
    extra=dict(siglip=dict(hidden_size=1152, intermediate_size=64, num_hidden_layers=1, num_attention_heads=16,
                           image_size=384, patch_size=14)),
    default_dtype="bfloat16",
    default_size=(640, 640),
    default_frames=FRAMEPACK_WINDOW,
)

#: diffusers' test configuration of the class (2 heads x 10, 1 dual + 1 single block, 1 refiner block)
HUNYUAN_VIDEO_FRAMEPACK_TINY = dataclasses.replace(
    HUNYUAN_VIDEO_FRAMEPACK,
    name="hunyuan-video-framepack-tiny",
    description="HunyuanVideo Framepack shrunk for CPU tests: diffusers' test config (1 dual + 1 single block, 2 "
                "heads x 10), a tiny HunyuanVideo VAE, Llama, CLIP and SigLIP image encoder",
    transformer=dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
                     num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
                     text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=[2, 4, 4], image_condition_type=None,
                     has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True),
    vae=HUNYUAN_VIDEO_TINY.vae,
    clip=dict(HUNYUAN_VIDEO_TINY.clip, hidden_size=8, intermediate_size=16, projection_dim=8),
    t5=dict(HUNYUAN_VIDEO_TINY.t5, hidden_size=16, num_attention_heads=2, num_key_value_heads=1),
    extra=dict(siglip=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16)),
    default_dtype="float32",
    default_size=(64, 64),
    default_frames=3,
)

def framepack_components(arch: SynthArch, kit) -> dict:
    """HunyuanVideoFramepackPipeline's other components: HunyuanVideo's (:func:`~.hunyuan_video.hunyuan_video_components`:
    its VAE, a Llama text model with a local tokenizer, CLIP) and a SigLIP vision encoder (``arch.extra["siglip"]``)
    with its image processor at the encoder's size (the torchvision-free one where torchvision is missing)."""
    import transformers

    siglip = arch.extra["siglip"]
    size = {"height": siglip["image_size"], "width": siglip["image_size"]}
    return dict(hunyuan_video_components(arch, kit), feature_extractor=transformers.SiglipImageProcessor(size=size),
                image_encoder=kit.make(transformers.SiglipVisionModel, transformers.SiglipVisionConfig(**siglip), 4))


HUNYUAN_VIDEO_FRAMEPACK_ADAPTER = register(dataclasses.replace(
    HUNYUAN_VIDEO_ADAPTER,
    name="hunyuan-video-framepack",
    class_names=("HunyuanVideoFramepackTransformer3DModel",),
    sequence_plan=FRAMEPACK_PLAN,
    example_inputs=framepack_example_inputs,
    layout=framepack_layout,
    batch_inputs=HUNYUAN_VIDEO_ADAPTER.batch_inputs + ("image_embeds", "latents_clean", "latents_history_2x",
                                                       "latents_history_4x"),
    cfg_switch="guidance_scale",  # real CFG with guidance_scale > 1 (its checkpoints are distilled: 1 by default)
    cfg_hint="--guidance > 1 (e.g. --guidance 5)",
    frame_step=None,
    pipelines=("HunyuanVideoFramepackPipeline",),
    synth_archs=(HUNYUAN_VIDEO_FRAMEPACK, HUNYUAN_VIDEO_FRAMEPACK_TINY),
    synth_components=framepack_components,
    # image to video: the image is the clean frame the windows are sampled from (no strength: every run is from noise)
    image_pipelines=(ImagePipeline("i2v", "HunyuanVideoFramepackPipeline", strength=False),),
    unsupported=None,
    meta_trace=framepack_meta_trace,
    pp_refusal="its attention always takes the text's key mask, which PipeFusion's attention does not take",
))
