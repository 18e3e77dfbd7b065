"""Mochi under every axis on real gloo process groups, against one process: the joint [video, text] attention of
streams of different widths, run for all samples at once under a key-padding mask over the joint sequence where the
model loops over each sample's valid caption tokens; captions of unequal valid lengths in every call."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cases_models import EVERY_AXIS, axis_id, check_ranks, pipeline_generate, sequence_counts, transformer_call
from ditmesh.testing import rel_err

#: two prompts of different lengths and CFG's empty negative prompt: four captions, four valid lengths
PROMPTS = ["a red circle", "a big blue square on a green field under a yellow sun at noon"]
LAYERS, STEPS = 2, 2
#: video tokens: latent frames ((frames - 1) / 6 + 1) x H/16 x W/16, and the caption's max_sequence_length text
#: tokens, each stream split on its own: 2 x 16 = 32 and 32 (divide 2 and 4); 3 x 9 = 27 and 31 (divide neither)
SHAPES = {"even": dict(height=64, width=64, frames=7, max_sequence_length=32),
          "uneven": dict(height=48, width=48, frames=13, max_sequence_length=31)}
#: all-reduces per call under tp: attention out, text out, both feed-forwards' out in block 0; the last block
#: (context_pre_only) has no text output projection and no text feed-forward
TP_ALL_REDUCES = 4 + 2


@pytest.fixture(scope="module")
def mochi_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("mochi-tiny")


@functools.cache
def reference(path: str, shape: str) -> torch.Tensor:
    """The one-process latents of the two prompts with CFG at ``shape``, computed once per session."""
    return pipeline_generate(path, {}, steps=STEPS, prompt=PROMPTS, guidance_scale=4.5, **SHAPES[shape])[0]


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: one transformer call a step (CFG batched)."""
    if "cfg" in config or "dp" in config:
        return {"all_gather": STEPS}  # each call's output gathered over the ranks' halves of the batch
    if "tp" in config:
        return {"all_reduce": TP_ALL_REDUCES * STEPS}
    return sequence_counts(config, LAYERS, STEPS)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", EVERY_AXIS, ids=axis_id)
def test_mochi_pipeline_matches_single_process(pools, mochi_tiny, config, shape):
    ref = reference(mochi_tiny, shape)
    outs = pools(math.prod(config.values())).run(pipeline_generate, mochi_tiny, config, steps=STEPS, prompt=PROMPTS,
                                                 guidance_scale=4.5, **SHAPES[shape])
    check_ranks(outs, ref, STEPS, expected_counts(config))


def test_mochi_pipeline_passes_unequal_caption_masks(mochi_tiny):
    # the case the parallel runs must carry: every call's captions have different valid lengths
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(mochi_tiny, dtype=torch.float32)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["encoder_attention_mask"]), with_kwargs=True)
    pipe.set_progress_bar_config(disable=True)
    pipe(PROMPTS, num_inference_steps=2, guidance_scale=4.5, output_type="latent", height=48, width=48, num_frames=7,
         max_sequence_length=32)
    lengths = seen[0].sum(1).tolist()
    assert len(set(lengths)) == 3 and max(lengths) < 32  # "", and the two prompts; all padded


# -- the transformer itself ------------------------------------------------------------------------------------
TRANSFORMER_CONFIGS = [{"ulysses": 4}, {"ring": 4}, {"tp": 2, "ulysses": 2}, {"tp": 2, "ring": 2}]


def transformer_inputs(shape: str) -> dict:
    """One step's inputs at ``shape`` (three samples, captions of 3 valid lengths: full, -3 and -6 tokens)."""
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    size = dict(SHAPES[shape])
    text = size.pop("max_sequence_length")
    model = build_transformer("mochi-tiny", dtype=torch.float32)
    return adapter_for_class("MochiTransformer3DModel").example_inputs(
        model, batch=3, text_len=text, generator=torch.Generator().manual_seed(3), device="cpu", dtype=torch.float32,
        **size)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", TRANSFORMER_CONFIGS, ids=axis_id)
def test_mochi_transformer_with_caption_masks_matches_single_process(pools, config, shape):
    inputs = transformer_inputs(shape)
    ref, _ = transformer_call("mochi-tiny", {}, inputs)
    expected = sequence_counts({k: v for k, v in config.items() if k != "tp"}, LAYERS, 1)
    if "tp" in config:
        expected["all_reduce"] = TP_ALL_REDUCES
    for out, counts in pools(math.prod(config.values())).run(transformer_call, "mochi-tiny", config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == expected
    # the masks matter: with every caption token valid the output is another
    unmasked = dict(inputs, encoder_attention_mask=torch.ones_like(inputs["encoder_attention_mask"]))
    assert rel_err(transformer_call("mochi-tiny", {}, unmasked)[0], ref) > 1e-2


def test_mochi_frame_rule_and_real_size():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    adapter = adapter_for_class("MochiTransformer3DModel")
    assert adapter.frames_error(163) is None
    assert adapter.frames_error(160) == "--frames 160 must be 6k+1 for mochi (e.g. 157 or 163)"
    real = get_arch("mochi-1").transformer
    layout = adapter.layout(real, 480, 848, 163, 256)
    assert (layout.image_tokens, layout.split_tokens, layout.latent_shape) == (28 * 30 * 53, 28 * 30 * 53 + 256,
                                                                                (12, 28, 60, 106))
    assert (real["num_layers"], real["num_attention_heads"], real["pooled_projection_dim"]) == (48, 24, 1536)


def test_mochi_pipefusion_is_refused_in_one_line(pools, mochi_tiny):
    # every Mochi call carries its captions' mask, which PipeFusion's attention over the K/V buffers does not take:
    # refused by parallelize, before a step runs
    from ditmesh.testing import RankError

    with pytest.raises(RankError, match=r"PipeFusion does not run mochi yet: every call carries its captions' "
                                        r"key-padding mask, .*; use pp=1"):
        pools(2).run(pipeline_generate, mochi_tiny, {"pp": 2}, steps=STEPS, prompt=PROMPTS, **SHAPES["even"])


def test_mochi_generate_cli_keeps_the_6k_plus_1_frame_rule(tmp_path, mochi_tiny):
    from safetensors.torch import load_file

    from cases_models import run_ranks

    run_ranks(["generate", "--model", mochi_tiny, "--frames", "7", "--steps", "2", "--height", "48", "--width", "48",
               "--nproc", "2", "--ulysses", "2", "--out", str(tmp_path / "clip.mp4"),
               "--save-latents", str(tmp_path / "lat.safetensors")])
    assert load_file(str(tmp_path / "lat.safetensors"))["latents"].shape == (1, 12, 2, 6, 6)  # 7 frames: 2 latent
    from cases_models import generate_refusal

    assert "--frames 8 must be 6k+1 for mochi (e.g. 7 or 13)" in generate_refusal(mochi_tiny, "--frames", "8")
