"""Latte (``LatteTransformer3DModel``, ``LattePipeline``): PixArt-α's blocks over video, a spatial block (per frame:
self-attention over the frame's patches, cross-attention to the T5 text) and a temporal block (per patch position:
self-attention over the frames) in turn, adaLN-single modulation.

Where the tokens are: ``forward`` folds the frames into the batch, ``[B * F, C, H, W]``, patchifies in ``pos_embed``
(which adds the sine-cosine table of the patch positions) to ``[B * F, N, D]``, runs the spatial blocks on that and
the temporal blocks on the transpose ``[B * N, F, D]`` (adding the frames' sine-cosine table before the first), and
unpatchifies each frame after ``proj_out``.

The split: by patch position. Every rank holds the same positions in every frame (its chunk of the ``N`` positions,
uneven by at most one), cut at ``pos_embed``'s output after the position table is added. The spatial self-attention is
then a sequence split within each frame (``B * F`` rows of ``N`` tokens: Ulysses, ring or USP over the positions), the
cross-attention reads the whole text every rank holds, and the temporal blocks attend over the frames of one position,
all of which the rank holds: they run diffusers' own processor with no communication. ``forward`` transposes the local
``[B * F, N_r, D]`` to ``[B * N_r, F, D]`` by itself (it reads the position count off the tensor); the frames' table
depends on the frame alone. What it builds from the global position count is cut: the temporal blocks' timestep
(``[B * N, 6D]``, one row per sample and position, ``Split(folded=True)``). ``proj_out``'s output is gathered
before the per-frame unpatchify.

Blocks: ``transformer_blocks`` and ``temporal_transformer_blocks`` run in turn (``alternating_blocks``), so PipeFusion's
stages and the step caches' spans are refused; regional compile takes both lists. Tensor plan: PixArt's over the
spatial blocks (3 all-reduces) and the same without cross-attention over the temporal ones (2). CFG: one call on
``[uncond, cond]`` (batched). Frames: the temporal table holds ``video_length`` frames (16 for Latte-1), and a call
takes that many or one (``enable_temporal_attentions`` on or off alike).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import KL_VAE_PLAN
from .pixart import PIXART_ARCHS, PIXART_SIGMA, PixArtSequenceParallelProcessor, pixart_components

_LISTS = ("transformer_blocks", "temporal_transformer_blocks")


def latte_frames(config, frames: int | None) -> int:
    """The latent frames of a call of ``frames`` frames (the VAE runs per frame): 1 or the model's ``video_length``
    (its temporal position table's length); ValueError naming both otherwise."""
    length = config["video_length"] if isinstance(config, dict) else config.video_length
    frames = length if frames is None else frames
    if frames not in (1, length):
        raise ValueError(f"--frames {frames}: Latte's temporal position table holds {length} frames; use --frames "
                         f"{length} (or 1)")
    return frames


def latte_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one LattePipeline step: the latent video (8x smaller frames, ``video_length`` of them
    unless ``frames`` says 1), the T5 text and one timestep per sample."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, cfg.in_channels, latte_frames(cfg, frames), height // 8, width // 8),
                encoder_hidden_states=rand(batch, text_len, cfg.caption_channels),
                timestep=torch.full((batch,), 700, dtype=torch.long, device=device),
                enable_temporal_attentions=True, return_dict=False)


def latte_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a LattePipeline call: the VAE divides each frame by 8, then ``patch_size`` patches; every
    frame's positions are split, so the split sequence is all the video's tokens. Text is cross-attention context."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"Latte (8x VAE, patch {patch})")
    latent_frames = latte_frames(config, frames)
    tokens = latent_frames * (lh // patch) * (lw // patch)
    return Layout(tokens, text_tokens, tokens, (config.get("in_channels", 4), latent_frames, lh, lw))


def latte_call_arguments(pipe, kwargs: dict) -> dict:
    """LattePipeline names its frame count ``video_length``: ``--frames`` as that (the model's own by default)."""
    kwargs = dict(kwargs)
    kwargs["video_length"] = latte_frames(pipe.transformer.config, kwargs.pop("num_frames", None))
    return kwargs


def latte_unsupported(transformer, config) -> str | None:
    """tp slices the feed-forward's first linear as one column-parallel piece: a gated activation (GEGLU's two halves
    in one projection) would be cut across its halves."""
    activation = transformer.config.activation_fn
    if config.tp > 1 and activation not in ("gelu", "gelu-approximate"):
        return (f"tp cuts Latte's feed-forward as one column-parallel linear, which its {activation!r} activation (two "
                "halves in one projection) does not take; use ulysses or ring")
    return None


def _tensor_plan() -> TensorPlan:
    """Q/K/V column-parallel and ``to_out.0`` row-parallel in every attention (the spatial blocks' ``attn1`` and
    ``attn2``, the temporal blocks' ``attn1``), the feed-forwards column -> row: 5 all-reduces per layer."""
    attns = [("transformer_blocks", "attn1"), ("transformer_blocks", "attn2"), ("temporal_transformer_blocks", "attn1")]
    return TensorPlan(
        colwise=tuple(f"{path}.*.{attn}.{proj}" for path, attn in attns for proj in ("to_q", "to_k", "to_v"))
        + tuple(f"{path}.*.ff.net.0.proj" for path in _LISTS),
        rowwise=tuple(f"{path}.*.{attn}.to_out.0" for path, attn in attns)
        + tuple(f"{path}.*.ff.net.2" for path in _LISTS),
        per_rank_attrs={f"{path}.*.{attn}": ("heads", "inner_dim") for path, attn in attns},
    )


# -- synthetic architectures ---------------------------------------------------------------------------------
LATTE_1 = SynthArch(
    name="latte-1",
    description="Latte-1 transformer (28 spatial and 28 temporal blocks, 16 heads x 72, 16 frames), the SD VAE, "
                "one-layer T5 of T5-XXL's width",
    pipeline="LattePipeline",
    transformer_class="LatteTransformer3DModel",
    transformer=dict(sample_size=64, num_layers=28, attention_head_dim=72, num_attention_heads=16, in_channels=4,
                     out_channels=8, patch_size=2, cross_attention_dim=1152, caption_channels=4096, attention_bias=True,
                     activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                     norm_elementwise_affine=False, norm_eps=1e-6, video_length=16),
    vae=dict(PIXART_SIGMA.vae, scaling_factor=0.18215),
    clip={},
    t5=PIXART_SIGMA.t5,
    scheduler=dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                   clip_sample=False),
    scheduler_class="DDIMScheduler",
    default_dtype="float16",
    default_size=(512, 512),
    max_sequence_length=120,  # LattePipeline pads every prompt to 120 T5 tokens
    default_frames=16,
)

