"""Bria FIBO 2 (``BriaFibo2Transformer2DModel``, BriaFibo2Pipeline): Z-Image's blocks over the image and the images
to edit, then over one sequence joined with a Perceiver's gist tokens.

Where the tokens are: ``forward`` patchifies the latent (``[B, C, H, W]``, 2x2 patches) and each image to edit
(``context_latents``, each of its own size) into one sequence ``[image, context]`` (``x_embedder``), with its RoPE
table (``[1, N, D / 2]`` complex, built in the forward). The noise refiner (``noise_refiner``) runs over that sequence
alone, with a per-token noise mask when images to edit are given. The Perceiver then squeezes the first text bundle
into gist tokens (as many as the longest prompt needs, from 256 to 512), which join the sequence: first, or last
when a batch pads them (then with a key mask ``[B, N]`` over ``[image, context, gist]``). The main blocks (``layers``)
run over the joined sequence with a per-token noise mask; some of them (``injection_layer_ids``) also cross-attend to
their own text bundle, whole, under the prompts' padding mask. The final layer reads the image tokens only.

Sequence plan: two streams, each split once. ``image`` (the image and context tokens) is split where the noise refiner
starts (its input, its RoPE table and its noise mask at every refiner block) and gathered where it ends, because the
forward builds the joined sequence, its noise mask (set by global token index) and the gist padding mask from the
tokens it holds: held split, those would be wrong, and every rank would hold every gist token (a replicated stream
whose keys the attention would have to count once). ``joint`` is that joined sequence, split where the main blocks
start (its RoPE table and noise mask at every block) and gathered after the last one, before the model keeps its image
tokens. The gather between costs one all-gather of the refined tokens a call, against two all-to-alls per attention
layer. The Perceiver runs whole on every
rank (it reads the text only: ``whole_attention``); the injection blocks' cross-attention has local queries and the
whole text as keys, so it runs as diffusers' processor; the key mask stays whole and goes to ``sp.attention``.

Tensor plan (refiner, main blocks, injection cross-attention): Q, K, V and the SwiGLU's ``w1``/``w3``
column-parallel, the attention outputs and ``w2`` row-parallel: 2 all-reduces a block, 3 in an injection block. CFG:
the prompt's call, then the negative prompt's (sequential). The VAE is FLUX.2's (``AutoencoderKLFlux2``), split as
FLUX.2's.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .flux import FLUX_SCHEDULER
from .flux2 import FLUX2_TINY, FLUX2_VAE_PLAN
from .lumina2 import swiglu_blocks_plan
from .qwenimage import qwen3vl_sizes, qwen3vl_text_encoder


def _rotated(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE as diffusers' ``BriaFibo2AttnProcessor`` applies it: complex products in float32, then back to x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)


class BriaFibo2SequenceParallelProcessor(SequenceProcessor):
    """Processor for Bria FIBO 2's attention layers (module docstring): a self-attention runs through ``sp.attention``
    over the stream its blocks carry (``joint`` once the main blocks have split it, else the refiner's ``image``), with
    the whole key mask; a cross-attention to the whole text goes to the layer's own processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        if encoder_hidden_states is not None:
            return self.previous(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if freqs_cis is not None:
            q, k = _rotated(q, freqs_cis), _rotated(k, freqs_cis)
        split = getattr(getattr(self.sp, "ctx", None), "stream_sizes", {})
        streams = ("joint",) if "joint" in split else ("image",)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, streams=streams, mask=attention_mask)
        return attn.to_out[0](out.flatten(2, 3).to(q.dtype))


def bria_fibo2_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one BriaFibo2Pipeline step: the latent of FLUX.2's VAE (8x, 2x2 patches inside), the
    text bundles (the Perceiver's, then one per injection block), the noise level in [0, 1]. No text mask: with every
    token valid the forward takes none (and one would be read on the host, which the planner's meta trace cannot)."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 8, width // 8),
                timestep=torch.full((batch,), 0.7).to(device, dtype),
                encoder_hidden_states=rand(batch, 1 + len(cfg.injection_layer_ids), text_len, cfg.cap_feat_dim),
                return_dict=False)


def bria_fibo2_meta_trace(model):
    """The planner's trace: the Perceiver hands its layers a slice of its query parameter, made under no_grad, which
    requires grad without a grad function; torch's module tracker (of the FLOP counter) refuses such an input. The
    parameter is traced without grad, as inference runs it."""
    queries = model.perceiver.latent_queries
    wanted = queries.requires_grad
    queries.requires_grad_(False)
    return lambda: queries.requires_grad_(wanted)


def gist_tokens(config: dict, text_tokens: int) -> int:
    """The gist tokens of a prompt of ``text_tokens`` tokens (the class's ``compute_gist_count``, torch-free)."""
    low, high = config.get("min_num_gist_tokens", 256), config.get("max_num_gist_tokens", 512)
    first, last = config.get("gist_min_text_len", 256), config.get("gist_max_text_len", 2048)
    step = config.get("gist_step", 64)
    ratio = min(1.0, max(0.0, (text_tokens - first) / (last - first)))
    return max(low, min(high, -(-(low + ratio * (high - low)) // step) * step))


def bria_fibo2_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a BriaFibo2Pipeline call: FLUX.2's VAE divides by 8, 2x2 patches become one token; the main
    blocks' sequence holds the image tokens and the prompt's gist tokens."""
    lh, lw = spatial_latent(height, width, 16, "Bria FIBO 2 (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + int(gist_tokens(config, text_tokens)),
                  (config.get("in_channels", 32), lh, lw))


_BLOCKS = ("noise_refiner", "layers")
_SWIGLU = swiglu_blocks_plan(_BLOCKS, "attention", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
#: refiner and main blocks alike, plus the injection blocks' cross-attention (absent from the other blocks)
BRIA_FIBO2_TENSOR_PLAN = TensorPlan(
    colwise=_SWIGLU.colwise + tuple(f"layers.*.cross_attention.{p}" for p in ("to_q", "to_k", "to_v")),
    rowwise=_SWIGLU.rowwise + ("layers.*.cross_attention.to_out.0",),
    per_rank_attrs=dict(_SWIGLU.per_rank_attrs, **{"layers.*.cross_attention": ("heads",)}),
)

_IMAGE = Split(dim=1, stream="image", ndim=3)
_JOINT = Split(dim=1, stream="joint", ndim=3)

# -- synthetic architectures ---------------------------------------------------------------------------------
#: the pipeline reads Qwen3-VL's hidden states up to the 35th (three per text bundle): 36 layers, as Qwen3-VL-4B's
BRIA_FIBO2 = SynthArch(
    name="bria-fibo2",
    description="Bria FIBO 2 transformer as diffusers' defaults (44 blocks + 2 refiners, 28 heads x 128, 5 injection "
                "blocks, a 2-layer Perceiver of 256 to 512 gist tokens, text bundles 7680 wide), FLUX.2's VAE, a "
                "36-layer Qwen3-VL of Qwen3-VL-4B's width, narrow inside",
    pipeline="BriaFibo2Pipeline",
    transformer_class="BriaFibo2Transformer2DModel",
    transformer={},
    vae={},  # AutoencoderKLFlux2's defaults are FLUX.2's VAE
    clip={},
    t5=qwen3vl_sizes(2560, 36, 128, [24, 20, 20]),
    scheduler=FLUX_SCHEDULER,
    default_dtype="bfloat16",
    default_size=(1024, 1024),
    max_sequence_length=2048,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_bria_fibo2.py)
BRIA_FIBO2_TINY = dataclasses.replace(
    BRIA_FIBO2, name="bria-fibo2-tiny",
    description="Bria FIBO 2 at diffusers' test configuration: 2 blocks (the second an injection block) + 1 refiner, "
                "2 heads x 16, a 1-layer Perceiver of 4 to 8 gist tokens; a tiny FLUX.2 VAE and 36-layer Qwen3-VL",
    transformer=dict(in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=24,
                     injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8,
                     gist_step=4, gist_min_text_len=4, gist_max_text_len=16, axes_dims=(4, 6, 6),
                     axes_lens=(16, 16, 16)),
    vae=FLUX2_TINY.vae,
    t5=qwen3vl_sizes(8, 36, 8, [2, 1, 1], intermediate_size=16),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=64)


def bria_fibo2_components(arch: SynthArch, kit) -> dict:
    """BriaFibo2Pipeline's other components: FLUX.2's VAE (``arch.vae``) and a Qwen3-VL for conditional generation
    (``arch.t5``). In the processor's place (a Qwen3-VL processor, whose video processor needs torchvision) the local
    Qwen2 tokenizer it wraps: the pipeline calls it on text alone unless a caption's text is drawn as images."""
    import diffusers

    encoder = qwen3vl_text_encoder(arch, kit, "Qwen3VLForConditionalGeneration")
    return dict(vae=kit.make(diffusers.AutoencoderKLFlux2, arch.vae, 1), text_encoder=encoder["text_encoder"],
                processor=encoder["tokenizer"])

BRIA_FIBO2_ADAPTER = register(
    ModelAdapter(
        name="bria-fibo2",
        class_names=("BriaFibo2Transformer2DModel",),
        num_heads=lambda model: model.config.n_heads,
        sequence_plan=SequencePlan(
            streams=("image", "joint"),
            inputs={"noise_refiner.0": {"x": _IMAGE},
                    "noise_refiner.*": {"freqs_cis": _IMAGE, "noise_mask": Split(dim=1, stream="image", ndim=2)},
                    "layers.0": {"x": _JOINT},
                    "layers.*": {"freqs_cis": _JOINT, "noise_mask": Split(dim=1, stream="joint", ndim=2)}},
            gathers={"noise_refiner.-1": Gather(dim=1, stream="image"), "layers.-1": Gather(dim=1, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; the refiner's tokens split and gathered around it, then "
                                 "the sequence joined with the gist tokens split and gathered around the main blocks",
        ),
        attention=AttentionSelector(paths=("noise_refiner.*.attention", "layers.*.attention",
                                           "layers.*.cross_attention")),
        # the Perceiver reads the text alone, before any token is split
        whole_attention=AttentionSelector(paths=("perceiver.layers.*.cross_attention",
                                                 "perceiver.layers.*.self_attention")),
        sequence_processor=BriaFibo2SequenceParallelProcessor,
        blocks=(),
        example_inputs=bria_fibo2_example_inputs,
        meta_trace=bria_fibo2_meta_trace,
        layout=bria_fibo2_layout,
        text_tokens=2048,  # the pipeline's max_sequence_length
        tensor_plan=BRIA_FIBO2_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                      "context_latents"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=1,
        out_channels=lambda model: model.config.in_channels,
        pipelines=("BriaFibo2Pipeline",),
        synth_archs=(BRIA_FIBO2_TINY, BRIA_FIBO2),
        synth_components=bria_fibo2_components,
        vae=FLUX2_VAE_PLAN,
        pp_refusal="Bria FIBO 2's blocks take x, not hidden_states, and its sequence is joined between the refiner "
                   "and the main blocks; PipeFusion does not take it",
    )
)
