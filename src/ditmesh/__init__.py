"""ditmesh: run diffusers DiT pipelines across many GPUs with hybrid parallelism.

The package imports lazily: ``import ditmesh`` (and ``ditmesh --help``) loads neither torch nor diffusers
until ``parallelize`` or another name that needs them is used.
"""

from .config import ConfigError, ParallelConfig
from .options import LoraSpec, RunOptions

__version__ = "0.1.0"

__all__ = ["ParallelConfig", "RunOptions", "LoraSpec", "ConfigError", "parallelize", "remove", "runtime_of", "ParallelRuntime", "__version__"]

_FROM_API = ("parallelize", "remove", "runtime_of", "ParallelRuntime")


def __getattr__(name: str):
    if name in _FROM_API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ditmesh' has no attribute {name!r}")
