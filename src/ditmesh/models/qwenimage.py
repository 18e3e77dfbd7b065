"""QwenImage (``QwenImageTransformer2DModel``, ``QwenImagePipeline``): joint text+image attention in dual-stream
blocks, separate RoPE tables for text and image, and a mask over padded text.

Where the tokens are: ``forward`` embeds the image tokens (``img_in``) and the text (``txt_norm``, ``txt_in``) on
the full sequences, builds the image and text RoPE tables from ``img_shapes`` and the text length (``pos_embed``
returns ``(image table, text table)``; the text table starts after the largest image position), and runs the
blocks. The sequence plan (diffusers' ``_cp_plan`` with streams) splits

- both RoPE tables at ``pos_embed``'s output, each with its stream, so every rank rotates its tokens with their
  global positions;
- the image (``hidden_states``) and text (``encoder_hidden_states``) tokens at the input of ``transformer_blocks.0``;
- ``modulate_index`` (which image tokens are the condition image's, in the edit checkpoints with ``zero_cond_t``)
  at every block's input, with the image stream;

and gathers ``proj_out``'s output. The text stays whole up to the first block because ``forward`` reads its length
for the text RoPE table and checks the mask against it.

Mask. ``QwenImagePipeline`` pads the prompts of a batch to the longest and passes ``encoder_hidden_states_mask``
``[B, text]`` (None when nothing is padded); diffusers' processor extends it with ones over the image keys. Here
it stays whole on every rank (``SequencePlan.whole``; diffusers' plan splits it) and the processor extends it over
the global image length and hands it to ``sp.attention``, which reorders it like the keys.

Tensor plan: diffusers' ``_tp_plan`` (Q/K/V of both streams and both MLPs' first linears column-parallel; both
attention outputs and both MLPs' second linears row-parallel: 4 all-reduces per block), with the head counts
divided. CFG: true CFG with a negative prompt, two transformer calls per step (sequential).

This file is everything ditmesh knows about QwenImage: the plans, the processor, the blocks, example inputs, the
planner's layout and the synthetic architectures (with a locally built Qwen2 tokenizer and Qwen2.5-VL encoder).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.autoencoders import autoencoder_kl_qwenimage
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .wan import WAN_VAE_PLAN, causal_conv_padding


class QwenImageSequenceParallelProcessor:
    """Attention processor for QwenImage's joint attention whose core attention runs sequence-parallel.

    Projections, QK-norms and the two RoPE tables are applied to the local tokens as diffusers'
    ``QwenDoubleStreamAttnProcessor2_0`` does; the softmax attention over ``[text, image]`` goes through
    ``sp.attention`` with the text mask extended over every image key (global order).
    """

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("QwenImage's joint attention takes the text stream and encoder_hidden_states_mask, "
                             "not an attention_mask")
        head_dim = attn.inner_dim // attn.heads  # unchanged by tensor parallelism, which divides both

        def heads(linear, x):
            return linear(x).unflatten(-1, (-1, head_dim))

        q, k, v = heads(attn.to_q, hidden_states), heads(attn.to_k, hidden_states), heads(attn.to_v, hidden_states)
        eq, ek, ev = (heads(attn.add_q_proj, encoder_hidden_states), heads(attn.add_k_proj, encoder_hidden_states),
                      heads(attn.add_v_proj, encoder_hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        if image_rotary_emb is not None:
            image_freqs, text_freqs = image_rotary_emb
            q, k = (apply_rotary_emb_qwen(t, image_freqs, use_real=False) for t in (q, k))
            eq, ek = (apply_rotary_emb_qwen(t, text_freqs, use_real=False) for t in (eq, ek))
        mask = None
        if encoder_hidden_states_mask is not None:  # key padding over [text, image], global order
            image = encoder_hidden_states_mask.new_ones(hidden_states.shape[0], self.sp.stream_length("image"))
            mask = torch.cat([encoder_hidden_states_mask, image], dim=1)

        out = self.sp.attention(torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1),
                                backend=self._attention_backend, mask=mask)
        out = out.flatten(2, 3).to(q.dtype)
        text_out, image_out = out.split_with_sizes([eq.shape[1], q.shape[1]], dim=1)
        image_out = attn.to_out[0](image_out.contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(text_out.contiguous())


def qwenimage_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one QwenImagePipeline denoising step (random latents and text embeddings). One prompt
    per sample of equal length, so no mask (the pipeline passes none when nothing is padded)."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=rand(batch, h * w, cfg.in_channels),
        encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
        encoder_hidden_states_mask=None,
        timestep=torch.full((batch,), 0.7).to(device, dtype),
        guidance=torch.full((batch,), 3.5).to(device, dtype) if cfg.guidance_embeds else None,
        img_shapes=[[(1, h, w)]] * batch,
        return_dict=False,
    )


def qwenimage_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a QwenImagePipeline call: the VAE divides by 8, then 2x2 latent patches become one token
    (1328x1328: 83 x 83 = 6,889 image tokens)."""
    lh, lw = spatial_latent(height, width, 16, "QwenImage (8x VAE, 2x2 packing)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (image, config.get("in_channels", 64)))


def qwenimage_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first block's modulated image stream: ``img_norm1`` shifted and scaled by the first half of ``img_mod``."""
    shift_scale_gate = block.img_mod(named["temb"]).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(named["hidden_states"]), shift_scale_gate, named.get("modulate_index"))[0]


