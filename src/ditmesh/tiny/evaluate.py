"""Score a tiny pipeline: generate images for captions and read them back with the procedural checker.

The default caption set is every phrasing of the scenes held out of training
(:func:`ditmesh.tiny.data.split_scenes`), so the score measures composition, not memory. Accuracy is the
share of images whose shape colour, shape class and position (an unnamed position is the center) match
the caption.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import data as tiny_data
from . import default_model_path, load_pipeline, read_meta

TARGETS = {"colour": 0.95, "shape": 0.85, "position": 0.85}
#: Captions of the sample grid in docs/img/tiny_samples.png (row by row, 6 per row).
SAMPLE_CAPTIONS = [
    "a red circle",
    "a green square at the top left",
    "a blue triangle at the bottom right",
    "a yellow circle on a black background",
    "a red square at the top right on a gray background",
    "a green triangle at the bottom left on a black background",
    "a blue circle at the top left on a gray background",
    "a yellow square at the bottom left",
    "a red triangle at the center on a black background",
    "a green circle at the bottom right on a gray background",
    "a blue square on a black background",
    "a yellow triangle at the top right",
]


def eval_captions(split: str = "held-out", seed: int = 0) -> list[str]:
    """Every phrasing of the scenes in ``split``: ``held-out`` (default), ``train`` or ``all``."""
    train, held = tiny_data.split_scenes(seed)
    scenes = {"held-out": held, "train": train, "all": train + held}[split]
    return [c for s in scenes for c in s.captions()]


@dataclass
class EvalResult:
    """Accuracies over ``n`` images, and per image (caption, what the checker read)."""

    n: int
    steps: int
    accuracy: dict
    rows: list = field(default_factory=list)
    seconds: float = 0.0

    def meets_targets(self) -> bool:
        """Whether colour, shape and position reach :data:`TARGETS`."""
        return all(self.accuracy[k] >= v for k, v in TARGETS.items())

    def summary(self) -> str:
        """One line: ``colour 98.8% shape 91.2% position 97.5% (80 images, 28 steps, 12.3 s)``."""
        parts = " ".join(f"{k} {100 * self.accuracy[k]:.1f}%" for k in ("colour", "shape", "position", "all"))
        return f"{parts} ({self.n} images, {self.steps} steps, {self.seconds:.1f} s)"


def generate(pipe, captions: list[str], steps: int, seed: int, batch_size: int = 64, guidance_scale: float = 3.5) -> np.ndarray:
    """uint8 ``[len(captions), H, W, 3]`` images; batch ``b`` draws its noise from generator ``seed + b``.

    Size and ``max_sequence_length`` come from the folder's ``ditmesh_tiny.json``.
    """
    meta = read_meta(pipe.name_or_path)
    height, width = meta["default_size"]
    out = []
    for b, i in enumerate(range(0, len(captions), batch_size)):
        images = pipe(prompt=captions[i:i + batch_size], height=height, width=width, num_inference_steps=steps,
                      guidance_scale=guidance_scale, max_sequence_length=meta["max_sequence_length"], output_type="np",
                      generator=torch.Generator().manual_seed(seed + b)).images
        out.append(np.clip(np.rint(images * 255), 0, 255).astype(np.uint8))
    return np.concatenate(out)


def score(images: np.ndarray, captions: list[str]) -> tuple[dict, list]:
    """Checker accuracies (colour, shape, position, all three) of ``images`` against ``captions``."""
    hits = {"colour": 0, "shape": 0, "position": 0, "all": 0}
    rows = []
    for image, text in zip(images, captions):
        want, got = tiny_data.parse_caption(text), tiny_data.classify(image)
        ok = {"colour": got.colour == want.colour, "shape": got.shape == want.shape, "position": got.position == want.position}
        ok["all"] = all(ok.values())
        for k, v in ok.items():
            hits[k] += v
        rows.append({"caption": text, "colour": got.colour, "shape": got.shape, "position": got.position,
                     "background": got.background, "ok": ok["all"]})
    return {k: v / max(1, len(captions)) for k, v in hits.items()}, rows


def evaluate(model_path: str | None = None, captions: list[str] | None = None, steps: int = 28, seed: int = 0,
             images_per_caption: int = 4, batch_size: int = 64, guidance_scale: float = 3.5, pipe=None,
             grid: str | None = None) -> EvalResult:
    """Generate ``images_per_caption`` images per caption at ``steps`` steps and score them."""
    pipe = pipe or load_pipeline(model_path)
    pipe.set_progress_bar_config(disable=True)
    captions = captions if captions is not None else eval_captions()
    prompts = [c for c in captions for _ in range(images_per_caption)]
    t0 = time.time()
    images = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
    seconds = time.time() - t0
    accuracy, rows = score(images, prompts)
    if grid:
        save_grid(images, grid)
    return EvalResult(n=len(prompts), steps=steps, accuracy=accuracy, rows=rows, seconds=seconds)


def psnr_ssim(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """PSNR (dB, 8-bit) and SSIM (7x7 box windows on the luma, constants of Wang et al.) of two uint8 images."""
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
    weights = np.array([0.299, 0.587, 0.114])
    x, y = (img.astype(np.float64) @ weights for img in (a, b))

    def box(z, k=7):  # mean over k x k windows (valid part), through a summed-area table
        c = np.pad(z.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
        return (c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]) / (k * k)

    mx, my = box(x), box(y)
    vx, vy, cxy = box(x * x) - mx ** 2, box(y * y) - my ** 2, box(x * y) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return psnr, float(ssim.mean())


def cache_sweep(model_path: str | None, settings: list[str], captions: list[str], steps: int = 28, seed: int = 0,
                images_per_caption: int = 4, batch_size: int = 16, guidance_scale: float = 3.5) -> list[dict]:
    """Quality of step-cache settings against the uncached images of the same captions, noise and batches: per
    setting, transformer evaluations per image (blocks computed / all blocks, summed over steps), accuracies,
    images that lost an attribute the uncached image had right, and mean PSNR / SSIM against it."""
    from .. import ParallelConfig, parallelize, remove

    pipe = load_pipeline(model_path)
    pipe.set_progress_bar_config(disable=True)
    prompts = [c for c in captions for _ in range(images_per_caption)]
    reference = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
    rows = [{"cache": "off", "evaluations": float(steps), **against_reference(reference, reference, prompts)}]
    for setting in settings:
        runtime = parallelize(pipe, ParallelConfig(), cache=setting)
        cache = runtime.caches["transformer"]
        start = time.time()
        images = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
        seconds = time.time() - start
        total = len(cache.blocks)
        kept = cache.config.first + cache.config.last
        calls = len(cache.history)
        evaluations = sum(kept / total if h["skip"] else 1.0 for h in cache.history) * steps / max(1, calls)
        rows.append({"cache": setting, "evaluations": round(evaluations, 2),
                     **against_reference(images, reference, prompts), "seconds": round(seconds, 1)})
        remove(pipe)
    return rows


def against_reference(images: np.ndarray, reference: np.ndarray, prompts: list[str]) -> dict:
    """Accuracies of ``images``, how many lost an attribute the ``reference`` image of the same prompt and noise had
    right, and their mean PSNR / SSIM against it."""
    attributes = ("colour", "shape", "position")
    want = [tiny_data.parse_caption(p) for p in prompts]
    ref_rows = score(reference, prompts)[1]
    accuracy, got_rows = score(images, prompts)
    ref_ok = [{k: r[k] == getattr(w, k) for k in attributes} for r, w in zip(ref_rows, want)]
    quality = [psnr_ssim(a, b) for a, b in zip(images, reference)]
    # each image that lost an attribute: the first one it lost, what the checker read instead, its PSNR
    lost = []
    for i, (ok, g, w) in enumerate(zip(ref_ok, got_rows, want)):
        k = next((a for a in attributes if ok[a] and g[a] != getattr(w, a)), None)
        if k is not None:
            lost.append({"image": i, "prompt": prompts[i], "attribute": k, "want": str(getattr(w, k)),
                         "got": str(g[k]), "psnr": round(float(quality[i][0]), 2)})
    return {**accuracy, "lost": len(lost), "lost_images": lost,
            "psnr": round(float(np.mean([q[0] for q in quality if np.isfinite(q[0])] or [float("inf")])), 2),
            "ssim": round(float(np.mean([q[1] for q in quality])), 4)}


def parse_pp_setting(text: str) -> dict:
    """``pp=2,patches=4,warmup=1`` -> ``{"pp": 2, "patches": 4, "warmup": 1}`` (patches default pp, warmup 1);
    ``displaced=2,warmup=1`` -> ``{"displaced": 2, "warmup": 1}`` (displaced attention over 2 ulysses ranks)."""
    from ..config import ConfigError

    values = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("pp", "patches", "warmup", "displaced") or not value.isdigit():
            raise ConfigError(f"--pp-sweep setting {text!r}: give pp=N,patches=M,warmup=W or displaced=N,warmup=W (e.g. "
                              "pp=2,patches=4,warmup=1)")
        values[key] = int(value)
    if values.get("warmup", 1) < 1:
        raise ConfigError(f"--pp-sweep setting {text!r}: warmup must be >= 1 (e.g. warmup=1)")
    if "displaced" in values:
        if set(values) - {"displaced", "warmup"}:
            raise ConfigError(f"--pp-sweep setting {text!r}: displaced=N takes only warmup=W beside it")
        if values["displaced"] < 2:
            raise ConfigError(f"--pp-sweep setting {text!r}: displaced must be >= 2 ranks (e.g. displaced=2)")
        return {"displaced": values["displaced"], "warmup": values.get("warmup", 1)}
    if "pp" not in values:
        raise ConfigError(f"--pp-sweep setting {text!r} has no pp=N or displaced=N")
    setting = {"pp": values["pp"], "patches": values.get("patches", values["pp"]), "warmup": values.get("warmup", 1)}
    if setting["pp"] < 1 or setting["patches"] < setting["pp"]:
        raise ConfigError(f"--pp-sweep setting {text!r}: give pp >= 1 (1: the exact reference) and patches >= pp "
                          "(e.g. pp=2,patches=2,warmup=1)")
    return setting


def setting_ranks(setting: dict) -> int:
    """The processes a ``--pp-sweep`` setting runs on."""
    return setting.get("displaced") or setting["pp"]


def describe_setting(setting: dict) -> str:
    """A sweep row's mode as the README writes it: ``pp 2, 4 patches``, ``displaced, ulysses 2``, or the reference."""
    if setting.get("displaced"):
        return f"displaced, ulysses {setting['displaced']}"
    if setting["pp"] == 1:
        return "one process (exact)"
    return f"pp {setting['pp']}, {setting['patches']} patches"


