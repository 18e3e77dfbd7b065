"""The tiny trained text-to-image pipeline shipped inside ditmesh (FLUX.1 family, 64x64 shapes).

``default_model_path()`` is the shipped pipeline folder (``FluxPipeline.from_pretrained`` loads it);
``ditmesh.tiny.data`` draws the captioned data set and checks generated images, ``ditmesh.tiny.train``
retrains the weights and ``ditmesh.tiny.evaluate`` scores them. See docs/tiny.md.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Name of the metadata file inside the pipeline folder (``max_sequence_length``, ``default_size``).
META_FILE = "ditmesh_tiny.json"


def default_model_path() -> str:
    """The folder of the shipped tiny pipeline (``src/ditmesh/assets/tiny-flux``)."""
    return str(Path(__file__).resolve().parent.parent / "assets" / "tiny-flux")


def read_meta(model_path: str | None = None) -> dict:
    """The ``ditmesh_tiny.json`` of a tiny pipeline folder: generate must pass its ``max_sequence_length``."""
    return json.loads((Path(model_path or default_model_path()) / META_FILE).read_text())


def load_pipeline(model_path: str | None = None, device: str = "cpu", dtype=None):
    """``FluxPipeline.from_pretrained`` on the tiny pipeline folder (the shipped one by default)."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_path or default_model_path(), dtype=dtype or torch.float32)
    return pipe.to(device)
