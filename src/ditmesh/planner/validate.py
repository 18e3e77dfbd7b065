"""``ditmesh plan --validate RESULTS.json ...``: the planner's predictions against ``ditmesh bench`` runs.

Every ditmesh row of the given results (schema ``ditmesh-bench/1``; peer rows and rows that did not run are
left out) becomes a configuration (the row's ``degrees``) and a workload (resolution, ``compiled``, ``graph``;
a file of ``batch`` 2 is one prompt's batched CFG step, as ``bench --batch`` defines it). The planner predicts
each on the hardware named by ``--device`` / ``--link``, or by the file's card. The report: predicted against
measured step latency and peak memory per row, and per group of rows the Spearman rank correlation of
latency, the largest memory error and the mean latency error.

Each row is predicted as it ran: a ``displaced`` row with displaced attention over its ulysses ranks, a ``pp`` row
with its ``pp_patches`` (the runtime's default, ``pp``, when the row names none). Bench rows of both time stale calls
(the bench's warm-up calls include the run's one exact step), so their latency is the planner's ``step_ms`` (a stale
call), not ``exact_step_ms``.

Measured memory (``peak_gib_per_gpu``) is torch's steady-state peak allocated after setup; the planner's
``memory["total"]`` models exactly that (its ``reserve_gib`` enters only the "fits" decision). The peak of a
PipeFusion or displaced row includes the exact warm-up call.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import build_hardware
from .cost import Calibration, Workload, predict, spearman
from .stats import PlannerError, model_stats, resolve_model


def load_rows(paths: list[str | Path]) -> list[dict]:
    """Every measured ditmesh row of the results files, once (the first file that has a configuration wins)."""
    from ..config import ParallelConfig

    rows, seen = [], set()
    for path in map(Path, paths):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlannerError(f"--validate {path}: not a readable results file ({exc})") from None
        if not str(data.get("schema", "")).startswith("ditmesh-bench/"):
            raise PlannerError(f"--validate {path}: not a ditmesh bench result (no 'schema': 'ditmesh-bench/...')")
        batch = data.get("batch", 1)
        cfg_on = batch == 2
        for r in data["rows"]:
            if r["method"].startswith(("diffusers-", "xdit-")) or "step_ms" not in r or r.get("tree") == "baseline":
                continue  # peers' implementations, rows that did not run, and an A/B's older tree
            key = (r["model"], r["height"], r["width"], r["method"], r["gpus"], r["compiled"], r.get("graph", False))
            if key in seen:
                continue
            seen.add(key)
            rows.append(dict(
                file=path.name, card=data.get("card", ""), model=r["model"], height=r["height"], width=r["width"],
                frames=data.get("frames") or 1, method=r["method"], gpus=r["gpus"],
                mode="compiled" if r["compiled"] else "eager", graph=r.get("graph", False),
                config=ParallelConfig(**r["degrees"]), cfg_on=cfg_on, batch=batch // 2 if cfg_on else batch,
                displaced=r["method"] == "displaced", pp_patches=r.get("pp_patches"),
                step_ms=r["step_ms"], gib=r["peak_gib_per_gpu"]))
    return rows


def device_of(card: str) -> str | None:
    """The device preset a card's name names (``NVIDIA H200`` -> ``h200``), or None."""
    from .hardware import DEVICES

    name = card.lower().replace(" ", "")
    return next((d for d in DEVICES if d in name), None)


class Validation:
    """Predictions for measured rows on one choice of hardware (``device``/``link`` None: from each row's card)."""

    def __init__(self, device: str | None = None, link: str | None = None):
        self.device, self.link = device, link
        self._stats: dict = {}

    def predict_row(self, row: dict, cal: Calibration | None = None):
        """The planner's prediction for one measured row (``calibrate.fit`` takes this as its model)."""
        key = (row["model"], row["height"], row["width"], row["frames"])
        if key not in self._stats:
            self._stats[key] = model_stats(resolve_model(row["model"]), row["height"], row["width"], row["frames"])
        hw = build_hardware(row["config"].world_size, device=self.device or device_of(row["card"]), link=self.link)
        wl = Workload(batch=row["batch"], cfg_on=row["cfg_on"], mode=row["mode"], cuda_graph=row["graph"],
                      pp_patches=row.get("pp_patches"))
        return predict(row["config"], self._stats[key], hw, wl, cal or Calibration(), displaced=row.get("displaced", False))

    def evaluate(self, rows: list[dict], cal: Calibration | None = None) -> list[dict]:
        """``rows`` with the predicted latency and memory and their relative errors."""
        out = []
        for row in rows:
            p = self.predict_row(row, cal)
            out.append(dict(row, pred_ms=p.step_ms, pred_gib=p.memory["total"], described=p.describe(),
                            mem_err=(p.memory["total"] - row["gib"]) / row["gib"],
                            ms_err=(p.step_ms - row["step_ms"]) / row["step_ms"]))
        return out


