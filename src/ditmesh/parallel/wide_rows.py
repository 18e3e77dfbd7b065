"""Inductor's heuristics with persistent reductions over wide contiguous rows (``parallel.quant.WIDE_ROWS``).

A module of its own, imported only when a compile of fp8 blocks installs it: it imports inductor, and inductor's
caches key on the class by its importable name.
"""

from __future__ import annotations

from torch._inductor import config
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V


class WideRows(InductorChoices):
    """Inductor's choices, except that a reduction over contiguous rows (``ReductionHint.INNER``) of up to
    :attr:`limit` elements is persistent: one pass, the row held in registers."""

    limit = 16384

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction, *rest) -> bool:
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction, *rest):
            return True
        return bool(config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, WideRows.limit))
