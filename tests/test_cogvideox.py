"""CogVideoX under every axis on real gloo process groups, against one process: text and video split as streams of
their own where the model cuts them apart, the pipeline's RoPE table cut with the video tokens, the heads shard (TP),
the batched CFG call's halves and the prompts on their own ranks (cfg, dp); odd token counts split unevenly. CogVideoX
1.0 2B (no RoPE, positions added whole in patch_embed) and 1.5 (two latent frames a patch) under Ulysses and ring."""

from __future__ import annotations


import pytest
import torch

from cases_models import FamilyRuns, PROMPTS, axis_id, check_ranks, pipeline_counts
from ditmesh.testing import rel_err

#: video tokens ((frames - 1) / 4 + 1 latent frames x H/16 x W/16) and text tokens (max_sequence_length, every prompt
#: padded to it): 32 + 32 divide 2 and 4; 27 + 31 divide neither
SHAPES = {"even": dict(height=64, width=64, frames=5, max_sequence_length=32),
          "uneven": dict(height=48, width=48, frames=9, max_sequence_length=31),
          # 2B's sine-cosine positions cover max_text_seq_length (32) text tokens: only the video is uneven (27)
          "odd-video": dict(height=48, width=48, frames=9, max_sequence_length=32)}
BLOCKS = 2
STEPS = 2


