"""Audio files the CLI writes, in the format their suffix names, checked before anything is loaded.

`.wav`: 16-bit PCM through `pcm.WavWriter` (valid after every chunk, so a Ctrl-C leaves a playable file);
`.flac` (16-bit), `.ogg` (Vorbis) and `.mp3` through soundfile, where the installed libsndfile writes them
(soundfile finalises the file when it is closed, which the CLI does on Ctrl-C too).
`check_output` refuses what would fail later: a directory, an unknown suffix, a missing parent directory, a
place that cannot be written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# suffix -> soundfile (format, subtype); None: the WAV writer of higgs_rt.pcm
FORMATS = {".wav": None, ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS"), ".mp3": ("MP3", "MPEG_LAYER_III")}


class OutputRefused(ValueError):
    """An output the CLI will not write (a directory, an unknown format): a usage error."""


class OutputUnwritable(OSError):
    """An output the machine cannot take (no such directory, no permission, no encoder): an environment error."""


def _soundfile():
    try:
        import soundfile
    except (ImportError, OSError) as e:
        raise OutputUnwritable(f"writing this format needs soundfile ({e}): pip install 'higgs-rt[audio]', "
                               "or write a .wav") from None
    return soundfile


def check_output(path: str | Path, what: str = "--out") -> Path:
    """`path` if a file of its format can be written there; else OutputRefused or OutputUnwritable, one line.
    Nothing is left behind by the check."""
    path = Path(path)
    if path.is_dir():
        raise OutputRefused(f"{what} {path} is a directory: give a file name, e.g. {path / 'speech.wav'}")
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise OutputRefused(f"{what} {path}: cannot write {suffix or 'a file without a suffix'}; the suffix names "
                            f"the format: {', '.join(FORMATS)}")
    if FORMATS[suffix] is not None:
        sf = _soundfile()
        if not sf.check_format(*FORMATS[suffix]):
            raise OutputUnwritable(f"{what} {path}: this libsndfile ({sf.__libsndfile_version__}) cannot write "
                                   f"{suffix}; write a .wav or .flac")
    parent = path.parent
    if not parent.is_dir():
        raise OutputUnwritable(f"{what} {path}: the directory {parent} does not exist")
    try:
        if path.exists():
            open(path, "ab").close()  # opened for writing, not changed
        else:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".higgs-rt-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise OutputUnwritable(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return path


class _SoundFileWriter:
    def __init__(self, path: Path, sample_rate: int, format: str, subtype: str):
        self._file = _soundfile().SoundFile(path, "w", sample_rate, 1, subtype, format=format)

    def write(self, pcm) -> None:
        from .pcm import to_int16

        self._file.write(to_int16(pcm))  # the WAV's rounding, so a FLAC holds the WAV's samples

    def close(self) -> None:
        self._file.close()


def open_output(path: str | Path, sample_rate: int):
    """A writer for `path` in its suffix's format (`check_output` first): `.write(float32 chunk)`, `.close()`."""
    path = Path(path)
    spec = FORMATS[path.suffix.lower()]
    if spec is None:
        from .pcm import WavWriter

        return WavWriter(path, sample_rate)
    return _SoundFileWriter(path, sample_rate, *spec)
