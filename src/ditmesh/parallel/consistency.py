"""Opt-in debug check: every rank sees identical transformer inputs at every call.

Why: a published FLUX tensor-parallel script broadcast the timestep into a temporary copy, so every
rank but 0 denoised with timestep 0 and produced noise without any error. This hook catches that class
of bug at the first transformer call where inputs diverge.

Every tensor a pipeline passes to its transformer must be the same on every rank (each rank runs the same
pipeline call); the parallel dimensions cut their shares only after this check. So the check needs no list
of input names: it compares every tensor argument.

Cross-rank rule: the ``consistency`` hook runs on every rank before every transformer call, outside the
batch and sequence hooks (``hooks.ORDER``), so it sees the full, replicated inputs; it issues the same
collectives everywhere (inputs in name order).
"""

from __future__ import annotations

import torch

from ..comm import check_identical
from ..hooks import ForwardContext, Hook, add_hook, bind_kwargs


class RankDivergenceError(RuntimeError):
    """Ranks disagree on an input that must be replicated."""


class ConsistencyHook(Hook):
    """The transformer's ``consistency`` hook."""

    name = "consistency"

    def __init__(self, ctx: ForwardContext, forward, group=None):
        self.ctx, self.forward, self.group = ctx, forward, group

    def __call__(self, owner, call_next, args, kwargs):
        named = bind_kwargs(self.forward, args, kwargs)
        for name in sorted(named):
            t = named[name]
            if isinstance(t, torch.Tensor) and not check_identical(t, self.group):
                raise RankDivergenceError(
                    f"ranks disagree on '{name}' at transformer call {self.ctx.calls}: every rank must run the "
                    f"pipeline with identical inputs (same prompt, seed, steps and size)"
                )
        return call_next(args, kwargs)


def attach_consistency_check(model: torch.nn.Module, ctx: ForwardContext, group=None) -> list:
    """Check ``model``'s inputs before every call; returns undo callables."""
    return [add_hook(model, ConsistencyHook(ctx, model.forward, group))]
