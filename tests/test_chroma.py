"""Chroma under every axis on real gloo process groups, against one process: its padded-text mask travels with the
keys (Ulysses, ring), shards with the heads (TP) and with each CFG branch (cfg)."""

from __future__ import annotations

import math

import pytest
import torch

from cases_cache import assert_cache_decides_as_one_process
from cases_models import FamilyRuns, JOINT_SHAPES, PROMPTS, check_ranks, masks_dropped, pipeline_counts, pipeline_generate
from ditmesh.testing import rel_err

#: two prompts of different lengths: each sample pads its text differently, so the mask differs per sample
SHAPES = JOINT_SHAPES
ATTENTION_LAYERS = 4  # 2 double + 2 single blocks
STEPS = 2


@pytest.fixture(scope="module")
def chroma_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("chroma-tiny")


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0)
reference = RUNS.reference


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 2 transformer calls (prompt, negative prompt); under tp 4
    all-reduces per double block and 1 per single block (FLUX's plan)."""
    return pipeline_counts(config, STEPS, ATTENTION_LAYERS, all_reduces_per_call=4 * 2 + 1 * 2)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2}, {"cfg": 2}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_chroma_pipeline_matches_single_process(pools, chroma_tiny, config, shape):
    ref = reference(chroma_tiny, shape)
    outs = RUNS.generate(chroma_tiny, config, shape, pools=pools)
    check_ranks(outs, ref, 2 * STEPS, expected_counts(config))


@pytest.mark.parametrize("config", [{}, {"ulysses": 2}, {"ring": 2}], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "single")
def test_chroma_attention_in_query_pieces_keeps_its_mask(pools, chroma_tiny, config):
    # pieces of 5 queries (and feed-forwards of 5 tokens) with the padded-text mask cut by query rows
    ref = reference(chroma_tiny, "uneven")
    args = (pipeline_generate, chroma_tiny, config)
    kwargs = dict(steps=STEPS, prompt=PROMPTS, chunk_tokens=5, **SHAPES["uneven"])
    outs = pools(math.prod(config.values())).run(*args, **kwargs) if config else [args[0](*args[1:], **kwargs)]
    for latents, counts, calls in outs:
        assert rel_err(latents, ref) <= 1e-5
        assert counts == (expected_counts(config) if config else {})  # the pieces add no collective


def test_chroma_mask_changes_the_output(chroma_tiny):
    # the mask the parallel runs must carry matters: dropping it inside the transformer gives another result
    seen, latents = masks_dropped(chroma_tiny, "attention_mask", PROMPTS, STEPS, **SHAPES["even"])
    mask = seen[0]
    assert mask.shape == (2, 32 + 16) and not torch.equal(mask[0], mask[1])  # per-sample padding
    assert rel_err(latents, reference(chroma_tiny, "even")) > 1e-3


def test_chroma_cache_decides_as_one_process_under_ulysses(pools, chroma_tiny):
    # teacache skips the double and the single blocks: its residual runs from [text, image] into cat([text, image])
    assert_cache_decides_as_one_process(pools, chroma_tiny, {"ulysses": 2}, "teacache:threshold=1.0,warmup=1", steps=5,
                                        prompts=PROMPTS, size=48, max_sequence_length=15, guidance_scale=1.0)


def test_chroma_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    hd = get_arch("chroma1-hd").transformer
    assert (hd["num_layers"], hd["num_single_layers"], hd["num_attention_heads"], hd["attention_head_dim"]) == (19, 38, 24, 128)
    assert (hd["approximator_hidden_dim"], hd["approximator_layers"], hd["joint_attention_dim"]) == (5120, 5, 4096)
