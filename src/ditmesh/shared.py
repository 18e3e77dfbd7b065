"""What every tool shares (synth, runtime, bench, planner, tiny): dtype names, atomic file writes, argv edits.

It imports nothing else of ditmesh, so any tool can use it without an import cycle, and not torch either
(``DTYPES`` imports it on first use), so command-line checks stay fast.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

#: dtype names the command line accepts -> torch's name for them
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none): how every tool reports an error."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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
