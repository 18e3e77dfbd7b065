"""Mochi 1 (``MochiTransformer3DModel``): joint attention of video and text tokens of different widths.

Where the tokens are: ``forward`` embeds the timestep and pools the caption (under its mask) in ``time_embed``, which
also projects the caption to ``pooled_projection_dim`` (1536, half the video width 3072); it patchifies each frame
(``patch_embed``), flattens to ``[B, N, D]`` video tokens, builds the RoPE table (``rope``: cos and sin
``[N, H, head_dim / 2]``), runs the blocks on ``(hidden_states, encoder_hidden_states)`` and unpatchifies after
``proj_out``. The plan splits the RoPE table at ``rope``'s output and both token streams where they enter
``transformer_blocks.0``, and gathers the video tokens at the output of ``proj_out``.

Attention (``MochiAttention``, one per block): video Q/K/V (``to_q`` ...) and text Q/K/V (``add_q_proj`` ...) have
their own projections and per-head RMS norms, RoPE rotates the video tokens only, and the attention runs over
``[video, text]``. diffusers' processor loops over the samples and keeps each sample's valid text tokens (the
caption's ``encoder_attention_mask``), leaving zeros at the padded text positions of the output. The sequence
processor runs all samples at once through ``sp.attention`` with the equivalent key-padding mask over the joint
sequence (every video key, the valid text keys: the caption mask after ``sp.stream_length("video")`` ones, in the
model's order, which sequence parallelism reorders like the keys) and zeroes the output of the padded text queries
(its rows of the caption mask). The pipeline's masks keep each caption's valid tokens first (T5's right padding),
which is the case the two formulations agree on: diffusers packs a sample's valid text outputs at the front of its
text rows.

The last block is ``context_pre_only`` (no text feed-forward, no ``to_add_out``): its text rows are computed and
dropped, as in the model.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, VaePlan, norm1_modulated_input, register, spatial_latent)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mochi's RoPE on ``[B, S, H, D]``: each (even, odd) channel pair rotated by its angle (``cos``/``sin``
    ``[S, H, D / 2]``, one entry per pair), in float32, back in ``x``'s dtype."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


class MochiSequenceParallelProcessor:
    """Processor for ``MochiAttention``: the joint ``[video, text]`` attention of all samples at once, sequence-parallel,
    under the key-padding mask of each sample's caption (module docstring). Projections, QK-norms and RoPE run on
    the local tokens; only the softmax attention goes through ``sp.attention``."""

    def __init__(self, sp, previous=None):
        self.sp = sp
        self.previous = previous

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None):
        def heads(t):
            return t.unflatten(2, (attn.heads, -1))

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        text = encoder_hidden_states
        tq, tk, tv = heads(attn.add_q_proj(text)), heads(attn.add_k_proj(text)), heads(attn.add_v_proj(text))
        tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
        if image_rotary_emb is not None:
            q, k = rotate_interleaved(q, *image_rotary_emb), rotate_interleaved(k, *image_rotary_emb)
        valid = attention_mask.bool()  # [B, T]: the caption's valid tokens, whole on every rank
        # the chunked local runtime (sequence degree 1) holds every token; the sequence-parallel one this rank's
        video = self.sp.stream_length("video") if hasattr(self.sp, "stream_length") else q.shape[1]
        local_valid = self.sp.split(valid, 1, "text") if hasattr(self.sp, "split") else valid
        mask = torch.cat([valid.new_ones(valid.shape[0], video), valid], dim=1)
        out = self.sp.attention(torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1), mask=mask)
        out = out.flatten(2, 3).type_as(q)
        out, text_out = out.split_with_sizes((q.shape[1], tq.shape[1]), dim=1)
        text_out = text_out * local_valid.unsqueeze(-1).to(text_out.dtype)  # the model's zeros at padded text
        out = attn.to_out[1](attn.to_out[0](out))
        if hasattr(attn, "to_add_out"):
            text_out = attn.to_add_out(text_out)
        return out, text_out


def mochi_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one MochiPipeline step: random latents and caption embeddings, and caption masks whose
    valid lengths differ per sample (right padding, as T5's tokenizer pads). ``frames`` (default 163) become
    ``(frames - 1) // 6 + 1`` latent frames (the Mochi VAE's 6x temporal compression); height and width shrink 8x."""
    cfg = model.config
    latent_frames = ((frames or 163) - 1) // 6 + 1
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    lengths = torch.tensor([max(1, text_len - 3 * i) for i in range(batch)])
    return dict(
        hidden_states=rand(batch, cfg.in_channels, latent_frames, height // 8, width // 8),
        encoder_hidden_states=rand(batch, text_len, cfg.text_embed_dim),
        timestep=torch.full((batch,), 700.0).to(device, dtype),
        encoder_attention_mask=(torch.arange(text_len)[None] < lengths[:, None]).long().to(device),
        return_dict=False,
    )


def mochi_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a MochiPipeline call: 8x spatial and 6x temporal VAE, then 2x2 patches per frame; the split
    sequence is the video tokens and the caption's (joint attention)."""
    p = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * p, "Mochi (8x VAE, 2x2 patches)")
    if frames < 1 or (frames - 1) % 6:
        raise ValueError(f"frames={frames} must be 6k+1 for Mochi's 6x temporal VAE; try {max(1, (frames - 1) // 6 * 6 + 1)}")
    latent_frames = (frames - 1) // 6 + 1
    video = latent_frames * (lh // p) * (lw // p)
    return Layout(video, text_tokens, video + text_tokens, (config.get("in_channels", 12), latent_frames, lh, lw))


#: Tensor plan. Video Q/K/V and text Q/K/V column-parallel, ``to_out.0`` and ``to_add_out`` (the text output,
#: back to 1536 wide) row-parallel; the SwiGLU feed-forwards' input linears (``ff.net.0.proj``: value and gate
#: halves side by side, each split on its own) column- and their output linears row-parallel. The QK-norms are per
#: head and need nothing. 4 all-reduces per block, 2 in the last (``context_pre_only``: no ``to_add_out``, no
#: ``ff_context``). The RoPE table holds a frequency per head (``pos_frequencies`` ``[3, H, head_dim / 2]``), so
#: each rank keeps its heads' part of ``rope``'s output. The modulation linears (``norm1``, ``norm1_context``), ``time_embed``, ``norm_out`` and
#: ``proj_out`` stay replicated.
_BLOCK = "transformer_blocks.*"
MOCHI_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"{_BLOCK}.attn1.{n}" for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")),
    rowwise=(f"{_BLOCK}.attn1.to_out.0", f"{_BLOCK}.attn1.to_add_out?", f"{_BLOCK}.ff.net.2",
             f"{_BLOCK}.ff_context.net.2?"),
    packed_colwise={f"{_BLOCK}.{ff}.net.0.proj{opt}": ("../2.in_features", "../2.in_features")
                    for ff, opt in (("ff", ""), ("ff_context", "?"))},
    per_rank_attrs={f"{_BLOCK}.attn1": ("heads",)},
    head_outputs={"rope": 1},  # the RoPE table's cos and sin [N, H, head_dim / 2]: each rank rotates its heads
)


