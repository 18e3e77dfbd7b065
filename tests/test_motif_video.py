"""Motif-Video (``models/motif_video.py``) on real gloo process groups, against one process: the video split where it
is embedded, the context (image embeds and text) at the first dual block, the key mask rebuilt over the whole
sequence, the cross-attention on the gathered context; on diffusers' test configuration and inputs (9 frames of 16 x
16 tokens, 12 text tokens, no mask) and on ours: 3 heads, 2x2 patches, 1 dual and 2 single blocks with text
cross-attention in all of them, a batch of 2 on 3 frames of 3 x 5 tokens, 3 image embeddings and 7 text tokens of
which the second prompt pads 3; Ulysses, ring, USP, tp (diffusers' 2 heads, with the dual block's cross-attention) and
the guider's two calls on two ranks, dp; ours with a decoder block (attending from a copy of the embedded video to the
encoder's output) under every sequence axis; the single blocks' cross-attention refused under tp."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases_models import SP_AXES, case_id, check_transformer, refused_call, transformer_call
from ditmesh.testing import rel_err


def arch_of(shape: str):
    from ditmesh.synth import get_arch

    arch = get_arch("motif-video-tiny")
    if shape == "diffusers":
        return arch
    if shape == "tp":  # diffusers' 2 heads, the dual block's cross-attention on
        return dataclasses.replace(arch, transformer=dict(arch.transformer, enable_text_cross_attention_dual=True))
    return dataclasses.replace(arch, transformer=dict(
        arch.transformer, num_attention_heads=3, num_single_layers=2, patch_size=2,
        enable_text_cross_attention_dual=True, enable_text_cross_attention_single=True,
        **({"num_decoder_layers": 1} if shape == "decoder" else {})))


def inputs_of(shape: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if shape in ("diffusers", "tp"):
        return dict(hidden_states=rand(1, 33, 9, 16, 16), encoder_hidden_states=rand(1, 12, 32),
                    timestep=torch.tensor([421]), return_dict=False)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return dict(hidden_states=rand(2, 33, 3, 6, 10), encoder_hidden_states=rand(2, 7, 32), encoder_attention_mask=mask,
                image_embeds=rand(2, 3, 4), timestep=torch.tensor([700.0, 300.0]), return_dict=False)


def counts(config: dict, shape: str) -> dict:
    """Per joint attention its exchanges, per cross-attention the context's gather; the output's gather."""
    if config.get("tp", 1) > 1:  # the dual block's 4 (and its cross-attention's), the single block's proj_out
        return {"all_reduce": 6 if shape == "tp" else 5}
    if "dp" in config:  # one sample a rank, the outputs gathered
        return {"all_gather": 1}
    joint, cross = {"diffusers": (2, 0), "odd": (3, 3), "decoder": (3, 2)}[shape]  # decoder blocks: no cross
    got = {"all_gather": 1 + cross}
    if "ulysses" in config:
        got["all_to_all"] = 2 * joint
    if "ring" in config:
        got["ring_p2p"] = (config["ring"] - 1) * joint
    return got


# diffusers' configuration under Ulysses; ours, the harder one, under every sequence axis; tp on diffusers' 2 heads,
# with and without the dual block's cross-attention; ours with its second single block a decoder block; dp on ours
CASES = ([({"ulysses": 2}, "diffusers")] + [(c, "odd") for c in SP_AXES] + [({"tp": 2}, "diffusers"), ({"tp": 2}, "tp")]
         + [(c, "decoder") for c in SP_AXES] + [({"dp": 2}, "odd")])


@pytest.mark.parametrize("config, shape", CASES, ids=case_id)
def test_motif_video_transformer_matches_single_process(pools, config, shape):
    check_transformer(pools, arch_of(shape), config, inputs_of(shape), counts(config, shape))


def test_motif_video_cfg_runs_the_two_calls_on_two_ranks(pools):
    from cases_two_calls import check_cfg_two_calls

    check_cfg_two_calls(pools, arch_of("odd"), inputs_of("odd"))


def test_motif_video_refuses_single_block_cross_attention_under_tp(pools):
    single = dataclasses.replace(arch_of("tp"), transformer=dict(arch_of("tp").transformer,
                                                                 enable_text_cross_attention_single=True))
    message = pools(2).run(refused_call, single, {"tp": 2}, inputs_of("tp"))[0]
    assert "cross-attention" in message and "use ulysses, ring, cfg or dp" in message


def test_motif_video_mask_image_embeds_and_cross_attention_matter():
    # the text padding, the image embeddings and the cross-attention must change the output, or the cases above could
    # not fail on them
    arch, inputs = arch_of("odd"), inputs_of("odd")
    ref = transformer_call(arch, {}, inputs)[0]
    unmasked = dict(inputs, encoder_attention_mask=torch.ones(2, 7, dtype=torch.long))
    assert rel_err(transformer_call(arch, {}, unmasked)[0][1], ref[1]) > 1e-3
    image = dict(inputs, image_embeds=inputs["image_embeds"].flip(-1))
    assert rel_err(transformer_call(arch, {}, image)[0], ref) > 1e-3
    plain = dataclasses.replace(arch, transformer=dict(arch.transformer, enable_text_cross_attention_single=False))
    assert rel_err(transformer_call(plain, {}, inputs)[0], ref) > 1e-3
