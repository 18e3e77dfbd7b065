"""Model adapters, one file per family. Importing this package registers every adapter."""

from . import allegro, chroma, cogview4, flux, flux2, hunyuan_dit, lumina2, ltx, pixart, qwenimage, sana, sd3, wan, zimage  # noqa: F401  (each registers its adapter)
from .base import ModelAdapter, adapter_for, adapter_for_class, adapters, supported_classes, synth_archs

__all__ = ["ModelAdapter", "adapter_for", "adapter_for_class", "adapters", "supported_classes", "synth_archs"]
