"""FLUX.2 under every axis on real gloo process groups, against one process: 4-axis ids with a batch dimension split
with their tokens (Ulysses, ring, USP), the fused QKV + MLP projection of the single blocks and the SwiGLU halves
sharded part by part (TP), each CFG branch and each prompt on its own ranks (cfg, dp; Klein's pipeline)."""

from __future__ import annotations

import math

import pytest
import torch

from cases_cache import assert_cache_decides_as_one_process
from cases_tp_models import tp_model_case
from cases_models import FamilyRuns, JOINT_SHAPES, PROMPTS, pipeline_counts, pipeline_generate, refused_call, transformer_call
from ditmesh.testing import rel_err

SHAPES = JOINT_SHAPES  # the pipeline pads the text to max_sequence_length
ATTENTION_LAYERS = 4  # 2 double + 2 single blocks
STEPS = 2


@pytest.fixture(scope="module")
def flux2_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("flux2-tiny")


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=4.0)
reference = RUNS.reference


@pytest.mark.parametrize("config, shape", [
    ({"ulysses": 2}, "even"), ({"ring": 2}, "even"), ({"tp": 2}, "even"), ({"cfg": 2}, "even"), ({"tp": 4}, "even"),
    ({"ulysses": 2}, "uneven"), ({"ulysses": 4}, "uneven"), ({"ring": 2, "ulysses": 2}, "uneven"),
    ({"tp": 2, "ring": 2}, "uneven"), ({"dp": 2}, "uneven"),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) if isinstance(c, dict) else c)
def test_flux2_pipeline_matches_single_process(pools, flux2_tiny, config, shape):
    ref = reference(flux2_tiny, shape)
    outs = RUNS.generate(flux2_tiny, config, shape, pools=pools)
    for latents, counts, calls in outs:
        assert rel_err(latents, ref) <= 1e-5
        assert calls == 2 * STEPS  # Klein's true CFG: the prompts' call, then the negative prompts'
        # 4 all-reduces per double block (both attention outputs, both feed-forwards), 1 per single block
        assert counts == pipeline_counts(config, STEPS, ATTENTION_LAYERS, all_reduces_per_call=4 * 2 + 1 * 2)
    assert torch.equal(outs[0][0], outs[-1][0])


@pytest.mark.parametrize("config", [{"tp": 2}, {"tp": 2, "ulysses": 2}], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_flux2_sharded_load_matches_single_process(pools, flux2_tiny, config):
    # each rank reads only its rows of every packed part from the checkpoint, and holds replicated + sharded / tp bytes
    shape = dict(SHAPES["even"], guidance_scale=4.0)
    ref = pipeline_generate(flux2_tiny, {}, steps=STEPS, prompt="a red circle", **shape)[0]
    per_call = pipeline_counts(config, 1, ATTENTION_LAYERS, 4 * 2 + 1 * 2, calls_per_step=1)
    for r in pools(math.prod(config.values())).run(tp_model_case, flux2_tiny, config, sharded_load=True, **shape):
        assert rel_err(r["latents"], ref) <= 1e-5
        assert r["param_bytes"] == r["expected_bytes"]
        assert r["calls"] == [per_call] * 2 * STEPS
        assert [r["per_block"][f"transformer_blocks.{i}"]["all_reduce"] for i in range(2)] == [4, 4]


def test_flux2_tensor_plan_keeps_each_packed_part_whole_per_rank():
    # the fused single-block projection is Q | K | V | MLP gate | MLP value: each rank must keep its share of every part
    from diffusers import Flux2Transformer2DModel

    from ditmesh.models import adapter_for_class
    from ditmesh.parallel.tensor import resolve_plan
    from ditmesh.synth import get_arch

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**get_arch("flux2-dev").transformer)
    shards = resolve_plan(model, adapter_for_class("Flux2Transformer2DModel").tensor_plan, 4)
    fused = shards["single_transformer_blocks.0.attn.to_qkv_mlp_proj"]
    assert fused.parts == (6144, 6144, 6144, 18432, 18432)
    assert fused.ranges(1, 4) == [(1536, 1536), (7680, 1536), (13824, 1536), (23040, 4608), (41472, 4608)]
    assert shards["single_transformer_blocks.0.attn.to_out"].parts == (6144, 18432)
    assert shards["transformer_blocks.0.ff.linear_in"].parts == (18432, 18432)


def _inputs(**extra):
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer("flux2-tiny")
    inputs = adapter_for_class("Flux2Transformer2DModel").example_inputs(
        model, height=48, width=48, batch=2, text_len=7, generator=torch.Generator().manual_seed(3), device="cpu",
        dtype=torch.float32)
    return dict(inputs, **extra)


def test_flux2_transformer_with_distilled_guidance_matches_single_process(pools):
    # FLUX.2-dev's shape: guidance embedded (one call per step), ids with a batch dimension, odd counts (9 + 7)
    import dataclasses

    from ditmesh.synth import get_arch

    arch = get_arch("flux2-tiny")
    arch = dataclasses.replace(arch, transformer=dict(arch.transformer, guidance_embeds=True))
    inputs = _inputs()
    ref, _ = transformer_call(arch, {}, inputs)
    for config in ({"ulysses": 2}, {"tp": 2}):
        for out, counts in pools(2).run(transformer_call, arch, config, inputs):
            assert rel_err(out, ref) <= 1e-5
            assert counts == pipeline_counts(config, 1, ATTENTION_LAYERS, 10, calls_per_step=1)


def test_flux2_reference_kv_cache_is_refused_under_sequence_parallelism(pools):
    inputs = _inputs(kv_cache_mode="extract", num_ref_tokens=4)
    for message in pools(2).run(refused_call, "flux2-tiny", {"ulysses": 2}, inputs):
        assert message is not None and "kv_cache_mode" in message and "--tp" in message


def test_flux2_cache_decides_as_one_process_under_ulysses(pools, flux2_tiny):
    # teacache decides from the first double block's modulated input (the adapter's ``modulated_input``)
    assert_cache_decides_as_one_process(pools, flux2_tiny, {"ulysses": 2}, "teacache:threshold=0.5,warmup=1", steps=5,
                                        prompts=PROMPTS, size=48, max_sequence_length=15)


def test_flux2_real_size_matches_the_published_config():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    t = get_arch("flux2-dev").transformer
    assert (t["num_layers"], t["num_single_layers"], t["num_attention_heads"], t["attention_head_dim"]) == (8, 48, 48, 128)
    assert (t["joint_attention_dim"], t["in_channels"], t["axes_dims_rope"]) == (15360, 128, [32, 32, 32, 32])
    layout = adapter_for_class("Flux2Transformer2DModel").layout(t, 1024, 1024, 1, 512)
    assert layout.image_tokens == 4096 and layout.split_tokens == 4608
