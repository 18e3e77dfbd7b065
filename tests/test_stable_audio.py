"""Stable Audio Open on real gloo process groups, against one process: the global token and the audio samples split
where the blocks start, with the pipeline's RoPE table, and gathered after the last one (Ulysses, ring, USP); the
cross-attention to the whole context; tp over both attentions' heads and the SwiGLU halves; batched CFG on two ranks;
at diffusers' test configuration with 16 latent samples and an odd 21."""

from __future__ import annotations

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs

ARCH = "stable-audio-tiny"
#: (latent samples, context tokens): 16 samples + the global token (17), and 21 + 1 with 7 context tokens
SIZES = {"even": (16, 8), "odd": (21, 7)}
LAYERS, ALL_REDUCES = 2, 2 * 3


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "even"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_stable_audio_transformer_matches_single_process(pools, config, size):
    samples, context = SIZES[size]
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, LAYERS, ALL_REDUCES)
    check_transformer(pools, ARCH, config, example_inputs(ARCH, 1, samples, context), counts)
