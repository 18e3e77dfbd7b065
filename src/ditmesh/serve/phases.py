"""What a served request spends its time on, per rank (its timeline), and the cache of prompt embeddings.

A rank times each phase of a pipeline call with ``timeline`` hooks (the outermost of each chain): the text
encoding (``encode_prompt``) and the VAE decode (``vae.decode``), each ended by a device synchronization so that
the seconds are the device's; the steps are timed by the step callback. ``prompt_cache`` answers
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
    """The phase seconds of the call in flight on this rank."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.ended: dict[str, float] = {}  # phase -> when it last ended (perf_counter)
        self.step_ends: list[float] = []
        self.first_call: float | None = None  # when the transformer was first called (perf_counter)
        #: on a GPU: events recorded at the first call and at each step's end, read once the call has ended (the
        #: steps' seconds as the GPU ran them, beside the host's)
        self.gpu_marks: list = []

    def mark_gpu(self) -> None:
        """Record an event where the device's stream stands now (CUDA only; no synchronization)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.gpu_marks.append(event)

    def step_end(self) -> None:
        """A denoising step ended (the step callback): its host time, and its event on a GPU."""
        self.mark_gpu()
        self.step_ends.append(time.perf_counter())

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, phase: str, start: float) -> float:
        """Count ``perf_counter() - start`` to ``phase`` (after a device synchronization); returns the end."""
        self.sync()
        end = time.perf_counter()
        self.seconds[phase] += end - start
        self.ended[phase] = end
        return end

    def report(self, start: float, end: float) -> dict:
        """The call's phases (seconds): those timed by hooks, ``prepare`` (from the end of the text encoding, or the
        call's start, to the transformer's first call: latents, timesteps, the call's set-up), ``steps`` (from then
        to the last step's end), ``postprocess`` (the rest after the VAE), the first step's and the median later
        step's seconds, the slowest later step's (``step_max``), on a GPU the steps' and the median step's seconds
        on its own clock (``steps_gpu``, ``step_gpu``), and ``call`` (all of it)."""
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        if self.step_ends:
            begin = self.ended.get("text_encode", start)
            if self.first_call is not None:
                out["prepare"] = round(self.first_call - begin, 4)
                begin = self.first_call
            out["steps"] = round(self.step_ends[-1] - begin, 4)
            out["first_step"] = round(self.step_ends[0] - begin, 4)
            later = sorted(b - a for a, b in zip(self.step_ends, self.step_ends[1:]))
            if later:
                out["step"] = round(later[len(later) // 2], 4)
                out["step_max"] = round(later[-1], 4)
        if len(self.gpu_marks) > 2 and len(self.gpu_marks) == len(self.step_ends) + 1:
            # the GPU's own clock, read after the call's last synchronization: from the first call to the last
            # step's end, and the median step (what the host's step times hide: the GPU idle between steps)
            self.gpu_marks[-1].synchronize()
            gaps = sorted(a.elapsed_time(b) / 1000 for a, b in zip(self.gpu_marks[1:], self.gpu_marks[2:]))
            out["steps_gpu"] = round(self.gpu_marks[0].elapsed_time(self.gpu_marks[-1]) / 1000, 4)
            out["step_gpu"] = round(gaps[len(gaps) // 2], 4)
        after = self.ended.get("vae_decode", self.step_ends[-1] if self.step_ends else start)
        out["postprocess"] = round(end - after, 4)
        out["call"] = round(end - start, 4)
        return out


class Timed(Hook):
    """The ``timeline`` hook: the seconds of the method it wraps go to ``phase``."""

    name = "timeline"

    def __init__(self, timeline: Timeline, phase: str):
        self.timeline, self.phase = timeline, phase

    def __call__(self, owner, call_next, args, kwargs):
        start = time.perf_counter()
        out = call_next(args, kwargs)
        self.timeline.add(self.phase, start)
        return out


class FirstCall(Hook):
    """The ``timeline`` hook on a transformer: notes when the call's first step began (host time, no sync: what
    came before it was launched, the device may still run it)."""

    name = "timeline"

    def __init__(self, timeline: Timeline):
        self.timeline = timeline

    def __call__(self, owner, call_next, args, kwargs):
        if self.timeline.first_call is None:
            self.timeline.first_call = time.perf_counter()
            self.timeline.mark_gpu()
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
