"""Playback of streamed PCM on the local speakers.

Owns the path from the generating thread to the sound card: a single-producer / single-consumer ring
buffer (`RingBuffer`), the PortAudio output stream that drains it (`AudioPlayer`), output device
selection (`list_devices`) and the one error type for everything audio-device related
(`AudioDeviceError`). sounddevice is imported lazily so the rest of higgs-rt works without it.
"""

from __future__ import annotations

import threading
import time

import numpy as np

NO_DEVICE_HINT = "use --out FILE.wav to write a file instead"
_POLL_S = 0.005  # how often a blocked writer looks for free space


class AudioDeviceError(RuntimeError):
    """No usable audio output: sounddevice or PortAudio missing, no device, unknown device."""


class RingBuffer:
    """Fixed-capacity float32 ring between one writer thread and one reader (the audio callback).

    The writer only advances `_w`, the reader only `_r` (both count samples since the start), so the
    two sides need no lock. `read_into` allocates nothing: it copies straight into the caller's array.
    """

    def __init__(self, capacity: int, preroll: int = 0):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._buf = np.zeros(capacity, dtype=np.float32)
        self._cap = capacity
        self._preroll = min(preroll, capacity)
        self._w = 0
        self._r = 0
        self._started = False
        self._dry = False
        self.underruns = 0
        self.finished = False
        self.stopped = False

    @property
    def available(self) -> int:
        return self._w - self._r

    @property
    def read_total(self) -> int:
        return self._r

    @property
    def drained(self) -> bool:
        """True once the writer has finished and every sample has been read."""
        return self.finished and self._w == self._r

    def write(self, pcm) -> int:
        """Append mono samples, blocking while the buffer is full; returns how many were taken
        (fewer than given only if `stop()` was called meanwhile)."""
        pcm = np.asarray(pcm, dtype=np.float32)
        if pcm.ndim != 1:
            raise ValueError(f"expected mono 1-D PCM, got shape {pcm.shape}")
        if self.finished:
            raise RuntimeError("write() after finish()")
        done = 0
        while done < len(pcm) and not self.stopped:
            n = min(len(pcm) - done, self._cap - (self._w - self._r))
            if n == 0:
                time.sleep(_POLL_S)
                continue
            self._copy(pcm[done : done + n], self._w % self._cap)
            self._w += n
            done += n
        return done

    def _copy(self, src: np.ndarray, at: int) -> None:
        head = min(len(src), self._cap - at)
        self._buf[at : at + head] = src[:head]
        self._buf[: len(src) - head] = src[head:]

    def finish(self) -> None:
        """The writer is done: from now on running dry is the end of the stream, not an underrun."""
        self.finished = True

    def stop(self) -> None:
        """Unblock the writer for good and make the reader output silence."""
        self.stopped = True

    def read_into(self, out: np.ndarray) -> int:
        """Fill `out` (1-D float32) with the next samples, zero-filling what is missing; returns the
        number of buffered samples used."""
        want = len(out)
        avail = self._w - self._r
        if self.stopped or not (self._started or avail >= self._preroll or self.finished):
            out.fill(0)
            return 0
        self._started = True
        n = min(want, avail)
        at = self._r % self._cap
        head = min(n, self._cap - at)
        out[:head] = self._buf[at : at + head]
        out[head:n] = self._buf[: n - head]
        out[n:] = 0
        self._r += n
        short = n < want and not self.finished
        if short and not self._dry:
            self.underruns += 1
        self._dry = short
        return n


def _sounddevice():
    try:
        import sounddevice
    except ImportError:
        raise AudioDeviceError(f"sounddevice is not installed (pip install sounddevice): {NO_DEVICE_HINT}") from None
    except OSError:
        raise AudioDeviceError(
            f"PortAudio library not found (apt-get install libportaudio2): {NO_DEVICE_HINT}"
        ) from None
    except Exception as e:  # PortAudioError from Pa_Initialize
        raise AudioDeviceError(f"PortAudio failed to initialize ({e}): {NO_DEVICE_HINT}") from None
    return sounddevice


