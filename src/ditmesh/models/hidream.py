"""HiDream-I1 (``HiDreamImageTransformer2DModel``, ``HiDreamImagePipeline``): double-stream then single-stream blocks
over the image, T5 and Llama-3.1 states, with a fresh Llama layer's states appended at every block.

Where the tokens are: ``forward`` patchifies a square latent inside (``[B, C, H, W]``); a non-square one is padded to
``max_seq`` image tokens (``max_resolution``) with ``hidden_states_masks``, which multiplies the image keys (zero keys
for the padding). ``encoder_hidden_states_llama3`` stacks the Llama layers' states ``[layers, B, L, D]``;
``llama_layers`` picks one layer per block. Every double block attends over ``[image, t5, llama(last), llama(this
block)]`` and the model cuts the block's text output back to ``[t5, llama(last)]``; the single blocks take ``[image,
t5, llama(last)]`` joined, append the block's Llama states and are cut back after each block. The RoPE ids are the
image's positions followed by zeros for every text token (identity rotation on text).

Sequence plan (diffusers has no ``_cp_plan`` for the class). Each rank holds its chunk of every stream:

- the T5 states (``t5``) and the whole Llama stack (``llama``, along its token dim 2) at the entry, so every caption
  projection, the block's appended Llama states and the model's truncations (which read local lengths) work on the
  local chunks;
- the image tokens at ``x_embedder``'s output, and ``hidden_states_masks`` with them at every block's input (the
  single blocks' mask is the image mask followed by ones over the local text: ``Split.leading``);
- the RoPE ids at ``pe_embedder``'s input: the image ids (built whole) cut with the image, the text zeros (built at
  the local text length) kept;

and gathers ``final_layer``'s output before unpatchify. The attention runs over ``(image, t5, llama, llama)`` (the
block's Llama states are a chunk of the ``llama`` stream's size). Non-square sizes are exact: the mask multiplies each
rank's own keys, a token-local product, so the padded keys take part in the softmax as on one process.

Tensor plan: Q/K/V of both streams column-parallel with their RMS QK-norms over all heads sharded (one all-reduce of
``[..., 1]`` each), both attention outputs row-parallel; every SwiGLU (the text MLP, each routed expert and the
shared expert of the MoE) ``w1``/``w3`` column- and ``w2`` row-parallel. The router runs on the replicated tokens, so
every tp rank routes alike; an expert no token chose runs nowhere, so a block's all-reduces are 1 per expert that
ran (every expert at real sizes) plus the fixed ones. CFG: ``HiDreamImagePipeline`` runs ``[uncond, cond]`` in one
call (batched); the Llama stack carries the batch in dim 1 (``batch_dims``).

Blocks: the double blocks carry the image and the text ``[t5, llama(last), llama(this block)]``; the single blocks
carry the joined sequence (``joins``), so a step cache's residual spans both lists. PipeFusion does not apply: the
lists pass different activations (``check_blocks`` says so).

This file is everything ditmesh knows about HiDream: the plans, the processor, the blocks, example inputs, the
planner's layout and the synthetic architectures (CLIP-L/G with HiDream's 248 positions, T5, a Llama with a locally
built byte-level BPE tokenizer).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_hidream_image import apply_rope

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import FLUX_VAE, KL_VAE_PLAN

#: the streams of every HiDream attention, in the model's order: the block's own Llama states are a second chunk of
#: the ``llama`` stream's size
ATTENTION_STREAMS = ("image", "t5", "llama", "llama")


class HiDreamSequenceParallelProcessor:
    """Attention processor for HiDream's double- and single-stream attention whose core attention runs
    sequence-parallel: projections, QK-norms, the key mask and RoPE as diffusers' ``HiDreamAttnProcessor`` on the local
    tokens, the softmax attention through ``sp.attention``."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, hidden_states_masks=None, encoder_hidden_states=None,
                 image_rotary_emb=None, *args, **kwargs):
        dtype, batch = hidden_states.dtype, hidden_states.shape[0]
        head_dim = attn.to_k.out_features // attn.heads  # unchanged by tensor parallelism, which divides both

        def heads(x):
            return x.view(batch, -1, attn.heads, head_dim)

        query = heads(attn.q_rms_norm(attn.to_q(hidden_states)).to(dtype))
        key = heads(attn.k_rms_norm(attn.to_k(hidden_states)).to(dtype))
        value = heads(attn.to_v(hidden_states))
        if hidden_states_masks is not None:  # zero keys for the padded image tokens (this rank's share of the mask)
            key = key * hidden_states_masks.view(batch, -1, 1, 1)
        image_tokens = query.shape[1]
        if not attn.single:
            query = torch.cat([query, heads(attn.q_rms_norm_t(attn.to_q_t(encoder_hidden_states)).to(dtype))], dim=1)
            key = torch.cat([key, heads(attn.k_rms_norm_t(attn.to_k_t(encoder_hidden_states)).to(dtype))], dim=1)
            value = torch.cat([value, heads(attn.to_v_t(encoder_hidden_states))], dim=1)
        if query.shape[-1] == image_rotary_emb.shape[-3] * 2:
            query, key = apply_rope(query, key, image_rotary_emb)
        else:  # RoPE on the first half of each head
            (q1, q2), (k1, k2) = query.chunk(2, dim=-1), key.chunk(2, dim=-1)
            q1, k1 = apply_rope(q1, k1, image_rotary_emb)
            query, key = torch.cat([q1, q2], dim=-1), torch.cat([k1, k2], dim=-1)

        out = self.sp.attention(query, key, value, backend=self._attention_backend, streams=ATTENTION_STREAMS)
        out = out.flatten(2, 3).to(query.dtype)
        if attn.single:
            return attn.to_out(out)
        image_out, text_out = out.split_with_sizes([image_tokens, out.shape[1] - image_tokens], dim=1)
        return attn.to_out(image_out.contiguous()), attn.to_out_t(text_out.contiguous())