def _replicate_padded(module):
    """``VaePlan.pre_padding`` of the Mochi VAE: its causal convolutions (CogVideoX's class) in ``replicate`` mode pad
    their input in ``forward`` (time in front, height and width replicating the edge rows) and run their inner
    ``conv`` unpadded: (that conv, its height padding on both sides)."""
    if type(module).__name__ == "CogVideoXCausalConv3d" and module.pad_mode == "replicate":
        return module.conv, (module.height_pad, module.height_pad)
    return None


#: The Mochi VAE split along height. Its causal convolutions replicate the edge rows (``pre_padding``): the image's
#: edges on the edge ranks, halo rows elsewhere; its group norms (per frame, in chunks of frames) are exact group
#: norms; its attentions run over the frames of one position (no rows mixed); its up-sampling is a per-position
#: linear followed by a depth-to-space reshape, which keeps each rank's rows together.
MOCHI_VAE_PLAN = VaePlan(
    class_names=("AutoencoderKLMochi",),
    spatial_factor=lambda vae: vae.spatial_compression_ratio,
    pre_padding=_replicate_padded,
)


# -- synthetic architectures ---------------------------------------------------------------------------------
MOCHI_1 = SynthArch(
    name="mochi-1",
    description="Mochi 1 preview transformer (48 blocks, 24 heads x 128, text stream 1536 wide), full Mochi VAE, "
                "a one-layer T5 of T5-XXL's width",
    pipeline="MochiPipeline",
    transformer_class="MochiTransformer3DModel",
    transformer=dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48,
                     pooled_projection_dim=1536, in_channels=12, qk_norm="rms_norm", text_embed_dim=4096,
                     time_embed_dim=256, activation_fn="swiglu", max_sequence_length=256),
    vae={},  # AutoencoderKLMochi's defaults are the Mochi 1 VAE
    clip={},
    t5=dict(d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8),
    # mochi-1-preview's scheduler: flow matching with inverted sigmas (the pipeline passes its own sigmas)
    scheduler=dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, invert_sigmas=True),
    default_dtype="bfloat16",
    default_size=(480, 848),
    max_sequence_length=256,
    default_frames=163,
)

