"""Model adapters. Importing this package registers every adapter."""

from . import flux  # noqa: F401  (registers the FLUX adapter)
from .base import ModelAdapter, adapter_for, supported_classes

__all__ = ["ModelAdapter", "adapter_for", "supported_classes"]
