"""Reference audio for voice cloning: a WAV/FLAC file or an array -> validated mono float32 at the codec's rate.

Sample rates 8 to 192 kHz, integer or float samples, mono or up to 8 channels (averaged to mono), resampled to the
codec's rate with soxr (its cost is linear in the samples for any rate pair; imported only when the rates differ). A
file's rate, channels and length are checked from its header before its samples are read, so a small upload cannot
decode into gigabytes nor a long file fill memory, and a file is no larger than the largest usable reference can be
(MAX_FILE_BYTES); it must be a regular file (a FIFO or a device is refused, not waited on or read). Samples, a
file's or an array's, are converted and mixed to mono a block at a time (`_Samples`), so memory holds the mono
signal and one block, never all the channels of a FLAC that decodes 30 s of 8 channels from a few KB. A WAV (or
MP3) cut short is read as far as it goes (its length is then what was read); a FLAC or Ogg file cut short or damaged
in its audio is refused (the FLAC decoder loses sync; an Ogg stream's last page is cut or not marked as its end, a
check of the file's last 64 KiB, as libsndfile reads a cut Ogg as a shorter file). Everything a user can get wrong
ends in one `ReferenceAudioError` whose message says what and how to fix it: an unreadable, corrupt or truncated
file, a header that says 0 Hz or 0 channels, a rate or channel count outside the bounds, no samples at all (a header
only), a length outside 0.5 to 30 s, silence (RMS below -60 dBFS, a constant offset not counted), non-finite samples
or ones far above full scale, an array without its sample rate, or a reference without its transcript (or with one
over MAX_TRANSCRIPT_CHARS). libsndfile's MP3 decoder (libmpg123) prints its resync notes on a damaged or oddly
tagged MP3 straight to the process's stderr (libsndfile issue 958); those lines are dropped while a file is read
(`_decoder_chatter_dropped`), so a CLI user sees the one-line answer only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import stat
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .resample import MAX_RATE, MIN_RATE

MIN_SECONDS, MAX_SECONDS = 0.5, 30.0
MAX_CHANNELS = 8
# the largest file a usable reference can be: MAX_SECONDS at MAX_RATE in MAX_CHANNELS of 64-bit samples, plus 1 MiB
# of headers; a larger file is refused from its size, and only a file's samples are held in memory
MAX_FILE_BYTES = int(MAX_SECONDS * MAX_RATE) * MAX_CHANNELS * 8 + (1 << 20)
MAX_TRANSCRIPT_CHARS = 4096  # as a request's input; every utterance's prompt carries the transcript
SILENCE_DBFS = -60.0
UNKNOWN_LENGTH = 1 << 62  # libsndfile's frame count for a header that leaves the length open (2**63 - 1)
BLOCK_SECONDS = 1.0  # samples are converted and mixed to mono this much at a time
MAX_PEAK = 4.0  # float samples past 12 dB over full scale are no recording the codec was made for (integer values
# stored as floats, or garbage): the encoder overflows on them into a voice of constant codes
OGG_MAX_PAGE = 27 + 255 + 255 * 255  # bytes: a header, its 255 segment sizes and 255 full segments
_DAMAGED = "the file is damaged or was written wrong; re-encode it, e.g. as WAV"
# libsndfile's words for a file it will not open (as soundfile gives them) -> what they mean to a user
OPEN_ERRORS = {"SF_INFO struct incomplete": f"its header says the sample rate is 0 Hz (or over 2 GHz): {_DAMAGED}",
               "Channel count is zero": f"its header says it has 0 channels: {_DAMAGED}",
               "Too many channels specified": f"its header says it has over 1024 channels: use 1 to {MAX_CHANNELS}",
               "file is malformed": f"its header does not parse: {_DAMAGED}",
               # (libsndfile's MP3 reader says so of an MP3 cut in its first frame: the file is regular, checked first)
               "not a regular file (possibly a pipe?)": "its audio does not decode (an MP3 cut short, or damaged?): "
                                                        "give the whole file, or re-encode it, e.g. as WAV",
               "unimplemented format": "its samples are in an encoding that cannot be decoded (or its header "
                                       "gives a sample size of 0 or 64 bits): re-encode it, e.g. as 16-bit WAV",
               # (an AIFF whose chunks are garbled; a FLAC whose stream info is)
               "Unspecified internal error": f"its header does not parse: {_DAMAGED}",
               "unknown error in flac decoder": f"its FLAC header or first frame does not decode: {_DAMAGED}"}


# what libmpg123 writes to fd 2 itself: "Note: ...", "Warning: ...", "[src/libmpg123/...] error: ..."
_MPG123_LINE = re.compile(rb"^(Note: |Warning: |\[src/libmpg123/)")
_MAX_CAPTURED = 1 << 20  # bytes of fd 2 replayed after a read (a damaged file's notes are ~100 bytes a frame)
_FD2 = threading.Lock()  # one capture at a time: nested dup2s from two threads would leave fd 2 pointing nowhere
log = logging.getLogger(__name__)


@contextmanager
def _decoder_chatter_dropped():
    """fd 2 goes to a temporary file while the body runs; then libmpg123's lines are dropped (logged at debug level)
    and whatever else reached fd 2 meanwhile (another thread's output) is written back, in order. Without an fd 2
    (a daemon's) or a temporary file the body runs as it is."""
    with _FD2:
        captured = saved = None
        try:
            sys.stderr.flush()
            captured = tempfile.TemporaryFile()
            saved = os.dup(2)
            os.dup2(captured.fileno(), 2)
        except (OSError, ValueError, AttributeError):  # (AttributeError: sys.stderr is None)
            if saved is not None:
                os.close(saved)
                saved = None
        try:
            yield
        finally:
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
                _replay(captured.fileno())
            if captured is not None:
                captured.close()


def _replay(fd: int) -> None:
    """What reached fd 2 during a read, but libmpg123's lines, back to fd 2."""
    size = os.fstat(fd).st_size
    kept, notes = [], []
    for line in os.pread(fd, min(size, _MAX_CAPTURED), 0).splitlines(keepends=True):
        (notes if _MPG123_LINE.match(line) else kept).append(line)
    if kept:
        os.write(2, b"".join(kept))
    if notes:
        log.debug("the audio decoder's notes: %s", b"".join(notes).decode(errors="replace"))


class ReferenceAudioError(ValueError):
    """A reference recording that cannot be used for cloning, with the reason in one line."""


@dataclass
class ReferenceAudio:
    samples: torch.Tensor  # [n] float32, mono, at sample_rate
    sample_rate: int
    sha256: str  # of the file's bytes, or of the array's samples and rate

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate


class TranscriptError(ReferenceAudioError):
    """The reference's transcript is missing or too long (a server names its field, not the audio's)."""


def check_transcript(text) -> str:
    if not isinstance(text, str) or not text.strip():
        raise TranscriptError("a reference recording needs its transcript (the words spoken in it)")
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise TranscriptError(f"the reference transcript has {len(text)} characters: at most "
                                  f"{MAX_TRANSCRIPT_CHARS} (a 30 s recording holds a few hundred)")
    return text.strip()


def _read_file(path: Path) -> tuple[_Samples, int, str]:
    """A regular file's samples (as many as its header says, at most MAX_SECONDS'), rate and sha256: the header
    is checked before any sample is read, the samples are read a block at a time (mixed to mono as they come) and
    the file is hashed in blocks, so memory holds the mono samples and one block."""
    import soundfile

    what = f"reference audio {path}"
    try:  # O_NONBLOCK: a FIFO without a writer is refused below instead of blocking the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ReferenceAudioError(f"cannot read reference audio {path}: {getattr(e, 'strerror', None) or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ReferenceAudioError(f"{what} is not a regular file (a directory, pipe or device): "
                                  "give a WAV/FLAC file")
    with open(fd, "rb") as file:
        if st.st_size > MAX_FILE_BYTES:
            raise ReferenceAudioError(f"{what} is larger than {MAX_FILE_BYTES >> 20} MiB, more than "
                                      f"{MAX_SECONDS:g} s of audio at any rate and channel count: use a shorter "
                                      "recording")
        if file.read(4) == b"OggS" and _ogg_cut(file):
            raise ReferenceAudioError(f"{what} ends inside its audio data (truncated?) or is damaged there (its Ogg "
                                      "stream stops before its end): give the whole file")
        file.seek(0)
        try:
            with _decoder_chatter_dropped(), soundfile.SoundFile(_File(file), "r") as f:
                rate = _check_rate(f.samplerate, f"{what}: its")
                if f.frames >= UNKNOWN_LENGTH:  # libsndfile cannot read such a file to its end either
                    raise ReferenceAudioError(f"{what} does not say how long it is (a FLAC written as a stream?): "
                                              "re-encode it, e.g. as WAV")
                _check_layout(f.frames, f.channels, rate, what)  # the header's; reading stops past the bound
                samples = _Samples(f.channels, min(f.frames, int(MAX_SECONDS * rate) + 1))
                while samples.frames < samples.limit:  # (soundfile's `blocks` pads a short read with stale samples)
                    try:
                        block = f.read(min(_block_frames(rate), samples.limit - samples.frames), dtype="float32",
                                       always_2d=True)
                    except RuntimeError as e:  # a FLAC cut short or damaged (lost sync), or a header only
                        raise ReferenceAudioError(f"{what} ends inside its audio data (truncated?) or is damaged "
                                                  f"there ({_libsndfile_words(e).rstrip('.')}): give the whole file"
                                                  ) from None
                    if not block.shape[0]:  # fewer samples than the header says (an MP3 cut short)
                        break
                    samples.add(block)
        except ReferenceAudioError:
            raise
        except Exception as e:  # libsndfile's errors: truncated, not audio, unknown format
            why = _libsndfile_words(e)
            for words, meaning in OPEN_ERRORS.items():
                if words in why:
                    raise ReferenceAudioError(f"{what}: {meaning}") from None
            raise ReferenceAudioError(f"{what} is not a readable WAV/FLAC file: {why}") from None
        digest = hashlib.sha256()
        file.seek(0)
        for chunk in iter(lambda: file.read(1 << 20), b""):  # no further than MAX_FILE_BYTES, if it grew meanwhile
            digest.update(chunk)
            if file.tell() > MAX_FILE_BYTES:
                raise ReferenceAudioError(f"{what} grew past {MAX_FILE_BYTES >> 20} MiB while it was read")
    return samples, rate, digest.hexdigest()


def _libsndfile_words(e: Exception) -> str:
    """libsndfile's message in one line, without soundfile's "Error opening <file object repr>: " or "Error : "."""
    return re.sub(r"^(Error opening <[^>]*>: )?((Internal )?[Ee]rror : )?", "", " ".join(str(e).split()))


class _File:
    """The file as soundfile hands it to libsndfile: a seek before its start (to -1, after a damaged AIFF's chunk
    sizes) stays where it was and libsndfile refuses the file (the file object's OSError was printed as a traceback
    by soundfile's callback)."""

    def __init__(self, file):
        self._file = file

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        try:
            return self._file.seek(offset, whence)
        except (OSError, ValueError, OverflowError):
            return self._file.tell()

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer) -> int:
        return self._file.readinto(buffer)


