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