def _pp_images(model_path: str | None, setting: dict, prompts: list[str], steps: int, seed: int, batch_size: int,
               guidance_scale: float):
    """On every rank of a gloo pool: the images of ``prompts`` under PipeFusion (or displaced) ``setting``; rank 0
    returns them."""
    import torch.distributed as dist

    from .. import ParallelConfig, parallelize

    pipe = load_pipeline(model_path)
    pipe.set_progress_bar_config(disable=True)
    if setting.get("displaced"):
        parallelize(pipe, ParallelConfig(ulysses=setting["displaced"]), displaced=True,
                    displaced_warmup=setting["warmup"])
    else:
        parallelize(pipe, ParallelConfig(pp=setting["pp"]), pp_patches=setting["patches"], pp_warmup=setting["warmup"])
    images = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
    return images if dist.get_rank() == 0 else None


def pp_sweep(model_path: str | None, settings: list[dict], captions: list[str], steps: int = 28, seed: int = 0,
             images_per_caption: int = 4, batch_size: int = 16, guidance_scale: float = 3.5, on_row=None) -> list[dict]:
    """Quality of PipeFusion settings (``pp``, ``patches``, ``warmup``; each on ``pp`` gloo processes) and displaced
    ones (``displaced``, ``warmup``; on ``displaced`` processes) against the
    exact images of one process, same captions, noise and batches: accuracies, lost attributes, PSNR / SSIM.
    ``on_row(row)`` is called as each row is done."""
    from ..testing import ProcessPool

    pipe = load_pipeline(model_path)
    pipe.set_progress_bar_config(disable=True)
    prompts = [c for c in captions for _ in range(images_per_caption)]
    reference = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
    rows = [{"pp": 1, "patches": 1, "warmup": steps, **against_reference(reference, reference, prompts)}]
    (on_row or (lambda row: None))(rows[0])
    pools: dict[int, ProcessPool] = {}
    try:
        for setting in settings:
            ranks = setting_ranks(setting)
            if ranks not in pools:  # one pool per process count, started once
                pools[ranks] = ProcessPool(ranks)
            pool = pools[ranks]
            start = time.time()
            images = pool.run(_pp_images, model_path, setting, prompts, steps, seed, batch_size, guidance_scale)[0]
            rows.append({**setting, **against_reference(images, reference, prompts),
                         "seconds": round(time.time() - start, 1)})
            (on_row or (lambda row: None))(rows[-1])
    finally:
        for pool in pools.values():
            pool.close()
    return rows