MOCHI_TINY = dataclasses.replace(
    MOCHI_1,
    name="mochi-tiny",
    description="Mochi 1 architecture shrunk for CPU tests: 2 blocks, 6 heads x 16 (96 wide), a 48-wide text stream, "
                "tiny Mochi VAE",
    transformer=dict(MOCHI_1.transformer, num_attention_heads=6, attention_head_dim=16, num_layers=2,
                     pooled_projection_dim=48, text_embed_dim=64, time_embed_dim=32, max_sequence_length=32),
    vae=dict(encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
             layers_per_block=(1, 1, 1, 1, 1)),
    t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    default_dtype="float32",
    default_size=(48, 48),
    max_sequence_length=32,
    default_frames=7,
)


def mochi_components(arch: SynthArch, kit) -> dict:
    """MochiPipeline's other components: AutoencoderKLMochi and a T5 text encoder with its tokenizer."""
    import diffusers
    import transformers

    t5_tok = kit.t5_tokenizer(arch.max_sequence_length)
    return dict(vae=kit.make(diffusers.AutoencoderKLMochi, arch.vae, 1),
                text_encoder=kit.make(transformers.T5EncoderModel, kit.t5_config(t5_tok, arch.t5), 3),
                tokenizer=t5_tok)


def mochi_meta_trace(model: torch.nn.Module):
    """Make ``model`` traceable on the meta device for the planner: its RoPE builds the table under autocast on the
    positions' device, which the meta device has not (here the same table, float32 positions times frequencies, then
    cos and sin, without autocast); its attention finds each prompt's valid tokens with ``nonzero`` of the text mask,
    which a meta tensor cannot answer (the planner's prompts are all valid: the attention reads a host mask of ones of
    the meta mask's shape). Returns the undo callable."""
    rope = model.rope

    def create_rope(freqs: torch.Tensor, pos: torch.Tensor):
        angles = torch.einsum("nd,dhf->nhf", pos.float(), freqs.float())
        return torch.cos(angles), torch.sin(angles)

    def all_valid(processor):
        def call(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs):
            ones = torch.ones(attention_mask.shape, dtype=attention_mask.dtype)
            return processor(attn, hidden_states, encoder_hidden_states, ones, **kwargs)
        return call

    rope._create_rope = create_rope
    processors = [block.attn1.processor for block in model.transformer_blocks]
    for block, processor in zip(model.transformer_blocks, processors):
        block.attn1.processor = all_valid(processor)

    def undo() -> None:
        delattr(rope, "_create_rope")
        for block, processor in zip(model.transformer_blocks, processors):
            block.attn1.processor = processor

    return undo


MOCHI = register(
    ModelAdapter(
        name="mochi",
        class_names=("MochiTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video", "text"),
            inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, stream="video", ndim=3),
                                             "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)}},
            outputs={"rope": {0: Split(dim=0, stream="video", ndim=3), 1: Split(dim=0, stream="video", ndim=3)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
        ),
        attention=AttentionSelector(class_names=("MochiAttention",)),
        sequence_processor=MochiSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states"), ("video", "text")),),
        token_wise=(f"{_BLOCK}.ff", f"{_BLOCK}.ff_context"),
        modulated_input=norm1_modulated_input,
        example_inputs=mochi_example_inputs,
        layout=mochi_layout,
        text_tokens=256,  # MochiPipeline's max_sequence_length
        tensor_plan=MOCHI_TENSOR_PLAN,
        meta_trace=mochi_meta_trace,
        batch_inputs=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
        cfg_mode="batched",  # MochiPipeline runs [uncond, cond] in one call
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels or model.config.in_channels,
        frame_step=6,  # the Mochi VAE compresses time 6x: 6k+1 frames
        fps=30,  # Mochi 1 is trained on 30 fps clips
        pipelines=("MochiPipeline",),
        synth_archs=(MOCHI_1, MOCHI_TINY),
        synth_components=mochi_components,
        vae=MOCHI_VAE_PLAN,
        pp_refusal="every call carries its captions' key-padding mask, which the stages' attention over the K/V "
                   "buffers does not take",
    )
)