@pytest.fixture(scope="module")
def cogvideox(tiny_checkpoints):
    return tiny_checkpoints


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0)
reference = RUNS.reference


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 1 transformer call ([uncond, cond] batched); under tp 2
    all-reduces per block (attention output, feed-forward)."""
    return pipeline_counts(config, STEPS, BLOCKS, all_reduces_per_call=2 * BLOCKS, calls_per_step=1)


@pytest.mark.parametrize("config, shape", [
    ({"ulysses": 2}, "even"), ({"ring": 2}, "even"), ({"tp": 2}, "even"), ({"tp": 4}, "even"), ({"cfg": 2}, "even"),
    ({"ulysses": 2}, "uneven"), ({"ulysses": 4}, "uneven"), ({"ring": 4}, "uneven"), ({"ring": 2, "ulysses": 2}, "uneven"),
    ({"tp": 2, "ring": 2}, "uneven"), ({"dp": 2}, "uneven"),
], ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
def test_cogvideox_pipeline_matches_single_process(pools, cogvideox, config, shape):
    path = cogvideox("cogvideox-tiny")
    ref = reference(path, shape)
    check_ranks(RUNS.generate(path, config, shape, pools=pools), ref, STEPS, expected_counts(config))


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}], ids=axis_id)
@pytest.mark.parametrize("arch", ["cogvideox-2b-tiny", "cogvideox1.5-tiny"])
def test_cogvideox_1_0_without_rope_and_1_5_match_single_process(pools, cogvideox, arch, config):
    path = cogvideox(arch)
    ref = reference(path, "odd-video")
    check_ranks(RUNS.generate(path, config, "odd-video", pools=pools), ref, STEPS, expected_counts(config))


def test_cogvideox_rope_and_positions_matter(cogvideox):
    # the three variants differ only in positions: without the RoPE split test above could pass with any table
    outs = [reference(cogvideox(arch), "odd-video") for arch in ("cogvideox-tiny", "cogvideox-2b-tiny")]
    assert outs[0].shape == outs[1].shape and rel_err(outs[0], outs[1]) > 1e-2


def test_cogvideox_real_size_matches_the_published_config():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    t = get_arch("cogvideox-5b").transformer
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["text_embed_dim"]) == (42, 48, 64, 4096)
    assert t["use_rotary_positional_embeddings"] and t["patch_size"] == 2
    adapter = adapter_for_class("CogVideoXTransformer3DModel")
    layout = adapter.layout(t, 480, 720, 49, 226)
    assert layout.image_tokens == 13 * 30 * 45 and layout.split_tokens == 17550 + 226
    assert layout.latent_shape == (13, 16, 60, 90)
    assert adapter.frames_error(48) is not None and adapter.frames_error(49) is None


@pytest.mark.parametrize("world, rows, frames", [(2, 5, 5), (3, 5, 5), (3, 4, 2)])
def test_cogvideox_vae_decode_split_along_height_matches_single_process(pools, world, rows, frames):
    # 5 latent rows over 3 ranks: 2 + 2 + 1; 5 latent frames: two decoder calls (3 + 2 frames) with the causal cache
    # between them on every rank, for its own rows
    from torch import nn

    from cases_vae import tiny_vae, vae_case

    decoder = tiny_vae("cogvideox").decoder
    convs = sum(isinstance(m, (nn.Conv2d, nn.Conv3d)) and m.kernel_size[-2] > 1 for m in decoder.modules())
    norms = sum(isinstance(m, nn.GroupNorm) for m in decoder.modules())
    calls = max(frames // 2, 1)  # two latent frames a decoder call, an odd one with the first two
    for r in pools(world).run(vae_case, "cogvideox", "decode", rows, 3, frames):
        assert r["err"] <= 1e-5 and r["restored"]
        # a halo exchange per convolution taller than a row, a statistics gather per group norm, the output gather
        assert r["counts"] == {"halo": calls * convs, "all_gather": calls * norms + 1}


def test_cogvideox_vae_encodes_whole_on_every_rank(pools):
    from cases_vae import vae_case

    for r in pools(2).run(vae_case, "cogvideox", "encode", 5, 3, 5):
        assert r["err"] == 0 and r["counts"] == {} and r["restored"]


def test_cogvideox_steps_are_counted_without_a_scheduler_step_index(cogvideox):
    # CogVideoX's DDIM scheduler keeps no step_index: the context counts the steps by the pipeline's timestep
    from diffusers import DiffusionPipeline

    from ditmesh import ParallelConfig, parallelize

    pipe = DiffusionPipeline.from_pretrained(cogvideox("cogvideox-tiny"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert not hasattr(pipe.scheduler, "step_index")
    runtime = parallelize(pipe, ParallelConfig())
    seen = []
    pipe.transformer.register_forward_hook(lambda m, a, o: seen.append(runtime.context.step_index))
    for steps in (3, 2):
        pipe("a red circle", num_inference_steps=steps, height=32, width=32, num_frames=5, max_sequence_length=8,
             output_type="latent")
    assert seen == [0, 1, 2, 0, 1]


def test_cogvideox_cache_decides_as_one_process_under_ulysses(pools, cogvideox):
    from cases_cache import assert_cache_decides_as_one_process

    assert_cache_decides_as_one_process(pools, cogvideox("cogvideox-tiny"), {"ulysses": 2},
                                        "teacache:threshold=0.5,warmup=1", steps=5, prompts=PROMPTS, size=48,
                                        num_frames=5, guidance_scale=5.0)


def test_cogvideox_pipefusion_warmup_is_exact_and_stale_steps_run_patch_by_patch(pools, cogvideox):
    from cases_pipefusion import pipeline_run

    path, call = cogvideox("cogvideox-tiny"), dict(height=48, width=48, frames=9, max_sequence_length=31)
    ref = pipeline_run(path, {}, steps=3, **call)[0]
    for warmup, patches in ((3, None), (1, 3)):
        results = pools(2).run(pipeline_run, path, {"pp": 2}, steps=3, per_step=True, pp_warmup=warmup,
                               pp_patches=patches, **call)
        assert torch.equal(results[0][0], results[1][0])  # every rank steps on the same broadcast prediction
        err = rel_err(results[0][0], ref)
        assert err <= 1e-5 if warmup == 3 else 1e-6 < err < 0.2
        for rank, (_, _, per_step, _, _) in enumerate(results):
            kind = "pp_send" if rank == 0 else "pp_recv"
            assert per_step == [{kind: 1 if step < warmup else patches, "broadcast": 1} for step in range(3)]


@pytest.mark.parametrize("config", [{"tp": 2}, {"ring": 2}], ids=axis_id)
def test_cogvideox_remove_gives_back_the_pipeline(pools, cogvideox, config):
    from cases_hooks import remove_restores_case

    for diffs, parallel_err, after_remove in pools(2).run(remove_restores_case, cogvideox("cogvideox-tiny"), config,
                                                          extra={"num_frames": 5}):
        assert diffs == [] and parallel_err <= 1e-5 and after_remove == 0.0