def _ogg_cut(file) -> bool:
    """Whether an Ogg file's last page is cut short, or complete but not marked as its stream's end (a cut at a page
    boundary, or bytes after the stream): its last OGG_MAX_PAGE bytes are read, and the file's position is left
    anywhere."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - OGG_MAX_PAGE))
    tail = file.read(OGG_MAX_PAGE)
    at = len(tail)
    while (at := tail.rfind(b"OggS", 0, at)) >= 0:  # the last page, which ends where the file does
        if at + 27 <= len(tail):
            sizes = tail[at + 27:at + 27 + tail[at + 26]]  # its segments' sizes
            if len(sizes) == tail[at + 26] and at + 27 + len(sizes) + sum(sizes) == len(tail):
                return not tail[at + 5] & 4  # its end-of-stream flag
    return True


def _check_rate(rate, what: str = "reference") -> int:
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not MIN_RATE <= rate <= MAX_RATE:
        raise ReferenceAudioError(f"{what} sample rate must be an integer from {MIN_RATE} to {MAX_RATE} Hz, "
                                  f"got {rate!r}")
    return int(rate)


def _check_layout(frames: int, channels: int, rate: int, what: str = "reference audio") -> None:
    """A file's header or an array's shape, before its samples are converted: channels and length in bounds."""
    if not 1 <= channels <= MAX_CHANNELS:
        raise ReferenceAudioError(f"{what} has {channels} channels: use 1 to {MAX_CHANNELS}")
    _check_length(frames, rate, what)


def _check_length(frames: int, rate: int, what: str = "reference audio") -> None:
    if frames == 0:  # a header with an empty data chunk (a writer stopped before its first sample), or a cut file
        raise ReferenceAudioError(f"{what} holds no audio samples (its header says there are none: an empty "
                                  f"recording, or a file cut short): give {MIN_SECONDS:g} to {MAX_SECONDS:g} s of "
                                  "speech")
    seconds = frames / rate
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        shown = f"{seconds:.2f}" if seconds >= 0.01 else f"{seconds:.2g}"  # a few samples are not "0.00 s"
        raise ReferenceAudioError(f"{what} is {shown} s long: use {MIN_SECONDS:g} to {MAX_SECONDS:g} s of speech")


def resample_to(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 samples from `rate` to `target_rate` Hz with soxr (high quality; linear cost for any ratio)."""
    if rate == target_rate:
        return samples
    try:
        import soxr
    except ImportError:
        raise ReferenceAudioError(f"resampling reference audio from {rate} Hz needs the soxr package: "
                                  "pip install 'higgs-rt[audio]'") from None
    return np.ascontiguousarray(soxr.resample(samples, rate, target_rate, quality="HQ"), dtype=np.float32)


