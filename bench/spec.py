"""Every published table and every suite of runs: the one place that says which results make which table.

``scripts/tables.py`` writes each entry of ``TABLES`` between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``
in its doc; ``scripts/suite.py`` runs the entries of ``SUITES`` on the GPU machine.

A table is a dict:

- ``name``: the marker name (unique); ``doc``: the doc it goes in, relative to the checkout
- ``files``: globs under ``bench/results`` (``{a,b}`` braces allowed); every pattern must match a file
- ``columns``: ``(header, value[, format])``; value a dotted path into the row (``breakdown.compute_ms``,
  ``_doc.card``) or a function of the row; format a format spec for numbers (``.1f``, ``.2e``, ``+.1%``)
- optional ``where`` (a dict of path -> value, or a function of the row) keeps some rows; ``rows`` (a function
  of one file's parsed JSON and its rows) replaces how a file's rows are read; ``derive`` (a function of the
  table's rows) returns the rows to show (pairs, pivots, ratios against another row); ``order`` a sort key;
  ``note`` a line under the table

A suite is a list of runs, each a dict: ``name``, ``gpus``, ``wall_s`` (seconds the run took, or is expected to
take, on the GPU machine: how ``scripts/suite.py`` packs runs into calls), ``command`` (run from the checkout's
root on the GPU machine; ``$OUT`` is the call's output folder), ``result`` (where its main file goes under
``bench/results``, i.e. ``<date>_<card>x<N>/<suite>/<file>``). A run whose result is not there yet is listed as
unmeasured in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics

GIB = 2 ** 30
UNMEASURED_DOC = "docs/benchmarks.md"
BENCHMARKS = "docs/benchmarks.md"
CACHING = "docs/caching.md"
TIMELINE = "docs/timeline.md"
PLANNER = "docs/planner.md"
QUANTIZATION = "docs/quantization.md"


# -- how a row reads -----------------------------------------------------------------------------------------------
def who(r: dict) -> str:
    """Whose code a bench row ran: diffusers as it is, ditmesh, or a peer."""
    m = r.get("method", "")
    if m == "single":
        return "ditmesh" if r.get("graph") else "diffusers"
    return {"diffusers": "diffusers", "xdit": "xDiT", "torchao": "diffusers + torchao"}.get(m.split("-")[0], "ditmesh")


def layout(r: dict) -> str:
    """A bench row's degrees: ``1 GPU``, ``ulysses 4``, ``ring 2 × ulysses 2``, ``pp 4``, ``displaced 4``."""
    m = r.get("method", "")
    if m == "single":
        return "1 GPU"
    if m in ("pp", "displaced"):
        return f"{m} {r.get('gpus')}"
    degrees = {k: v for k, v in (r.get("degrees") or {}).items() if v and v > 1}
    if not degrees:
        return f"{m.split('-', 1)[-1] if who(r) != 'ditmesh' else m} {r.get('gpus')}"
    return " × ".join(f"{k} {v}" for k, v in degrees.items())


def mode(r: dict) -> str:
    return ("compiled" if r.get("compiled") else "eager") + (" + graph" if r.get("graph") else "")


def label(r: dict) -> str:
    return f"{who(r)} {layout(r)}"


def note(r: dict) -> str:
    """What else a row says: its error, its cache's skipped steps."""
    if r.get("error"):
        return f"fails: {r['error'][:160]}"
    if r.get("cache"):
        return f"cache {r['cache']}, {r.get('cache_skipped', 0)} timed steps cached"
    return ""


def dotted(d: dict, path: str, default=0):
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def split(r: dict, keys: tuple[str, ...]) -> str | None:
    """Profiled fields (of ``breakdown``, else of the row) as one ``a / b / c`` cell (ms)."""
    b = r.get("breakdown") or r
    if b.get(keys[0]) is None:
        return None
    return " / ".join(f"{dotted(b, k):.1f}" for k in keys)


def fp8_linear_variant(r: dict) -> str:
    """An fp8-linear row's name: diffusers' rows, the torchao recipe, ditmesh bf16, or ditmesh fp8 with its backend
    and switches as the row's call ran them."""
    if r["method"] == "torchao-fp8":
        return "diffusers + torchao fp8 (the recipe without FA3)"
    if not r.get("graph"):
        return "diffusers compiled" if r.get("compiled") else "diffusers eager"
    if not r.get("quant"):
        return "ditmesh bf16"
    name = r["_file"].rsplit("/", 1)[1]
    extra = {"flux-fp8-linears.json": "scaled-mm, no fast accumulation", "flux-fp8-fused.json":
             "scaled-mm, no fast accumulation, fused Q/K/V", "flux-final.json": "auto (bug: bf16 products)",
             "flux-fp8-default.json": "auto = scaled-mm, fast accumulation (today's default)",
             "flux-fp8-tuned.json": "scaled-mm, coordinate-descent tuning (DITMESH_FP8_TUNE=1), no fast accumulation"}
    return f"ditmesh --quant fp8: {extra.get(name, r.get('quant_backend', 'auto'))}"


#: an fp8-linear row's step, memory, first call and the profiler's kernel groups
FP8_STEP = [("step ms", "step_ms", ".1f"), ("peak GiB", "peak_gib_per_gpu", ".2f"), ("first call s", "first_call_s", ".1f"),
            ("GEMM ms", "breakdown.kernels_ms.gemm", ".1f"), ("attention ms", "breakdown.kernels_ms.attention", ".1f"),
            ("other ms", "breakdown.kernels_ms.other", ".1f"), ("note", note)]


def model_size(r: dict) -> str:
    d = r["_doc"]
    size = f"{d['height']}×{d['width']}" + (f"×{d['frames']}" if d.get("frames") else "")
    return f"{d['model']} {size}" + (f", batch {d['batch']}" if d.get("batch", 1) > 1 else "")


STEP = [("row", label), ("GPUs", "gpus"), ("mode", mode), ("step ms", "step_ms", ".1f")]
SPEEDUPS = [("× diffusers 1 GPU", "speedup_vs_1gpu", ".2f"), ("× ditmesh 1 GPU", "speedup_vs_our_1gpu", ".2f")]
MEMORY_ERROR = [("peak GiB/GPU", "peak_gib_per_gpu", ".2f"), ("rel. err vs 1 GPU", "rel_err_vs_1gpu", ".2e")]
#: a ``ditmesh bench`` row: who, degrees, mode, median step, speedups, peak memory, error, what failed
BENCH = STEP + SPEEDUPS + MEMORY_ERROR + [("note", note)]
#: the profiler's breakdown of one step (``--profile``), ms
BREAKDOWN = [("row", label), ("GPUs", "gpus"), ("mode", mode)] + [
    (head, f"breakdown.{key}", ".1f") for head, key in (
        ("span ms", "span_ms"), ("compute ms", "compute_ms"), ("GEMM ms", "kernels_ms.gemm"),
        ("attention ms", "kernels_ms.attention"), ("other ms", "kernels_ms.other"), ("NCCL all ms", "comm_ms"),
        ("hidden ms", "comm_hidden_ms"), ("exposed ms", "comm_exposed_ms"), ("idle ms", "idle_ms"))]
PROFILED = ("compute / NCCL exposed / idle ms", lambda r: split(r, ("compute_ms", "comm_exposed_ms", "idle_ms")))


def ok(r: dict) -> bool:
    return "step_ms" in r or "error" in r


# -- ditmesh generate reports ----------------------------------------------------------------------------------
def config_name(r: dict) -> str:
    c = {k: v for k, v in (r.get("config") or {}).items() if v and v > 1}
    return " × ".join(f"{k} {v}" for k, v in c.items()) or "1 GPU"


def policy(r: dict) -> str:
    setting = ((r.get("cache") or {}).get("transformer") or {}).get("setting")
    return "uncached" if not setting or setting == "off" else f"`{setting.split(':')[0]}`"


def steps_from(r: dict, first: int) -> float | None:
    s = r.get("step_latency_s")
    return round(sum(s[first:]), 3) if s else None


def peak_gib(r: dict, key: str = "peak_memory_bytes") -> float | None:
    v = r.get(key)
    return max(v) / GIB if v else None


def cached_calls(r: dict) -> str:
    c = (r.get("cache") or {}).get("transformer")
    return f"{c['skipped']} of {c['calls']}" if c else ""


def uncached_first(r: dict):
    """Order of generate reports: by GPU count, the uncached run first, then by file."""
    return r.get("world_size", 0), policy(r) != "uncached", r["_file"]


def ratio_to_uncached(rows: list[dict]) -> list[dict]:
    """Each run's steps 2-28 and 3-28 against the uncached run of the same layout in the same table."""
    base = {(r.get("world_size"), r["_file"].rsplit("/", 2)[0]): r for r in rows if policy(r) == "uncached"}
    for r in rows:
        b = base.get((r.get("world_size"), r["_file"].rsplit("/", 2)[0]))
        if b is not None and r is not b:
            r["ratio_2"] = steps_from(r, 1) / steps_from(b, 1)
            r["ratio_3"] = steps_from(r, 2) / steps_from(b, 2)
    return rows


