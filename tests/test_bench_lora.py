"""`ditmesh bench --lora RANK`: the adapter's rows on CPU (flux-tiny over gloo) against one process, the synthetic
adapter's layers, and the options it refuses."""

from __future__ import annotations

import argparse
import json

import pytest

from ditmesh.config import ConfigError
from test_bench_smoke import bench_here, leftovers

#: FLUX's attention projections (double blocks: all eight; single blocks: to_q, to_k, to_v)
FLUX_PROJECTIONS = {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}


def test_bench_lora_rows_fused_and_unloaded_equal_unfused_and_match_one_process(tmp_path, monkeypatch):
    """The 1-process row and tp 2 (the adapter cut per rank, fused into the weight shards, then unloaded). The
    bench's LoRA phases are one code path whatever a row's degrees; the adapter under ulysses 2 (unfused, fused,
    unloaded) equals one process in test_lora.py."""
    out = tmp_path / "lora.json"
    assert bench_here(["--lora", "4", "--gpus", "1,2", "--methods", "tp", "--steps", "1", "--warmup", "1",
                       "--out", str(out)], tmp_path, monkeypatch) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["lora"] == 4 and doc["settings"]["cuda_graph"] is False
    rows = {(r["method"], r["gpus"]): r for r in doc["rows"]}
    assert set(rows) == {("single", 1), ("tp", 2)}
    for key, r in rows.items():
        assert "error" not in r and "lora_error" not in r, (key, r)
        assert r["lora_rank"] == 4
        assert r["lora_layers"] == r["lora_merged_layers"] == 2 * 8 + 2 * 3, key  # 2 double and 2 single blocks
        assert r["lora_fused_rel_err"] <= 1e-5, key  # fusing changes the arithmetic, not the result
        assert r["lora_layers_unloaded"] == 0, key  # unloading took every peft layer out
        assert r["lora_unloaded_rel_err"] <= 1e-5, key  # ... and kept the fused weights (the tp shards)
        assert r["lora_change"] > 1e-2, key  # the adapter changes the output
        assert r["rel_err_lora_vs_1gpu"] <= 1e-5, key  # cut per tp rank, it is one process's
        for phase in ("unfused", "fused", "fused_unloaded"):
            assert r[f"lora_{phase}_overhead"] == round(r[f"step_ms_lora_{phase}"] / r["step_ms"] - 1, 4)
    table = out.with_suffix(".md").read_text()
    assert "| LoRA unfused ms | LoRA fused ms | LoRA fused+unloaded ms |" in table
    assert f"| {rows[('tp', 2)]['step_ms_lora_unfused']} (" in table
    assert f"| {rows[('tp', 2)]['step_ms_lora_fused_unloaded']} (" in table
    assert leftovers(tmp_path) == []


def test_synthetic_lora_adapts_every_attention_projection():
    import torch

    from ditmesh.synth import attention_lora, build_transformer

    model = build_transformer("flux-tiny")
    state = attention_lora(model, 3)
    adapted = {k.rsplit(".lora_", 1)[0] for k in state}
    assert {n.split(".attn.", 1)[1] for n in adapted} == FLUX_PROJECTIONS
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".attn." in n}
    assert adapted == linears  # every linear of every attention layer, nothing else
    q = "transformer_blocks.0.attn.to_q"
    assert state[f"{q}.lora_A.weight"].shape == (3, model.get_submodule(q).in_features)
    assert state[f"{q}.lora_B.weight"].shape == (model.get_submodule(q).out_features, 3)
    assert all(v.abs().sum() > 0 for v in state.values())
    again = attention_lora(build_transformer("flux-tiny"), 3)  # seeded: every rank draws the same adapter
    assert all(torch.equal(again[k], v) for k, v in state.items())


@pytest.mark.parametrize("value", ["0", "x"])
def test_bench_bad_lora_rank_is_one_line_and_exit_2(value, capsys):
    from ditmesh.cli import main

    assert main(["bench", "--model", "flux-tiny", "--lora", value]) == 2
    err = capsys.readouterr().err
    assert f"--lora {value}: give the adapter's rank" in err and len(err.strip().splitlines()) == 1, err


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"lora": "8", "cuda_graph": None, "cache": None, "fuse_qkv": False, **given})


@pytest.mark.parametrize("given,needle", [
    ({"cuda_graph": True}, "--lora cannot run with --cuda-graph"),
    ({"cache": "teacache:0.1"}, "--lora cannot run with --cache"),
    ({"fuse_qkv": True}, "--lora cannot run with --fuse-qkv"),
])
def test_bench_lora_refuses_what_it_cannot_run_with(given, needle):
    from ditmesh.bench.cli import _lora_rank

    assert _lora_rank(_args()) == 8 and _lora_rank(_args(lora=None)) is None
    with pytest.raises(ConfigError, match=needle):
        _lora_rank(_args(**given))


def test_bench_lora_without_peft_names_the_extra(monkeypatch):
    import importlib.util

    from ditmesh.bench.cli import _lora_rank

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'ditmesh\[lora\]'"):
        _lora_rank(_args())
