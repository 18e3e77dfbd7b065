"""ERNIE-Image (``ErnieImageTransformer2DModel``, ``ErnieImagePipeline``): one ``[image, text]`` sequence, sequence-first.

``forward`` patchifies the latent, projects the text, concatenates ``[image, text]`` along dim 0 (the blocks work on
``[S, B, D]``), builds one RoPE table ``[B, S, 1, D]`` and a key mask ``[B, 1, 1, S]`` from each prompt's length,
expands the timestep modulation to every token (six ``[S, B, D]`` tensors handed to every block), runs the
single-stream blocks, and keeps the image rows of the final projection (``[:N_img]``).

Sequence plan: one stream, ``joint``, the concatenated sequence, split along dim 0 at the input of ``layers.0``; the
RoPE table (dim 1) and the six modulation tensors (dim 0) split with it at every block; the last block's output
gathered (``layers.-1``), so that the final layers and the image rows' cut see the whole sequence. The key mask stays
whole: one stream's local sequences one after another are the global order.

Tensor plan: Q/K/V and the feed-forward's gate and up projections column-parallel, the attention output and the
feed-forward's ``linear_fc2`` row-parallel (2 all-reduces per block), the head count divided. CFG: one call on
``[uncond, cond]`` (batched).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, replace_forward, spatial_latent)


class ErnieImageSequenceParallelProcessor:
    """Attention processor for ``ErnieImageAttention`` whose attention runs sequence-parallel: diffusers'
    ``ErnieImageSingleStreamAttnProcessor`` on the local tokens, the softmax attention through ``sp.attention`` with
    the model's key mask."""

    _parallel_config = None

    def __init__(self, sp, previous=None):
        self.sp = sp
        self._attention_backend = getattr(previous, "_attention_backend", None)

    def __call__(self, attn, hidden_states, attention_mask=None, freqs_cis=None):
        def heads(linear):
            return linear(hidden_states).unflatten(-1, (attn.heads, -1))

        query, key, value = heads(attn.to_q), heads(attn.to_k), heads(attn.to_v)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query, key = _rotate(query, freqs_cis), _rotate(key, freqs_cis)
        out = self.sp.attention(query, key, value, backend=self._attention_backend, mask=attention_mask)
        return attn.to_out[0](out.flatten(2, 3).to(query.dtype))


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ERNIE-Image's rotation of the first ``freqs.shape[-1]`` channels of each head (halves rotated), the rest kept."""
    width = freqs.shape[-1]
    x, rest = x[..., :width], x[..., width:]
    cos, sin = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def ernie_image_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one ErnieImagePipeline step: latents 16x smaller than the image (FLUX.2's VAE, its 2x2
    patches folded into channels), ``text_len`` text tokens, each prompt of full length."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, cfg.in_channels, height // 16, width // 16),
                timestep=torch.full((batch,), 700.0).to(device, dtype), text_bth=rand(batch, text_len, cfg.text_in_dim),
                text_lens=torch.full((batch,), text_len, dtype=torch.long, device=device), return_dict=False)


def ernie_image_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an ErnieImagePipeline call: the latent is 16x smaller than the image, one token per latent pixel
    (patch 1); image and text are one sequence, split together."""
    spatial_latent(height, width, 16, "ERNIE-Image (16x VAE)")
    image = (height // 16) * (width // 16)
    return Layout(image, text_tokens, image + text_tokens, (config.get("in_channels", 128), height // 16, width // 16))


def ernie_image_meta_trace(model: torch.nn.Module):
    """Make ``model`` traceable on the meta device for the planner: the RoPE table (which turns autocast off on the
    positions' device) is an empty ``[B, S, 1, head dim]``. Returns the undo callable."""
    return replace_forward(model.pos_embed, lambda ids: ids.new_empty(*ids.shape[:2], 1, model.pos_embed.dim))


ERNIE_IMAGE = SynthArch(
    name="ernie-image",
    description="ERNIE-Image transformer as diffusers' defaults (24 blocks, 24 heads x 128, FFN 8192, text width 2560), "
                "FLUX.2's VAE, a two-layer Mistral 3 of Ministral-3-3B's width (no prompt enhancer)",
    pipeline="ErnieImagePipeline",
    transformer_class="ErnieImageTransformer2DModel",
    transformer=dict(hidden_size=3072, num_attention_heads=24, num_layers=24, ffn_hidden_size=8192, in_channels=128,
                     out_channels=128, patch_size=1, text_in_dim=2560),
    vae={},  # AutoencoderKLFlux2's defaults are FLUX.2's VAE
    clip={},
    # two layers: the pipeline reads the last hidden state but one
    t5=dict(text=dict(hidden_size=2560, intermediate_size=64, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128),
            vision=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8)),
    scheduler=dict(num_train_timesteps=1000, shift=3.0),
    default_dtype="bfloat16",
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_ernie_image.py): one block of one
#: 16-wide head, RoPE axes 8 + 4 + 4
ERNIE_IMAGE_TINY = dataclasses.replace(
    ERNIE_IMAGE, name="ernie-image-tiny",
    description="ERNIE-Image at diffusers' test configuration: 1 block, 1 head x 16, text width 16; a tiny FLUX.2 VAE "
                "and Mistral 3",
    transformer=dict(hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16, in_channels=16,
                     out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=[8, 4, 4]),
    vae=dict(block_out_channels=[4, 4, 4, 4], layers_per_block=1, latent_channels=4, norm_num_groups=2),
    t5=dict(text=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8),
            vision=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8)),
    default_dtype="float32", default_size=(64, 64), max_sequence_length=32)


