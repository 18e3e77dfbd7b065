"""Model adapters, one file per family, imported on demand: :mod:`.registry` names the module of every
transformer class and synthetic architecture without importing any (nor torch), and ``adapter_for_class`` imports
the one a model needs. ``adapters()`` imports them all."""

_FROM_BASE = ("ModelAdapter", "adapter_for", "adapter_for_class", "adapters", "supported_classes", "synth_archs")

__all__ = list(_FROM_BASE)


def __getattr__(name: str):
    if name == "supported_classes":  # from the registry's table: no torch
        from .registry import supported_classes

        return supported_classes
    if name in _FROM_BASE:  # base imports torch: only when one of these is used
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module 'ditmesh.models' has no attribute {name!r}")
