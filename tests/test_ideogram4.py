"""Ideogram 4 on real gloo process groups, against one process: its packed per-token inputs cut at the entry and the
segment mask built whole (Ulysses, ring, USP), the heads sharded (tp), at diffusers' test configuration and input sizes
and at odd token counts with two samples packed in one row; cfg refused in one line."""

from __future__ import annotations

import pytest
import torch

from cases_models import axis_id, call_counts, check_transformer, example_inputs, refused_call, transformer_call
from ditmesh.testing import rel_err

ARCH = "ideogram4-tiny"
#: (height, width, text positions): diffusers' test inputs (4 text positions, 2 x 2 image tokens) and an odd count
#: (7 text positions, 3 x 5 image tokens: 22 in all)
SIZES = {"diffusers": (32, 32, 4), "odd": (48, 80, 7)}
LAYERS, ALL_REDUCES = 2, 2 * 2


def _inputs(size: str, packed: bool = False) -> dict:
    inputs = example_inputs(ARCH, *SIZES[size])
    if packed:  # sample 1's row holds two segments: its first 9 positions are another sample's
        inputs["segment_ids"][1, :9] = 2
        inputs["timestep"] = torch.rand(2, inputs["indicator"].shape[1], generator=torch.Generator().manual_seed(4))
    return inputs


@pytest.mark.parametrize("config, size", [({"ulysses": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"tp": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_ideogram4_transformer_matches_single_process(pools, config, size):
    check_transformer(pools, ARCH, config, _inputs(size, packed=size == "odd"), call_counts(config, LAYERS, ALL_REDUCES))


def test_ideogram4_segments_and_token_timesteps_matter():
    inputs = _inputs("odd", packed=True)
    ref, _ = transformer_call(ARCH, {}, inputs)
    one_segment = dict(inputs, segment_ids=torch.ones_like(inputs["segment_ids"]))
    assert rel_err(transformer_call(ARCH, {}, one_segment)[0], ref) > 1e-3
    one_time = dict(inputs, timestep=inputs["timestep"].mean(1))
    assert rel_err(transformer_call(ARCH, {}, one_time)[0], ref) > 1e-3


def test_ideogram4_cfg_is_refused_in_one_line(pools):
    for message in pools(2).run(refused_call, ARCH, {"cfg": 2}, _inputs("diffusers")):
        assert message is not None and "cfg=2 cannot run ideogram4" in message and "unconditional_transformer" in message
