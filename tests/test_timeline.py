"""The run's timeline (``ditmesh.timeline``): its clock starts with the process, phases nest, and the Chrome trace
puts every rank on one clock. The timeline of a whole 2-rank ``generate`` is checked in test_generate_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ditmesh.timeline import LAUNCH_START_ENV, Timeline, chrome_trace, process_start_unix


def test_process_start_is_the_interpreter_start():
    """A child process reads its own start: before the moment it imports the module, after the parent asked for it."""
    before = time.time()
    code = ("import time; time.sleep(0.3); from ditmesh.timeline import process_start_unix; "
            "print(process_start_unix(), time.time())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).stdout.split()
    start, imported = float(out[0]), float(out[1])
    assert before - 0.05 <= start <= imported - 0.25  # the sleep before the import counts; 10 ms clock ticks
    assert process_start_unix() < before


def test_phases_nest_and_launch_origin(monkeypatch):
    launched = process_start_unix() - 2.0
    monkeypatch.setenv(LAUNCH_START_ENV, str(launched))
    tl = Timeline()
    assert tl.origin_unix == launched
    assert tl.phases[0]["name"] == "launch" and abs(tl.phases[0]["end_s"] - 2.0) < 1e-3
    with tl.phase("load"):
        with tl.phase("load vae"):
            time.sleep(0.01)
        with tl.phase("load transformer", size=3):
            pass
    tl.add("step 0", tl.now(), tl.now() + 0.5)
    data = tl.as_dict(rank=1)
    assert data["rank"] == 1 and abs(data["process_start_s"] - 2.0) < 1e-3
    names = [(p["name"], p["depth"]) for p in data["phases"]]
    assert names == [("launch", 0), ("load", 0), ("load vae", 1), ("load transformer", 1), ("step 0", 0)]
    load, vae, transformer = data["phases"][1:4]
    assert load["start_s"] <= vae["start_s"] and vae["end_s"] <= transformer["start_s"] <= transformer["end_s"] <= load["end_s"]
    assert vae["end_s"] - vae["start_s"] >= 0.01 and transformer["args"] == {"size": 3}
    json.dumps(data)


def test_chrome_trace_puts_ranks_on_one_clock():
    ranks = [{"rank": 0, "origin_unix": 100.0, "process_start_s": 0.0,
              "phases": [{"name": "load", "start_s": 1.0, "end_s": 3.0, "depth": 0}]},
             {"rank": 1, "origin_unix": 100.5, "process_start_s": 0.0,
              "phases": [{"name": "load", "start_s": 1.0, "end_s": 2.0, "depth": 0, "args": {"n": 1}}]}]
    trace = chrome_trace(ranks)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in spans] == [(0, 1e6, 2e6), (1, 1.5e6, 1e6)]
    assert spans[1]["args"] == {"n": 1}
    assert {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        (0, "rank 0"), (1, "rank 1")}
