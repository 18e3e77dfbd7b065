"""What the GPU checks share: launching a check script on N local ranks (from a test), and a rank's start (inside
the script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

#: NVLink multicast off: the lent machines do not support it
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def torchrun(script: str, world: int, *args: str, timeout: int = 900) -> str:
    """Run ``script`` (a file beside this one) on ``world`` local ranks; its stdout. Fails the test on a non-zero
    exit, with the end of both outputs."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                           str(Path(__file__).with_name(script)), *args],
                          env=dict(os.environ, **NO_MULTICAST), capture_output=True, text=True, timeout=timeout)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def start_tiny_rank():
    """Inside a torchrun script: this rank's NCCL group on its GPU and the tiny trained pipeline there (float32);
    returns ``(rank, world, pipe)``. A rank stuck in a collective prints where it is and exits after
    ``$DITMESH_CHECK_TIMEOUT_S`` (600), rather than holding the test until its timeout."""
    import faulthandler

    import torch.distributed as dist
    from diffusers import DiffusionPipeline

    from ditmesh.tiny import default_model_path

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulthandler.dump_traceback_later(float(os.environ.get("DITMESH_CHECK_TIMEOUT_S", "600")), exit=True)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    pipe = DiffusionPipeline.from_pretrained(default_model_path(), dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    return rank, world, pipe