#: what an ``--eight-sweep`` setting may name: comm=fp8, attention=fp8, quant=fp8 (the block linears), exact-steps=W
EIGHT_KEYS = {"comm": ("fp8",), "attention": ("fp8",), "quant": ("fp8",)}
#: a setting's parts when it does not name them
EIGHT_DEFAULT = {"comm": "auto", "attention": "exact", "quant": "off", "exact_steps": 0}


def parse_eight_setting(text: str) -> dict:
    """``comm=fp8,attention=fp8,exact-steps=2`` -> ``{"comm": "fp8", "attention": "fp8", "exact_steps": 2}`` (each
    part optional; comm auto, attention exact and 0 exact steps by default)."""
    from ..config import ConfigError

    setting = dict(EIGHT_DEFAULT)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "exact-steps" and value.isdigit():
            setting["exact_steps"] = int(value)
        elif value in EIGHT_KEYS.get(key, ()):
            setting[key] = value
        else:
            raise ConfigError(f"--eight-sweep setting {text!r}: give comm=fp8, attention=fp8, quant=fp8 and "
                              "exact-steps=W, joined by commas (e.g. comm=fp8,attention=fp8,exact-steps=2)")
    if setting == EIGHT_DEFAULT:
        raise ConfigError(f"--eight-sweep setting {text!r} names no 8-bit mode (comm=fp8, attention=fp8, "
                          "quant=fp8)")
    if setting["exact_steps"] and setting["attention"] == "exact":
        raise ConfigError(f"--eight-sweep setting {text!r}: exact-steps keeps steps out of 8-bit attention; add "
                          "attention=fp8")
    return setting


