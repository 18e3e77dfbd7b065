"""Wan's variants (``models/wan_variants.py``: ChronoEdit, Wan VACE, Wan Animate) under every axis on real gloo process
groups, against one process: each transformer on diffusers' own test configuration and inputs of its class and on an
odd token count (27 video tokens: chunks of 14 and 13, or 7, 7, 7 and 6, so that no rank holds whole frames), then one
pipeline of each family through ``generate`` (ChronoEdit's edit, VACE's text-to-video) and under cfg 2."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cases_models import axis_id, sequence_counts, transformer_call
from ditmesh.testing import rel_err

#: diffusers 0.42.1's ``get_init_dict`` of each class (tests/models/transformers/test_models_transformer_*.py)
DIFFUSERS_CONFIGS = {
    "chronoedit-tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16,
                            out_channels=16, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                            qk_norm="rms_norm_across_heads", eps=1e-06, image_dim=None, added_kv_proj_dim=None,
                            rope_max_seq_len=64, pos_embed_seq_len=None, rope_temporal_skip_len=8),
    "wan-vace-tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                          out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=4, cross_attn_norm=True,
                          qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=48),
    "wan-animate-tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12,
                             latent_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                             cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=16, rope_max_seq_len=32,
                             motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16,
                             motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                             face_encoder_num_heads=2, inject_face_latents_blocks=2),
}
CLASSES = {"chronoedit-tiny": "ChronoEditTransformer3DModel", "wan-vace-tiny": "WanVACETransformer3DModel",
           "wan-animate-tiny": "WanAnimateTransformer3DModel"}


def diffusers_inputs(arch: str) -> dict:
    """diffusers' ``get_dummy_inputs`` of the class (its shapes; our seed, and a float timestep)."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    timestep = torch.tensor([700.0])
    if arch == "chronoedit-tiny":  # 2 latent frames of 8 x 8: ChronoEdit's two-frame RoPE; 32 tokens
        return dict(hidden_states=rand(1, 16, 2, 8, 8), timestep=timestep, encoder_hidden_states=rand(1, 12, 32),
                    return_dict=False)
    if arch == "wan-vace-tiny":  # 2 latent frames of 16 x 16: 128 tokens
        return dict(hidden_states=rand(1, 16, 2, 16, 16), encoder_hidden_states=rand(1, 12, 32),
                    control_hidden_states=rand(1, 48, 2, 16, 16), timestep=timestep, return_dict=False)
    # Wan Animate: 21 latent frames of 16 x 16 (1344 tokens, 64 a frame), 77 face frames of 16 x 16
    return dict(hidden_states=rand(1, 12, 21, 16, 16), timestep=timestep, encoder_hidden_states=rand(1, 12, 16),
                encoder_hidden_states_image=rand(1, 12, 16), pose_hidden_states=rand(1, 4, 20, 16, 16),
                face_pixel_values=rand(1, 3, 77, 16, 16), return_dict=False)


def case(arch: str, shape: str):
    """(the architecture, one step's inputs): diffusers' configuration and inputs, or our tiny architecture at 27 video
    tokens (3 latent frames of 3 x 3 patches) with 11 text tokens and two samples."""
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer, get_arch

    if shape == "diffusers":
        return dataclasses.replace(get_arch(arch), transformer=DIFFUSERS_CONFIGS[arch]), diffusers_inputs(arch)
    model = build_transformer(arch, dtype=torch.float32)
    frames = 5 if arch == "wan-animate-tiny" else 9  # Animate: 2 latent frames and the reference frame
    inputs = adapter_for_class(CLASSES[arch]).example_inputs(
        model, height=48, width=48, batch=2, text_len=11, generator=torch.Generator().manual_seed(3), device="cpu",
        dtype=torch.float32, frames=frames)
    return get_arch(arch), dict(inputs, timestep=torch.tensor([700.0, 300.0]))


#: self-attentions over the split video tokens per call, and tp all-reduces per call, by architecture and shape
SELF_ATTENTIONS = {"chronoedit-tiny": 2, "wan-vace-tiny": 6, "wan-animate-tiny": 2}  # VACE: 4 blocks + 2 VACE blocks
ALL_REDUCES = {
    # 3 row-parallel linears and 4 sharded QK-norms per Wan block; the image context's norm_added_k one more
    ("chronoedit-tiny", "diffusers"): 2 * 7, ("chronoedit-tiny", "odd"): 2 * 8,
    ("wan-vace-tiny", "diffusers"): 6 * 7, ("wan-vace-tiny", "odd"): 6 * 7,
    # Animate's face adapter: one row-parallel output
    ("wan-animate-tiny", "diffusers"): 2 * 7 + 1, ("wan-animate-tiny", "odd"): 2 * 7 + 1,
}
CONFIGS = [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2}]


def counts_of(arch: str, shape: str, config: dict) -> dict:
    if "tp" in config:
        return {"all_reduce": ALL_REDUCES[arch, shape]}
    return sequence_counts(config, SELF_ATTENTIONS[arch], 1)


def distinct_face_frames(model) -> None:
    """Make every latent frame's motion tokens differ: the tiny motion encoder gives nearly the same output for every
    face frame (its frames differ by ~1e-6), which would hide a token attending to the wrong frame's motion tokens."""

    def hook(module, args, out):
        return out + torch.randn(out.shape, generator=torch.Generator().manual_seed(7)) * out.std()

    if hasattr(model, "face_encoder"):
        model.face_encoder.register_forward_hook(hook)