GENERATE_CACHE = [
    ("run", lambda r: f"{config_name(r)}, {policy(r)}"), ("cached calls", cached_calls),
    ("steps 2-28 s", lambda r: steps_from(r, 1), ".3f"), ("steps 3-28 s", lambda r: steps_from(r, 2), ".3f"),
    ("× uncached, steps 2-28", "ratio_2", ".3f"), ("× uncached, steps 3-28", "ratio_3", ".3f"),
    ("median step ms, 3-28", lambda r: 1e3 * statistics.median(r["step_latency_s"][2:]), ".1f"),
    ("peak GiB/GPU", peak_gib, ".2f")]


# -- other harnesses -------------------------------------------------------------------------------------------
def vae_case(r: dict) -> str:
    name, size = r["case"].split(" ", 1)
    return f"{'FLUX' if name == 'flux' else name.capitalize()} {size.replace('x', '×')}"


VAE = [("case", vae_case), ("mode", "mode"), ("GPUs", "gpus"), ("s", "seconds", ".3f"),
       ("peak GiB/GPU", "peak_gib", ".2f"), ("reserved GiB/GPU", "reserved_gib", ".2f"),
       ("err vs whole", "err_whole", ".2e"), ("err vs tiled", "err_tiled", ".2e"), ("err vs fp32", "err_fp32", ".2e"),
       ("status", "status")]


def serve_rows(doc: dict, rows: list[dict]) -> list[dict]:
    """``scripts/serve_bench.py``: one row per layout and client count."""
    out = []
    for lay in doc["layouts"]:
        for i, row in enumerate(lay["rows"]):
            out.append(dict(row, _file=rows[0]["_file"], _doc=doc, _layout=lay, _first=i == 0))
    return out


SERVE = [("layout", lambda r: f"`{r['_layout']['layout']}`" if r["_first"] else ""),
         ("replicas × ranks", lambda r: f"{r['_layout']['replicas']} × {r['_layout']['ranks_per_replica']}"),
         ("ready s", lambda r: r["_layout"]["ready_s"] if r["_first"] else None, ".1f"),
         ("first image s", lambda r: r["_layout"]["first_image_s"] if r["_first"] else None, ".1f"),
         ("clients", "clients"), ("ok / sent", lambda r: f"{r['ok']} / {r['sent']}"),
         ("img/s", "images_per_s", ".3f"), ("p50 s", "latency_s.p50", ".2f"), ("p99 s", "latency_s.p99", ".2f"),
         ("peak GPU GiB/rank", lambda r: r["peak_gpu_mib_per_rank"] / 1024 if r.get("peak_gpu_mib_per_rank") else None,
          ".1f")]


S5_CALLS = {"serve-512-nosettle.json": 1, "serve-batch-1024.json": 2, "serve-512.json": 3, "serve-first-512.json": 4}


def serve_size(r: dict) -> str:
    """The picture size a ``serve_bench.py`` run served (its servers' ``--height``), e.g. ``512²``."""
    args = r["_doc"]["serve_args"]
    return f"{args[args.index('--height') + 1]}²"


def lone_bound(r: dict) -> float:
    """Issue 45's bound on a lone request: 28 x the row's median step + 0.15 s."""
    return 28 * r["phases_s"]["step"] + 0.15


def lora_cell(phase: str):
    def value(r):
        ms = r.get(f"step_ms_lora_{phase}")
        return None if ms is None else f"{ms:.2f} ({r[f'lora_{phase}_overhead']:+.1%})"
    return value


LORA = [("row", label), ("GPUs", "gpus"), ("mode", mode),
        ("plain step ms (range)",
         lambda r: f"{r['step_ms']:.2f} ({min(r['step_ms_all']):.1f}-{max(r['step_ms_all']):.1f})"),
        ("LoRA unfused ms", lora_cell("unfused")), ("LoRA fused ms", lora_cell("fused")),
        ("fused + unloaded ms", lora_cell("fused_unloaded")), ("peak GiB/GPU", "peak_gib_per_gpu", ".2f"),
        ("output moved by the LoRA", "lora_change", ".1%")]


def pp_vs_xdit(rows: list[dict]) -> list[dict]:
    """ditmesh ``generate`` reports and xDiT's PipeFusion rows in one form."""
    out = []
    for r in rows:
        if "peer" in r:
            out.append(dict(r, run=f"xDiT PipeFusion {r['pp']}" + (f" × Ulysses {r['ulysses']}" if r["ulysses"] > 1
                                                                  else "") + f" ({r['patches']} patches)",
                            compiled="eager", image_s=r["seconds_per_image"], peak=r["peak_gib_per_gpu"],
                            loaded=r["loaded_gib_per_gpu"]))
            continue
        pipe = r.get("pipefusion") or {}
        name = f"ditmesh {config_name(r)}" + (f" ({pipe.get('patches')} patches)" if pipe else " (exact)")
        compiled = "compiled" if r.get("compile_breakdown_s") else "eager"
        out.append(dict(r, run=name, compiled=compiled, steps3=steps_from(r, 2),
                        image_s=28 * statistics.median(r["step_latency_s"][2:]), peak=peak_gib(r),
                        loaded=peak_gib(r, "load_peak_memory_bytes")))
    return out


def peers_ratio(rows: list[dict]) -> list[dict]:
    base = {r["gpus"]: r["steps_2_on_s"] for r in rows if r["cache"] == "off"}
    for r in rows:
        r["ratio"] = r["steps_2_on_s"] / base[r["gpus"]] if r["cache"] != "off" else None
    return rows


def step_range(r: dict) -> str:
    s = [1e3 * x for x in r["step_s"][1:]]
    return f"{statistics.median(s):.1f} ({min(s):.0f}-{max(s):.0f})"


def hooks_ab(rows: list[dict]) -> list[dict]:
    """The two trees' rows side by side, one line per configuration."""
    def key(r):
        return r["method"], r["gpus"], r.get("compiled"), r.get("graph")

    old = {key(r): r for r in rows if "old" in r["_file"]}
    return [dict(r, old_ms=old[key(r)]["step_ms"], ratio=r["step_ms"] / old[key(r)]["step_ms"])
            for r in rows if "old" not in r["_file"] and key(r) in old]


def ran(r: dict) -> bool:
    """A row the bench did not skip for its GPU count (``usp`` on 2 GPUs)."""
    return "needs another GPU count" not in (r.get("error") or "")


def ours(r: dict) -> bool:
    return who(r) == "ditmesh"


#: a row of ``scripts/overlap_bench.py`` (the variant study): its variant, step, and profiled step
OVERLAP = [("variant", "variant"), ("GPUs", "gpus"), ("step ms", "step_ms", ".2f"),
           ("profiled: compute / attention / NCCL all / hidden / exposed / idle ms",
            lambda r: split(r, ("compute_ms", "kernels_ms.attention", "comm_ms", "comm_hidden_ms", "comm_exposed_ms",
                                "idle_ms"))),
           ("rel. err vs 1 GPU", "rel_err", ".2e"), ("peak GiB/GPU", "peak_gib", ".2f")]


# -- the planner's predictions against the bench rows (``ditmesh plan --validate ... --json``) -------------------
PLANNED = [("model", "model"), ("res", "height"), ("config", lambda r: f"{r['described']} ({r['method']} {r['gpus']})"),
           ("mode", lambda r: r["mode"] + (" + graph" if r.get("graph") else "")),
           ("predicted ms", "pred_ms", ".1f"), ("measured ms", "step_ms", ".1f"), ("latency error", "ms_err", "+.1%"),
           ("predicted GiB", "pred_gib", ".2f"), ("measured GiB", "gib", ".2f"), ("memory error", "mem_err", "+.1%"),
           ("measured in", "file")]


def planned_rows(doc: dict, rows: list[dict]) -> list[dict]:
    """``ditmesh plan --json``: its three best configurations, each with the workload it was planned for."""
    m, w, hw = doc["model"], doc["workload"], doc["hardware"]
    size = f"{w['width']}×{w['height']}" + (f"×{w['frames']}" if w["frames"] > 1 else "")
    return [dict(model=m["model"], size=size, cfg="on" if w["cfg"] else "off", rank=i + 1, config=c["config"],
                 mode=w["mode"] + (" + graph" if w["cuda_graph"] else ""), step_ms=c["step_ms"],
                 speedup=c["speedup"], gib=c["memory_gib"]["total"], comm_mb=c["comm_bytes"]["total"] / 1e6,
                 hardware=f"{hw['gpus']}× {hw['device']} ({hw['link']})", baseline_ms=doc["baseline_step_ms"],
                 _file=rows[0]["_file"], _doc=doc)
            for i, c in enumerate(doc["configs"][:3])]


