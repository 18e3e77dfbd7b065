"""Procedural captioned shapes: the data set of the tiny trained pipeline, and its checker.

An image is ``SIZE``x``SIZE`` RGB: one shape (circle, square or triangle) in one of four colours, at one of
five positions, on a white, black or gray background. Its caption follows the grammar

    a {colour} {shape}[ at the {position}][ on a {background} background]

where an unnamed position is the center and an unnamed background is white, so one scene has up to four
phrasings. Images are drawn at 4x and box-downsampled (anti-aliased edges); the shape's size and its
centre jitter a little so that no two samples are identical.

The checker (:func:`classify`) reads an image back to (colour, shape, position) without any learned
part: the background is the median border colour, the shape is every pixel far from it, its colour is the
nearest palette colour, its position the nearest anchor to its centroid, and its class the template
(circle, square, triangle drawn in the shape's bounding box) with the highest overlap.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40)}
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
#: Shape centres (x, y) in pixels of a SIZE x SIZE image.
POSITIONS = {
    "top left": (16, 16),
    "top right": (48, 16),
    "bottom left": (16, 48),
    "bottom right": (48, 48),
    "center": (32, 32),
}
DEFAULT_POSITION = "center"
DEFAULT_BACKGROUND = "white"
#: Half the shape's extent in pixels (drawn uniformly in this range) and the jitter of its centre.
HALF_EXTENT = (10.0, 13.0)
JITTER = 2.0
_SUPERSAMPLE = 4
#: Checker thresholds (see ``_shape_of``): taper above which a shape is a triangle, corner fill above
#: which a non-triangle is a square.
TAPER_THRESHOLD = 0.25
CORNER_THRESHOLD = 0.55


@dataclass(frozen=True)
class Scene:
    """What one image shows; ``caption(...)`` writes it in the grammar."""

    colour: str
    shape: str
    position: str = DEFAULT_POSITION
    background: str = DEFAULT_BACKGROUND

    def captions(self) -> list[str]:
        """Every phrasing of this scene the grammar allows (defaults may be named or left out)."""
        positions = [self.position] + ([None] if self.position == DEFAULT_POSITION else [])
        backgrounds = [self.background] + ([None] if self.background == DEFAULT_BACKGROUND else [])
        return [caption(self.colour, self.shape, p, b) for p in positions for b in backgrounds]


def caption(colour: str, shape: str, position: str | None = None, background: str | None = None) -> str:
    """The caption ``a {colour} {shape}[ at the {position}][ on a {background} background]``."""
    text = f"a {colour} {shape}"
    if position is not None:
        text += f" at the {position}"
    if background is not None:
        text += f" on a {background} background"
    return text


def parse_caption(text: str) -> Scene:
    """The scene a grammar caption describes (defaults filled in); ``ValueError`` if off-grammar."""
    words = text.strip().split()
    if len(words) < 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
        raise ValueError(f"not a caption of the tiny grammar: {text!r}")
    rest = " ".join(words[3:])
    position, background = DEFAULT_POSITION, DEFAULT_BACKGROUND
    if rest.startswith("at the "):
        for name in POSITIONS:
            if rest[len("at the "):].startswith(name):
                position, rest = name, rest[len("at the ") + len(name):].strip()
                break
        else:
            raise ValueError(f"unknown position in {text!r}")
    if rest:
        bg = rest.removeprefix("on a ").removesuffix(" background")
        if bg not in BACKGROUNDS or rest != f"on a {bg} background":
            raise ValueError(f"not a caption of the tiny grammar: {text!r}")
        background = bg
    return Scene(words[1], words[2], position, background)


def all_scenes() -> list[Scene]:
    """Every (colour, shape, position, background) combination, in a fixed order."""
    return [Scene(c, s, p, b) for c, s, p, b in itertools.product(COLOURS, SHAPES, POSITIONS, BACKGROUNDS)]


def split_scenes(seed: int = 0, holdout: int = 24) -> tuple[list[Scene], list[Scene]]:
    """(train, held-out) scenes: ``holdout`` whole combinations never seen in training.

    The held-out combinations are drawn so that each colour, shape, position and background still occurs
    in training; the model must compose them.
    """
    scenes = all_scenes()
    rng = random.Random(seed)
    held = rng.sample(scenes, holdout)
    train = [s for s in scenes if s not in held]
    return train, held


def _shape_polygon(shape: str, cx: float, cy: float, r: float):
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    raise ValueError(shape)


def _draw_mask(shape: str, cx: float, cy: float, r: float, size: int, scale: int) -> Image.Image:
    """A filled ``shape`` as an 'L' image of ``size*scale`` pixels (coordinates given at ``size``)."""
    img = Image.new("L", (size * scale, size * scale), 0)
    draw = ImageDraw.Draw(img)
    s = float(scale)
    if shape == "circle":
        draw.ellipse([(cx - r) * s, (cy - r) * s, (cx + r) * s - 1, (cy + r) * s - 1], fill=255)
    else:
        draw.polygon([(x * s, y * s) for x, y in _shape_polygon(shape, cx, cy, r)], fill=255)
    return img


def render(scene: Scene, rng: random.Random | None = None) -> np.ndarray:
    """The scene as a ``(SIZE, SIZE, 3)`` uint8 image; ``rng`` draws size and jitter (None: no jitter)."""
    cx, cy = POSITIONS[scene.position]
    r = sum(HALF_EXTENT) / 2
    if rng is not None:
        r = rng.uniform(*HALF_EXTENT)
        cx, cy = cx + rng.uniform(-JITTER, JITTER), cy + rng.uniform(-JITTER, JITTER)
    mask = _draw_mask(scene.shape, cx, cy, r, SIZE, _SUPERSAMPLE).resize((SIZE, SIZE), Image.BOX)
    alpha = np.asarray(mask, dtype=np.float32)[..., None] / 255.0
    fg = np.array(COLOURS[scene.colour], dtype=np.float32)
    bg = np.array(BACKGROUNDS[scene.background], dtype=np.float32)
    return np.clip(np.rint(alpha * fg + (1 - alpha) * bg), 0, 255).astype(np.uint8)


def sample_dataset(scenes: list[Scene], n: int, seed: int) -> tuple[np.ndarray, list[Scene]]:
    """``n`` images of scenes drawn uniformly from ``scenes``: ``(uint8 [n, SIZE, SIZE, 3], scenes)``."""
    rng = random.Random(seed)
    picked = [rng.choice(scenes) for _ in range(n)]
    images = np.stack([render(s, rng) for s in picked])
    return images, picked


# ---------------------------------------------------------------------------------------------------
# checker
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reading:
    """What the checker sees in an image; fields are None when no shape was found."""

    colour: str | None
    shape: str | None
    position: str | None
    background: str
    shape_score: float = 0.0


def _nearest(rgb: np.ndarray, palette: dict) -> str:
    names = list(palette)
    dist = [float(np.sum((rgb - np.array(palette[n], dtype=np.float32)) ** 2)) for n in names]
    return names[int(np.argmin(dist))]


def classify(image) -> Reading:
    """Read (colour, shape, position, background) from a uint8 RGB image (array or PIL) of any size."""
    img = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    h, w = img.shape[:2]
    border = np.concatenate([img[:2].reshape(-1, 3), img[-2:].reshape(-1, 3), img[:, :2].reshape(-1, 3), img[:, -2:].reshape(-1, 3)])
    bg_rgb = np.median(border, axis=0)
    background = _nearest(bg_rgb, BACKGROUNDS)
    mask = np.sqrt(np.sum((img - bg_rgb) ** 2, axis=-1)) > 90.0
    if mask.sum() < max(8, h * w // 400):
        return Reading(None, None, None, background)
    colour = _nearest(np.median(img[mask], axis=0), COLOURS)
    ys, xs = np.nonzero(mask)
    cx, cy = xs.mean() * SIZE / w, ys.mean() * SIZE / h
    position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
    # Bounding box of the mask after a 3x3 majority filter, so stray pixels do not stretch it.
    padded = np.pad(mask, 1).astype(np.int32)
    votes = sum(padded[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3))
    core = mask & (votes >= 5)
    ys, xs = np.nonzero(core if core.any() else mask)
    x0, x1, y0, y1 = xs.min(), xs.max(), ys.min(), ys.max()
    box = mask[y0:y1 + 1, x0:x1 + 1].astype(np.float32)
    shape, score = _shape_of(box)
    return Reading(colour, shape, position, background, score)


def _shape_of(box: np.ndarray) -> tuple[str, float]:
    """Shape class of a mask cropped to its bounding box, from two measures that survive blurred edges.

    Taper: mean row width of the bottom third minus that of the top third, over the widest row (an upright
    triangle ~0.5, circle and square ~0). Corners: fill of the four corner cells (a quarter of each side)
    of the box (square ~1, circle ~0.2). Returns (class, margin from the decision threshold).
    """
    bh, bw = box.shape
    widths = box.sum(axis=1)
    third = max(1, bh // 3)
    taper = float(widths[-third:].mean() - widths[:third].mean()) / max(1.0, float(widths.max()))
    if taper > TAPER_THRESHOLD:
        return "triangle", taper - TAPER_THRESHOLD
    ch, cw = max(1, bh // 4), max(1, bw // 4)
    corners = float(np.mean([box[:ch, :cw].mean(), box[:ch, -cw:].mean(), box[-ch:, :cw].mean(), box[-ch:, -cw:].mean()]))
    if corners > CORNER_THRESHOLD:
        return "square", corners - CORNER_THRESHOLD
    return "circle", CORNER_THRESHOLD - corners
