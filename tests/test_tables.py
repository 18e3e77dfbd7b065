"""The docs' tables of measured numbers: each is generated from bench/results (scripts/tables.py, bench/spec.py),
none is stale, none with units is hand-written; the suites pack their runs into calls under the device limit.
Torch-free and fast: the generator and the spec are plain Python."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"ditmesh_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(ROOT / "scripts"))
tables = _load("tables")
suite = _load("suite")


# -- the checkout as it is -----------------------------------------------------------------------------------------
def test_every_generated_region_is_current_and_no_table_with_units_is_hand_written():
    spec = tables.load_spec()
    assert tables.stale(spec) == []
    assert tables.unsourced_lines(spec) == []


def test_check_command_passes_without_importing_torch():
    code = ("import sys, runpy; sys.argv = ['tables.py', '--check']\n"
            "try:\n    runpy.run_path('scripts/tables.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_row_links_its_raw_file_and_names_its_card_and_command():
    spec = tables.load_spec()
    for table in spec.TABLES:
        path = ROOT / table["doc"]
        text = path.read_text()
        start, end = tables.regions(text)[table["name"]]
        body = text[start:end]
        rows = [line for line in body.splitlines() if line.startswith("| ")][1:]
        assert rows, table["name"]
        for row in rows:
            link = re.search(r"\[[^]]+\]\(([^)]+)\)\s*\|$", row)
            assert link, (table["name"], row)
            assert (path.parent / link.group(1)).resolve().is_file(), (table["name"], link.group(1))
        provenance = [line for line in body.splitlines() if line.startswith("- `")]
        assert provenance and all("×" in line or "cpu" in line for line in provenance), table["name"]
        assert all("command:" in line for line in provenance), table["name"]


def test_the_output_is_deterministic():
    spec = tables.load_spec()
    assert tables.build(spec) == tables.build(spec)


# -- a checkout of our own: the check fails where it must ------------------------------------------------------------
RESULT = {"schema": "ditmesh-bench/1", "command": ["ditmesh", "bench", "--gpus", "1,2"], "card": "NVIDIA H200",
          "device_count": 2, "versions": {"torch": "2.11.0"},
          "rows": [{"method": "single", "gpus": 1, "step_ms": 100.0}, {"method": "ulysses", "gpus": 2,
                                                                       "step_ms": 55.5}]}


@pytest.fixture
def checkout(tmp_path):
    """README.md, docs/a.md with a region, bench/results/2026-01-01_h200x2/run.json, and a one-table spec."""
    (tmp_path / "docs").mkdir()
    results = tmp_path / "bench" / "results" / "2026-01-01_h200x2"
    results.mkdir(parents=True)
    (results / "run.json").write_text(json.dumps(RESULT))
    (tmp_path / "README.md").write_text("# x\n\n| module | holds |\n|---|---|\n| a | b |\n")
    (tmp_path / "docs" / "a.md").write_text("# a\n\nIntro.\n\n<!-- table:t -->\n<!-- /table:t -->\n\nAfter.\n")
    spec = SimpleNamespace(TABLES=[dict(name="t", doc="docs/a.md", files=["2026-01-01_h200x2/run.json"],
                                        columns=[("method", "method"), ("step ms", "step_ms", ".1f")])])
    for path, text in tables.build(spec, tmp_path).items():
        path.write_text(text)
    return tmp_path, spec


def test_a_generated_region_is_written_in_place_with_its_provenance(checkout):
    root, spec = checkout
    text = (root / "docs" / "a.md").read_text()
    assert text.startswith("# a\n\nIntro.\n\n<!-- table:t -->\n") and text.endswith("<!-- /table:t -->\n\nAfter.\n")
    assert "| ulysses | 55.5 | [run.json](../bench/results/2026-01-01_h200x2/run.json) |" in text
    assert "2× NVIDIA H200; torch 2.11.0; command: `ditmesh bench --gpus 1,2`" in text
    assert tables.stale(spec, root) == [] and tables.unsourced_lines(spec, root) == []


def test_a_stale_region_fails_the_check(checkout):
    root, spec = checkout
    doc = root / "docs" / "a.md"
    doc.write_text(doc.read_text().replace("| 55.5 |", "| 50.1 |"))  # a hand edit inside the region
    assert tables.stale(spec, root) == ["docs/a.md: t"]
    for path, text in tables.build(spec, root).items():
        path.write_text(text)
    assert tables.stale(spec, root) == []
    result = root / "bench" / "results" / "2026-01-01_h200x2" / "run.json"
    result.write_text(json.dumps(dict(RESULT, rows=RESULT["rows"][:1])))  # the results change under the doc
    assert tables.stale(spec, root) == ["docs/a.md: t"]


@pytest.mark.parametrize("table", [
    "| config | step ms |\n|---|---|\n| ulysses 2 | 55.5 |\n",  # a unit in the header
    "| config | step |\n|---|---|\n| ulysses 2 | 55.5 ms |\n",  # a number with a unit in a cell
    "| config | memory |\n|---|---|\n| tp 4 | 10.4 GiB |\n",
    "| config | speed-up |\n|---|---|\n| ulysses 4 | 2.93× |\n",
    "| config | throughput |\n|---|---|\n| 4 × 1 | 0.94 img/s |\n",
    "| cache | lost |\n|---|---|\n| fbcache | 2.3% |\n",
])
def test_a_hand_written_table_with_units_fails_the_check(checkout, table):
    root, spec = checkout
    (root / "docs" / "b.md").write_text(f"# b\n\n{table}\nText.\n")
    assert tables.unsourced_lines(spec, root) == [
        "docs/b.md:3: a table with units outside a generated region (declare it in bench/spec.py)"]


@pytest.mark.parametrize("text", [
    "| module | holds |\n|---|---|\n| cache.py | step caching, 2 × 2 heads |\n",  # no measurement
    "```\n| config | step ms |\n|---|---|\n| a | 1 |\n```\n",  # inside a code block
])
def test_tables_without_measurements_pass(checkout, text):
    root, spec = checkout
    (root / "docs" / "b.md").write_text(f"# b\n\n{text}")
    assert tables.unsourced_lines(spec, root) == []


def test_a_region_the_spec_does_not_declare_fails_the_check(checkout):
    root, spec = checkout
    (root / "docs" / "b.md").write_text("# b\n\n<!-- table:gone -->\n| a | 1 ms |\n<!-- /table:gone -->\n")
    assert tables.unsourced_lines(spec, root) == [
        "docs/b.md: region 'gone' has no table in bench/spec.py: declare it or take its markers out"]


def test_a_kept_table_must_exist(checkout):
    root, spec = checkout
    (root / "README.md").write_text("# x\n\n| dimension | status |\n|---|---|\n| tp | 7.4 GiB |\n")
    assert len(tables.unsourced_lines(spec, root)) == 1
    spec.NOT_GENERATED = [("README.md", "| dimension | status |", "rewritten elsewhere")]
    assert tables.unsourced_lines(spec, root) == []
    (root / "README.md").write_text("# x\n")  # the table is gone: the entry must go too
    assert tables.unsourced_lines(spec, root) == [
        "README.md: NOT_GENERATED names '| dimension | status |', which no table there starts with: take it out of "
        "bench/spec.py"]


def test_a_table_whose_files_are_missing_is_an_error(checkout):
    root, spec = checkout
    spec.TABLES[0]["files"] = ["2026-01-01_h200x2/other.json"]
    with pytest.raises(SystemExit, match="no result file matches"):
        tables.build(spec, root)


# -- suites ----------------------------------------------------------------------------------------------------------
def test_runs_are_packed_into_calls_under_the_limit():
    runs = [dict(name=str(i), wall_s=w) for i, w in enumerate([200, 300, 100, 540, 700, 50])]
    calls = suite.pack(runs, 540)
    assert [[r["name"] for r in c] for c in calls] == [["0", "1"], ["2"], ["3"], ["4"], ["5"]]
    assert all(sum(r["wall_s"] for r in c) <= 540 for c in calls if len(c) > 1)


def test_every_suite_fits_the_device_limit_and_lists_its_unmeasured_runs(capsys):
    spec = tables.load_spec()
    names = {run["name"] for s in spec.SUITES.values() for run in s["runs"]}
    assert len(names) == sum(len(s["runs"]) for s in spec.SUITES.values())  # names (and $OUT files) unique
    for name, s in spec.SUITES.items():
        for call in suite.pack(s["runs"]):
            assert sum(r["wall_s"] for r in call) <= suite.LIMIT_S, name
    todo = {run["name"] for _, run in tables.unmeasured(spec)}
    assert {"flux2-1024-x4", "hunyuan-video-720x1280x129-x4", "mochi-480x848x163", "skyreels-544x960x97",
            "allegro-720x1280x88", "lora-fused-ulysses", "pp-wan-480x832x81", "largest-x4"} <= todo
    assert not todo & {run["name"] for run in spec.SUITES["flux"]["runs"]}  # published: measured
    text = (ROOT / spec.UNMEASURED_DOC).read_text()
    body = text[slice(*tables.regions(text)["unmeasured"])]
    assert all(f"| {n} |" in body for n in todo)
    assert suite.main(["families-4gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "call 1:" in out and "python3 scripts/suite.py families-4gpu --call 1" in out and "$OUT/flux2-1024-x4" in out


def test_a_result_dropped_in_takes_its_run_off_the_unmeasured_list(tmp_path):
    run = dict(name="a", gpus=4, wall_s=60, command="x", result="*/s/a.json")
    spec = SimpleNamespace(SUITES={"s": dict(runs=[run])})
    assert [run["name"] for _, run in tables.unmeasured(spec, tmp_path)] == ["a"]
    (tmp_path / "2026-01-02_h200x4" / "s").mkdir(parents=True)
    (tmp_path / "2026-01-02_h200x4" / "s" / "a.json").write_text("{}")
    assert tables.unmeasured(spec, tmp_path) == []


def test_a_call_runs_its_commands_and_records_them(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = SimpleNamespace(SUITES={"s": dict(runs=[
        dict(name="ok", gpus=1, wall_s=10, command='echo hi > "$OUT/ok.json"', result="*/s/ok.json"),
        dict(name="bad", gpus=1, wall_s=10, command="exit 3", result="*/s/bad.json")])})
    monkeypatch.setattr(suite.tables, "load_spec", lambda: spec)
    assert suite.main(["s", "--call", "1"]) == 1  # one run failed; the call went on
    assert (tmp_path / "ok.json").read_text() == "hi\n"
    record = json.loads((tmp_path / "s-call1.json").read_text())
    assert [(r["name"], r["exit_code"]) for r in record["runs"]] == [("ok", 0), ("bad", 3)]
    with pytest.raises(SystemExit, match="calls 1 to 1"):
        suite.main(["s", "--call", "2"])


def test_the_quality_tables_render_once_their_results_are_in(tmp_path):
    """``CPU_TABLES`` waits for suite ``quality``'s results: it renders ``eval-tiny --json``'s two schemas."""
    spec = tables.load_spec()
    folder = tmp_path / spec.CPU / "quality"
    folder.mkdir(parents=True)
    row = {"colour": 1.0, "shape": 0.93, "position": 1.0, "all": 0.93, "lost": 0, "psnr": 53.9, "ssim": 0.9996}
    (folder / "cache-sweep.json").write_text(json.dumps([dict(row, cache="off", evaluations=28.0),
                                                         dict(row, cache="fbcache:0.1", evaluations=12.46, lost=3)]))
    (folder / "eval-held-out-seed0.json").write_text(json.dumps({"accuracy": row, "n": 128, "steps": 28, "rows": []}))
    (tmp_path / "docs").mkdir()
    texts = {t["name"]: tables.render(t, ROOT / t["doc"], tmp_path, manifest={}) for t in spec.CPU_TABLES}
    assert "| `fbcache:0.1` | 12.46 | 1.000 | 0.930 | 1.000 | 0.930 | 3 | 53.90 | 0.9996 |" in texts["caching-quality"]
    assert "| held-out-seed0 | 128 | 28 | 100.0% | 93.0% | 100.0% | 93.0% |" in texts["tiny-eval"]


def test_a_script_s_named_steps_are_its_commands():
    doc = {"commands": [{"name": "quantize", "command": ["ditmesh", "quantize", "--quant", "fp8"], "exit": 0},
                        ["ditmesh", "generate"], "ditmesh plan"]}
    assert tables.command_of(doc, "x/y.json", {}) == ["`ditmesh quantize --quant fp8`", "`ditmesh generate`",
                                                       "`ditmesh plan`"]
