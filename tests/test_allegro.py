"""Allegro under every axis on real gloo process groups, against one process: video self-attention split over the
ranks (Ulysses, ring, USP) with each rank's RoPE positions, cross-attention to the whole text under its padding mask,
tensor parallelism, batched CFG and data parallelism; the model's self-attention mask; the 16k+24 frame rule."""

from __future__ import annotations


import pytest
import torch

from cases_models import (PROMPTS, FamilyRuns, axis_id, cross_attention_counts, generate_refusal,
                          transformer_call)
from ditmesh.testing import rel_err

#: video tokens (latent frames x H/16 x W/16): 8 frames -> 2 x 4 x 4 = 32 divide 2 and 4; 9 -> 3 x 3 x 3 = 27 do not
SHAPES = {"even": dict(height=64, width=64, frames=8, max_sequence_length=32),
          "uneven": dict(height=48, width=48, frames=9, max_sequence_length=15)}
EXTRA = dict(clean_caption=False)  # caption cleaning needs BeautifulSoup and ftfy
BLOCKS = 2  # allegro-tiny: one self-attention (split) and one cross-attention (local) per block
STEPS = 2
CALLS = STEPS  # batched CFG: one transformer call per step on [uncond, cond]


@pytest.fixture(scope="module")
def allegro_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("allegro-tiny")


RUNS = FamilyRuns(SHAPES, STEPS, guidance_scale=3.0, extra=EXTRA)


def expected_counts(config: dict, calls: int = CALLS) -> dict:
    """Collectives of ``calls`` transformer calls under ``config``: per block one split self-attention, and under tp 3
    row-parallel linears."""
    return cross_attention_counts(config, BLOCKS, calls, 3 * BLOCKS)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"ulysses": 4}, {"tp": 2},
                                    {"tp": 2, "ring": 2}, {"cfg": 2}], ids=axis_id)
def test_allegro_pipeline_matches_single_process(pools, allegro_tiny, config, shape):
    RUNS.check(pools, allegro_tiny, config, shape, CALLS, expected_counts(config))


def test_allegro_dp2_three_prompts_matches_single_process(pools, allegro_tiny):
    # 3 prompts x [uncond, cond] = 6 samples over 2 ranks
    RUNS.check(pools, allegro_tiny, {"dp": 2}, "uneven", CALLS, expected_counts({"dp": 2}),
               PROMPTS + ["a green triangle"])


def test_allegro_tp4_matches_single_process(pools, tiny_checkpoints):
    RUNS.check(pools, tiny_checkpoints("allegro-tiny-tp"), {"tp": 4}, "uneven", CALLS, expected_counts({"tp": 4}))


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}], ids=axis_id)
def test_allegro_self_attention_mask_and_rope_match_single_process(pools, config):
    # the model's own attention_mask ([B, F, H, W] in latent pixels, 1 keeps) becomes a bias over the video keys of the
    # self-attention; the pipeline never passes one. 27 tokens split 14 + 13; the masked keys sit on both ranks
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer("allegro-tiny", dtype=torch.float32)
    inputs = adapter_for(model).example_inputs(model, height=48, width=48, batch=2, text_len=11, device="cpu",
                                               dtype=torch.float32, generator=torch.Generator().manual_seed(3),
                                               frames=9)
    keep = torch.ones(2, 3, 6, 6)
    keep[0, 2] = 0  # the last latent frame of sample 0
    keep[1, :, :2] = 0  # the top patch row of sample 1
    inputs["attention_mask"] = keep
    ref, _ = transformer_call("allegro-tiny", {}, inputs)
    for out, counts in pools(2).run(transformer_call, "allegro-tiny", config, inputs):
        assert rel_err(out, ref) <= 1e-5 and counts == expected_counts(config, calls=1)
    unmasked = dict(inputs, attention_mask=None)
    assert rel_err(transformer_call("allegro-tiny", {}, unmasked)[0], ref) > 1e-3  # the mask matters
    unrotated = dict(inputs, image_rotary_emb=None)
    assert rel_err(transformer_call("allegro-tiny", {}, unrotated)[0], ref) > 1e-3  # so do the positions


