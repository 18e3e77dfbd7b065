"""CogView3-Plus (CogVideoX's processor and tensor plan over an image) on real gloo process groups, against one
process: text and image split where the blocks start (Ulysses, ring, USP), tp, batched CFG's samples on two ranks; at
diffusers' test configuration and input sizes and at odd token counts."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs

ARCH = "cogview3plus-tiny"
#: (height, width, text tokens): diffusers' test inputs (an 8 x 8 latent: 16 image tokens, 8 text tokens) and an odd
#: count (3 x 5 image tokens, 11 text tokens)
SIZES = {"diffusers": (64, 64, 8), "odd": (48, 80, 11)}
LAYERS, ALL_REDUCES = 2, 2 * 2


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_cogview3plus_transformer_matches_single_process(pools, config, size):
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, LAYERS, ALL_REDUCES)
    check_transformer(pools, ARCH, config, example_inputs(ARCH, *SIZES[size]), counts)
