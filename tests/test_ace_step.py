"""ACE-Step on real gloo process groups, against one process: the patch tokens split where the layers start and
gathered after the last one, the sliding-window band mask whole, rows and columns (Ulysses, ring, USP), the
cross-attention local, batched CFG on two ranks; at diffusers' test configuration and input size (8 frames) and at
ours: 21 frames (11 tokens, the last one padded) under windows of 3, so the band cuts across ranks."""

from __future__ import annotations

import dataclasses

import pytest

from cases_models import axis_id, call_counts, check_transformer, example_inputs, transformer_call
from ditmesh.testing import rel_err


def _arch(window: int):
    from ditmesh.synth import get_arch

    arch = get_arch("ace-step-tiny")
    return dataclasses.replace(arch, transformer=dict(arch.transformer, sliding_window=window))


CASES = {"diffusers": (16, 8, 10), "odd": (3, 21, 7)}  # (window, frames, condition tokens)


@pytest.mark.parametrize("config, case", [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_ace_step_transformer_matches_single_process(pools, config, case):
    window, frames, context = CASES[case]
    arch = _arch(window)
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, 2, 0)
    check_transformer(pools, arch, config, example_inputs(arch, 1, frames, context), counts)


def test_ace_step_band_matters():
    inputs = example_inputs(_arch(3), 1, 21, 7)
    narrow, _ = transformer_call(_arch(3), {}, inputs)
    assert rel_err(transformer_call(_arch(64), {}, inputs)[0], narrow) > 1e-3
