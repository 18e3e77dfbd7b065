"""Helios (``models/helios.py``) on real gloo process groups, against one process: the window and its long, mid and short
history split as one sequence at the first block, the window count made local for each block (``Split.count``), the
self-attention's history keys scaled by the local count; on diffusers' test configuration and inputs (2 window frames
of 16 x 16 after 4 + 1 + 1 history frames: 192 tokens) and on ours: 3 heads, per-head history key scaling, a batch
of 2, a 3-frame window of 6 x 10 latents after 4 + 2 + 1 history frames (23 history and 45 window tokens: on two
ranks the first holds 23 + 11, on four the second 6 + 11)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, call_counts, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("helios-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, num_attention_heads=3, is_amplify_history=True,
                                                      history_scale_mode="per_head"))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        ones = lambda n: torch.ones(1, n)  # noqa: E731
        return dict(hidden_states=rand(1, 4, 2, 16, 16), timestep=torch.randint(0, 1000, (1,), generator=g),
                    encoder_hidden_states=rand(1, 12, 16), indices_hidden_states=ones(2),
                    indices_latents_history_short=ones(1), indices_latents_history_mid=ones(1),
                    indices_latents_history_long=ones(4), latents_history_short=rand(1, 4, 1, 16, 16),
                    latents_history_mid=rand(1, 4, 1, 16, 16), latents_history_long=rand(1, 4, 4, 16, 16),
                    return_dict=False)
    from ditmesh.models.helios import helios_inputs

    return helios_inputs(None, rand(2, 4, 3, 6, 10), torch.tensor([700.0, 300.0]), rand(2, 7, 16), (4, 2, 1))


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES]
CASES += [({"tp": 2}, "diffusers")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_helios_transformer_matches_single_process(pools, config, shape):
    arch, inputs = arch_of(shape), inputs_of(shape)
    # tp: Wan's 3 row-parallel linears and 4 sharded QK-norms per block; sequence: the self-attention's exchanges
    # and the gather after the last block
    want = call_counts(config, LAYERS, 7 * LAYERS)
    check_transformer(pools, arch, config, inputs, want)


def test_helios_history_and_its_key_scale_matter():
    # the history must change the window's output, and so must the scale of its keys (the local count the processor
    # and the blocks read), or the odd cases could not catch a wrong count
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    flat = dict(inputs, latents_history_long=torch.zeros_like(inputs["latents_history_long"]))
    assert rel_err(transformer_call(arch, {}, flat)[0], ref) > 1e-3
    unscaled = dataclasses.replace(arch, transformer=dict(arch.transformer, is_amplify_history=False))
    assert rel_err(transformer_call(unscaled, {}, inputs)[0], ref) > 1e-3


def test_helios_refuses_tp_with_per_head_history_scale_in_one_line():
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.synth import build_transformer

    scaled = dataclasses.replace(arch_of("odd"), transformer=dict(arch_of("odd").transformer, num_attention_heads=2))

    class Pipe:
        transformer = build_transformer(scaled, dtype=torch.float32)

    with pytest.raises(Exception, match="per-head history key scale") as refused:
        parallelize(Pipe, ParallelConfig(tp=2))
    assert "\n" not in str(refused.value)


def test_helios_cfg_runs_the_two_calls_on_two_ranks(pools):
    # HeliosPipeline's CFG: the prompt's call, then the negative prompt's, one on each rank
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))
