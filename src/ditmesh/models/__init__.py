"""Model adapters. Importing this package registers every adapter."""

from . import flux, sd3, wan  # noqa: F401  (each registers its adapter)
from .base import ModelAdapter, adapter_for, supported_classes

__all__ = ["ModelAdapter", "adapter_for", "supported_classes"]
