"""The parallel VAE (decode and encode split along height) against the whole VAE on one rank."""

from __future__ import annotations

import pytest
import torch

from cases_vae import band_peak_case, chunked_vae_case, local_norms_case, pipeline_vae_case, tiled_case, vae_case
from ditmesh.comm import split_sizes
from ditmesh.testing import RankError, rel_err

#: collectives of a split call of the tiny 3-level KL VAE (layers_per_block 1): one halo exchange per convolution
#: wider than one row or strided, one all-gather per group norm (the statistics; the mid-block attention's own norm
#: among them), one for the mid-block attention's keys and values, one at the exit
KL_DECODE = {"halo": 20, "all_gather": 18 + 1 + 1}  # convs: 2 + mid 4 + up 6 resnets x 2 + 2 upsamplers
KL_ENCODE = {"halo": 14, "all_gather": 12 + 1 + 1}  # convs: 2 + mid 4 + down 3 resnets x 2 + 2 downsamplers


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
        assert r["restored"] and r["pieced"] == 0  # tiny layers: one piece each
    assert results[0]["shape"][-2:] == ((rows * 4, cols * 4) if what == "decode" else (rows, cols))


@pytest.mark.parametrize("world,what,rows,cols,batch,piece_bytes", [
    (2, "decode", 7, 5, 1, 1),      # every large layer in pieces of one latent row (4, 3 latent rows a rank)
    (2, "decode", 7, 5, 2, 6000),   # pieces of a few rows, uneven
    (3, "decode", 7, 5, 1, 1),      # 3, 2, 2 latent rows
    (2, "encode", 7, 5, 1, 1),      # the encoder's residual blocks and its strided convolutions
    (3, "encode", 13, 3, 1, 3000),
])
def test_kl_vae_split_in_pieces_of_rows_matches_single_process(pools, world, what, rows, cols, batch, piece_bytes):
    # large layers on pieces of each rank's rows: residual blocks (norm, activation and convolution a piece at a
    # time), up-samplers, convolutions into one output; the same collectives as the split without pieces
    for r in pools(world).run(vae_case, "kl", what, rows, cols, 1, batch, piece_bytes=piece_bytes):
        assert r["err"] <= 1e-5, r["err"]
        assert r["counts"] == (KL_DECODE if what == "decode" else KL_ENCODE)
        assert r["pieced"] > 0 and r["restored"]


def test_split_decode_in_pieces_holds_less_per_rank_and_the_planner_traces_it(pools):
    # one rank's peak of live tensor bytes, measured on the real tensors of a FLUX-shaped VAE split over 4 ranks (8
    # latent rows each), with every layer whole and with pieces of one latent row; the planner's meta trace of the
    # same rank's share predicts both. Whole, the peak is the last up-sampler: its input, the up-sampled rows, their
    # halo-extended copy and the convolution's output; in pieces it is a top residual block of the last level: the
    # level's input (held by the decoder), the block's input and h, and one piece's temporaries
    results = pools(4).run(band_peak_case, 32, 12)
    for whole, pieces in results:
        assert whole["err"] <= 1e-5 and pieces["err"] <= 1e-5, (whole["err"], pieces["err"])
        assert whole["peak"] == pytest.approx(whole["traced"], rel=0.05)
        assert pieces["peak"] == pytest.approx(pieces["traced"], rel=0.05)
        assert whole["peak"] / pieces["peak"] >= 1.5, (whole["peak"], pieces["peak"])


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


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("what,rows,cols,frames", [("decode", 5, 3, 2), ("encode", 5, 3, 7)])
def test_mochi_vae_split_along_height_matches_single_process(pools, world, what, rows, cols, frames):
    # causal convolutions that replicate their edge rows (kept at the image's edges, halo rows elsewhere), group norms
    # per frame in chunks of frames, attentions over the frames of one position; 5 latent rows over 2 and 3 ranks
    from cases_vae import _inputs, _run, tiny_vae

    vae, calls = tiny_vae("mochi"), {"norm": 0, "conv": 0}
    for m in vae.modules():  # what one whole call runs: group norms (one statistics gather each), convolutions whose
        # windows overlap (a halo each; the strided 2 x 2 down-samplings keep to their rows)
        if isinstance(m, torch.nn.GroupNorm):
            m.register_forward_hook(lambda *a: calls.__setitem__("norm", calls["norm"] + 1))
        elif isinstance(m, torch.nn.Conv3d) and m.kernel_size[-2] > m.stride[-2]:
            m.register_forward_hook(lambda *a: calls.__setitem__("conv", calls["conv"] + 1))
    _run(vae, what, _inputs(vae, "mochi", what, rows, cols, frames, 1))
    assert calls["norm"] and calls["conv"]
    for r in pools(world).run(vae_case, "mochi", what, rows, cols, frames):
        assert r["err"] <= 1e-5, r["err"]
        assert r["restored"]
        # one halo exchange per such convolution, one gather per group norm and one at the exit
        assert r["counts"] == {"halo": calls["conv"], "all_gather": calls["norm"] + 1}


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



