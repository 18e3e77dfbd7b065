"""DiT (``DiTTransformer2DModel``, ``DiTPipeline``): the class-conditional DiT of Peebles and Xie, image tokens only.

``forward`` patchifies the latent with its sine-cosine positions (``pos_embed``), runs ``BasicTransformerBlock``s
(self-attention only, AdaLN-Zero from the timestep and the class label), modulates and projects (``proj_out_2``) and
unpatchifies a square grid. Sequence plan: the image tokens split at ``pos_embed``'s output, ``proj_out_2``'s output
gathered; the blocks' self-attention runs through PixArt's processor (diffusers' ``AttnProcessor2_0`` with the softmax
attention through ``sp.attention``). Tensor plan: PixArt's for ``attn1`` and the feed-forward (2 all-reduces per block).
CFG: one call on ``[cond, uncond]`` class labels (batched).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import (AttentionSelector, BlockList, Gather, Layout, ModelAdapter, SequencePlan, Split, SynthArch,
                   TensorPlan, register, spatial_latent)
from .pixart import _SDXL_VAE, PixArtSequenceParallelProcessor


def dit_example_inputs(model, height, width, batch, text_len, generator, device, dtype, frames=None) -> dict:
    """Transformer inputs of one DiTPipeline step: latents 8x smaller than the image, a class label per sample."""
    cfg = model.config
    labels = torch.randint(0, cfg.num_embeds_ada_norm, (batch,), generator=generator)
    return dict(hidden_states=torch.randn(batch, cfg.in_channels, height // 8, width // 8, generator=generator).to(
                    device, dtype),
                timestep=torch.full((batch,), 700, dtype=torch.long, device=device), class_labels=labels.to(device),
                return_dict=False)


def dit_layout(config: dict, height: int, width: int, frames: int, text_tokens: int) -> Layout:
    """Token counts of a DiTPipeline call: the VAE divides by 8, ``patch_size`` square patches become one token; no
    text (DiT unpatchifies a square grid)."""
    patch = config.get("patch_size", 2)
    lh, lw = spatial_latent(height, width, 8 * patch, f"DiT (8x VAE, {patch}x{patch} patches)")
    if lh != lw:
        raise ValueError(f"DiT renders square images (its unpatchify reads a square grid): {height}x{width}; use "
                         f"{height}x{height}")
    image = (lh // patch) * (lw // patch)
    return Layout(image, 0, image, (config.get("in_channels", 4), lh, lw))


DIT_XL = SynthArch(
    name="dit-xl-2-256",
    description="DiT-XL/2-256 transformer (28 blocks, 16 heads x 72, 1000 classes), the SD VAE; classes by id",
    pipeline="DiTPipeline",
    transformer_class="DiTTransformer2DModel",
    transformer=dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                     activation_fn="gelu-approximate", attention_bias=True, norm_type="ada_norm_zero",
                     num_embeds_ada_norm=1000, patch_size=2, sample_size=32),
    vae=dict(_SDXL_VAE, scaling_factor=0.18215), clip={}, t5={},
    scheduler=dict(num_train_timesteps=1000),
    scheduler_class="DDIMScheduler",
    default_dtype="float16",
    default_size=(256, 256),
    max_sequence_length=0,
)

#: diffusers' test configuration (tests/models/transformers/test_models_dit_transformer2d.py): 1 block, 2 heads of 4,
#: 8 classes, an 8 x 8 latent
DIT_TINY = dataclasses.replace(
    DIT_XL, name="dit-tiny",
    description="DiT at diffusers' test configuration: 1 block, 2 heads x 4, 8 classes (named cat, dog, tree, house, "
                "car, flower, mountain, sea); a tiny VAE; no CFG (the pipeline's null class is 1000)",
    transformer=dict(DIT_XL.transformer, num_attention_heads=2, attention_head_dim=4, num_layers=1,
                     num_embeds_ada_norm=8, sample_size=8),
    vae=dict(DIT_XL.vae, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64),
    # the class names the pipeline maps prompts to (written to model_index.json as DiT checkpoints have them)
    pipeline_config=dict(id2label=dict(enumerate("cat dog tree house car flower mountain sea".split()))),
    default_dtype="float32", default_size=(64, 64))

def dit_components(arch: SynthArch, kit) -> dict:
    """DiTPipeline's other component: the SD VAE (``arch.vae``); no text encoder (it generates classes)."""
    import diffusers

    return dict(vae=kit.make(diffusers.AutoencoderKL, arch.vae, 1))


def dit_call_arguments(pipe, kwargs: dict) -> dict:
    """DiTPipeline's call: each prompt is a class, by a name the checkpoint's ``id2label`` knows or by its id; CFG
    (``--guidance`` > 1) adds the null class 1000, which a checkpoint of fewer classes does not have."""
    classes = pipe.transformer.config.num_embeds_ada_norm
    prompts = kwargs.pop("prompt")
    labels = []
    for prompt in [prompts] if isinstance(prompts, str) else prompts:
        label = pipe.labels.get(prompt.strip(), int(prompt) if prompt.strip().isdigit() else None)
        if label is None or not 0 <= label < classes:
            known = f"a class name it knows ({', '.join(list(pipe.labels)[:4])}, ...) or " if pipe.labels else ""
            raise ValueError(f"--prompt {prompt!r}: DiT generates one of its {classes} classes; give {known}a class "
                             f"id from 0 to {classes - 1}")
        labels.append(label)
    if kwargs.get("guidance_scale", 1) > 1 and classes < 1001:
        raise ValueError(f"--guidance {kwargs['guidance_scale']}: DiTPipeline's CFG uses the null class 1000, and this "
                         f"checkpoint has {classes} classes; use --guidance 1")
    return dict(kwargs, class_labels=labels)


DIT_ADAPTER = register(
    ModelAdapter(
        name="dit",
        class_names=("DiTTransformer2DModel",),
        num_heads=lambda model: model.config.num_attention_heads,
        sequence_plan=SequencePlan(
            streams=("image",),
            outputs={"pos_embed": {None: Split(dim=1, stream="image", ndim=3)}},
            gathers={"proj_out_2": Gather(dim=1, stream="image")},
            differs_from_cp_plan="the class has no _cp_plan; image tokens split where they appear, gathered after the "
                                 "last projection",
        ),
        attention=AttentionSelector(paths=("transformer_blocks.*.attn1",)),
        sequence_processor=PixArtSequenceParallelProcessor,
        blocks=(BlockList("transformer_blocks", ("hidden_states",), ("hidden_states",), ("image",)),),
        token_wise=("transformer_blocks.*.ff",),
        example_inputs=dit_example_inputs,
        layout=dit_layout,
        text_tokens=0,
        tensor_plan=TensorPlan(
            colwise=("transformer_blocks.*.attn1.to_q", "transformer_blocks.*.attn1.to_k",
                     "transformer_blocks.*.attn1.to_v", "transformer_blocks.*.ff.net.0.proj"),
            rowwise=("transformer_blocks.*.attn1.to_out.0", "transformer_blocks.*.ff.net.2"),
            per_rank_attrs={"transformer_blocks.*.attn1": ("heads", "inner_dim")},
        ),
        batch_inputs=("hidden_states", "timestep", "class_labels"),
        cfg_mode="batched",  # one call on the class labels and the null class
        output_channel_dim=1,
        out_channels=lambda model: model.config.out_channels,
        pipelines=("DiTPipeline",),
        synth_archs=(DIT_TINY, DIT_XL),
        synth_components=dit_components,
        call_arguments=dit_call_arguments,
    )
)
