"""Compiled blocks kept between processes (``compile_artifacts``): a run that loads them traces nothing and gives
the latents of the run that compiled them, on the block graph of every parallel axis; a block class that cannot be
compiled whole (a graph break) keeps the ordinary compile, named in the stats."""

from __future__ import annotations

import math

import pytest
import torch

from ditmesh.testing import rel_err

#: mode -> (degrees, options): one layout per distinct loading path or graph content (each one is a cold
#: ``aot_compile`` of every block class on every rank). The blocks routed to their class's artifact (no hook of their
#: own): one process; tp (all-reduces, sharded weights); the ring (its rounds are functional all-to-alls under
#: compile); displaced attention (a ditmesh custom operator). Through the hooks' compiled inner forward: the step
#: cache (under Ulysses: its all-to-alls) and PipeFusion (stage subsets, several artifacts of one input layout).
#: Plain Ulysses and cfg are not layouts of their own: Ulysses' block graph is the cache layout's, loaded routed as the
#: ring's all-to-alls are; cfg splits the batch outside the blocks, whose graph is the one process's
MODES = {
    "one-process": ({}, {}),
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2}, {"pp_warmup": 1}),
    "displaced": ({"ulysses": 2}, {"displaced": True}),
    "cache": ({"ulysses": 2}, {"cache": "static:skip=1"}),
    "ring2": ({"ring": 2}, {}),
}
BLOCKS = {"FluxSingleTransformerBlock", "FluxTransformerBlock"}


@pytest.mark.parametrize("mode", list(MODES))
def test_loaded_blocks_trace_nothing_and_give_the_compiled_latents(pools, flux_tiny, tmp_path, mode):
    from cases_aot import aot_round_trip

    config, options = MODES[mode]
    world = math.prod(config.values()) if config else 1
    args = (flux_tiny, config, options, str(tmp_path))
    results = [aot_round_trip(*args)] if world == 1 else pools(world).run(aot_round_trip, *args)
    for rank, r in enumerate(results):
        saved, loaded = set(r["save"]["saved"]), set(r["load"]["loaded"])
        assert rel_err(r["load"]["latents"], r["eager"]["latents"]) <= 1e-5, rank
        assert r["load"]["fallbacks"] == [] and r["save"]["fallbacks"] == [], r["save"]["fallbacks"]
        # PipeFusion: each stage saves and loads the classes of the blocks it holds
        assert saved and saved == loaded and saved <= BLOCKS and (mode == "pp2" or saved == BLOCKS), (saved, loaded)
        assert r["load"]["frames"] == 0  # nothing traced when the artifacts are loaded
        assert torch.equal(r["load"]["latents"], r["save"]["latents"])


def test_the_frame_count_sees_an_ordinary_compile(flux_tiny, tmp_path):
    """What makes ``frames == 0`` above mean something: the same count sees the ordinary compile trace."""
    from cases_aot import aot_round_trip

    r = aot_round_trip(flux_tiny, {}, {}, str(tmp_path), modes=("off",), steps=1)
    assert r["off"]["frames"] >= 2 and r["off"]["saved"] == r["off"]["loaded"] == []


def test_a_block_class_with_a_graph_break_keeps_the_ordinary_compile(flux_tiny, tmp_path, monkeypatch):
    """A block that cannot be compiled whole saves nothing, names why, and runs compiled the ordinary way."""
    from cases_aot import aot_round_trip
    from diffusers.models.transformers import transformer_flux

    call = transformer_flux.FluxAttnProcessor.__call__

    def breaking(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return call(self, *args, **kwargs)

    monkeypatch.setattr(transformer_flux.FluxAttnProcessor, "__call__", breaking)
    r = aot_round_trip(flux_tiny, {}, {}, str(tmp_path), steps=1)
    assert r["save"]["saved"] == r["load"]["loaded"] == []
    assert {name for name, _ in r["save"]["fallbacks"]} == BLOCKS, r["save"]["fallbacks"]
    assert all("graph break" in why.lower() or "graph_break" in why for _, why in r["save"]["fallbacks"]), r["save"]
    assert r["load"]["frames"] >= 2  # traced the ordinary way
    assert rel_err(r["load"]["latents"], r["eager"]["latents"]) <= 1e-5