def ernie_image_components(arch: SynthArch, kit) -> dict:
    """ErnieImagePipeline's other components: AutoencoderKLFlux2 (``arch.vae``) and a Mistral 3 (``arch.t5``: a
    Mistral text model and a Pixtral vision tower the pipeline does not call) with a local byte-level BPE tokenizer. No
    prompt enhancer (``pe``, optional): the pipeline then encodes the prompt as given."""
    import diffusers
    import transformers

    specials = ("<unk>", "<s>", "</s>", "<pad>")
    vocab, merges = kit.byte_bpe(specials)
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>",
                                            eos_token="</s>", pad_token="<pad>")
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = transformers.Mistral3Config(text_config=dict(model_type="mistral", **arch.t5["text"], **ids),
                                         vision_config=dict(model_type="pixtral", image_size=28, patch_size=14,
                                                            **arch.t5["vision"]), spatial_merge_size=1)
    return dict(vae=kit.make(diffusers.AutoencoderKLFlux2, arch.vae, 1), tokenizer=tokenizer,
                text_encoder=kit.make(transformers.Mistral3Model, config, 3), pe=None, pe_tokenizer=None)


ERNIE_IMAGE_ADAPTER = register(
    ModelAdapter(
        name="ernie-image",
        class_names=("ErnieImageTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("joint",),
            inputs={"layers.0": {"x": Split(dim=0, stream="joint", ndim=3)},
                    "layers.*": {"rotary_pos_emb": Split(dim=1, stream="joint", ndim=4),
                                 "temb": Split(dim=0, stream="joint", ndim=3)}},
            gathers={"layers.-1": Gather(dim=0, stream="joint")},
            differs_from_cp_plan="the class has no _cp_plan; the sequence-first [image, text] sequence is split where "
                                 "the blocks start, with its RoPE table and per-token modulation, and gathered where "
                                 "they end",
        ),
        attention=AttentionSelector(class_names=("ErnieImageAttention",)),
        sequence_processor=ErnieImageSequenceParallelProcessor,
        blocks=(BlockList("layers", ("x",), ("x",)),),
        token_wise=("layers.*.mlp",),
        example_inputs=ernie_image_example_inputs,
        layout=ernie_image_layout,
        text_tokens=512,
        tensor_plan=TensorPlan(
            colwise=("layers.*.self_attention.to_q", "layers.*.self_attention.to_k", "layers.*.self_attention.to_v",
                     "layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"),
            rowwise=("layers.*.self_attention.to_out.0", "layers.*.mlp.linear_fc2"),
            per_rank_attrs={"layers.*.self_attention": ("heads",)},
        ),
        batch_inputs=("hidden_states", "timestep", "text_bth", "text_lens"),
        cfg_mode="batched",  # one call on [uncond, cond]
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("ErnieImagePipeline",),
        synth_archs=(ERNIE_IMAGE_TINY, ERNIE_IMAGE),
        synth_components=ernie_image_components,
        meta_trace=ernie_image_meta_trace,
        pp_refusal="ERNIE-Image's blocks carry one sequence-first [image, text] sequence whose key mask PipeFusion "
                   "does not take",
    )
)
