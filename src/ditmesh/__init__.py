"""ditmesh: run diffusers DiT pipelines across many GPUs with hybrid parallelism.

The package imports lazily: ``import ditmesh`` (and ``ditmesh --help``) loads neither torch nor diffusers
until ``parallelize`` or another name that needs them is used.
"""

import logging

from .config import ConfigError, ParallelConfig
from .options import LoraSpec, RunOptions

__version__ = "0.1.0"

# torchao (imported by diffusers when installed) warns about its optional CUDA kernels on machines without them and
# registers enums with torch's pytree, which warns on torch >= 2.12: in every process that imports ditmesh (the
# ranks of generate and serve too), so a one-line error stays one line
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

__all__ = ["ParallelConfig", "RunOptions", "LoraSpec", "ConfigError", "parallelize", "remove", "runtime_of", "ParallelRuntime", "__version__"]

_FROM_API = ("parallelize", "remove", "runtime_of", "ParallelRuntime")


def __getattr__(name: str):
    if name in _FROM_API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ditmesh' has no attribute {name!r}")
