"""Tensor parallelism on SD3 (sd3-tiny, SD3.5 layout) and Wan (wan-tiny), alone and x ulysses / ring, vs one process;
tp 4 on their 4-head variants sd3-tiny-tp and wan-tiny-tp.

Every rank's final latents must match the single-process run (rel err <= 1e-5, float32), every rank must hold
exactly ``replicated + sharded / tp`` parameter bytes, and each transformer call must issue exactly the
all-reduces the plans imply (counted per block as well).
"""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import pipeline_generate
from cases_tp_models import sharded_rms_norm_case, tp_model_case
from ditmesh.testing import rel_err

#: pipeline sizes: sd3-tiny 64x64 (16 image + 112 text tokens); wan-tiny 64x64 x 5 frames (2 x 4 x 4 = 32 tokens)
SHAPES = {
    "sd3-tiny": dict(height=64, width=64, max_sequence_length=35),
    "wan-tiny": dict(height=64, width=64, frames=5),
    # 16 image + 32 T5 + 2 x 32 Llama tokens (HiDreamImagePipeline renders default_sample_size^2 latent pixels)
    "hidream-tiny": dict(height=64, width=64, max_sequence_length=32, pipe_attrs={"default_sample_size": 8}),
}

#: all-reduces per block under tp > 1, in block order.
#: sd3-tiny: block 0 is dual-attention (to_out.0, to_add_out, attn2.to_out.0, ff.net.2, ff_context.net.2 = 5),
#: block 1 a plain joint block (4), block 2 is context_pre_only (no to_add_out, no ff_context: 2).
#: wan-tiny: attn1.to_out.0, attn2.to_out.0, ffn.net.2 (3 row-parallel) + the sharded QK-norms of both
#: attentions (norm_q, norm_k: 4) = 7 per block.
#: hidream-tiny: double block: to_out, to_out_t, 4 sharded QK-norms, the text MLP, the MoE's shared expert and its 4
#: routed experts (each chosen by some token here) = 12; single block: to_out, 2 QK-norms, shared + 4 experts = 8.
BLOCK_ALL_REDUCES = {"sd3-tiny": [5, 4, 2], "wan-tiny": [7, 7], "hidream-tiny": [12, 12, 8, 8]}
#: attention layers that run through sp.attention in one transformer call (see test_models_sp.py)
SP_ATTENTION_LAYERS = {"sd3-tiny": 4, "wan-tiny": 2, "hidream-tiny": 4}
#: transformer calls per pipeline run of 2 steps: SD3 batches CFG in one call, Wan calls twice per step
CALLS = {"sd3-tiny": 2, "wan-tiny": 4, "hidream-tiny": 2}

CONFIGS = [{"tp": 2}, {"tp": 2, "ulysses": 2}, {"tp": 2, "ring": 2}]

#: 4-head variants for tp 4 (sd3-tiny and wan-tiny keep 6 heads for uneven head splits elsewhere), each with the
#: blocks, shapes and collectives of its base model: variant -> base
TP4_VARIANTS = {"sd3-tiny-tp": "sd3-tiny", "wan-tiny-tp": "wan-tiny"}


def per_call(model: str, config: dict) -> dict:
    """Collectives of ONE transformer call."""
    out = {"all_reduce": sum(BLOCK_ALL_REDUCES[model])} if config.get("tp", 1) > 1 else {}
    if config.get("ulysses", 1) > 1:
        out["all_to_all"] = 2 * SP_ATTENTION_LAYERS[model]
    if config.get("ring", 1) > 1:
        out["ring_p2p"] = (config["ring"] - 1) * SP_ATTENTION_LAYERS[model]
    if config.get("ulysses", 1) * config.get("ring", 1) > 1:
        out["all_gather"] = 1  # before unpatchify
    return out


