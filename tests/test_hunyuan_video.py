"""HunyuanVideo under every axis on real gloo process groups, against one process: its padded-text key mask travels
with the keys (Ulysses, ring, USP), its RoPE table with the video tokens, the token refiner runs whole, the heads
shard (TP), each CFG branch and each prompt run on their own ranks (cfg, dp); odd token counts split unevenly."""

from __future__ import annotations


import pytest
import torch

from cases_models import FamilyRuns, PROMPTS, axis_id, check_ranks, pipeline_counts
from ditmesh.testing import rel_err

#: true CFG: the prompts' call, then the negative prompts' (guidance_scale is the distilled guidance of each call)
CFG = dict(negative_prompt=["", ""], true_cfg_scale=4.0)
#: video tokens ((frames - 1) / 4 + 1 latent frames x H/16 x W/16) and text tokens (max_sequence_length, every prompt
#: padded to it): 32 + 32 divide 2 and 4; 27 + 31 divide neither
SHAPES = {"even": dict(height=64, width=64, frames=5, max_sequence_length=32),
          "uneven": dict(height=48, width=48, frames=9, max_sequence_length=31)}
ATTENTIONS = 4  # 2 dual + 2 single blocks, one joint attention each
STEPS = 2


@pytest.fixture(scope="module")
def hunyuan_video_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("hunyuan-video-tiny")


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=6.0, extra=CFG)
reference = RUNS.reference


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 2 transformer calls; under tp 4 all-reduces per dual block and 1
    per single block (the packed proj_out)."""
    return pipeline_counts(config, STEPS, ATTENTIONS, all_reduces_per_call=2 * 4 + 2 * 1)


@pytest.mark.parametrize("config, shape", [
    ({"ulysses": 2}, "even"), ({"ring": 2}, "even"), ({"tp": 2}, "even"), ({"tp": 4}, "even"), ({"cfg": 2}, "even"),
    ({"ulysses": 2}, "uneven"), ({"ulysses": 4}, "uneven"), ({"ring": 4}, "uneven"), ({"ring": 2, "ulysses": 2}, "uneven"),
    ({"tp": 2, "ulysses": 2}, "uneven"), ({"dp": 2}, "uneven"),
], ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
def test_hunyuan_video_pipeline_matches_single_process(pools, hunyuan_video_tiny, config, shape):
    ref = reference(hunyuan_video_tiny, shape)
    outs = RUNS.generate(hunyuan_video_tiny, config, shape, pools=pools)
    check_ranks(outs, ref, 2 * STEPS, expected_counts(config))


def test_hunyuan_video_mask_changes_the_output(hunyuan_video_tiny):
    # the prompts are padded (the mask the parallel runs carry is not all ones) and the padding matters: a mask of
    # ones gives another result
    from diffusers import DiffusionPipeline

    from cases_models import call_kwargs

    pipe = DiffusionPipeline.from_pretrained(hunyuan_video_tiny, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def unmask(module, args, kwargs):
        seen.append(kwargs["encoder_attention_mask"])
        return args, dict(kwargs, encoder_attention_mask=torch.ones_like(kwargs["encoder_attention_mask"]))

    pipe.transformer.register_forward_pre_hook(unmask, with_kwargs=True)
    final: dict = {}
    shape = dict(SHAPES["even"])
    pipe(prompt=list(PROMPTS), **call_kwargs(final, STEPS, shape.pop("height"), shape.pop("width"), shape.pop("frames"),
                                             shape.pop("max_sequence_length"), 6.0), **CFG)
    lengths = seen[0].sum(dim=1).tolist()
    assert seen[0].shape == (2, 32) and lengths[0] < lengths[1] < 32  # both padded, the shorter prompt more
    assert rel_err(final["latents"], reference(hunyuan_video_tiny, "even")) > 1e-3


def test_hunyuan_video_generate_rejects_bad_frame_counts(hunyuan_video_tiny):
    from cases_models import generate_refusal

    line = generate_refusal(hunyuan_video_tiny, "--frames", "8")
    assert "--frames 8" in line and "4k+1" in line


def test_hunyuan_video_real_size_matches_the_published_config():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    arch = get_arch("hunyuan-video")
    t = arch.transformer
    assert (t["num_layers"], t["num_single_layers"], t["num_attention_heads"], t["attention_head_dim"]) == (20, 40, 24, 128)
    assert (t["text_embed_dim"], t["pooled_projection_dim"], t["rope_axes_dim"]) == (4096, 768, [16, 56, 56])
    layout = adapter_for_class("HunyuanVideoTransformer3DModel").layout(t, 720, 1280, 129, 256)
    assert layout.image_tokens == 33 * 45 * 80 and layout.split_tokens == 118800 + 256
    assert layout.latent_shape == (16, 33, 90, 160)
    with pytest.raises(ValueError, match="4k\\+1"):
        adapter_for_class("HunyuanVideoTransformer3DModel").layout(t, 720, 1280, 128, 256)


def _token_replace_call():
    """HunyuanVideo-I2V's token-replace layout of hunyuan-video-tiny and one step's inputs (5 frames at 32x32)."""
    import dataclasses

    from ditmesh.models import adapter_for
    from ditmesh.synth import build_transformer, get_arch

    arch = get_arch("hunyuan-video-tiny")
    arch = dataclasses.replace(arch, transformer=dict(arch.transformer, image_condition_type="token_replace"))
    model = build_transformer(arch)
    inputs = adapter_for(model).example_inputs(model, 32, 32, 1, 8, torch.Generator().manual_seed(0), "cpu",
                                               torch.float32, frames=5)
    return arch, inputs


def test_hunyuan_video_token_replace_is_refused_under_sequence_parallelism_and_runs_under_tp(pools):
    from cases_models import refused_call, transformer_call

    arch, inputs = _token_replace_call()
    for message in pools(2).run(refused_call, arch, {"ulysses": 2}, inputs):
        assert "token_replace" in message and "use tp, cfg or dp" in message and "\n" not in message
    ref, _ = transformer_call(arch, {}, inputs)
    for out, counts in pools(2).run(transformer_call, arch, {"tp": 2}, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == {"all_reduce": 2 * 4 + 2 * 1}


def test_hunyuan_video_pipefusion_is_refused_in_one_line():
    # every attention takes the padded-text key mask, which PipeFusion's attention does not
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.config import ConfigError
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer("hunyuan-video-tiny")

    with pytest.raises(ConfigError, match=r"PipeFusion \(pp=2\) does not take; use ulysses, ring, tp, cfg or dp$"):
        parallelize(Pipe, ParallelConfig(pp=2))


def test_hunyuan_video_cache_decides_as_one_process_under_ulysses(pools, hunyuan_video_tiny):
    # teacache decides from the first dual block's modulated video stream (norm1, the adapter's modulated_input)
    from cases_cache import assert_cache_decides_as_one_process

    assert_cache_decides_as_one_process(pools, hunyuan_video_tiny, {"ulysses": 2}, "teacache:threshold=0.5,warmup=1",
                                        steps=5, prompts=PROMPTS, size=48, num_frames=5, cfg=True)


@pytest.mark.parametrize("config", [{"tp": 2}, {"ring": 2}], ids=axis_id)
def test_hunyuan_video_remove_gives_back_the_pipeline(pools, hunyuan_video_tiny, config):
    from cases_hooks import remove_restores_case

    for diffs, parallel_err, after_remove in pools(2).run(remove_restores_case, hunyuan_video_tiny, config,
                                                          extra={"num_frames": 5}):
        assert diffs == [] and parallel_err <= 1e-5 and after_remove == 0.0
