"""What a request may ask for: the JSON bodies of ``POST /generate`` and ``POST /v1/images/generations`` turned
into the options of one pipeline call, or one clear message why not (:class:`BadRequest`, answered with a 4xx).

One rule for the status: 400 for a request no server would run (not JSON, an unknown field, a wrong type, a value
outside what the option means: ``n`` 0, ``steps`` -3, a size not a multiple of 16); 422 for a valid value over this
server's limits (``--max-pixels``, ``--max-steps``, ``--max-frames``, ``--max-n``) or that the pipeline refused. The
JSON error names the field (``{"error": {"message", "code", "field"}}``) and the message says what would work.

Nothing here imports torch: a bad request is answered without touching the workers. The options a request
gives are the names of ``generate``'s options (``steps``, ``seed``, ``guidance``, ``negative_prompt``,
``true_cfg_scale``, ``height``, ``width``, ``frames``, and ``n`` for ``--images-per-prompt``); those it leaves out
keep the values the server was started with. Paths never come from a request.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

#: the longest prompt a request may send (characters)
MAX_PROMPT_CHARS = 4000
#: the largest seed (torch's generators take 64-bit seeds; JSON clients often hold 63)
MAX_SEED = 2**63 - 1


class BadRequest(ValueError):
    """A request the service refuses; ``status`` is the HTTP code (400, or 422 for a value over this server's limits)
    and ``field`` the request field at fault (None when it is the body as a whole)."""

    def __init__(self, message: str, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


def check_range(name: str, value: int, limit: int, flag: str) -> None:
    """``value`` of field ``name`` must be at least 1 (else 400: no server runs it) and at most ``limit`` (else 422:
    this server's ``flag`` refuses it)."""
    if value < 1:
        raise BadRequest(f"{name} {value} must be >= 1 (this server takes 1 to {limit})", 400, name)
    if value > limit:
        raise BadRequest(f"{name} {value} is over this server's limit: 1 to {limit} ({flag})", 422, name)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for at most (``serve --max-pixels --max-steps --max-frames --max-n``)."""

    max_pixels: int
    max_steps: int
    max_frames: int
    max_n: int


#: native fields -> (type, the option of ``generate`` it sets)
NATIVE_FIELDS = {
    "prompt": (str, "prompt"),
    "negative_prompt": (str, "negative_prompt"),
    "steps": (int, "steps"),
    "seed": (int, "seed"),
    "guidance": (float, "guidance"),
    "true_cfg_scale": (float, "true_cfg_scale"),
    "height": (int, "height"),
    "width": (int, "width"),
    "frames": (int, "frames"),
    "n": (int, "images_per_prompt"),
    "lora": (str, "adapter"),
}

#: fields of OpenAI's image generation request that are accepted; ``model`` and ``user`` are taken and ignored;
#: ``lora`` (the adapter, as in the native API) is the one field of ours, sent by OpenAI's clients as ``extra_body``
OPENAI_FIELDS = ("prompt", "n", "size", "response_format", "model", "user", "lora")


def parse_json(body: bytes) -> dict:
    """The JSON object of a request body; NaN and infinities (which Python's json would accept) are refused."""

    def no_constants(name):
        raise BadRequest(f"{name} is not a finite number; JSON numbers must be finite")

    try:
        value = json.loads(body or b"null", parse_constant=no_constants)
    except BadRequest:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object, e.g. {\"prompt\": \"a red circle\"}")
    return value


def _typed(name: str, value, kind: type):
    if kind is str:
        if not isinstance(value, str):
            raise BadRequest(f"{name} must be a string", field=name)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number", field=name)
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise BadRequest(f"{name} {value} must be a whole number", field=name)
            value = int(value)
        return value
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise BadRequest(f"{name} {value} is not a finite number", field=name)
    return float(value)


def native_options(body: dict, limits: Limits, defaults, adapter=None) -> dict:
    """The options of ``POST /generate``'s body, checked against ``limits``; ``defaults`` (the server's options)
    fill what the body leaves out for the checks that combine fields. ``adapter`` (the model's family, or None)
    checks frames. Raises :class:`BadRequest` with one message."""
    unknown = sorted(set(body) - set(NATIVE_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; the fields are: {', '.join(NATIVE_FIELDS)}", field=unknown[0])
    options = {}
    for name, value in body.items():
        kind, option = NATIVE_FIELDS[name]
        if value is None and name in ("negative_prompt", "frames", "height", "width", "lora"):  # null: the default
            options[option] = None
            continue
        options[option] = _typed(name, value, kind)
    check_options(options, limits, defaults, adapter)
    return options


def check_options(options: dict, limits: Limits, defaults, adapter=None) -> None:
    """Check a request's options (``generate``'s names) with the server's ``defaults`` filling the rest."""
    merged = {name: options.get(name, getattr(defaults, name, None)) for name in
              ("prompt", "steps", "seed", "height", "width", "frames", "images_per_prompt", "guidance")}
    prompt = options.get("prompt")
    if prompt is not None and not prompt.strip():
        raise BadRequest("prompt is empty; describe the picture, e.g. \"a red circle\"", field="prompt")
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"prompt has {len(prompt)} characters; at most {MAX_PROMPT_CHARS}", field="prompt")
    for name in ("height", "width"):
        value = merged[name]
        if value is not None and (value <= 0 or value % 16):
            raise BadRequest(f"{name} {value} must be a positive multiple of 16 (e.g. {max(16, value // 16 * 16)})",
                             field=name)
    height, width = merged["height"], merged["width"]
    if height is not None and width is not None and height * width > limits.max_pixels:
        raise BadRequest(f"{width}x{height} is {width * height} pixels; this server allows at most "
                         f"{limits.max_pixels} (--max-pixels)", 422, "height, width")
    check_range("steps", merged["steps"], limits.max_steps, "--max-steps")
    check_range("n", merged["images_per_prompt"], limits.max_n, "--max-n")
    if not 0 <= merged["seed"] <= MAX_SEED:
        raise BadRequest(f"seed {merged['seed']} must be between 0 and {MAX_SEED}", field="seed")
    if merged["guidance"] < 0:
        raise BadRequest(f"guidance {merged['guidance']} must be >= 0", field="guidance")
    if "adapter" in options:
        check_lora(options["adapter"], getattr(defaults, "lora_names", ()))
    frames = options.get("frames")
    if frames is not None:
        check_range("frames", frames, limits.max_frames, "--max-frames")
        from ..config import ConfigError
        from ..runtime.video import validate_frames

        try:
            validate_frames(adapter, frames)
        except ConfigError as exc:
            raise BadRequest(str(exc).replace("--frames", "frames"), field="frames") from None


def check_lora(name, known) -> None:
    """``name`` (None: no adapter but those always on) must be one of the server's named adapters ``known``."""
    if name is None:
        return
    if not known:
        raise BadRequest(f"lora {name!r}: this server has no named LoRA adapters (start it with --lora NAME=PATH to "
                         "choose one per request)", field="lora")
    if name not in known:
        raise BadRequest(f"lora {name!r} is not loaded; the adapters are: {', '.join(known)} (or null for none)",
                         field="lora")


def openai_options(body: dict, limits: Limits, defaults, adapter=None) -> dict:
    """The options of an OpenAI-shaped ``POST /v1/images/generations`` body (prompt, n, size ``WxH``,
    response_format ``b64_json``)."""
    unknown = sorted(set(body) - set(OPENAI_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; the fields are: {', '.join(OPENAI_FIELDS)}", field=unknown[0])
    if "prompt" not in body:
        raise BadRequest("prompt is required", field="prompt")
    options = {"prompt": _typed("prompt", body["prompt"], str)}
    if "n" in body:
        options["images_per_prompt"] = _typed("n", body["n"], int)
    if "lora" in body:
        options["adapter"] = None if body["lora"] is None else _typed("lora", body["lora"], str)
    if body.get("response_format", "b64_json") != "b64_json":
        raise BadRequest(f"response_format {body['response_format']!r} is not served; use \"b64_json\"",
                         field="response_format")
    if "size" in body:
        size = _typed("size", body["size"], str)
        match = re.fullmatch(r"(\d{1,6})x(\d{1,6})", size)
        if not match:
            raise BadRequest(f"size {size!r} must be WIDTHxHEIGHT, e.g. \"1024x1024\"", field="size")
        options["width"], options["height"] = int(match.group(1)), int(match.group(2))
    try:
        check_options(options, limits, defaults, adapter)
    except BadRequest as exc:
        if exc.field in ("height", "width", "height, width"):  # this request names them "size"
            exc.field = "size"
        raise
    return options