def _frames_channels(shape) -> tuple[int, int]:
    """An array's [samples] or [samples, channels] shape (channels: the shorter axis of a 2-D one)."""
    if len(shape) not in (1, 2):
        raise ReferenceAudioError(f"reference audio must be [samples] or [samples, channels], got shape "
                                  f"{tuple(shape)}")
    if 0 in shape:
        raise ReferenceAudioError(f"reference audio holds no audio samples (shape {tuple(shape)})")
    return (shape[0], 1) if len(shape) == 1 else (max(shape), min(shape))


def _as_array(audio, rate: int) -> np.ndarray:
    """An array, a tensor or a list of samples as a numpy array (not yet converted), shaped [n, channels], its
    layout checked first: a tensor's from its shape, before it is copied off its device or to float32."""
    if isinstance(audio, torch.Tensor):
        _check_layout(*_frames_channels(audio.shape), rate)
        if audio.is_meta:
            raise ReferenceAudioError("reference audio is a tensor on the meta device: it holds no samples")
        audio = audio.detach()
        if audio.layout != torch.strided:  # sparse: numpy has no such arrays (its size is bounded by now)
            audio = audio.to_dense()
        if audio.is_floating_point() and audio.dtype not in (torch.float16, torch.float32, torch.float64):
            audio = audio.float()  # bfloat16, float8: types numpy does not have
        a = audio.cpu().numpy()
    else:
        try:
            a = np.asarray(audio)
        except (ValueError, TypeError) as e:
            raise ReferenceAudioError(f"reference audio must be an array of samples: {e}") from None
        _check_layout(*_frames_channels(a.shape), rate)
    if a.ndim == 1:
        return a[:, None]
    return a.T if a.shape[0] < a.shape[1] else a


