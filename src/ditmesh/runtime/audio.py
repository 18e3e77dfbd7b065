"""Audio output of ``ditmesh generate`` for the audio pipelines (Stable Audio): WAV files through the standard library.

A pipeline's ``audios`` (a tensor or array of ``[batch, channels, samples]`` in [-1, 1]) become one 16-bit PCM WAV
per sample, at the VAE's sampling rate; every file is written to a temporary name and renamed, like every other output
of ``generate``.
"""

from __future__ import annotations

import io
import os
import wave
from pathlib import Path

import numpy as np

from ..shared import atomic_write_bytes

#: the suffix every audio output gets (``--out`` with another suffix is written with this one)
AUDIO_SUFFIX = ".wav"


def sampling_rate(pipe, default: int = 44_100) -> int:
    """The samples per second of ``pipe``'s audio: its VAE's ``sampling_rate`` (Oobleck) or ``sample_rate``."""
    vae = getattr(pipe, "vae", None)
    config = getattr(vae, "config", {}) or {}
    return int(getattr(vae, "sampling_rate", None) or config.get("sampling_rate") or config.get("sample_rate")
               or default)


def wav_bytes(audio, rate: int) -> bytes:
    """One clip (``[channels, samples]`` or ``[samples]``, floats in [-1, 1]) as a 16-bit PCM WAV file."""
    data = audio.detach().float().cpu().numpy() if hasattr(audio, "detach") else np.asarray(audio, dtype=np.float32)
    data = data[None] if data.ndim == 1 else data
    pcm = (np.clip(data, -1.0, 1.0) * 32767).round().astype("<i2").T  # [samples, channels], interleaved
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def write_audios(path: str | os.PathLike, audios, rate: int) -> list[str]:
    """Each clip of ``audios`` (``[batch, channels, samples]``) as a WAV: ``path`` with the suffix ``.wav`` for one,
    ``<stem>_<i>.wav`` beside it for several; returns the files written."""
    path = Path(path).with_suffix(AUDIO_SUFFIX)
    targets = [path] if len(audios) == 1 else [path.with_name(f"{path.stem}_{i}{AUDIO_SUFFIX}")
                                               for i in range(len(audios))]
    encoded = [wav_bytes(clip, rate) for clip in audios]
    for target, data in zip(targets, encoded):
        atomic_write_bytes(target, data)
    return [str(t) for t in targets]
