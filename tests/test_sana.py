"""Sana under every axis on real gloo process groups, against one process: linear self-attention with its key sums
added over the ranks, the Mix-FFN's 3x3 convolution on rows split over the ranks with halo rows exchanged,
cross-attention to the whole text under its mask, tensor parallelism, batched CFG and data parallelism."""

from __future__ import annotations

import pytest
import torch

from cases_models import PROMPTS, FamilyRuns, transformer_call
from cases_sana import compiled_sequence_parallel_case, sana_without_case, transformer_call_error
from ditmesh.testing import rel_err

#: latent grids (the DC-AE divides by 32): 8 x 8 = 64 tokens (8 rows: 4 + 4, 2 x 4); 7 x 5 = 35 tokens (7 rows:
#: 4 + 3 on 2 ranks, 2 + 2 + 2 + 1 on 4)
SHAPES = {"even": dict(height=256, width=256, max_sequence_length=32),
          "uneven": dict(height=224, width=160, max_sequence_length=15)}
#: SanaPipeline options for tiny CPU runs: no resolution binning, no caption cleaning, no chat instruction in front
EXTRA = dict(use_resolution_binning=False, clean_caption=False, complex_human_instruction=None)
BLOCKS = 2
STEPS = 2
CALLS = STEPS  # batched CFG: one transformer call per step on [uncond, cond]


@pytest.fixture(scope="module")
def sana_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("sana-tiny")


#: the pipeline runs of this file and their one-process references (pipeline_generate's guidance 5.0)
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0, extra=EXTRA)
generate, reference = RUNS.generate, RUNS.reference






def expected_counts(config: dict, calls: int = CALLS) -> dict:
    """Collectives of ``calls`` transformer calls."""
    counts = {}
    sp = config.get("ulysses", 1) * config.get("ring", 1) > 1
    reduces = (2 * BLOCKS if config.get("tp", 1) > 1 else 0) + (BLOCKS if sp else 0)  # tp: attn1, attn2; sp: key sums
    if reduces:
        counts["all_reduce"] = reduces * calls
    if sp:
        counts["halo"] = BLOCKS * calls  # one exchange per Mix-FFN convolution
    gathers = (1 if sp else 0) + (1 if config.get("cfg", 1) * config.get("dp", 1) > 1 else 0)
    if gathers:
        counts["all_gather"] = gathers * calls
    return counts


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"ulysses": 4}, {"tp": 2},
                                    {"tp": 2, "ring": 2}, {"cfg": 2}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sana_pipeline_matches_single_process(pools, sana_tiny, config, shape):
    RUNS.check(pools, sana_tiny, config, shape, CALLS, expected_counts(config))


def test_sana_dp2_three_prompts_matches_single_process(pools, sana_tiny):
    prompts = PROMPTS + ["a green triangle"]
    ref = reference(sana_tiny, "uneven", tuple(prompts))
    for latents, counts, _ in generate(sana_tiny, {"dp": 2}, "uneven", prompts, pools=pools):
        assert latents.shape[0] == 3 and rel_err(latents, ref) <= 1e-5
        assert counts == expected_counts({"dp": 2})


def test_sana_tp4_matches_single_process(pools, tiny_checkpoints):
    path = tiny_checkpoints("sana-tiny-tp")
    for latents, counts, _ in generate(path, {"tp": 4}, "uneven", pools=pools):
        assert rel_err(latents, reference(path, "uneven")) <= 1e-5 and counts == expected_counts({"tp": 4})


def _inputs(height: int, width: int) -> dict:
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer("sana-tiny", dtype=torch.float32)
    return adapter_for(model).example_inputs(model, height=height, width=width, batch=2, text_len=9, device="cpu",
                                             dtype=torch.float32, generator=torch.Generator().manual_seed(3))


def test_sana_halo_rows_and_key_sums_matter(pools):
    # the two exchanges are needed: without the halo rows the convolution sees zeros at the ranks' borders, and
    # without the all-reduce each rank's attention sums only its own keys; both give another result
    inputs = _inputs(224, 160)
    ref, _ = transformer_call("sana-tiny", {}, inputs)
    for config in ({"ulysses": 2}, {"ring": 2}):
        for out, counts in pools(2).run(transformer_call, "sana-tiny", config, inputs):
            assert rel_err(out, ref) <= 1e-5 and counts == expected_counts(config, calls=1)
    for missing in ("halo", "key sums"):
        for out in pools(2).run(sana_without_case, missing, inputs):
            assert rel_err(out, ref) > 1e-3, missing


def test_sana_refuses_fewer_rows_than_ranks_in_one_line(pools):
    # 3 latent rows cannot give each of 4 ranks a whole row
    inputs = _inputs(96, 160)
    for message in pools(4).run(transformer_call_error, "sana-tiny", {"ulysses": 4}, inputs):
        assert "whole grid rows" in message and "at least 4 latent rows" in message and "\n" not in message


def test_sana_refuses_compiled_blocks_with_sequence_parallelism_in_one_line(pools):
    # the halo exchange inside a compiled block is not supported: refused before anything is changed
    for message in pools(2).run(compiled_sequence_parallel_case):
        assert "compile off with sequence parallelism" in message and "\n" not in message


def test_sana_real_size_matches_the_published_config():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    sana = get_arch("sana-1600m").transformer
    assert (sana["num_layers"], sana["num_attention_heads"], sana["attention_head_dim"]) == (20, 70, 32)
    assert sana["num_attention_heads"] * sana["attention_head_dim"] == sana["cross_attention_dim"] == 20 * 112
    assert get_arch("sana-1600m").t5["hidden_size"] == sana["caption_channels"]

    class Config:
        num_attention_heads, num_cross_attention_heads = 70, 20

    class Model:
        config = Config

    assert adapter_for_class("SanaTransformer2DModel").num_heads(Model) == 10  # tp must divide 70 and 20


def test_the_planner_counts_sanas_key_sums_and_halo_rows():
    # no softmax attention of Sana crosses ranks: what its sequence parallelism moves is the adapter's count
    from ditmesh.config import ParallelConfig
    from ditmesh.planner import plan

    by = {p.config: p for p in plan("sana-1600m", 1024, 1024, 2, link="nvlink-h100").predictions}
    moved = by[ParallelConfig(ulysses=2)].comm_bytes["by_collective"]
    # 20 blocks: key sums [70, 33, 32] float32 all-reduced (sends 2 x (2 - 1) / 2 of it), halo 2 rows x 32 tokens x
    # 11200 channels in bf16
    assert moved["all_reduce"] == 20 * 70 * 33 * 32 * 4
    assert moved["halo"] == 20 * 2 * 32 * 11200 * 2
    assert "all_to_all" not in moved and "ring_p2p" not in by[ParallelConfig(ring=2)].comm_bytes["by_collective"]
