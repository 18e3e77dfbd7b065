"""HunyuanImage 2.1 (HunyuanVideo's adapter over an image, ``models/hunyuan_image.py``) on real gloo process groups,
against one process: the glyph stream interleaved into the text before the split, the padded-text key mask reordered
like the keys (Ulysses, ring, USP), the heads sharded (tp), the two guider calls on two ranks (cfg)."""

from __future__ import annotations

import pytest
import torch

from cases_models import axis_id, call_counts, check_transformer, example_inputs, transformer_call
from ditmesh.testing import rel_err

ARCH = "hunyuan-image-tiny"
#: 96 x 160 px: 3 x 5 image tokens (the VAE divides by 32); 11 prompt tokens, the first sample's last 3 padding, and
#: 8 glyph tokens (5 valid): 15 + 19 tokens, odd and divided by no degree
LAYERS, ALL_REDUCES = 4, 4 * 2 + 1 * 2


def _inputs() -> dict:
    inputs = example_inputs(ARCH, 96, 160, 11)
    inputs["encoder_attention_mask"][0, 8:] = 0
    return inputs


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"ring": 2, "ulysses": 2}, {"tp": 2},
                                    {"tp": 2, "ulysses": 2}], ids=axis_id)
def test_hunyuan_image_transformer_matches_single_process(pools, config):
    check_transformer(pools, ARCH, config, _inputs(), call_counts(config, LAYERS, ALL_REDUCES))


def test_hunyuan_image_cfg_runs_the_two_guider_calls_on_two_ranks(pools):
    # the guider calls the transformer for the prompt, then for the negative prompt; a bare transformer alternates
    from cases_two_calls import two_calls

    cond, uncond = _inputs(), _inputs()
    uncond["encoder_hidden_states"] = uncond["encoder_hidden_states"].flip(1)
    ref, _ = two_calls({}, cond, uncond)
    for outs, counts in pools(2).run(two_calls, {"cfg": 2}, cond, uncond):
        assert all(rel_err(o, r) <= 1e-5 for o, r in zip(outs, ref))
        assert counts == {"all_gather": 1}


def test_hunyuan_image_masks_and_glyphs_matter():
    inputs = _inputs()
    ref, _ = transformer_call(ARCH, {}, inputs)
    unpadded = dict(inputs, encoder_attention_mask=torch.ones_like(inputs["encoder_attention_mask"]))
    assert rel_err(transformer_call(ARCH, {}, unpadded)[0], ref) > 1e-3
    no_glyphs = dict(inputs, encoder_hidden_states_2=None, encoder_attention_mask_2=None)
    assert rel_err(transformer_call(ARCH, {}, no_glyphs)[0], ref) > 1e-3


def test_hunyuan_image_real_size_layout():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    layout = adapter_for_class("HunyuanImageTransformer2DModel").layout(get_arch("hunyuan-image-2.1").transformer,
                                                                         2048, 2048, 1, 1000)
    assert (layout.image_tokens, layout.split_tokens) == (4096, 4096 + 1000)
