"""What every tool shares (synth, runtime, bench, planner, tiny): dtype names, atomic file writes, argv edits.

It imports nothing else of ditmesh, so any tool can use it without an import cycle, and not torch either
(``DTYPES`` imports it on first use), so command-line checks stay fast.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
from pathlib import Path

#: dtype names the command line accepts -> torch's name for them
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def quiet_libraries() -> None:
    """What every process that runs a pipeline sets before torch, transformers and diffusers load: their progress
    bars, verbosity and warnings off, so a one-line error stays one line."""
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


@contextlib.contextmanager
def imports_without_gc():
    """Import torch, diffusers and the like with Python's cyclic garbage collector paused, then freeze the heap
    (:func:`freeze_heap`).

    Those imports build a few hundred thousand objects that live as long as the process and hold almost no garbage
    cycles; the collector's full passes over them while they load (seven in ``import torch, diffusers; from diffusers
    import FluxPipeline``) took about 1 s of CPU in a 6 s import on the 2-core machine (``gc.callbacks``; docs/
    timeline.md), and each later full pass (while weights load, while dynamo traces) walked them all again. Where
    nothing new was imported (a process that runs several commands, as the test suite's workers do), nothing is
    frozen: what earlier commands left is not kept from the collector."""
    import sys

    enabled, modules = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            freeze_heap()
        if enabled:
            gc.enable()


def freeze_heap() -> None:
    """Move every object alive now to the collector's permanent generation (``gc.freeze``): later full collections
    skip them. Reference counting still frees each of them as before; only a garbage cycle among them would stay
    (the modules, a loaded pipeline and its compiled blocks live as long as the process anyway)."""
    gc.freeze()


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none): how every tool reports an error."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def no_cuda_here() -> bool:
    """Whether torch will certainly find no CUDA device here, known without importing it: ``CUDA_VISIBLE_DEVICES``
    hides every GPU, or no GPU driver is loaded (neither NVIDIA's ``/proc/driver/nvidia`` nor ROCm's ``/dev/kfd``).
    False means "may have one": the ranks then check with torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return True
    return not (Path("/proc/driver/nvidia").exists() or Path("/dev/kfd").exists())


def __getattr__(name: str):
    if name == "DTYPES":  # dtype name -> torch.dtype, built on first use
        import torch

        return {key: getattr(torch, value) for key, value in DTYPE_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def current_umask() -> int:
    """The process umask (read without changing it for longer than one call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(folder: str | os.PathLike) -> None:
    """Give every file written into ``folder`` (a folder of our own making) the mode the umask gives a new file:
    libraries that write through private temporary files (safetensors' writer) leave them 0600."""
    mode = 0o666 & ~current_umask()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes private files; outputs follow the umask
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def cpu_threads(processes: int) -> int:
    """The one thread policy of every CPU path: each of ``processes`` processes started together gets this
    machine's cores shared (at least one each). A one-process run is ``processes=1``; a benchmark gives its
    one-process reference the threads of its ranks (``processes``: the most ranks of its rows)."""
    return max(1, (os.cpu_count() or 1) // processes)


def share_cpu_threads(env: dict, processes: int) -> None:
    """Set ``OMP_NUM_THREADS`` in ``env`` (unless the user set it) to :func:`cpu_threads` of ``processes``."""
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads(processes)))


def cpu_load(threads: int) -> dict:
    """What a CPU timing ran against: this machine's ``cores``, the 1-minute load average before the run
    (``load_1min``), the run's ``threads`` in all, and ``warning``: one line when the load and the run's threads
    together ask for a whole core more than there are (the timing then measures the contention), else None."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not known on this system
        return {"cores": cores, "load_1min": None, "threads": threads, "warning": None}
    warning = None
    if load + threads - cores >= 1:
        warning = (f"ditmesh: warning: this machine is busy (1-minute load {load:.1f} on {cores} cores, and this run "
                   f"adds {threads} threads): CPU timings will measure the contention more than the run")
    return {"cores": cores, "load_1min": round(load, 2), "threads": threads, "warning": warning}


def strip_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without the option ``name`` and its value (``--name v`` and ``--name=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def model_source(model: str, arch_names) -> str:
    """What a ``--model`` value names: ``"arch"`` (a ``ditmesh synth`` architecture), ``"folder"`` (a diffusers
    pipeline folder) or ``"hub"`` (a Hugging Face hub id, ``org/name``). ``generate``, ``serve``, ``analyze`` and
    ``plan`` take the same values; anything else is a ValueError with one line saying what would do.

    ``arch_names()`` gives the architecture names; it is called only for a value without ``/`` (no architecture
    name has one), so a path or a hub id is answered without importing the adapters (and torch).
    """
    if "/" not in model and model in arch_names():
        return "arch"
    path = Path(model).expanduser()
    if path.is_file():
        raise ValueError(f"--model {model}: is a file; give the pipeline folder that holds model_index.json and "
                         f"the component folders (e.g. one written by `ditmesh synth`), a hub id (org/name) or an "
                         f"architecture name (`ditmesh synth --list`)")
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise ValueError(f"--model {model}: folder has no model_index.json; give a diffusers pipeline folder "
                             f"(e.g. one written by `ditmesh synth`)")
        return "folder"
    if model.count("/") == 1 and not model.startswith((".", "/", "~")) and all(model.split("/")):
        return "hub"
    names = ", ".join(sorted(arch_names()))
    raise ValueError(f"--model {model}: no such folder; give a diffusers pipeline folder (e.g. one written by "
                     f"`ditmesh synth`), a hub id (org/name) or a synthetic architecture ({names})")


def hub_config_folder(repo_id: str, files: tuple[str, ...] = ("model_index.json", "transformer/config.json")) -> str:
    """A local folder holding ``files`` of hub model ``repo_id`` (the Hugging Face cache, downloaded when missing;
    offline, what the cache holds). Reading a configuration downloads no weights. ValueError (one line) naming the
    id when they cannot be had (no network, unknown or gated id)."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=list(files))
    except Exception as exc:  # noqa: BLE001  (offline, not found, gated, ...: one line naming the id)
        raise ValueError(f"--model {repo_id}: could not read {files[-1]} of this hub id ({one_line(exc)}); check the "
                         f"id and the network (gated models need `hf auth login`), or `hf download {repo_id} "
                         f"--local-dir DIR` and pass DIR") from None
    if not (Path(folder) / files[-1]).is_file():
        raise ValueError(f"--model {repo_id}: the hub id has no {files[-1]}; give a diffusers pipeline with a "
                         f"transformer")
    return folder


def add_quant_flags(parser) -> None:
    """``--quant``, ``--quant-keep-modulation`` and ``--quant-modulation`` (generate, serve, bench, plan, quantize)."""
    parser.add_argument("--quant", default=None, metavar="MODE",
                        help="the linears of the transformer blocks in 8 bits: fp8 (weights and activations, per-row "
                             "scales; GPUs with fp8: Ada, Hopper), fp8-weight (weights alone), int8-weight (weights "
                             "alone; any device), off (default). docs/quantization.md")
    modulation = parser.add_mutually_exclusive_group()
    modulation.add_argument("--quant-keep-modulation", dest="quant_modulation", action="store_const", const=False,
                            default=None, help="with --quant: keep the AdaLN modulation linears in the model's dtype "
                                               "(fp8-weight's default)")
    modulation.add_argument("--quant-modulation", dest="quant_modulation", action="store_const", const=True,
                            help="with --quant: quantize the AdaLN modulation linears too (the default of fp8 and "
                                 "int8-weight)")


def empty_output(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path; FileExistsError if it holds anything (``synth`` asks before it imports torch)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output folder {out} exists and is not empty; choose a new --out or remove it")
    return out
