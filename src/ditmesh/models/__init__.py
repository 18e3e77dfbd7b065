"""Model adapters, one file per family. Importing this package registers every adapter."""

from . import chroma, cogview4, flux, flux2, hunyuan_dit, lumina2, pixart, qwenimage, sana, sd3, wan, zimage  # noqa: F401  (each registers its adapter)
from . import mochi, skyreels_v2  # noqa: F401
from .base import ModelAdapter, adapter_for, adapter_for_class, adapters, supported_classes, synth_archs

__all__ = ["ModelAdapter", "adapter_for", "adapter_for_class", "adapters", "supported_classes", "synth_archs"]
