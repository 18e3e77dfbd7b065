"""One rank of one ``ditmesh bench`` configuration (``ditmesh bench --worker SPEC``).

Every rank builds the same seeded transformer and one denoising step's inputs, applies the row's method
(ditmesh's ``parallelize``, or a peer from :mod:`ditmesh.bench.peers`), runs ``warmup + steps`` calls and
times each after a barrier. Rank 0 appends the row to ``rows.jsonl`` in the run's temporary folder and saves
its output there, for the error against the 1-process output.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .report import LORA_PHASES


def error_text(exc: BaseException) -> str:
    """A failed row's note: the exception's type and first line."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:300]


def row_key(row: dict) -> str:
    """The file stem of a row's saved output: method, process count, compiled (c/e), CUDA graph (g), and the payload
    dtype and attention where they are not the defaults."""
    eight = "".join(f"-{row[k]}".replace(":", "-") for k in ("quant", "comm_dtype", "attention") if row.get(k))
    return f"{row['method']}-{row['gpus']}-{'c' if row.get('compiled') else 'e'}{'g' if row.get('graph') else ''}{eight}"


def append_row(tmp: str | Path, row: dict) -> None:
    """Add one row to the run's ``rows.jsonl``."""
    with open(Path(tmp) / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _timed(model, inputs, spec: dict, steps, device, row: dict) -> tuple[list[float], torch.Tensor | None]:
    """``warmup + steps`` calls of ``model(**inputs)``, each after a device sync and a barrier; the timed calls'
    seconds and the last output (an exception is the row's ``error``)."""
    import torch.distributed as dist

    times, out = [], None
    with torch.no_grad():
        for i in range(spec["warmup"] + spec["steps"]):
            steps.step_index = i
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            try:
                out = model(**inputs)[0]
            except Exception as exc:  # noqa: BLE001
                row["error"] = error_text(exc)
                break
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
            elif i == 0:  # the first call pays the compile and the CUDA graph capture (cold or warm caches)
                row["first_call_s"] = round(time.perf_counter() - t0, 3)
    if isinstance(out, (list, tuple)):  # a family returning one prediction per packed item: compared as one tensor
        out = torch.cat([t.flatten() for t in out])
    return times, out


def _compile_stats(runtime) -> dict:
    """What the row's compile cost this process: the graphs dynamo made (one per block class when nothing
    recompiled), the AOT autograd / inductor cache misses (0 when the caches were warm), dynamo's and the backend's
    seconds and, for ditmesh's rows, the CUDA graph capture (``runtime.generate.compile_breakdown``)."""
    from torch._dynamo.utils import counters

    stats = {"graphs": counters["stats"]["unique_graphs"],
             "fx_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
    if runtime is not None:
        from ..runtime.generate import compile_breakdown

        stats.update(compile_breakdown(runtime))
    return stats


def _lora_layers(model) -> list:
    """peft's LoRA layers in ``model`` (the modules that keep a ``merged_adapters`` list)."""
    return [m for m in model.modules() if hasattr(m, "merged_adapters")]


def _lora_rows(model, inputs, spec: dict, steps, device, row: dict, lora: dict, plain: torch.Tensor,
               rank: int) -> None:
    """``--lora``: time the row again with ``lora`` loaded (after ``parallelize``, through the transformer's
    ``load_lora_adapter``, which ditmesh's ``lora`` hooks cut per tensor-parallel rank), then fused into the base
    weights (``fuse_lora``), then with peft's layers taken out and the fused weights kept (``unload_lora``: plain
    modules again, the sharded ones under tp). Each phase repeats the warm-up calls (they absorb the recompiles the
    changed layers cause). Adds ``step_ms_lora_unfused``, ``step_ms_lora_fused``, ``step_ms_lora_fused_unloaded``,
    ``lora_rank``, ``lora_layers`` (adapted linears), ``lora_merged_layers`` (of those, merged by ``fuse_lora``),
    ``lora_layers_unloaded`` (LoRA layers left after unloading: 0), ``lora_change`` (the unfused output against the
    row's own, plain one), ``lora_fused_rel_err`` (fused against unfused) and ``lora_unloaded_rel_err`` (unloaded
    against fused); rank 0 saves the unfused output for the error against the 1-process LoRA output. A failure is
    the row's ``lora_error``."""
    from ..testing import rel_err

    row["lora_rank"] = spec["lora"]
    outs = {}
    try:
        model.load_lora_adapter(lora, prefix=None, adapter_name="bench")
        layers = _lora_layers(model)
        row["lora_layers"] = len(layers)
        for phase in LORA_PHASES:
            if phase == "fused":
                model.fuse_lora(lora_scale=1.0)
                row["lora_merged_layers"] = sum(bool(m.merged_adapters) for m in layers)
            elif phase == "fused_unloaded":
                model.unload_lora()
                row["lora_layers_unloaded"] = len(_lora_layers(model))
            times, outs[phase] = _timed(model, inputs, spec, steps, device, row)
            if "error" in row:
                row["lora_error"] = row.pop("error")
                return
            row[f"step_ms_lora_{phase}"] = round(statistics.median(times) * 1e3, 3)
    except Exception as exc:  # noqa: BLE001  (the row keeps its plain timing)
        row["lora_error"] = error_text(exc)
        return
    row["lora_change"] = rel_err(outs["unfused"].float(), plain.float())
    row["lora_fused_rel_err"] = rel_err(outs["fused"].float(), outs["unfused"].float())
    row["lora_unloaded_rel_err"] = rel_err(outs["fused_unloaded"].float(), outs["fused"].float())
    if rank == 0:
        torch.save(outs["unfused"].float().cpu(), Path(spec["tmp"]) / f"{row_key(row)}-lora.pt")


def run_worker(spec: dict) -> None:
    """Measure one configuration on this rank (see the module docstring)."""
    import torch.distributed as dist

    from ..api import parallelize
    from ..comm import all_gather_object
    from ..config import ParallelConfig
    from ..mesh import default_device
    from ..options import RunOptions
    from ..options import quant_of
    from ..models.base import adapter_for
    from ..runtime.generate import _init_distributed
    from ..runtime.report import device_name
    from ..shared import DTYPES
    from ..synth import build_transformer, get_arch

    device = default_device()
    _init_distributed(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = DTYPES[spec["dtype"]]
    arch = get_arch(spec["model"])
    model = build_transformer(arch, seed=0, device=device, dtype=dtype)
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(1)
    shape = dict(height=spec["height"], width=spec["width"])
    if spec.get("frames"):
        shape["frames"] = spec["frames"]
    inputs = adapter.example_inputs(model, batch=spec.get("batch", 1), text_len=arch.max_sequence_length,
                                    generator=gen, device=device, dtype=dtype, **shape)

    class _Steps:  # a denoising loop's position, so that a step cache decides per step as in a pipeline run
        step_index = 0
        # the profiled call comes after the timed ones; a displaced row's is not the run's last step either (that one
        # starts no gather, and under CUDA graphs it has a graph of its own)
        timesteps = torch.arange(spec["warmup"] + spec["steps"] + (2 if spec["method"] == "displaced" else 1))

    class _Pipe:  # parallelize() needs only `.transformer` (and the scheduler's position, for a step cache)
        transformer = model
        scheduler = _Steps

    lora = None
    if spec.get("lora"):  # the whole layers' shapes: built before parallelize cuts them, loaded after; kept on the
        from ..synth import attention_lora  # CPU until then, out of the plain row's peak memory

        lora = attention_lora(model, spec["lora"], seed=2, device="cpu")
    row = {"method": spec["method"], "gpus": spec["gpus"], "degrees": spec["degrees"], "height": spec["height"],
           "width": spec["width"], "compiled": spec["compile"], "graph": spec.get("graph", False),
           "model": spec["model"], "dtype": spec["dtype"]}
    if device.type == "cpu":
        row["cpu_threads"] = torch.get_num_threads()  # per rank: the same in every row (bench/cli.py)

    ours = False  # parallelize() compiles our rows itself; peers and plain diffusers are compiled below
    try:
        if spec["method"].startswith("diffusers-"):
            from .peers import enable_diffusers

            enable_diffusers(model, spec["method"], spec["degrees"])
        elif spec["method"] == "torchao-fp8":
            from .peers import enable_torchao_fp8

            enable_torchao_fp8(model)
        elif spec["method"].startswith("xdit-"):
            from .peers import enable_xdit

            model = enable_xdit(model, arch.transformer, spec, text_len=arch.max_sequence_length)
        elif spec["method"] != "single" or row["graph"]:  # plain "single" rows are diffusers as it is
            if spec.get("cache"):
                row["cache"] = spec["cache"]
            options = RunOptions.create(ParallelConfig(**spec["degrees"]), cuda_graph=row["graph"],
                                        ulysses_chunks=spec.get("chunks"), compile=spec["compile"],
                                        transport=spec.get("transport", "nccl"), fuse_qkv=spec.get("fuse_qkv", False),
                                        cache=row.get("cache"), displaced=spec["method"] == "displaced",
                                        comm_dtype=spec.get("comm_dtype", "auto"),
                                        attention=spec.get("attention", "default"),
                                        quant_backend=spec.get("quant_backend", "auto"),
                                        **quant_of(spec.get("quant", "off")))
            runtime = parallelize(_Pipe, options, device=device)
            ours = True
            for key, default in (("comm_dtype", "auto"), ("attention", "default"), ("quant", "off"),
                                 ("quant_backend", "auto")):
                if spec.get(key, default) != default:
                    row[key] = spec[key]
            if spec.get("fuse_qkv"):
                row["fuse_qkv"] = True
            sp = runtime.sequence()
            if sp is not None and sp.ulysses_degree > 1 and sp.ring_degree == 1:  # USP runs one group
                row["ulysses_chunks"] = sp.ulysses_chunks  # head groups as resolved (the default depends on compile)
                row["transport"] = sp.transport
    except Exception as exc:  # noqa: BLE001  (a configuration that cannot run is a row with its error)
        row["error"] = error_text(exc)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # steady state: weights as placed + activations
    if "error" not in row:
        if spec["compile"] and not ours:
            from ..api import compile_blocks

            compile_blocks(model, adapter)
        times, out = _timed(model, inputs, spec, _Steps, device, row)
        if spec["compile"]:
            row["compile"] = _compile_stats(runtime if ours else None)
    if "error" not in row and spec.get("profile") and device.type == "cuda":
        from ..profiling import profile_step

        if dist.is_initialized():
            dist.barrier()  # start together, so that start-up skew does not read as communication
        try:
            _Steps.step_index += 1
            with torch.no_grad():
                row["breakdown"] = profile_step(lambda: model(**inputs), device)
        except Exception as exc:  # noqa: BLE001  (the row keeps its timing; every rank goes on)
            row["breakdown_error"] = error_text(exc)
    if "error" not in row and row.get("cache"):
        caches = runtime.caches.values()
        row["cache_skipped"] = sum(h["skip"] for c in caches for h in c.history[spec["warmup"]:])
    if "error" not in row:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        peaks = all_gather_object(peak)
        row.update(step_ms=round(statistics.median(times) * 1e3, 3), step_ms_all=[round(t * 1e3, 3) for t in times],
                   peak_gib_per_gpu=round(max(peaks) / 2**30, 3), card=device_name(device))
        if rank == 0:
            torch.save(out.float().cpu(), Path(spec["tmp"]) / f"{row_key(row)}.pt")
    if "error" not in row and lora is not None:
        _lora_rows(model, inputs, spec, _Steps, device, row, lora, out, rank)
    if rank == 0:
        append_row(spec["tmp"], row)
        print(f"ditmesh bench row: {json.dumps({k: v for k, v in row.items() if k != 'step_ms_all'})}", flush=True)
    from ..runtime.generate import finish_rank

    finish_rank()
