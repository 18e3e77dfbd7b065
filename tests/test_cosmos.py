"""Cosmos (``models/cosmos.py``) under every axis on real gloo process groups, against one process: on diffusers' test
configuration of the class (without the padding-mask channel, whose resize needs torchvision) at its inputs' size (1
latent frame of 16 x 16: 64 tokens) and at 3 latent frames of 6 x 6 (27 tokens) with one timestep per latent frame
(the per-token modulation cut at every block) and padded text."""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import axis_id, sequence_counts, transformer_call
from ditmesh.testing import rel_err

ARCH = "cosmos-tiny"
LAYERS = 2


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 4, 1, 16, 16), timestep=torch.tensor([700.0]),
                    encoder_hidden_states=rand(1, 12, 16), attention_mask=torch.ones(1, 12), fps=30, return_dict=False)
    mask = torch.ones(2, 11)
    mask[1, 5:] = 0
    return dict(hidden_states=rand(2, 4, 3, 6, 6), timestep=(torch.rand(2, 1, 3, 1, 1, generator=g) * 1000),
                encoder_hidden_states=rand(2, 11, 16), attention_mask=mask, fps=24, return_dict=False)


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2}], ids=axis_id)
def test_cosmos_transformer_matches_single_process(pools, config, shape):
    inputs = inputs_of(shape)
    ref, _ = transformer_call(ARCH, {}, inputs)
    want = {"all_reduce": 3 * LAYERS} if "tp" in config else sequence_counts(config, LAYERS, 1)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, ARCH, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == want


def test_cosmos_per_frame_timesteps_matter():
    inputs = inputs_of("odd")
    ref = transformer_call(ARCH, {}, inputs)[0]
    flat = dict(inputs, timestep=inputs["timestep"].mean(2, keepdim=True).expand_as(inputs["timestep"]))
    assert rel_err(transformer_call(ARCH, {}, flat)[0], ref) > 1e-3
