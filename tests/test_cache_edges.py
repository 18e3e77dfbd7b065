"""The step cache's limits at their edges, on the decisions alone (no pipeline, no rank): each knob that bounds
what may be skipped (``warmup``, ``max_skips``, ``threshold``, teacache's accumulated change and its last step,
taylor's ``interval``, static's step list) at its value and one past it, against the pattern the rule in
``ditmesh.cache``'s docstring gives. A constant relative change of exactly 0.5 per step (the statistic grows by
1.5x a step, exact in float32) puts every threshold comparison on its edge. Fast: the mutation check runs these
first for cache.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ditmesh.cache import StepCache
from ditmesh.options import CacheConfig

STEPS = 8


def _pattern(setting: str, steps: int = STEPS, calls: int = 1, runs: int = 1, factors: list | None = None) -> str:
    """The decisions of a cache of ``setting`` over ``steps`` steps of ``calls`` branches each (C: computed,
    S: skipped), the statistic 1.5**step (a relative change of 0.5 a step); ``runs`` pipeline runs in a row, the
    last one's pattern per branch joined by '|'."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
    adapter = SimpleNamespace(name="fake", blocks=[SimpleNamespace(path="blocks")], modulated_input="x")
    ctx = SimpleNamespace(run=0, run_step=0, run_steps=steps, call_in_step=0)
    cache = StepCache(model, adapter, CacheConfig.parse(setting), ctx, group=None)
    for run in range(runs):
        ctx.run = run
        cache.history.clear()
        for step in range(steps):
            ctx.run_step = step
            for call in range(calls):
                ctx.call_in_step = call
                cache.decide(torch.full((4,), 1.5 ** step))
                cache.end_call()
                if factors is not None and run == runs - 1:
                    factors.append(round(cache.factor, 4))
    return "|".join("".join("S" if h["skip"] else "C" for h in cache.history if h["branch"] == call)
                    for call in range(calls))


@pytest.mark.parametrize("setting, pattern", [
    # max_skips: at most that many skips in a row, then a computed step
    ("dbcache:threshold=0.6,warmup=0,max_skips=1", "CSCSCSCS"),
    ("dbcache:threshold=0.6,warmup=0,max_skips=2", "CSSCSSCS"),
    ("dbcache:threshold=0.6,warmup=0,max_skips=7", "CSSSSSSS"),
    # warmup: its steps are computed (step 0 always: no previous statistic), the first skip at step == warmup
    ("dbcache:threshold=0.6,warmup=1,max_skips=2", "CSSCSSCS"),
    ("dbcache:threshold=0.6,warmup=3,max_skips=2", "CCCSSCSS"),
    ("dbcache:threshold=0.6,warmup=4,max_skips=2", "CCCCSSCS"),
    ("dbcache:threshold=0.6,warmup=7,max_skips=2", "CCCCCCCS"),
    ("dbcache:threshold=0.6,warmup=8,max_skips=2", "CCCCCCCC"),
    # threshold: a change of exactly the threshold is computed, a hair under it skipped
    ("dbcache:threshold=0.5,warmup=0,max_skips=9", "CCCCCCCC"),
    ("dbcache:threshold=0.500001,warmup=0,max_skips=9", "CSSSSSSS"),
    ("dbcache:threshold=0,warmup=0,max_skips=9", "CCCCCCCC"),
    # teacache: the change accumulates over skipped steps (poly 1/0: the change itself) until it reaches the
    # threshold; the run's last step always runs
    ("teacache:threshold=1.0,poly=1/0,max_skips=9", "CSCSCSCC"),
    ("teacache:threshold=1.000001,poly=1/0,max_skips=9", "CSSCSSCC"),
    ("teacache:threshold=1.000001,poly=1/0,max_skips=1", "CSCSCSCC"),
    ("teacache:threshold=9,poly=1/0,max_skips=9,warmup=2", "CCSSSSSC"),
    ("teacache:threshold=9,poly=1/0,max_skips=9,warmup=3", "CCCSSSSC"),
    # taylor: after warmup every interval-th step is computed, and a skip needs two computed steps to extrapolate
    ("taylor:interval=2,warmup=2", "CCCSCSCS"),
    ("taylor:interval=2,warmup=1", "CCSCSCSC"),
    ("taylor:interval=3,warmup=2", "CCCSSCSS"),
    ("taylor:interval=3,warmup=0", "CCSCSSCS"),
    # static: the steps listed are skipped once a step has been computed
    ("static:skip=1+2", "CSSCCCCC"),
    ("static:skip=0+1", "CSCCCCCC"),
    ("static:skip=7", "CCCCCCCS"),
])
def test_cache_decisions_at_each_limit_and_one_past_it(setting, pattern):
    assert _pattern(setting) == pattern


def test_each_branch_and_each_run_counts_its_own_limits():
    # two calls a step (the cfg branches): each keeps its own statistic, warm-up and skips in a row; a second run
    # starts from nothing (warm-up again, no statistic of the first run)
    assert _pattern("dbcache:threshold=0.6,warmup=2,max_skips=2", calls=2) == "CCSSCSSC|CCSSCSSC"
    assert _pattern("dbcache:threshold=0.6,warmup=2,max_skips=2", calls=2, runs=2) == "CCSSCSSC|CCSSCSSC"
    assert _pattern("teacache:threshold=1.000001,poly=1/0,max_skips=9", runs=2) == "CSSCSSCC"
    assert _pattern("taylor:interval=3,warmup=0", runs=3) == "CCSCSSCS"


def test_taylor_extrapolates_from_its_last_two_computed_steps():
    # a skipped step is extrapolated (step - last computed) / (last computed - the one before) spans ahead; a
    # computed one not at all; a second run measures its spans afresh
    for runs in (1, 2):
        factors = []
        assert _pattern("taylor:interval=3,warmup=0", runs=runs, factors=factors) == "CCSCSSCS"
        assert factors == [0, 0, 1.0, 0, 0.5, 1.0, 0, 0.3333], factors