PREDICTED = [("model", "model"), ("size", "size"), ("CFG", "cfg"), ("#", "rank"), ("layout", "config"),
             ("mode", "mode"), ("predicted step ms", "step_ms", ".1f"), ("1-GPU step ms", "baseline_ms", ".1f"),
             ("predicted speed-up", "speedup", ".2f"), ("GiB/GPU", "gib", ".1f"), ("MB sent/GPU/step", "comm_mb", ".0f"),
             ("hardware", "hardware")]


STARTUP_ROWS = (("one import (`import torch, diffusers; from diffusers import FluxPipeline`)", "one_import_s", ""),
                ("ditmesh's own modules in `import ditmesh.cli` (-X importtime, self)", "cli_import_ditmesh_s", "<= 0.3"),
                ("ditmesh's own modules in a tiny generate (-X importtime, self)", "generate_import_ditmesh_s",
                 "<= 0.3"),
                ("`ditmesh synth --list`", "synth_list_s", "<= 2"),
                ("2-step tiny `generate`, 1 process", "generate_2step_s", "<= 1.5 x one import + 2"),
                ("1.5 x one import + 2", "generate_target_s", ""),
                ("`ditmesh plan --model flux-dev --gpus 4`, cold trace cache", "plan_cold_s", "<= 10"))


def startup_rows(doc: dict, rows: list[dict]) -> list[dict]:
    """``scripts/startup_bench.py``: one row per measurement, a column per tree."""
    trees = list(doc["rows"])
    return [dict(what=what, target=target, _file=rows[0]["_file"], _doc=doc,
                 **{f"t{i}": doc["rows"][tree].get(key, "not measured") for i, tree in enumerate(trees)}) for what, key, target in STARTUP_ROWS]


STARTUP = [("seconds (median of 3, 2 CPUs under load)", "what"), ("baseline 42e3be5", "t0", ".2f"),
           ("this tree", "t1", ".2f"), ("target", "target")]

#: ``scripts/launch_bench.py``: the same command with its ranks forked from one import or each its own interpreter
LAUNCH = [("case", "case"),
          ("ranks", lambda r: {"fork": "forked (default)", "exec": "own interpreter (DITMESH_LAUNCH=exec)"}[r["way"]]),
          ("wall s", "wall_s", ".2f"), ("CPU s (all its processes)", "cpu_s", ".1f")]


def generate_rows(rows: list[dict]) -> list[dict]:
    """``launch.json``'s ``generate`` rows (its ``serve`` rows measured a service whose ranks a fork server forked,
    which ditmesh's service does not do: it spawns them)."""
    return [r for r in rows if r["case"].startswith("generate")]


#: ``scripts/serve_bench.py`` rows of the baseline tree (serve-old.json) and this one, with the requests' phases
SERVE_OLD_NEW = [("tree", lambda r: ("baseline 42e3be5" if "serve-old" in r["_file"] else "new")
                  if r["_first"] else "")] + SERVE + [
    ("steps s", "phases_s.steps", ".2f"), ("text encode s", "phases_s.text_encode", ".3f"),
    ("VAE s", "phases_s.vae_decode", ".3f"), ("PNG s", "phases_s.encode", ".3f")]

E2E = [("row", "row"), ("GPUs", "nproc"), ("wall s", "wall_s", ".1f"), ("load s", "load_s", ".1f"),
       ("first step's extra s", "first_step_extra_s", ".1f"), ("28 × steady step s", "steps_s", ".2f"),
       ("overhead s", "overhead_s", ".1f"), ("one import s", "_doc.one_import_s", ".1f"),
       ("launcher s", "split_s.launch", ".1f"), ("rank imports s", "split_s.imports", ".1f"),
       ("rendezvous s", "split_s.rendezvous", ".1f"),
       ("text encoding s", "split_s.text_encoding", ".2f"), ("VAE s", "split_s.vae_decode", ".2f"),
       ("writing s", "split_s.writing", ".2f"), ("dynamo s", "compile_breakdown_s.dynamo", ".1f")]


def summary_rows(doc: dict, rows: list[dict]) -> list[dict]:
    """``plan --validate --json``'s summary: one row per group of rows."""
    return [dict(v, group=k, _file=rows[0]["_file"], _doc=doc) for k, v in doc["summary"].items()]


SUMMARY = [("rows", "group"), ("n", "n"), ("Spearman (latency)", "spearman", ".3f"),
           ("max memory error", "max_abs_mem_err", ".1%"), ("mean latency error", "mean_abs_ms_err", ".1%")]


# -- the tiny pipeline on CPU (``ditmesh eval-tiny --json``) ---------------------------------------------------------
QUALITY = [("cache", lambda r: f"`{r['cache']}`"), ("evaluations per image", "evaluations", ".2f"),
           ("colour", "colour", ".3f"), ("shape", "shape", ".3f"), ("position", "position", ".3f"),
           ("all three", "all", ".3f"), ("images that lost an attribute", "lost"), ("PSNR dB", "psnr", ".2f"),
           ("SSIM", "ssim", ".4f")]


def accuracy_row(doc: dict, rows: list[dict]) -> list[dict]:
    """``eval-tiny --json``'s accuracies as one row."""
    return [dict(doc["accuracy"], n=doc["n"], steps=doc["steps"], _file=rows[0]["_file"], _doc=doc)]


EVAL = [("run", lambda r: r["_file"].rsplit("/", 1)[1][5:-5]), ("images", "n"), ("steps", "steps"),
        ("colour", "colour", ".1%"), ("shape", "shape", ".1%"), ("position", "position", ".1%"),
        ("all three", "all", ".1%")]


def eight_mode(r: dict) -> str:
    """An ``eval-tiny --quant-sweep`` / ``--eight-sweep`` row's mode: block linears, payloads, attention."""
    if "comm" not in r:  # a --quant-sweep row
        return "exact (model dtype)" if r["quant"] == "off" else f"`--quant {r['quant']}`"
    parts = [f"comm {r['comm']}"] if r.get("comm", "auto") != "auto" else []
    if r.get("attention", "exact") not in ("exact", "default"):
        steps = r.get("exact_steps") or 0
        parts.append(f"attention {r['attention']}" + (f", first and last {steps} steps exact" if steps else ""))
    if r.get("quant", "off") != "off":
        parts.append(f"linears {r['quant']}")
    return ", ".join(parts) or "exact (model dtype)"


#: ``eval-tiny --quant-sweep`` / ``--eight-sweep``: each mode's images against the exact images of the same captions
EIGHT_QUALITY = [("mode", eight_mode), ("images that lost an attribute", "lost"),
                 ("PSNR dB", lambda r: r["psnr"] if r["psnr"] != float("inf") else "(reference)", ".2f"),
                 ("SSIM", "ssim", ".4f"),
                 ("captions × images", lambda r: f"{r['_doc']['captions']} × {r['_doc']['images'] // r['_doc']['captions']}")]


# -- the tables ------------------------------------------------------------------------------------------------
H200X4 = "2026-11-26_h200x4"
H100X4 = "2026-11-26_h100x4"
H100X4B = "2026-11-27_h100x4"
H100X2 = "2026-11-26_h100x2"
H200X2 = "2026-11-26_h200x2"
CPU = "2026-11-28_cpu"
CPU_QUALITY = "2026-11-29_cpu"
#: rows measured with every 8-bit mode quantizing the modulation linears: their variants as the flags that run them now
WEIGHT_ONLY_THEN = {"fp8-weight": "fp8-weight:quant-modulation"}
LAB_OVERLAP = "docs/lab/ulysses-overlap.md"

