"""Kandinsky 5 (``models/kandinsky5.py``) under every axis on real gloo process groups, against one process: the
transformer of diffusers' Kandinsky 5 pipeline test (4 heads x 4) at that test's size (5 frames of 32 x 32: 2 x 2 x 2
= 8 video tokens) and at an odd count (3 latent frames of 3 x 3 patches: 27 tokens), with the text blocks over the
whole text, the RoPE table cut at every visual block and the gather after the last one."""

from __future__ import annotations

import math

import pytest
import torch

from cases_models import axis_id, sequence_counts, transformer_call
from ditmesh.testing import rel_err

ARCH = "kandinsky5-tiny"
VISUAL_BLOCKS, TEXT_BLOCKS = 2, 1
SIZES = {"diffusers": dict(height=32, width=32, frames=5, text_len=8),  # the pipeline test's call
         "odd": dict(height=48, width=48, frames=9, text_len=11)}


def inputs_of(shape: str) -> dict:
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer(ARCH, dtype=torch.float32)
    inputs = adapter_for_class("Kandinsky5Transformer3DModel").example_inputs(
        model, batch=2, generator=torch.Generator().manual_seed(3), device="cpu", dtype=torch.float32,
        **SIZES[shape])
    return dict(inputs, timestep=torch.tensor([700.0, 300.0]))


@pytest.mark.parametrize("shape", ["diffusers", "odd"])
@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2}], ids=axis_id)
def test_kandinsky5_transformer_matches_single_process(pools, config, shape):
    inputs = inputs_of(shape)
    assert inputs["hidden_states"].shape[1:4] == {"diffusers": (2, 4, 4), "odd": (3, 6, 6)}[shape]
    ref, _ = transformer_call(ARCH, {}, inputs)
    # tp: per visual block the self- and cross-attention outputs and the feed-forward, per text block two
    want = ({"all_reduce": 3 * VISUAL_BLOCKS + 2 * TEXT_BLOCKS} if "tp" in config
            else sequence_counts(config, VISUAL_BLOCKS, 1))
    for out, counts in pools(math.prod(config.values())).run(transformer_call, ARCH, config, inputs):
        assert rel_err(out, ref) <= 1e-5
        assert counts == want


def test_kandinsky5_refuses_nabla_attention_under_sequence_parallelism():
    import dataclasses

    from ditmesh import ParallelConfig
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer, get_arch

    arch = get_arch(ARCH)
    model = build_transformer(dataclasses.replace(arch, transformer=dict(arch.transformer, attention_type="nabla")))
    why = adapter_for_class("Kandinsky5Transformer3DModel").unsupported(model, ParallelConfig(ulysses=2))
    assert why.startswith("Kandinsky 5's nabla sparse attention does not run under sequence parallelism (ulysses=2")
