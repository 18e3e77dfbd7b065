"""The run report: latency per step, memory per rank, devices and versions."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import tempfile
from pathlib import Path

import torch


def versions() -> dict[str, str]:
    """Versions of the software that shaped a run."""
    import diffusers
    import transformers

    from .. import __version__

    out = {
        "ditmesh": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda or torch.version.hip)
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001  (ROCm/RCCL builds)
            pass
    return out


def device_name(device: torch.device) -> str:
    """Human name of a device, e.g. ``NVIDIA H100 80GB HBM3`` or ``cpu (x86_64)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on GPUs, the process's max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


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