def _output_devices(sd) -> list[tuple[int, str]]:
    devices = [(i, d["name"]) for i, d in enumerate(sd.query_devices()) if d["max_output_channels"] > 0]
    if not devices:
        raise AudioDeviceError(f"no audio output device found: {NO_DEVICE_HINT}")
    return devices


def _describe(sd, devices) -> str:
    default = sd.default.device[1]
    return "\n".join(f"{'*' if i == default else ' '} {i:>3}  {name}" for i, name in devices)


def list_devices() -> str:
    """Output devices, one per line as `index  name`, the default one marked with `*`."""
    sd = _sounddevice()
    return _describe(sd, _output_devices(sd))


def _resolve_device(sd, device: int | str | None) -> int | None:
    """PortAudio index of the output device chosen by index or by (case-insensitive) name substring;
    an exact name wins over substrings."""
    devices = _output_devices(sd)
    if device is None:
        return None
    if isinstance(device, str):
        key = device.lower()
        matches = [i for i, name in devices if name.lower() == key]
        matches = matches or [i for i, name in devices if key in name.lower()]
    else:
        matches = [i for i, _ in devices if i == device]
    if len(matches) != 1:
        what = "matches several" if matches else "matches no"
        raise AudioDeviceError(
            f"{device!r} {what} output device; choose one of (see --list-devices):\n{_describe(sd, devices)}"
        )
    return matches[0]


def check_device(device: int | str | None = None) -> int | None:
    """Resolve an output device now (None: the default), so a missing one fails before any work starts."""
    return _resolve_device(_sounddevice(), device)


class AudioPlayer:
    """Plays mono float32 PCM written from a producer thread on an output device, as it arrives.

    `write()` blocks while `capacity_s` of audio is queued; playback starts once `preroll_s` is
    buffered (or `finish()` was called). Use as a context manager: a clean exit waits for the end
    of playback, an exception stops at once.
    """

    def __init__(
        self,
        device: int | str | None = None,
        samplerate: int = 24000,
        blocksize: int = 480,
        capacity_s: float = 2.0,
        preroll_s: float = 0.1,
    ):
        sd = _sounddevice()
        index = _resolve_device(sd, device)
        self.samplerate = samplerate
        self._ring = RingBuffer(max(int(capacity_s * samplerate), blocksize), int(preroll_s * samplerate))
        self._done = threading.Event()
        self._close_lock = threading.Lock()
        self._callback_stop = sd.CallbackStop
        try:
            self._stream = sd.OutputStream(
                samplerate=samplerate,
                blocksize=blocksize,
                device=index,
                channels=1,
                dtype="float32",
                latency="low",
                callback=self._callback,
                finished_callback=self._done.set,
            )
            self._stream.start()
        except sd.PortAudioError as e:
            name = "default device" if index is None else f"device {index}"
            raise AudioDeviceError(f"cannot open audio output ({name}): {e}; {NO_DEVICE_HINT}") from None

    def _callback(self, outdata, frames, time_info, status):
        self._ring.read_into(outdata[:, 0])
        if self._ring.drained:
            raise self._callback_stop

    @property
    def underruns(self) -> int:
        return self._ring.underruns

    @property
    def played_samples(self) -> int:
        return self._ring.read_total

    @property
    def stopped(self) -> bool:
        return self._ring.stopped

    def write(self, pcm) -> None:
        """Queue mono samples at `samplerate`; blocks while the buffer is full. Dropped after `stop()`."""
        self._ring.write(pcm)

    def finish(self) -> None:
        """Wait until everything written has been played, then close the device."""
        self._ring.finish()
        pending_s = self._ring.available / self.samplerate
        if not self._done.wait(pending_s + 5.0 + self._stream.latency):
            self.stop()
            raise AudioDeviceError("the audio device stopped consuming samples")
        self._close()

    def stop(self) -> None:
        """Barge-in: silence the output now, drop what is queued, unblock the writer and close."""
        self._ring.stop()
        self._close()
        self._done.set()

    def _close(self) -> None:
        with self._close_lock:
            if not self._stream.closed:
                self._stream.abort()
                self._stream.close()

    def __enter__(self) -> AudioPlayer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and not self.stopped:
            self.finish()
        else:
            self.stop()
