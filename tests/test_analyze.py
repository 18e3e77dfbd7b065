"""``ditmesh analyze``: step-to-step redundancy per block, the same numbers under every parallel configuration as
on one process (the statistics are reduced over the ranks that share each computation)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from cases_analyze import probe_records, probe_refusal


def flat(records: dict) -> dict:
    """``{(component, branch, quantity, module, step): value}``."""
    return {(c, b, q, m, i): v for c, branches in records.items() for b, quantities in branches.items()
            for q, modules in quantities.items() for m, values in modules.items() for i, v in enumerate(values)}


def assert_same_numbers(got: dict, ref: dict) -> None:
    a, b = flat(got), flat(ref)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-3) for k in b)
    assert worst <= 1e-5, worst


_REF: dict = {}


def reference(model, **kwargs):
    key = (model, tuple(sorted(kwargs.items())))
    if key not in _REF:
        _REF[key] = probe_records(model, {}, **kwargs)
    return _REF[key]


def test_the_probe_records_every_block_attention_and_kv_from_the_second_step(flux_tiny):
    records = reference(flux_tiny)
    data = records["transformer"]["call0"]
    assert set(data) == {"output", "residual", "attention", "key", "value", "modulated"}
    assert list(data["modulated"]) == ["transformer_blocks.0"] and len(data["modulated"]["transformer_blocks.0"]) == 2
    # flux-tiny: 2 double + 2 single blocks, one attention each
    assert list(data["output"]) == ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
                                    "single_transformer_blocks.1"]
    assert len(data["attention"]) == 4 and len(data["key"]) == 4
    for series in data["output"].values():
        assert len(series) == 2 and all(0 < v < 10 and math.isfinite(v) for v in series)  # 3 steps: 2 changes


@pytest.mark.parametrize("config", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}], ids=str)
def test_sequence_and_tensor_parallel_runs_record_the_single_process_numbers(pools, flux_tiny, config):
    ref = reference(flux_tiny)
    for records in pools(2).run(probe_records, flux_tiny, config):
        assert_same_numbers(records, ref)


def test_cfg_parallel_run_records_both_branches_like_one_process(pools, flux_tiny):
    ref = reference(flux_tiny, cfg=True)
    assert set(ref["transformer"]) == {"call0", "call1"}
    for records in pools(2).run(probe_records, flux_tiny, {"cfg": 2}, cfg=True):
        assert_same_numbers(records, ref)


def test_data_parallel_and_4_rank_runs_record_the_single_process_numbers(pools, flux_tiny):
    prompts = ("a red circle", "a blue square", "a green triangle")
    ref = reference(flux_tiny, prompts=prompts)
    for records in pools(2).run(probe_records, flux_tiny, {"dp": 2}, prompts=prompts):
        assert_same_numbers(records, ref)
    for records in pools(4).run(probe_records, flux_tiny, {"ulysses": 2, "tp": 2}, prompts=prompts):
        assert_same_numbers(records, ref)


def test_the_probe_refuses_a_batch_that_leaves_a_dp_rank_without_an_image(pools, flux_tiny):
    """Every rank must compute every call for the probe's records to be the one process's: one prompt on two dp
    groups is refused on every rank (instead of one rank skipping calls the other records)."""
    for message in pools(2).run(probe_refusal, flux_tiny, {"dp": 2}, steps=2):
        assert message is not None and "cannot give each of the 2 dp/cfg batch ranks an image" in message


def test_sd3_batched_cfg_and_wan_record_the_single_process_numbers(pools, model_checkpoints):
    sd3 = model_checkpoints["sd3-tiny"]
    ref = reference(sd3, guidance_scale=5.0)
    for records in pools(2).run(probe_records, sd3, {"cfg": 2}, guidance_scale=5.0):
        assert_same_numbers(records, ref)
    wan = model_checkpoints["wan2.2-tiny"]
    ref = reference(wan, steps=8, num_frames=5, guidance_scale=5.0)
    assert set(ref) == {"transformer", "transformer_2"}  # both experts, each against its own previous step
    for records in pools(2).run(probe_records, wan, {"ulysses": 2}, steps=8, num_frames=5, guidance_scale=5.0):
        assert_same_numbers(records, ref)


def test_analyze_cli_writes_json_heatmap_and_curves(tmp_path, flux_tiny):
    out = tmp_path / "an"
    proc = subprocess.run([sys.executable, "-m", "ditmesh", "analyze", "--model", flux_tiny, "--nproc", "2",
                           "--ulysses", "2", "--steps", "3", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "redundancy.json").read_text())
    assert doc["config"]["ulysses"] == 2 and doc["steps"] == 3
    assert len(doc["records"]["transformer"]["call0"]["output"]) == 4
    assert (out / "heatmap.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0
