"""The run report: latency per step, memory per rank, devices and versions (written with ``ditmesh.shared``)."""

from __future__ import annotations

import platform
import resource
import sys

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