def _to_float(a: np.ndarray) -> np.ndarray:
    """Signed and unsigned integer PCM (unsigned is centred on half its range, as 8-bit WAV) to -1..1; floats as
    they are."""
    if np.issubdtype(a.dtype, np.integer):
        half = float(2 ** (8 * a.dtype.itemsize - 1))
        return ((a - (half if np.issubdtype(a.dtype, np.unsignedinteger) else 0.0)) / half).astype(np.float32)
    if np.issubdtype(a.dtype, np.floating):
        return a.astype(np.float32)
    raise ReferenceAudioError(f"reference audio samples must be numbers, got dtype {a.dtype}")


def _block_frames(rate: int) -> int:
    return max(1, int(BLOCK_SECONDS * rate))


class _Samples:
    """[n, channels] float32 samples taken a block at a time (a file's as they are read): the mono mix (the
    channels' mean) and what the checks need of the channels (finite or not, the peak, each channel's spread
    about its own mean), so that no more than one block is ever held in all its channels: a FLAC of 30 s at
    192 kHz in 8 channels is a few KB when constant, and decoded whole was 184 MB before its copies."""

    def __init__(self, channels: int, limit: int):
        self.channels, self.limit = channels, limit  # limit: the most frames that will be added
        self._mono = np.empty(limit, np.float32)
        self.frames = 0
        self.finite, self.peak = True, 0.0
        self._mean = np.zeros(channels)  # each channel's running mean and sum of squared deviations from it
        self._m2 = np.zeros(channels)

    def add(self, block: np.ndarray) -> None:
        """Frames [m, channels] of float32 samples, in order."""
        m = block.shape[0]
        if m == 0:
            return
        lo, hi = float(block.min()), float(block.max())  # NaN if any sample is: no copy of the block for it
        self.finite = self.finite and math.isfinite(lo) and math.isfinite(hi)
        self.peak = max(self.peak, -lo, hi)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN, inf or huge samples: refused by the checks,
            self._mono[self.frames:self.frames + m] = block.mean(axis=1)  # not by a numpy warning on stderr
        if self.channels > 1 and self.finite:  # Chan's merge of the block's mean and deviations into the totals
            wide = block.astype(np.float64)
            mean = wide.mean(axis=0)
            delta, total = mean - self._mean, self.frames + m
            self._m2 += np.square(wide - mean).sum(axis=0) + np.square(delta) * (self.frames * m / total)
            self._mean += delta * (m / total)
        self.frames += m

    @property
    def mono(self) -> np.ndarray:
        return self._mono[:self.frames]

    def spread(self) -> float:
        """The RMS of every channel's samples about that channel's mean (0 for one channel: nothing to mix)."""
        if self.channels == 1 or not self.frames:
            return 0.0
        return math.sqrt(float(self._m2.sum()) / (self.frames * self.channels))


