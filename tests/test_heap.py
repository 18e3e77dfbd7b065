"""Start-up: the collector paused while the heavy modules import and the heap frozen after them
(``shared.imports_without_gc``: later full collections skip what lives to the end), and the compile machinery imported
in a thread while the weights are copied (``runtime.generate.imported_meanwhile``); docs/timeline.md."""

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


def test_modules_imported_meanwhile_are_there_after_the_block_and_a_failing_one_is_left(tmp_path, monkeypatch):
    from ditmesh import timeline
    from ditmesh.runtime.generate import imported_meanwhile

    (tmp_path / "meanwhile_probe.py").write_text("import time\ntime.sleep(0.2)\nVALUE = 2\n")
    (tmp_path / "meanwhile_broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(timeline, "_TIMELINE", None)
    try:
        with imported_meanwhile(("meanwhile_broken", "meanwhile_probe")):
            assert "meanwhile_probe" not in sys.modules or not hasattr(sys.modules["meanwhile_probe"], "VALUE")
        assert sys.modules["meanwhile_probe"].VALUE == 2 and "meanwhile_broken" not in sys.modules
        (row,) = [p for p in timeline.timeline().phases if p["name"] == "imports meanwhile"]
        assert row["tid"] == 2 and row["end_s"] - row["start_s"] >= 0.2
    finally:
        sys.modules.pop("meanwhile_probe", None)
