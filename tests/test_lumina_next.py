"""Lumina-Next on real gloo process groups, against one process: image tokens and their RoPE rows split where they
appear, the self-attention's length-dependent softmax scale from the global length (Ulysses, ring, USP), the gated
cross-attention to the whole text, batched CFG on two ranks; grouped-query heads; even and odd token counts."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs

ARCH = "lumina-next-tiny"
#: (height, width, text tokens): 4 x 4 image tokens; an odd 3 x 5
SIZES = {"even": (64, 64, 8), "odd": (48, 80, 7)}


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "even"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_lumina_next_transformer_matches_single_process(pools, config, size):
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, 2, 0)
    check_transformer(pools, ARCH, config, example_inputs(ARCH, *SIZES[size]), counts)
