"""Lumina-Image 2.0 under every axis on real gloo process groups, against one process: the joint per-sample
sequence split where it enters the main layers (its key-padding mask whole on every rank), grouped-query attention,
the refiners whole, tensor parallelism over refiners and layers, and its two CFG calls."""

from __future__ import annotations


import pytest
import torch

from cases_models import EVERY_AXIS, PROMPTS, FamilyRuns, axis_id, sequence_counts

#: two prompts of different lengths: the joint sequences differ, so the main layers get a key-padding mask
#: image tokens (H/16 * W/16): 16 divides 2, 9 does not; the joint length adds the longer caption
SHAPES = {"even": dict(height=64, width=64, max_sequence_length=256),
          "uneven": dict(height=48, width=48, max_sequence_length=256)}
LAYERS, REFINERS = 2, 2  # main layers; one noise and one context refiner
STEPS = 2


@pytest.fixture(scope="module")
def lumina2_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("lumina2-tiny")


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=4.0)


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 2 transformer calls (prompt, negative prompt)."""
    calls = 2 * STEPS
    if "cfg" in config:
        return {"all_gather": STEPS}  # the two branches exchanged once per step
    if "dp" in config:
        return {"all_gather": calls}  # each call's output gathered over the two groups' samples
    if "tp" in config:
        return {"all_reduce": 2 * (LAYERS + REFINERS) * calls}  # attention output and SwiGLU, every block
    return sequence_counts(config, LAYERS, calls)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", EVERY_AXIS, ids=axis_id)
def test_lumina2_pipeline_matches_single_process(pools, lumina2_tiny, config, shape):
    RUNS.check(pools, lumina2_tiny, config, shape, 2 * STEPS, expected_counts(config))


def test_lumina2_joint_sequence_is_padded_and_masked_per_sample(lumina2_tiny):
    # the case the parallel runs must carry: samples of different caption lengths, a key-padding mask in the layers
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(lumina2_tiny, dtype=torch.float32)
    seen = []
    pipe.transformer.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    pipe.set_progress_bar_config(disable=True)
    pipe(PROMPTS, num_inference_steps=1, guidance_scale=1.0, output_type="latent", **SHAPES["even"])
    mask = seen[0]
    assert mask is not None and mask.shape[0] == 2 and mask.all(dim=1).tolist() == [False, True]


def test_lumina2_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    t = get_arch("lumina2").transformer
    assert (t["num_layers"], t["num_attention_heads"], t["num_kv_heads"], t["hidden_size"]) == (26, 24, 8, 2304)
