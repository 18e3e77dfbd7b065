"""Fit :class:`~ditmesh.planner.cost.Calibration` constants to measured step latencies.

A small coordinate search over a grid per constant, minimising the mean squared log error of predicted vs
measured step time (so a 10% miss at 50 ms weighs as much as one at 800 ms). Only the constants named in
``FREE`` move; the rest keep their values. Used by ``ditmesh plan --validate ... --holdout``
(``planner.validate.holdout``) and to produce the shipped defaults (docs/planner.md section 6).
"""

from __future__ import annotations

import math
from dataclasses import replace

from .cost import Calibration

#: constant -> (mode key or None, candidate values): the constants that describe ditmesh's implementation
#: (launch cost per op and per collective, the ring's LSE attention kernel); ``KERNEL`` adds the kernel rates
FREE = {
    "ring_attention_efficiency": (None, [0.25, 0.30, 0.35, 0.40, 0.45, 0.50, 0.60, 0.70]),
    "host_us_per_op": ("eager", [12.0, 13.0, 14.0, 15.0, 16.0, 17.0]),
    "collective_host_us": ("eager", [20.0, 40.0, 60.0, 80.0, 120.0]),
}
KERNEL = {
    "gemm_half_flops": (None, [0.5e10, 1.0e10, 1.5e10, 2.0e10, 3.0e10]),
    "attention_efficiency": (None, [0.60, 0.65, 0.70, 0.75, 0.80]),
    **FREE,
}


def _set(cal: Calibration, name: str, key: str | None, value: float) -> Calibration:
    if key is None:
        return replace(cal, **{name: value})
    return replace(cal, **{name: {**getattr(cal, name), key: value}})


def loss(rows: list[dict], predict_row, cal: Calibration) -> float:
    """Mean squared log error of step latency over ``rows`` (each with a measured ``step_ms``)."""
    return sum(math.log(predict_row(r, cal).step_ms / r["step_ms"]) ** 2 for r in rows) / len(rows)


def fit(rows: list[dict], predict_row, start: Calibration | None = None, free: dict | None = None,
        sweeps: int = 4) -> tuple[Calibration, float]:
    """Coordinate search: for each free constant in turn keep the grid value with the lowest loss."""
    cal = start or Calibration()
    free = FREE if free is None else free
    best = loss(rows, predict_row, cal)
    for _ in range(sweeps):
        improved = False
        for name, (key, grid) in free.items():
            for value in grid:
                trial = _set(cal, name, key, value)
                val = loss(rows, predict_row, trial)
                if val < best - 1e-12:
                    cal, best, improved = trial, val, True
        if not improved:
            break
    return cal, best