def hidream_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one HiDreamImagePipeline denoising step: a square latent (the model patchifies it; a
    non-square one is padded to ``max_seq`` tokens), T5 states and the Llama stack of ``text_len`` tokens each."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    t5_width, llama_width = cfg.caption_channels
    return dict(
        hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
        timesteps=torch.full((batch,), 700.0).to(device, dtype),
        encoder_hidden_states_t5=rand(batch, text_len, t5_width),
        encoder_hidden_states_llama3=rand(max(cfg.llama_layers) + 1, batch, text_len, llama_width),
        pooled_embeds=rand(batch, cfg.text_emb_dim),
        return_dict=False,
    )


def hidream_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a HiDreamImagePipeline call: the VAE divides by 8, then 2x2 patches; a non-square latent is
    padded to ``max_seq`` tokens (128 x 128 latent / 4 = 4,096 for HiDream-I1). ``text_tokens`` T5 tokens and as many
    Llama tokens twice (the last layer's and the block's) join every attention."""
    lh, lw = spatial_latent(height, width, 16, "HiDream (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    if lh != lw:
        resolution = config.get("max_resolution", (128, 128))
        image = resolution[0] * resolution[1] // 4
    text = 3 * text_tokens
    return Layout(image, text, image + text, (config.get("in_channels", 16), lh, lw))


def hidream_modulated_input(block: torch.nn.Module, named: dict) -> torch.Tensor:
    """The first double block's modulated image stream: ``norm1_i`` shifted and scaled by its AdaLN."""
    inner = block.block
    shift, scale = inner.adaLN_modulation(named["temb"])[:, None].chunk(12, dim=-1)[:2]
    return inner.norm1_i(named["hidden_states"]) * (1 + scale) + shift


