"""Validate the planner's cost model against ditmesh's own `ditmesh bench` measurements (issue 8).

For every ditmesh row (not the ``diffusers-*`` peer rows) of the bench JSONs in ``bench/results/``, map
``method`` + ``gpus`` to a :class:`ParallelConfig` (``ditmesh.bench.METHODS``), ask the planner for that
configuration on 4x H200 over NVLink (``h200`` / ``nvlink-h200`` presets, eager or compiled as measured) and
print predicted vs measured step latency and peak memory, the Spearman rank correlation of latency (all
rows, per resolution, per file) and the largest memory error.

    python scripts/validate_planner.py            # the table (markdown) and the summary
    python scripts/validate_planner.py --json     # the rows as JSON
    python scripts/validate_planner.py --holdout  # also: refit the calibration on 1024^2 rows, score 2048^2

Measured memory (``peak_gib_per_gpu``) is torch's steady-state peak allocated after setup; the planner's
``memory["total"]`` models exactly that (its 1 GiB ``reserve_gib`` for CUDA context/NCCL is only added for
the "fits" decision), so they are compared directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ditmesh.bench import METHODS  # noqa: E402
from ditmesh.config import ParallelConfig  # noqa: E402
from ditmesh.planner import Calibration, Workload, model_stats, predict, resolve_model, spearman  # noqa: E402
from ditmesh.planner import build_hardware  # noqa: E402

#: bench file -> the workload it measured: batch 2 in sd35_cfg.json is one batched CFG step
FILES = {
    "flux1024_eager.json": dict(cfg_on=False),
    "flux2048_eager.json": dict(cfg_on=False),
    "flux1024_compiled.json": dict(cfg_on=False),
    "sd35_cfg.json": dict(cfg_on=True),
    # third session: compiled, our rows replayed from CUDA graphs (``graph`` true), beside plain diffusers
    "flux1024_gpus124.json": dict(cfg_on=False),
    "flux2048_graph.json": dict(cfg_on=False),
}


def load_rows(results: Path = ROOT / "bench" / "results") -> list[dict]:
    """Every measured ditmesh row, with the config and workload the planner needs."""
    rows, seen = [], set()
    for name, extra in FILES.items():
        data = json.loads((results / name).read_text())
        for r in data["rows"]:
            if r["method"].startswith(("diffusers-", "xdit-")) or "step_ms" not in r:
                continue  # peers' implementations, and rows that did not run
            key = (r["model"], r["height"], r["method"], r["gpus"], r["compiled"], r.get("graph", False))
            if key in seen:  # flux1024_compiled.json repeats the eager single-GPU row
                continue
            seen.add(key)
            degrees = METHODS[r["method"]](r["gpus"])
            batch = data.get("batch", 1)
            cfg_on = extra["cfg_on"]
            rows.append(dict(
                file=name, model=r["model"], height=r["height"], width=r["width"], method=r["method"],
                gpus=r["gpus"], mode="compiled" if r["compiled"] else "eager", graph=r.get("graph", False),
                config=ParallelConfig(**degrees), cfg_on=cfg_on,
                batch=batch // 2 if cfg_on else batch,  # a batch-2 CFG step = one prompt with CFG on
                step_ms=r["step_ms"], gib=r["peak_gib_per_gpu"],
            ))
    return rows


_STATS: dict = {}


def predict_row(row: dict, cal: Calibration | None = None):
    key = (row["model"], row["height"], row["width"])
    if key not in _STATS:
        _STATS[key] = model_stats(resolve_model(row["model"]), row["height"], row["width"])
    hw = build_hardware(row["config"].world_size, device="h200", link="nvlink-h200")
    wl = Workload(batch=row["batch"], cfg_on=row["cfg_on"], mode=row["mode"], cuda_graph=row["graph"])
    return predict(row["config"], _STATS[key], hw, wl, cal or Calibration())


def evaluate(rows: list[dict], cal: Calibration | None = None) -> list[dict]:
    out = []
    for row in rows:
        p = predict_row(row, cal)
        out.append(dict(row, pred_ms=p.step_ms, pred_gib=p.memory["total"],
                        mem_err=(p.memory["total"] - row["gib"]) / row["gib"],
                        ms_err=(p.step_ms - row["step_ms"]) / row["step_ms"]))
    return out


def rho(rows: list[dict]) -> float | None:
    return spearman([r["pred_ms"] for r in rows], [r["step_ms"] for r in rows]) if len(rows) >= 3 else None


def summary(ev: list[dict]) -> dict:
    flux_eager = [r for r in ev if r["model"] == "flux-dev" and r["mode"] == "eager"]
    groups = {
        "flux eager 1024+2048": flux_eager,
        "flux eager 1024": [r for r in flux_eager if r["height"] == 1024],
        "flux eager 2048": [r for r in flux_eager if r["height"] == 2048],
        "flux all (eager+compiled)": [r for r in ev if r["model"] == "flux-dev"],
        "flux compiled + CUDA graph": [r for r in ev if r["graph"]],
        "sd3.5-large cfg (batch 2)": [r for r in ev if r["model"] == "sd3.5-large"],
        "all rows": ev,
    }
    out = {}
    for name, g in groups.items():
        out[name] = dict(n=len(g), spearman=rho(g),
                         max_abs_mem_err=max(abs(r["mem_err"]) for r in g),
                         mean_abs_ms_err=sum(abs(r["ms_err"]) for r in g) / len(g))
    return out


def table(ev: list[dict]) -> str:
    lines = ["| model | res | config | mode | predicted ms | measured ms | latency error | predicted GiB | "
             "measured GiB | memory error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ev:
        lines.append(f"| {r['model']} | {r['height']} | {r['config'].describe()} ({r['method']} {r['gpus']}) | "
                     f"{r['mode']}{' + graph' if r['graph'] else ''} | {r['pred_ms']:.1f} | {r['step_ms']:.1f} | {r['ms_err']:+.1%} | "
                     f"{r['pred_gib']:.2f} | {r['gib']:.2f} | {r['mem_err']:+.1%} |")
    return "\n".join(lines)


def print_summary(s: dict, title: str) -> None:
    print(f"\n{title}")
    for name, v in s.items():
        sp = "n/a" if v["spearman"] is None else f"{v['spearman']:.3f}"
        print(f"  {name:28s} n={v['n']:2d}  Spearman {sp:>6s}  max |mem err| {v['max_abs_mem_err']:.1%}  "
              f"mean |latency err| {v['mean_abs_ms_err']:.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--holdout", action="store_true", help="refit on 1024^2 FLUX rows, score on 2048^2")
    args = ap.parse_args()
    rows = load_rows()
    ev = evaluate(rows)
    if args.json:
        print(json.dumps([{k: (v.describe() if k == "config" else v) for k, v in r.items()} for r in ev], indent=1))
        return 0
    print("Planner (h200 / nvlink-h200 presets) vs ditmesh bench, 4x NVIDIA H200\n")
    print(table(ev))
    print_summary(summary(ev), "Calibration() as shipped:")
    if args.holdout:
        from ditmesh.planner.calibrate import FREE, fit, loss  # noqa: PLC0415

        flux = [r for r in rows if r["model"] == "flux-dev"]
        splits = {
            "fit on FLUX 1024^2 (eager+compiled), score FLUX 2048^2 + SD3.5":
                [r for r in flux if r["height"] == 1024],
            "fit on all FLUX rows, score SD3.5": flux,
        }
        for title, train in splits.items():
            test = [r for r in rows if r not in train]
            start = Calibration(ring_attention_efficiency=0.70)  # the ANCHORS-era value: no ring-specific rate
            cal, train_loss = fit(train, predict_row, start=start, free=FREE)
            fitted = {k: getattr(cal, k) for k in FREE}
            print(f"\n{title}: refit {fitted}")
            print(f"  msle train {train_loss:.4f}  held-out {loss(test, predict_row, cal):.4f}")
            print_summary(summary(evaluate(rows, cal)), "  with the refit constants:")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
