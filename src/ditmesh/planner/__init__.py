"""``ditmesh plan``: pick the parallel configuration from the model, the resolution and the hardware.

Entry points: :func:`plan` (every valid configuration, ranked), :func:`recommend` (the best one as a
:class:`~ditmesh.config.ParallelConfig`) and the closed forms :func:`ring_attention_cost`,
:func:`ulysses_attention_cost`, :func:`tensor_parallel_cost`.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    """The names of :mod:`ditmesh.planner.core` (which imports torch and diffusers), loaded on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(".core", __name__), name)
