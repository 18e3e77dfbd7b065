"""What a ``ditmesh bench`` run leaves: one JSON document in the results schema, a Markdown table, a plot.

The schema (``SCHEMA``), one JSON object per run:

- ``schema``: ``"ditmesh-bench/1"``
- ``command``: the command as typed (``["ditmesh", "bench", ...]``; a published document that several
  commands produced has ``commands``, one argv each); ``settings``: every option as resolved (defaults filled
  in), so a later default cannot change what the run meant
- ``created``: ISO 8601 time; ``card``: the device's name; ``device_count``; ``versions``: ditmesh, Python,
  torch, diffusers, transformers, CUDA, NCCL; ``env``: the NCCL and symmetric-memory variables that were set
- ``model``, ``height``, ``width``, ``frames``, ``batch``, ``dtype``: the workload
- ``rows``: one per configuration (``method``, ``gpus``, ``degrees``, ``compiled``, ``graph``, ``step_ms`` =
  median of the timed steps, ``step_ms_all``, ``peak_gib_per_gpu``, ``rel_err_vs_1gpu``, speedups, ``card``;
  on CPU ``cpu_threads``: each rank's threads, the same in every row, the 1-process reference's included
  (``settings.cpu``: them, the cores, the 1-minute load before the run and a warning when it was busy);
  ``breakdown`` with ``--profile``; with ``--lora RANK``: ``lora_rank``, ``step_ms_lora_<phase>`` and
  ``lora_<phase>_overhead`` (a fraction of ``step_ms``) for each of ``LORA_PHASES`` (``unfused``, ``fused``,
  ``fused_unloaded``), ``lora_layers`` / ``lora_merged_layers`` (adapted, and merged by ``fuse_lora``),
  ``lora_layers_unloaded`` (LoRA layers left after ``unload_lora``: 0), ``lora_change`` (the adapted output
  against the plain one), ``lora_fused_rel_err`` (fused against unfused), ``lora_unloaded_rel_err`` (fused and
  unloaded against fused), ``rel_err_lora_vs_1gpu``, or ``lora_error``; ``error`` when the configuration could
  not run; ``rendezvous_retry``: why its ranks' first start could not meet, when it was started again); with
  ``--baseline-src`` each row also has ``tree`` (``baseline`` or ``current``)

Runs go to ``--out`` or, by default, to ``$DITMESH_BENCH_DIR`` (else ``bench/`` under ditmesh's cache
folder, ``$DITMESH_CACHE`` or ``~/.cache/ditmesh``): never into a checkout unless asked. The project's
published results live under ``bench/results/<date>_<card>/``, listed in ``bench/results/MANIFEST.md``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: the ``--lora`` phases, in the order a row runs them: the adapter's layers, fused, fused with the layers taken out
LORA_PHASES = ("unfused", "fused", "fused_unloaded")

SCHEMA = "ditmesh-bench/1"

#: environment variables that change how collectives run, recorded with every run
ENV_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_", "OMP_NUM_THREADS")


def default_out_dir() -> Path:
    """Where runs without ``--out`` are written: ``$DITMESH_BENCH_DIR``, else ``<ditmesh cache>/bench``."""
    from ..runtime.models import cache_dir

    return Path(os.environ.get("DITMESH_BENCH_DIR") or cache_dir() / "bench")


def default_out_path(model: str, height: int, width: int) -> Path:
    """``<default_out_dir>/<model>-<H>x<W>-<YYYYmmdd-HHMMSS>.json``."""
    return default_out_dir() / f"{model}-{height}x{width}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def document(*, command: list[str], settings: dict, card: str, device_count: int, versions: dict, rows: list[dict],
             **workload) -> dict:
    """One run in the results schema (``workload``: model, height, width, frames, batch, dtype)."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {"schema": SCHEMA, "command": command, "settings": settings,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "card": card, "device_count": device_count,
            "versions": versions, "env": env, **workload, "rows": rows}


def write(path: Path, doc: dict) -> list[Path]:
    """Write ``doc`` as JSON at ``path``, its Markdown table next to it (``.md``) and, where matplotlib is
    installed, its plot (``.png``); return the paths written."""
    from ..shared import atomic_write_bytes, write_json

    write_json(path, doc)
    written = [path, path.with_suffix(".md")]
    atomic_write_bytes(written[1], (markdown(doc) + "\n").encode())
    title = f"{doc['model']} {doc['height']}x{doc['width']}" + (f"x{doc['frames']}f" if doc.get("frames") else "")
    if plot([r for r in doc["rows"] if r.get("tree", "current") == "current"], path.with_suffix(".png"), title):
        written.append(path.with_suffix(".png"))
    return written


def markdown(doc: dict) -> str:
    """The run as Markdown: what ran where, the rows' table, and the A/B table when there is a baseline."""
    head = (f"`{' '.join(doc['command'])}`\n\n{doc['card']} x{doc['device_count']}, "
            + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + "\n")
    current = [r for r in doc["rows"] if r.get("tree", "current") == "current"]
    parts = [head, rows_table(current)]
    if any(r.get("tree") == "baseline" for r in doc["rows"]):
        parts += ["", f"Against the baseline tree ({doc['settings'].get('baseline_src')}):", "", ab_table(doc["rows"])]
    return "\n".join(parts)


