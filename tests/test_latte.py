"""Latte (``models/latte.py``) on real gloo process groups, against one process: the patch positions split in every
frame (the spatial attention over the ranks' positions: Ulysses, ring, USP; the temporal attention local to each
rank; the temporal blocks' per-position timestep cut with the positions), tp, batched CFG, dp; at diffusers' test
configuration and inputs (one frame of 4 x 4 positions) and at an awkward one of ours (3 heads, 2 layers, 3 frames
of 5 x 5 positions: 13 + 12 over 2 ranks)."""

from __future__ import annotations

import pytest
import torch

from cases_models import axis_id, call_counts, check_transformer, transformer_call
from ditmesh.testing import rel_err


def inputs_of(shape: str, temporal: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    if shape == "diffusers":  # diffusers' get_dummy_inputs: 1 frame of an 8 x 8 latent, 8 text tokens 8 wide
        return dict(hidden_states=torch.randn(2, 4, 1, 8, 8, generator=g),
                    encoder_hidden_states=torch.randn(2, 8, 8, generator=g),
                    timestep=torch.randint(0, 1000, (2,), generator=g), enable_temporal_attentions=True,
                    return_dict=False)
    return dict(hidden_states=torch.randn(2, 4, 3, 10, 10, generator=g),
                encoder_hidden_states=torch.randn(2, 7, 16, generator=g), timestep=torch.tensor([700, 300]),
                enable_temporal_attentions=temporal, return_dict=False)


ARCHS = {"diffusers": ("latte-tiny", 1), "odd": ("latte-tiny-odd", 2)}  # (architecture, layers)


@pytest.mark.parametrize("config, shape", [({"ulysses": 2}, "diffusers"), ({"ring": 2}, "diffusers"),
                                           ({"tp": 2}, "diffusers"), ({"ulysses": 2}, "odd"), ({"ring": 2}, "odd"),
                                           ({"ring": 2, "ulysses": 2}, "odd"), ({"cfg": 2}, "odd"),
                                           ({"dp": 2}, "odd")],
                         ids=lambda v: axis_id(v) if isinstance(v, dict) else v)
def test_latte_transformer_matches_single_process(pools, config, shape):
    arch, layers = ARCHS[shape]
    # per layer: the spatial self-attention's exchanges (the cross- and temporal attentions move nothing); tp: 3
    # all-reduces in the spatial block, 2 in the temporal one
    counts = {"all_gather": 1} if "cfg" in config or "dp" in config else call_counts(config, layers, 5 * layers)
    check_transformer(pools, arch, config, inputs_of(shape), counts)


def test_latte_without_temporal_attention_matches_single_process(pools):
    check_transformer(pools, "latte-tiny-odd", {"ulysses": 2}, inputs_of("odd", temporal=False),
                      call_counts({"ulysses": 2}, 2, 0))


def test_latte_temporal_attention_mixes_the_frames():
    # the temporal blocks (local to each rank under the split) carry one frame's input to the other frames' output at
    # the same positions, so a split that kept frames apart could not pass the tests above
    inputs = inputs_of("odd")
    ref, _ = transformer_call("latte-tiny-odd", {}, inputs)
    moved = inputs["hidden_states"].clone()
    moved[:, :, 0] += 1.0
    out, _ = transformer_call("latte-tiny-odd", {}, dict(inputs, hidden_states=moved))
    assert rel_err(out[:, :, 2], ref[:, :, 2]) > 1e-3


def test_latte_refuses_a_frame_count_its_table_does_not_hold():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    layout = adapter_for_class("LatteTransformer3DModel").layout
    assert layout(get_arch("latte-1").transformer, 512, 512, 16, 120).split_tokens == 16 * 32 * 32
    with pytest.raises(ValueError, match="holds 16 frames; use --frames 16"):
        layout(get_arch("latte-1").transformer, 512, 512, 9, 120)


def test_latte_refuses_tp_for_a_gated_feed_forward():
    # GEGLU's two halves sit in one projection, which the column-parallel cut would split across its halves
    from types import SimpleNamespace

    from ditmesh import ParallelConfig
    from ditmesh.models.latte import latte_unsupported

    model = lambda activation: SimpleNamespace(config=SimpleNamespace(activation_fn=activation))  # noqa: E731
    assert "'geglu' activation" in latte_unsupported(model("geglu"), ParallelConfig(tp=2))
    assert latte_unsupported(model("geglu"), ParallelConfig(ulysses=2)) is None
    assert latte_unsupported(model("gelu-approximate"), ParallelConfig(tp=2)) is None
