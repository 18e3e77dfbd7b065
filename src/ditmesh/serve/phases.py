"""What a served request spends its time on, per rank (its timeline), and the cache of prompt embeddings.

A rank times each phase of a pipeline call with ``timeline`` hooks (the outermost of each chain): the text
encoding (``encode_prompt``) and the VAE decode (``vae.decode``), and the transformer's first call; the steps are
timed by the step callback. On a GPU each boundary is a CUDA event, read after the call, so that the seconds are
the device's without a synchronization inside the call (:class:`Timeline`). ``prompt_cache`` answers
``encode_prompt`` for arguments it has seen, with a copy of what the encoders returned then (the same values:
a served picture does not change), the least recently used entry going first.

Cross-rank rule: every rank runs the same calls in the same order, so every rank's cache holds the same entries
and hits on the same call (a tensor-parallel group's ``encode_once`` broadcast is skipped on every rank alike).
"""

from __future__ import annotations

import collections
import time

import torch
from diffusers.image_processor import VaeImageProcessor

from ..api import transformers_of
from ..hooks import Hook, add_hook

#: the phases a rank reports, in the order they run
RANK_PHASES = ("lora_switch", "text_encode", "prepare", "steps", "vae_decode", "postprocess")


class Timeline:
    """The phase seconds of the call in flight on this rank, on the device's clock. Each boundary is a mark: the
    host's time and, on a GPU, a CUDA event recorded on the current stream. Nothing inside the call waits for the
    GPU to time it (the host launches the next phase while the GPU ends the last: the text encoding's kernels run
    while the host prepares the latents, the VAE's are launched while the last step runs); the events are read once
    the call has ended, its pictures on the host."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.spans: list[tuple[str, tuple, tuple]] = []  # (phase, start mark, end mark) in the order they ended
        self.step_marks: list[tuple] = []  # the end of each denoising step
        self.first_call: tuple | None = None  # the transformer's first call

    def mark(self) -> tuple:
        """Now: ``(perf_counter(), event)``, the event recorded on the current CUDA stream (None off a GPU)."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def add(self, phase: str, start: tuple) -> None:
        """Count from the mark ``start`` to now to ``phase``."""
        self.spans.append((phase, start, self.mark()))

    def step_end(self) -> None:
        """A denoising step ended (the step callback)."""
        self.step_marks.append(self.mark())

    def report(self, start: tuple, end: tuple) -> dict:
        """The call's phases (seconds) from its first mark ``start`` to its last ``end`` (taken once the pictures are
        on the host): those timed by hooks, ``prepare`` (from the end of the text encoding, or the call's start, to
        the transformer's first call: latents, timesteps, the call's set-up), ``steps`` (from then to the last step's
        end), ``postprocess`` (the rest after the VAE), the first step's, the median later step's (``step``) and the
        slowest later step's (``step_max``) seconds, and ``call`` (all of it, on the host's clock). On a GPU every
        mark is read on the GPU's clock (its event's time from ``start``'s, the GPU idle when a call begins)."""
        if end[1] is not None:
            end[1].synchronize()

        def at(mark: tuple) -> float:
            host, event = mark
            return host if event is None or start[1] is None else start[0] + start[1].elapsed_time(event) / 1000

        seconds: dict[str, float] = collections.defaultdict(float)
        ended: dict[str, float] = {}
        for phase, begun, finished in self.spans:
            seconds[phase] += at(finished) - at(begun)
            ended[phase] = at(finished)
        out = {k: round(v, 4) for k, v in seconds.items()}
        steps = [at(mark) for mark in self.step_marks]
        if steps:
            begin = ended.get("text_encode", start[0])
            if self.first_call is not None:
                out["prepare"] = round(at(self.first_call) - begin, 4)
                begin = at(self.first_call)
            out["steps"] = round(steps[-1] - begin, 4)
            out["first_step"] = round(steps[0] - begin, 4)
            later = sorted(b - a for a, b in zip(steps, steps[1:]))
            if later:
                out["step"] = round(later[len(later) // 2], 4)
                out["step_max"] = round(later[-1], 4)
        after = ended.get("vae_decode", steps[-1] if steps else start[0])
        out["postprocess"] = round(at(end) - after, 4)
        out["call"] = round(end[0] - start[0], 4)
        return out


class Timed(Hook):
    """The ``timeline`` hook: the seconds of the method it wraps go to ``phase``."""

    name = "timeline"

    def __init__(self, timeline: Timeline, phase: str):
        self.timeline, self.phase = timeline, phase

    def __call__(self, owner, call_next, args, kwargs):
        start = self.timeline.mark()
        out = call_next(args, kwargs)
        self.timeline.add(self.phase, start)
        return out


class FirstCall(Hook):
    """The ``timeline`` hook on a transformer: marks where the call's first step begins (on a GPU, where the stream
    reaches it: after what came before it)."""

    name = "timeline"

    def __init__(self, timeline: Timeline):
        self.timeline = timeline

    def __call__(self, owner, call_next, args, kwargs):
        if self.timeline.first_call is None:
            self.timeline.first_call = self.timeline.mark()
        return call_next(args, kwargs)


class PromptCache(Hook):
    """The ``prompt_cache`` hook around ``encode_prompt``: up to ``size`` results kept by their arguments (and
    ``context()``, e.g. the LoRA adapter chosen, which may adapt the text encoders). A call whose arguments hold
    a tensor (embeddings given) goes through."""

    name = "prompt_cache"

    def __init__(self, size: int, context=lambda: None):
        self.size, self.context = size, context
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.hits = self.misses = 0

    def __call__(self, owner, call_next, args, kwargs):
        key = _key((args, sorted(kwargs.items()), self.context()))
        if key is None:
            return call_next(args, kwargs)
        if key in self.entries:
            self.entries.move_to_end(key)
            self.hits += 1
            return _copy(self.entries[key])
        self.misses += 1
        out = call_next(args, kwargs)
        self.entries[key] = _copy(out)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return out


class DevicePictures(Hook):
    """The ``pictures`` hook around a ``VaeImageProcessor``'s ``postprocess`` to PIL: the pixels rounded to 8 bits
    where the decoded image is (the device), so a quarter of the bytes crosses to the host and no float array is
    made there. Exact: diffusers takes the denormalized image to the host as float32, multiplies by 255 and rounds
    half to even (numpy); here the same float32 product is rounded half to even by torch on the device, which gives
    the same bytes (tests/test_serve_phases.py). Other output types and arguments go through unchanged."""

    name = "pictures"

    def __call__(self, owner, call_next, args, kwargs):
        bound = dict(zip(("image", "output_type", "do_denormalize"), args), **kwargs)
        image = bound.get("image")
        if bound.get("output_type", "pil") != "pil" or not isinstance(image, torch.Tensor) or image.ndim != 4 \
                or image.shape[1] not in (1, 3):
            return call_next(args, kwargs)
        return pil_pictures(call_next((image,), {"output_type": "pt", "do_denormalize": bound.get("do_denormalize")}))


def pil_pictures(images: torch.Tensor) -> list:
    """``[batch, channels, height, width]`` values in [0, 1] as PIL pictures, rounded as diffusers' ``numpy_to_pil``
    rounds them (float32 times 255, half to even), on the images' device. The rounding runs on the images' own
    layout and only the 8-bit pixels are put in rows of pixels there (on a GPU a copy of a few microseconds), so
    one contiguous copy crosses to the host and PIL gets rows it takes as they are (from a channels-first array it
    would gather every pixel's channels on the host: ~8 ms at 1024²)."""
    from PIL import Image

    pixels = (images.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()
    if pixels.shape[-1] == 1:
        return [Image.fromarray(p.squeeze(-1), mode="L") for p in pixels]
    return [Image.fromarray(p) for p in pixels]


def _key(value):
    """A hashable form of ``value`` (strings, numbers, devices, dtypes, None, and sequences of them); None when it
    holds anything else (a tensor)."""
    if value is None or isinstance(value, (str, int, float, bool, torch.device, torch.dtype)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        items = [_key(v) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    return None


def _copy(value):
    """``value`` with every tensor in it cloned (the pipeline may write into what it is given)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def instrument(pipe, device, prompt_cache: int, context=lambda: None) -> tuple[Timeline, PromptCache | None]:
    """Time ``pipe``'s text encoding and VAE decode, and cache up to ``prompt_cache`` encodings (0: none)."""
    timeline = Timeline(device)
    cache = None
    if hasattr(pipe, "encode_prompt"):
        add_hook(pipe, Timed(timeline, "text_encode"), method="encode_prompt")
        if prompt_cache > 0:
            cache = PromptCache(prompt_cache, context)
            add_hook(pipe, cache, method="encode_prompt")
    for transformer in transformers_of(pipe).values():
        add_hook(transformer, FirstCall(timeline))
    vae = getattr(pipe, "vae", None)
    if vae is not None and hasattr(vae, "decode"):
        add_hook(vae, Timed(timeline, "vae_decode"), method="decode")
    processor = getattr(pipe, "image_processor", None)
    if type(processor) is VaeImageProcessor:  # its postprocess, not a subclass's (which may add to it)
        add_hook(processor, DevicePictures(), method="postprocess")
    return timeline, cache
