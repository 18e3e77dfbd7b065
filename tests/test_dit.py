"""DiT on real gloo process groups, against one process: its image tokens split where they appear and gathered after
the last projection (Ulysses, ring, USP), tp, batched CFG's class labels on two ranks; at diffusers' test configuration
and input size (16 tokens) and at an odd count (3 x 3 tokens: DiT's grid is square)."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs

ARCH = "dit-tiny"
#: (height, width): diffusers' test input (an 8 x 8 latent: 4 x 4 tokens) and an odd count (3 x 3 tokens)
SIZES = {"diffusers": (64, 64), "odd": (48, 48)}


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_dit_transformer_matches_single_process(pools, config, size):
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, 1, 2)
    check_transformer(pools, ARCH, config, example_inputs(ARCH, *SIZES[size], 0), counts)


def test_dit_refuses_a_non_square_size():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    with pytest.raises(ValueError, match="square"):
        adapter_for_class("DiTTransformer2DModel").layout(get_arch("dit-xl-2-256").transformer, 256, 512, 1, 0)