#: diffusers' ``_tp_plan``; ``inner_dim`` is divided with ``heads`` so that ``inner_dim // heads`` stays the head dim
QWENIMAGE_TENSOR_PLAN = TensorPlan(
    colwise=(
        "transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v",
        "transformer_blocks.*.attn.add_q_proj", "transformer_blocks.*.attn.add_k_proj",
        "transformer_blocks.*.attn.add_v_proj",
        "transformer_blocks.*.img_mlp.net.0.proj", "transformer_blocks.*.txt_mlp.net.0.proj",
    ),
    rowwise=(
        "transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.attn.to_add_out",
        "transformer_blocks.*.img_mlp.net.2", "transformer_blocks.*.txt_mlp.net.2",
    ),
    per_rank_attrs={"transformer_blocks.*.attn": ("heads", "inner_dim")},
)


#: The QwenImage VAE (Wan 2.1's causal 3-D VAE under its own class names, one frame per image) split along height as
#: Wan's: frames whole, each rank's temporal cache holding its own rows, the mid-block attention on the gathered rows.
QWENIMAGE_VAE_PLAN = dataclasses.replace(
    WAN_VAE_PLAN,
    class_names=("AutoencoderKLQwenImage",),
    gathered=("QwenImageAttentionBlock",),
    conv_padding=causal_conv_padding(autoencoder_kl_qwenimage.QwenImageCausalConv3d),
)


# -- synthetic architectures ---------------------------------------------------------------------------------
#: QwenImage's scheduler (Qwen/Qwen-Image ``scheduler_config.json``)
QWENIMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)

#: the words of the pipeline's prompt template, so the synthetic tokenizer reads it in whole words
_TEMPLATE_WORDS = ("describe", "detailing", "color", "size", "texture", "quantity", "text", "spatial",
                   "relationships", "objects", "system", "user", "assistant")

QWENIMAGE = SynthArch(
    name="qwenimage",
    description="QwenImage (20B) transformer (60 dual-stream blocks, 24 heads x 128, text width 3584), full VAE, "
                "a one-layer Qwen2.5-VL text encoder",
    pipeline="QwenImagePipeline",
    transformer_class="QwenImageTransformer2DModel",
    transformer=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                     axes_dims_rope=[16, 56, 56]),
    vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]),
    clip={},
    # the Qwen2.5-VL text model (``t5``: the family's text encoder) and its vision tower
    t5=dict(text=dict(hidden_size=3584, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=28,
                      num_key_value_heads=4, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                           "type": "default"}, rope_theta=1000000.0),
            vision=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=3584)),
    scheduler=QWENIMAGE_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1328, 1328),
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/pipelines/qwenimage), with 4 heads so that tp 2 and 4 divide them
QWENIMAGE_TINY = dataclasses.replace(
    QWENIMAGE,
    name="qwenimage-tiny",
    description="QwenImage architecture shrunk for CPU tests: 2 blocks, 4 heads x 16, a small VAE and text encoder",
    transformer=dict(QWENIMAGE.transformer, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                     num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=[8, 4, 4]),
    vae=dict(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
             latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
    t5=dict(text=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default",
                                                         "type": "default"}, rope_theta=1000000.0),
            vision=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=64,
)


