"""GLM-Image (``models/glm_image.py``, on CogView4's processor) on real gloo process groups, against one process: the
image, text and prior projections split where they are made, the text mask's whole 0/1 score matrix; on diffusers' test
configuration and inputs (2 of its blocks; a 4 x 4 patch grid, 12 text tokens, one prior token) and on ours: 3 heads,
a batch of 2, a 3 x 5 patch grid with one prior token per patch, 7 text tokens of which the second prompt pads 3;
Ulysses, ring, USP, tp, the two CFG calls on two ranks, and the refusal of a filled condition-image K/V cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, call_counts, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("glm-image-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, num_attention_heads=3))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 4, 8, 8), encoder_hidden_states=rand(1, 12, 32),
                    prior_token_id=torch.randint(0, 64, (1,), generator=g), prior_token_drop=torch.zeros(1, dtype=bool),
                    timestep=torch.randint(0, 1000, (1,), generator=g), target_size=torch.tensor([[8.0, 8.0]]),
                    crop_coords=torch.tensor([[0.0, 0.0]]), return_dict=False)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    drop = torch.zeros(2, 15, dtype=torch.bool)
    drop[0, ::4] = True
    return dict(hidden_states=rand(2, 4, 6, 10), encoder_hidden_states=rand(2, 7, 32),
                prior_token_id=torch.randint(0, 64, (2, 15), generator=g), prior_token_drop=drop,
                timestep=torch.tensor([700.0, 300.0]), target_size=torch.tensor([[48.0, 80.0]] * 2),
                crop_coords=torch.zeros(2, 2), attention_mask=mask, return_dict=False)


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis; tp on diffusers' 2 heads
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES] + [({"tp": 2}, "diffusers")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_glm_image_transformer_matches_single_process(pools, config, shape):
    # tp: the attention output and the feed-forward's down projection, once per stream (3 all-reduces a block)
    check_transformer(pools, arch_of(shape), config, inputs_of(shape), call_counts(config, LAYERS, 3 * LAYERS))


def test_glm_image_cfg_runs_the_two_calls_on_two_ranks(pools):
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))


def test_glm_image_text_mask_and_prior_matter():
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    assert rel_err(transformer_call(arch, {}, dict(inputs, attention_mask=None))[0][1], ref[1]) > 1e-3
    other = dict(inputs, prior_token_id=inputs["prior_token_id"].flip(1))
    assert rel_err(transformer_call(arch, {}, other)[0], ref) > 1e-3


def _cached_call(arch):
    """One call under ulysses 2 with a condition image's K/V in the cache, as the pipeline's image-to-image reads it."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    caches = GlmImageKVCache(num_layers=LAYERS)
    caches.set_mode("write")
    inputs = inputs_of("diffusers")
    try:
        transformer_call(arch, {"ulysses": 2}, dict(inputs, kv_caches=caches))
    except NotImplementedError as refused:
        return str(refused)
    return None


def test_glm_image_refuses_a_condition_image_cache_under_sequence_parallelism(pools):
    for refused in pools(2).run(_cached_call, arch_of("diffusers")):
        assert refused and "K/V cache" in refused and "\n" not in refused
