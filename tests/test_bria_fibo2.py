"""Bria FIBO 2 (``models/bria_fibo2.py``) on real gloo process groups, against one process: the refiner's image and
context tokens split and gathered around it, then the sequence joined with the Perceiver's gist tokens split and
gathered around the main blocks; on diffusers' test configuration and inputs (a 4 x 4 grid, 6 text tokens: 8 gist
tokens first) and on ours: 3 heads, 2 refiner blocks, a batch of 2 on a 3 x 5 grid with a 2 x 3 image to edit (21
refiner tokens), prompts of 4 and 16 text tokens whose gist (4 and 8) the batch pads, so the gist goes last under a
key mask (29 joint tokens); Ulysses, ring, USP, tp, dp (one prompt a rank, its gist unpadded) and the two CFG calls
on two ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("bria-fibo2-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, dim=48, n_heads=3, n_refiner_layers=2))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 4, 8, 8), timestep=torch.tensor([0.5]),
                    encoder_hidden_states=rand(1, 2, 6, 24), return_dict=False)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 4:] = False
    return dict(hidden_states=rand(2, 4, 6, 10), timestep=torch.tensor([0.7, 0.3]),
                encoder_hidden_states=rand(2, 2, 16, 24), encoder_attention_mask=mask,
                context_latents=[rand(2, 4, 4, 6)], return_dict=False)


def refiners(shape: str) -> int:
    return arch_of(shape).transformer["n_refiner_layers"]


def counts(config: dict, shape: str) -> dict:
    """Per refiner and main block the self-attention's exchanges; the refiner's gather and the output's."""
    layers = refiners(shape) + 2
    if config.get("tp", 1) > 1:  # per block the attention output and w2; the injection block's cross-attention
        return {"all_reduce": 2 * layers + 1}
    if "dp" in config:  # one sample a rank, the outputs gathered
        return {"all_gather": 1}
    got = {"all_gather": 2}
    if "ulysses" in config:
        got["all_to_all"] = 2 * layers
    if "ring" in config:
        got["ring_p2p"] = (config["ring"] - 1) * layers
    return got


# diffusers' configuration under Ulysses and tp (its 2 heads); ours, the harder one, under every sequence axis and dp
# (one prompt a rank: each rank's gist unpadded and first, the batch's padded and last)
CASES = [({"ulysses": 2}, "diffusers"), ({"tp": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES] + [({"dp": 2}, "odd")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_bria_fibo2_transformer_matches_single_process(pools, config, shape):
    check_transformer(pools, arch_of(shape), config, inputs_of(shape), counts(config, shape))


def test_bria_fibo2_cfg_runs_the_two_calls_on_two_ranks(pools):
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))


def test_bria_fibo2_context_and_gist_padding_matter():
    # the image to edit and the prompts' padding (hence the gist mask) must change the output, or the cases above
    # could not fail on them
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    assert rel_err(transformer_call(arch, {}, dict(inputs, context_latents=None))[0], ref) > 1e-3
    unpadded = dict(inputs, encoder_attention_mask=torch.ones(2, 16, dtype=torch.bool))
    assert rel_err(transformer_call(arch, {}, unpadded)[0][0], ref[0]) > 1e-3