def roll_face_frames(model) -> None:
    """:func:`distinct_face_frames`, then the motion tokens of frame ``t`` given to frame ``t + 1``."""
    distinct_face_frames(model)
    model.face_encoder.register_forward_hook(lambda module, args, out: out.roll(1, dims=1))


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
@pytest.mark.parametrize("config", CONFIGS, ids=axis_id)
@pytest.mark.parametrize("arch", list(CLASSES))
def test_wan_variant_transformer_matches_single_process(pools, arch, config, shape):
    model_arch, inputs = case(arch, shape)
    ref, _ = transformer_call(model_arch, {}, inputs, prepare=distinct_face_frames)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, model_arch, config, inputs,
                                                              prepare=distinct_face_frames):
        assert rel_err(out, ref) <= 1e-5
        assert counts == counts_of(arch, shape, config)


def test_what_each_variant_adds_changes_the_output():
    # the inputs the plans split or keep whole beyond Wan's must matter, or the cases above could not fail
    arch, inputs = case("wan-vace-tiny", "odd")
    ref = transformer_call(arch, {}, inputs)[0]
    assert rel_err(transformer_call(arch, {}, dict(inputs, control_hidden_states=-inputs["control_hidden_states"]))[0],
                   ref) > 1e-3
    arch, inputs = case("wan-animate-tiny", "odd")
    ref = transformer_call(arch, {}, inputs, prepare=distinct_face_frames)[0]
    # each frame's tokens attend to their own frame's motion tokens: the frames' motion tokens rolled by one differ
    assert rel_err(transformer_call(arch, {}, inputs, prepare=roll_face_frames)[0], ref) > 1e-3
    arch, inputs = case("chronoedit-tiny", "diffusers")  # ChronoEdit's RoPE differs from Wan's at two latent frames
    wan = dataclasses.replace(arch, transformer_class="WanTransformer3DModel",
                              transformer={k: v for k, v in arch.transformer.items() if k != "rope_temporal_skip_len"})
    assert rel_err(transformer_call(wan, {}, inputs)[0], transformer_call(arch, {}, inputs)[0]) > 1e-3


@pytest.mark.parametrize("arch", ["wan-vace-tiny", "wan-animate-tiny"])
def test_vace_and_animate_refuse_pipefusion_and_step_caches(arch):
    # their hints and face outputs are added between blocks by the forward: not one stack of blocks
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.config import ConfigError
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer(arch, dtype=torch.float32)

    with pytest.raises(ConfigError, match="step caches do not run wan-.*: its .* between blocks"):
        parallelize(Pipe, ParallelConfig(), cache="fbcache:0.08")
    with pytest.raises(NotImplementedError, match="PipeFusion does not run wan-.* between blocks"):
        parallelize(Pipe, ParallelConfig(pp=2))


# -- pipelines: generate end to end, and CFG as the pipelines run it -----------------------------------------------
def _pipeline_latents(path: str, report: dict, **call):
    """The pipeline in folder ``path`` called in this process with ``report``'s prompt, seed and guidance, latents out."""
    import diffusers

    from ditmesh.models import adapter_for_class

    pipe = diffusers.DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    setups = [adapter_for_class(type(pipe.transformer).__name__).pipeline_setup]
    setups += [p.setup for p in adapter_for_class(type(pipe.transformer).__name__).image_pipelines]
    for setup in filter(None, setups):
        setup()
    return pipe(prompt=report["prompt"][0], num_inference_steps=report["steps"], guidance_scale=report["guidance"],
                generator=torch.Generator("cpu").manual_seed(report["seed"]), max_sequence_length=16,
                output_type="latent", **call).frames


@pytest.mark.parametrize("arch, parallel", [("wan-vace-tiny", ["--ulysses", "2"]), ("chronoedit-tiny", ["--cfg", "2"])],
                         ids=["vace-ulysses2", "chronoedit-cfg2"])
def test_generate_runs_each_variant_as_one_process_does(tmp_path, tiny_checkpoints, arch, parallel):
    # VACE: WanVACEPipeline text-to-video (no control video: the pipeline conditions on a blank one); ChronoEdit: its
    # image edit (the image as the first of five frames), CFG's two calls a step on two ranks
    import json

    from safetensors.torch import load_file

    from cases_image import condition_image
    from cases_models import run_ranks

    path, out = tiny_checkpoints(arch), tmp_path / "video.gif"
    image = []
    if arch == "chronoedit-tiny":
        condition_image(48, 48).save(tmp_path / "cond.png")
        image = ["--image", str(tmp_path / "cond.png")]
    run_ranks(["generate", "--model", path, *image, "--frames", "5", "--height", "48", "--width", "48", "--steps", "2",
               "--guidance", "4", "--out", str(out), "--save-latents", str(tmp_path / "latents.safetensors"),
               "--nproc", "2", *parallel])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert report["frames"] == 5 and report["guidance"] == 4
    call = dict(height=48, width=48, num_frames=5)
    if image:
        from PIL import Image

        call["image"] = Image.open(tmp_path / "cond.png").convert("RGB")
    want = _pipeline_latents(path, report, **call)
    assert rel_err(load_file(str(tmp_path / "latents.safetensors"))["latents"], want) <= 1e-5
