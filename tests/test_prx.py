"""PRX on real gloo process groups, against one process: image queries over [text, image] keys with the text's key
padding (Ulysses, ring, USP: the local text tokens get queries whose rows are dropped), the unchanged text split at
every block, tp over its fused projections, batched CFG on two ranks; at even and odd token counts (diffusers' test
configuration is 200M parameters: ours has its layout at 4 heads of 16)."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs, transformer_call
from ditmesh.testing import rel_err

ARCH = "prx-tiny"
#: (height, width, text tokens): 4 x 4 image tokens and 16 text tokens; an odd 3 x 5 and 11
SIZES = {"even": (64, 64, 16), "odd": (48, 80, 11)}
LAYERS, ALL_REDUCES = 2, 2 * 2


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "even"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_prx_transformer_matches_single_process(pools, config, size):
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, LAYERS, ALL_REDUCES)
    check_transformer(pools, ARCH, config, example_inputs(ARCH, *SIZES[size]), counts)


def test_prx_text_padding_matters():
    inputs = example_inputs(ARCH, *SIZES["odd"])
    ref, _ = transformer_call(ARCH, {}, inputs)
    assert rel_err(transformer_call(ARCH, {}, dict(inputs, attention_mask=None))[0], ref) > 1e-3
