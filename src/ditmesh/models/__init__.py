"""Model adapters, one file per family. Importing this package registers every adapter."""

from . import (allegro, chroma, cogvideox, cogview4, flux, flux2, hidream, hunyuan_dit, hunyuan_video, lumina2,  # noqa: F401
               ltx, mochi, pixart, qwenimage, sana, sd3, skyreels_v2, wan, zimage)  # (each registers its adapter)
from .base import ModelAdapter, adapter_for, adapter_for_class, adapters, supported_classes, synth_archs

__all__ = ["ModelAdapter", "adapter_for", "adapter_for_class", "adapters", "supported_classes", "synth_archs"]