# -- chunked decode on one process (parallel.vae_chunk) ---------------------------------------------------------------
#: the tiny KL VAE's modules with a vae_chunk hook: encoder 3 + 2 mid residual blocks, decoder 2 mid + 3 x 2 up
#: residual blocks and 2 up-samplers
KL_CHUNKED = 5 + 8 + 2


@pytest.mark.parametrize("what,rows,cols,batch,piece_rows", [
    ("decode", 7, 5, 2, 1),
    ("decode", 7, 5, 1, 3),   # uneven pieces
    ("decode", 13, 3, 1, 5),
    ("encode", 7, 5, 1, 2),   # the encoder's residual blocks
])
def test_kl_vae_in_pieces_of_rows_matches_whole(what, rows, cols, batch, piece_rows):
    r = chunked_vae_case(what, rows, cols, batch, piece_rows)
    assert r["err"] <= 1e-5, r["err"]
    assert r["hooked"] == KL_CHUNKED and r["restored"]
    assert r["split_calls"] == (5 if what == "encode" else 10 if piece_rows < rows else 9)


def test_flux_pipeline_decodes_the_same_with_vae_chunk(pools, flux_tiny):
    whole = pipeline_vae_case(flux_tiny, {}, "auto")
    one = pipeline_vae_case(flux_tiny, {}, "auto", remove=True, vae_chunk=2)
    assert rel_err(one["image"], whole["image"]) <= 1e-5 and one["split_calls"] > 0 and one["restored"]
    # two ranks: a split decode leaves the pieces aside; a whole one (vae_parallel off) uses them
    split = pools(2).run(pipeline_vae_case, flux_tiny, {"ulysses": 2}, "auto", vae_chunk=2)
    off = pools(2).run(pipeline_vae_case, flux_tiny, {"ulysses": 2}, "off", vae_chunk=2)
    for a, b in zip(split, off):
        assert a["split_calls"] == 0 and a["counts"]["halo"] > 0
        assert b["split_calls"] > 0 and b["counts"] == {}
        assert rel_err(a["image"], whole["image"]) <= 1e-5 and rel_err(b["image"], whole["image"]) <= 1e-5


def test_bad_vae_chunk_settings_are_refused_in_one_line():
    from ditmesh.config import ConfigError
    from ditmesh.options import RunOptions

    def rows(text, cli=True):
        return RunOptions.create(vae_chunk=text, cli=cli).vae_chunk

    assert rows("auto") == "auto" and rows("64") == 64 and rows(None) is None
    with pytest.raises(ConfigError, match="--vae-chunk 'rows' is not a row count; give a positive integer"):
        rows("rows")
    with pytest.raises(ConfigError, match="vae_chunk=0 is not a row count"):
        rows(0, cli=False)


# -- rank-parallel tiled decode (vae_parallel="tiled") ---------------------------------------------------------------
@pytest.mark.parametrize("world,rows,cols,batch", [
    (2, 14, 11, 1),  # tiles of 8 latent rows every 6: 3 x 2 tiles, 3 per rank, edge tiles smaller
    (3, 14, 11, 2),  # 2 per rank
    (2, 20, 5, 1),   # 4 x 1 tiles
])
def test_tiled_decode_spread_over_ranks_equals_one_process_tiled_decode(pools, world, rows, cols, batch):
    grid = len(range(0, rows, 6)) * len(range(0, cols, 6))
    results = pools(world).run(tiled_case, rows, cols, batch)
    for rank, r in enumerate(results):
        assert r["err"] <= 1e-6, r["err"]  # the same tiles, blended by diffusers' own code
        assert r["differs_from_whole"] > 1e-3  # tiling changes the picture: the test compares with the right one
        assert r["decoded"] == split_sizes(grid, world)[rank]
        assert r["counts"] == {"all_gather": 1} and r["restored"]
    assert sum(r["decoded"] for r in results) == grid  # each tile decoded once, on one rank


@pytest.mark.parametrize("rows,cols", [(14, 11), (13, 7)])  # 13 x 7: the last tiles one latent row, one column wide
def test_tiled_mode_on_one_process_is_diffusers_tiling(rows, cols):
    r = tiled_case(rows, cols)
    assert r["err"] == 0 and r["decoded"] == 6 and r["counts"] == {} and r["restored"]


def test_flux_pipeline_tiled_mode_over_two_ranks_equals_diffusers_tiling_on_one(pools, flux_tiny):
    tiled = pipeline_vae_case(flux_tiny, {}, "off", tile=32)  # diffusers' own tiling, one process
    whole = pipeline_vae_case(flux_tiny, {}, "off")
    assert rel_err(tiled["image"], whole["image"]) > 1e-3  # 3 x 2 tiles of 32 pixels change the picture
    for r in pools(2).run(pipeline_vae_case, flux_tiny, {"ulysses": 2}, "tiled", remove=True, tile=32):
        assert rel_err(r["image"], tiled["image"]) <= 1e-5
        assert r["counts"] == {"all_gather": 1} and r["restored"]


