"""Kandinsky 6 (``models/kandinsky6.py``) under sequence parallelism on real gloo process groups, against one process:
the video split, the audio whole on every rank and its audio-to-video attention merged from every rank's partial
result, at Kandinsky 5's pipeline-test size (8 video tokens) and at an odd count (27), with and without audio."""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import axis_id, transformer_call, whole_audio_counts
from ditmesh.testing import rel_err

ARCH = "kandinsky6-tiny"
BLOCKS = 2
SIZES = {"small": dict(height=32, width=32, frames=5, text_len=8), "odd": dict(height=48, width=48, frames=9, text_len=11)}


def inputs_of(shape: str) -> dict:
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer(ARCH, dtype=torch.float32)
    inputs = adapter_for_class("Kandinsky6Transformer3DModel").example_inputs(
        model, batch=2, generator=torch.Generator().manual_seed(3), device="cpu", dtype=torch.float32, **SIZES[shape])
    mask = torch.ones(2, SIZES[shape]["text_len"], dtype=torch.bool)
    mask[1, 5:] = False  # the second prompt padded
    return dict(inputs, timestep=torch.tensor([700.0, 300.0]), encoder_attention_mask=mask)



@pytest.mark.parametrize("shape", ["small", "odd"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}], ids=axis_id)
def test_kandinsky6_video_and_audio_match_single_process(pools, config, shape):
    inputs = inputs_of(shape)
    (video, audio), _ = transformer_call(ARCH, {}, inputs, outputs=2)
    results = pools(math.prod(config.values())).run(transformer_call, ARCH, config, inputs, outputs=2)
    for (got_video, got_audio), counts in results:
        assert rel_err(got_video, video) <= 1e-5 and rel_err(got_audio, audio) <= 1e-5
        assert counts == whole_audio_counts(config, BLOCKS)
    assert all(torch.equal(results[0][0][1], r[0][1]) for r in results)  # every rank holds the same audio


def test_kandinsky6_video_alone_matches_single_process(pools):
    inputs = dict(inputs_of("odd"), audio_hidden_states=None)
    ref, _ = transformer_call(ARCH, {}, inputs)
    for out, counts in pools(2).run(transformer_call, ARCH, {"ulysses": 2}, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == whole_audio_counts({"ulysses": 2}, BLOCKS, audio=False)


def test_kandinsky6_audio_reads_the_video():
    # the audio-to-video attention matters, so a merge of the ranks' partial results that dropped one would show
    inputs = inputs_of("odd")
    (_, audio), _ = transformer_call(ARCH, {}, inputs, outputs=2)
    other = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(9))
    (_, moved), _ = transformer_call(ARCH, {}, dict(inputs, hidden_states=other), outputs=2)
    assert rel_err(moved, audio) > 1e-2
