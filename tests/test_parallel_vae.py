"""The parallel VAE (decode and encode split along height) against the whole VAE on one rank."""

from __future__ import annotations

import pytest
import torch

from cases_vae import local_norms_case, pipeline_vae_case, vae_case
from ditmesh.testing import RankError, rel_err

#: collectives of a split call of the tiny 3-level KL VAE (layers_per_block 1): one halo exchange per convolution
#: wider than one row or strided, one all-gather per group norm (the statistics), one for the mid-block attention,
#: one at the exit
KL_DECODE = {"halo": 20, "all_gather": 17 + 1 + 1}  # convs: 2 + mid 4 + up 6 resnets x 2 + 2 upsamplers
KL_ENCODE = {"halo": 14, "all_gather": 11 + 1 + 1}  # convs: 2 + mid 4 + down 3 resnets x 2 + 2 downsamplers


@pytest.mark.parametrize("kind,world,what,rows,cols,batch", [
    ("kl", 2, "decode", 7, 5, 1),
    ("kl", 2, "encode", 7, 5, 1),
    ("kl", 3, "decode", 7, 5, 2),   # 3, 2, 2 latent rows
    ("kl", 3, "encode", 13, 3, 1),  # 5, 4, 4 latent rows (20, 16, 16 image rows)
    ("flux2", 2, "decode", 7, 5, 1),  # FLUX.2's AutoencoderKLFlux2, the same layers
    ("flux2", 2, "encode", 7, 5, 1),
])
def test_kl_vae_split_along_height_matches_single_process(pools, kind, world, what, rows, cols, batch):
    results = pools(world).run(vae_case, kind, what, rows, cols, 1, batch)
    for r in results:
        assert r["err"] <= 1e-5, r["err"]
        assert r["counts"] == (KL_DECODE if what == "decode" else KL_ENCODE)
        assert r["restored"]
    assert results[0]["shape"][-2:] == ((rows * 4, cols * 4) if what == "decode" else (rows, cols))


def test_group_norm_over_local_rows_alone_is_wrong(pools):
    # the between-rank variance term matters: statistics of the local rows alone give a visibly different image
    for err in pools(2).run(local_norms_case, "kl", 7, 5):
        assert err > 1e-3


@pytest.mark.parametrize("kind,what,rows,cols,frames", [
    ("wan", "decode", 5, 3, 3),
    ("wan", "encode", 5, 3, 5),
    ("wan22", "decode", 3, 2, 2),  # 2x2 patches, residual blocks with pixel-shuffle shortcuts
    ("wan22", "encode", 3, 2, 5),
    ("qwen", "decode", 5, 3, 1),  # QwenImage's VAE: Wan 2.1's, one frame per image
    ("qwen", "encode", 5, 3, 1),
])
def test_wan_causal_vae_split_along_height_matches_single_process(pools, kind, what, rows, cols, frames):
    # the temporal cache stays on each rank with its own rows; frames are not split
    for r in pools(2).run(vae_case, kind, what, rows, cols, frames):
        assert r["err"] <= 1e-5, r["err"]
        assert r["restored"]
        # one gather per latent frame chunk for the mid-block attention (decode: one chunk per latent frame;
        # encode: 1 + (frames - 1) // 4 chunks), one at the exit
        chunks = frames if what == "decode" else 1 + (frames - 1) // 4
        assert r["counts"]["all_gather"] == chunks + 1


def test_wan_causal_vae_on_three_ranks(pools):
    for r in pools(3).run(vae_case, "wan", "decode", 4, 3, 2):
        assert r["err"] <= 1e-5 and r["restored"]


def test_too_few_latent_rows_run_whole_under_auto_and_fail_under_on(pools):
    for r in pools(3).run(vae_case, "kl", "decode", 2, 3):  # 2 latent rows, 3 ranks
        assert r["err"] == 0 and r["counts"] == {}
    with pytest.raises(RankError, match="2 latent rows leave some of the 3 ranks without a row"):
        pools(3).run(vae_case, "kl", "decode", 2, 3, mode="on")


def test_flux_pipeline_under_ulysses_decodes_the_same_with_the_vae_split(pools, flux_tiny):
    off = pools(2).run(pipeline_vae_case, flux_tiny, {"ulysses": 2}, "off")
    on = pools(2).run(pipeline_vae_case, flux_tiny, {"ulysses": 2}, "auto", remove=True)
    assert off[0]["counts"] == {}
    for r in on:
        assert rel_err(r["image"], off[0]["image"]) <= 1e-5
        assert r["counts"]["halo"] > 0 and r["restored"]
    assert torch.equal(on[0]["image"], on[1]["image"])

