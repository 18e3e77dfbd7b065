"""JoyImage-Edit (``JoyImageEditTransformer3DModel``, JoyImageEditPipeline): dual-stream blocks, an image and a text
stream, each with its fused Q/K/V, joined in one attention without a mask.

Where the tokens are: ``forward`` takes the latents ``[B, C, T, H, W]``, or ``[B, items, C, T, H, W]`` for an edit
(the target and its reference images, laid one after another along time, the target moved first), patchifies them
into ``[B, N, D]`` image tokens, projects the text, builds the RoPE tables with a method (not a module): the image's
cos and sin ``[N, D]`` and, under ``rope_type="mrope"``, the text's ``[L, D]`` (positions after the largest image
index), and hands every block ``image_rotary_emb=(image table, text table or None)``. The blocks return both streams;
only the image goes on to ``norm_out`` and ``proj_out``.

Sequence plan: the image and text streams split at the input of the first block, the image table (item 0) at every
block; the image gathered at ``proj_out``'s output (narrower than the blocks', and both layers act per token). The
text table is whole in every block: the processor cuts this rank's rows from it at its offset in the text stream
(``base.token_range``). Attention: the local ``[image, text]`` Q/K/V through ``sp.attention`` (no mask: the ranks'
order needs none), then each stream's output projection.

Tensor plan: each stream's fused Q/K/V column-parallel in three parts (a rank keeps its heads of Q, of K and of V),
its output projection and the feed-forwards' down projections row-parallel: 4 all-reduces a block. CFG: the prompt's
call, then the negative prompt's (sequential).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers.models.transformers.transformer_joyimage import _apply_rotary_emb
from diffusers.models.transformers.transformer_joyimage_edit_plus import _apply_rotary_emb_batched

from .base import (AttentionSelector, BlockList, Gather, ImagePipeline, Layout, ModelAdapter, SequencePlan,
                   SequenceProcessor, Split, SynthArch, TensorPlan, register, spatial_latent, token_range,
                   torchvision_error)
from .qwenimage import qwen3vl_processor, qwen3vl_sizes, qwen3vl_text_encoder


class JoyImageSequenceParallelProcessor(SequenceProcessor):
    """Processor for ``JoyImageAttention``: diffusers' ``JoyImageAttnProcessor`` on local tokens, the softmax over
    the joined ``[image, text]`` streams through ``sp.attention`` (with Edit Plus's key mask, in the model's order)."""

    #: diffusers' rotation of Q and K by a table
    rotate = staticmethod(_apply_rotary_emb)

    @staticmethod
    def tables(image_rotary_emb):
        """(the image's table, the text's or None) from the blocks' ``image_rotary_emb``."""
        return image_rotary_emb if image_rotary_emb is not None else (None, None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, image_rotary_emb=None, attention_mask=None):
        def heads(qkv: torch.Tensor, q_norm, k_norm):
            q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in qkv.chunk(3, dim=-1))
            return q_norm(q), k_norm(k), v

        iq, ik, iv = heads(attn.img_attn_qkv(hidden_states), attn.img_attn_q_norm, attn.img_attn_k_norm)
        tq, tk, tv = heads(attn.txt_attn_qkv(encoder_hidden_states), attn.txt_attn_q_norm, attn.txt_attn_k_norm)
        image_table, text_table = self.tables(image_rotary_emb)
        if image_table is not None:
            iq, ik = self.rotate(iq, ik, image_table)
        if text_table is not None:  # whole on every rank: this rank's text rows
            first, _ = token_range(self.sp, "text", tq.shape[1])
            tq, tk = self.rotate(tq, tk, tuple(t[first:first + tq.shape[1]] for t in text_table))
        out = self.sp.attention(torch.cat([iq, tq], 1), torch.cat([ik, tk], 1), torch.cat([iv, tv], 1),
                                backend=self._attention_backend, mask=attention_mask)
        image_out, text_out = out.flatten(2, 3).to(iq.dtype).split([iq.shape[1], tq.shape[1]], dim=1)
        return attn.img_attn_proj(image_out), attn.txt_attn_proj(text_out)


class JoyImagePlusSequenceParallelProcessor(JoyImageSequenceParallelProcessor):
    """Processor for ``JoyImageEditPlusAttention``: the image's table per sample (``[B, N, D]``), no text table."""

    rotate = staticmethod(_apply_rotary_emb_batched)

    @staticmethod
    def tables(image_rotary_emb):
        return image_rotary_emb, None


def joyimage_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one JoyImageEditPipeline step of an edit: the target and one reference image as two
    items of one latent frame each, 8x smaller (the Wan VAE), the text encoder's states and the timestep."""
    cfg = model.config
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, 2, cfg.in_channels, 1, height // 8, width // 8),
                timestep=torch.full((batch,), 700.0).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_dim), return_dict=False)


