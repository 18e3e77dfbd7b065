"""OmniGen (``OmniGenTransformer2DModel``, OmniGenPipeline): a Phi-3-style decoder over one joined sequence, the
prompt's tokens (with condition images' patches written over their placeholders), a time token, then the image's
patches.

Where the tokens are: ``forward`` embeds the token ids and patches, concatenates ``[condition, time, image]``, turns
the pipeline's 0/1 mask ``[B, N, N]`` (causal over the prompt, bidirectional within each image, left padding) into an
additive ``[B, 1, N, N]`` one, builds the RoPE table from ``position_ids`` (cos and sin ``[N, D]``, the first
sample's positions, as diffusers does), runs the layers, normalizes and keeps the last image tokens.

Sequence plan: one stream, ``joint``, split at the input of ``layers.0``; the RoPE table split with it at every
layer; the last layer's output gathered (``layers.-1``), so the model normalizes and cuts the image from the whole
sequence. The mask stays whole: in one stream the ranks' local sequences one after another are the global order, so
``sp.attention`` takes it as the model builds it, rows and columns. Attention: Q/K/V of the local tokens, the RoPE
rotation, key/value heads repeated to the query heads, the softmax through ``sp.attention``.

Tensor plan: Q/K/V and the fused gate-and-up projection (in two halves) column-parallel, the attention output and the
down projection row-parallel: 2 all-reduces a layer. CFG and dp are refused: its pipeline batches the conditional,
unconditional and image-conditional calls (up to three) with the condition images as one list over the batch and a
dict of their positions per sample, which a batch split would have to re-index.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, replace_forward, spatial_latent, with_torchvision)
from .pixart import _SDXL_VAE


class OmniGenSequenceParallelProcessor(SequenceProcessor):
    """Processor for OmniGen's self-attention: diffusers' ``OmniGenAttnProcessor2_0`` on local tokens, the softmax
    through ``sp.attention`` with the model's whole ``[B, 1, N, N]`` mask."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = q.shape[-1] // attn.heads
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))  # [B, N, H, D]
        if image_rotary_emb is not None:
            q, k = (apply_rotary_emb(t.transpose(1, 2), image_rotary_emb, use_real_unbind_dim=-2).transpose(1, 2)
                    for t in (q, k))
        groups = q.shape[2] // k.shape[2]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        out = self.sp.attention(q, k, v, backend=self._attention_backend, mask=attention_mask)
        return attn.to_out[0](out.flatten(2, 3).type_as(q))


