"""Video output of ``ditmesh generate --frames N``: frame-count rules and writing the result.

Where a video goes, by the suffix of ``--out``:

- ``.gif``: an animated GIF through Pillow (always available);
- ``.png``: one PNG per frame in the folder ``<stem>_frames/`` next to ``--out``;
- anything else (``.mp4`` by default): an H.264 MP4 through imageio-ffmpeg, the optional ``video`` extra
  (``pip install 'ditmesh[video]'``). Without it, ditmesh writes the PNG frames instead and says so in
  one line on stderr, so a long run is never lost to a missing package.

Every file is written to a temporary name and renamed, like every other output of ``generate``.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..config import ConfigError
from ..shared import atomic_write_bytes, current_umask

#: frames per second of a written video when the family does not say (its adapter's ``fps``)
DEFAULT_FPS = 16


def validate_frames(adapter, frames: int) -> None:
    """Raise :class:`ConfigError` (one line) unless ``--frames frames`` suits the family of ``adapter``.

    ``adapter``: the family's adapter or its torch-free :class:`~ditmesh.models.registry.FamilyFacts`; None (a hub id,
    not inspected before loading) accepts any positive count.
    """
    if frames < 1:
        raise ConfigError(f"--frames {frames} must be >= 1")
    if adapter is None:
        return
    if adapter.frame_step is None:
        from ..models.registry import video_families

        video = video_families()
        raise ConfigError(f"--frames {frames}: {adapter.name} pipelines generate images; --frames is for video "
                          f"families ({', '.join(video)})")
    error = adapter.frames_error(frames)
    if error:
        raise ConfigError(error)


def as_uint8_frames(video) -> np.ndarray:
    """``[F, H, W, 3]`` uint8 from a pipeline's video: float array/tensor in [0, 1], or a list of PIL images."""
    if isinstance(video, (list, tuple)) and video and hasattr(video[0], "convert"):
        return np.stack([np.asarray(frame.convert("RGB")) for frame in video])
    if hasattr(video, "detach"):
        video = video.detach().float().cpu().numpy()
    video = np.asarray(video)
    if video.dtype != np.uint8:
        video = np.clip(np.rint(video * 255.0), 0, 255).astype(np.uint8)
    return video


def write_video(path: str | os.PathLike, video, fps: int = DEFAULT_FPS) -> list[str]:
    """Write one video to ``path`` (format from the suffix, see the module docstring); returns the files written."""
    path = Path(path)
    frames = as_uint8_frames(video)
    suffix = path.suffix.lower()
    if suffix == ".gif":
        return [_write_gif(path, frames, fps)]
    if suffix == ".png":
        return write_png_frames(path, frames)
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        paths = write_png_frames(path, frames)
        print(f"ditmesh: MP4 needs imageio-ffmpeg (pip install 'ditmesh[video]'); wrote {len(paths)} PNG frames to "
              f"{Path(paths[0]).parent} instead", file=sys.stderr)
        return paths
    return [_write_mp4(path, frames, fps)]


def frames_dir(path: Path) -> Path:
    """The folder that holds the PNG frames of a video meant for ``path``."""
    return path.with_name(f"{path.stem}_frames")


def write_png_frames(path: Path, frames: np.ndarray) -> list[str]:
    """One PNG per frame, ``<stem>_frames/frame_0000.png``..."""
    from PIL import Image

    folder = frames_dir(path)
    paths = []
    for i, frame in enumerate(frames):
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="PNG")
        target = folder / f"frame_{i:04d}.png"
        atomic_write_bytes(target, buf.getvalue())
        paths.append(str(target))
    return paths


def gif_bytes(video, fps: int = DEFAULT_FPS) -> bytes:
    """One video as an animated GIF (looping), in memory."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in as_uint8_frames(video)]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return buf.getvalue()


def _write_gif(path: Path, frames: np.ndarray, fps: int) -> str:
    atomic_write_bytes(path, gif_bytes(frames, fps))
    return str(path)


def _write_mp4(path: Path, frames: np.ndarray, fps: int) -> str:
    import imageio.v2 as imageio

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix or ".mp4", dir=path.parent)
    os.close(fd)
    try:
        # macro_block_size=1: keep the generated size (a multiple of 16 already) instead of rescaling
        with imageio.get_writer(tmp, format="FFMPEG", fps=fps, codec="libx264", macro_block_size=1,
                                ffmpeg_log_level="error") as writer:
            for frame in frames:
                writer.append_data(frame)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(path)