@pytest.mark.parametrize("queries,keys", [(37, 53), (64, 64)])
def test_wide_head_attention_in_pieces_matches_sdpa(monkeypatch, queries, keys):
    # the mid-block attention's path for heads wider than the fused kernels take: pieces of query rows
    from ditmesh.parallel import vae as parallel_vae

    monkeypatch.setattr(parallel_vae, "ATTEND_PIECE", 10 * keys)  # 10 query rows per piece: several pieces, one short
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, n, 320, generator=g) for n in (queries, keys, keys))
    out = parallel_vae.attend(q, k, v)
    assert rel_err(out, torch.nn.functional.scaled_dot_product_attention(q, k, v)) <= 1e-5


@pytest.mark.parametrize("world,what,rows,cols,frames", [
    (2, "decode", 3, 2, 2), (2, "encode", 3, 2, 9), (3, "decode", 5, 3, 3), (3, "encode", 5, 2, 9)])
def test_ltx_video_vae_split_along_height_matches_single_process(pools, world, what, rows, cols, frames):
    # patchified 4x4 around the VAE, causal time padding in forward, per-position norms, no attention: one halo
    # exchange per convolution taller than one row and one all-gather at the exit
    from torch import nn

    from cases_vae import tiny_vae

    coder = getattr(tiny_vae("ltx"), "decoder" if what == "decode" else "encoder")
    tall = sum(1 for m in coder.modules() if isinstance(m, nn.Conv3d) and m.kernel_size[-2] > 1)
    for r in pools(world).run(vae_case, "ltx", what, rows, cols, frames):
        assert r["err"] <= 1e-5, r["err"]
        assert r["restored"] and r["counts"] == {"halo": tall, "all_gather": 1}


def test_a_call_that_runs_whole_is_said_once_per_reason_and_refused_under_on(caplog):
    import logging

    from ditmesh.config import ConfigError
    from ditmesh.parallel.vae import VaeParallel

    auto = VaeParallel(None)
    with caplog.at_level(logging.INFO, logger="ditmesh"):
        for reason in ("3 latent rows for 4 ranks", "3 latent rows for 4 ranks", "a mask"):
            auto.whole(reason)
    said = [r.getMessage() for r in caplog.records if "runs whole" in r.getMessage()]
    assert said == ["ditmesh: the VAE runs whole on every rank: 3 latent rows for 4 ranks",
                    "ditmesh: the VAE runs whole on every rank: a mask"]
    with pytest.raises(ConfigError, match="^the parallel VAE cannot split this call: a mask; use vae_parallel auto"):
        VaeParallel(None, strict=True).whole("a mask")


def test_a_call_that_misnames_its_input_fails_as_the_vae_itself_fails():
    # the split hook takes the input by position or by its name; a call with none, or with both, is the VAE's to refuse
    from cases_vae import tiny_vae
    from ditmesh.models.base import vae_plan_for
    from ditmesh.parallel.vae import apply

    vae = tiny_vae("kl")
    z = torch.zeros(1, vae.config.latent_channels, 4, 4)
    calls = [((), {"return_dict": False}), ((z,), {"z": z})]
    plain = [pytest.raises(TypeError, vae.decode, *args, **kwargs).value for args, kwargs in calls]
    undo = apply(vae, vae_plan_for(vae), None)
    try:
        for (args, kwargs), error in zip(calls, plain):
            with pytest.raises(TypeError) as hooked:
                vae.decode(*args, **kwargs)
            assert str(hooked.value) == str(error)
    finally:
        for fn in reversed(undo):
            fn()


@pytest.mark.parametrize("piece", [4, 64, 1 << 24], ids=["part-of-a-group", "groups-2-and-1", "every-group"])
def test_group_statistics_summed_in_pieces_are_the_whole_groups(monkeypatch, piece):
    # GROUP_PIECE bounds the values summed at a time: a part of one group (the parts merged), a few groups, or all
    from ditmesh.parallel import vae

    monkeypatch.setattr(vae, "GROUP_PIECE", piece)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 5, generator=g) * 3 + 1  # 3 groups of 2 channels: 30 values a group
    stats = vae.group_stats(x, 3)
    mean, var = vae.combine_stats(stats[None])
    want_var, want_mean = torch.var_mean(x.double().reshape(2, 3, -1), -1, correction=0)
    assert torch.equal(stats[0], torch.full((2, 3), 30.0, dtype=torch.float64))
    assert torch.allclose(mean, want_mean) and torch.allclose(var, want_var)
