"""Krea 2 on real gloo process groups, against one process: its one [text, image] sequence split where the blocks start
and gathered after the last one (Ulysses, ring, USP), grouped-query heads and the prompt's key mask, tp over the
query and key/value heads, the prompt's and the negative prompt's calls on two ranks (cfg); at diffusers' test
configuration and input sizes, and at odd token counts."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs, transformer_call
from ditmesh.testing import rel_err

ARCH = "krea2-tiny"
#: (height, width, text tokens): diffusers' test inputs (2 x 2 image tokens, 4 text tokens, the last one padding) and
#: an odd count (3 x 5 image tokens, 8 text tokens, the first sample's last 3 padding)
SIZES = {"diffusers": (32, 32, 4), "odd": (48, 80, 8)}
LAYERS, ALL_REDUCES = 2, 2 * 2


def _inputs(size: str) -> dict:
    inputs = example_inputs(ARCH, *SIZES[size])
    if size == "diffusers":
        inputs["encoder_attention_mask"][:, -1] = False
    else:
        inputs["encoder_attention_mask"][0, -3:] = False
    return inputs


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_krea2_transformer_matches_single_process(pools, config, size):
    check_transformer(pools, ARCH, config, _inputs(size), call_counts(config, LAYERS, ALL_REDUCES))


def test_krea2_cfg_runs_the_two_calls_on_two_ranks(pools):
    from cases_two_calls import two_calls

    cond, uncond = _inputs("odd"), _inputs("odd")
    uncond["encoder_hidden_states"] = uncond["encoder_hidden_states"].flip(1)
    ref, _ = two_calls({}, cond, uncond, arch=ARCH)
    for outs, counts in pools(2).run(two_calls, {"cfg": 2}, cond, uncond, arch=ARCH):
        assert all(rel_err(o, r) <= 1e-5 for o, r in zip(outs, ref))
        assert counts == {"all_gather": 1}


def test_krea2_mask_and_positions_matter():
    inputs = _inputs("odd")
    ref, _ = transformer_call(ARCH, {}, inputs)
    unpadded = dict(inputs, encoder_attention_mask=None)
    assert rel_err(transformer_call(ARCH, {}, unpadded)[0], ref) > 1e-3
    positions = inputs["position_ids"].clone()  # the image tokens' positions in reverse (a uniform shift changes nothing)
    positions[8:] = positions[8:].flip(0)
    assert rel_err(transformer_call(ARCH, {}, dict(inputs, position_ids=positions))[0], ref) > 1e-3
