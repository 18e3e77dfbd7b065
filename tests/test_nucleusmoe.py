"""Nucleus-MoE (``models/nucleusmoe.py``) on real gloo process groups, against one process: image queries over [image,
text] keys with the text keys as dropped queries, the whole key mask, the text's RoPE rows cut by the processor, and
the expert-choice feed-forward run on the gathered sequence; on diffusers' test configuration and inputs (2 dense
blocks, a 4 x 4 grid, 8 text tokens) and on ours: 3 query heads over 1 key/value head, a dense then an expert-choice
block (4 experts), a batch of 2 on a 3 x 5 grid, 7 text tokens of which the second prompt pads 3; Ulysses, ring, USP
and the two CFG calls on two ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str, heads: int = 3, kv_heads: int = 1):
    """diffusers' configuration, or ours (``odd``): ``heads`` query heads over ``kv_heads`` key/value heads, a dense then
    an expert-choice block."""
    from ditmesh.synth import get_arch

    arch = get_arch("nucleusmoe-image-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(
        arch.transformer, num_attention_heads=heads, num_key_value_heads=kv_heads, moe_enabled=True,
        dense_moe_strategy="leave_first_block_dense", num_experts=4, moe_intermediate_dim=32,
        capacity_factors=[2.0, 2.0]))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 16, 16), encoder_hidden_states=rand(1, 8, 16),
                    encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([1.0]),
                    img_shapes=[(1, 4, 4)], return_dict=False)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return dict(hidden_states=rand(2, 15, 16), encoder_hidden_states=rand(2, 7, 16), encoder_hidden_states_mask=mask,
                timestep=torch.tensor([0.7, 0.3]), img_shapes=[(1, 3, 5)] * 2, return_dict=False)


def counts(config: dict) -> dict:
    """Per block the attention's exchanges and the feed-forward's gather; the output's gather."""
    got = {"all_gather": LAYERS + 1}
    if "ulysses" in config:
        got["all_to_all"] = 2 * LAYERS
    if "ring" in config:
        got["ring_p2p"] = (config["ring"] - 1) * LAYERS
    return got


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_nucleusmoe_transformer_matches_single_process(pools, config, shape):
    check_transformer(pools, arch_of(shape), config, inputs_of(shape), counts(config))


def test_nucleusmoe_cfg_runs_the_two_calls_on_two_ranks(pools):
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))


def test_nucleusmoe_routing_and_mask_matter():
    # the expert-choice routing over the whole sequence and the text padding must change the output
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    dense = dataclasses.replace(arch, transformer=dict(arch.transformer, capacity_factors=[2.0, 4.0]))
    assert rel_err(transformer_call(dense, {}, inputs)[0], ref) > 1e-4  # far above the 1e-5 the parallel runs keep
    unmasked = dict(inputs, encoder_hidden_states_mask=torch.ones(2, 7, dtype=torch.long))
    assert rel_err(transformer_call(arch, {}, unmasked)[0][1], ref[1]) > 1e-3


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
def test_nucleusmoe_tensor_parallel_matches_single_process(pools, shape):
    # tp 2: diffusers' dense blocks (4 heads), and ours with 4 query over 2 key/value heads, a dense then an
    # expert-choice block (its shared expert split, its routed experts whole); per block one all-reduce after the
    # attention's output projection and one after the feed-forward's (the dense SwiGLU's or the shared expert's)
    arch = arch_of(shape, heads=4, kv_heads=2)
    check_transformer(pools, arch, {"tp": 2}, inputs_of(shape), {"all_reduce": 2 * LAYERS})


def test_nucleusmoe_tensor_parallel_shards_and_refuses_split_kv_heads():
    from ditmesh import ParallelConfig
    from ditmesh.models import adapter_for
    from ditmesh.parallel.tensor import resolve_plan
    from ditmesh.synth import build_transformer

    model = build_transformer(arch_of("odd", heads=4, kv_heads=2))
    adapter = adapter_for(model)
    shards = resolve_plan(model, adapter.tensor_plan, 2)
    assert {"transformer_blocks.0.img_mlp.net.2", "transformer_blocks.1.img_mlp.shared_expert.net.2",
            "transformer_blocks.1.attn.add_v_proj"} <= set(shards)
    assert not any("experts.gate_up_proj" in name or name.endswith("img_mlp.gate") for name in shards)
    assert adapter.unsupported(model, ParallelConfig(tp=2)) is None
    one_kv = build_transformer(arch_of("odd", heads=4, kv_heads=1))
    assert "does not divide Nucleus-MoE's 1 key/value heads" in adapter.unsupported(one_kv, ParallelConfig(tp=2))
