"""LTX-Video under every axis on real gloo process groups, against one process: video self-attention split over the
ranks (Ulysses, ring, USP) with its per-channel RoPE rows, cross-attention to the whole text under its padding mask,
tensor parallelism (with each rank's share of the RoPE tables), batched CFG and data parallelism; per-token and
broadcast timesteps of the image-conditioned pipelines; the 8k+1 frame rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cases_models import PROMPTS, axis_id, check_ranks, cross_attention_counts, generate_on, transformer_call
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


_REFERENCES: dict = {}


def reference(path: str, shape: str, prompt=tuple(PROMPTS)) -> torch.Tensor:
    key = (path, shape, prompt)
    if key not in _REFERENCES:
        _REFERENCES[key] = generate(path, {}, shape, list(prompt))[0][0]
    return _REFERENCES[key]


def generate(path: str, config: dict, shape: str, prompt=PROMPTS, pools=None) -> list:
    return generate_on(pools, path, config, steps=STEPS, prompt=prompt, guidance_scale=3.0, **SHAPES[shape])


def expected_counts(config: dict, calls: int = CALLS) -> dict:
    """Collectives of ``calls`` transformer calls under ``config``: per block one split self-attention, and under tp 3
    row-parallel linears + 4 sharded QK-norms."""
    return cross_attention_counts(config, BLOCKS, calls, 7 * BLOCKS)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"ulysses": 4}, {"tp": 2},
                                    {"tp": 2, "ulysses": 2}, {"cfg": 2}], ids=axis_id)
def test_ltx_pipeline_matches_single_process(pools, ltx_tiny, config, shape):
    ref = reference(ltx_tiny, shape)
    check_ranks(generate(ltx_tiny, config, shape, pools=pools), ref, CALLS, expected_counts(config))


def test_ltx_dp2_three_prompts_matches_single_process(pools, ltx_tiny):
    prompts = PROMPTS + ["a green triangle"]  # 3 prompts x [uncond, cond] = 6 samples over 2 ranks
    ref = reference(ltx_tiny, "uneven", tuple(prompts))
    for latents, counts, calls in generate(ltx_tiny, {"dp": 2}, "uneven", prompts, pools=pools):
        assert latents.shape[0] == 3 and rel_err(latents, ref) <= 1e-5
        assert counts == expected_counts({"dp": 2})


def test_ltx_tp4_matches_single_process(pools, tiny_checkpoints):
    path = tiny_checkpoints("ltx-video-tiny-tp")
    ref = reference(path, "uneven")
    for latents, counts, calls in generate(path, {"tp": 4}, "uneven", pools=pools):
        assert rel_err(latents, ref) <= 1e-5 and counts == expected_counts({"tp": 4})


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
    assert rel_err(out, reference(ltx_tiny, "even")) > 1e-3


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
    bad = subprocess.run([sys.executable, "-m", "ditmesh", "generate", "--model", ltx_tiny, "--frames", "12"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--frames 12 must be 8k+1" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_ltx_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    ltx = get_arch("ltx-video").transformer
    assert (ltx["num_layers"], ltx["num_attention_heads"], ltx["attention_head_dim"]) == (28, 32, 64)
    assert ltx["cross_attention_dim"] == 32 * 64 and ltx["caption_channels"] == get_arch("ltx-video").t5["d_model"]
    assert ltx["in_channels"] == 128 and get_arch("ltx-video").max_sequence_length == 128


def test_ltx_modulated_input_is_what_attn1_reads_and_caches_decide_as_one_process(pools, ltx_tiny):
    # the block list and the modulated input make step caching apply; under ulysses and cfg they decide as one process
    from diffusers import LTXPipeline

    from cases_cache import cached_run
    from ditmesh.hooks import bind_kwargs
    from ditmesh.models import adapter_for
    from test_cache import assert_same_run

    pipe = LTXPipeline.from_pretrained(ltx_tiny, dtype=torch.float32)
    block, seen = pipe.transformer.transformer_blocks[0], {}

    def ours(module, args, kwargs):
        seen.setdefault("ours", adapter_for(pipe.transformer).modulated_input(module, bind_kwargs(module.forward, args, kwargs)))

    def attention_input(module, args, kwargs):
        seen.setdefault("attention", kwargs["hidden_states"])

    block.register_forward_pre_hook(ours, with_kwargs=True)
    block.attn1.register_forward_pre_hook(attention_input, with_kwargs=True)
    pipe.set_progress_bar_config(disable=True)
    pipe("a cat", num_inference_steps=2, output_type="latent", height=64, width=64, num_frames=9, max_sequence_length=16)
    assert torch.equal(seen["ours"], seen["attention"])
    kwargs = dict(steps=6, size=64, guidance_scale=3.0, num_frames=9)
    for setting in ("teacache:threshold=0.3", "dbcache:threshold=0.3,warmup=1"):
        ref = cached_run(ltx_tiny, {}, setting, **kwargs)
        assert any(h["skip"] for h in ref[1]["transformer"]), setting
        for config in ({"ulysses": 2}, {"cfg": 2}):
            for got in pools(2).run(cached_run, ltx_tiny, config, setting, **kwargs):
                assert_same_run(got, ref)