def rows_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (with the profiler's breakdown where rows have one, and the LoRA step times with
    their cost over the plain step where rows have them: ``--lora``)."""
    lora = any("lora_rank" in r for r in rows)
    lora_head = " LoRA unfused ms | LoRA fused ms | LoRA fused+unloaded ms |" if lora else ""
    head = ("| method | gpus | compiled | graph | step ms | speedup | efficiency | peak GiB/GPU | rel err vs 1 "
            f"| compute / comm exposed / idle ms | first call s |{lora_head} note |")
    lines = [head, "|---" * head.count(" |") + "|"]
    for r in rows:
        err = r.get("rel_err_vs_1gpu")
        b = r.get("breakdown")
        split = f"{b['compute_ms']} / {b['comm_exposed_ms']} / {b['idle_ms']}" if b else ""
        extra = "".join(f" {_lora_cell(r, phase)} |" for phase in LORA_PHASES) if lora else ""
        lines.append(
            f"| {r['method']} | {r['gpus']} | {r.get('compiled', '')} | {r.get('graph', False)} | {r.get('step_ms', '')} "
            f"| {r.get('speedup_vs_1gpu', '')} | {r.get('efficiency', '')} | {r.get('peak_gib_per_gpu', '')} "
            f"| {'' if err is None else f'{err:.2e}'} | {split} | {_first_call(r)} |{extra} "
            f"{r.get('error', '') or r.get('lora_error', '') or _cache_note(r) or _eight_note(r)}"
            f"{' (started again after: ' + r['rendezvous_retry'] + ')' if r.get('rendezvous_retry') else ''} |"
        )
    return "\n".join(lines)


def _lora_cell(row: dict, phase: str) -> str:
    """A row's step time with the adapter (``phase``: one of ``LORA_PHASES``) and its cost over the plain step."""
    if f"step_ms_lora_{phase}" not in row:
        return ""
    overhead = row.get(f"lora_{phase}_overhead")
    return f"{row[f'step_ms_lora_{phase}']}" + ("" if overhead is None else f" ({overhead:+.1%})")


def _first_call(row: dict) -> str:
    """The first call's seconds (compile and CUDA graph capture included) and, compiled, the graphs dynamo made and
    inductor's cache misses: ``41.2 (2 graphs, 14 misses)``."""
    if "first_call_s" not in row:
        return ""
    c = row.get("compile")
    return f"{row['first_call_s']}" + (f" ({c['graphs']} graphs, {c['fx_cache_misses']} misses)" if c else "")


def _eight_note(row: dict) -> str:
    """A row's 8-bit options: ``comm fp8, attention fp8, quant backend scaled-mm, fused qkv`` (empty for the
    defaults)."""
    return ", ".join([f"{name} {row[key]}" for key, name in (("quant", "quant"), ("quant_backend", "quant backend"),
                                                             ("comm_dtype", "comm"), ("attention", "attention"))
                      if row.get(key)] + (["fused qkv"] if row.get("fuse_qkv") else []))


def _cache_note(row: dict) -> str:
    """A cached row's note: the cache setting and how many timed steps it skipped."""
    if not row.get("cache"):
        return ""
    return f"cache {row['cache']}, {row.get('cache_skipped', 0)} timed steps cached"


def ab_table(rows: list[dict]) -> str:
    """Baseline against current step times, one line per configuration both trees ran."""
    def key(r):
        return r["method"], r["gpus"], bool(r.get("compiled")), bool(r.get("graph"))

    base = {key(r): r for r in rows if r.get("tree") == "baseline"}
    lines = ["| method | gpus | compiled | graph | baseline ms | current ms | current / baseline |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get(key(r))
        if r.get("tree") != "current" or b is None:
            continue
        ratio = f"{r['step_ms'] / b['step_ms']:.3f}" if "step_ms" in r and "step_ms" in b else ""
        lines.append(f"| {r['method']} | {r['gpus']} | {bool(r.get('compiled'))} | {bool(r.get('graph'))} "
                     f"| {b.get('step_ms', b.get('error', ''))} | {r.get('step_ms', r.get('error', ''))} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Latency and speedup against GPU count, one line per method (needs matplotlib; skipped without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[str, list] = {}
    for r in rows:
        if "step_ms" in r:
            name = r["method"] + (" (compiled)" if r.get("compiled") else "") + (" +graph" if r.get("graph") else "")
            series.setdefault(name, []).append((r["gpus"], r["step_ms"], r.get("speedup_vs_1gpu", 0)))
    singles = {k: v for k, v in series.items() if k.startswith("single")}
    for name, points in series.items():
        if name.startswith("single"):
            continue
        mode = (" (compiled)" if "compiled" in name else "") + (" +graph" if name.endswith("+graph") else "")
        points = sorted(singles.get("single" + mode, []) + points)
        ax1.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax2.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=name)
    ax1.set(xlabel="GPUs", ylabel="ms per step", title=title)
    ax2.set(xlabel="GPUs", ylabel="speedup vs 1 GPU", title="speedup")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
