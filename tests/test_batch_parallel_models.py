"""Data and CFG parallelism on SD3 and HiDream (batched CFG) and Wan (two transformer calls per step), against one
process."""

from __future__ import annotations

import pytest

from cases_batch import pipe_call
from ditmesh.testing import rel_err

SD3 = dict(height=64, width=64, max_sequence_length=35, guidance_scale=5.0)
WAN = dict(height=64, width=64, num_frames=5, max_sequence_length=32, guidance_scale=5.0)
HIDREAM = dict(height=64, width=64, max_sequence_length=32, guidance_scale=5.0)
#: HiDreamImagePipeline renders default_sample_size^2 latent pixels whatever size is asked: 8 -> 64x64
HIDREAM_ATTRS = {"default_sample_size": 8}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from ditmesh.synth import write_checkpoint

    root = tmp_path_factory.mktemp("batch-models")
    return {name: str(write_checkpoint(name, root / name, seed=0, device="cpu"))
            for name in ("sd3-tiny", "wan-tiny", "hidream-tiny")}


@pytest.mark.parametrize("config,world,expected", [
    ({"cfg": 2}, 2, {"all_gather": 2}),  # one gather of [uncond, cond] halves per step
    ({"cfg": 2, "ulysses": 2}, 4, {"all_gather": 4, "all_to_all": 16}),  # + sequence gather; 4 layers x 2 a2a x 2 steps
])
def test_sd3_batched_cfg_matches_single(pools, ckpts, config, world, expected):
    call = dict(SD3, prompt="a red circle", negative_prompt="a blue square")
    ref, _ = pipe_call(ckpts["sd3-tiny"], {}, call)
    for latents, counts in pools(world).run(pipe_call, ckpts["sd3-tiny"], config, call):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == expected


def test_sd3_dp2_three_prompts_matches_single_in_order(pools, ckpts):
    call = dict(SD3, prompt=["a red circle", "a green triangle", "a blue square"])
    ref, _ = pipe_call(ckpts["sd3-tiny"], {}, call)
    for latents, counts in pools(2).run(pipe_call, ckpts["sd3-tiny"], {"dp": 2}, call):
        assert latents.shape == ref.shape and latents.shape[0] == 3
        for i in range(3):
            assert rel_err(latents[i], ref[i]) <= 1e-5
        assert counts == {"all_gather": 2}


def test_wan_two_call_cfg2_matches_single(pools, ckpts):
    call = dict(WAN, prompt="a red circle", negative_prompt="a blue square")
    ref, _ = pipe_call(ckpts["wan-tiny"], {}, call)
    for latents, counts in pools(2).run(pipe_call, ckpts["wan-tiny"], {"cfg": 2}, call):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == {"all_gather": 2}  # one cond/uncond exchange per step


@pytest.mark.parametrize("config,world,expected", [
    ({"cfg": 2}, 2, {"all_gather": 2}),  # one gather of [uncond, cond] halves per step
    ({"cfg": 2, "ulysses": 2}, 4, {"all_gather": 4, "all_to_all": 16}),  # + sequence gather; 4 layers x 2 a2a x 2 steps
])
def test_hidream_batched_cfg_matches_single(pools, ckpts, config, world, expected):
    # the Llama stack [layers, B, L, D] carries the batch in dim 1 (the adapter's batch_dims)
    call = dict(HIDREAM, prompt="a red circle", negative_prompt="a blue square")
    ref, _ = pipe_call(ckpts["hidream-tiny"], {}, call, pipe_attrs=HIDREAM_ATTRS)
    for latents, counts in pools(world).run(pipe_call, ckpts["hidream-tiny"], config, call, pipe_attrs=HIDREAM_ATTRS):
        assert rel_err(latents, ref) <= 1e-5
        assert counts == expected


def test_hidream_dp2_three_prompts_matches_single_in_order(pools, ckpts):
    call = dict(HIDREAM, prompt=["a red circle", "a green triangle", "a blue square"])
    ref, _ = pipe_call(ckpts["hidream-tiny"], {}, call, pipe_attrs=HIDREAM_ATTRS)
    for latents, counts in pools(2).run(pipe_call, ckpts["hidream-tiny"], {"dp": 2}, call, pipe_attrs=HIDREAM_ATTRS):
        assert latents.shape == ref.shape and latents.shape[0] == 3
        for i in range(3):
            assert rel_err(latents[i], ref[i]) <= 1e-5
        assert counts == {"all_gather": 2}