def _average_moe_forward(moe: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The cost of an MoE feed-forward call without its data-dependent routing: the router and the shared expert on
    every token, and ``num_activated_experts`` routed experts on every token (each token runs that many). The
    output is the shared expert's: only shapes and FLOPs matter on the meta device."""
    moe.gate(x)
    for expert in list(moe.experts)[: moe.num_activated_experts]:
        expert(x)
    return moe.shared_experts(x)


def hidream_meta_trace(model: torch.nn.Module):
    """Give every MoE feed-forward of ``model`` :func:`_average_moe_forward` (its routing counts tokens per expert on
    the host, which the meta device cannot) and make ``unpatchify``, which reads the patch grid's size from a tensor,
    return the tokens as they are; returns the undo callable."""
    import types

    moes = [m for m in model.modules() if hasattr(m, "moe_infer")]
    for moe in moes:
        moe.forward = types.MethodType(_average_moe_forward, moe)
    model.unpatchify = lambda tokens, img_sizes, is_training: tokens

    def undo() -> None:
        for moe in moes:
            del moe.forward
        del model.unpatchify

    return undo


def _swiglu(prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(column-parallel, row-parallel) patterns of the SwiGLU feed-forward at ``prefix``."""
    return (f"{prefix}.w1", f"{prefix}.w3"), (f"{prefix}.w2",)


def _tensor_plan() -> TensorPlan:
    colwise, rowwise, norms = [], [], []
    for blocks, text in (("double_stream_blocks", True), ("single_stream_blocks", False)):
        attn = f"{blocks}.*.block.attn1"
        suffixes = ("", "_t") if text else ("",)
        for t in suffixes:
            colwise += [f"{attn}.to_q{t}", f"{attn}.to_k{t}", f"{attn}.to_v{t}"]
            rowwise.append(f"{attn}.to_out{t}")
            norms += [f"{attn}.q_rms_norm{t}", f"{attn}.k_rms_norm{t}"]
        ffs = [f"{blocks}.*.block.ff_i.experts.*", f"{blocks}.*.block.ff_i.shared_experts"]
        ffs += [f"{blocks}.*.block.ff_t"] if text else []
        for ff in ffs:
            col, row = _swiglu(ff)
            colwise += col
            rowwise += row
    return TensorPlan(colwise=tuple(colwise), rowwise=tuple(rowwise), sharded_norms=tuple(norms),
                      per_rank_attrs={"double_stream_blocks.*.block.attn1": ("heads", "inner_dim"),
                                      "single_stream_blocks.*.block.attn1": ("heads", "inner_dim")})


#: Megatron-style plan of the attentions and every SwiGLU (routed experts, shared expert, text MLP); the MoE router,
#: AdaLN, embedders, caption projections and the final layer stay replicated
HIDREAM_TENSOR_PLAN = _tensor_plan()


# -- synthetic architectures ---------------------------------------------------------------------------------
#: HiDream-I1-Dev's scheduler (flow matching, shift 6, no dynamic shifting)
HIDREAM_SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)

HIDREAM_I1 = SynthArch(
    name="hidream-i1",
    description="HiDream-I1 (17B) transformer (16 double + 32 single blocks, 20 heads x 128, MoE 4 routed experts, "
                "2 active), FLUX's VAE, one-layer CLIP-L/G and T5, a 32-layer Llama of width 4096 (narrow layers)",
    pipeline="HiDreamImagePipeline",
    transformer_class="HiDreamImageTransformer2DModel",
    transformer=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                     attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
                     num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[64, 32, 32],
                     max_resolution=[128, 128], llama_layers=list(range(32)) + [31] * 16),
    vae=FLUX_VAE,
    # CLIP-L (pooled 768) + CLIP-G (pooled 1280) = text_emb_dim 2048, with HiDream's 248 positions
    clip=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=12, projection_dim=768),
    clip_2=dict(hidden_size=1280, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=20,
                projection_dim=1280),
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
    # the Llama-3.1-8B text model's width and depth (every one of its 32 layers' states is read), narrow layers
    extra=dict(llama=dict(hidden_size=4096, intermediate_size=256, num_hidden_layers=32, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64)),
    scheduler=HIDREAM_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=128,
)

#: diffusers' test configuration (tests/pipelines/hidream_image) with 2 + 2 blocks and 4 heads of 16 (tp 2 and 4 divide
#: them), RoPE over the whole head, Llama layers picked with a repeat as in the real list
HIDREAM_TINY = dataclasses.replace(
    HIDREAM_I1,
    name="hidream-tiny",
    description="HiDream-I1 architecture shrunk for CPU tests: 2 double + 2 single blocks, 4 heads x 16, MoE 4/2",
    transformer=dict(HIDREAM_I1.transformer, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
                     attention_head_dim=16, num_attention_heads=4, caption_channels=[32, 16], text_emb_dim=32,
                     axes_dims_rope=[8, 4, 4], max_resolution=[16, 16], llama_layers=[0, 1, 1, 1]),
    vae=dict(FLUX_VAE, latent_channels=4, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8,
             sample_size=64),
    clip=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, projection_dim=16),
    clip_2=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, projection_dim=16),
    t5=dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    extra=dict(llama=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8)),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)

#: CLIP's positions in HiDream (the pipeline pads CLIP prompts to min(max_sequence_length, 218) tokens)
CLIP_POSITIONS = 248


def _llama_tokenizer(kit, max_length: int):
    """A Llama-3-style byte-level BPE tokenizer (``PreTrainedTokenizerFast``) that starts every prompt with
    ``<|begin_of_text|>``; the pipeline pads with its end token."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ("<|begin_of_text|>", "<|end_of_text|>")
    vocab, merges = kit.byte_bpe(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A", special_tokens=[(specials[0], 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                                                pad_token=specials[1], model_max_length=max_length)


def hidream_components(arch: SynthArch, kit) -> dict:
    """HiDreamImagePipeline's other components: AutoencoderKL, CLIP-L and CLIP-G with projections (248 positions),
    T5 and a Llama (``arch.extra["llama"]``) with its tokenizer."""
    import diffusers
    import transformers

    clip_tok, t5_tok = kit.clip_tokenizer(), kit.t5_tokenizer(arch.max_sequence_length)
    clip_tok.model_max_length = CLIP_POSITIONS
    llama_tok = _llama_tokenizer(kit, arch.max_sequence_length)

    def clip_config(cfg):
        return transformers.CLIPTextConfig(vocab_size=len(clip_tok), max_position_embeddings=CLIP_POSITIONS,
                                           bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                                           pad_token_id=clip_tok.pad_token_id, **cfg)

    llama = transformers.LlamaConfig(vocab_size=len(llama_tok), bos_token_id=llama_tok.bos_token_id,
                                     eos_token_id=llama_tok.eos_token_id, pad_token_id=llama_tok.pad_token_id,
                                     attn_implementation="eager", **arch.extra["llama"])
    clip = transformers.CLIPTextModelWithProjection
    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                text_encoder=kit.make(clip, clip_config(arch.clip), 2), tokenizer=clip_tok,
                text_encoder_2=kit.make(clip, clip_config(arch.clip_2), 4), tokenizer_2=clip_tok,
                text_encoder_3=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer_3=t5_tok,
                text_encoder_4=kit.make(transformers.LlamaForCausalLM, llama, 6), tokenizer_4=llama_tok)


HIDREAM = register(
    ModelAdapter(
        name="hidream",
        class_names=("HiDreamImageTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image", "t5", "llama"),
            inputs={
                "": {"encoder_hidden_states_t5": Split(dim=1, stream="t5", ndim=3),
                     "encoder_hidden_states_llama3": Split(dim=2, stream="llama", ndim=4)},
                "pe_embedder": {"ids": Split(dim=1, stream="image", ndim=3, leading=True)},
                "double_stream_blocks.*": {"hidden_states_masks": Split(dim=1, stream="image", ndim=2)},
                "single_stream_blocks.*": {"hidden_states_masks": Split(dim=1, stream="image", ndim=2, leading=True)},
            },
            outputs={"x_embedder": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"final_layer": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the class has no _cp_plan: image, T5 and Llama states split as streams of their own",
        ),
        attention=AttentionSelector(class_names=("HiDreamAttention",)),
        sequence_processor=HiDreamSequenceParallelProcessor,
        blocks=(BlockList("double_stream_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states")),
                BlockList("single_stream_blocks", ("hidden_states",), ("hidden_states",),
                          joins=("hidden_states", "encoder_hidden_states"))),
        modulated_input=hidream_modulated_input,
        example_inputs=hidream_example_inputs,
        layout=hidream_layout,
        text_tokens=128,  # the pipeline's max_sequence_length: T5 and Llama each
        tensor_plan=HIDREAM_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timesteps", "encoder_hidden_states_t5", "encoder_hidden_states_llama3",
                      "pooled_embeds", "img_ids", "img_sizes", "hidden_states_masks"),
        batch_dims={"encoder_hidden_states_llama3": 1},
        cfg_mode="batched",  # HiDreamImagePipeline runs [uncond, cond] in one transformer call
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        pipelines=("HiDreamImagePipeline",),
        synth_archs=(HIDREAM_TINY, HIDREAM_I1),
        synth_components=hidream_components,
        vae=KL_VAE_PLAN,
        meta_trace=hidream_meta_trace,
        graph_refusal="its MoE feed-forward counts the tokens of each expert on the host in every call "
                      "(MOEFeedForwardSwiGLU.moe_infer)",
    )
)
