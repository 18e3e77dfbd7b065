"""HunyuanDiT under every axis on real gloo process groups, against one process: image self-attention with its 2-D
RoPE rows split with the tokens (Ulysses, ring, USP), long skip connections on local shards, cross-attention to the
whole masked text on every rank, tensor parallelism, batched CFG and data parallelism."""

from __future__ import annotations

import pytest
import torch

from cases_models import PROMPTS, FamilyRuns, transformer_call
from ditmesh.testing import rel_err

#: image tokens (H/16 * W/16): 16 divide 2 and 4, 9 do not; the text lengths are the model's (77 + 256)
SHAPES = {"even": dict(height=64, width=64), "uneven": dict(height=48, width=48)}
EXTRA = dict(use_resolution_binning=False)
BLOCKS = 4  # hunyuan-dit-tiny: block 0's output feeds block 3 (the long skip)
STEPS = 2
CALLS = STEPS  # batched CFG


@pytest.fixture(scope="module")
def hunyuan_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("hunyuan-dit-tiny")


#: the pipeline runs of this file and their one-process references (pipeline_generate's guidance 5.0)
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0, extra=EXTRA)
generate, reference = RUNS.generate, RUNS.reference






def expected_counts(config: dict, calls: int = CALLS) -> dict:
    counts = {}
    if config.get("tp", 1) > 1:
        counts["all_reduce"] = 3 * BLOCKS * calls  # attn1.to_out.0, attn2.to_out.0, ff.net.2
    if config.get("ulysses", 1) > 1:
        counts["all_to_all"] = 2 * BLOCKS * calls  # the self-attentions only
    if config.get("ring", 1) > 1:
        counts["ring_p2p"] = (config["ring"] - 1) * BLOCKS * calls
    gathers = (1 if config.get("ulysses", 1) * config.get("ring", 1) > 1 else 0)
    gathers += 1 if config.get("cfg", 1) * config.get("dp", 1) > 1 else 0
    if gathers:
        counts["all_gather"] = gathers * calls
    return counts


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"ulysses": 4}, {"tp": 2},
                                    {"tp": 2, "ulysses": 2}, {"cfg": 2}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_hunyuan_pipeline_matches_single_process(pools, hunyuan_tiny, config, shape):
    RUNS.check(pools, hunyuan_tiny, config, shape, CALLS, expected_counts(config))


def test_hunyuan_dp2_three_prompts_matches_single_process(pools, hunyuan_tiny):
    prompts = PROMPTS + ["a green triangle"]
    ref = reference(hunyuan_tiny, "uneven", tuple(prompts))
    for latents, counts, _ in generate(hunyuan_tiny, {"dp": 2}, "uneven", prompts, pools=pools):
        assert latents.shape[0] == 3 and rel_err(latents, ref) <= 1e-5
        assert counts == expected_counts({"dp": 2})


def test_hunyuan_tp4_matches_single_process(pools, tiny_checkpoints):
    path = tiny_checkpoints("hunyuan-dit-tiny-tp")
    for latents, counts, _ in generate(path, {"tp": 4}, "uneven", pools=pools):
        assert rel_err(latents, reference(path, "uneven")) <= 1e-5 and counts == expected_counts({"tp": 4})


def test_hunyuan_rope_text_masks_and_skips_matter(pools):
    # what the parallel runs must carry changes the output: the RoPE rows (split with the tokens), the text masks
    # (whole on every rank) and the long skip (a local shard)
    from ditmesh.models.base import adapter_for
    from ditmesh.synth import build_transformer

    model = build_transformer("hunyuan-dit-tiny", dtype=torch.float32)
    inputs = adapter_for(model).example_inputs(model, height=48, width=48, batch=2, text_len=0, device="cpu",
                                               dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    inputs["text_embedding_mask"][1, 5:] = 0  # the two samples pad their text differently
    ref, _ = transformer_call("hunyuan-dit-tiny", {}, inputs)
    for config in ({"ulysses": 2}, {"ring": 2}):
        for out, counts in pools(2).run(transformer_call, "hunyuan-dit-tiny", config, inputs):
            assert rel_err(out, ref) <= 1e-5 and counts == expected_counts(config, calls=1)
    for change in ("rope", "mask"):
        changed = dict(inputs)
        if change == "rope":
            changed["image_rotary_emb"] = tuple(t.flip(0) for t in inputs["image_rotary_emb"])
        else:
            changed["text_embedding_mask"] = torch.ones_like(inputs["text_embedding_mask"])
        assert rel_err(transformer_call("hunyuan-dit-tiny", {}, changed)[0], ref) > 1e-3, change
    assert model.blocks[3].skip_linear is not None and all(b.skip_linear is None for b in model.blocks[:3])


def test_hunyuan_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    hy = get_arch("hunyuan-dit").transformer
    assert (hy["num_layers"], hy["num_attention_heads"], hy["attention_head_dim"]) == (40, 16, 88)
    assert hy["hidden_size"] == 16 * 88 and int(hy["hidden_size"] * hy["mlp_ratio"]) == 6144