def summary(ev: list[dict]) -> dict:
    """Per group of rows (each model in each mode, per resolution, CUDA graphs, all): n, Spearman, errors."""
    groups: dict[str, list[dict]] = {}
    for r in ev:
        kind = f"{r['model']} {r['mode']}" + (" + CUDA graph" if r["graph"] else "")
        groups.setdefault(kind, []).append(r)
        groups.setdefault(f"{kind} {r['height']}x{r['width']}", []).append(r)
        groups.setdefault(f"{r['model']} all", []).append(r)
    groups["all rows"] = ev
    out, kept = {}, set()
    for name, g in sorted(groups.items(), key=lambda kv: (kv[0] == "all rows", kv[0])):
        members = tuple(sorted(map(id, g)))
        if members in kept:  # the same rows under a narrower name (one resolution, one mode)
            continue
        kept.add(members)
        out[name] = dict(n=len(g), spearman=spearman([r["pred_ms"] for r in g], [r["step_ms"] for r in g])
                         if len(g) >= 3 else None,
                         max_abs_mem_err=max(abs(r["mem_err"]) for r in g),
                         mean_abs_ms_err=sum(abs(r["ms_err"]) for r in g) / len(g))
    return out


def table(ev: list[dict]) -> str:
    """One Markdown line per row: predicted against measured latency and memory."""
    lines = ["| model | res | config | mode | predicted ms | measured ms | latency error | predicted GiB | "
             "measured GiB | memory error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ev:
        lines.append(f"| {r['model']} | {r['height']} | {r['described']} ({r['method']} {r['gpus']}) | "
                     f"{r['mode']}{' + graph' if r['graph'] else ''} | {r['pred_ms']:.1f} | {r['step_ms']:.1f} | "
                     f"{r['ms_err']:+.1%} | {r['pred_gib']:.2f} | {r['gib']:.2f} | {r['mem_err']:+.1%} |")
    return "\n".join(lines)


def summary_text(s: dict) -> str:
    """The summary, one line per group."""
    lines = []
    for name, v in s.items():
        sp = "n/a" if v["spearman"] is None else f"{v['spearman']:.3f}"
        lines.append(f"  {name:40s} n={v['n']:2d}  Spearman {sp:>6s}  max |mem err| {v['max_abs_mem_err']:.1%}  "
                     f"mean |latency err| {v['mean_abs_ms_err']:.1%}")
    return "\n".join(lines)


def holdout(rows: list[dict], validation: Validation) -> list[tuple[str, dict, float, float, list[dict]]]:
    """Refit the implementation constants (``calibrate.FREE``) on part of the rows and score the rest.

    Two splits, on the model with the most rows: fit on its rows at its smallest resolution, and fit on all its
    rows. Returns ``(title, fitted constants, train loss, held-out loss, evaluated rows)`` per split.
    """
    from .calibrate import FREE, fit, loss

    models = sorted({r["model"] for r in rows}, key=lambda m: -sum(r["model"] == m for r in rows))
    main = [r for r in rows if r["model"] == models[0]]
    smallest = min(r["height"] * r["width"] for r in main)
    splits = {f"fit on {models[0]} at its smallest resolution": [r for r in main if r["height"] * r["width"] == smallest],
              f"fit on every {models[0]} row": main}
    out = []
    for title, train in splits.items():
        test = [r for r in rows if r not in train]
        cal, train_loss = fit(train, validation.predict_row, start=Calibration(ring_attention_efficiency=0.70), free=FREE)
        held = loss(test, validation.predict_row, cal) if test else float("nan")
        out.append((title, {k: getattr(cal, k) for k in FREE}, train_loss, held, validation.evaluate(rows, cal)))
    return out


def report(paths: list[str], device: str | None = None, link: str | None = None, with_holdout: bool = False,
           as_json: bool = False) -> str:
    """The text ``ditmesh plan --validate`` prints."""
    rows = load_rows(paths)
    if not rows:
        raise PlannerError(f"--validate {' '.join(map(str, paths))}: no measured ditmesh rows in these files")
    validation = Validation(device, link)
    ev = validation.evaluate(rows)
    if as_json:
        return json.dumps({"rows": [{k: (v.describe() if k == "config" else v) for k, v in r.items()} for r in ev],
                           "summary": summary(ev)}, indent=1)
    cards = sorted({r["card"] for r in rows})
    parts = [f"Planner ({device or 'device from each card'}, {link or 'the device preset link'}) against "
             f"{len(rows)} measured rows ({', '.join(cards)})", "", table(ev), "", "Calibration() as shipped:",
             summary_text(summary(ev))]
    if with_holdout:
        for title, fitted, train_loss, held, ev_fit in holdout(rows, validation):
            parts += ["", f"{title}: refit {fitted}", f"  msle train {train_loss:.4f}  held-out {held:.4f}",
                      "  with the refit constants:", summary_text(summary(ev_fit))]
    return "\n".join(parts)