def eight_sweep(model_path: str | None, settings: list[dict], captions: list[str], steps: int = 28, seed: int = 0,
                images_per_caption: int = 4, batch_size: int = 16, guidance_scale: float = 3.5, on_row=None) -> list[dict]:
    """Quality of fp8 payloads and 8-bit attention (:func:`parse_eight_setting`) against the exact images of the same
    captions, noise and batches, on one process: fp8 payloads rounded where Ulysses sends them
    (``parallel.eight.emulate_fp8_comm``: Q, K, V and the attention output, per token and head; the images of a
    Ulysses run with ``comm_dtype="fp8"`` up to float32 noise) and the fp8 attention's rounding in float32 math
    (``attention="fp8-emulated"``); accuracies, lost attributes, PSNR / SSIM. ``on_row(row)`` as each row is done."""
    from .. import ParallelConfig, parallelize, remove
    from ..parallel.eight import emulate_fp8_comm

    pipe = load_pipeline(model_path)
    pipe.set_progress_bar_config(disable=True)
    prompts = [c for c in captions for _ in range(images_per_caption)]
    start = time.time()
    reference = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
    rows = [{"comm": "auto", "attention": "exact", "quant": "off", "exact_steps": steps,
             **against_reference(reference, reference, prompts), "seconds": round(time.time() - start, 1)}]
    (on_row or (lambda row: None))(rows[0])
    for setting in settings:
        attention = "default" if setting["attention"] == "exact" else f"{setting['attention']}-emulated"
        quant = setting.get("quant", "off")
        if setting["comm"] == "fp8":
            emulate_fp8_comm(parallelize(pipe, ParallelConfig(), quant=quant), "ulysses", attention,
                             setting["exact_steps"])
        else:
            parallelize(pipe, ParallelConfig(), attention=attention, attention_bf16_steps=setting["exact_steps"],
                        quant=quant)
        start = time.time()
        images = generate(pipe, prompts, steps, seed, batch_size, guidance_scale)
        rows.append({**setting, **against_reference(images, reference, prompts), "seconds": round(time.time() - start, 1)})
        if quant == "off":
            remove(pipe)
        else:  # the 8-bit linears replaced the weights (remove() cannot give them back): load the pipeline again
            pipe = load_pipeline(model_path)
            pipe.set_progress_bar_config(disable=True)
        (on_row or (lambda row: None))(rows[-1])
    return rows


