"""Opt-in debug check: every rank sees identical timesteps, latents and text embeddings at every step.

Why: a published FLUX tensor-parallel script broadcast the timestep into a temporary copy, so every
rank but 0 denoised with timestep 0 and produced noise without any error. This hook catches that class
of bug at the first transformer call where inputs diverge.

Cross-rank rule: the hook runs on every rank before every transformer call (it is registered before
the sequence split, so it sees the full, replicated inputs) and issues the same collectives everywhere.
"""

from __future__ import annotations

import torch

from ..comm import check_identical

CHECKED_INPUTS = (
    "hidden_states",
    "timestep",
    "encoder_hidden_states",
    "pooled_projections",
    "guidance",
    "encoder_hidden_states_image",
)


class RankDivergenceError(RuntimeError):
    """Ranks disagree on an input that must be replicated."""


def attach_consistency_check(model: torch.nn.Module, group=None) -> list:
    """Register the check on ``model``; returns undo callables."""
    calls = {"n": 0}

    def pre_hook(module, args, kwargs):
        calls["n"] += 1
        for name in CHECKED_INPUTS:
            t = kwargs.get(name)
            if isinstance(t, torch.Tensor) and not check_identical(t, group):
                raise RankDivergenceError(
                    f"ranks disagree on '{name}' at transformer call {calls['n']}: every rank must run the "
                    f"pipeline with identical inputs (same prompt, seed, steps and size)"
                )
        return None

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
    return [handle.remove]
