"""Start N local ranks of a ditmesh command through torch's elastic launcher.

``ditmesh generate --nproc N ...`` re-runs itself as ``python -m ditmesh ...`` (without ``--nproc``) in
N processes with RANK/WORLD_SIZE/MASTER_* set, exactly as ``torchrun --nproc-per-node N`` would.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from ..testing import free_port


class LaunchError(RuntimeError):
    """One or more ranks exited with an error."""


def launch_local(nproc: int, argv: list[str], log_dir: str | None = None) -> int:
    """Run ``python -m ditmesh <argv>`` on ``nproc`` local ranks; return 0 or raise LaunchError.

    ``log_dir``: where the launcher keeps its per-run folder (default: a new ``torchelastic_*`` folder in the
    temporary directory, left behind).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ditmesh-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "ditmesh", *argv)
    except ChildFailedError as exc:
        failed = sorted(exc.failures)
        first = exc.failures[failed[0]]
        raise LaunchError(f"rank {first.local_rank} exited with code {first.exitcode} "
                          f"({len(failed)} of {nproc} ranks failed); its error is printed above") from None
    return 0
