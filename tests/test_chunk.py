"""Chunked feed-forwards and attention give the numbers of whole ones, alone and under sequence and tensor
parallelism, with the same collectives."""

from __future__ import annotations

import pytest
import torch

from cases_chunk import chunked_output
from ditmesh.testing import rel_err


def test_chunked_feed_forwards_and_attention_equal_whole_ones_on_every_family(model_checkpoints, flux_tiny):
    for path, frames in ((flux_tiny, None), (model_checkpoints["sd3-tiny"], None), (model_checkpoints["wan2.2-tiny"], 5)):
        whole = chunked_output(path, {}, None, frames=frames)
        assert whole["hooked"] == 0 and whole["attention_splits"] == 0
        r = chunked_output(path, {}, 7, frames=frames, remove=True)  # uneven pieces of 7 tokens
        assert r["hooked"] > 0 and r["left"] == 0 and r["processors_back"]
        assert r["attention_splits"] > 0  # every family's attention ran in pieces of queries
        assert rel_err(r["out"], whole["out"]) <= 1e-6


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}, {"ring": 2, "ulysses": 2}], ids=str)
def test_chunked_feed_forwards_and_attention_under_parallelism_equal_one_whole_process(pools, flux_tiny, config):
    whole = chunked_output(flux_tiny, {}, None)
    world = 4 if len(config) == 2 else 2
    pieces = 3 if world == 4 else 5  # 4 ranks hold 4 image tokens each: pieces of 3 still cut them
    unchunked = pools(world).run(chunked_output, flux_tiny, config, None)
    for r, plain in zip(pools(world).run(chunked_output, flux_tiny, config, pieces), unchunked):
        assert r["hooked"] == 4 and rel_err(r["out"], whole["out"]) <= 1e-5
        assert r["attention_splits"] > 0  # USP: 12 tokens per ring rank after the all-to-all
        if "tp" not in config:  # pieces add no collective (under tp a row-parallel feed-forward reduces per piece)
            assert r["counts"] == plain["counts"] and r["counts"]


def test_attention_in_query_pieces_equals_whole_with_masks_and_lse():
    from ditmesh.attention.local import QueryChunks, attention_with_lse

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, 3, 8, generator=g) for _ in range(3))
    per_query = torch.rand(2, 1, 11, 11, generator=g) > 0.3
    per_query[:, :, 4] = False  # a fully masked query row: 0 out, LSE -inf, in a piece or not
    for mask in (None, torch.rand(2, 11, generator=g) > 0.2, per_query, torch.randn(2, 3, 11, 11, generator=g)):
        out, lse = attention_with_lse(q, k, v, mask=mask)
        pieces = QueryChunks(tokens=4)
        cut_out, cut_lse = attention_with_lse(q, k, v, mask=mask, chunks=pieces)
        assert pieces.split_calls == 1
        assert torch.allclose(cut_out, out, atol=1e-6) and torch.equal(torch.isneginf(cut_lse), torch.isneginf(lse))
        assert torch.allclose(cut_lse.nan_to_num(neginf=0), lse.nan_to_num(neginf=0), atol=1e-6)
    budget = QueryChunks(budget=2 * 3 * 11 * 4 * 5)  # the scores of 5 queries
    assert budget.size(q, k) == 5


def test_bad_chunk_settings_are_refused_in_one_line():
    from ditmesh.config import ConfigError
    from ditmesh.options import RunOptions

    def chunk(text, cli=True):
        return RunOptions.create(chunk_tokens=text, cli=cli).chunk_tokens

    assert chunk("auto") == "auto" and chunk("64") == 64 and chunk(None) is None and chunk(64, cli=False) == 64
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ConfigError, match=f"--chunk '{bad}' is not a token count"):
            chunk(bad)
    with pytest.raises(ConfigError, match="chunk_tokens=0 is not a token count"):
        chunk(0, cli=False)
