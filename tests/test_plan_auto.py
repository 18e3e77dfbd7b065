"""`ditmesh generate --plan auto` takes the planner's recommendation among implemented dimensions."""

from __future__ import annotations

import argparse

import pytest

from ditmesh import ConfigError
from ditmesh.runtime.generate import planned_config


def _args(**kw):
    base = dict(model="flux-tiny", height=None, width=None, dp=1, cfg=1, pp=1, ring=1, ulysses=1, tp=1,
                negative_prompt=None, true_cfg_scale=4.0, guidance=3.5, prompt=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_plan_auto_picks_an_implemented_config_for_the_process_count():
    config = planned_config(_args(), 2)
    assert config.world_size == 2 and config.ulysses == 2


def test_plan_auto_refuses_explicit_degrees():
    with pytest.raises(ConfigError, match="--plan auto picks the degrees itself"):
        planned_config(_args(ulysses=2), 2)


def test_plan_auto_never_picks_a_configuration_that_runs_out_of_memory():
    # FLUX-dev's VAE decode of an 8192² picture does not fit one 80 GB GPU whole: refused, naming what fits
    with pytest.raises(ConfigError, match=r"--plan auto: no configuration of 1 GPU\(s\) fits 8192x8192 .* holds about "
                                          r"\d+x\d+"):
        planned_config(_args(model="flux-dev", height=8192, width=8192), 1)
    # diffusers' tiling (here on one process) or the split over 4 GPUs holds it
    assert planned_config(_args(model="flux-dev", height=8192, width=8192, vae_parallel="tiled"), 1).world_size == 1
    assert planned_config(_args(model="flux-dev", height=8192, width=8192), 4).world_size == 4


def test_plan_auto_offers_pipefusion_and_displaced_to_the_planner_only_with_allow_stale(monkeypatch):
    import ditmesh.planner
    from ditmesh import ParallelConfig

    from ditmesh.planner import Prediction

    offered = []

    def recommend_prediction(*args, supported, displaced, **kwargs):
        offered.append((supported, displaced))
        return Prediction(ParallelConfig(ulysses=2), 1.0, 1.0, 0.0, 0.0, {}, {}, "yes")

    monkeypatch.setattr(ditmesh.planner, "recommend_prediction", recommend_prediction)
    planned_config(_args(), 2)
    planned_config(_args(allow_stale=True), 2)
    assert "pp" not in offered[0][0] and "ulysses" in offered[0][0] and not offered[0][1]  # nor displaced
    assert "pp" in offered[1][0] and offered[1][1]
    # a family that refuses PipeFusion (Mochi: every call carries a mask) or displaced attention (Sana: its token
    # grid; its blocks declare no token streams for PipeFusion either) is never offered it, also with --allow-stale
    planned_config(_args(model="mochi-tiny", allow_stale=True), 2)
    planned_config(_args(model="sana-tiny", allow_stale=True), 2)
    assert "pp" not in offered[2][0] and offered[2][1]
    assert "pp" not in offered[3][0] and not offered[3][1]
    # nor is ring offered to a family that refuses it (Kandinsky 6 SR: its NABLA block mask)
    planned_config(_args(model="kandinsky6-sr-tiny"), 2)
    assert "ring" not in offered[4][0] and "ulysses" in offered[4][0] and "ring" in offered[0][0]
