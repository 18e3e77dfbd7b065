"""EasyAnimate (``models/easyanimate.py``) under every axis on real gloo process groups, against one process: on
diffusers' test configuration and inputs of the class (2 MMDiT blocks; 2 frames of 16 x 16: 128 video + 16 text tokens)
and on an odd count (3 latent frames of 3 x 3 patches, 27 video + 11 text tokens) with a third, shared-projection block
(``mmdit_layers`` 2 of 3)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cases_models import axis_id, sequence_counts, transformer_call
from ditmesh.testing import rel_err

ARCH = "easyanimate-tiny"  # diffusers' get_init_dict of the class


def case(shape: str):
    from ditmesh.synth import get_arch

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    arch = get_arch(ARCH)
    if shape == "diffusers":
        return arch, dict(hidden_states=rand(2, 4, 2, 16, 16), timestep=torch.tensor([700.0, 300.0]),
                          encoder_hidden_states=rand(2, 16, 16), return_dict=False)
    arch = dataclasses.replace(arch, transformer=dict(arch.transformer, num_layers=3))
    return arch, dict(hidden_states=rand(2, 4, 3, 6, 6), timestep=torch.tensor([700.0, 300.0]),
                      encoder_hidden_states=rand(2, 11, 16), return_dict=False)


CASES = [(c, s) for s in ("diffusers", "odd") for c in ({"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2})]


@pytest.mark.parametrize("config, shape", CASES + [({"tp": 2}, "diffusers")],
                         ids=lambda c: axis_id(c) if isinstance(c, dict) else c)
def test_easyanimate_transformer_matches_single_process(pools, config, shape):
    arch, inputs = case(shape)
    layers = arch.transformer["num_layers"]
    ref, _ = transformer_call(arch, {}, inputs)
    # tp: per MMDiT block the video and text attention outputs and both feed-forwards
    want = {"all_reduce": 4 * layers} if "tp" in config else sequence_counts(config, layers, 1)
    for out, counts in pools(math.prod(config.values())).run(transformer_call, arch, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == want


def test_easyanimate_refuses_tp_with_shared_projection_blocks(pools):
    from cases_models import refused_call

    arch, inputs = case("odd")
    for line in pools(2).run(refused_call, arch, {"tp": 2}, inputs):
        assert line.startswith("EasyAnimate's shared-projection blocks (mmdit_layers=2 of num_layers=3)")
