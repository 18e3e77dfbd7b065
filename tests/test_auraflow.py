"""AuraFlow on real gloo process groups, against one process: image tokens split where they appear, the text with its
register tokens where the joint blocks start, the single blocks' concatenation cut by the local text length (Ulysses,
ring, USP); tp over the heads and SwiGLUs; batched CFG's samples on two ranks; at diffusers' test configuration and
input sizes and at odd token counts."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs

ARCH = "auraflow-tiny"
#: (height, width, text tokens): diffusers' test inputs (a 32 x 32 latent: 256 image tokens; 256 text tokens + 8
#: registers) and an odd count (3 x 5 image tokens, 11 + 8 text tokens)
SIZES = {"diffusers": (256, 256, 256), "odd": (48, 80, 11)}
LAYERS, ALL_REDUCES = 2, 4 + 2


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_auraflow_transformer_matches_single_process(pools, config, size):
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, LAYERS, ALL_REDUCES)
    check_transformer(pools, ARCH, config, example_inputs(ARCH, *SIZES[size]), counts)
