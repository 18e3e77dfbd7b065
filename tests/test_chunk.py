"""Chunked feed-forwards give the numbers of whole ones, alone and under sequence and tensor parallelism."""

from __future__ import annotations

import pytest

from cases_chunk import chunked_output
from ditmesh.testing import rel_err


def test_chunked_feed_forwards_equal_whole_ones_on_every_family(model_checkpoints, flux_tiny):
    for path, frames in ((flux_tiny, None), (model_checkpoints["sd3-tiny"], None), (model_checkpoints["wan2.2-tiny"], 5)):
        whole, none = chunked_output(path, {}, None, frames=frames)
        assert none == 0
        out, hooked, left = chunked_output(path, {}, 7, frames=frames, remove=True)  # uneven pieces of 7 tokens
        assert hooked > 0 and left == 0
        assert rel_err(out, whole) <= 1e-6


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"tp": 2}], ids=str)
def test_chunked_feed_forwards_under_parallelism_equal_one_whole_process(pools, flux_tiny, config):
    whole, _ = chunked_output(flux_tiny, {}, None)
    for out, hooked in pools(2).run(chunked_output, flux_tiny, config, 5):
        assert hooked == 4 and rel_err(out, whole) <= 1e-5


def test_bad_chunk_settings_are_refused_in_one_line():
    from ditmesh.config import ConfigError
    from ditmesh.config import check_chunk
    from ditmesh.runtime.generate import chunk_setting

    assert chunk_setting("auto") == "auto" and chunk_setting("64") == 64 and chunk_setting(None) is None
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ConfigError, match="is not a token count"):
            chunk_setting(bad)
    with pytest.raises(ConfigError, match="chunk=0"):
        check_chunk(0)
