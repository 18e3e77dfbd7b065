"""HunyuanVideo 1.5 (``models/hunyuan_variants.py``) under every axis on real gloo process groups, against one process:
the transformer on diffusers' own test configuration and inputs of its class (64 video tokens, 6 + 4 + 3 text tokens,
the image tokens padding) and on an odd count (3 latent frames of 3 x 3: 27 video tokens) with padded prompts of
different lengths, so that the text mask, reordered like the keys, decides the output."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cases_models import axis_id, sequence_counts, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2  # dual-stream blocks, one joint attention each


def arch_of(shape: str):
    """hunyuan-video-1.5-tiny: diffusers' ``get_init_dict`` of the class with the pipeline's 9 input channels; for
    diffusers' inputs, its 4."""
    from ditmesh.synth import get_arch

    arch = get_arch("hunyuan-video-1.5-tiny")
    return dataclasses.replace(arch, transformer=dict(arch.transformer, in_channels=4)) if shape == "diffusers" else arch


def inputs_of(shape: str) -> dict:
    """diffusers' ``get_dummy_inputs`` (batch 1, 1 latent frame of 8 x 8, texts of 6 and 4 tokens, zero image), or two
    samples at 27 video tokens whose Qwen and ByT5 prompts are padded to different lengths and whose image tokens are
    real (image-to-video)."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 4, 1, 8, 8), timestep=torch.tensor([1.0]),
                    encoder_hidden_states=rand(1, 6, 16), encoder_hidden_states_2=rand(1, 4, 8),
                    encoder_attention_mask=torch.ones(1, 6), encoder_attention_mask_2=torch.ones(1, 4),
                    image_embeds=torch.zeros(1, 3, 12), return_dict=False)
    mask = torch.tensor([[1] * 7 + [0] * 4, [1] * 3 + [0] * 8])
    mask_2 = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    return dict(hidden_states=rand(2, 9, 3, 3, 3), timestep=torch.tensor([700.0, 300.0]),
                encoder_hidden_states=rand(2, 11, 16), encoder_hidden_states_2=rand(2, 5, 8),
                encoder_attention_mask=mask, encoder_attention_mask_2=mask_2, image_embeds=rand(2, 3, 12),
                return_dict=False)


CONFIGS = [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2}]


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
@pytest.mark.parametrize("config", CONFIGS, ids=axis_id)
def test_hunyuan_video15_transformer_matches_single_process(pools, config, shape):
    inputs, arch = inputs_of(shape), arch_of(shape)
    ref, _ = transformer_call(arch, {}, inputs)
    # tp: 4 row-parallel linears a dual block (attention video and text outputs, both feed-forwards)
    want = {"all_reduce": 4 * LAYERS} if "tp" in config else sequence_counts(config, LAYERS, 1)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, arch, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == want


def test_hunyuan_video15_text_mask_and_image_tokens_matter():
    inputs, arch = inputs_of("odd"), arch_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    unmasked = dict(inputs, encoder_attention_mask=torch.ones_like(inputs["encoder_attention_mask"]))
    assert rel_err(transformer_call(arch, {}, unmasked)[0], ref) > 1e-3
    text_to_video = dict(inputs, image_embeds=torch.zeros_like(inputs["image_embeds"]))
    assert rel_err(transformer_call(arch, {}, text_to_video)[0], ref) > 1e-3


def test_hunyuan_video15_plans_at_its_native_size():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    adapter = adapter_for_class("HunyuanVideo15Transformer3DModel")
    layout = adapter.layout(get_arch("hunyuan-video-1.5").transformer, 480, 848, 121, 1000)
    assert layout.latent_shape == (65, 31, 30, 53) and layout.image_tokens == 31 * 30 * 53
    assert layout.text_tokens == 1000 + 256 + 729 and layout.split_tokens == layout.image_tokens + layout.text_tokens
    with pytest.raises(ValueError, match="multiple of 16"):
        adapter.layout(get_arch("hunyuan-video-1.5").transformer, 488, 848, 121, 1000)


def test_generate_runs_hunyuan_video15_as_one_process_does(tmp_path, tiny_checkpoints):
    # HunyuanVideo15Pipeline: CFG through its guider (two calls a step), no step callback (generate marks the steps at
    # the scheduler's step); ulysses 2 x cfg 2 on four ranks
    import json

    import diffusers
    from safetensors.torch import load_file

    from cases_models import run_ranks

    path, out = tiny_checkpoints("hunyuan-video-1.5-tiny"), tmp_path / "video.gif"
    run_ranks(["generate", "--model", path, "--frames", "5", "--height", "48", "--width", "48", "--steps", "2",
               "--out", str(out), "--save-latents", str(tmp_path / "latents.safetensors"), "--nproc", "4",
               "--ulysses", "2", "--cfg", "2"])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert len(report["step_latency_s"]) == 2
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=report["prompt"][0], height=48, width=48, num_frames=5, num_inference_steps=2,
                generator=torch.Generator("cpu").manual_seed(report["seed"]), output_type="latent").frames
    assert rel_err(load_file(str(tmp_path / "latents.safetensors"))["latents"], want) <= 1e-5


def test_a_pipeline_without_step_callbacks_is_timed_at_its_scheduler_steps_during_the_call_only():
    from ditmesh.runtime.generate import step_callback

    class Scheduler:
        def step(self, noise, t, latents, return_dict=False):
            return (latents - noise,)

    class Pipe:  # HunyuanVideo15Pipeline's case: neither callback_on_step_end nor callback
        scheduler = Scheduler()

        def __call__(self, prompt):
            return self.scheduler.step(torch.ones(1), 7, torch.full((1,), 3.0), return_dict=False)[0]

    seen = []
    pipe = Pipe()
    with step_callback(pipe, lambda p, i, t, kw: seen.append((i, t, kw["latents"].item()))) as kwargs:
        assert kwargs == {} and pipe(prompt="x").item() == 2.0
    assert seen == [(0, 7, 2.0)]
    assert "step" not in vars(pipe.scheduler)  # the scheduler is the user's again
    pipe(prompt="x")
    assert len(seen) == 1


# -- HunyuanVideo Framepack -----------------------------------------------------------------------------------------
FRAMEPACK = "hunyuan-video-framepack-tiny"  # diffusers' get_init_dict of the class


def framepack_inputs(shape: str) -> dict:
    """diffusers' ``get_dummy_inputs`` (batch 1: 3 frames of 4 x 4, clean and 2x history of 2 frames, 4x of 8: 12 + 8 +
    2 + 2 = 24 video tokens, the text cut to its length, no mask), or the pipeline's first window at 3 frames of 6 x 6
    for two prompts of different lengths (an odd count of video tokens, the key mask over [video, text])."""
    if shape == "diffusers":
        g = torch.Generator().manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        return dict(hidden_states=rand(1, 4, 3, 4, 4), timestep=torch.tensor([700.0]),
                    encoder_hidden_states=rand(1, 12, 16), pooled_projections=rand(1, 8),
                    encoder_attention_mask=torch.ones(1, 12), guidance=torch.tensor([300.0]),
                    image_embeds=rand(1, 12, 16), indices_latents=torch.ones(3), latents_clean=rand(1, 4, 2, 4, 4),
                    indices_latents_clean=torch.ones(2), latents_history_2x=rand(1, 4, 2, 4, 4),
                    indices_latents_history_2x=torch.ones(2), latents_history_4x=rand(1, 4, 8, 4, 4),
                    indices_latents_history_4x=torch.ones(8), return_dict=False)
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer(FRAMEPACK, dtype=torch.float32)
    inputs = adapter_for_class("HunyuanVideoFramepackTransformer3DModel").example_inputs(
        model, height=48, width=48, batch=2, text_len=11, generator=torch.Generator().manual_seed(3), device="cpu",
        dtype=torch.float32, frames=3)
    inputs["encoder_attention_mask"][1, 4:] = 0
    return dict(inputs, image_embeds=inputs["image_embeds"][:, :5], timestep=torch.tensor([700.0, 300.0]))


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
@pytest.mark.parametrize("config", CONFIGS, ids=axis_id)
def test_hunyuan_video_framepack_transformer_matches_single_process(pools, config, shape):
    inputs = framepack_inputs(shape)
    ref, _ = transformer_call(FRAMEPACK, {}, inputs)
    # tp: FLUX's plan, 4 all-reduces a dual block and 1 a single block; sp: one attention a block
    want = {"all_reduce": 4 + 1} if "tp" in config else sequence_counts(config, 2, 1)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, FRAMEPACK, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == want


def test_hunyuan_video_framepack_history_matters():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    layout = adapter_for_class("HunyuanVideoFramepackTransformer3DModel").layout(
        get_arch(FRAMEPACK).transformer, 48, 48, 3, 11)
    assert layout.image_tokens % 2 == 1  # the odd case's video tokens: 27 window + 18 clean + 2x and 4x history
    inputs = framepack_inputs("odd")
    ref = transformer_call(FRAMEPACK, {}, inputs)[0]
    other = dict(inputs, latents_history_4x=-inputs["latents_history_4x"])
    assert rel_err(transformer_call(FRAMEPACK, {}, other)[0], ref) > 1e-4

