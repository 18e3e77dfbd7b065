"""SkyReels-V2 under every axis on real gloo process groups, against one process: diffusion forcing's per-frame
timesteps (the per-token modulation cut with the video tokens at every block, the final norm's shift and scale whole
after the gather) and its block-causal mask over the video tokens (reordered like the keys), through the
SkyReelsV2DiffusionForcingPipeline in its asynchronous mode and through the transformer itself."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cases_models import EVERY_AXIS, axis_id, check_ranks, sequence_counts, transformer_call
from cases_skyreels import skyreels_generate, skyreels_pp_run
from ditmesh.testing import rel_err

PROMPTS = ["a red circle", "a big blue square on a green field under a yellow sun at noon"]
LAYERS = 2  # skyreels-v2-tiny's blocks, one self-attention each
STEPS, AR_STEP = 2, 1
#: video tokens: latent frames ((frames - 1) / 4 + 1) x H/16 x W/16, in causal blocks of ``causal_block_size`` latent
#: frames: 4 x 9 = 36 tokens in 2 blocks (divides 2 and 4), 9 x 9 = 81 in 3 blocks (divides neither)
SHAPES = {"even": dict(height=48, width=48, frames=13, causal_block_size=2),
          "uneven": dict(height=48, width=48, frames=33, causal_block_size=3)}


@pytest.fixture(scope="module")
def skyreels_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("skyreels-v2-tiny")


def _kwargs(shape: str) -> dict:
    """pipeline_generate kwargs: two prompts with CFG, asynchronous diffusion forcing (each causal block a step behind
    the one before it, so the frames of a call have different timesteps)."""
    size = dict(SHAPES[shape])
    block = size.pop("causal_block_size")
    extra = dict(causal_block_size=block, ar_step=AR_STEP, base_num_frames=size["frames"])
    return dict(steps=STEPS, prompt=PROMPTS, guidance_scale=5.0, extra=extra, **size)


def iterations(shape: str) -> int:
    """Denoising iterations of an asynchronous run: ``steps`` plus ``ar_step`` for every causal block after the first."""
    size = SHAPES[shape]
    blocks = ((size["frames"] - 1) // 4 + 1) // size["causal_block_size"]
    return STEPS + (blocks - 1) * AR_STEP


@functools.cache
def reference(path: str, shape: str) -> tuple:
    """One-process latents and transformer calls at ``shape``, computed once per session."""
    latents, _, calls = skyreels_generate(path, {}, **_kwargs(shape))
    return latents, calls


def expected_counts(config: dict, shape: str) -> dict:
    """Collectives of one pipeline call: two transformer calls (cond, uncond) per iteration."""
    calls = 2 * iterations(shape)
    if "cfg" in config:
        return {"all_gather": calls // 2}  # the branches exchanged once per iteration
    if "dp" in config:
        return {"all_gather": calls}  # each call's output gathered over the ranks' prompts
    if "tp" in config:
        return {"all_reduce": 7 * LAYERS * calls}  # 3 row-parallel linears + 4 sharded QK-norms per block
    return sequence_counts(config, LAYERS, calls)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", EVERY_AXIS, ids=axis_id)
def test_skyreels_diffusion_forcing_pipeline_matches_single_process(pools, skyreels_tiny, config, shape):
    ref, calls = reference(skyreels_tiny, shape)
    assert calls == 2 * iterations(shape)
    outs = pools(math.prod(config.values())).run(skyreels_generate, skyreels_tiny, config, **_kwargs(shape))
    check_ranks(outs, ref, calls, expected_counts(config, shape))


# -- the transformer itself: per-frame timesteps, the block-causal mask, one timestep per sample ------------------
def skyreels_call(arch: str, config: dict, inputs: dict, causal_block_size: int):
    """``transformer_call`` with ``causal_block_size`` latent frames per causal block (the pipelines' setting)."""
    return transformer_call(arch, config, inputs, dict(num_frame_per_block=causal_block_size))


TRANSFORMER_CONFIGS = [{"ulysses": 2}, {"ulysses": 4}, {"ring": 2}, {"ring": 4}, {"ring": 2, "ulysses": 2},
                       {"tp": 2}, {"tp": 2, "ulysses": 2}]


def transformer_inputs(shape: str, arch: str = "skyreels-v2-tiny", batch: int = 2) -> dict:
    """One diffusion-forcing step's inputs at ``shape``: a different timestep for every latent frame and sample."""
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    size = {k: v for k, v in SHAPES[shape].items() if k != "causal_block_size"}
    model = build_transformer(arch, dtype=torch.float32)
    inputs = adapter_for_class("SkyReelsV2Transformer3DModel").example_inputs(
        model, batch=batch, text_len=11, generator=torch.Generator().manual_seed(3), device="cpu", dtype=torch.float32,
        **size)
    frames = inputs["hidden_states"].shape[2]
    inputs["timestep"] = torch.rand(batch, frames, generator=torch.Generator().manual_seed(4)) * 1000
    return inputs


def transformer_counts(config: dict) -> dict:
    """Collectives of one transformer call."""
    counts = {"all_reduce": 7 * LAYERS} if "tp" in config else {}
    if "ulysses" in config or "ring" in config:
        counts.update(sequence_counts({k: v for k, v in config.items() if k != "tp"}, LAYERS, 1))
    return counts


def check_call(pools, config: dict, inputs: dict, block: int, arch: str = "skyreels-v2-tiny") -> torch.Tensor:
    """The transformer under ``config`` against one process; returns the one-process output."""
    ref, _ = skyreels_call(arch, {}, inputs, block)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, arch, config, inputs,
                                                              dict(num_frame_per_block=block)):
        assert rel_err(out, ref) <= 1e-5
        assert counts == transformer_counts(config)
    return ref


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", TRANSFORMER_CONFIGS, ids=axis_id)
def test_skyreels_per_frame_timesteps_and_causal_mask_match_single_process(pools, config, shape):
    inputs = transformer_inputs(shape)
    block = SHAPES[shape]["causal_block_size"]
    ref = check_call(pools, config, inputs, block)
    # both matter: without the mask, or with one timestep per sample repeated over the frames, the output differs
    assert rel_err(skyreels_call("skyreels-v2-tiny", {}, inputs, 1)[0], ref) > 1e-2
    flat = dict(inputs, timestep=inputs["timestep"].mean(1, keepdim=True).expand_as(inputs["timestep"]))
    assert rel_err(skyreels_call("skyreels-v2-tiny", {}, flat, block)[0], ref) > 1e-2


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}], ids=axis_id)
def test_skyreels_one_timestep_per_sample_matches_single_process(pools, config):
    # the text-to-video pipeline's call: timestep [B], no diffusion forcing; the modulation [B, 6, D] stays whole
    inputs = dict(transformer_inputs("uneven"), enable_diffusion_forcing=False, timestep=torch.tensor([700.0, 300.0]))
    check_call(pools, config, inputs, 1)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"tp": 2}], ids=axis_id)