def quant_sweep(model_path: str | None, variants: list[str], captions: list[str], steps: int = 28, seed: int = 0,
                images_per_caption: int = 1, batch_size: int = 16, guidance_scale: float = 3.5,
                on_row=None) -> list[dict]:
    """Quality of the 8-bit linears (``--quant`` variants as ``bench --quant`` names them: ``fp8``,
    ``fp8:keep-modulation`` ...) against the exact images of the same captions, noise and batches, on one process (on
    CPU: the rounding in float32 math, ``parallel.quant.QuantLinear``). Each variant quantizes a freshly loaded
    pipeline (quantizing replaces the weights). Accuracies, lost attributes, PSNR / SSIM; ``on_row(row)`` per row."""
    from .. import ParallelConfig, parallelize
    from ..options import quant_of

    prompts = [c for c in captions for _ in range(images_per_caption)]

    def run(variant: str):
        pipe = load_pipeline(model_path)
        pipe.set_progress_bar_config(disable=True)
        if variant != "off":
            parallelize(pipe, ParallelConfig(), **quant_of(variant))
        start = time.time()
        return generate(pipe, prompts, steps, seed, batch_size, guidance_scale), round(time.time() - start, 1)

    reference, seconds = run("off")
    rows = [{"quant": "off", **against_reference(reference, reference, prompts), "seconds": seconds}]
    (on_row or (lambda row: None))(rows[0])
    for variant in variants:
        images, seconds = run(variant)
        rows.append({"quant": variant, **against_reference(images, reference, prompts), "seconds": seconds})
        (on_row or (lambda row: None))(rows[-1])
    return rows


def write_samples(path: str, model_path: str | None = None, steps: int = 28, seed: int = 0, pipe=None) -> list[str]:
    """Draw :data:`SAMPLE_CAPTIONS` into one PNG grid (6 per row, 2x nearest upscale); returns the captions."""
    pipe = pipe or load_pipeline(model_path)
    pipe.set_progress_bar_config(disable=True)
    save_grid(generate(pipe, SAMPLE_CAPTIONS, steps, seed), path, cols=6, scale=2)
    return SAMPLE_CAPTIONS


