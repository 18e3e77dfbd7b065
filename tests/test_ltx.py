"""LTX-Video under every axis on real gloo process groups, against one process: video self-attention split over the
ranks (Ulysses, ring, USP) with its per-channel RoPE rows, cross-attention to the whole text under its padding mask,
tensor parallelism (with each rank's share of the RoPE tables), batched CFG and data parallelism; per-token and
broadcast timesteps of the image-conditioned pipelines; the 8k+1 frame rule."""

from __future__ import annotations

import json

import pytest
import torch

from cases_models import (PROMPTS, FamilyRuns, axis_id, cross_attention_counts, generate_refusal, run_ranks,
                          transformer_call)
from ditmesh.testing import rel_err

#: video tokens ((frames - 1) / 8 + 1 latent frames x H/32 x W/32): 4 x 2 x 2 = 16 divide 2 and 4, 3 x 3 x 3 = 27 do not
SHAPES = {"even": dict(height=64, width=64, frames=25, max_sequence_length=32),
          "uneven": dict(height=96, width=96, frames=17, max_sequence_length=15)}
BLOCKS = 2  # ltx-video-tiny: one self-attention (split) and one cross-attention (local) per block
STEPS = 2
CALLS = STEPS  # batched CFG: one transformer call per step on [uncond, cond]


@pytest.fixture(scope="module")
def ltx_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("ltx-video-tiny")


RUNS = FamilyRuns(SHAPES, STEPS, guidance_scale=3.0)


def expected_counts(config: dict, calls: int = CALLS) -> dict:
    """Collectives of ``calls`` transformer calls under ``config``: per block one split self-attention, and under tp 3
    row-parallel linears + 4 sharded QK-norms."""
    return cross_attention_counts(config, BLOCKS, calls, 7 * BLOCKS)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"ulysses": 4}, {"tp": 2},
                                    {"tp": 2, "ulysses": 2}, {"cfg": 2}], ids=axis_id)
def test_ltx_pipeline_matches_single_process(pools, ltx_tiny, config, shape):
    RUNS.check(pools, ltx_tiny, config, shape, CALLS, expected_counts(config))


def test_ltx_dp2_three_prompts_matches_single_process(pools, ltx_tiny):
    # 3 prompts x [uncond, cond] = 6 samples over 2 ranks
    RUNS.check(pools, ltx_tiny, {"dp": 2}, "uneven", CALLS, expected_counts({"dp": 2}), PROMPTS + ["a green triangle"])


def test_ltx_tp4_matches_single_process(pools, tiny_checkpoints):
    RUNS.check(pools, tiny_checkpoints("ltx-video-tiny-tp"), {"tp": 4}, "uneven", CALLS, expected_counts({"tp": 4}))


def _inputs(height: int, width: int, frames: int) -> dict:
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer("ltx-video-tiny", dtype=torch.float32)
    return adapter_for(model).example_inputs(model, height=height, width=width, batch=2, text_len=11, device="cpu",
                                             dtype=torch.float32, generator=torch.Generator().manual_seed(3),
                                             frames=frames)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}], ids=axis_id)
def test_ltx_per_token_and_broadcast_timesteps_match_single_process(pools, config):
    # LTXImageToVideoPipeline passes one timestep per token ([B, N], 0 on the condition frame); LTXConditionPipeline
    # passes [B, 1] without condition frames. 27 tokens split 14 + 13
    inputs = _inputs(96, 96, 17)
    tokens = inputs["hidden_states"].shape[1]
    assert tokens == 27
    per_token = torch.rand(2, tokens, generator=torch.Generator().manual_seed(4)) * 1000
    for timestep in (per_token, per_token[:, :1]):
        inputs["timestep"] = timestep
        ref, _ = transformer_call("ltx-video-tiny", {}, inputs)
        for out, counts in pools(2).run(transformer_call, "ltx-video-tiny", config, inputs):
            assert rel_err(out, ref) <= 1e-5
            assert counts == expected_counts(config, calls=1)
    inputs["timestep"] = per_token.mean(1)  # the per-token values matter: one per sample gives another output
    assert rel_err(transformer_call("ltx-video-tiny", {}, inputs)[0], ref) > 1e-2


def test_ltx_video_coords_match_single_process(pools):
    # LTXConditionPipeline builds the RoPE positions itself (video_coords [B, 3, N]): the table is computed whole and
    # split with the tokens
    inputs = _inputs(96, 96, 17)
    for key in ("num_frames", "height", "width", "rope_interpolation_scale"):
        inputs.pop(key)
    grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(3), torch.arange(3), indexing="ij")).flatten(1)
    inputs["video_coords"] = (grid * torch.tensor([[8 / 25], [32.0], [32.0]])).expand(2, 3, 27).clone()
    ref, _ = transformer_call("ltx-video-tiny", {}, inputs)
    for out, counts in pools(2).run(transformer_call, "ltx-video-tiny", {"ring": 2}, inputs):
        assert rel_err(out, ref) <= 1e-5 and counts == expected_counts({"ring": 2}, calls=1)


