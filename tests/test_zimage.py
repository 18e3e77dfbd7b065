"""Z-Image under every axis on real gloo process groups, against one process: lists of samples in and out, the joint
per-sample sequence split where it enters the main layers (its key-padding mask whole on every rank, its RoPE table
split at every layer), the refiners whole, tensor parallelism over refiners and layers, and its batched CFG call with
the sample lists sliced over the dp/cfg ranks."""

from __future__ import annotations


import pytest
import torch

from cases_models import EVERY_AXIS, FamilyRuns, axis_id, check_ranks, pipeline_generate, sequence_counts

#: captions of 17 and 61 tokens (chat template included), 14 for the empty negative prompt: padded to 32 and 64, so
#: the joint sequences differ and the main layers get a key-padding mask
PROMPTS = ["a red circle",
           "a big blue square on a green field under a yellow sun at noon with many small red circles around it"]
#: image tokens (H/16 * W/16): 16 and 9 (odd); the model pads each to 32, so the joint sequence (image + caption, each
#: a multiple of 32) is 96 tokens in both and splits evenly over 2 ranks
SHAPES = {"even": dict(height=64, width=64, max_sequence_length=64),
          "uneven": dict(height=48, width=48, max_sequence_length=64)}
LAYERS, REFINERS = 2, 2  # main layers; one noise and one context refiner
STEPS = 2


@pytest.fixture(scope="module")
def zimage_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("z-image-tiny")


#: the pipeline runs of this file (the two prompts with CFG) and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=4.0)


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 1 transformer call (prompts and negative prompts in one list)."""
    calls = STEPS
    if "cfg" in config or "dp" in config:
        return {"all_gather": calls}  # each call's outputs gathered over the ranks' slices of the sample list
    if "tp" in config:
        return {"all_reduce": 2 * (LAYERS + REFINERS) * calls}  # attention output and SwiGLU, every block
    return sequence_counts(config, LAYERS, calls)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", EVERY_AXIS, ids=axis_id)
def test_zimage_pipeline_matches_single_process(pools, zimage_tiny, config, shape):
    RUNS.check(pools, zimage_tiny, config, shape, STEPS, expected_counts(config), PROMPTS)


def test_zimage_dp_rank_without_a_sample_skips_the_call(pools, zimage_tiny):
    # one prompt, no CFG: a list of one sample over dp 2, so rank 1 gets an empty slice and a placeholder
    kwargs = dict(steps=STEPS, prompt=PROMPTS[:1], guidance_scale=1.0, **SHAPES["even"])
    ref = pipeline_generate(zimage_tiny, {}, **kwargs)[0]
    check_ranks(pools(2).run(pipeline_generate, zimage_tiny, {"dp": 2}, **kwargs), ref, STEPS, {"all_gather": STEPS})


def test_zimage_joint_sequence_is_padded_and_masked_per_sample(zimage_tiny):
    # the case the parallel runs must carry: samples of different caption lengths, a key-padding mask in the layers
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(zimage_tiny, dtype=torch.float32)
    seen = []
    pipe.transformer.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[:2]))
    pipe.set_progress_bar_config(disable=True)
    pipe(list(PROMPTS), num_inference_steps=1, guidance_scale=4.0, output_type="latent", **SHAPES["even"])
    joint, mask = seen[0]
    assert joint.shape[:2] == (4, 96)  # two prompts, two negative prompts; 32 image + 32 or 64 caption tokens
    assert mask is not None and mask.sum(dim=1).tolist() == [64, 96, 64, 64]


def test_zimage_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    t = get_arch("z-image").transformer
    assert (t["n_layers"], t["n_refiner_layers"], t["n_heads"], t["dim"], t["cap_feat_dim"]) == (30, 2, 30, 3840, 2560)


def test_zimage_refuses_pipefusion_and_step_caches_in_one_line():
    # the adapter declares no block list (the blocks take ``x``, not ``hidden_states``): both need one
    from ditmesh.cache import StepCache
    from ditmesh.options import CacheConfig
    from ditmesh.config import ConfigError
    from ditmesh.models import adapter_for_class
    from ditmesh.options import pipefusion_refusal
    from ditmesh.synth import build_transformer

    adapter = adapter_for_class("ZImageTransformer2DModel")
    with pytest.raises(NotImplementedError, match="PipeFusion does not run zimage: it declares no block lists"):
        pipefusion_refusal(adapter)
    with pytest.raises(ConfigError, match="the zimage adapter declares no block lists of ZImageTransformer2DModel"):
        StepCache(build_transformer("z-image-tiny"), adapter, CacheConfig(policy="dbcache"), None, None)
