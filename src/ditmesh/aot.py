"""Compiled blocks kept between processes: torch's ahead-of-time compile (``torch.compile(...).aot_compile``).

With ``compile``, every new process traces each block class again with dynamo on its first step, even with
inductor's and triton's caches warm. With ``compile_artifacts="save"`` (e.g. ``ditmesh generate --warmup-only
--compile --compile-artifacts save``), each block class is compiled whole (``fullgraph``) from the inputs its first
block receives, with the block as the compiled function's first input so that every parameter is a graph input and
one artifact serves every block of the class, and the artifact is written to a folder of its own; with ``"load"``, a
later process (``generate``, ``serve``) reads it and runs the blocks through it without tracing anything. Off by
default: measured on one H200 (FLUX.1-dev architecture, docs/timeline.md) loading took longer than dynamo's warm
re-trace; on the 2-core CPU machine it is several times faster.

Safety: the artifact keeps torch's guards on the inputs (shapes, strides, dtypes, the parallel context the
processors read: ranks, group names, degrees); an input that fails them never runs the artifact (the call goes to
the ordinary ``torch.compile`` path, which traces that case). Guards that cannot be serialized (globals, the
processors' code objects) are dropped, so the folder is keyed by everything they covered: ditmesh's source, the
torch and diffusers versions, the transformer's class, config, dtype and device, every run option, the rank and the
world size (:func:`artifact_folder`). Only blocks whose own ``forward`` carries no ditmesh hook, or whose hooks run
a compiled inner forward (the step cache, PipeFusion), use artifacts; a block class that cannot be compiled whole
(a graph break) keeps the ordinary path, logged once. ``STATS`` counts what each process loaded, saved and fell back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("ditmesh")

#: guard kinds a saved artifact cannot hold (torch names them in ``CheckFunctionManager``; this is torch 2.13's list)
UNSERIALIZABLE = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                  "CLOSURE_MATCH", "WEAKREF_ALIVE")
#: this process's artifacts: ``loaded`` and ``saved`` (block class, seconds), ``fallbacks`` (block class, why)
STATS: dict[str, list] = {"loaded": [], "saved": [], "fallbacks": []}
#: artifacts of one block class and input layout at the most (each for another guarded context)
PER_LAYOUT = 8


def serializable_guards(entries) -> list[bool]:
    """The guard filter of a saved artifact: keep a guard unless it is global or it, or a guard derived from it,
    cannot be serialized (FLUX's processors give a constant match with a derived ``ID_MATCH`` on their code)."""
    from torch._dynamo.guards import CheckFunctionManager

    bad = set(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", UNSERIALIZABLE))
    return [not (g.is_global or g.guard_type in bad or any(d in bad for d in g.derived_guard_types)) for g in entries]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of ditmesh's Python source (the processors' code is not guarded in an artifact)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def artifact_folder(model: torch.nn.Module, options: dict, rank: int, world: int, component: str = "transformer",
                    root: Path | None = None) -> Path:
    """The folder of ``model``'s artifacts for this run: ``root`` (``$DITMESH_CACHE/compile/aot``) / a hash of
    everything the dropped guards covered / ``rank{rank}``."""
    import diffusers

    if root is None:
        from .config import cache_dir

        root = cache_dir() / "compile" / "aot"
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    config = dict(getattr(model, "config", {}) or {})
    key = {"ditmesh": source_hash(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "model": f"{type(model).__module__}.{type(model).__qualname__}", "component": component,
           "config": {k: v for k, v in config.items() if not k.startswith("_")},
           "dtype": str(param.dtype if param is not None else None), "device": device.type,
           "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
           "options": {k: v for k, v in options.items() if k != "compile_artifacts"}, "world": world}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return root / digest / f"rank{rank}"


def _signature(args: tuple, kwargs: dict) -> str:
    """A short name for a call's input layout (the artifact file of that layout)."""
    def describe(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), tuple(v.stride()), str(v.dtype), v.device.type)
        if isinstance(v, (tuple, list)):
            return tuple(describe(x) for x in v)
        if isinstance(v, dict):
            return tuple(sorted((k, describe(x)) for k, x in v.items()))
        return repr(v) if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__

    text = repr((describe(args), describe(kwargs)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ClassCompiler:
    """The blocks of one class: calls go to an artifact whose guards pass, else (in ``save`` mode, for a layout not
    seen yet) to a new artifact compiled and written now, else to the ordinary ``torch.compile`` of the class's
    forward."""

    def __init__(self, cls: type, folder: Path, mode: str, options: dict | None):
        self.cls, self.folder, self.mode, self.options = cls, folder, mode, options
        self.artifacts: list = []
        self.tried: dict[str, int] = {}  # layout -> artifacts of it looked at so far (-1: no more)
        self.whole = True  # False after the class failed to compile whole: no more attempts
        self._dynamo = None

    def dynamo(self):
        if self._dynamo is None:
            self._dynamo = torch.compile(self.cls.forward, options=self.options)
        return self._dynamo

    def __call__(self, block, *args, **kwargs):
        for fn in self.artifacts:
            if fn.guard_check(block, *args, **kwargs):
                return fn.fn(block, *args, **kwargs)
        if self.whole:
            # the artifacts of this input layout, one after the other: several when the guarded context differs
            # between calls of one layout (PipeFusion's patches, a cache's branches)
            sig = _signature(args, kwargs)
            n = self.tried.get(sig, 0)
            while 0 <= n < PER_LAYOUT:
                fn = self._load_or_save(sig, n, block, args, kwargs)
                if fn is None:
                    self.tried[sig] = -1
                    break
                self.artifacts.append(fn)
                n = self.tried[sig] = n + 1
                if fn.guard_check(block, *args, **kwargs):
                    return fn.fn(block, *args, **kwargs)
        return self.dynamo()(block, *args, **kwargs)

    def _load_or_save(self, sig: str, n: int, block, args, kwargs):
        """The artifact ``n`` of the layout ``sig``: read from the folder, else (saving) compiled from this call and
        written, else None."""
        path = self.folder / f"{self.cls.__qualname__}-{sig}-{n}.aot"
        name = self.cls.__qualname__
        if path.is_file():
            start = time.perf_counter()
            try:
                with open(path, "rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
            except Exception as e:  # noqa: BLE001  (a stale or broken file: compile instead)
                STATS["fallbacks"].append((name, f"{path.name} could not be loaded: {e}"))
                log.warning("ditmesh: compiled %s in %s could not be loaded (%s); compiling", name, path, e)
                return None
            STATS["loaded"].append((name, time.perf_counter() - start))
            return fn
        if self.mode != "save":
            STATS["fallbacks"].append((name, f"no artifact fits this call ({path.name} and later ones are missing); "
                                             "compiled the ordinary way"))
            return None
        start = time.perf_counter()
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):
                fn = torch.compile(self.cls.forward, fullgraph=True,
                                   options={**(self.options or {}), "guard_filter_fn": serializable_guards}
                                   ).aot_compile(((block, *args), kwargs))
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            fn.save_compiled_function(str(partial))
            os.replace(partial, path)
        except Exception as e:  # noqa: BLE001  (a graph break, an unpicklable graph: the ordinary path)
            self.whole = False
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            STATS["fallbacks"].append((name, reason))
            log.warning("ditmesh: %s could not be compiled ahead of time (%s); it is compiled the ordinary way",
                        name, reason)
            return None
        STATS["saved"].append((name, time.perf_counter() - start))
        return fn


def compilers(blocks: list, folder: Path, mode: str, options: dict | None) -> dict[type, ClassCompiler]:
    """One :class:`ClassCompiler` per block class: every class when saving, else only the classes with an artifact
    in ``folder`` (the others keep the ordinary compile, with no per-call cost)."""
    classes = dict.fromkeys(type(b) for b in blocks)
    if mode != "save":
        classes = [cls for cls in classes if any(Path(folder).glob(f"{cls.__qualname__}-*.aot"))]
    return {cls: ClassCompiler(cls, Path(folder), mode, options) for cls in classes}
