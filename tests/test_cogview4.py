"""CogView4 under every axis on real gloo process groups, against one process: the split after its own patch
embedding, RoPE on the image tokens only (the local image part of each rank's joint sequence), the optional text
mask reordered like the keys, tensor parallelism over its shared feed-forward, and its two CFG calls."""

from __future__ import annotations


import pytest
import torch

from cases_models import EVERY_AXIS, PROMPTS, FamilyRuns, axis_id, sequence_counts, transformer_call
from ditmesh.testing import rel_err

#: image tokens (H/16 * W/16) and text tokens (the prompt padded to a multiple of 16): 16 + 16 divide 2; 9 does not
SHAPES = {"even": dict(height=64, width=64), "uneven": dict(height=48, width=48)}
LAYERS = 2
STEPS = 2


@pytest.fixture(scope="module")
def cogview4_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("cogview4-tiny")


#: the pipeline runs of this file and their one-process references (pipeline_generate's guidance 5.0)
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0)


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 2 transformer calls (prompt, negative prompt)."""
    calls = 2 * STEPS
    if "cfg" in config:
        return {"all_gather": STEPS}  # the two branches exchanged once per step
    if "dp" in config:
        return {"all_gather": calls}  # each call's output gathered over the two groups' samples
    if "tp" in config:
        return {"all_reduce": 3 * LAYERS * calls}  # attention output, and the shared feed-forward once per stream
    return sequence_counts(config, LAYERS, calls)


@pytest.mark.parametrize("shape", ["even", "uneven"])
@pytest.mark.parametrize("config", EVERY_AXIS, ids=axis_id)
def test_cogview4_pipeline_matches_single_process(pools, cogview4_tiny, config, shape):
    prompt = PROMPTS if "dp" in config else PROMPTS[:1]
    RUNS.check(pools, cogview4_tiny, config, shape, 2 * STEPS, expected_counts(config), prompt)


def _masked_inputs() -> dict:
    """Transformer inputs of two samples whose text is padded differently (12 and 5 prompt tokens of 16), 9 image
    tokens."""
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer("cogview4-tiny", seed=0, dtype=torch.float32)
    inputs = adapter_for_class("CogView4Transformer2DModel").example_inputs(
        model, 48, 48, 2, 16, torch.Generator().manual_seed(3), "cpu", torch.float32)
    mask = torch.ones(2, 16)
    mask[0, 12:], mask[1, 5:] = 0, 0
    return dict(inputs, attention_mask=mask)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_cogview4_text_mask_travels_with_the_keys(pools, config):
    inputs = _masked_inputs()
    ref, _ = transformer_call("cogview4-tiny", {}, inputs)
    unmasked, _ = transformer_call("cogview4-tiny", {}, {k: v for k, v in inputs.items() if k != "attention_mask"})
    assert rel_err(unmasked, ref) > 1e-3  # the mask changes the result: the parallel runs must carry it
    for out, counts in pools(2).run(transformer_call, "cogview4-tiny", config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts.get("all_to_all", 0) == (2 * LAYERS if "ulysses" in config else 0)


def test_cogview4_real_size_matches_the_published_config():
    from ditmesh.synth import get_arch

    t = get_arch("cogview4").transformer
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["text_embed_dim"]) == (28, 32, 128, 4096)
