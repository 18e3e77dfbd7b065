"""The phases of ``generate`` in the run's timeline (``ditmesh.timeline``): loading each component, and inside the
pipeline call, text encoding, each denoising step and the VAE decode.

Nothing here forks a pipeline: components are timed where diffusers loads them (its ``load_sub_model``, wrapped for
the length of ``from_pretrained``), and the call through ``timeline`` hooks (``ditmesh.hooks``) around the
pipeline's ``encode_prompt``, the transformers' ``forward`` and the VAE's ``decode``, removed after the call, plus
the step callback ``generate`` already has.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

from ..hooks import Hook, add_hook
from ..shared import atomic_write_bytes
from ..timeline import chrome_trace, timeline


@contextmanager
def timed_component_loading():
    """While open, each component diffusers' ``from_pretrained`` loads is a phase ``load <name>`` (diffusers'
    ``load_sub_model``, by the name it passes; left alone where a diffusers version calls it otherwise)."""
    from diffusers.pipelines import pipeline_utils

    original = getattr(pipeline_utils, "load_sub_model", None)
    if original is None:
        yield
        return

    def load_sub_model(*args, **kwargs):
        with timeline().phase(f"load {kwargs.get('name', 'component')}"):
            return original(*args, **kwargs)

    pipeline_utils.load_sub_model = load_sub_model
    try:
        yield
    finally:
        pipeline_utils.load_sub_model = original


class _PhaseHook(Hook):
    """Times every call of the method as phase ``label`` (the device synchronized at its end, so the phase holds
    the work it queued)."""

    name = "timeline"

    def __init__(self, label: str, sync):
        self.label = label
        self.sync = sync

    def __call__(self, owner, call_next, args, kwargs):
        with timeline().phase(self.label):
            out = call_next(args, kwargs)
            self.sync()
        return out


class _FirstCallHook(Hook):
    """Notes when the first call of a transformer in a pipeline call starts (the first step's start)."""

    name = "timeline"

    def __init__(self, starts: list):
        self.starts = starts

    def __call__(self, owner, call_next, args, kwargs):
        if not self.starts:
            self.starts.append(timeline().now())
        return call_next(args, kwargs)


class CallPhases:
    """The phases of one pipeline call on this rank: ``with CallPhases(...) as phases: pipe(...)``, calling
    :meth:`step_end` from the step callback. Recorded: ``pipeline call`` and in it ``text encoding``, ``prepare``
    (latents, timesteps: from the text encoding's end to the first transformer call), ``step i`` (step 0 from the
    first transformer call, its name saying ``compile`` / ``capture`` where it pays them), ``vae decode`` and
    ``postprocess`` (after the last step, the decode excepted)."""

    def __init__(self, pipe, transformers: dict, sync, first_step: str = "step 0"):
        self.pipe, self.transformers, self.sync, self.first_step = pipe, transformers, sync, first_step
        self.starts: list[float] = []
        self.step_ends: list[float] = []
        self._removers: list = []
        self._perf_to_timeline = 0.0  # set on entering: a perf_counter() reading + this = the timeline's seconds

    def __enter__(self):
        tl = timeline()
        self._perf_to_timeline = tl.now() - time.perf_counter()
        self._call = tl.phase("pipeline call")
        self._call.__enter__()
        if hasattr(self.pipe, "encode_prompt"):
            self._removers.append(add_hook(self.pipe, _PhaseHook("text encoding", self.sync), "encode_prompt"))
        vae = getattr(self.pipe, "vae", None)
        if vae is not None and hasattr(vae, "decode"):
            self._removers.append(add_hook(vae, _PhaseHook("vae decode", self.sync), "decode"))
        for model in self.transformers.values():
            self._removers.append(add_hook(model, _FirstCallHook(self.starts)))
        return self

    def step_end(self, perf: float) -> None:
        """Called by the step callback, after the device was synchronized: the current step ended at ``perf``, the
        ``time.perf_counter()`` reading the caller keeps for its own step times (one reading: a second clock read
        after a thread switch could put a step milliseconds off the caller's)."""
        self.step_ends.append(perf + self._perf_to_timeline)

    def __exit__(self, *exc):
        for remove in self._removers:
            remove()
        tl = timeline()
        encode_end = max((p["end_s"] for p in tl.phases if p["name"] == "text encoding"), default=None)
        if self.starts and encode_end is not None and self.starts[0] > encode_end:
            tl.add("prepare", encode_end, self.starts[0])
        begin = self.starts[0] if self.starts else None
        for i, end in enumerate(self.step_ends):
            if begin is not None:
                tl.add(self.first_step if i == 0 else f"step {i}", begin, end)
            begin = end
        if self.step_ends:
            decode = [p for p in tl.phases if p["name"] == "vae decode" and p["start_s"] >= self.step_ends[-1]]
            tail_start = decode[-1]["end_s"] if decode else self.step_ends[-1]
            tl.add("postprocess", tail_start, tl.now())
        self._call.__exit__(*exc)
        return False


def write_trace(path: str, ranks: list[dict]) -> None:
    """Write the timelines of ``ranks`` as a Chrome trace (JSON) to ``path`` (written whole, then renamed)."""
    atomic_write_bytes(path, json.dumps(chrome_trace(ranks)).encode())