def joyimage_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of an edit (the target and one reference image): the Wan VAE divides by 8, 2x2 patches; the image
    and the text streams are split together."""
    _, ph, pw = config.get("patch_size", (1, 2, 2))
    lh, lw = spatial_latent(height, width, 8 * ph, "JoyImage-Edit (8x VAE, 2x2 patches)")
    image = 2 * (lh // ph) * (lw // pw)
    return Layout(image, text_tokens, image + text_tokens, (2, config.get("in_channels", 16), 1, lh, lw))


def joyimage_components(arch: SynthArch, kit) -> dict:
    """JoyImageEditPipeline's (and Edit Plus's) other components: the Wan VAE (``arch.vae``) and a Qwen3-VL for
    conditional generation (``arch.t5``) with the local Qwen2 tokenizer and, where torchvision imports, a Qwen3-VL
    processor over it (:func:`~ditmesh.models.qwenimage.qwen3vl_processor`: the pipeline puts the reference image in the
    prompt through it). Where torchvision does not import (the processor's video processor needs it), the tokenizer
    stands in the processor's place: the pipeline calls the processor only for that image, so the checkpoint generates
    from text alone (``generate --image`` refuses it in one line)."""
    import diffusers

    if torchvision_error() is None:
        encoder = qwen3vl_processor(arch, kit)
    else:
        encoder = qwen3vl_text_encoder(arch, kit, "Qwen3VLForConditionalGeneration")
        encoder["processor"] = encoder["tokenizer"]
    return dict(vae=kit.make(diffusers.AutoencoderKLWan, arch.vae, 1), **encoder)


def _each(*suffixes: str) -> tuple[str, ...]:
    return tuple(f"double_blocks.*.{suffix}" for suffix in suffixes)


JOYIMAGE_TENSOR_PLAN = TensorPlan(
    colwise=_each("img_mlp.net.0.proj", "txt_mlp.net.0.proj"),
    rowwise=_each("attn.img_attn_proj", "attn.txt_attn_proj", "img_mlp.net.2", "txt_mlp.net.2"),
    packed_colwise={pattern: ("img_attn_proj.in_features",) * 3
                    for pattern in _each("attn.img_attn_qkv", "attn.txt_attn_qkv")},
    per_rank_attrs={"double_blocks.*.attn": ("heads",)},
)

# -- synthetic architectures ---------------------------------------------------------------------------------
JOYIMAGE_EDIT = SynthArch(
    name="joyimage-edit",
    description="JoyImage-Edit transformer as diffusers' defaults (20 dual-stream blocks, 24 heads x 128, text width "
                "4096), the Wan VAE, a two-layer Qwen3-VL of Qwen3-VL-8B's width",
    pipeline="JoyImageEditPipeline",
    transformer_class="JoyImageEditTransformer3DModel",
    transformer=dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=3072, num_attention_heads=24, text_dim=4096,
                     num_layers=20, rope_dim_list=[16, 56, 56], theta=256),
    vae={}, clip={}, t5=qwen3vl_sizes(4096, 2, 128, [24, 20, 20]), scheduler={},
    default_dtype="bfloat16",
    max_sequence_length=512,
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_joyimage.py)
JOYIMAGE_TINY = dataclasses.replace(
    JOYIMAGE_EDIT,
    name="joyimage-edit-tiny",
    description="JoyImage-Edit at diffusers' test configuration: 2 blocks, 2 heads x 16, text width 16; a Wan VAE 2 "
                "channels wide without residual blocks (the pipeline decodes 1024 x 1024) and a two-layer Qwen3-VL",
    transformer=dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16,
                     num_layers=2, rope_dim_list=[4, 6, 6], theta=256),
    vae=dict(base_dim=2, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=0, temperal_downsample=[False, True, True]),
    t5=qwen3vl_sizes(16, 2, 8, [1, 1, 2], kv_heads=2, intermediate_size=16),
    default_dtype="float32",
    default_size=(64, 64),
    max_sequence_length=32,
)

JOYIMAGE = register(
    ModelAdapter(
        name="joyimage-edit",
        class_names=("JoyImageEditTransformer3DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image", "text"),
            inputs={"double_blocks.0": {"hidden_states": Split(dim=1, stream="image", ndim=3),
                                        "encoder_hidden_states": Split(dim=1, stream="text", ndim=3)},
                    "double_blocks.*": {"image_rotary_emb": Split(dim=0, stream="image", ndim=2, item=0)}},
            gathers={"proj_out": Gather(dim=1, stream="image")},
        ),
        attention=AttentionSelector(class_names=("JoyImageAttention",)),
        sequence_processor=JoyImageSequenceParallelProcessor,
        blocks=(BlockList("double_blocks", ("hidden_states", "encoder_hidden_states"),
                          ("hidden_states", "encoder_hidden_states"), ("image", "text")),),
        token_wise=_each("img_mlp", "txt_mlp"),
        example_inputs=joyimage_example_inputs,
        layout=joyimage_layout,
        text_tokens=512,
        tensor_plan=JOYIMAGE_TENSOR_PLAN,
        batch_inputs=("hidden_states", "timestep", "encoder_hidden_states"),
        cfg_mode="sequential",  # the prompt's call, then the negative prompt's
        output_channel_dim=-4,  # [B, (items,) C, T, H, W]
        out_channels=lambda model: model.out_channels,
        pipelines=("JoyImageEditPipeline",),
        # the reference image (the pipeline's own class, which also generates from text alone)
        image_pipelines=(ImagePipeline("edit", "JoyImageEditPipeline", strength=False, processor="Qwen3VLProcessor"),),
        synth_archs=(JOYIMAGE_TINY, JOYIMAGE_EDIT),
        synth_components=joyimage_components,
        pp_refusal="PipeFusion is not tested on JoyImage-Edit's dual-stream blocks",
    )
)


# -- JoyImage-Edit Plus: the same blocks over pre-patchified images of their own sizes -------------------------
def joyimage_plus_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one JoyImageEditPlusPipeline step: the target's and one reference image's 2 x 2 patches
    of an 8x VAE latent, packed one after the other (``shape_list``: each sample's grids), the text and its mask."""
    cfg = model.config
    rows, cols = height // 16, width // 16
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    return dict(hidden_states=rand(batch, 2 * rows * cols, cfg.in_channels, *cfg.patch_size),
                timestep=torch.full((batch,), 700.0).to(device, dtype),
                encoder_hidden_states=rand(batch, text_len, cfg.text_dim),
                encoder_hidden_states_mask=torch.ones(batch, text_len, device=device),
                shape_list=[[(1, rows, cols), (1, rows, cols)] for _ in range(batch)], return_dict=False)


def joyimage_plus_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """:func:`joyimage_layout`'s tokens, the latent as Edit Plus takes it: ``[patches, C, 1, 2, 2]``."""
    layout = joyimage_layout(config, height, width, frames, text_tokens)
    return dataclasses.replace(layout, latent_shape=(layout.image_tokens, config.get("in_channels", 16),
                                                     *config.get("patch_size", (1, 2, 2))))


JOYIMAGE_EDIT_PLUS = dataclasses.replace(
    JOYIMAGE_EDIT,
    name="joyimage-edit-plus",
    description="JoyImage-Edit Plus transformer as diffusers' defaults (20 dual-stream blocks, 24 heads x 128, text "
                "width 4096), the Wan VAE, a two-layer Qwen3-VL of Qwen3-VL-8B's width",
    pipeline="JoyImageEditPlusPipeline",
    transformer_class="JoyImageEditPlusTransformer3DModel",
)

#: diffusers' test configuration (tests/models/transformers/test_models_transformer_joyimage_edit_plus.py)
JOYIMAGE_PLUS_TINY = dataclasses.replace(
    JOYIMAGE_TINY,
    name="joyimage-edit-plus-tiny",
    description="JoyImage-Edit Plus at diffusers' test configuration: 2 blocks, 2 heads x 16, text width 16; "
                "JoyImage-Edit's tiny Wan VAE and two-layer Qwen3-VL",
    pipeline=JOYIMAGE_EDIT_PLUS.pipeline,
    transformer_class=JOYIMAGE_EDIT_PLUS.transformer_class,
)

JOYIMAGE_PLUS = register(dataclasses.replace(
    JOYIMAGE,
    name="joyimage-edit-plus",
    class_names=("JoyImageEditPlusTransformer3DModel",),
    sequence_plan=dataclasses.replace(JOYIMAGE.sequence_plan, inputs={
        "double_blocks.0": JOYIMAGE.sequence_plan.inputs["double_blocks.0"],
        # the image's table per sample, cos and sin [B, N, D]; the key mask [B, 1, 1, N + L] stays whole
        "double_blocks.*": {"image_rotary_emb": Split(dim=1, stream="image", ndim=3)}}),
    attention=AttentionSelector(class_names=("JoyImageEditPlusAttention",)),
    sequence_processor=JoyImagePlusSequenceParallelProcessor,
    example_inputs=joyimage_plus_example_inputs,
    layout=joyimage_plus_layout,
    batch_inputs=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "shape_list"),
    batch_lists=("shape_list",),
    cfg_mode="batched",  # one call on [uncond, cond], the grids listed twice
    output_channel_dim=2,  # [B, patches, C, pt, ph, pw]
    pipelines=("JoyImageEditPlusPipeline",),
    image_pipelines=(),  # its reference images are not run by generate yet
    synth_archs=(JOYIMAGE_PLUS_TINY, JOYIMAGE_EDIT_PLUS),
    synth_components=joyimage_components,
    pp_refusal="PipeFusion is not tested on JoyImage-Edit Plus's dual-stream blocks",
))
