"""Audio files the CLI writes, in the format their suffix names, checked before anything is loaded.

`.wav`: 16-bit PCM through `pcm.WavWriter` (valid after every chunk, so a Ctrl-C leaves a playable file);
`.flac` (16-bit), `.ogg` (Vorbis) and `.mp3` through soundfile, where the installed libsndfile writes them
(soundfile finalises the file when it is closed, which the CLI does on Ctrl-C too).
`check_output` refuses what would fail later: a directory, a FIFO (whose open blocks until a reader comes), an
unknown suffix, a name too long for the file system, a parent directory that is missing, not a directory or a
symbolic link leading nowhere, a place without write permission, a symbolic link that leads nowhere (dangling, or
a loop). A link to a file is written through, as the shell's `>` does; a dangling one is refused rather than
followed, which would create its target, a file the name does not show.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

# suffix -> soundfile (format, subtype); None: the WAV writer of higgs_rt.pcm
FORMATS = {".wav": None, ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS"), ".mp3": ("MP3", "MPEG_LAYER_III")}


class OutputRefused(ValueError):
    """An output the CLI will not write (a directory, an unknown format, no such directory, no permission): a usage
    error."""


class OutputUnwritable(OSError):
    """An output the machine cannot take (no encoder, a full disk): an environment error."""


# errors of looking at or probing the output that name a bad choice of path, not a machine that lacks something
REFUSED_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES, errno.EPERM, errno.EROFS)


def _soundfile():
    try:
        import soundfile
    except (ImportError, OSError) as e:
        raise OutputUnwritable(f"writing this format needs soundfile ({e}): pip install 'higgs-rt[audio]', "
                               "or write a .wav") from None
    return soundfile


def slash_ended(path: str | Path) -> str | None:
    """Why a file name ending with a slash is refused (Path() drops the slash: a.wav/ would be a.wav), or None;
    for every file path the CLI takes, read or written (`cli_options.file_arg`)."""
    if str(path).endswith(("/", os.sep)):
        return f"{path} ends with a slash (a directory): give a file name"
    return None


def _link_fault(path: str | Path) -> tuple[str, str] | None:
    """("dangling", its target) for a symbolic link whose target, or a directory on the way, is not there;
    ("loop", "") for a loop of links; None for anything else (not a link, or a link to something)."""
    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "dangling", os.readlink(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "loop", ""
    return None


def broken_link(path: str | Path) -> str | None:
    """Why a path that is a symbolic link leading nowhere is refused, or None; for every path the CLI takes
    (`cli_options.path_arg`) and the directories above --out (`check_output`)."""
    fault = _link_fault(path)
    if fault is None:
        return None
    return f"a dangling symbolic link (to {fault[1]})" if fault[0] == "dangling" else "a loop of symbolic links"


def check_output(path: str | Path, what: str = "--out") -> Path:
    """`path` if a file of its format can be written there; else OutputRefused or OutputUnwritable, one line.
    Nothing is left behind by the check."""
    if (why := slash_ended(path)) is not None:
        raise OutputRefused(f"{what} {why}")
    path = Path(path)
    try:
        return _check_output(path, what)
    except OutputUnwritable:
        raise
    except OSError as e:  # looking at the path failed: a name past the file system's limit, a loop of links, a
        if e.errno in REFUSED_ERRNOS:  # directory on the way without permission to look in
            raise OutputRefused(f"{what} {path}: {e.strerror}: give another file name") from None
        raise OutputUnwritable(f"{what} {path}: cannot write there ({e.strerror or e})") from None


def _check_output(path: Path, what: str) -> Path:
    fault = _link_fault(path)  # a link is written through (a link to a file is taken): its target is checked
    if fault is not None and fault[0] == "loop":  # refused by `check_output`, with the system's words
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    if fault is not None:
        raise OutputRefused(f"{what} {path} is a symbolic link to {fault[1]}, which does not exist: "
                            "give a file name (or a link to a file)")
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
    if path.is_fifo():  # the check's open would block until a reader came, and the writers seek
        raise OutputRefused(f"{what} {path} is a FIFO: give a file name (a device such as /dev/null is taken)")
    parent = path.parent
    if not parent.is_dir():
        raise OutputRefused(f"{what} {path}: {_no_directory(parent)}")
    try:
        if path.exists():
            open(path, "ab").close()  # opened for writing, not changed
        else:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".higgs-rt-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        error = OutputRefused if e.errno in REFUSED_ERRNOS else OutputUnwritable  # no permission; a full disk
        raise error(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return path


def _no_directory(parent: Path) -> str:
    """Why `parent`, not a directory, cannot hold the output: the outermost directory on its way that is a
    symbolic link leading nowhere, missing, or not a directory."""
    for step in (*reversed(parent.parents), parent):
        if (why := broken_link(step)) is not None:
            return f"{step} is {why}"
        if not step.is_dir():
            return f"{step} is not a directory" if step.exists() else f"the directory {step} does not exist"
    return f"{parent} is not a directory"  # it became one meanwhile


class _Sink:
    """The file soundfile writes through. libsndfile's Vorbis and MP3 encoders ignore a failed or short write (a
    full disk) and its FLAC encoder reports one without the reason, so the first OSError is kept here for the
    writer to raise. Unbuffered, a short write retried: an error surfaces at the write that failed."""

    def __init__(self, path: Path):
        self.file = open(path, "w+b", buffering=0)
        self.error: OSError | None = None

    def write(self, data) -> int:
        if self.error is None:
            rest = memoryview(data)
            try:
                while rest:
                    rest = rest[self.file.write(rest):]
                return len(data)
            except OSError as e:
                self.error = e
        return 0

    def read(self, size: int = -1) -> bytes:
        return self.file.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()


class _SoundFileWriter:
    def __init__(self, path: Path, sample_rate: int, format: str, subtype: str):
        self._format, self._written = format, 0
        self._sink = _Sink(path)
        try:
            self._file = _soundfile().SoundFile(self._sink, "w", sample_rate, 1, subtype, format=format)
        except BaseException:
            self._sink.file.close()
            raise
        if self._sink.error is not None:  # the header's write failed: close both, raising its error
            self.close()

    def _check(self) -> None:
        if self._sink.error is not None:
            raise self._sink.error

    def write(self, pcm) -> None:
        from .pcm import to_int16

        samples = to_int16(pcm)  # the WAV's rounding, so a FLAC holds the WAV's samples
        try:
            self._file.write(samples)
        except RuntimeError as e:  # libsndfile's error for a failed write: the sink has its reason
            self._check()
            raise OSError(str(e)) from None
        self._check()
        self._written += len(samples)

    def close(self) -> None:
        import numpy as np

        from .pcm import NO_EMPTY_FORMATS, not_empty

        try:
            if not self._file.closed:
                try:
                    if not self._written and self._format in NO_EMPTY_FORMATS:  # no audio: what such a file holds
                        self.write(not_empty(np.zeros(0, np.int16)))
                finally:  # even after a failed write: a SoundFile left open flushes into the closed sink when
                    self._close_file()  # collected, and keeps libsndfile's encoder
        finally:
            self._sink.file.close()
        self._check()

    def _close_file(self) -> None:
        try:
            self._file.close()  # the encoder's last pages go out here
        except RuntimeError as e:  # libsndfile's error for a failed write: the sink has its reason
            self._check()
            raise OSError(str(e)) from None


class _Output:
    """A format's writer whose failures (a full disk, a file removed or made unwritable meanwhile) are one
    OutputUnwritable naming the output. The file is opened at the first chunk (or at a `close` that keeps an empty
    file): a failure before any audio leaves what the path held as it was."""

    def __init__(self, path: Path, what: str, open_writer):
        self.path, self.what = path, what
        self._open, self._writer = open_writer, None

    def _opened(self):
        if self._writer is None:
            with self._checked():
                self._writer = self._open()
        return self._writer

    def _checked(self):
        from contextlib import contextmanager

        @contextmanager
        def checked():
            try:
                yield
            except OSError as e:
                raise OutputUnwritable(f"{self.what} {self.path}: cannot write there ({e.strerror or e})") from None

        return checked()

    def write(self, pcm) -> None:
        writer = self._opened()
        with self._checked():
            writer.write(pcm)

    def close(self, keep_empty: bool = True) -> None:
        """Finish the file; with no chunk written, an empty file of the format, or (keep_empty=False: the run
        failed before any audio) nothing, the path untouched."""
        if self._writer is None and not keep_empty:
            return
        writer = self._opened()
        with self._checked():
            writer.close()


def open_output(path: str | Path, sample_rate: int, what: str = "--out"):
    """A writer for `path` in its suffix's format (`check_output` first): `.write(float32 chunk)`, `.close()`;
    a failure to write is an OutputUnwritable naming `what` and the path."""
    path = Path(path)
    spec = FORMATS[path.suffix.lower()]
    if spec is None:
        from .pcm import WavWriter

        return _Output(path, what, lambda: WavWriter(path, sample_rate))
    return _Output(path, what, lambda: _SoundFileWriter(path, sample_rate, *spec))