#: diffusers' test configuration of the class (1 layer, 2 heads x 4, an 8 x 8 latent of 16 positions, caption 8 wide)
#: with a 2-frame temporal table (their inputs have one frame, which never reads it); PixArt's tiny VAE and a tiny T5
LATTE_TINY = dataclasses.replace(
    LATTE_1,
    name="latte-tiny",
    description="Latte at diffusers' test configuration (1 layer, 2 heads x 4, caption 8 wide) with 2 frames; PixArt's "
                "tiny VAE, a T5 8 wide",
    transformer=dict(LATTE_1.transformer, sample_size=8, num_layers=1, attention_head_dim=4, num_attention_heads=2,
                     caption_channels=8, cross_attention_dim=8, video_length=2),
    vae=dict(PIXART_ARCHS[1].vae, scaling_factor=0.18215),
    t5=dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2),
    default_dtype="float32",
    default_size=(64, 64),
    default_frames=2,
)

#: an awkward one of ours: 3 heads (no even head split), 2 layers (the blocks alternate twice), 3 frames, sized for
#: 5 x 5 = 25 positions at 80 x 80 (uneven over 2 and 4 ranks)
LATTE_TINY_ODD = dataclasses.replace(
    LATTE_TINY,
    name="latte-tiny-odd",
    description="latte-tiny with 2 layers, 3 heads x 8 and 3 frames, for odd position counts and heads",
    transformer=dict(LATTE_TINY.transformer, num_layers=2, attention_head_dim=8, num_attention_heads=3,
                     caption_channels=16, cross_attention_dim=24, video_length=3, sample_size=10),
    t5=dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    default_size=(80, 80),
    default_frames=3,
)


LATTE = register(
    ModelAdapter(
        name="latte",
        class_names=("LatteTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("video",),
            outputs={"pos_embed": {None: Split(dim=1, stream="video", ndim=3)}},
            inputs={"temporal_transformer_blocks.*": {"timestep": Split(dim=0, stream="video", folded=True)}},
            gathers={"proj_out": Gather(dim=1, stream="video")},
            differs_from_cp_plan="the class has no _cp_plan; patch positions split in every frame",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1", "transformer_blocks.*.attn2")),
        whole_attention=AttentionSelector(paths=("temporal_transformer_blocks.*.attn1",)),
        sequence_processor=PixArtSequenceParallelProcessor,
        blocks=tuple(BlockList(path, ("hidden_states",), ("hidden_states",)) for path in _LISTS),
        alternating_blocks=True,
        token_wise=tuple(f"{path}.*.ff" for path in _LISTS),
        example_inputs=latte_example_inputs,
        layout=latte_layout,
        text_tokens=120,
        tensor_plan=_tensor_plan(),
        unsupported=latte_unsupported,
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_attention_mask", "timestep"),
        cfg_mode="batched",  # LattePipeline runs [uncond, cond] in one call
        output_channel_dim=1,
        out_channels=lambda model: model.out_channels,
        frame_step=1,
        fps=8,
        call_arguments=latte_call_arguments,
        pp_refusal="Latte's spatial and temporal blocks run in turn, transposing the video between them, which "
                   "PipeFusion's stages do not send",
        cache_refusal="Latte's spatial and temporal blocks run in turn, transposing the video between them, which the "
                      "caches' spans do not cover",
        pipelines=("LattePipeline",),
        synth_archs=(LATTE_TINY, LATTE_TINY_ODD, LATTE_1),
        synth_components=pixart_components,
        vae=KL_VAE_PLAN,
    )
)
