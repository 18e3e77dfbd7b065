"""Nucleus-MoE (``NucleusMoEImageTransformer2DModel``, NucleusMoEImagePipeline): single-stream image blocks whose
queries attend over ``[image, text]`` keys, with expert-choice mixture-of-experts feed-forwards.

Where the tokens are: ``forward`` embeds the packed latents (``[B, N, C]``) and normalizes the text, builds the RoPE
tables (``pos_embed``: the image's ``[N, D / 2]`` and the text's ``[L, D / 2]``, complex) and a key mask over ``[image,
text]`` from the prompts' padding, and runs the blocks; each projects the whole text into its own context
(``encoder_proj``), attends from the image tokens to the keys of both, and runs its feed-forward: dense, or a MoE layer
where each expert picks its top-capacity tokens among all the image tokens of a sample.

Sequence plan: the image tokens split at the first block, the image table at every block (item 0), the text at every
block's input (each block projects it again); the text's table stays whole and the processor cuts its rows
(``token_range``). The queries are the image tokens only while sequence parallelism exchanges queries with the keys:
the local text keys serve as queries too and their rows are dropped (PRX's way). The expert-choice routing needs every
token of a sample, so the feed-forward runs on the whole sequence: the output of ``pre_mlp_norm`` is gathered (from
which the block builds both the MoE input and the router's input) and the feed-forward's output cut back to the rank's
tokens (one all-gather a block, the feed-forward computed whole on every rank: exact, not faster). The image is
gathered at ``proj_out``. Tensor plan: the attention by heads (query and key/value heads), the dense and shared-expert
SwiGLUs by width; the routed experts' packed weights stay whole on every rank (``NUCLEUSMOE_TENSOR_PLAN``). CFG: the prompt's call, then the
negative prompt's (sequential). A ``cached_txt_key`` passed in ``attention_kwargs`` is refused in one line.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_nucleusmoe_image import _apply_rotary_emb_nucleus

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, SequenceProcessor, Split,
                   SynthArch, TensorPlan, register, replace_forward, spatial_latent, token_range)
from .qwenimage import qwen3vl_sizes, qwen3vl_text_encoder


class NucleusMoESequenceParallelProcessor(SequenceProcessor):
    """Processor for Nucleus-MoE's attention (module docstring): diffusers' ``NucleusMoEAttnProcessor2_0`` on local
    tokens, the text keys doubling as dropped queries, the softmax through ``sp.attention`` with the whole key mask."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 cached_txt_key=None, cached_txt_value=None):
        if cached_txt_key is not None or encoder_hidden_states is None:
            raise NotImplementedError("Nucleus-MoE's cached text keys (attention_kwargs cached_txt_key) do not run "
                                      "under sequence parallelism: pass the text (encoder_hidden_states) instead")
        head_dim = attn.inner_dim // attn.heads
        kv_heads = attn.inner_kv_dim // head_dim
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        k, v = (p(hidden_states).unflatten(-1, (kv_heads, -1)) for p in (attn.to_k, attn.to_v))
        tk, tv = (p(encoder_hidden_states).unflatten(-1, (kv_heads, -1)) for p in (attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if attn.norm_added_k is not None:
            tk = attn.norm_added_k(tk)
        if image_rotary_emb is not None:
            image_table, text_table = image_rotary_emb
            q, k = (_apply_rotary_emb_nucleus(t, image_table, use_real=False) for t in (q, k))
            first, _ = token_range(self.sp, "text", tk.shape[1])  # the text's table is whole: this rank's rows
            tk = _apply_rotary_emb_nucleus(tk, text_table[first:first + tk.shape[1]], use_real=False)
        groups = attn.heads // kv_heads
        k, v, tk, tv = (t.repeat_interleave(groups, dim=2) if groups > 1 else t for t in (k, v, tk, tv))
        out = self.sp.attention(torch.cat([q, tk], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1),
                                backend=self._attention_backend, mask=attention_mask)
        out = attn.to_out[0](out[:, :q.shape[1]].flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def nucleusmoe_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one NucleusMoEImagePipeline step: 2x2-packed latents of an 8x VAE, the text states and
    their mask, the timestep and each sample's token grid."""
    cfg = model.config
    rows, cols = height // 16, width // 16
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, rows * cols, cfg.in_channels),
                encoder_hidden_states=rand(batch, text_len, cfg.joint_attention_dim),
                encoder_hidden_states_mask=torch.ones(batch, text_len, dtype=torch.long, device=device),
                timestep=torch.full((batch,), 0.7).to(device, dtype), img_shapes=[(1, rows, cols)] * batch,
                return_dict=False)


def nucleusmoe_meta_trace(model):
    """The planner's meta-device trace: the routed experts read their token counts on the host; every expert takes
    the same count under expert-choice routing (its capacity for each sample), so they run as one batched product of
    that cost."""
    undo = []
    for experts in (m for m in model.modules() if type(m).__name__ == "SwiGLUExperts"):
        def forward(x, num_tokens_per_expert, experts=experts):
            gate, up = torch.bmm(x.view(experts.num_experts, -1, x.shape[-1]), experts.gate_up_proj).chunk(2, dim=-1)
            return torch.bmm(torch.nn.functional.silu(gate) * up, experts.down_proj).view(-1, x.shape[-1])

        undo.append(replace_forward(experts, forward))
    return lambda: [u() for u in undo]


def nucleusmoe_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a NucleusMoEImagePipeline call: the VAE divides by 8, 2x2 latent patches become one token; the
    image and the text are split together."""
    lh, lw = spatial_latent(height, width, 16, "Nucleus-MoE (8x VAE, 2x2 packing)")
    image = (lh // 2) * (lw // 2)
    return Layout(image, text_tokens, image + text_tokens, (image, config.get("in_channels", 64)))


#: Megatron-style: the attention's Q, K, V and the text's K, V column-parallel by heads (the key/value heads too, so
#: tp must divide them: :func:`nucleusmoe_unsupported`), its output row-parallel; the SwiGLU feed-forwards of the dense
#: blocks and the MoE blocks' shared expert split by their hidden width (value and gate halves of ``net.0.proj``, each
#: cut on its own), ``net.2`` row-parallel. The routed experts (packed ``gate_up_proj``/``down_proj`` parameters, not
#: linears) and the router stay whole on every rank: the routing reads the whole replicated stream, so every rank picks
#: the same tokens and adds the same routed output after the shared expert's all-reduce. Two all-reduces a block.
_SWIGLU = ("../2.in_features", "../2.in_features")
NUCLEUSMOE_TENSOR_PLAN = TensorPlan(
    colwise=tuple(f"transformer_blocks.*.attn.{name}" for name in ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj")),
    rowwise=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.img_mlp.net.2?",
             "transformer_blocks.*.img_mlp.shared_expert.net.2?"),
    packed_colwise={"transformer_blocks.*.img_mlp.net.0.proj?": _SWIGLU,
                    "transformer_blocks.*.img_mlp.shared_expert.net.0.proj?": _SWIGLU},
    per_rank_attrs={"transformer_blocks.*.attn": ("heads", "inner_dim", "inner_kv_dim")},
)


def nucleusmoe_unsupported(model, config) -> str | None:
    """tp that does not divide the key/value heads (grouped-query attention): each rank needs whole K/V heads."""
    kv_heads = model.config.num_key_value_heads or model.config.num_attention_heads
    if config.tp > 1 and kv_heads % config.tp:
        return (f"tp={config.tp} does not divide Nucleus-MoE's {kv_heads} key/value heads; use a tp that divides "
                f"them, or ulysses, ring or cfg")
    return None


# -- synthetic architectures ---------------------------------------------------------------------------------
NUCLEUSMOE = SynthArch(
    name="nucleusmoe-image",
    description="Nucleus-MoE image transformer as diffusers' defaults (24 blocks, 16 heads x 128, 128 experts with "
                "expert-choice routing, text width 3584), the QwenImage VAE, an 8-layer Qwen3-VL of that width (the "
                "pipeline reads its 8th-last hidden state)",
    pipeline="NucleusMoEImagePipeline",
    transformer_class="NucleusMoEImageTransformer2DModel",
    transformer={},
    vae={}, clip={}, t5=qwen3vl_sizes(3584, 8, 128, [24, 20, 20]), scheduler={},
    default_dtype="bfloat16",
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_nucleusmoe_image.py)
NUCLEUSMOE_TINY = dataclasses.replace(
    NUCLEUSMOE,
    name="nucleusmoe-image-tiny",
    description="Nucleus-MoE at diffusers' test configuration: 2 dense blocks, 4 heads x 16, text width 16; its "
                "pipeline test's QwenImage VAE and 8-layer Qwen3-VL",
    transformer=dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                     num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=[8, 4, 4], moe_enabled=False,
                     capacity_factors=[8.0, 8.0]),
    vae=dict(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
             latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
    t5=qwen3vl_sizes(16, 8, 8, [1, 1, 2], kv_heads=2, intermediate_size=16),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=8,
)

_IMAGE = Split(dim=1, stream="image", ndim=3)


def nucleusmoe_components(arch: SynthArch, kit) -> dict:
    """NucleusMoEImagePipeline's other components: the QwenImage VAE (``arch.vae``) and a Qwen3-VL for conditional
    generation (``arch.t5``). In the processor's place (a Qwen3-VL processor, whose video processor needs torchvision)
    the local Qwen2 tokenizer it wraps, with the chat template: the pipeline calls it on text alone."""
    import diffusers

    encoder = qwen3vl_text_encoder(arch, kit, "Qwen3VLForConditionalGeneration")
    return dict(vae=kit.make(diffusers.AutoencoderKLQwenImage, arch.vae, 1), text_encoder=encoder["text_encoder"],
                processor=encoder["tokenizer"])

NUCLEUSMOE_ADAPTER = register(
    ModelAdapter(
        name="nucleusmoe-image",
        class_names=("NucleusMoEImageTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image", "text"),
            inputs={"transformer_blocks.0": {"hidden_states": _IMAGE},
                    "transformer_blocks.*": {"encoder_hidden_states": Split(dim=1, stream="text", ndim=3),
                                             "image_rotary_emb": Split(dim=0, stream="image", ndim=2, item=0)}},
            outputs={"transformer_blocks.*.img_mlp": {None: _IMAGE}},
            gathers={"transformer_blocks.*.pre_mlp_norm": Gather(dim=1, stream="image"),
                     "proj_out": Gather(dim=1, stream="image")},
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn",)),
        sequence_processor=NucleusMoESequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",), ("image",)),),
        example_inputs=nucleusmoe_example_inputs,
        tensor_plan=NUCLEUSMOE_TENSOR_PLAN,
        unsupported=nucleusmoe_unsupported,
        meta_trace=nucleusmoe_meta_trace,
        layout=nucleusmoe_layout,
        text_tokens=512,
        batch_inputs=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=-1,
        out_channels=lambda model: model.config.out_channels * model.config.patch_size ** 2,
        pipelines=("NucleusMoEImagePipeline",),
        synth_archs=(NUCLEUSMOE_TINY, NUCLEUSMOE),
        synth_components=nucleusmoe_components,
        pp_refusal="Nucleus-MoE's expert-choice feed-forwards run on the whole sequence; PipeFusion is not tested on "
                   "it",
    )
)
