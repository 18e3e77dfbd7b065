"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): joint video + text attention with a padded-text mask.

Where the tokens are: ``forward`` builds the RoPE table of the video tokens from the latent's shape (``rope``),
patchifies the latent (``x_embedder``), refines the text embeddings whole (``context_embedder``, a token refiner
with its own self-attention over the text), builds a key mask ``[B, 1, 1, video + text]`` that drops each prompt's
padding (global order: video first, then text), runs 20 dual-stream and 40 single-stream blocks over
``[video, text]`` and unpatchifies after ``proj_out``. diffusers gives the class no ``_cp_plan``. The sequence plan
splits

- the RoPE table (``rope``'s cos and sin, ``[video, D]``) with the video tokens, so every rank rotates its tokens
  with their global positions (only video tokens are rotated; text keeps its positions out of the rotation);
- the video (``hidden_states``) and text (``encoder_hidden_states``) tokens at the input of ``transformer_blocks.0``,
  each stream on its own (any token count: 720x1280x129 has 118,800 video tokens);

and gathers ``proj_out``'s output. The text stays whole up to the first block: the token refiner attends over all of
it (``whole_attention``) and ``forward`` builds the mask from its global length. The mask stays whole on every rank
and the processor hands it to ``sp.attention`` in the model's order, which reorders it like the keys.

Tensor plan: FLUX.1's (the same block layout and module names): dual blocks 4 all-reduces, single blocks 1 (the
packed ``proj_out`` over attention and MLP). CFG: true CFG with a negative prompt, two calls per step (sequential);
``guidance_scale`` is the distilled guidance, an input of one call. Image-to-video checkpoints that concatenate the
image latents on channels (``latent_concat``) have the same tokens; those whose blocks modulate the first frame's
tokens apart (``token_replace``) are refused under sequence parallelism (``unsupported``).

The VAE (``AutoencoderKLHunyuanVideo``) runs whole on every rank: its causal convolutions pad height by replicating
the edge rows inside ``forward``, which the parallel VAE's zero-row halos do not reproduce.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   norm1_modulated_input, register, spatial_latent, temporal_latent)
from .flux import FLUX_TENSOR_PLAN


class HunyuanVideoSequenceParallelProcessor:
    """Attention processor for HunyuanVideo's joint attention whose core attention runs sequence-parallel.

    Dual blocks project video and text with their own linears, single blocks with the same ones (``add_q_proj`` is
    None); QK-norms act per head, RoPE rotates the video tokens only, as diffusers' ``HunyuanVideoAttnProcessor2_0``
    does. The softmax attention over ``[video, text]`` goes through ``sp.attention`` with the model's key mask.
    """

    _parallel_config = None
    #: the joint sequence's order: video then text (HunyuanVideo), or text then video (EasyAnimate)
    text_first = False

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None:
            raise ValueError("HunyuanVideo's joint attention takes the text stream (encoder_hidden_states)")
        dual = attn.add_q_proj is not None

        def heads(linear, x):
            return linear(x).unflatten(2, (attn.heads, -1))  # heads divided by tensor parallelism, head dim kept

        def qkv(to_q, to_k, to_v, norm_q, norm_k, x):
            q, k = heads(to_q, x), heads(to_k, x)
            return (norm_q(q) if norm_q is not None else q), (norm_k(k) if norm_k is not None else k), heads(to_v, x)

        q, k, v = qkv(attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        if dual:
            eq, ek, ev = qkv(attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_added_q, attn.norm_added_k,
                             encoder_hidden_states)
        else:
            eq, ek, ev = qkv(attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, encoder_hidden_states)

        order = (lambda video, text: (text, video)) if self.text_first else (lambda video, text: (video, text))
        out = self.sp.attention(*(torch.cat(order(a, b), dim=1) for a, b in ((q, eq), (k, ek), (v, ev))),
                                backend=self._attention_backend, mask=attention_mask)
        out = out.flatten(2, 3).to(q.dtype)
        parts = out.split_with_sizes(order(q.shape[1], eq.shape[1]), dim=1)
        video_out, text_out = order(*parts)  # the same swap undoes itself
        if getattr(attn, "to_out", None) is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out.contiguous()))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out.contiguous())
        return video_out, text_out


