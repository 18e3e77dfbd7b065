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


def nabla_inputs() -> dict:
    """2 latent frames of 8 x 16 patches (256 tokens: 4 blocks of 64, the fractal order's 8 x 8 tiles) with nabla's
    parameters as the pipeline passes them: a sliding-tile prior of each block alone, half of each row's mass kept."""
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer

    model = build_transformer(ARCH, dtype=torch.float32)
    inputs = adapter_for_class("Kandinsky5Transformer3DModel").example_inputs(
        model, batch=2, generator=torch.Generator().manual_seed(3), device="cpu", dtype=torch.float32, height=128,
        width=256, frames=5, text_len=8)
    sparse = {"sta_mask": torch.eye(4, dtype=torch.bool)[None, None], "P": 0.5, "to_fractal": True}
    return dict(inputs, timestep=torch.tensor([700.0, 300.0]), sparse_params=sparse)


def test_kandinsky5_nabla_attention_under_ulysses_matches_single_process(pools):
    # each rank builds its heads' nabla block masks after the all-to-all; both sides through cases_nabla's emulation,
    # which applies the block mask (eager flex attention on CPU ignores it)
    from cases_nabla import flex_backend, masked_transformer_call

    inputs = nabla_inputs()
    ref, _ = masked_transformer_call(ARCH, {}, inputs, prepare=flex_backend)
    dense, _ = masked_transformer_call(ARCH, {}, dict(inputs, sparse_params=None), prepare=flex_backend)
    assert rel_err(dense, ref) > 1e-3  # the mask drops blocks, so a wrong one could not pass
    for out, counts in pools(2).run(masked_transformer_call, ARCH, {"ulysses": 2}, inputs, None, flex_backend):
        assert rel_err(out, ref) <= 1e-5
        assert counts == sequence_counts({"ulysses": 2}, VISUAL_BLOCKS, 1)


def test_kandinsky5_refuses_nabla_attention_under_ring():
    import dataclasses

    from ditmesh import ParallelConfig
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import build_transformer, get_arch

    arch = get_arch(ARCH)
    model = build_transformer(dataclasses.replace(arch, transformer=dict(arch.transformer, attention_type="nabla")))
    unsupported = adapter_for_class("Kandinsky5Transformer3DModel").unsupported
    assert unsupported(model, ParallelConfig(ulysses=2)) is None
    why = unsupported(model, ParallelConfig(ring=2))
    assert why.startswith("Kandinsky 5's nabla sparse attention chooses each query block's keys") and "ring=2" in why


@pytest.mark.parametrize("arch_name, nabla", [(ARCH, True), (ARCH, False), ("kandinsky6-sr-tiny", True)])
def test_the_8_bit_attention_refuses_a_nabla_checkpoint_in_one_line_before_it_runs(arch_name, nabla):
    # nabla's block-sparse mask runs through flex attention: --attention fp8 would silently attend exactly there
    import dataclasses

    from ditmesh import ParallelConfig
    from ditmesh.options import ConfigError, RunOptions
    from ditmesh.synth import build_transformer, get_arch

    arch = get_arch(arch_name)
    if arch_name == ARCH:
        arch = dataclasses.replace(arch, transformer=dict(arch.transformer,
                                                          attention_type="nabla" if nabla else "regular"))
    model = build_transformer(arch)
    options = RunOptions(config=ParallelConfig(ulysses=2), attention="fp8-emulated")
    if not nabla:
        options.validate(models=[model])
        return
    with pytest.raises(ConfigError) as refused:
        options.validate(models=[model])
    line = str(refused.value)
    assert "\n" not in line and "fp8-emulated does not run Kandinsky" in line and "use the default attention" in line
    RunOptions(config=ParallelConfig(ulysses=2)).validate(models=[model])  # the default attention runs it
