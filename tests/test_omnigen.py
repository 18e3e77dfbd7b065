"""OmniGen (``models/omnigen.py``) on real gloo process groups, against one process: the joined [condition, time, image]
sequence split where the layers start and gathered after the last, its whole [N, N] mask through sp.attention (Ulysses,
ring, USP), tp; on diffusers' test configuration and inputs (2 of its layers; a condition image in the first sample,
an all-ones mask: 24 + 1 + 16 tokens) and on ours: 3 heads, two prompts of 5 and 9 tokens (the first left-padded), a
4 x 6 condition latent in the second, a 6 x 10 latent (15 image tokens): 25 tokens, as diffusers' collator builds
them (causal prompt, bidirectional images)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, call_counts, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("omnigen-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, hidden_size=12, num_attention_heads=3,
                                                      num_key_value_heads=3))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        n = 24 + 1 + 16
        return dict(hidden_states=rand(2, 4, 8, 8), timestep=torch.rand(2, generator=g),
                    input_ids=torch.randint(0, 10, (2, 24), generator=g), input_img_latents=[rand(1, 4, 8, 8)],
                    input_image_sizes={0: [[0, 16]]}, attention_mask=torch.ones(2, n, n),
                    position_ids=torch.arange(n).expand(2, -1), return_dict=False)
    from ditmesh.models.omnigen import omnigen_inputs
    from ditmesh.synth import build_transformer

    model = build_transformer(arch_of(shape), dtype=torch.float32)
    prompts = [torch.randint(3, 1000, (5,), generator=g).tolist(), torch.randint(3, 1000, (9,), generator=g).tolist()]
    return omnigen_inputs(model, rand(2, 4, 6, 10), prompts, torch.tensor([0.7, 0.3]), {1: [rand(1, 4, 4, 6)]})


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES]
CASES += [({"tp": 2}, "odd")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_omnigen_transformer_matches_single_process(pools, config, shape):
    arch, inputs = arch_of(shape), inputs_of(shape)
    if "tp" in config:  # tp divides the heads: the odd case's 3 do not divide by 2, diffusers' 4 do
        arch = arch_of("diffusers")
    # tp: the attention output and the down projection per layer; sequence: the exchanges and the gather after the
    # last layer
    want = call_counts(config, LAYERS, 2 * LAYERS)
    check_transformer(pools, arch, config, inputs, want)


def test_omnigen_mask_and_condition_image_matter():
    inputs, arch = inputs_of("odd"), arch_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    n = inputs["attention_mask"].shape[-1]
    assert rel_err(transformer_call(arch, {}, dict(inputs, attention_mask=torch.ones(2, n, n)))[0], ref) > 1e-3
    other = dict(inputs, input_img_latents=[-inputs["input_img_latents"][0]])
    assert rel_err(transformer_call(arch, {}, other)[0][1], ref[1]) > 1e-3


def test_omnigen_refuses_cfg_and_dp_in_one_line():
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer("omnigen-tiny", dtype=torch.float32)

    with pytest.raises(Exception, match="condition images as one list over the batch") as refused:
        parallelize(Pipe, ParallelConfig(cfg=2))
    assert "\n" not in str(refused.value)