def test_ltx_text_mask_changes_the_output(ltx_tiny):
    # the cross-attention mask every rank applies whole matters: dropping it gives another result
    from cases_models import masks_dropped

    seen, out = masks_dropped(ltx_tiny, "encoder_attention_mask", PROMPTS, STEPS, 64, 64, 32, guidance_scale=3.0,
                              extra=dict(num_frames=25))
    mask = seen[0]
    assert mask.shape == (4, 32) and not torch.equal(mask[2], mask[3])  # [uncond x 2, cond x 2], per-sample padding
    assert rel_err(out, RUNS.reference(ltx_tiny, "even")) > 1e-3


def test_ltx_frame_rule_and_layout():
    from ditmesh.config import ConfigError
    from ditmesh.models import adapter_for_class
    from ditmesh.runtime.video import validate_frames

    ltx = adapter_for_class("LTXVideoTransformer3DModel")
    validate_frames(ltx, 161)
    with pytest.raises(ConfigError, match=r"--frames 160 must be 8k\+1 for ltx-video \(e.g. 153 or 161\)"):
        validate_frames(ltx, 160)
    layout = ltx.layout({"in_channels": 128}, 512, 768, 121, 128)
    assert (layout.split_tokens, layout.latent_shape) == (16 * 16 * 24, (128, 16, 16, 24))
    with pytest.raises(ValueError, match="height=500 is not a positive multiple of 32"):
        ltx.layout({}, 500, 768, 121, 128)


def test_generate_cli_refuses_ltx_frames_off_the_rule(ltx_tiny):
    assert "--frames 12 must be 8k+1" in generate_refusal(ltx_tiny, "--frames", "12")


def test_ltx_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    ltx = get_arch("ltx-video").transformer
    assert (ltx["num_layers"], ltx["num_attention_heads"], ltx["attention_head_dim"]) == (28, 32, 64)
    assert ltx["cross_attention_dim"] == 32 * 64 and ltx["caption_channels"] == get_arch("ltx-video").t5["d_model"]
    assert ltx["in_channels"] == 128 and get_arch("ltx-video").max_sequence_length == 128


def test_ltx_modulated_input_is_what_attn1_reads_and_caches_decide_as_one_process(pools, ltx_tiny):
    # the block list and the modulated input make step caching apply; under ulysses and cfg they decide as one process
    from cases_cache import check_caches_decide_as_one_process
    from cases_models import first_modulated_inputs

    ours, attention = first_modulated_inputs(ltx_tiny, prompt="a cat", num_inference_steps=2, output_type="latent",
                                             height=64, width=64, num_frames=9, max_sequence_length=16)
    assert torch.equal(ours, attention)
    settings = ("teacache:threshold=0.3", "dbcache:threshold=0.3,warmup=1")  # changes of 0.25-0.45 (probed)
    check_caches_decide_as_one_process(pools, ltx_tiny, settings, steps=6, size=64, guidance_scale=3.0, num_frames=9)


def test_ltx_pipefusion_matches_single_process_in_warmup_and_runs_patch_by_patch(pools, ltx_tiny):
    # 3 patches of the 27 video tokens: the RoPE tables are cut with each patch
    from cases_pipefusion import check_pipefusion

    check_pipefusion(pools, ltx_tiny, height=96, width=96, frames=17, guidance_scale=3.0)


def test_generate_cli_writes_an_ltx_video_with_the_vae_split(tmp_path, ltx_tiny):
    # generate --frames 9 (8k+1) under ulysses 2: 2 latent frames denoised, the VAE decoding split along height into
    # 9 frames (the pipeline tests above compare the latents with one process)
    from PIL import Image
    from safetensors.torch import load_file

    out = tmp_path / "clip.gif"
    run_ranks(["generate", "--model", ltx_tiny, "--frames", "9", "--steps", "2", "--height", "96", "--width", "64",
               "--nproc", "2", "--ulysses", "2", "--out", str(out), "--save-latents", str(tmp_path / "lat.safetensors")])
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert report["vae_parallel"]["split"] and report["config"]["ulysses"] == 2
    assert load_file(str(tmp_path / "lat.safetensors"))["latents"].shape == (1, 2 * 3 * 2, 8)  # packed tokens
    video = Image.open(out)
    assert video.n_frames == 9 and video.size == (64, 96)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"tp": 2}, {"cfg": 2}], ids=axis_id)
def test_ltx_image_to_video_matches_single_process(pools, ltx_tiny, config):
    # LTXImageToVideoPipeline: the image is VAE-encoded (split over the ranks) into the first latent frame and the
    # timestep becomes one per token, 0 on that frame's tokens; 3 latent frames x 3 x 2 = 18 tokens
    from cases_image import image_case

    runs = [("LTXImageToVideoPipeline", {"image": (96, 64), "guidance_scale": 3.0})]
    kwargs = dict(steps=2, size=(96, 64), frames=17)
    ref = image_case(ltx_tiny, {}, runs, **kwargs)[0]
    assert ref["tokens"] == 18 and ref["encoder_rows"] == [24]  # the encoder's first convolution reads 4x4 patches
    results = [got for got, in pools(2).run(image_case, ltx_tiny, config, runs, **kwargs)]
    for got in results:
        assert rel_err(got["latents"], ref["latents"]) <= 1e-5
    assert [got["encoder_rows"] for got in results] == [[16], [8]]  # the encode split in latent rows: 2 + 1
    other = image_case(ltx_tiny, {}, [(runs[0][0], {**runs[0][1], "image": (96, 64, 1)})], **kwargs)[0]
    assert rel_err(other["latents"], ref["latents"]) > 1e-3  # the image conditions the video
