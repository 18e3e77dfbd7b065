"""`ditmesh bench` xDiT peer rows: the methods exist (a row without xfuser: tests/test_bench_smoke.py)."""

from __future__ import annotations

from ditmesh.bench import METHODS


def test_xdit_methods_have_our_degrees():
    for m in ("ulysses", "ring", "usp"):
        assert METHODS[f"xdit-{m}"](4) == METHODS[m](4)
    assert METHODS["xdit-usp"](4) == {"ulysses": 2, "ring": 2}