def test_allegro_text_mask_changes_the_output(allegro_tiny):
    from cases_models import masks_dropped

    seen, out = masks_dropped(allegro_tiny, "encoder_attention_mask", PROMPTS, STEPS, 64, 64, 32, guidance_scale=3.0,
                              extra=dict(num_frames=8, **EXTRA))
    mask = seen[0]
    assert mask.shape == (4, 32) and not torch.equal(mask[2], mask[3])  # [uncond x 2, cond x 2], per-sample padding
    assert rel_err(out, RUNS.reference(allegro_tiny, "even")) > 1e-3


def test_allegro_frame_rule_and_layout():
    from ditmesh.config import ConfigError
    from ditmesh.models import adapter_for_class
    from ditmesh.runtime.video import validate_frames

    allegro = adapter_for_class("AllegroTransformer3DModel")
    for frames in (24, 40, 88):
        validate_frames(allegro, frames)
    with pytest.raises(ConfigError, match=r"--frames 80 must be 16k\+24 for allegro \(e.g. 72 or 88\)"):
        validate_frames(allegro, 80)
    with pytest.raises(ConfigError, match=r"--frames 9 must be 16k\+24 for allegro \(e.g. 24 or 40\)"):
        validate_frames(allegro, 9)
    layout = allegro.layout({"patch_size": 2, "in_channels": 4}, 720, 1280, 88, 512)
    assert (layout.split_tokens, layout.latent_shape) == (22 * 45 * 80, (4, 22, 90, 160))


def test_generate_cli_refuses_allegro_frames_off_the_rule(allegro_tiny):
    assert "--frames 25 must be 16k+24" in generate_refusal(allegro_tiny, "--frames", "25")


def test_allegro_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    allegro = get_arch("allegro").transformer
    assert (allegro["num_layers"], allegro["num_attention_heads"], allegro["attention_head_dim"]) == (32, 24, 96)
    assert allegro["cross_attention_dim"] == 24 * 96
    assert allegro["caption_channels"] == get_arch("allegro").t5["d_model"]
    assert (allegro["sample_frames"], allegro["sample_height"], allegro["sample_width"]) == (22, 90, 160)


def test_allegro_modulated_input_is_what_attn1_reads_and_caches_decide_as_one_process(pools, allegro_tiny):
    # the block list and the modulated input make step caching apply; under ulysses and cfg they decide as one process
    from cases_cache import check_caches_decide_as_one_process
    from cases_models import first_modulated_inputs

    ours, attention = first_modulated_inputs(allegro_tiny, prompt="a cat", num_inference_steps=1, output_type="latent",
                                             height=48, width=48, num_frames=9, max_sequence_length=16, **EXTRA)
    assert torch.equal(ours, attention)
    settings = ("teacache:threshold=1.0", "dbcache:threshold=1.0,warmup=1")  # changes of 0.38-1.24 (probed)
    check_caches_decide_as_one_process(pools, allegro_tiny, settings, steps=6, size=48, guidance_scale=3.0, num_frames=9,
                                       **EXTRA)


def test_allegro_pipefusion_matches_single_process_in_warmup_and_runs_patch_by_patch(pools, allegro_tiny):
    # 3 patches of the 27 video tokens: the RoPE positions are cut with each patch, the tables stay whole
    from cases_pipefusion import check_pipefusion

    check_pipefusion(pools, allegro_tiny, height=48, width=48, frames=9, guidance_scale=3.0, call=EXTRA)


def test_generate_cli_writes_an_allegro_video(tmp_path, allegro_tiny):
    # generate --frames 24 (16k+24) under ulysses 2: 6 latent frames denoised, decoded tiled (the Allegro VAE's only
    # decode, which generate turns on) into 24 frames
    import json

    from PIL import Image

    from cases_models import run_ranks

    out = tmp_path / "clip.gif"
    run_ranks(["generate", "--model", allegro_tiny, "--frames", "24", "--steps", "2", "--height", "128", "--width",
               "128", "--nproc", "2", "--ulysses", "2", "--out", str(out)])
    assert json.loads(out.with_name(out.name + ".json").read_text())["config"]["ulysses"] == 2
    video = Image.open(out)
    assert video.n_frames == 24 and video.size == (128, 128)
