"""The collectives of ``ditmesh.comm`` themselves, on real gloo process groups: which ranks each one spans, what it
returns and how it is counted in ``COUNTS``."""

from __future__ import annotations

from cases import gathers_case


def test_gathers_span_the_group_given_and_count_once_each(pools):
    # a group given is the one gathered over (a one-rank group: the rank's own rows); None is the default group
    for rank, (own, every, objects, counts) in enumerate(pools(2).run(gathers_case)):
        assert own == [[float(rank)] * 3]
        assert every == [[0.0] * 3, [1.0] * 3]
        assert objects == [{"rank": 0}, {"rank": 1}]
        assert counts == {"all_gather": 2, "object": 1}
