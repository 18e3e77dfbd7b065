"""QwenImage under every axis on real gloo process groups, against one process: its padded-text mask travels with
the keys (Ulysses, ring, USP), its two RoPE tables with their streams, the heads shard (TP), each CFG branch and each
prompt run on its own ranks (cfg, dp); odd token counts split unevenly (QwenImage's 1328^2 has 6,889 image tokens)."""

from __future__ import annotations


import pytest
import torch

from cases_cache import assert_cache_decides_as_one_process
from cases_models import FamilyRuns, PROMPTS, check_ranks, masks_dropped, pipeline_counts, transformer_call
from ditmesh.testing import rel_err

#: true CFG: the prompts' call, then the negative prompts' (the pipeline passes no mask there: nothing is padded)
CFG = dict(negative_prompt=["", ""], true_cfg_scale=4.0, guidance_scale=None)
#: image tokens (H/16 * W/16) and text tokens (the longer prompt, cut at max_sequence_length): 16 + 60 divide 2 and
#: 4; 9 + 57 (odd, like 1328^2's 83 x 83) divide neither
SHAPES = {"even": dict(height=64, width=64, max_sequence_length=60),
          "uneven": dict(height=48, width=48, max_sequence_length=57)}
BLOCKS = 2
STEPS = 2


@pytest.fixture(scope="module")
def qwenimage_tiny(tiny_checkpoints) -> str:
    return tiny_checkpoints("qwenimage-tiny")


#: the pipeline runs of this file and their one-process references
RUNS = FamilyRuns(SHAPES, steps=STEPS, guidance_scale=5.0, extra=CFG)
reference = RUNS.reference


def expected_counts(config: dict) -> dict:
    """Collectives of one pipeline call: 2 steps x 2 transformer calls (prompts, negative prompts); under tp 4
    all-reduces per block (both attention outputs, both MLPs)."""
    return pipeline_counts(config, STEPS, BLOCKS, all_reduces_per_call=4 * BLOCKS)


@pytest.mark.parametrize("config, shape", [
    ({"ulysses": 2}, "even"), ({"ring": 2}, "even"), ({"tp": 2}, "even"), ({"cfg": 2}, "even"),
    ({"ulysses": 2}, "uneven"), ({"ulysses": 4}, "uneven"), ({"ring": 2, "ulysses": 2}, "uneven"),
    ({"tp": 2, "ulysses": 2}, "uneven"), ({"dp": 2}, "uneven"),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) if isinstance(c, dict) else c)
def test_qwenimage_pipeline_matches_single_process(pools, qwenimage_tiny, config, shape):
    ref = reference(qwenimage_tiny, shape)
    outs = RUNS.generate(qwenimage_tiny, config, shape, pools=pools)
    check_ranks(outs, ref, 2 * STEPS, expected_counts(config))


def test_qwenimage_mask_changes_the_output(qwenimage_tiny):
    # the mask the parallel runs carry matters: dropping it inside the transformer gives another result
    seen, latents = masks_dropped(qwenimage_tiny, "encoder_hidden_states_mask", PROMPTS, STEPS, extra=CFG,
                                  **SHAPES["even"])
    mask = seen[0]
    assert mask.shape == (2, 60) and not mask[0].all() and mask[1].all()  # the shorter prompt is padded
    assert seen[1] is None  # the negative prompts: nothing padded, no mask
    assert rel_err(latents, reference(qwenimage_tiny, "even")) > 1e-3


def _edit_inputs():
    """Inputs of an edit checkpoint's call (``zero_cond_t``): the noisy image's 3 x 3 tokens and a 2 x 3 condition
    image's 6 tokens in one image stream, told apart by ``modulate_index`` (the model builds it from ``img_shapes``)."""
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 15, 16, generator=g), encoder_hidden_states=torch.randn(1, 7, 16, generator=g),
                encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 1, 0, 0]]), timestep=torch.tensor([0.6]),
                img_shapes=[[(1, 3, 3), (1, 2, 3)]], return_dict=False)


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}], ids=str)
def test_qwenimage_edit_transformer_splits_modulate_index_with_the_image(pools, config):
    from ditmesh.synth import get_arch
    import dataclasses

    arch = get_arch("qwenimage-tiny")
    arch = dataclasses.replace(arch, transformer=dict(arch.transformer, zero_cond_t=True))
    ref, _ = transformer_call(arch, {}, _edit_inputs())
    for out, counts in pools(2).run(transformer_call, arch, config, _edit_inputs()):
        assert rel_err(out, ref) <= 1e-5
        assert counts["all_gather"] == 1


def test_qwenimage_cache_decides_as_one_process_under_ulysses(pools, qwenimage_tiny):
    # teacache decides from the first block's modulated input (the adapter's ``modulated_input``)
    assert_cache_decides_as_one_process(pools, qwenimage_tiny, {"ulysses": 2}, "teacache:threshold=0.5,warmup=1", steps=5,
                                        prompts=PROMPTS, size=48, max_sequence_length=57)


def test_qwenimage_real_size_matches_the_published_config():
    from ditmesh.models import adapter_for_class
    from ditmesh.synth import get_arch

    t = get_arch("qwenimage").transformer
    assert (t["num_layers"], t["num_attention_heads"], t["attention_head_dim"], t["joint_attention_dim"]) == (60, 24, 128, 3584)
    layout = adapter_for_class("QwenImageTransformer2DModel").layout(t, 1328, 1328, 1, 512)
    assert layout.image_tokens == 6889 and layout.latent_shape == (6889, 64)
