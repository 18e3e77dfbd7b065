"""Model adapters, one file per family. Importing this package registers every adapter."""

from . import chroma, flux, lumina2, pixart, sana, sd3, wan  # noqa: F401  (each registers its adapter)
from .base import ModelAdapter, adapter_for, adapter_for_class, adapters, supported_classes, synth_archs

__all__ = ["ModelAdapter", "adapter_for", "adapter_for_class", "adapters", "supported_classes", "synth_archs"]
