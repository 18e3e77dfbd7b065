"""scripts/e2e_bench.py's tables from given rows and logs: the first step's extra by part, and the imports' accounts."""

from __future__ import annotations

import pytest

from cases import load_script


def test_the_first_steps_rest_is_its_extra_minus_dynamo_capture_and_loaded_artifacts():
    bench = load_script("e2e_bench")
    rows = [{"row": "new:1gpu:warm", "first_step_extra_s": 3.0,
             "compile_breakdown_s": {"dynamo": 2.1, "bytecode_tracing": 1.2, "backend": 0.8, "cuda_graph_capture": 0.2},
             "compile_artifacts": {"loaded": [["FluxTransformerBlock", 0.25]], "saved": [], "fallbacks": []}},
            {"row": "old:1gpu:warm", "first_step_extra_s": None, "compile_breakdown_s": None}]
    head, _, new, old = bench.first_step_table(rows).splitlines()
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in new.split("|")]))
    assert cells["dynamo s"] == "2.10" and cells["graph capture s"] == "0.20"
    assert cells["artifacts loaded s"] == "0.25" and float(cells["rest s"]) == pytest.approx(3.0 - 2.1 - 0.2 - 0.25)
    assert old.split("|")[2].strip() == "" and old.split("|")[-2].strip() == ""  # nothing measured: blank


def test_importtime_logs_give_each_modules_own_seconds():
    bench = load_script("e2e_bench")
    log = ("import time: self [us] | cumulative | imported package\n"
           "import time:       120 |        120 |   ditmesh.config\n"
           "import time:      2500 |       2620 | ditmesh\n"
           "some other line\n")
    assert bench._self_times(log) == {"ditmesh.config": 0.00012, "ditmesh": 0.0025}


def test_the_steady_step_is_the_later_steps_median_also_of_two_steps():
    bench = load_script("e2e_bench")
    report = {"step_latency_s": [5.0, 0.1], "load_s": 1.0, "first_step_extra_s": 4.9, "total_latency_s": 5.2}
    row = bench.summarize(report, 10.0, 2)
    assert row["steady_step_s"] == 0.1 and row["steps_s"] == 0.2 and row["overhead_s"] == pytest.approx(10 - 1 - 0.2)
    row = bench.summarize(dict(report, step_latency_s=[5.0, 0.1, 0.3, 0.2]), 10.0, 4)
    assert row["steady_step_s"] == 0.2