TABLES = [
    dict(name="hooks-ab", doc=BENCHMARKS, files=[f"{H100X4}/ab-hooks-{{old-63b13c1,new}}.json"], derive=hooks_ab,
         columns=[("row", label), ("GPUs", "gpus"), ("mode", mode), ("63b13c1 ms", "old_ms", ".2f"),
                  ("hook registry ms", "step_ms", ".2f"), ("ratio", "ratio", ".3f"),
                  ("rel. err vs 1 GPU", "rel_err_vs_1gpu", ".2e")]),
    dict(name="ttfi", doc=BENCHMARKS, files=[f"{H100X4}/ttfi/run{{1,2}}-new-{{1,4}}-{{cold,warm}}.json"],
         columns=[("run", lambda r: r["_file"].rsplit("/", 1)[1][:-5]), ("GPUs", "world_size"),
                  ("load s", "load_s", ".1f"), ("first step s", "step_latency_s.0", ".2f"),
                  ("first-step extra s", "first_step_extra_s", ".2f"),
                  ("median step ms", lambda r: 1e3 * statistics.median(r["step_latency_s"][1:]), ".1f"),
                  ("dynamo / of it tracing / backend / graph capture s",
                   lambda r: " / ".join(f"{v:.2f}" for v in r["compile_breakdown_s"].values())
                   if r.get("compile_breakdown_s") else None)]),
    dict(name="cache-p2", doc=BENCHMARKS, files=[f"{H100X2}/cache/p2-{{off,default}}.json"],
         derive=ratio_to_uncached, order=uncached_first, columns=GENERATE_CACHE),
    dict(name="cache-every-policy", doc=BENCHMARKS, files=[f"{H100X4B}/cache/g{{1,4}}-{{off,static,default,fb}}.json"],
         derive=ratio_to_uncached, order=uncached_first, columns=GENERATE_CACHE),
    dict(name="cache-peers", doc=BENCHMARKS, files=[f"{H100X4B}/cache/peers.jsonl"], derive=peers_ratio,
         columns=[("diffusers hook", "cache"), ("GPUs", "gpus"), ("steps 2-28 s", "steps_2_on_s", ".3f"),
                  ("× its uncached", "ratio", ".3f"), ("computed steps", "last_attention_computed"),
                  ("step ms, steps 2-28 (median, range)", step_range)]),
    dict(name="flux-1024-graph", doc=BENCHMARKS, files=[f"{H200X4}/flux-dev-1024-graph-gpus124.json"], columns=BENCH),
    dict(name="flux-1024-graph-breakdown", doc=BENCHMARKS, files=[f"{H200X4}/flux-dev-1024-graph-gpus124.json"],
         where=lambda r: "breakdown" in r, columns=BREAKDOWN),
    dict(name="flux-1024-graph-rerun", doc=BENCHMARKS, files=[f"{H200X4}/flux-dev-1024-graph-gpus14.json"],
         columns=BENCH[:5] + [PROFILED]),
    dict(name="flux-2048-graph", doc=BENCHMARKS, files=[f"{H200X4}/flux-dev-2048-graph-gpus14.json"],
         columns=STEP + SPEEDUPS + [MEMORY_ERROR[1], PROFILED]),
    dict(name="flux-eager-methods", doc=BENCHMARKS,
         files=[f"{H200X4}/flux-dev-1024-eager-methods.json", f"{H200X4}/flux-dev-2048-eager-methods.json"], where=ran,
         columns=[("size", lambda r: f"{r['_doc']['height']}²")] + BENCH[:5] + MEMORY_ERROR + [("note", note)]),
    dict(name="tp-generate", doc=BENCHMARKS, files=[f"{H200X4}/flux-dev-1024-tp-generate.json"],
         columns=[("config", config_name), ("processes", "nproc"), ("median step ms", "median_step_ms", ".1f"),
                  ("peak GiB/GPU, whole pipeline", lambda r: max(r["peak_gib_per_gpu"]), ".2f"),
                  ("peak GiB/GPU after loading", lambda r: max(r["load_peak_gib_per_gpu"]), ".2f")]),
    dict(name="sd35-cfg", doc=BENCHMARKS, files=[f"{H200X4}/sd3.5-large-1024-cfg-eager.json"],
         columns=BENCH[:5] + MEMORY_ERROR),
    dict(name="wan-compiled", doc=BENCHMARKS, files=[f"{H200X4}/wan2.1-14b-480x832x81-compiled.json"],
         columns=STEP + [SPEEDUPS[0], MEMORY_ERROR[1], PROFILED,
                         ("other kernels ms", "breakdown.kernels_ms.other", ".1f")]),
    dict(name="wan-eager", doc=BENCHMARKS, files=[f"{H200X4}/wan2.1-14b-480x832x81-eager.json"],
         columns=BREAKDOWN[:3] + [("step ms", "step_ms", ".1f"), SPEEDUPS[0]] + BREAKDOWN[4:]),
    dict(name="transport-symm", doc=BENCHMARKS, files=[f"{H200X2}/overlap-flux-dev-1024-x2-symm.json"],
         columns=[("variant", "variant"), ("GPUs", "gpus"), ("step ms", "step_ms", ".1f"),
                  ("rel. err vs 1 GPU (eager)", "rel_err", ".2e"), ("peak GiB/GPU", "peak_gib", ".2f")],
         note="Variants: `c1`/`c2` one or two head groups; `graph` compiled with CUDA graphs, `eager` without "
              "compiling; `symm` copy engines, else NCCL; `nofuse` separate Q/K/V projections."),
    dict(name="vae-x2", doc=BENCHMARKS, files=[f"{H100X2}/vae-queries/vae-{{2048,4096}}.json"], columns=VAE),
    dict(name="vae-x4", doc=BENCHMARKS,
         files=[f"{H100X4B}/lora-serve-vae/vae4-4096-pieces.json", f"{H100X4B}/lora-serve-vae/vae4-8192-pieces.json"],
         derive=lambda rows: [r for i, r in enumerate(rows) if r not in rows[:i]], columns=VAE),
    dict(name="pp-qwen-x2", doc=BENCHMARKS,
         files=[f"{H100X2}/families-pp-vae/pp-flux-1024.json", f"{H100X2}/families-pp-vae/qwenimage-1328.json"],
         columns=[("model, size", model_size)] + STEP + [SPEEDUPS[0]] + MEMORY_ERROR + [("note", note)]),
    dict(name="pp-vs-xdit", doc=BENCHMARKS,
         files=[f"{H100X4B}/pp/pp4-1024.json", f"{H100X4B}/pp/u4e-1024.json", f"{H100X4B}/pp/xdit-pp4-u1-1024.json",
                f"{H100X4B}/pp/xdit-pp2-u2-1024.json"], derive=pp_vs_xdit,
         columns=[("run", "run"), ("mode", "compiled"), ("steps 3-28 s", "steps3", ".3f"),
                  ("image s, warm (xDiT: after a warm-up image; ditmesh: 28 × median step)", "image_s", ".3f"),
                  ("peak GiB/GPU", "peak", ".2f"),
                  ("GiB/GPU after loading", "loaded", ".2f")]),
    dict(name="pp4-bench", doc=BENCHMARKS, files=[f"{H100X4B}/pp/pp4-bench-1024.json"], columns=BENCH),
    dict(name="displaced-video-x2", doc=BENCHMARKS,
         files=[f"{H100X2}/displaced/displaced-1024.json",
                f"{H100X2}/video/{{cogvideox,hyv,ltx,mochi,skyreels}}.json"],
         columns=[("model, size", model_size)] + STEP + [SPEEDUPS[0]] + MEMORY_ERROR + [PROFILED, ("note", note)]),
    dict(name="serve", doc=BENCHMARKS,
         files=[f"{H100X4}/lora-serve/serve.json", f"{H100X4B}/lora-serve-vae/serve-2x2.json"],
         rows=serve_rows, columns=SERVE),
    dict(name="lora", doc=BENCHMARKS,
         files=[f"{H100X4}/lora-serve/lora-flux-1024.json", f"{H100X4B}/lora-serve-vae/lora-flux-1024.json"],
         columns=LORA),
    dict(name="displaced-x4", doc=BENCHMARKS, files=[f"{H100X4B}/displaced/displaced-flux-1024.json"],
         columns=STEP + [("step ms range", lambda r: f"{min(r['step_ms_all']):.1f}-{max(r['step_ms_all']):.1f}"),
                         SPEEDUPS[1], MEMORY_ERROR[0],
                         ("profiled: span / compute / hidden / exposed / idle ms",
                          lambda r: split(r, ("span_ms", "compute_ms", "comm_hidden_ms", "comm_exposed_ms",
                                              "idle_ms")))]),
    # docs/caching.md
    dict(name="caching-p2", doc=CACHING, files=[f"{H100X2}/cache/p2-{{off,default}}.json"],
         derive=ratio_to_uncached, order=uncached_first, columns=GENERATE_CACHE),
    dict(name="caching-decision-x2", doc=CACHING, files=[f"{H100X2}/cache-decision/bench-{{off,dbcache}}.json"],
         where=ours,
         columns=[("cache", lambda r: r.get("cache") or "off")] + STEP + [
             ("profiled: span / compute / exposed / idle ms",
              lambda r: split(r, ("span_ms", "compute_ms", "comm_exposed_ms", "idle_ms")))]),
    dict(name="caching-decision-x4", doc=CACHING, files=[f"{H100X4}/cache3/bench4-{{off,dbcache}}.json"],
         columns=[("cache", lambda r: r.get("cache") or "off")] + STEP + [
             ("profiled: span / compute / exposed / idle ms",
              lambda r: split(r, ("span_ms", "compute_ms", "comm_exposed_ms", "idle_ms")))]),
    dict(name="caching-every-policy", doc=CACHING,
         files=[f"{H100X4B}/cache/g{{1,4}}-{{off,static,default,fb}}.json"], derive=ratio_to_uncached,
         columns=GENERATE_CACHE),
    dict(name="caching-wan", doc=CACHING, files=[f"{H100X4}/cache3/w4-{{off,default}}.json"],
         derive=ratio_to_uncached, order=uncached_first, columns=GENERATE_CACHE),
    dict(name="caching-peers", doc=CACHING, files=[f"{H100X4B}/cache/peers.jsonl"], derive=peers_ratio,
         columns=[("diffusers hook", "cache"), ("GPUs", "gpus"), ("steps 2-28 s", "steps_2_on_s", ".3f"),
                  ("× its uncached", "ratio", ".3f"), ("computed steps", "last_attention_computed"),
                  ("step ms, steps 2-28 (median, range)", step_range)]),
    # docs/planner.md
    dict(name="planner-h200x4", doc=PLANNER, files=[f"{H200X4}/planner/validate.json"], columns=PLANNED),
    dict(name="startup-cpu", doc=TIMELINE, files=["2026-11-28_cpu2/startup.json"], rows=startup_rows,
         columns=STARTUP),
    dict(name="launch-cpu2", doc=TIMELINE, files=["2026-11-29_cpu2/launch.json"], derive=generate_rows,
         columns=LAUNCH, note="the machine otherwise idle; medians of 3"),
    dict(name="launch-h200x1", doc=TIMELINE, files=["2026-11-29_h200x1/launch/launch.json"], derive=generate_rows,
         columns=LAUNCH, note="a fresh machine; medians of 3; the CPU rows with CUDA_VISIBLE_DEVICES empty, on the "
                              "host's 16 cores"),
    dict(name="e2e-h200x2", doc=TIMELINE, files=["2026-11-28_h200x2b/e2e.json"], columns=E2E,
         note="old = the baseline tree 42e3be5, new = this tree; warm compile caches (the rows' warm-ups ran first, "
              "all at once); rows the call's deadline skipped: new:1gpu:warm, new:pp:warm, new:displaced:warm"),
    dict(name="serve-h200x2", doc=TIMELINE,
         files=["2026-11-28_h200x2b/serve-old.json", "2026-11-28_h200x2b/serve-new.json",
                "2026-11-28_h200x2b/serve-4x1.json"], rows=serve_rows,
         columns=SERVE_OLD_NEW,
         note="one request a client; the 2 × 1 layout's 16 clients were cut by the call's deadline (12 of 32 "
              "answered) and its --max-batch 4 row did not start"),
    dict(name="serve-batching-cpu", doc="docs/serve.md",
         files=["2026-12-02_cpu/serve/batching-tiny.json", "2026-12-02_cpu/serve/batching-tiny-2.json"],
         rows=serve_rows, columns=[("run", lambda r: 2 if r["_file"].endswith("-2.json") else 1)] + SERVE[:3]
         + [SERVE[3]] + SERVE[4:9],
         note="one CPU process, flux-tiny (synthetic checkpoint) at 64², 2 steps, 4 requests a client; the machine "
              "otherwise idle; run 2 started the layouts in the other order"),
    dict(name="serve-batching-cpu-idle", doc="docs/serve.md",
         files=["2026-12-02_cpu/serve/batching-idle.json", "2026-12-02_cpu/serve/batching-idle-2.json"],
         rows=serve_rows, columns=[("run", lambda r: 2 if r["_file"].endswith("-2.json") else 1)] + SERVE[:4]
         + [("batching measured s", lambda r: r["_layout"].get("batching_measured_s") if r["_first"] else None, ".1f"),
            ("batch used", lambda r: (r["_layout"]["batching"][0]["use"] if r["_layout"].get("batching") else "")
             if r["_first"] else "")] + SERVE[4:9],
         note="one CPU process, flux-tiny (synthetic checkpoint) at 64², 2 steps, 4 requests a client, the machine "
              "otherwise idle; `--batching auto` measuring once the service is idle after the first picture (the "
              "bench waits for it before the load phases: `batching measured`, seconds after launch); run 2 started "
              "the layouts in the other order"),
    dict(name="e2e-h200x1-i45", doc=TIMELINE, files=["2026-12-02_h200x1/service/e2e/e2e.json"],
         columns=E2E + [("bytecode tracing s", "compile_breakdown_s.bytecode_tracing", ".2f"),
                        ("backend s", "compile_breakdown_s.backend", ".2f"),
                        ("capture s", "compile_breakdown_s.cuda_graph_capture", ".2f")],
         note="the synthetic architecture by name (`--model flux-dev`: random weights built in the rank, no "
              "checkpoint read); warm compile caches (a 3-step warm-up run first); one import timed in the same call"),
    dict(name="serve-lone-h200x1", doc=TIMELINE, files=["2026-12-02_h200x1/service/serve-lone-1024.json"],
         rows=serve_rows,
         columns=SERVE + [(head, f"phases_s.{key}", ".3f") for head, key in (
             ("steps s", "steps"), ("step s", "step"), ("text encode s", "text_encode"), ("prepare s", "prepare"),
             ("VAE s", "vae_decode"), ("postprocess s", "postprocess"), ("hand-off s", "handoff"), ("PNG s", "encode"),
             ("way in s", "http_in"), ("way out s", "http_out"))]
         + [("bound s", lone_bound, ".3f")],
         note="a lone client, 4 requests one after the other (the phases' means over them; `step` is each request's "
              "median later step); `bound` = 28 × the step + 0.15 s (issue 45); the server compiled cold (its compile cache was not the "
              "e2e rows'), so `ready` and `first image` include a cold compile"),
    dict(name="serve-lone-h200x1-s3", doc=TIMELINE, files=["2026-12-02_h200x1/service-s3/serve-lone-1024.json"],
         rows=serve_rows,
         columns=[SERVE[0], ("answer", "answer")] + SERVE[2:4] + [SERVE[6], SERVE[7]]
         + [(head, f"phases_s.{key}", ".3f") for head, key in (
             ("steps s", "steps"), ("step s", "step"), ("slowest step s", "step_max"), ("text encode s", "text_encode"),
             ("prepare s", "prepare"), ("VAE s", "vae_decode"), ("postprocess s", "postprocess"),
             ("hand-off s", "handoff"), ("PNG s", "encode"), ("way out s", "http_out"))]
         + [("bound s", lone_bound, ".3f"), ("within", lambda r: "yes" if r["latency_s"]["p50"] <= lone_bound(r) else "no")],
         note="one client, 2 requests a row one after the other (the phases' means, on the GPU's clock: CUDA events, no "
              "synchronization inside the call); each server answered as JSON (base64 inside) and as the PNG file "
              "(`Accept: image/png`); `bound` = 28 × the step + 0.15 s (issue 45); the first server compiled cold, the "
              "others read its compile cache; the compiled VAE's picture differs from the eager VAE's (not bit-exact), "
              "the other two servers' first pictures are the same bytes"),
    dict(name="serve-batching-h200x1", doc="docs/serve.md",
         files=["2026-12-02_h200x1/service-s3/serve-512.json", "2026-12-02_h200x1/service-s3/serve-batch-1024.json"],
         rows=serve_rows,
         columns=[("size", lambda r: "{0}²".format(r["_doc"]["serve_args"][r["_doc"]["serve_args"].index("--height") + 1])
                   if r["_first"] else "")] + SERVE,
         note="one H200, FLUX.1-dev architecture (random weights built in the rank), 28 steps, compiled with CUDA graphs, "
              "one request a client; the replica with `--max-batch 4` (`--batching auto`) batched at 512² (start-up "
              "measurement, a whole call's seconds a picture by batch size 1-4: 1.25, 1.15, 1.12, 1.10) and left "
              "batching off at 1024² (3.99, 4.01, 3.93, 3.91: no size 5% cheaper); 512² and 1024² ran in two calls on "
              "one machine"),
    dict(name="serve-batching-h200x1-s5", doc="docs/serve.md",
         files=["2026-12-02_h200x1/service-s5/serve-512-nosettle.json", "2026-12-02_h200x1/service-s5/serve-512.json",
                "2026-12-02_h200x1/service-s5/serve-batch-1024.json"],
         rows=serve_rows,
         columns=[("call", lambda r: S5_CALLS[r["_file"].rsplit("/", 1)[-1]] if r["_first"] else ""),
                  ("size", lambda r: serve_size(r) if r["_first"] else "")] + SERVE[:4]
         + [("batch used", lambda r: r["_layout"]["batching"][0]["use"] if r["_first"] and r["_layout"].get("batching")
             else "")] + SERVE[4:10],
         note="one H200, FLUX.1-dev architecture (random weights built in the rank), 28 steps, compiled with CUDA "
              "graphs, one request a client; `--max-batch 4` with `--batching auto`: measured once the service is "
              "idle after the first picture (the bench waits for it before the load phases), `batch used` is what "
              "the measurement chose (1: batching off); in each call the first server compiled cold and the others "
              "read its compile cache; calls 2-4 started each server on a quiet host (`--settle 30`: under 1% "
              "busy at every start)"),
    dict(name="serve-first-h200x1-s5", doc="docs/serve.md",
         files=["2026-12-02_h200x1/service-s5/serve-512-nosettle.json", "2026-12-02_h200x1/service-s5/serve-512.json",
                "2026-12-02_h200x1/service-s5/serve-first-512.json",
                "2026-12-02_h200x1/service-s5/serve-batch-1024.json"],
         rows=lambda doc, rows: [dict(lay, _file=rows[0]["_file"], _doc=doc, _order=i)
                                 for i, lay in enumerate(doc["layouts"]) if i > 0],
         columns=[("call", lambda r: S5_CALLS[r["_file"].rsplit("/", 1)[-1]]), ("size", serve_size),
                  ("server", lambda r: r["_order"] + 1), ("layout", lambda r: f"`{r['layout']}`"),
                  ("ready s", "ready_s", ".1f"), ("first image s", "first_image_s", ".1f"),
                  ("load s", lambda r: r["load_s"][0][0], ".1f"),
                  ("warm-up s", lambda r: list(r["warm_s"][0].values())[0], ".1f")],
         note="each call's servers after its first (which compiled cold), in the order they ran; `load` and "
              "`warm-up`: the rank's loading and its warm-up call before it says it is ready; the rest of `ready` "
              "is the front end's checks and the rank's start (imports), the same code with and without "
              "`--max-batch` under `--batching auto`"),
    dict(name="e2e-h200x4", doc=TIMELINE, files=["2026-11-28_h200x4/e2e.json"], columns=E2E,
         note="old = the baseline tree 42e3be5, new = this tree; warm compile caches (the rows' warm-ups ran first, "
              "all at once); the row the call's deadline skipped: new:pp:warm (its warm-up took 116 s)"),
    dict(name="serve-h200x4", doc=TIMELINE,
         files=["2026-11-28_h200x4/serve-old.json", "2026-11-28_h200x4/serve-new.json",
                "2026-11-28_h200x4/serve-4x1.json"], rows=serve_rows,
         columns=SERVE_OLD_NEW,
         note="one request a client (two in the 4 × 1 row, cut by the call's deadline: 17 of 32 answered; its "
              "--max-batch 4 row did not start); both trees on the compile cache the generate rows filled"),
    dict(name="quant-flux-h200x4", doc="docs/quantization.md", files=["2026-11-28_h200x4/quant/quant-flux-x4.json"],
         columns=[("variant", lambda r: r.get("quant", "bf16"))] + BENCH[1:4] + MEMORY_ERROR[:1] + [("note", note)],
         note="no diffusers row in this section (`--no-single`): the error of a parallel row against one process is "
              "what the CPU tests check"),
    dict(name="quant-wan-h200x4", doc="docs/quantization.md", files=["2026-11-28_h200x4/quant/quant-wan.json"],
         columns=[("variant", lambda r: ", ".join(f"{k} {r[k]}" for k in ("quant", "attention") if r.get(k))
                   or ("diffusers" if r["method"] == "single" else "bf16"))] + BENCH[1:5] + MEMORY_ERROR,
         note="eager (no compile, no CUDA graphs), 2 timed steps after 1 warm-up; rel. err is one step against "
              "diffusers' 1-GPU bf16 output"),
    dict(name="quant-checkpoint-h200x4", doc="docs/quantization.md",
         files=["2026-11-28_h200x4/quant/quant-checkpoint.json"],
         columns=[("quantize s", lambda r: r["commands"][0]["wall_s"]),
                  ("generate s (from outside)", lambda r: r["commands"][1]["wall_s"]),
                  ("load peak GiB", lambda r: r["load_peak_gib"][0]), ("run peak GiB", lambda r: r["peak_gib"][0]),
                  ("step ms", "step_ms", ".1f"), ("device", lambda r: r["devices"][0])],
         note="`ditmesh quantize --model flux-dev --out /tmp/flux-dev-fp8 --quant fp8`, then `ditmesh generate "
              "--model /tmp/flux-dev-fp8 --height 1024 --width 1024 --steps 8` on one GPU, eager"),
    dict(name="quant-flux-h200x2", doc="docs/quantization.md", files=["2026-11-28_h200x2/quant/quant-flux-1gpu.json"],
         columns=[("variant", lambda r: WEIGHT_ONLY_THEN.get(r.get("quant"), r.get("quant", "bf16")) if r.get("graph")
                   else ("diffusers eager" if not r.get("compiled") else "diffusers compiled"))]
         + BENCH[1:5] + MEMORY_ERROR + [("28 steps s", "e2e_28_steps_s", ".2f")],
         note="every 8-bit row with the modulation linears quantized (the fp8-weight row ran what "
              "`--quant fp8-weight:quant-modulation` runs; `fp8-weight` alone keeps them in bf16); the call's other "
              "sections (ulysses 2 with fp8 payloads, Wan2.1-14B, the modulation kept in bf16) were skipped at its "
              "deadline; rel. err is one step against diffusers' eager bf16 output"),
    dict(name="quant-modulation-h200x1", doc="docs/quantization.md",
         files=["2026-11-29_h200x1/quant-modulation/quant-modulation-1gpu.json"],
         columns=[("variant", lambda r: r.get("quant", "bf16") if r.get("graph") else
                   ("diffusers eager" if not r.get("compiled") else "diffusers compiled"))]
         + BENCH[1:5] + MEMORY_ERROR + [("note", note)],
         note="a fresh machine, compile caches cold: the rows stopped at the 150 s row limit were compiling (the rank "
              "waiting on inductor's compile workers, or running); rel. err is one step against diffusers' eager bf16 "
              "output"),
    dict(name="attention8-kernels-h200x1", doc="docs/quantization.md",
         files=["2026-12-02_h200x1/attention8.json"], where=lambda r: "ms" in r,
         columns=[("shape", "shape"), ("kernel", "row"), ("timed", "part"), ("ms (CUDA graph)", "ms", ".3f"),
                  ("ms (eager)", "eager_ms", ".3f"), ("TFLOP/s", "tflops", ".0f"),
                  ("of bf16 peak", "of_bf16_peak", ".2f"), ("of fp8 peak", "of_fp8_peak", ".2f"),
                  ("rel. err vs float32", "rel_err", ".4f")],
         note="median of 10 after 3 warm-ups; the card's measured peaks in the same call: 765 TFLOP/s (8192³ bf16 "
              "matmul) and 1388 TFLOP/s (8192³ fp8 `torch._scaled_mm`); inputs q, v ~ N(0, 1), k ~ N(0, 1) plus a "
              "per-channel offset ~ N(0, 2²), bf16; the error is against float32 SDPA on the same bf16 values; "
              "`kernel+quantize` includes the 8-bit rounding of the inputs (compiled where it is ours)"),
    dict(name="attention8-models-h200x1", doc="docs/quantization.md",
         files=["2026-12-02_h200x1/flux-attention.json", "2026-12-02_h200x1/wan-attention.json"],
         columns=[("model", "model"), ("variant", lambda r: ("ditmesh, attention " + r.get("attention", "default"))
                                      if r.get("graph") else ("diffusers eager" if not r.get("compiled")
                                                              else "diffusers compiled")),
                  ("step ms", "step_ms", ".1f"), ("peak GiB", "peak_gib_per_gpu", ".2f"),
                  ("rel. err vs diffusers eager", "rel_err_vs_1gpu", ".2e")],
         note="FLUX.1-dev 1024² and Wan2.1-14B 480x832x81 architectures (random weights), one GPU, compiled; ditmesh "
              "rows with CUDA graphs; 3 (FLUX) and 2 (Wan) timed steps after 1 warm-up. The FLUX fp8 row ran before "
              "the fix of its recompiles (the 8-bit attention's call counter was traced as a static int, so every "
              "block recompiled until dynamo's limit and ran eager): it is not a measurement of the fp8 kernel. "
              "The Wan rows ran in a later call without diffusers' rows (`--no-diffusers`)"),
    dict(name="fp8-linears-h200x1", doc="docs/quantization.md",
         files=["2026-12-02_h200x1/fp8-linears/flux-fp8-linears.json", "2026-12-02_h200x1/fp8-linears/flux-fp8-fused.json",
                "2026-12-02_h200x1/fp8-linears/flux-final.json", "2026-12-02_h200x1/fp8-linears/flux-fp8-default.json",
                "2026-12-02_h200x1/fp8-linears/flux-fp8-tuned.json"],
         columns=[("call", lambda r: {"flux-fp8-linears.json": 1, "flux-fp8-fused.json": 1, "flux-final.json": 2}.get(
                      r["_file"].rsplit("/", 1)[1], 3)),
                  ("row", fp8_linear_variant)] + FP8_STEP,
         note="FLUX.1-dev architecture (random weights) at 1024², one GPU, compiled (regional), ditmesh rows with CUDA "
              "graphs, 3 timed steps after 1 warm-up; three consecutive calls on one machine (caches cold in call 1 "
              "and 2, warm from call 2 in call 3). `first call s` is the first call's wall time (dynamo, inductor, "
              "capture); the kernel columns are the profiler's (one step). Call 2's fp8 row ran the products in bf16 "
              "after dequantizing (a bug of that commit's `auto` backend, fixed before call 3): not a measurement of "
              "the fp8 path"),
    dict(name="fp8-s3-h200x1", doc="docs/quantization.md",
         files=["2026-12-02_h200x1/fp8-s3/flux-final.json", "2026-12-02_h200x1/fp8-s3/flux-fp8-wide-rows.json",
                "2026-12-02_h200x1/fp8-s3/wan-bf16.json", "2026-12-02_h200x1/fp8-s3/wan-fp8-wide-rows.json"],
         columns=[("call", lambda r: 2 if r["_file"].endswith("wan-fp8-wide-rows.json") else 1),
                  ("model", model_size),
                  ("row", lambda r: (fp8_linear_variant(r) if not r.get("quant") else "ditmesh --quant fp8" + (
                      " --attention fp8" if r.get("attention") == "fp8" else "")) + (
                      ", DITMESH_FP8_WIDE_ROWS=16384" if "wide-rows" in r["_file"] else ""))] + FP8_STEP,
         note="one H200 (torch 2.11.0+cu130, cuDNN 9.19): call 1 `TOTAL_S=570 PARTS=qtests,final,wide,wanq bash "
              "scripts/gpu_issue44.sh` on a cold machine, call 2 the Wan fp8 row with DITMESH_FP8_WIDE_ROWS=16384 on "
              "the same machine right after; FLUX.1-dev and Wan2.1-14B architectures (random weights), compiled "
              "(regional), ditmesh rows with CUDA graphs, FLUX 3 timed steps and Wan 2 after 1 warm-up; the kernel "
              "columns are the profiler's (one step, FLUX rows). Call 1's Wan fp8 row without the wide rows, 2,007.1 "
              "ms (16.52 GiB), is in calls.log only (its files stayed on the machine: 8 files come back a call)"),
    dict(name="ray-cpu-throughput", doc="docs/ray.md",
         files=["2026-11-28_cpu3/ray/throughput.json", "2026-11-28_cpu3/ray/throughput-8steps-128.json"],
         order=lambda r: (len(r["_doc"]["command"]), r["round"], r["nodes"]),
         columns=[("request", lambda r: "{} steps, {}²".format(r["_doc"]["serve"][1], r["_doc"]["serve"][3])),
                  ("round", "round"), ("pinned CPU nodes", "nodes"), ("one-rank replicas", "replicas"),
                  ("requests / clients", lambda r: f"{r['requests']} / {r['clients']}"), ("req/s", "req_per_s", ".2f"),
                  ("× 1 node (median)", "speedup", ".2f"), ("p50 s", "p50_s", ".2f"), ("p99 s", "p99_s", ".2f"),
                  ("served per replica", lambda r: " / ".join(map(str, r["served_per_replica"])))]),
    dict(name="gpu8-planned", doc=BENCHMARKS, files=["2026-11-28_plan-h200x8/gpu8/plan-*.json"], rows=planned_rows,
         columns=PREDICTED, note="predictions of `ditmesh plan`; the measured rows come from suite gpu8 when an "
                                 "8-GPU machine is lent"),
    dict(name="planner-h200x4-summary", doc=PLANNER, files=[f"{H200X4}/planner/validate.json"], rows=summary_rows,
         columns=SUMMARY),
    dict(name="planner-h100x2", doc=PLANNER, files=[f"{H100X2}/planner/validate-*.json"], columns=PLANNED),
    dict(name="planner-h100x4", doc=PLANNER, files=[f"{H100X4B}/planner/validate.json"], columns=PLANNED),
    # docs/lab
    dict(name="lab-overlap-graphs", doc=LAB_OVERLAP, files=[f"{H200X4}/overlap-flux-dev-1024-x4-graphs.json"],
         columns=OVERLAP),
    dict(name="lab-overlap-groups", doc=LAB_OVERLAP,
         files=[f"{H200X4}/overlap-flux-dev-1024-x4-x2.json", f"{H200X4}/overlap-flux-dev-1024-x4-nccl-p2p32.json",
                f"{H200X4}/overlap-flux-dev-2048-x4.json", f"{H200X4}/overlap-wan2.1-14b-x4.json"],
         columns=[("size", lambda r: f"{r['_doc']['model']} {r['_doc']['height']}×{r['_doc']['width']}")] + OVERLAP),
    dict(name="lab-transport", doc=LAB_OVERLAP, files=[f"{H200X2}/transport-flux-layer-x2.json"],
         columns=[("transfer", "row"), ("µs", "us", ".1f"), ("tokens per rank", "tokens"), ("tensors", "tensors")]),
    dict(name="lab-tp-style", doc="docs/lab/tensor-parallel-style.md",
         files=[f"{H200X4}/tp-style-flux-dev-blocks.json"],
         columns=[("tp", "tp"), ("style", "style"), ("mode", "mode"), ("ms per block pair", "ms", ".2f"),
                  ("rel. err vs unsharded", "rel_err", ".1e"),
                  ("peak GiB", lambda r: r["peak_memory_bytes"] / GIB if r.get("peak_memory_bytes") else None, ".2f")]),
    # docs/quantization.md: the 8-bit modes' quality on the tiny trained pipeline (CPU, the rounding emulated)
    dict(name="quant-tiny", doc=QUANTIZATION, files=[f"{CPU_QUALITY}/quant/eval-tiny-quant.json"], columns=EIGHT_QUALITY),
    dict(name="eight-tiny", doc=QUANTIZATION, files=[f"{CPU_QUALITY}/quant/eval-tiny-eight.json"], columns=EIGHT_QUALITY),
    dict(name="eight-tiny-fp8-attention", doc=QUANTIZATION, files=["2026-12-02_cpu/quant/eval-tiny-fp8-attention.json"],
         columns=EIGHT_QUALITY),
]

