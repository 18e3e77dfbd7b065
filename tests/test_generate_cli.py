"""`ditmesh generate` end to end: N local processes give the single-process result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from pytest import approx

from ditmesh.testing import rel_err


#: one-process results by their arguments: a reference that several tests compare with runs once per session
_ONE_PROCESS: dict[tuple, tuple] = {}


def generate(tmp_path, name, *extra, launch: bool = False):
    """``ditmesh generate --steps 3 *extra`` -> (report, final latents, image as int32). A one-process run
    (``--nproc 1``) with the same arguments as an earlier one gives that run's result (copies) instead of running
    again; its files are not written into this ``tmp_path`` then.

    ``launch``: as a user runs it (a new interpreter, which launches ``--nproc`` ranks); otherwise on the ranks of
    the session's gloo pool of that size (``cases_models.run_command``: the same rank code, no process started)
    or, for one process, in this one."""
    one_process = any(a == "--nproc" and b == "1" for a, b in zip(extra, extra[1:]))
    key = (os.getcwd(), *extra)
    if one_process and key in _ONE_PROCESS:
        report, latents, image = _ONE_PROCESS[key]
        return json.loads(json.dumps(report)), latents.clone(), image.copy()
    result = _run_generate(tmp_path, name, *extra, launch=launch)
    if one_process:
        report, latents, image = result
        _ONE_PROCESS[key] = (json.loads(json.dumps(report)), latents.clone(), image.copy())
    return result


def _run_generate(tmp_path, name, *extra, launch: bool = False):
    out = tmp_path / f"{name}.png"
    argv = ["generate", "--steps", "3", "--out", str(out), "--save-latents", str(tmp_path / f"{name}.safetensors"),
            *extra]
    start = time.time()
    if launch:
        proc = subprocess.run([sys.executable, "-m", "ditmesh", *argv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        from cases_models import run_ranks

        run_ranks(argv)
    wall_s = time.time() - start
    report = json.loads(out.with_name(out.name + ".json").read_text())
    report["measured_wall_s"] = wall_s  # timed from outside, as a user would
    latents = load_file(str(tmp_path / f"{name}.safetensors"))["latents"]
    return report, latents, np.asarray(Image.open(out)).astype(np.int32)


def test_generate_ulysses2_matches_single_process(tmp_path, flux_tiny):
    r1, l1, img1 = generate(tmp_path, "single", "--model", flux_tiny, "--nproc", "1")
    trace = tmp_path / "uly2.trace.json"
    r2, l2, img2 = generate(tmp_path, "uly2", "--model", flux_tiny, "--nproc", "2", "--ulysses", "2", "--trace", str(trace),
                            launch=True)  # the launcher's own path, timed from outside
    assert rel_err(l2, l1) <= 1e-5
    check_trace(json.loads(trace.read_text()), r2, steps=3)
    assert np.abs(img1 - img2).max() <= 1
    assert r2["world_size"] == 2 and r2["config"]["ulysses"] == 2
    # the image above was decoded with the VAE split over both ranks (the default)
    assert r2["vae_parallel"] == {"mode": "auto", "split": True} and not r1["vae_parallel"]["split"]
    for key in ("config", "world_size", "devices", "versions", "step_latency_s", "total_latency_s", "peak_memory_bytes"):
        assert key in r2
    assert len(r2["step_latency_s"]) == 3 and len(r2["peak_memory_bytes"]) == 2 and len(r2["devices"]) == 2
    assert all(m > 0 for m in r2["peak_memory_bytes"])


def test_generate_seeds_torchs_global_generator_from_seed_before_the_call(tmp_path, flux_tiny, monkeypatch):
    # what a pipeline draws from torch's global generator (JoyImageEditPipeline samples its reference image's latents
    # with no generator) must be the same in every run, so on every rank: drawn here at the call's start, in two runs
    # of one process whose generator moved on between them
    import functools

    import diffusers

    from ditmesh.cli import main

    call, drawn = diffusers.FluxPipeline.__call__, []

    @functools.wraps(call)
    def drawing(self, *args, **kwargs):
        drawn.append(torch.rand(4))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.FluxPipeline, "__call__", drawing)
    for run in range(2):
        torch.rand(run + 1)
        assert main(["generate", "--model", flux_tiny, "--steps", "1", "--seed", "7", "--out",
                     str(tmp_path / f"{run}.png")]) == 0
    assert len(drawn) == 2 and torch.equal(drawn[0], drawn[1])
    assert torch.equal(drawn[0], torch.rand(4, generator=torch.Generator().manual_seed(7)))


def test_generate_pp2_with_every_step_exact_matches_single_process(tmp_path, flux_tiny):
    _, l1, _ = generate(tmp_path, "single", "--model", flux_tiny, "--nproc", "1")
    r2, l2, _ = generate(tmp_path, "pp2", "--model", flux_tiny, "--nproc", "2", "--pp", "2", "--pp-patches", "3",
                         "--pp-warmup", "3")
    assert rel_err(l2, l1) <= 1e-5
    assert r2["config"]["pp"] == 2 and r2["pipefusion"] == {"patches": 3, "warmup": 3}


def test_generate_pp2_x_tp2_with_every_step_exact_matches_single_process(tmp_path, flux_tiny):
    # the tp shards are loaded, then each rank keeps only its stage's blocks of its shard
    _, l1, _ = generate(tmp_path, "single", "--model", flux_tiny, "--nproc", "1")
    r4, l4, _ = generate(tmp_path, "pp2tp2", "--model", flux_tiny, "--nproc", "4", "--pp", "2", "--tp", "2",
                         "--pp-warmup", "3")
    assert rel_err(l4, l1) <= 1e-5
    assert r4["config"]["pp"] == 2 and r4["config"]["tp"] == 2


#: the phases every rank of a 2-rank ``generate --nproc 2`` has, in the order they start (depth 0 and nested): the
#: ranks are forked from one process that imported torch and diffusers for them ("shared imports", in "launch")
RANK_PHASES = ["launch", "shared imports", "interpreter start", "checks", "imports", "family checks", "rendezvous", "checks", "load",
               "load components",
               "to device", "parallelize", "communicators", "pipeline call", "text encoding", "prepare", "step 0",
               "step 1", "step 2", "vae decode", "postprocess", "gather statistics"]
#: the phases rank 0 adds (it writes the outputs)
WRITER_PHASES = ["encode images", "write outputs", "write report"]


def check_trace(trace: dict, report: dict, steps: int) -> None:
    """A Chrome trace of a 2-rank run: one process per rank; every phase of the run present on each rank in the
    order it ran; phases of one depth ordered and not overlapping; nested phases inside their parent; the trace
    covers what the user waited for (its span against the wall measured from outside), and the report's
    timeline holds the same phases."""
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        spans = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert all(e["dur"] >= 0 for e in spans)
        started = [e["name"] for e in sorted(spans, key=lambda e: (e["ts"], e["cat"]))]
        expected = RANK_PHASES + (WRITER_PHASES if rank == 0 else [])
        assert [n for n in started if not n.startswith("load ") or n == "load components"] == expected
        loaded = {n for n in started if n.startswith("load ") and n != "load components"}
        assert {"load transformer", "load vae", "load text_encoder", "load text_encoder_2"} <= loaded
        # the rendezvous runs in a thread of its own (its own row), beside the checks and the load
        assert [e["name"] for e in spans if e["tid"] != 0] == ["rendezvous"]
        rendezvous = next(e for e in spans if e["tid"] != 0)
        load = next(e for e in spans if e["name"] == "load")
        assert rendezvous["ts"] + rendezvous["dur"] <= load["ts"] + load["dur"] + 1  # joined before parallelize
        spans = [e for e in spans if e["tid"] == 0]
        by_depth: dict = {}
        for e in sorted(spans, key=lambda e: e["ts"]):
            by_depth.setdefault(e["cat"], []).append(e)
        for depth, level in by_depth.items():
            for a, b in zip(level, level[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + 1, (depth, a, b)  # 1 us: rounding
        for child in (e for e in spans if e["cat"] != "depth0"):
            parents = [p for p in by_depth["depth" + str(int(child["cat"][5:]) - 1)]
                       if p["ts"] <= child["ts"] + 1 and child["ts"] + child["dur"] <= p["ts"] + p["dur"] + 1]
            assert parents, child
        top = by_depth["depth0"]
        span_s = (top[-1]["ts"] + top[-1]["dur"] - top[0]["ts"]) / 1e6
        covered_s = sum(e["dur"] for e in top) / 1e6
        assert covered_s >= 0.95 * span_s  # the top phases leave no unexplained gap
        if rank == 0:  # the command's start to rank 0's last write: most of what the user waited for
            assert top[0]["ts"] == 0 and 0.6 * report["measured_wall_s"] <= span_s <= report["measured_wall_s"]
    steps_in_trace = [e["dur"] / 1e6 for e in events if e["pid"] == 0 and e["name"].startswith("step ")]
    assert len(steps_in_trace) == steps
    assert steps_in_trace[1:] == [approx(s, abs=2e-3) for s in report["step_latency_s"][1:]]
    timelines = report["timeline"]
    assert [t["rank"] for t in timelines] == [0, 1]
    assert [p["name"] for p in timelines[1]["phases"]] == [e["name"] for e in sorted(
        (e for e in events if e["pid"] == 1 and e["ph"] == "X"), key=lambda e: (e["ts"], e["cat"]))]


def test_synth_cli_writes_loadable_pipeline(tmp_path):
    out = tmp_path / "ft"
    proc = subprocess.run([sys.executable, "-m", "ditmesh", "synth", "--arch", "flux-tiny", "--out", str(out), "--seed", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(out))
    assert pipe.transformer.config.num_attention_heads == 6
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary left behind
    # a folder that is not empty, an unknown name: refused in one line before torch is imported
    code = ("import sys; from ditmesh.cli import main; rc = main(['synth', *sys.argv[1:]]); "
            "print(rc, 'torch' in sys.modules, 'diffusers' in sys.modules)")
    for argv, needle in ((["--arch", "flux-tiny", "--out", str(out)], f"output folder {out} exists and is not empty"),
                         (["--arch", "flux-huge", "--out", str(tmp_path / "new")], "unknown architecture 'flux-huge'; "
                                                                                   "known: ")):
        again = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert again.stdout.strip().splitlines()[-1] == "2 False False", (argv, again.stdout, again.stderr)
        assert len(again.stderr.strip().splitlines()) == 1 and needle in again.stderr, (argv, again.stderr)
    assert not (tmp_path / "new").exists()


def test_synth_is_seeded():
    from ditmesh.synth import build_pipeline

    a = build_pipeline("flux-tiny", seed=5).transformer.state_dict()
    b = build_pipeline("flux-tiny", seed=5).transformer.state_dict()
    c = build_pipeline("flux-tiny", seed=6).transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_random_weights_video_says_its_output_is_noise_by_design(tmp_path):
    """A synthetic architecture's output is noise: the closing line says so, beside what the run measured."""
    out = tmp_path / "clip.gif"
    proc = subprocess.run([sys.executable, "-m", "ditmesh", "generate", "--model", "wan-tiny", "--frames", "5",
                           "--height", "32", "--width", "32", "--steps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wrote = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("ditmesh: wrote")]
    assert len(wrote) == 1 and "random weights (a synthetic architecture): the output is noise by design" in wrote[0]
