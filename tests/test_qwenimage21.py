"""Qwen-Image 2.1 on real gloo process groups, against one process: its one joint sequence of text and images under
the block-causal mask (Ulysses, ring, USP), with padded text keys, a condition image between texts, and the prefix K/V
cache from the first step reused by the next; tp over its heads and SwiGLU; true CFG's two branches on two ranks."""

from __future__ import annotations

import math

import pytest

from cases_models import axis_id
from cases_qwenimage21 import layout_inputs, steps
from ditmesh.testing import rel_err

#: joint lengths: 6 text + 4 condition-image + 3 text + 16 target = 29 tokens (odd, no degree divides it), and
#: 4 + 4 + 2 + 12 = 22 (a 3 x 4 target: the cached calls split 12 target tokens)
LAYOUTS = {"odd": ((6, (2, 2), 3, (4, 4))), "even": ((4, (2, 2), 2, (4, 4)))}
BLOCKS = 2


def expected_counts(config: dict, cache: bool) -> dict:
    """Collectives of a 2-step run (one branch): per block 2 all-to-alls (Ulysses) or ring - 1 exchange rounds (ring) in
    each call, one all-gather of the output per call; the extracting call all-gathers each layer's K and V once. A
    cached call under ring gathers the target's keys and values instead of passing them round (one all-gather per
    layer); under tp 2 all-reduces per block and call."""
    calls, counts = 2, {}
    if "tp" in config:
        counts["all_reduce"] = 2 * BLOCKS * calls
    if "ulysses" in config:
        counts["all_to_all"] = 2 * BLOCKS * calls
    if "ring" in config:
        counts["ring_p2p"] = (config["ring"] - 1) * BLOCKS * (1 if cache else calls)
    if "ulysses" in config or "ring" in config:
        counts["all_gather"] = calls + (BLOCKS if cache else 0) + (BLOCKS if cache and "ring" in config else 0)
    return counts


@pytest.mark.parametrize("config, layout, cache", [
    ({"ulysses": 2}, "odd", True), ({"ulysses": 2}, "even", False), ({"ring": 2}, "odd", True),
    ({"ring": 2, "ulysses": 2}, "odd", True), ({"ulysses": 4}, "even", True), ({"tp": 2}, "odd", True),
], ids=lambda v: axis_id(v) if isinstance(v, dict) else str(v))
def test_qwenimage21_steps_match_single_process(pools, config, layout, cache):
    inputs = layout_inputs(*LAYOUTS[layout])
    ref, _ = steps({}, inputs, cache=cache)
    for outs, counts in pools(math.prod(config.values())).run(steps, config, inputs, cache=cache):
        assert [o.shape for o in outs] == [r.shape for r in ref]
        assert all(rel_err(o, r) <= 1e-5 for o, r in zip(outs, ref))
        assert counts == expected_counts(config, cache)


def test_qwenimage21_cfg_branches_on_two_ranks(pools):
    # true CFG: the cond call on cfg rank 0, the uncond call on rank 1, each with its own cache; the skipped call's
    # placeholder is the whole joint sequence (29 tokens) in the extracting step and the target (16) in the cached one
    inputs = layout_inputs(*LAYOUTS["odd"])
    ref, _ = steps({}, inputs, branches=2)
    assert [r.shape[1] for r in ref] == [29, 29, 16, 16]
    for outs, counts in pools(2).run(steps, {"cfg": 2}, inputs, branches=2):
        assert all(rel_err(o, r) <= 1e-5 for o, r in zip(outs, ref))
        assert counts == {"all_gather": 2}


def test_qwenimage21_mask_and_cache_matter():
    # what the parallel runs must carry changes the output: the key padding, and the cache (a cached step differs from
    # the same step run in full only in the prefix's modulation, which the cache fixes at t = 0 either way)
    inputs = layout_inputs(*LAYOUTS["odd"])
    ref, _ = steps({}, inputs)
    unpadded, _ = steps({}, dict(inputs, encoder_hidden_states_mask=None))
    assert rel_err(unpadded[0], ref[0]) > 1e-3
    full, _ = steps({}, inputs, cache=False)
    assert rel_err(full[1][:, -16:], ref[1]) <= 1e-5  # the cache is exact: the prefix does not depend on the step


def test_qwenimage21_layout_and_real_size():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    adapter = adapter_for_class("QwenImage21Transformer2DModel")
    t = get_arch("qwenimage21").transformer
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"]) == (32, 32, 128)
    assert adapter.layout(t, 1024, 1024, 1, 512).split_tokens == 4096 + 512
    with pytest.raises(ValueError, match="multiple of 32"):
        adapter.layout(t, 1000, 1024, 1, 512)
