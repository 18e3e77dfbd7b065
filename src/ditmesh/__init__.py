"""ditmesh: run diffusers DiT pipelines across many GPUs with hybrid parallelism."""

from .api import ParallelRuntime, parallelize, remove, runtime_of
from .config import ConfigError, ParallelConfig

__version__ = "0.1.0"

__all__ = ["ParallelConfig", "ConfigError", "parallelize", "remove", "runtime_of", "ParallelRuntime", "__version__"]