def omnigen_inputs(model, latents: torch.Tensor, prompts: list[list[int]], timestep: torch.Tensor,
                   condition: dict[int, list[torch.Tensor]] | None = None) -> dict:
    """The transformer's inputs as OmniGenPipeline builds them (diffusers' ``OmniGenCollator``): token ids left-padded
    to the longest prompt, the positions, the causal-and-image 0/1 mask; ``condition``: per sample, the latents of
    condition images whose patches replace that many placeholder tokens at the prompt's start."""
    from diffusers.pipelines.omnigen.processor_omnigen import OmniGenCollator

    p = model.config.patch_size
    condition = condition or {}
    features, pixels = [], []
    for i, ids in enumerate(prompts):
        images = condition.get(i, [])
        sizes, start = [], 0
        for image in images:
            sizes.append([start, start + image.shape[-2] * image.shape[-1] // p // p])
            start = sizes[-1][1]
        features.append({"input_ids": ids, "pixel_values": images or None, "image_sizes": sizes})
        pixels += images
    height, width = latents.shape[-2:]
    collator = OmniGenCollator(pad_token_id=model.config.pad_token_id, hidden_size=model.config.hidden_size)
    ids, positions, mask, _, _, sizes = collator.process_mllm_input(features, [(8 * height, 8 * width)] * len(prompts))
    return dict(hidden_states=latents, timestep=timestep, input_ids=ids, input_img_latents=pixels,
                input_image_sizes=sizes, attention_mask=mask, position_ids=positions, return_dict=False)


def omnigen_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one OmniGenPipeline text-to-image step: random latents 8x smaller (the SDXL VAE) and
    prompts of ``text_len`` random token ids."""
    latents = torch.randn(batch, model.config.in_channels, height // 8, width // 8, generator=generator)
    prompts = torch.randint(3, model.config.vocab_size, (batch, text_len), generator=generator).tolist()
    inputs = omnigen_inputs(model, latents.to(device, dtype), prompts, torch.full((batch,), 0.7).to(device, dtype))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def omnigen_meta_trace(model):
    """The planner's meta-device trace: the RoPE module reads the largest position on the host to pick its scaling;
    answered with empty cos and sin tables ``[N, D]`` of the sequence's length."""
    dim = model.rope.dim

    def tables(hidden_states, position_ids):
        empty = hidden_states.new_empty(position_ids.shape[-1], dim, dtype=torch.float32)
        return empty, empty

    return replace_forward(model.rope, tables)


def omnigen_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an OmniGenPipeline call: the VAE divides by 8, 2x2 patches; the prompt, the time token and the
    image are one sequence, split together."""
    lh, lw = spatial_latent(height, width, 16, "OmniGen (8x VAE, 2x2 patches)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, text_tokens + 1 + image, (config.get("in_channels", 4), lh, lw))


OMNIGEN_TENSOR_PLAN = TensorPlan(
    colwise=("layers.*.self_attn.to_q", "layers.*.self_attn.to_k", "layers.*.self_attn.to_v"),
    rowwise=("layers.*.self_attn.to_out.0", "layers.*.mlp.down_proj"),
    packed_colwise={"layers.*.mlp.gate_up_proj": ("down_proj.in_features", "down_proj.in_features")},
    per_rank_attrs={"layers.*.self_attn": ("heads", "out_dim")},  # diffusers' processor reshapes to out_dim
)

# -- synthetic architectures ---------------------------------------------------------------------------------
#: the markers of OmniGen's prompt template (its processor's ``add_prefix_instruction``) and of a condition image
OMNIGEN_MARKERS = ("<|user|>", "<|assistant|>", "<|end|>", "<|diffusion|>", "<img>", "</img>")


def omnigen_components(arch: SynthArch, kit) -> dict:
    """OmniGenPipeline's other components: the SDXL VAE (``arch.vae``) and a Llama tokenizer built locally that knows
    the prompt template's markers; no text encoder (the transformer embeds the token ids itself)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1),
                tokenizer=kit.llama_tokenizer(OMNIGEN_MARKERS, 4096))  # its prompts are not cut


_ROPE_SCALING = dict(long_factor=[1.0] * 48, short_factor=[1.0] * 48)

OMNIGEN_V1 = SynthArch(
    name="omnigen-v1",
    description="OmniGen-v1 transformer as diffusers' defaults (32 layers, 32 heads x 96, Phi-3's 32064-token "
                "vocabulary), the SDXL VAE, a local Llama tokenizer",
    pipeline="OmniGenPipeline",
    transformer_class="OmniGenTransformer2DModel",
    transformer=dict(in_channels=4, patch_size=2, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=8192, num_layers=32, rope_scaling=_ROPE_SCALING),
    vae=_SDXL_VAE, clip={}, t5={}, scheduler={},
    default_dtype="bfloat16",
    max_sequence_length=120,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_omnigen.py), 2 of its 20 layers
OMNIGEN_TINY = dataclasses.replace(
    OMNIGEN_V1,
    name="omnigen-tiny",
    description="OmniGen at diffusers' test configuration (4 heads x 4, a 1000-token vocabulary) with 2 layers; a "
                "tiny SDXL VAE, a local Llama tokenizer",
    transformer=dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=2,
                     pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
                     rope_scaling=dict(long_factor=[1, 2], short_factor=[1, 2])),
    vae=dict(_SDXL_VAE, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=24,
)

OMNIGEN = register(
    ModelAdapter(
        name="omnigen",
        class_names=("OmniGenTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"layers.0": {"hidden_states": Split(dim=1, stream="joint", ndim=3)},
                    "layers.*": {"image_rotary_emb": Split(dim=0, stream="joint", ndim=2)}},
            gathers={"layers.-1": Gather(dim=1, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; the joined [condition, time, image] sequence is split "
                                 "where the layers start and gathered where they end, before the model cuts the image",
        ),
        attention=AttentionSelector(paths=("layers.*.self_attn",)),
        sequence_processor=OmniGenSequenceParallelProcessor,
        blocks=(BlockList("layers", ("hidden_states",), ("hidden_states",)),),
        token_wise=("layers.*.mlp",),
        example_inputs=omnigen_example_inputs,
        layout=omnigen_layout,
        text_tokens=120,
        tensor_plan=OMNIGEN_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "input_ids", "attention_mask", "position_ids"),
        cfg_mode="batched",
        output_channel_dim=1,
        out_channels=lambda model: model.config.in_channels,
        pipelines=("OmniGenPipeline",),
        synth_archs=(OMNIGEN_TINY, OMNIGEN_V1),
        synth_components=with_torchvision("OmniGen", "OmniGenPipeline's constructor builds its multimodal processor "
                                                     "from torchvision's transforms, even for text to image",
                                          omnigen_components),
        meta_trace=omnigen_meta_trace,
        batch_refusal="OmniGen's pipeline batches its (up to three) guidance calls with the condition images as one "
                      "list over the batch and a dict of their positions per sample, which a batch split would have "
                      "to re-index",
        pp_refusal="OmniGen's layers take one joined sequence under a whole [N, N] mask, which PipeFusion does not "
                   "take",
    )
)
