"""ERNIE-Image on real gloo process groups, against one process: its sequence-first [image, text] sequence split where
the blocks start and gathered after the last one, with its RoPE table and per-token modulation (Ulysses, ring, USP),
the prompts' key mask; at diffusers' test configuration (one head: ring; Ulysses refused in one line) and at ours (3
heads over 2 Ulysses ranks, odd token counts); tp over the heads; batched CFG's two samples on two ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import axis_id, call_counts, check_transformer, example_inputs, refused_call, transformer_call
from ditmesh.testing import rel_err


def _arch(heads: int):
    from ditmesh.synth import get_arch

    arch = get_arch("ernie-image-tiny")
    if heads == 1:
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, hidden_size=16 * heads,
                                                      num_attention_heads=heads, ffn_hidden_size=32))


#: (heads, height, width, text tokens): diffusers' test configuration and inputs (16 x 16 latent, 16 text tokens) and
#: ours (3 heads, a 3 x 5 latent, 11 text tokens of which the first prompt uses 8: 26 in all)
CASES = {"diffusers": (1, 256, 256, 16), "odd": (3, 48, 80, 11)}


def _inputs(case: str) -> dict:
    heads, height, width, text = CASES[case]
    inputs = example_inputs(_arch(heads), height, width, text)
    if case == "odd":
        inputs["text_lens"] = torch.tensor([8, 11])
    return inputs


@pytest.mark.parametrize("config, case", [({"ring": 2}, "diffusers"),
                                          ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                          ({"ring": 2, "ulysses": 2}, "odd"), ({"cfg": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_ernie_image_transformer_matches_single_process(pools, config, case):
    arch = _arch(CASES[case][0])
    counts = {"all_gather": 1} if "cfg" in config else call_counts(config, arch.transformer["num_layers"], 0)
    check_transformer(pools, arch, config, _inputs(case), counts)


def test_ernie_image_one_head_refuses_ulysses(pools):
    for message in pools(2).run(refused_call, _arch(1), {"ulysses": 2}, _inputs("diffusers")):
        assert message is not None and "ulysses=2 exceeds the 1 attention heads" in message


def test_ernie_image_tensor_parallel_matches_single_process(pools):
    arch = _arch(2)
    check_transformer(pools, arch, {"tp": 2}, _inputs("odd"), {"all_reduce": 2 * arch.transformer["num_layers"]})


def test_ernie_image_prompt_lengths_matter():
    arch, inputs = _arch(3), _inputs("odd")
    ref, _ = transformer_call(arch, {}, inputs)
    assert rel_err(transformer_call(arch, {}, dict(inputs, text_lens=torch.tensor([11, 11])))[0], ref) > 1e-3
