"""The default `ditmesh generate` (what `make demo` runs) draws what its prompt says, in parallel."""

from __future__ import annotations

import json
import subprocess
import sys

from PIL import Image

from ditmesh.runtime.models import default_model
from ditmesh.tiny import default_model_path
from ditmesh.tiny.data import classify


def test_default_model_is_the_shipped_tiny_pipeline():
    assert default_model() == default_model_path()


def test_demo_command_draws_its_prompt_with_two_ulysses_ranks(tmp_path):
    out = tmp_path / "demo.png"
    proc = subprocess.run([sys.executable, "-m", "ditmesh", "generate", "--nproc", "2", "--ulysses", "2",
                           "--prompt", "a blue triangle at the bottom right", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reading = classify(Image.open(out))
    assert (reading.colour, reading.shape, reading.position) == ("blue", "triangle", "bottom right")
    report = json.loads(out.with_name(out.name + ".json").read_text())
    assert report["model"] == default_model_path() and report["world_size"] == 2