def _array_samples(audio, rate: int) -> _Samples:
    """An array, tensor or list of samples taken as a file's are: converted and mixed a block at a time."""
    a = _as_array(audio, rate)
    samples = _Samples(a.shape[1], a.shape[0])
    step = _block_frames(rate)
    for start in range(0, a.shape[0], step):
        samples.add(_to_float(a[start:start + step]))
    return samples


def load_reference(audio, sample_rate: int | None = None, target_rate: int = 24000) -> ReferenceAudio:
    """A path (WAV/FLAC; `sample_rate` must then be None or match) or an array with its `sample_rate`."""
    what = "reference audio"
    if isinstance(audio, (str, Path)):
        path = Path(audio).expanduser()
        samples, rate, digest = _read_file(path)
        what = f"reference audio {path}"
        if sample_rate is not None and sample_rate != rate:
            raise ReferenceAudioError(f"{path} is {rate} Hz, but sample_rate={sample_rate} was given")
    else:
        if sample_rate is None:
            raise ReferenceAudioError("a reference given as an array needs its sample_rate")
        rate = _check_rate(sample_rate)
        samples, digest = _array_samples(audio, rate), None
    _check_length(samples.frames, rate, what)  # what was read: a file can hold fewer samples than its header says
    if not samples.finite:
        raise ReferenceAudioError(f"{what} contains NaN or infinite samples")
    if samples.peak > MAX_PEAK:
        raise ReferenceAudioError(f"{what} peaks at {samples.peak:.3g}, far above full scale (1.0): float samples "
                                  "must lie in -1..1 (integer PCM values stored as floats need dividing by 32768)")
    mono = samples.mono
    offset = float(np.mean(mono, dtype=np.float64))  # a constant (DC) level is no sound: 8-bit zero bytes are -1.0
    rms = float(np.sqrt(np.mean(np.square(mono - offset, dtype=np.float64))))
    if rms <= 10 ** (SILENCE_DBFS / 20):
        level = "-inf" if rms == 0 else f"{20 * math.log10(rms):.1f}"
        dc = f", apart from a constant offset of {offset:+.2f}" if abs(offset) > 10 ** (SILENCE_DBFS / 20) else ""
        cancel = ""
        if samples.spread() > 10 ** (SILENCE_DBFS / 20):
            cancel = ": its channels cancel when mixed to mono (one is the other inverted); give one channel"
        raise ReferenceAudioError(f"{what} is silent (RMS {level} dBFS, below {SILENCE_DBFS:g} dBFS{dc}){cancel}")
    if digest is None:
        digest = hashlib.sha256(str(rate).encode() + mono.tobytes()).hexdigest()
    return ReferenceAudio(torch.from_numpy(resample_to(mono, rate, target_rate)), target_rate, digest)
