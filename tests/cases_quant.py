"""8-bit linears (``quant``) on every axis: rank functions for tests/test_quant.py (module-level for the workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

MODES = ("fp8", "fp8-weight", "int8-weight")


def quant_runs(model: str, config: dict, call: dict, steps: int = 2, modes=MODES, options: dict | None = None) -> dict:
    """The pipeline in folder ``model`` under ``config`` (``{}``: one process, not distributed) with ``options`` and each
    of ``modes`` (a fresh pipeline each): ``{mode: quantized_run(...)}``."""
    from diffusers import DiffusionPipeline

    return {mode: quantized_run(DiffusionPipeline.from_pretrained(model, dtype=torch.float32), config, call, steps, mode,
                                options) for mode in modes}


def quantized_run(pipe, config: dict, call: dict, steps: int, mode: str, options: dict | None = None) -> dict:
    """``pipe`` parallelized under ``config`` with ``quant=mode`` and ``options``, called once: ``{"latents", "scales":
    {layer: [rows, 1] of every call, concatenated}, "keep": whether this rank's scales are the ones to compare (tp
    rank 0: the tp ranks quantize the same rows), "held": held_8bit(...)}``."""
    from ditmesh import ParallelConfig, parallelize
    from ditmesh.parallel.quant import record_scales

    pipe.set_progress_bar_config(disable=True)
    runtime = parallelize(pipe, ParallelConfig(**config), quant=mode, **(options or {}))
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"].clone()
        return kw

    with record_scales() as scales:
        pipe(**call, num_inference_steps=steps, generator=torch.Generator().manual_seed(42), output_type="latent",
             callback_on_step_end=grab)
    by_layer: dict[str, list] = {}
    for name, s in scales:
        by_layer.setdefault(name, []).append(s)
    keep = config.get("tp", 1) == 1 or runtime.mesh.rank("tp") == 0
    return dict(latents=final["latents"], keep=keep, scales={name: torch.cat(s) for name, s in by_layer.items()},
                held=held_8bit(pipe.transformer))


def compare_scales(reference: dict, results: list) -> tuple[float, int]:
    """Every fp8 layer's activation scales of the ranks (each rank's rows; tp ranks alike, so tp rank 0's) against one
    process's, as sorted multisets (the split of rows over ranks differs by axis): (largest rel. difference of a
    scale, scales compared)."""
    worst, count = 0.0, 0
    for name, ref in reference["scales"].items():
        theirs = ref.flatten().sort().values
        ranks = [r["scales"][name].flatten() for r in results if r["keep"] and name in r["scales"]]
        # rows split over the ranks (tokens, samples), or replicated on each (the modulation's timestep embedding)
        groups = [torch.cat(ranks)] if sum(t.numel() for t in ranks) == theirs.numel() else ranks
        for mine in groups:
            assert mine.numel() == theirs.numel(), f"{name}: {mine.numel()} scales vs {theirs.numel()}"
            worst = max(worst, float(((mine.sort().values - theirs).abs() / theirs).max()))
        count += theirs.numel()
    return worst, count


def flips_case(rows: int = 64, features: int = 96, seed: int = 0):
    """A row-parallel fp8 linear (input features split over the world) on an input whose shards carry a rounding
    relative difference of 1e-4: the scales (amax reduced over the ranks) equal one process's on the perturbed input,
    and the fp8 codes that flip are counted. Returns (scales equal bitwise, flipped codes, codes, rel. err of the
    output against one process's on the unperturbed input)."""
    from ditmesh.parallel.quant import QuantLinear, fp8_quantize, fp8_scale, row_amax

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    full = torch.nn.Linear(features, 32)
    with torch.no_grad():
        full.weight.copy_(torch.randn(32, features, generator=g))
    x = torch.randn(rows, features, generator=g)
    # what a reordered sum may give, exaggerated (float32 reorderings move values by an ulp or so, and flip about one
    # code in a million: too rare to count here)
    x_reordered = x * (1 + 1e-4 * torch.randn(x.shape, generator=g))
    width = features // world
    cols = slice(rank * width, (rank + 1) * width)
    shard = torch.nn.Linear(width, 32)
    with torch.no_grad():
        shard.weight.copy_(full.weight[:, cols])
        shard.bias.copy_(full.bias)
    one = QuantLinear(full, "fp8")
    par = QuantLinear(shard, "fp8", group=dist.group.WORLD)
    with torch.no_grad():
        scales_equal = torch.equal(fp8_scale(row_amax(x_reordered[:, cols], dist.group.WORLD)),
                                   fp8_scale(row_amax(x_reordered)))
        codes_one = fp8_quantize(x, fp8_scale(row_amax(x))).float()
        codes_par = fp8_quantize(x_reordered, fp8_scale(row_amax(x_reordered))).float()
        flipped = int((codes_one != codes_par)[:, cols].sum())
        ref, out = one(x), par(x_reordered[:, cols])
        weights_equal = torch.equal(par.qweight.float(), one.qweight.float()[:, cols]) and torch.equal(par.scale,
                                                                                                        one.scale)
    return scales_equal and weights_equal, flipped, rows * width, float((out - ref).norm() / ref.norm())


def checkpoint_runs(folders: dict, config: dict, call: dict, steps: int = 2) -> dict:
    """The pipelines written by ``ditmesh quantize`` (``folders``: mode -> folder) under ``config``, each loaded as
    ``generate`` loads it (a tp rank reads its slices only): ``{mode: quantized_run(...)}``."""
    from diffusers import DiffusionPipeline

    from ditmesh.parallel.quant import load_quantized_transformer

    tp = config.get("tp", 1)
    rank = dist.get_rank() if dist.is_initialized() else 0

    def load(folder: str):
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32, transformer=None)
        pipe.register_modules(transformer=load_quantized_transformer(folder, "transformer", "cpu", torch.float32,
                                                                     rank % tp, tp))
        return pipe

    return {mode: quantized_run(load(folder), config, call, steps, mode) for mode, folder in folders.items()}


def held_8bit(model) -> dict:
    """``{linear name: (shape, dtype)}`` of the 8-bit weight each :class:`QuantLinear` of ``model`` holds (on CPU all
    of them are QuantLinears)."""
    from ditmesh.parallel.quant import QuantLinear

    return {n: (tuple(m.qweight.shape), m.qweight.dtype) for n, m in model.named_modules() if isinstance(m, QuantLinear)}