#: the tiny pipeline's quality on CPU (``eval-tiny --json``), from suite ``quality``: not in ``TABLES`` while its
#: results are not in bench/results; once they are, add ``TABLES += CPU_TABLES`` and put the markers in the docs
CPU_TABLES = [
    dict(name="caching-quality", doc=CACHING, files=[f"{CPU}/quality/cache-sweep.json"], columns=QUALITY),
    # docs/tiny.md
    dict(name="tiny-eval", doc="docs/tiny.md", files=[f"{CPU}/quality/eval-held-out-seed0.json"], rows=accuracy_row,
         columns=EVAL),
]

#: tables with units that stay hand-written for now, each with the reason; an entry whose table is gone is an error
#: (``scripts/tables.py --check``), so the list cannot outlive its tables
NOT_GENERATED = [
    ("docs/adding-a-model.md", "| variant | adapter lines |",
     "line counts of the adapters' source at the commit that added them, not a measurement of a run"),
    ("docs/pipefusion.md", "  | pp | patches | warm-up steps | colour |",
     "eval-tiny --pp-sweep on CPU, no result file yet"),
    ("docs/displaced.md", "  | mode | warm-up steps | colour |",
     "eval-tiny --pp-sweep (displaced) on CPU, no result file yet"),
    ("docs/vae.md", "  | FLUX VAE split over 4 gloo ranks, float32 |",
     "a CPU memory trace, no result file yet"),
]


