"""Sana cases run on every rank of a gloo worker pool (module-level for the workers)."""

from __future__ import annotations

import torch

from cases_models import transformer_call


def transformer_call_error(arch: str, config: dict, inputs: dict) -> str:
    """The ValueError message of ``transformer_call`` (empty when it runs)."""
    try:
        transformer_call(arch, config, inputs)
    except ValueError as exc:
        return str(exc)
    return ""


def sana_without_case(missing: str, inputs: dict) -> torch.Tensor:
    """sana-tiny under ulysses 2 with one of its exchanges left out: ``"halo"`` (the convolution's neighbour rows
    arrive as zeros) or ``"key sums"`` (each rank's linear attention keeps the sums of its own keys)."""
    from unittest import mock

    from ditmesh import ParallelConfig, parallelize
    from ditmesh.hooks import find_hook
    from ditmesh.parallel import vae
    from ditmesh.synth import build_transformer

    model = build_transformer("sana-tiny", seed=0, dtype=torch.float32)

    class Pipe:
        transformer = model

    parallelize(Pipe, ParallelConfig(ulysses=2))
    if missing == "key sums":
        find_hook(model, "sequence").sp.sum = lambda t: t

    def zeros(sends, recvs, group):
        for t in recvs.values():
            t.zero_()

    with torch.no_grad(), mock.patch.object(vae, "exchange_rows", zeros if missing == "halo" else vae.exchange_rows):
        return model(**inputs)[0]


def compiled_sequence_parallel_case() -> str:
    """parallelize(sana-tiny, ulysses 2, compile=True): the ConfigError's message (empty when accepted)."""
    from ditmesh import ConfigError, ParallelConfig, parallelize
    from ditmesh.synth import build_transformer

    class Pipe:
        transformer = build_transformer("sana-tiny", seed=0, dtype=torch.float32)

    try:
        parallelize(Pipe, ParallelConfig(ulysses=2), compile=True)
    except ConfigError as exc:
        return str(exc)
    return ""