def test_skyreels_image_to_video_transformer_matches_single_process(pools, config):
    # the I2V checkpoints' cross-attention also reads 257 image tokens (add_k_proj, add_v_proj: column-parallel under
    # tp, with the sharded norm_added_k: 8 all-reduces a block); their processor takes the last 512 context tokens as
    # the text, so the text is 512 tokens
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer("skyreels-v2-i2v-tiny", dtype=torch.float32)
    inputs = adapter_for_class("SkyReelsV2Transformer3DModel").example_inputs(
        model, height=48, width=48, batch=2, text_len=512, generator=torch.Generator().manual_seed(3), device="cpu",
        dtype=torch.float32, frames=9)
    ref, _ = transformer_call("skyreels-v2-i2v-tiny", {}, inputs)
    expected = {"all_reduce": 8 * LAYERS} if "tp" in config else sequence_counts(config, LAYERS, 1)
    for out, counts in pools(2).run(transformer_call, "skyreels-v2-i2v-tiny", config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == expected
    image = inputs["encoder_hidden_states_image"]
    assert rel_err(transformer_call("skyreels-v2-i2v-tiny", {}, dict(inputs, encoder_hidden_states_image=-image))[0],
                   ref) > 1e-3  # the image tokens matter


def test_skyreels_fps_conditioning_matches_single_process(pools):
    # the 1.3B DF checkpoint adds an fps embedding to every token's modulation (one sample: diffusers broadcasts it
    # over the frames of one sample only)
    inputs = transformer_inputs("uneven", arch="skyreels-v2-tiny-fps", batch=1)
    assert inputs["fps"] == [1]
    ref = check_call(pools, {"ulysses": 2}, inputs, 3, arch="skyreels-v2-tiny-fps")
    assert rel_err(skyreels_call("skyreels-v2-tiny-fps", {}, dict(inputs, fps=[0]), 3)[0], ref) > 1e-3


#: PipeFusion: no causal blocks (no mask, which its attention over the K/V buffers does not take), each latent frame a
#: step behind the one before it (``ar_step``), so the frames of a call still have different timesteps
PP_CALL = dict(frames=9, height=48, width=48, guidance_scale=5.0, max_sequence_length=16,
               call=dict(causal_block_size=1, ar_step=1, base_num_frames=9))
PP_ITERATIONS = STEPS + 2 * AR_STEP  # 3 latent frames


@pytest.mark.parametrize("warmup", [PP_ITERATIONS, 1], ids=["exact", "stale"])
def test_skyreels_pipefusion_counts_the_loop_iterations(pools, skyreels_tiny, warmup):
    # the pipeline steps one scheduler copy per frame, so PipeFusion's warm-up and patches go by the loop's iterations
    ref = skyreels_pp_run(skyreels_tiny, {}, steps=STEPS, **PP_CALL)[0]
    results = pools(2).run(skyreels_pp_run, skyreels_tiny, {"pp": 2}, steps=STEPS, per_step=True, pp_warmup=warmup,
                           pp_patches=3, **PP_CALL)
    assert torch.equal(results[0][0], results[1][0])  # every rank steps on the same broadcast prediction
    for rank, (latents, _, per_step, _, _) in enumerate(results):
        kind = "pp_send" if rank == 0 else "pp_recv"
        patches = [1 if i < warmup else 3 for i in range(PP_ITERATIONS)]  # cond and uncond call each iteration
        assert per_step == [{kind: 2 * p, "broadcast": 2} for p in patches]
        assert rel_err(latents, ref) <= 1e-5 if warmup == PP_ITERATIONS else 1e-6 < rel_err(latents, ref) < 0.2


def test_skyreels_frame_rule_and_real_sizes():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    adapter = adapter_for_class("SkyReelsV2Transformer3DModel")
    assert adapter.frames_error(97) is None
    assert adapter.frames_error(96) == "--frames 96 must be 4k+1 for skyreels-v2 (e.g. 93 or 97)"
    layout = adapter.layout(get_arch("skyreels-v2-df-14b").transformer, 544, 960, 97, 512)
    assert layout.split_tokens == 25 * 34 * 60 and layout.latent_shape == (16, 25, 68, 120)
    big, small = get_arch("skyreels-v2-df-14b").transformer, get_arch("skyreels-v2-df-1.3b").transformer
    assert (big["num_layers"], big["num_attention_heads"], big["ffn_dim"], big["inject_sample_info"]) == (40, 40, 13824, False)
    assert (small["num_layers"], small["num_attention_heads"], small["ffn_dim"], small["inject_sample_info"]) == (30, 12, 8960, True)


def test_skyreels_generate_cli_refuses_a_frame_count_off_its_rule(tiny_checkpoints):
    from cases_models import generate_refusal

    line = generate_refusal(tiny_checkpoints("skyreels-v2-tiny"), "--frames", "10")
    assert "--frames 10 must be 4k+1 for skyreels-v2 (e.g. 9 or 13)" in line
