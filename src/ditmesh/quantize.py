"""``ditmesh quantize``: write a pipeline whose transformers hold 8-bit weights (``parallel.quant``'s formats), so
that ``generate`` and ``serve`` load them without ever holding those weights in the model's dtype (a tensor-parallel
rank reads its slices only). The other components are linked (or copied) unchanged. docs/quantization.md.

    ditmesh quantize --model DIR --out DIR --quant fp8 [--quant-keep-modulation|--quant-modulation] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .config import ConfigError
from .options import modulation_quantized
from .shared import DTYPE_NAMES, add_quant_flags, follow_umask, one_line


def _size(n: int) -> str:
    """Bytes for a person: GiB from 0.1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 0.1 * 2**30 else f"{n / 2**20:.1f} MiB"


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize", help="write a pipeline with 8-bit transformer weights (loaded without the originals)",
        description="Quantize the transformers' block linears of a pipeline once and write the result (the other "
                    "components linked or copied unchanged); generate and serve run it in the mode it was written in.")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="pipeline folder, synthetic architecture name (ditmesh synth --list) or hub id")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    add_quant_flags(p)
    p.add_argument("--dtype", default="bfloat16",
                   help="the dtype the weights are quantized from and the rest stored in (default bfloat16, the "
                        "dtype GPU runs use; float32 for CPU runs)")
    return p


def check_arguments(args) -> tuple[str, Path, str]:
    """Torch-free checks: ``(model, out folder, dtype name)``, or ConfigError naming the value."""
    from .options import QUANT_MODES
    from .runtime.models import read_quant_manifest, resolve_model

    modes = [m for m in QUANT_MODES if m != "off"]
    if args.quant not in modes:
        given = "no --quant" if args.quant is None else f"--quant {args.quant}"
        raise ConfigError(f"{given}: quantize writes one of {', '.join(modes)}; give --quant MODE")
    if args.dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype {args.dtype} is not one of: {', '.join(sorted(DTYPE_NAMES))}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; give a new folder")
    model = resolve_model(args.model)
    if read_quant_manifest(model) is not None:
        raise ConfigError(f"--model {model} is already quantized (by ditmesh quantize); give the original pipeline")
    return model, out, DTYPE_NAMES[args.dtype]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same bytes, no second copy on disk (files are replaced, never edited, by savers)
    except OSError:
        shutil.copy2(src, dst)


def quantize_pipeline(model: str, out: Path, mode: str, modulation: bool, dtype_name: str, log=print) -> dict:
    """Write ``model``'s pipeline to ``out`` with each transformer component quantized in ``mode``; returns
    ``{component: {"linears": n, "bytes_before": b, "bytes_after": a}}``. Written to a temporary folder beside
    ``out`` and renamed at the end: an error leaves nothing behind."""
    import torch

    from .models import adapter_for
    from .parallel.quant import save_quantized
    from .runtime.generate import transformer_components
    from .runtime.models import local_model_path

    path = local_model_path(model)
    if not Path(path).is_dir():  # a hub id: the whole pipeline, once
        from huggingface_hub import snapshot_download

        path = snapshot_download(path)
    path = Path(path)
    components = transformer_components(str(path))
    dtype = getattr(torch, dtype_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    summary = {}
    try:
        partial.mkdir()
        for entry in sorted(path.iterdir()):
            if entry.name in components or entry.name.startswith("."):
                continue
            if entry.is_dir():
                shutil.copytree(entry, partial / entry.name, copy_function=_link_or_copy)
            else:
                _link_or_copy(str(entry), str(partial / entry.name))
        for name in components:
            import diffusers

            start = time.perf_counter()
            config = json.loads((path / name / "config.json").read_text())
            cls = getattr(diffusers, config["_class_name"])
            transformer = cls.from_pretrained(str(path / name), torch_dtype=dtype).eval()
            before = sum(p.numel() * p.element_size() for p in transformer.parameters())
            manifest = save_quantized(transformer, adapter_for(transformer), partial / name, mode, modulation)
            follow_umask(partial / name)  # written here (the other components are links to the originals)
            after = sum(f.stat().st_size for f in (partial / name).glob("*.safetensors"))
            summary[name] = {"linears": len(manifest["layers"]), "bytes_before": before, "bytes_after": after}
            log(f"ditmesh quantize: {name}: {len(manifest['layers'])} linears in {mode}, {_size(before)} -> "
                f"{_size(after)} ({time.perf_counter() - start:.1f} s)")
        if out.exists():  # an empty folder (checked before)
            out.rmdir()
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return summary


def run_quantize(args) -> int:
    try:
        model, out, dtype_name = check_arguments(args)
    except ConfigError as exc:
        print(f"ditmesh quantize: error: {one_line(exc)}", file=sys.stderr)
        return 2
    modulation = modulation_quantized(args.quant, args.quant_modulation)
    quantize_pipeline(model, out, args.quant, modulation, dtype_name)
    print(f"ditmesh quantize: wrote {out} (run it with: ditmesh generate --model {out})")
    return 0