def save_grid(images: np.ndarray, path: str, cols: int = 8, pad: int = 2, scale: int = 1) -> None:
    """Save uint8 ``[N, H, W, 3]`` images as one PNG grid (gray gutters)."""
    from PIL import Image

    n, h, w, _ = images.shape
    rows = -(-n // cols)
    canvas = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 200, dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        canvas[pad + r * (h + pad):pad + r * (h + pad) + h, pad + c * (w + pad):pad + c * (w + pad) + w] = img
    out = Image.fromarray(canvas)
    if scale != 1:
        out = out.resize((out.width * scale, out.height * scale), Image.NEAREST)
    out.save(path)


# ---------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------
def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval-tiny`` on an argparse ``subparsers`` object; its handler is :func:`run_eval`."""
    parser = subparsers.add_parser("eval-tiny", help="score the tiny pipeline on held-out captions",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="pipeline folder (default: the shipped tiny-flux)")
    parser.add_argument("--steps", type=int, default=28, help="inference steps (default: 28)")
    parser.add_argument("--split", choices=("held-out", "train", "all"), default="held-out",
                        help="which scenes' captions to use (default: held-out)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N captions")
    parser.add_argument("--images-per-caption", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guidance-scale", "--guidance", type=float, default=3.5,
                        help="guidance scale (default 3.5; --guidance as in generate)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--grid", default=None, help="also save the generated images as a PNG grid")
    parser.add_argument("--samples", default=None, help="also draw the README sample grid (SAMPLE_CAPTIONS) to this PNG")
    parser.add_argument("--json", default=None, help="write accuracies and per-image readings to this file")
    parser.add_argument("--cache-sweep", default=None, metavar="SETTINGS",
                        help="semicolon-separated step-cache settings (e.g. 'fbcache:0.1;fbcache:0.2'): print each one's "
                             "evaluations per image, accuracy, lost attributes and PSNR/SSIM against the uncached images")
    parser.add_argument("--pp-sweep", default=None, metavar="SETTINGS",
                        help="semicolon-separated PipeFusion or displaced settings (e.g. 'pp=2,patches=2,warmup=1;"
                             "displaced=4,warmup=1'), each run on pp (displaced) local gloo processes: print accuracy, lost attributes and PSNR/SSIM against the "
                             "exact images of one process")
    parser.add_argument("--quant-sweep", default=None, metavar="LIST",
                        help="quality of the 8-bit linears: a comma list of --quant modes as bench names them (fp8, "
                             "fp8-weight, int8-weight, fp8:keep-modulation), each against the exact images "
                             "(docs/quantization.md)")
    parser.add_argument("--eight-sweep", default=None, metavar="SETTINGS",
                        help="semicolon-separated 8-bit settings (e.g. 'comm=fp8;attention=fp8;attention=fp8,"
                             "exact-steps=2'), their rounding emulated in float32 on one process: print accuracy, lost "
                             "attributes and PSNR/SSIM against the exact images (docs/quantization.md)")
    parser.set_defaults(func=run_eval)
    return parser


def _sweep_rows(args, captions: int, images: int, emulated: str, line):
    """A sweep's ``on_row``: prints each row's table ``line(row)`` and, with ``--json``, writes every row so far after
    each one (a sweep stopped part-way keeps what it measured)."""
    done = []

    def on_row(r):
        print(line(r), flush=True)
        done.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"captions": captions, "images": images, "steps": args.steps, "emulated": emulated,
                           "rows": done}, f, indent=1)

    return on_row


def run_eval(args: argparse.Namespace) -> int:
    """Handler of ``ditmesh eval-tiny``: print the accuracies; exit status 1 if a target is missed."""
    from pathlib import Path

    from ..options import CacheConfig
    from ..config import ConfigError

    for name in ("threads", "steps", "images_per_caption", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit} must be >= 1")
    if args.model and not (Path(args.model) / "model_index.json").is_file():
        raise ConfigError(f"--model {args.model}: not a pipeline folder (no model_index.json); "
                          f"give a folder written by `ditmesh train-tiny`")
    # every sweep setting is read before anything loads or prints
    cache_settings = [c for c in (args.cache_sweep or "").split(";") if c]
    for text in cache_settings:
        try:
            CacheConfig.parse(text)
        except ConfigError as exc:
            raise ConfigError(f"--cache-sweep setting {text!r}: {exc}") from None
    pp_settings = [parse_pp_setting(t) for t in (args.pp_sweep or "").split(";") if t]
    eight_settings = [parse_eight_setting(t) for t in (args.eight_sweep or "").split(";") if t]
    quant_variants_ = []
    if args.quant_sweep:
        from ..options import quant_variants

        quant_variants_ = [v for v in quant_variants(args.quant_sweep) if v != "off"]
    torch.set_num_threads(args.threads)
    captions = eval_captions(args.split)[: args.limit]
    if args.cache_sweep:
        rows = cache_sweep(args.model, cache_settings, captions, steps=args.steps,
                           seed=args.seed, images_per_caption=args.images_per_caption,
                           batch_size=min(args.batch_size, 16), guidance_scale=args.guidance_scale)
        print("| cache | evaluations per image | colour | shape | position | all | lost an attribute | PSNR dB | SSIM |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['cache']} | {r['evaluations']} | {r['colour']:.3f} | {r['shape']:.3f} | {r['position']:.3f} "
                  f"| {r['all']:.3f} | {r['lost']} of {len(captions) * args.images_per_caption} | {r['psnr']} | {r['ssim']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.pp_sweep:
        print("| mode | warm-up steps | colour | shape | position | all | lost an attribute | PSNR dB | SSIM |")
        print("|---|---|---|---|---|---|---|---|---|", flush=True)

        def print_row(r):
            print(f"| {describe_setting(r)} | {r['warmup']} | {r['colour']:.3f} | {r['shape']:.3f} "
                  f"| {r['position']:.3f} | {r['all']:.3f} | {r['lost']} of {len(captions) * args.images_per_caption} "
                  f"| {r['psnr']} | {r['ssim']} |", flush=True)

        rows = pp_sweep(args.model, pp_settings, captions,
                        steps=args.steps, seed=args.seed, images_per_caption=args.images_per_caption,
                        batch_size=min(args.batch_size, 16), guidance_scale=args.guidance_scale, on_row=print_row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if quant_variants_:
        images = len(captions) * args.images_per_caption
        print("| quant | colour | shape | position | all | lost an attribute | PSNR dB | SSIM | s |")
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        quant_row = _sweep_rows(args, len(captions), images, "8-bit linears rounded in float32 on one process "
                                "(parallel.quant)", lambda r: f"| {r['quant']} | {r['colour']:.3f} | {r['shape']:.3f} "
                                f"| {r['position']:.3f} | {r['all']:.3f} | {r['lost']} of {images} | {r['psnr']} "
                                f"| {r['ssim']} | {r['seconds']} |")

        quant_sweep(args.model, quant_variants_, captions, steps=args.steps, seed=args.seed,
                    images_per_caption=args.images_per_caption, batch_size=min(args.batch_size, 16),
                    guidance_scale=args.guidance_scale, on_row=quant_row)
        return 0
    if eight_settings:
        images = len(captions) * args.images_per_caption
        print("| comm | attention | linears | exact steps | colour | shape | position | all | lost an attribute | "
              "PSNR dB | SSIM |")
        print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        eight_row = _sweep_rows(args, len(captions), images, "fp8 payloads, 8-bit attention and linears rounded in "
                                "float32 on one process", lambda r: f"| {r['comm']} | {r['attention']} | {r['quant']} "
                                f"| {r['exact_steps']} "
                                f"| {r['colour']:.3f} | {r['shape']:.3f} | {r['position']:.3f} | {r['all']:.3f} "
                                f"| {r['lost']} of {images} | {r['psnr']} | {r['ssim']} |")

        eight_sweep(args.model, eight_settings, captions, steps=args.steps, seed=args.seed,
                    images_per_caption=args.images_per_caption, batch_size=min(args.batch_size, 16),
                    guidance_scale=args.guidance_scale, on_row=eight_row)
        return 0
    result = evaluate(args.model or default_model_path(), captions, steps=args.steps, seed=args.seed,
                      images_per_caption=args.images_per_caption, batch_size=args.batch_size,
                      guidance_scale=args.guidance_scale, grid=args.grid)
    print(result.summary())
    if args.samples:
        write_samples(args.samples, args.model, steps=args.steps, seed=args.seed)
    targets = " ".join(f"{k}>={100 * v:.0f}%" for k, v in TARGETS.items())
    print(f"targets ({targets}): {'met' if result.meets_targets() else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": result.accuracy, "n": result.n, "steps": result.steps, "rows": result.rows}, f, indent=1)
    return 0 if result.meets_targets() else 1


def main(argv=None) -> int:
    """``python -m ditmesh.tiny.evaluate [options]``."""
    import sys

    parser = argparse.ArgumentParser(prog="ditmesh-eval-tiny")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    args = parser.parse_args(["eval-tiny"] + list(argv if argv is not None else sys.argv[1:]))
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
