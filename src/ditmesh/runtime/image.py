"""Image-conditioned runs of ``ditmesh generate --image PATH [--mask PATH] [--strength S] [--image-mode MODE]``, and
of ``--image PATH --frames N`` for a video family (image-to-video: the image is the first frame).

The family's adapter lists its image-conditioned pipelines (``ModelAdapter.image_pipelines``); the run loads the same
checkpoint folder with the chosen class. Which one, in this order:

1. ``--image-mode MODE`` when given;
2. the checkpoint's own pipeline class (``model_index.json``) when it is one of them (an editing or a fill
   checkpoint runs the pipeline it was made for);
3. otherwise the family's first pipeline without a mask, or with ``--mask`` its first pipeline with one.

The arguments are checked before torch is imported where they can be: the files (readable images), a mask without an
image, a strength outside (0, 1]; what depends on the family (a mode it lacks, a mask the pipeline cannot take, a
checkpoint whose transformer does not fit the pipeline, ``--frames`` for an image family) is checked once the family is
known, before any weight loads.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..config import ConfigError


def image_args_given(args) -> bool:
    """Whether the run is image-conditioned (``--image``)."""
    return getattr(args, "image", None) is not None


def check_image_args(args) -> None:
    """The checks that need only the arguments (no torch): raise :class:`ConfigError` with one line."""
    image, mask = getattr(args, "image", None), getattr(args, "mask", None)
    strength, mode = getattr(args, "strength", None), getattr(args, "image_mode", None)
    if image is None:
        for flag, value in (("--mask", mask), ("--strength", strength), ("--image-mode", mode)):
            if value is not None:
                raise ConfigError(f"{flag} needs --image PATH (the condition image)")
        return
    if strength is not None and not (math.isfinite(strength) and 0 < strength <= 1):
        raise ConfigError(f"--strength {strength} must be in (0, 1] (1 = start from noise; e.g. 0.6)")
    for flag, path in (("--image", image), ("--mask", mask)):
        if path is not None:
            check_image_file(flag, path)


def check_image_file(flag: str, path: str) -> None:
    """Raise :class:`ConfigError` unless ``path`` is a file Pillow can read as an image."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).expanduser().is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    try:
        with Image.open(Path(path).expanduser()) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ConfigError(f"{flag} {path}: not an image Pillow can read ({type(exc).__name__})") from None


def choose_image_pipeline(args, adapter, checkpoint_pipeline: str | None, transformer_config: dict | None):
    """The family's :class:`~ditmesh.models.base.ImagePipeline` for this run (see the module docstring); raises
    :class:`ConfigError` with one line when the family, the mask, ``--strength`` or the checkpoint does not fit."""
    try:
        chosen = adapter.image_pipeline(getattr(args, "image_mode", None), checkpoint_pipeline,
                                        getattr(args, "mask", None) is not None)
    except ValueError as exc:
        raise ConfigError(f"--image: {exc}") from None
    mask = getattr(args, "mask", None) is not None
    if chosen.mask and not mask:
        raise ConfigError(f"--image-mode {chosen.mode} ({chosen.pipeline}) needs --mask PATH (white = repaint)")
    if mask and not chosen.mask:
        modes = [p.mode for p in adapter.image_pipelines if p.mask]
        raise ConfigError(f"--mask: {chosen.mode} ({chosen.pipeline}) takes no mask; use --image-mode "
                          f"{' or '.join(modes)}" if modes else f"--mask: {adapter.name} has no masked pipeline")
    if getattr(args, "strength", None) is not None and not chosen.strength:
        raise ConfigError(f"--strength: {chosen.mode} ({chosen.pipeline}) has no strength; leave it out")
    why = chosen.check(transformer_config) if chosen.check and transformer_config else None
    if why:
        raise ConfigError(f"--image-mode {chosen.mode}: {why}")
    if chosen.setup is not None:
        chosen.setup()
    return chosen


def image_call_kwargs(args, height: int | None, width: int | None) -> dict:
    """The pipeline-call arguments of an image-conditioned run: the images (RGB, mask as grey levels), the strength,
    and ``max_area`` (editing pipelines scale the output to it: the output keeps the asked size)."""
    from PIL import Image

    kwargs = {"image": Image.open(Path(args.image).expanduser()).convert("RGB")}
    if getattr(args, "mask", None) is not None:
        kwargs["mask_image"] = Image.open(Path(args.mask).expanduser()).convert("L")
    if getattr(args, "strength", None) is not None:
        kwargs["strength"] = args.strength
    if height and width:
        kwargs["max_area"] = height * width
    return kwargs


def image_report(args, pipe, call: dict) -> dict:
    """The report's image fields: the pipeline class, the condition files, and the strength the call used."""
    import inspect

    if not image_args_given(args):
        return {"pipeline": type(pipe).__name__, "image": None}
    default = inspect.signature(pipe.__call__).parameters.get("strength")
    strength = call.get("strength", default.default if default is not None else None)
    return {"pipeline": type(pipe).__name__, "image": args.image, "mask": getattr(args, "mask", None),
            "strength": strength}
