"""PCM output: float waveform -> 16-bit samples, WAV files, and WAV streams for pipes and HTTP.

`WavWriter` keeps the file valid while it grows: the RIFF and data sizes are patched after every write (when
the target can seek), so a run stopped half-way (Ctrl-C, a crash) leaves a playable file of what was written.
Targets that cannot seek (pipes, sockets) get the streaming header, whose sizes say "unknown" (0xFFFFFFFF).
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["to_int16", "pcm16_bytes", "write_wav", "wav_header", "wav_header_streaming", "WavWriter",
           "NO_EMPTY_FORMATS", "not_empty"]

_UNKNOWN_SIZE = 0xFFFFFFFF
_HEADER_BYTES = 44


def to_int16(pcm) -> np.ndarray:
    """Float samples (numpy or torch, nominally -1..1) -> int16, clipped, rounded to nearest (1.0 -> 32767)."""
    if hasattr(pcm, "detach"):
        pcm = pcm.detach().float().cpu().numpy()
    samples = np.asarray(pcm)
    if samples.dtype == np.int16:
        return samples
    return np.round(np.clip(samples.astype(np.float64), -1.0, 1.0) * 32767.0).astype(np.int16)


# libsndfile formats that cannot hold zero samples: it writes nothing for them (a 0-byte file), and a FLAC's
# stream info cannot say "0 samples" (0 there means an unknown length, which libsndfile then fails to read)
NO_EMPTY_FORMATS = frozenset({"FLAC", "MP3"})


def not_empty(samples: np.ndarray) -> np.ndarray:
    """The samples, or one sample of silence where there are none (speech that ended before its first audio
    frame): what a file of a NO_EMPTY_FORMATS format holds for no audio."""
    return samples if len(samples) else np.zeros(1, samples.dtype)


def pcm16_bytes(pcm) -> bytes:
    """16-bit little-endian PCM bytes: int16 samples as they are (no numpy pass), float ones as `to_int16`
    rounds them."""
    return to_int16(pcm).astype("<i2", copy=False).tobytes()


def write_wav(path: str | Path, pcm, sr: int) -> None:
    """Write mono (or [frames, channels]) float samples as a 16-bit PCM WAV file."""
    import soundfile

    soundfile.write(str(path), to_int16(pcm), sr, subtype="PCM_16")


def wav_header(sr: int = 24000, data_bytes: int = _UNKNOWN_SIZE) -> bytes:
    """44-byte RIFF/WAVE header, mono 16-bit PCM; sizes saturate at 0xFFFFFFFF ("unknown")."""
    riff = _UNKNOWN_SIZE if data_bytes >= _UNKNOWN_SIZE - 36 else data_bytes + 36
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sr, sr * 2, 2, 16)
            + b"data" + struct.pack("<I", min(data_bytes, _UNKNOWN_SIZE)))


def wav_header_streaming(sr: int = 24000) -> bytes:
    """Header for a WAV of unknown length (RIFF and data sizes 0xFFFFFFFF), for pipes and HTTP responses."""
    return wav_header(sr)


class WavWriter:
    """Incremental mono 16-bit WAV writer to a path or a binary file object; use as a context manager."""

    def __init__(self, target: str | Path | BinaryIO, sr: int = 24000):
        self.sr = sr
        self._owns = isinstance(target, (str, os.PathLike))
        self._file: BinaryIO = open(target, "wb") if self._owns else target
        try:
            self._seekable = self._file.seekable()
        except (AttributeError, io.UnsupportedOperation):
            self._seekable = False
        self.data_bytes = 0
        self._file.write(wav_header(sr, 0) if self._seekable else wav_header_streaming(sr))

    def write(self, pcm) -> None:
        data = to_int16(pcm).reshape(-1).astype("<i2").tobytes()
        self._file.write(data)
        self.data_bytes += len(data)
        self._patch_sizes()
        self._file.flush()

    def _patch_sizes(self) -> None:
        if not self._seekable:
            return
        end = self._file.tell()
        self._file.seek(0)
        self._file.write(wav_header(self.sr, self.data_bytes))
        self._file.seek(end)

    def close(self) -> None:
        if self._file.closed:
            return
        self._patch_sizes()
        self._file.flush()
        if self._owns:
            self._file.close()

    def __enter__(self) -> "WavWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
