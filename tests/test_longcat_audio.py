"""LongCat-Audio-DiT (``models/longcat_audio.py``) on real gloo process groups, against one process: the frames split at
the first block and gathered after the last, the padding mask whole as the self-attention's key mask and cut to each
rank's rows for the two row multipliers; on diffusers' test configuration and inputs (16 frames, all valid) and on
ours: 3 heads, the text ConvNeXt, a batch of 2 whose second sample has 8 of 21 frames masked, padded text, and
latent conditioning; Ulysses, ring, USP, tp and the two CFG calls on two ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, call_counts, case_id, check_transformer, transformer_call
from ditmesh.testing import rel_err

LAYERS = 2


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("longcat-audio-dit-tiny")
    if shape == "diffusers":
        return arch
    return dataclasses.replace(arch, transformer=dict(arch.transformer, dit_dim=48, dit_heads=3, text_conv=True))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape == "diffusers":
        return dict(hidden_states=rand(1, 16, 8), encoder_hidden_states=rand(1, 10, 32),
                    encoder_attention_mask=torch.ones(1, 10, dtype=torch.bool), timestep=torch.ones(1),
                    attention_mask=torch.ones(1, 16, dtype=torch.bool), return_dict=False)
    frames, text = torch.ones(2, 21, dtype=torch.bool), torch.ones(2, 7, dtype=torch.bool)
    frames[1, 13:] = False
    text[0, 5:] = False
    return dict(hidden_states=rand(2, 21, 8), encoder_hidden_states=rand(2, 7, 32), encoder_attention_mask=text,
                timestep=torch.tensor([0.7, 0.3]), attention_mask=frames, latent_cond=rand(2, 21, 8),
                return_dict=False)


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis
CASES = [({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES]
CASES += [({"tp": 2}, "diffusers")]


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_longcat_audio_transformer_matches_single_process(pools, config, shape):
    arch, inputs = arch_of(shape), inputs_of(shape)
    # tp: both attentions' and the feed-forward's row-parallel outputs (3) and four sharded QK-norms per block
    want = call_counts(config, LAYERS, 7 * LAYERS)
    check_transformer(pools, arch, config, inputs, want)


def test_longcat_audio_cfg_runs_the_two_calls_on_two_ranks(pools):
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))


def test_longcat_audio_frame_mask_matters():
    # the masked frames' keys and rows must change the valid frames' output, or the odd cases could not fail
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    whole = dict(inputs, attention_mask=torch.ones(2, 21, dtype=torch.bool))
    assert rel_err(transformer_call(arch, {}, whole)[0][1, :13], ref[1, :13]) > 1e-3
