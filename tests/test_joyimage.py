"""JoyImage-Edit (``models/joyimage.py``) under every axis on real gloo process groups, against one process: on
diffusers' test configuration of the class at its inputs' size (one 4 x 4 latent: 4 image tokens, 12 text tokens) and
on ours: 3 heads, the text's own RoPE table (``rope_type="mrope"``, whole on every rank, cut by the processor) and an
edit's two items of 3 x 5 tokens (30 image tokens) with 7 text tokens and a batch of 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, call_counts, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("joyimage-edit-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, hidden_size=48, num_attention_heads=3,
                                                      rope_type="mrope"))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 16, 1, 4, 4), encoder_hidden_states=rand(1, 12, 16),
                    timestep=torch.tensor([1.0]), return_dict=False)
    return dict(hidden_states=rand(2, 2, 16, 1, 6, 10), encoder_hidden_states=rand(2, 7, 16),
                timestep=torch.tensor([700.0, 300.0]), return_dict=False)


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES]
CASES += [({"tp": 2}, "diffusers")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_joyimage_transformer_matches_single_process(pools, config, shape):
    arch, inputs = arch_of(shape), inputs_of(shape)
    # tp: per block both streams' output projections and feed-forward down projections (4 all-reduces); sequence:
    # the joint attention's exchanges and the image's gather at proj_out
    want = call_counts(config, LAYERS, 4 * LAYERS)
    check_transformer(pools, arch, config, inputs, want)


def test_joyimage_cfg_runs_the_two_calls_on_two_ranks(pools):
    # JoyImageEditPipeline's CFG: the prompt's call, then the negative prompt's, one on each rank
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))


def test_joyimage_text_rope_matters():
    # the mrope text table the processor cuts must change the output, or the odd cases could not catch a wrong cut
    inputs = inputs_of("odd")
    plain = dataclasses.replace(arch_of("odd"), transformer=dict(arch_of("odd").transformer, rope_type="rope"))
    assert rel_err(transformer_call(plain, {}, inputs)[0], transformer_call(arch_of("odd"), {}, inputs)[0]) > 1e-3


# -- JoyImage-Edit Plus: its packed images padded to the longest sample, the key mask over [image, text] -------------
def plus_arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("joyimage-edit-plus-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, hidden_size=48, num_attention_heads=3))


def plus_inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 2, 16, 1, 2, 2), encoder_hidden_states=rand(1, 12, 16),
                    timestep=torch.tensor([1.0]), shape_list=[[(1, 1, 1), (1, 1, 1)]], return_dict=False)
    # sample 0: a 3 x 3 target and a 2 x 3 reference (15 patches); sample 1: the target and a 1 x 2 reference (11,
    # padded to 15); its prompt 4 of 7 tokens
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    return dict(hidden_states=rand(2, 15, 16, 1, 2, 2), encoder_hidden_states=rand(2, 7, 16),
                timestep=torch.tensor([700.0, 300.0]), encoder_hidden_states_mask=mask,
                shape_list=[[(1, 3, 3), (1, 2, 3)], [(1, 3, 3), (1, 1, 2)]], return_dict=False)


PLUS_CASES = [({"ulysses": 2}, "diffusers"), ({"tp": 2}, "diffusers")]
PLUS_CASES += [(c, "odd") for c in (*SP_AXES, {"cfg": 2}, {"dp": 2})]


@pytest.mark.parametrize("config, shape", PLUS_CASES, ids=case_id)
def test_joyimage_plus_transformer_matches_single_process(pools, config, shape):
    arch, inputs = plus_arch_of(shape), plus_inputs_of(shape)
    # cfg and dp: the batched [uncond, cond] call's two samples, each with its own grids, one on each rank
    want = {"all_gather": 1} if {"cfg", "dp"} & set(config) else call_counts(config, LAYERS, 4 * LAYERS)
    check_transformer(pools, arch, config, inputs, want)


def test_joyimage_plus_mask_and_grids_matter():
    inputs = plus_inputs_of("odd")
    ref = transformer_call(plus_arch_of("odd"), {}, inputs)[0]
    unmasked = dict(inputs, encoder_hidden_states_mask=torch.ones(2, 7))
    assert rel_err(transformer_call(plus_arch_of("odd"), {}, unmasked)[0], ref) > 1e-3
    swapped = dict(inputs, shape_list=inputs["shape_list"][::-1])  # sample 1 read with sample 0's grids
    assert rel_err(transformer_call(plus_arch_of("odd"), {}, swapped)[0][1], ref[1]) > 1e-3
