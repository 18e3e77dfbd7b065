"""scripts/serve_bench.py: a real run on CPU (the tiny pipeline, one layout of two one-rank replicas) whose JSON rows
must account for every request, its accounting against a stand-in server that answers one id twice, a layout the
server refuses, and its own option errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cases import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "serve_bench.py"


def test_serve_bench_on_cpu_answers_every_request_once_and_its_numbers_add_up(flux_tiny, tmp_path):
    bench = load_script("serve_bench")
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", flux_tiny, "--layout",
                           "--nproc 1 --replicas 2 --max-batch 2", "--clients", "1,3", "--answer", "json,png", "--json", str(out), "--deadline", "150",
                           "--steps", "2", "--height", "64", "--width", "64"],
                          capture_output=True, text=True, env=env, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["serve_args"] == ["--steps", "2", "--height", "64", "--width", "64"]
    assert report["versions"]["torch"] and report["card"]
    (layout,) = report["layouts"]
    assert layout["error"] is None and (layout["replicas"], layout["ranks_per_replica"], layout["gpus"]) == (2, 1, 2)
    assert "serve --model" in layout["command"] and "--nproc 1 --replicas 2 --max-batch 2 --steps 2" in \
        layout["command"]
    assert 0 < layout["ready_s"] < layout["first_image_s"]
    # --batching auto measures once the service is idle: the load phases waited for both replicas' measurements
    assert layout["first_image_s"] < layout["batching_measured_s"]
    assert [sorted(b["seconds"]) for b in layout["batching"]] == [["1", "2"]] * 2, layout["batching"]
    assert [(r["clients"], r["answer"], r["requests_per_client"]) for r in layout["rows"]] == [
        (1, "json", 4), (1, "png", 4), (3, "json", 2), (3, "png", 2)]
    # the first picture asked again as a file (Accept: image/png) is the JSON answer's file byte for byte
    assert layout["first_png_same_as_json"] is True and len(layout["first_sha256"]) == 64
    for row in layout["rows"]:
        sent = row["clients"] * row["requests_per_client"]
        assert (row["sent"], row["ok"], row["failed"], row["images"]) == (sent, sent, 0, sent), row
        assert row["answered_once"] and row["duplicate_ids"] == 0 and row["errors"] == []
        assert len(row["latencies_s"]) == sent and min(row["latencies_s"]) > 0
        assert len(row["pictures_sha256"]) == sent  # a seed each
        assert row["images_per_s"] == pytest.approx(row["images"] / row["wall_s"], rel=1e-3)
        # no request can take longer than its phase; the server's own clock is inside the client's
        lat = row["latency_s"]
        assert lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"] <= row["wall_s"]
        assert all(0 < s <= c + 0.05 for s, c in zip(sorted(row["server_seconds"]), sorted(row["latencies_s"])))
        assert row["peak_rss_mib_per_rank"] > 0
        # the server's timelines: the phases on rank 0 fit in its call, the call in the client's latency
        phases = row["phases_s"]
        assert phases["steps"] + phases["vae_decode"] <= phases["call"] <= lat["mean"]
        assert phases["text_encode"] >= 0 and phases["encode"] > 0 and phases["queue"] >= 0
        assert phases["prepare"] >= 0 and phases["http_in"] > 0 and phases["http_out"] > 0
        # the phases, each measured on its own, add up to what the client waited: at most 5% + 20 ms unaccounted
        accounted = bench.account(phases, lat["mean"])
        assert abs(accounted["unaccounted"]) <= 0.05 * lat["mean"] + 0.02, accounted
    # one line per layout x clients in each table (a rank that outlived its server would have set the layout's error)
    latency, phases = proc.stdout.split("\n\n")
    assert [line.split("|")[3].strip() for line in latency.splitlines()[2:]] == ["1", "1", "3", "3"]
    head, _, *lines = phases.strip().splitlines()
    layout = "--nproc 1 --replicas 2 --max-batch 2"
    assert [(line.split("|")[1].strip(), line.split("|")[2].strip()) for line in lines] == [
        (f"`{layout}`{answer}", clients) for clients in "13" for answer in ("", ", png")]
    # the lone client's row has its bound: --steps 2 x the steady step + 0.15 s
    columns = [c.strip() for c in head.split("|")]
    lone = dict(zip(columns, (c.strip() for c in lines[0].split("|"))))
    assert float(lone["bound"]) == pytest.approx(2 * float(lone["step"]) + 0.15, abs=2e-3)
    assert dict(zip(columns, (c.strip() for c in lines[2].split("|"))))["bound"] == ""


class _StandInServer:
    """Answers every POST /generate 200 with a picture; ``repeat_id`` gives two requests the same id."""

    rank_pids: list[int] = []

    def __init__(self, repeat_id: bool):
        self.calls = 0
        self.repeat_id = repeat_id
        self.lock = threading.Lock()

    def request(self, method, path, body=None, timeout=10.0, accept=None):
        with self.lock:
            self.calls += 1
            job = "same" if self.repeat_id and self.calls <= 2 else f"id{self.calls}"
        time.sleep(0.01)
        return 200, {"id": job, "seconds": 0.005, "images": [{"media_type": "image/png", "b64": ""}]}


@pytest.mark.parametrize("repeat_id", [False, True])
def test_a_phase_counts_a_repeated_answer_id_as_not_answered_once(repeat_id):
    bench = load_script("serve_bench")
    args = bench.parse_args(["--model", "m", "--layout", "--nproc 1", "--requests-per-client", "3", "--steps", "2"])
    assert args.serve_args == ["--steps", "2"] and args.layouts == [["--nproc", "1"]]
    server = _StandInServer(repeat_id)
    row = bench.run_phase(server, args, 2, 0, time.perf_counter() + 30)
    assert server.calls == row["sent"] == row["ok"] == 6
    assert row["duplicate_ids"] == (1 if repeat_id else 0) and row["answered_once"] is (not repeat_id)
    assert row["images_per_s"] == pytest.approx(6 / row["wall_s"], rel=1e-3)


def test_the_gpu_serve_preset_runs_issue_32s_rows_each_with_its_clients(tmp_path, capsys):
    bench = load_script("serve_bench")
    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(b"")
    args = bench.parse_args(["--model", "m", "--preset", "gpu-serve", "--lora-file", str(lora), "--steps", "28"])
    assert [" ".join(layout) for layout in args.layouts] == [
        "--nproc 4 --ulysses 4", "--nproc 1 --replicas 4", "--nproc 1 --replicas 4 --max-batch 4",
        f"--nproc 4 --ulysses 4 --lora a={lora} --lora b={lora}:0.5"]
    assert args.layout_clients == [[1, 16], [16], [16], [1]]
    assert args.layout_loras == [(), (), (), ("a", "b", None)] and args.serve_args == ["--steps", "28"]
    assert len(bench.parse_args(["--model", "m", "--preset", "gpu-serve"]).layouts) == 3  # no adapter file: no LoRA row
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m"])
    assert "give at least one --layout, or --preset gpu-serve" in capsys.readouterr().err


def test_e2e_rows_take_the_steps_at_the_steady_step_out_of_the_mean_latency():
    bench = load_script("serve_bench")
    row = {"clients": 1, "latency_s": {"mean": 1.5}, "phases_s": {"step": 0.05, "steps": 1.45}, "images_per_s": 0.7}
    report = {"serve_args": ["--compile", "--steps", "28"],
              "layouts": [{"layout": "--nproc 4 --ulysses 4", "rows": [row, dict(row, phases_s={})]}]}
    (only,) = bench.e2e_rows(report)  # a row without timelines has no steady step: left out
    assert only["row"] == "serve --nproc 4 --ulysses 4 x 1 client(s)" and only["steps"] == 28
    assert only["overhead_s"] == pytest.approx(1.5 - 28 * 0.05) and only["wall_s"] == 1.5


@pytest.mark.parametrize("argv, needle", [
    (["--clients", "0"], "--clients [0]: every count must be >= 1"),
    (["--clients", "a,b"], "--clients 'a,b': give comma-separated counts"),
    (["--port", "8000"], "--port: the benchmark sets serve's address itself"),
    (["--answer", "json,jpeg"], "--answer 'json,jpeg': give json, png or json,png"),
])
def test_bad_options_are_one_line_and_exit_code_2(capsys, argv, needle):
    bench = load_script("serve_bench")
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--model", "m", "--layout", "--nproc 1", *argv])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_server_that_refuses_its_layout_is_a_failed_layout_with_its_error_line(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "flux-tiny", "--layout", "--nproc 2 --ulysses 3",
                           "--clients", "1", "--json", str(out)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (layout,) = json.loads(out.read_text())["layouts"]
    assert layout["rows"] == [] and layout["exit_code"] == 2
    assert layout["error"].splitlines()[0].startswith("the server exited with code 2: ditmesh: error: the degrees "
                                                      "ulysses3 multiply to 3, but there are 2 processes")


def test_settle_waits_for_a_quiet_host_and_no_longer_than_its_limit():
    bench = load_script("serve_bench")
    busy = bench.cpu_busy(0.2)
    assert 0.0 <= busy <= 1.0
    waited, seen = bench.settle(5.0, below=1.01)  # every host is under 101% busy: one sample, no wait past it
    assert waited < 2.0 and seen <= 1.0
    t0 = time.perf_counter()
    waited, seen = bench.settle(1.0, below=-1.0)  # never quiet: it stops at its limit, and says how busy it was
    assert 1.0 <= waited < 3.0 and time.perf_counter() - t0 >= 1.0 and 0.0 <= seen <= 1.0
