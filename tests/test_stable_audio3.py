"""Stable Audio 3 (``models/stable_audio3.py``) on real gloo process groups, against one process: the memory and audio
tokens one stream, split at the first block and gathered after the last, the memory count and the inpainting
conditioning cut per rank (``Split.count``); on diffusers' test configuration and inputs (plain attention, 3 memory
tokens, 16 samples, batch 2) and on ours: differential attention (two sp attentions a layer), 3 heads, 5 memory tokens
before 21 samples, inpainting conditioning, a padded prompt; Ulysses, ring, USP and batched CFG."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, call_counts, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str, heads: int = 3):
    """diffusers' configuration, or ours (``odd``): differential attention, ``heads`` heads of 8, 5 memory tokens."""
    from ditmesh.synth import get_arch

    arch = get_arch("stable-audio-3-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, embed_dim=8 * heads, num_heads=heads,
                                                      num_memory_tokens=5, use_differential_attention=True))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(2, 8, 16), timestep=torch.rand(2, generator=g),
                    encoder_hidden_states=rand(2, 4, 16), global_hidden_states=rand(2, 16), return_dict=False)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return dict(hidden_states=rand(2, 8, 21), timestep=torch.tensor([0.7, 0.2]), encoder_hidden_states=rand(2, 6, 16),
                global_hidden_states=rand(2, 16), encoder_attention_mask=mask, local_add_cond=rand(2, 5, 21),
                return_dict=False)


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES]
CASES += [({"cfg": 2}, "odd")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_stable_audio3_transformer_matches_single_process(pools, config, shape):
    arch, inputs = arch_of(shape), inputs_of(shape)
    # sequence: one sp attention a layer, two when differential; cfg: the batched call's gather
    attentions = LAYERS * (2 if arch.transformer["use_differential_attention"] else 1)
    want = {"all_gather": 1} if "cfg" in config else call_counts(config, attentions, 0)
    check_transformer(pools, arch, config, inputs, want)


def test_stable_audio3_inpainting_conditioning_matters():
    # the conditioning the plan cuts to each rank's audio must change the output, or the odd cases could not fail
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    assert rel_err(transformer_call(arch, {}, dict(inputs, local_add_cond=None))[0], ref) > 1e-3


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
def test_stable_audio3_tensor_parallel_matches_single_process(pools, shape):
    # tp 2 over 4 heads: plain attention (fused Q/K/V of three parts, K/V of two) and differential (five and three, two
    # queries); per block one all-reduce after each attention's output projection and one after the SwiGLU's
    arch = arch_of(shape, heads=4)
    check_transformer(pools, arch, {"tp": 2}, inputs_of(shape), {"all_reduce": 3 * LAYERS})


def test_stable_audio3_tensor_plan_cuts_each_fused_part():
    from ditmesh.models import adapter_for
    from ditmesh.parallel.tensor import resolve_plan
    from ditmesh.synth import build_transformer

    for shape, qkv, kv in (("diffusers", 3, 2), ("odd", 5, 3)):
        model = build_transformer(arch_of(shape, heads=4))
        shards = resolve_plan(model, adapter_for(model).tensor_plan, 2)
        assert shards["transformer_blocks.0.self_attn.to_qkv"].parts == (32,) * qkv
        assert shards["transformer_blocks.1.cross_attn.to_kv"].parts == (32,) * kv