# -- the suites: every published run, as the GPU machine runs it ---------------------------------------------------
GPU = "bash scripts/gpu.sh python3 -m ditmesh"
SYNTH_FLUX = f"test -d /tmp/flux-dev || {GPU} synth --arch flux-dev --out /tmp/flux-dev"


def bench(name: str, gpus: int, wall_s: int, args: str, result: str | None = None) -> dict:
    """A ``ditmesh bench`` run writing ``$OUT/<name>.json``."""
    return dict(name=name, gpus=gpus, wall_s=wall_s, result=result,
                command=f"{GPU} bench {args} --out $OUT/{name}.json")


def largest(name: str, gpus: int, args: str) -> dict:
    """``scripts/largest_size.py``: ascending sizes until one does not complete."""
    return dict(name=name, gpus=gpus, wall_s=540, result=None,
                command=f"bash scripts/gpu.sh python3 scripts/largest_size.py {args} --json $OUT/{name}.json")


LORA = "--lora /tmp/lora64/lora.safetensors --fuse-lora"
SUITES = {
    "flux": dict(runs=[
        bench("flux-dev-1024-graph-gpus124", 4, 420, "--model flux-dev --height 1024 --width 1024 --gpus 1,2,4 "
              "--steps 5 --warmup 2 --profile --ulysses-chunks 2", f"{H200X4}/flux-dev-1024-graph-gpus124.json"),
        bench("flux-dev-2048-graph-gpus14", 4, 420, "--model flux-dev --height 2048 --width 2048 --gpus 1,4 --steps 3 "
              "--warmup 1 --profile --ulysses-chunks 2", f"{H200X4}/flux-dev-2048-graph-gpus14.json"),
        bench("flux-dev-1024-eager-methods", 4, 480, "--model flux-dev --height 1024 --width 1024 --gpus 1,2,4 "
              "--compile off --no-cuda-graph --ulysses-chunks 1 --steps 5 --warmup 2 "
              "--methods ulysses,ring,usp,tp,tp-ulysses,diffusers-ulysses,diffusers-ring",
              f"{H200X4}/flux-dev-1024-eager-methods.json"),
        bench("flux-dev-2048-eager-methods", 4, 420, "--model flux-dev --height 2048 --width 2048 --gpus 1,4 "
              "--compile off --no-cuda-graph --ulysses-chunks 1 --steps 5 --warmup 2 "
              "--methods ulysses,usp,tp,diffusers-ulysses", f"{H200X4}/flux-dev-2048-eager-methods.json"),
        bench("sd3.5-large-1024-cfg-eager", 4, 300, "--model sd3.5-large --height 1024 --width 1024 --batch 2 "
              "--gpus 1,2,4 --compile off --no-cuda-graph --ulysses-chunks 1 --steps 5 --warmup 2 "
              "--methods cfg,ulysses",
              f"{H200X4}/sd3.5-large-1024-cfg-eager.json"),
        bench("wan2.1-14b-480x832x81-compiled", 4, 480, "--model wan2.1-14b --height 480 --width 832 --frames 81 "
              "--gpus 1,4 --steps 2 --warmup 1 --profile --ulysses-chunks 2 --no-cuda-graph "
              "--methods ulysses,diffusers-ulysses", f"{H200X4}/wan2.1-14b-480x832x81-compiled.json"),
    ]),
    "families-4gpu": dict(runs=[
        bench("flux2-1024-x4", 4, 420, "--model flux2-dev --height 1024 --width 1024 --gpus 1,4 "
              "--methods ulysses,diffusers-ulysses --compile on --steps 5 --warmup 2"),
        bench("qwenimage-1328-x4", 4, 420, "--model qwenimage --height 1328 --width 1328 --gpus 1,4 "
              "--methods ulysses,diffusers-ulysses --compile on --steps 5 --warmup 2"),
        bench("hunyuan-video-720x1280x129-x1", 1, 540, "--model hunyuan-video --height 720 --width 1280 --frames 129 "
              "--gpus 1 --methods ulysses --compile on --steps 2 --warmup 1"),
        bench("hunyuan-video-720x1280x129-x4", 4, 420, "--model hunyuan-video --height 720 --width 1280 --frames 129 "
              "--gpus 4 --methods ulysses --compile on --steps 2 --warmup 1"),
        bench("cogvideox-5b-480x720x49", 4, 360, "--model cogvideox-5b --height 480 --width 720 --frames 49 --batch 2 "
              "--gpus 1,4 --methods ulysses --compile on --steps 3 --warmup 1"),
        bench("ltx-video-480x704x161", 4, 360, "--model ltx-video --height 480 --width 704 --frames 161 --batch 2 "
              "--gpus 1,4 --compile on --methods ulysses,diffusers-ulysses"),
        bench("mochi-480x848x163", 4, 480, "--model mochi-1 --height 480 --width 848 --frames 163 --batch 2 "
              "--gpus 1,4 --methods ulysses --compile on --steps 3"),
        bench("skyreels-544x960x97", 4, 480, "--model skyreels-v2-df-14b --height 544 --width 960 --frames 97 "
              "--gpus 1,4 --methods ulysses --compile on --steps 3"),
        bench("allegro-720x1280x88", 4, 480, "--model allegro --height 720 --width 1280 --frames 88 --batch 2 "
              "--gpus 1,4 --compile on --methods ulysses --steps 2 --warmup 1"),
        bench("hidream-1024", 4, 420, "--model hidream-i1 --height 1024 --width 1024 --gpus 1,4 "
              "--methods ulysses,ring,usp,tp,tp-ulysses --compile off --no-cuda-graph --steps 3 --warmup 1"),
    ]),
    # the plain model and the fused-and-unloaded LoRA, each in its own graphed run: what can judge the +5% bound
    "lora-graphed": dict(runs=[
        dict(name=f"lora-{kind}-{lay}", gpus=4, wall_s=150, result=None,
             command=f"{SYNTH_FLUX} && (test -d /tmp/lora64 || {GPU} synth --lora 64 --model /tmp/flux-dev "
                     f"--out /tmp/lora64) && {GPU} generate --model /tmp/flux-dev --nproc 4 --{lay} 4 --height 1024 "
                     "--width 1024 --steps 28 --compile --cuda-graph" + (f" {LORA}" if kind == "fused" else "")
                     + f" --out /tmp/o/{kind}.png --report $OUT/lora-{kind}-{lay}.json")
        for lay in ("ulysses", "tp") for kind in ("plain", "fused")]),
    "pp-ulysses-wan": dict(runs=[
        bench("pp-wan-480x832x81", 4, 540, "--model wan2.1-14b --height 480 --width 832 --frames 81 --gpus 4 "
              "--no-single --methods ulysses,pp-ulysses --compile on --no-cuda-graph --steps 2 --warmup 2"),
    ]),
    # eight GPUs: the planner's top three layouts of each workload, diffusers' context parallelism and the 1-GPU row
    # of the same call, then the planner's predictions of every row (plan --validate)
    "gpu8": dict(runs=[
        bench("gpu8-flux-dev-1024", 8, 420, "--model flux-dev --height 1024 --width 1024 --gpus 1,8 "
              "--methods ulysses,tp-ulysses,tp4-ulysses,diffusers-ulysses --steps 5 --warmup 2 --profile"),
        bench("gpu8-flux-dev-2048", 8, 480, "--model flux-dev --height 2048 --width 2048 --gpus 1,8 "
              "--methods ulysses,tp-ulysses,tp4-ulysses,diffusers-ulysses --steps 3 --warmup 1 --profile"),
        bench("gpu8-wan-480x832x81", 8, 540, "--model wan2.1-14b --height 480 --width 832 --frames 81 --gpus 1,8 "
              "--methods ulysses,tp-ulysses,diffusers-ulysses --steps 2 --warmup 1"),
        bench("gpu8-wan-480x832x81-cfg", 8, 420, "--model wan2.1-14b --height 480 --width 832 --frames 81 --gpus 8 "
              "--no-single --methods cfg --no-cuda-graph --steps 2 --warmup 1"),
        bench("gpu8-qwenimage-1328", 8, 480, "--model qwenimage --height 1328 --width 1328 --gpus 1,8 "
              "--methods ulysses,tp-ulysses,diffusers-ulysses --steps 3 --warmup 1"),
        bench("gpu8-qwenimage-1328-cfg", 8, 360, "--model qwenimage --height 1328 --width 1328 --gpus 8 --no-single "
              "--methods cfg --no-cuda-graph --steps 3 --warmup 1"),
        dict(name="gpu8-validate", gpus=0, wall_s=60, result=None,
             command="python3 -m ditmesh plan --validate $OUT/gpu8-*.json --json > $OUT/gpu8-validate.json"),
    ]),
    "largest-size": dict(runs=[
        largest("largest-x1", 1, "--model /tmp/flux-dev --layout \"--nproc 1\" --layout \"--nproc 1 --chunk 4096 "
                "--vae-chunk 128\" --sides 4096,4928,5376,5888,6400"),
        largest("largest-x4", 4, "--model /tmp/flux-dev --layout \"--nproc 4 --ulysses 4\" --sides 8192,10240"),
        largest("largest-wan", 4, "--model /tmp/wan --height 480 --width 832 --frames 81,161,241 "
                "--layout \"--nproc 1\" --layout \"--nproc 4 --ulysses 4\""),
    ]),
    # the tiny trained pipeline's quality under each cache setting, on CPU (gpus 0): 2 CPU threads
    "quality": dict(runs=[
        dict(name="cache-sweep", gpus=0, wall_s=300, result=None,
             command="python3 -m ditmesh eval-tiny --cache-sweep \"taylor:interval=4,warmup=3;teacache:threshold=0.16,"
                     "poly=21367.2/-8715.08/1212.89/-67.4309/1.32937;dbcache:threshold=0.15,max_skips=2;fbcache:0.1\" "
                     "--json $OUT/cache-sweep.json"),
        dict(name="eval-held-out-seed0", gpus=0, wall_s=120, result=None,
             command="python3 -m ditmesh eval-tiny --json $OUT/eval-held-out-seed0.json"),
    ]),
}
# the largest-size runs need their synthetic folders first
for _run in SUITES["largest-size"]["runs"]:
    _setup = (f"(test -d /tmp/wan || {GPU} synth --arch wan2.1-14b --out /tmp/wan)" if "wan" in _run["name"]
              else SYNTH_FLUX)
    _run["command"] = f"{_setup} && {_run['command']}"
# a run's result, unless given: any folder of bench/results, <date>_<card>x<N>/<suite>/<name>.json
for _suite, _spec in SUITES.items():
    for _run in _spec["runs"]:
        _run["result"] = _run["result"] or f"*/{_suite}/{_run['name']}.json"