def qwenimage_components(arch: SynthArch, kit) -> dict:
    """QwenImagePipeline's other components: the QwenImage VAE, a Qwen2.5-VL text encoder (``arch.t5``) and a
    byte-level BPE Qwen2 tokenizer built locally, knowing the chat template's special tokens."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKLQwenImage, arch.vae, 1), **qwen25vl_text_encoder(arch, kit))


#: Qwen's chat template: each message between ``<|im_start|>role`` and ``<|im_end|>``, its content a string or a list
#: of parts whose text parts are joined (EasyAnimate's messages)
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_tokenizer(kit):
    """A byte-level BPE Qwen2 tokenizer built locally: ``<|endoftext|>`` (its pad and end token), the chat template's
    special tokens, the words of Qwen-Image's prompt template whole, and :data:`QWEN_CHAT_TEMPLATE`."""
    import transformers

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    vocab, merges = kit.byte_bpe(specials, _TEMPLATE_WORDS)
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def qwen3vl_sizes(hidden_size: int, layers: int, head_dim: int, mrope_section: list[int], heads: int = 2,
                  kv_heads: int = 1, intermediate_size: int = 64) -> dict:
    """``arch.t5`` of a synthetic Qwen3-VL: a text model ``hidden_size`` wide outside and narrow inside (``heads`` of
    ``head_dim``, interleaved multimodal RoPE in ``mrope_section``), and a one-block vision tower the text-to-image
    pipelines (Krea 2, Ideogram 4) never call."""
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": mrope_section, "mrope_interleaved": True}
    return dict(text=dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                          rope_parameters=rope),
                vision=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden_size,
                            deepstack_visual_indexes=[]))


def qwen3vl_text_encoder(arch: SynthArch, kit, model: str = "Qwen3VLModel", tokenizer=None) -> dict:
    """``text_encoder`` (a ``Qwen3VLModel`` of ``arch.t5``'s sizes, :func:`qwen3vl_sizes`; ``model``: another
    transformers class of that config, such as ``Qwen3VLForConditionalGeneration``) and ``tokenizer``
    (:func:`qwen_tokenizer`, or the one given: the ids of the vision markers it knows go to the config), as Krea 2's,
    Ideogram 4's, JoyImage-Edit's and Nucleus-MoE's pipelines take them."""
    import transformers

    tokenizer = tokenizer or qwen_tokenizer(kit)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    known = tokenizer.get_vocab()
    markers = {f"{field}_token_id": known[token] for field, token in QWEN3VL_MARKERS.items() if token in known}
    config = transformers.Qwen3VLConfig(text_config=dict(arch.t5["text"], **ids), vision_config=arch.t5["vision"],
                                        **markers)
    return dict(text_encoder=kit.make(getattr(transformers, model), config, 3), tokenizer=tokenizer)


#: the vision markers a Qwen3-VL processor writes into the text, by the config field holding each one's id
QWEN3VL_MARKERS = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image": "<|image_pad|>",
                   "video": "<|video_pad|>"}


