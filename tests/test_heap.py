"""The collector paused while the heavy modules import, and the heap frozen after them (``shared.imports_without_gc``):
start-up's imports and the first step's full collections skip what lives to the end (docs/timeline.md)."""

import gc
import sys

from ditmesh.shared import imports_without_gc


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector could free it


def test_imports_without_gc_pauses_the_collector_then_freezes_what_was_made(tmp_path, monkeypatch):
    (tmp_path / "heap_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            made = [_Node() for _ in range(100)]
            import heap_probe_module  # noqa: F401  (something imported: the heap is frozen)
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + 100
        tracked = {id(o) for o in gc.get_objects()}  # the collector's generations: frozen objects are not in them
        assert not any(id(n) in tracked for n in made)
    finally:
        gc.unfreeze()
        sys.modules.pop("heap_probe_module", None)


def test_imports_without_gc_leaves_a_paused_collector_paused():
    gc.disable()
    try:
        with imports_without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_imports_without_gc_freezes_nothing_where_nothing_was_imported():
    frozen = gc.get_freeze_count()
    with imports_without_gc():
        made = [_Node() for _ in range(100)]  # noqa: F841
    assert gc.isenabled() and gc.get_freeze_count() == frozen