def _write_checkpoints(tmp_path_factory, folder: str, names) -> dict:
    """Synthetic pipeline folders (seed 0) of the architectures ``names``: name -> path."""
    from ditmesh.synth import write_checkpoint

    root = tmp_path_factory.mktemp(folder)
    return {name: str(write_checkpoint(name, root / name, seed=0, device="cpu")) for name in names}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Synthetic sd3-tiny, wan-tiny and hidream-tiny pipeline folders (seed 0)."""
    return _write_checkpoints(tmp_path_factory, "tp-models", SHAPES)


@pytest.fixture(scope="module")
def tp4_checkpoints(tmp_path_factory) -> dict:
    """Synthetic sd3-tiny-tp and wan-tiny-tp pipeline folders (seed 0)."""
    return _write_checkpoints(tmp_path_factory, "tp4-models", TP4_VARIANTS)


_REFERENCES: dict = {}


def reference(path: str, model: str) -> torch.Tensor:
    if model not in _REFERENCES:
        _REFERENCES[model] = pipeline_generate(path, {}, **SHAPES[TP4_VARIANTS.get(model, model)])[0]
    return _REFERENCES[model]


def check_tp_results(results: list, ref: torch.Tensor, model: str, config: dict):
    """Every rank: latents within 1e-5 of ``ref``, exact parameter bytes, exact all-reduces per block and per call
    (``model`` names the base architecture: sd3-tiny or wan-tiny)."""
    expected = per_call(model, config)
    for r in results:
        assert rel_err(r["latents"], ref) <= 1e-5
        assert r["param_bytes"] == r["expected_bytes"]  # replicated + sharded / tp, exactly
        blocks = [counts.get("all_reduce", 0) for counts in r["per_block"].values()]  # in forward order
        assert blocks == BLOCK_ALL_REDUCES[model]
        assert r["calls"] == [expected] * CALLS[model]  # every transformer call, exactly
        assert r["counts"] == {k: v * CALLS[model] for k, v in expected.items()}  # nothing outside the transformer
    assert torch.equal(results[0]["latents"], results[-1]["latents"])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("model", list(SHAPES))
def test_tp_matches_single_process(pools, checkpoints, model, config):
    ref = reference(checkpoints[model], model)
    results = pools(math.prod(config.values())).run(tp_model_case, checkpoints[model], config, **SHAPES[model])
    check_tp_results(results, ref, model, config)


@pytest.mark.parametrize("variant", list(TP4_VARIANTS))
def test_tp4_matches_single_process(pools, tp4_checkpoints, variant):
    base, config = TP4_VARIANTS[variant], {"tp": 4}
    ref = reference(tp4_checkpoints[variant], variant)
    results = pools(4).run(tp_model_case, tp4_checkpoints[variant], config, **SHAPES[base])
    check_tp_results(results, ref, base, config)


def test_wan_qk_norm_weights_are_sharded(pools, checkpoints):
    """The across-heads QK-norm weights count as sharded: each tp rank holds half of them."""
    from diffusers import WanTransformer3DModel

    full = WanTransformer3DModel.from_pretrained(checkpoints["wan-tiny"], subfolder="transformer")
    norm_bytes = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if ".norm_q." in n or ".norm_k." in n)
    for r in pools(2).run(tp_model_case, checkpoints["wan-tiny"], {"tp": 2}, steps=1, height=32, width=32, frames=1):
        assert r["sharded_norm_bytes"] * 2 == norm_bytes > 0


def test_sharded_rms_norm_is_exact_and_a_local_norm_is_wrong(pools):
    for sharded, local, counts in pools(2).run(sharded_rms_norm_case):
        assert sharded <= 1e-6
        assert local > 0.05  # a norm over the local channels alone raises nothing and is wrong
        assert counts == {"all_reduce": 1}


@pytest.mark.parametrize("model", list(SHAPES))
def test_sharded_load_matches_single_process(pools, checkpoints, model):
    ref = reference(checkpoints[model], model)
    for r in pools(2).run(tp_model_case, checkpoints[model], {"tp": 2}, sharded_load=True, **SHAPES[model]):
        assert rel_err(r["latents"], ref) <= 1e-5
        assert r["param_bytes"] == r["expected_bytes"]
        assert r["counts"] == {k: v * CALLS[model] for k, v in per_call(model, {"tp": 2}).items()}