def hunyuan_video_unsupported(model, config) -> str | None:
    """Why ``config`` cannot run this checkpoint exactly, or None. PipeFusion takes no attention mask. Token-replace
    checkpoints (``image_condition_type="token_replace"``, HunyuanVideo-I2V) modulate the first latent frame's tokens
    apart inside every block, at a token count that is global, so a rank holding a slice of the video would modulate
    the wrong tokens; tensor, cfg and data parallelism leave the tokens whole."""
    if config.pp > 1:
        return (f"HunyuanVideo's attention always takes the padded-text key mask, which PipeFusion (pp={config.pp}) "
                f"does not take; use ulysses, ring, tp, cfg or dp")
    if model.config.get("image_condition_type") == "token_replace" and config.sp > 1:
        return (f"HunyuanVideo's token-replace image conditioning (image_condition_type='token_replace') does not run "
                f"under sequence parallelism (ulysses={config.ulysses}, ring={config.ring}); use tp, cfg or dp")
    return None


def hunyuan_video_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one HunyuanVideoPipeline denoising step: random latents (``(frames - 1) // 4 + 1``
    latent frames, 8x smaller frames; default 129 frames), text embeddings and pooled CLIP embeddings, and a text
    mask of ones (a prompt filling ``text_len`` tokens); distilled guidance 6 (x1000, as the pipeline scales it)."""
    cfg = model.config
    frames = frames or 129
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, cfg.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
        encoder_attention_mask=torch.ones(batch, text_len, dtype=torch.int64, device=device),
        pooled_projections=rand(batch, cfg.pooled_projection_dim),
        guidance=torch.full((batch,), 6000.0).to(device, dtype),
        return_dict=False,
    )


def hunyuan_video_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a HunyuanVideoPipeline call: 8x spatial and 4x temporal VAE, then ``patch_size`` patches
    (720x1280x129: 33 x 45 x 80 = 118,800 video tokens). Video and text tokens are both split (joint attention)."""
    p, pt = config.get("patch_size", 2), config.get("patch_size_t", 1)
    lh, lw = spatial_latent(height, width, 8 * p, f"HunyuanVideo (8x VAE, {p}x{p} patches)")
    latent_frames = temporal_latent(frames, 4, "HunyuanVideo's 4x temporal VAE")
    video = (latent_frames // pt) * (lh // p) * (lw // p)
    return Layout(video, text_tokens, video + text_tokens, (config.get("in_channels", 16), latent_frames, lh, lw))


# -- synthetic architectures ---------------------------------------------------------------------------------
#: HunyuanVideo's prompt template (the pipeline's default) cut into words and the special tokens of the Llama 3 chat
#: format, so the synthetic tokenizer reads the template in whole words (98 tokens before the prompt; the pipeline
#: crops the first 95)
_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_TEMPLATE = (
    "system Describe the video by detailing the following aspects: 1. The main content and theme of the video. 2. The "
    "color, shape, size, texture, quantity, text, and spatial relationships of the objects. 3. Actions, events, "
    "behaviors temporal relationships, physical movement changes of the objects. 4. background environment, light, "
    "style and atmosphere. 5. camera angles, movements, and transitions used in the video user"
)
#: words of short prompts the synthetic tokenizer also knows whole
_PROMPT_WORDS = "a an on in at under over red green blue yellow white black big small circle square field sun noon cat"


def llama3_tokenizer(text: str, specials: tuple[str, ...]):
    """A byte-level BPE tokenizer like Llama 3's, trained here on ``text`` until each of its words is one token (with
    and without the leading space), knowing ``specials`` (the first begins a text, the second ends and pads it).
    Training, not hand-written merges: BPE applies merges by rank over every word, so only a trained list keeps each
    word whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text, text], trainer)  # every word twice, so every pair of a word is worth merging
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=specials[0], eos_token=specials[1],
                                   pad_token=specials[1], additional_special_tokens=list(specials[2:]))


HUNYUAN_VIDEO = SynthArch(
    name="hunyuan-video",
    description="HunyuanVideo (13B) transformer (20 dual + 40 single blocks, 24 heads x 128, 2 refiner blocks), "
                "full HunyuanVideo VAE, a two-layer Llama text encoder (4096 wide) and CLIP-L",
    pipeline="HunyuanVideoPipeline",
    transformer_class="HunyuanVideoTransformer3DModel",
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=[16, 56, 56]),
    vae=dict(latent_channels=16, scaling_factor=0.476986),  # AutoencoderKLHunyuanVideo's defaults otherwise
    clip=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=12, projection_dim=768),
    # the Llava-Llama-3 text model's width; the pipeline reads the third hidden state from the end
    t5=dict(hidden_size=4096, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8),
    scheduler=dict(shift=7.0),
    default_dtype="bfloat16",
    default_size=(720, 1280),
    max_sequence_length=256,
    default_frames=129,
)

#: diffusers' test configuration (tests/pipelines/hunyuan_video) with 4 heads of 16 (tp 2 and 4 divide them) and
#: HunyuanVideo's 2x2 patches
HUNYUAN_VIDEO_TINY = dataclasses.replace(
    HUNYUAN_VIDEO,
    name="hunyuan-video-tiny",
    description="HunyuanVideo architecture shrunk for CPU tests: 2 dual + 2 single blocks, 1 refiner block, "
                "4 heads x 16, a tiny HunyuanVideo VAE, Llama and CLIP",
    transformer=dict(HUNYUAN_VIDEO.transformer, in_channels=4, out_channels=4, num_attention_heads=4,
                     attention_head_dim=16, num_layers=2, num_single_layers=2, num_refiner_layers=1, text_embed_dim=32,
                     pooled_projection_dim=32, rope_axes_dim=[4, 6, 6]),
    vae=dict(latent_channels=4, down_block_types=["HunyuanVideoDownBlock3D"] * 4,
             up_block_types=["HunyuanVideoUpBlock3D"] * 4, block_out_channels=[8, 8, 8, 8], layers_per_block=1,
             norm_num_groups=4, scaling_factor=0.476986),
    clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, projection_dim=32),
    t5=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
    default_frames=5,
)


def hunyuan_video_components(arch: SynthArch, kit) -> dict:
    """HunyuanVideoPipeline's other components: AutoencoderKLHunyuanVideo, a Llama text model (``arch.t5``) with a
    locally trained byte-level BPE tokenizer (as Llama 3's) that knows the prompt template's words and specials, and CLIP-L (pooled)."""
    import diffusers
    import transformers

    tokenizer = llama3_tokenizer(f"{_TEMPLATE} {_PROMPT_WORDS}", _SPECIALS)
    llama = transformers.LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                     max_position_embeddings=1024, **arch.t5)
    clip_tok = kit.clip_tokenizer()
    return dict(vae=kit.make(diffusers.AutoencoderKLHunyuanVideo, arch.vae, 1),
                text_encoder=kit.make(transformers.LlamaModel, llama, 3), tokenizer=tokenizer,
                text_encoder_2=kit.make(transformers.CLIPTextModel, kit.clip_config(clip_tok, arch.clip), 2),
                tokenizer_2=clip_tok)


HUNYUAN_VIDEO_ADAPTER = register(
    ModelAdapter(
        name="hunyuan-video",
        class_names=("HunyuanVideoTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video", "text"),
            inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            outputs={"rope": {0: Split(dim=0, stream="video", ndim=2), 1: Split(dim=0, stream="video", ndim=2)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")),
        sequence_processor=HunyuanVideoSequenceParallelProcessor,
        whole_attention=AttentionSelector(paths=("context_embedder.token_refiner.refiner_blocks.*.attn",)),
        # no streams declared: PipeFusion's attention takes no key mask, and every HunyuanVideo attention has one
        # (``unsupported`` says so for pp > 1); step caches need none
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states")),
                BlockList("single_transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states"), packed=("hidden_states", "encoder_hidden_states"))),
        token_wise=("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
        modulated_input=norm1_modulated_input,
        example_inputs=hunyuan_video_example_inputs,
        layout=hunyuan_video_layout,
        text_tokens=256,  # the Llama prompt, padded to max_sequence_length (256) after the template is cropped
        tensor_plan=FLUX_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                      "pooled_projections", "guidance"),
        cfg_mode="sequential",  # true CFG: the prompt's call, then the negative prompt's
        cfg_switch="true_cfg_scale",  # guidance_scale is the distilled guidance, an input of one call
        cfg_hint="a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt ' ' --true-cfg-scale 6)",
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        frame_step=4,  # the HunyuanVideo VAE compresses time 4x: 4k+1 frames
        fps=24,
        pipelines=("HunyuanVideoPipeline",),
        synth_archs=(HUNYUAN_VIDEO, HUNYUAN_VIDEO_TINY),
        synth_components=hunyuan_video_components,
        unsupported=hunyuan_video_unsupported,
    )
)