def qwen3vl_processor(arch: SynthArch, kit) -> dict:
    """``text_encoder`` (a ``Qwen3VLForConditionalGeneration``, :func:`qwen3vl_text_encoder`), ``tokenizer`` (the
    local one, knowing the vision markers too) and ``processor``: a ``Qwen3VLProcessor`` over that tokenizer with
    Qwen3-VL's image processor (16-pixel patches merged 2 x 2: one vision token per 32 x 32 pixels, as the pipelines
    lay out 2 x 2 latent tokens of a 16x VAE per slot) and its video processor, which needs torchvision; as
    Qwen-Image 2.1's and JoyImage-Edit's pipelines take them for condition images."""
    import transformers

    tokenizer = qwen_tokenizer(kit)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                                *QWEN3VL_MARKERS.values()]})
    encoder = qwen3vl_text_encoder(arch, kit, "Qwen3VLForConditionalGeneration", tokenizer)
    patches = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    # Qwen3-VL's pixel bounds (its preprocessor_config.json): a 1024 x 1024 condition image keeps its size
    image_processor = transformers.Qwen2VLImageProcessor(size=dict(shortest_edge=65536, longest_edge=16777216), **patches)
    processor = transformers.Qwen3VLProcessor(image_processor=image_processor,
                                              video_processor=transformers.Qwen3VLVideoProcessor(**patches),
                                              tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE)
    return dict(encoder, processor=processor)


def qwen25vl_text_encoder(arch: SynthArch, kit, generation: str = "Qwen2_5_VL") -> dict:
    """``text_encoder`` (a Qwen2.5-VL of ``arch.t5``'s text and vision sizes; ``generation="Qwen2VL"``: a Qwen2-VL,
    whose vision config has other fields) and ``tokenizer`` (a byte-level BPE Qwen2 tokenizer built locally, knowing
    the chat template's special tokens, with :data:`QWEN_CHAT_TEMPLATE`), as QwenImage's, LongCat-Image's and
    EasyAnimate's pipelines take them."""
    import transformers

    tokenizer = qwen_tokenizer(kit)
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
               pad_token_id=tokenizer.pad_token_id)
    config = getattr(transformers, f"{generation}Config")(
        text_config=dict(arch.t5["text"], **ids), vision_config=arch.t5["vision"],
        hidden_size=arch.t5["text"]["hidden_size"], **ids)
    model = getattr(transformers, f"{generation}ForConditionalGeneration")
    return dict(text_encoder=kit.make(model, config, 3), tokenizer=tokenizer)


QWENIMAGE_ADAPTER = register(
    ModelAdapter(
        name="qwenimage",
        class_names=("QwenImageTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("text", "image"),
            inputs={
                "transformer_blocks.0": {"hidden_states": Split(dim=1, stream="image", ndim=3),
                                         "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)},
                "transformer_blocks.*": {"modulate_index": Split(dim=1, stream="image", ndim=2)},
            },
            outputs={"pos_embed": {0: Split(dim=0, stream="image", ndim=2), 1: Split(dim=0, stream="text", ndim=2)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
            whole=("encoder_hidden_states_mask",),
            differs_from_cp_plan="the same split and gather points, with text and image streams cut on their own (any "
                                 "token count: 1328^2 has 6,889 image tokens); the text mask stays whole on every "
                                 "rank and is reordered like the keys instead of being split",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn",)),
        sequence_processor=QwenImageSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("encoder_hidden_states", "hidden_states")),),
        token_wise=("transformer_blocks.*.img_mlp", "transformer_blocks.*.txt_mlp"),
        modulated_input=qwenimage_modulated_input,
        example_inputs=qwenimage_example_inputs,
        layout=qwenimage_layout,
        # the pipeline feeds the prompt's own length, padded to the batch's longest and cut at max_sequence_length
        # (512 by default): the planner and the benchmark take that cap
        text_tokens=512,
        tensor_plan=QWENIMAGE_TENSOR_PLAN,
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "guidance"),
        cfg_mode="sequential",  # true CFG: the prompt's call, then the negative prompt's
        cfg_switch="true_cfg_scale",
        cfg_hint="a negative prompt with --true-cfg-scale > 1 (e.g. --negative-prompt ' ' --true-cfg-scale 4)",
        output_channel_dim=-1,
        out_channels=lambda model: model.proj_out.out_features,
        pipelines=("QwenImagePipeline",),
        synth_archs=(QWENIMAGE_TINY, QWENIMAGE),
        synth_components=qwenimage_components,
        vae=QWENIMAGE_VAE_PLAN,
    )
)
