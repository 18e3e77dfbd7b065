"""Functions run on every rank of a gloo pool for the tests of families with two transformer calls a step (HunyuanImage's
guiders, Krea 2's true CFG)."""

from __future__ import annotations

import torch


def two_calls(config: dict, cond: dict, uncond: dict, arch: str = "hunyuan-image-tiny"):
    """The conditional then the unconditional call of the synthetic ``arch`` transformer (seed 0) under ``config`` on
    this rank (``{}``: one process). Returns (both outputs, the collectives of both)."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.comm import count_collectives
    from ditmesh.synth import build_transformer

    model = build_transformer(arch, seed=0, dtype=torch.float32)
    if config:
        class Pipe:  # parallelize() needs only `.transformer`
            transformer = model

        parallelize(Pipe, ParallelConfig(**config))
    with torch.no_grad(), count_collectives() as counts:
        outs = [model(**cond)[0], model(**uncond)[0]]
    return outs, dict(counts)


def check_cfg_two_calls(pools, arch, cond: dict, text: str = "encoder_hidden_states") -> None:
    """A sequential-CFG family's two calls of a step (``cond``, then the same with the prompt states ``text`` reversed
    as the negative prompt's) under cfg 2, one on each rank, against one process: rel. err <= 1e-5 and one
    all-gather."""
    from ditmesh.testing import rel_err

    uncond = dict(cond, **{text: cond[text].flip(1)})
    ref, _ = two_calls({}, cond, uncond, arch=arch)
    for outs, counts in pools(2).run(two_calls, {"cfg": 2}, cond, uncond, arch=arch):
        assert all(rel_err(o, r) <= 1e-5 for o, r in zip(outs, ref))
        assert counts == {"all_gather": 1}
