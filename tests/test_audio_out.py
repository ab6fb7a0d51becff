"""audio_out: the SPSC ring buffer on its own, then AudioPlayer through a real PortAudio stream.

The stream tests play into a private PulseAudio server with a null sink (started here, reached through
ALSA's `pulse` plugin): unlike ALSA's `null` device it consumes samples in real time, so wall-clock
and underrun assertions mean something on a machine without a sound card. No assertion depends on the test
winning a race against a loaded machine: threads are waited for by the state they reach, a lower bound on
playing time holds under any load (the sink cannot play faster than real time), and the upper bounds only
catch hangs, with seconds of margin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import tracemalloc
import types
from pathlib import Path

import numpy as np
import pytest

from higgs_rt.audio_out import AudioDeviceError, AudioPlayer, RingBuffer, list_devices

from conftest import _unavailable

SR = 24000
REPO = Path(__file__).resolve().parents[1]


def _join(thread: threading.Thread, timeout: float = 10.0) -> None:
    """The thread ends (it is not blocked forever); the timeout only catches a hang, so it is generous."""
    thread.join(timeout)
    assert not thread.is_alive(), "thread still blocked"


def _writer(ring: RingBuffer, pcm: np.ndarray, capacity: int) -> tuple[threading.Thread, list[int]]:
    """A thread writing `pcm`, returned once it has filled the ring (so it is blocked, whatever the load)."""
    taken: list[int] = []
    thread = threading.Thread(target=lambda: taken.append(ring.write(pcm)), daemon=True)
    thread.start()
    _wait_for(lambda: ring.available == capacity, "the writer never filled the ring")
    return thread, taken


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# ---------------------------------------------------------------- ring buffer


def test_wraparound_keeps_order():
    ring = RingBuffer(8)
    out = np.empty(7, np.float32)
    ring.write(np.arange(6))
    assert ring.read_into(out[:4]) == 4 and out[:4].tolist() == [0, 1, 2, 3]
    ring.write(np.arange(6, 11))  # indices 6, 7, then 0, 1, 2
    assert ring.read_into(out) == 7
    assert out.tolist() == list(range(4, 11))


def test_exact_sample_order_end_to_end_with_blocking_writer():
    rng = np.random.default_rng(0)
    pcm = np.arange(50_000, dtype=np.float32)
    ring = RingBuffer(1000, preroll=100)

    def produce():
        i = 0
        while i < len(pcm):
            n = int(rng.integers(1, 3000))
            ring.write(pcm[i : i + n])
            i += n
        ring.finish()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    got, block = [], np.empty(256, np.float32)
    deadline = time.monotonic() + 20
    while not ring.drained and time.monotonic() < deadline:
        n = ring.read_into(block)
        got.append(block[:n].copy())
    _join(thread)
    np.testing.assert_array_equal(np.concatenate(got), pcm)
    assert ring.read_total == len(pcm)


def test_underrun_zero_fills_and_counts_one_event_per_dry_spell():
    ring = RingBuffer(16)
    out = np.full(5, 9, np.float32)
    ring.write([1, 2, 3])
    assert ring.read_into(out) == 3
    assert out.tolist() == [1, 2, 3, 0, 0] and ring.underruns == 1
    ring.read_into(out)  # still dry: same event
    assert out.tolist() == [0] * 5 and ring.underruns == 1
    ring.write([4, 5, 6, 7, 8])
    assert ring.read_into(out) == 5 and ring.underruns == 1
    ring.read_into(out)
    assert ring.underruns == 2


def test_running_dry_after_finish_is_not_an_underrun():
    ring = RingBuffer(16)
    ring.write([1, 2])
    ring.finish()
    out = np.empty(4, np.float32)
    assert ring.read_into(out) == 2 and out.tolist() == [1, 2, 0, 0]
    assert ring.drained and ring.underruns == 0
    with pytest.raises(RuntimeError):
        ring.write([3])


def test_preroll_holds_playback_until_buffered_or_finished():
    out = np.full(4, 9, np.float32)
    ring = RingBuffer(16, preroll=4)
    ring.write([1, 2, 3])
    assert ring.read_into(out) == 0 and out.tolist() == [0] * 4
    assert ring.underruns == 0 and ring.read_total == 0
    ring.write([4])
    assert ring.read_into(out) == 4 and out.tolist() == [1, 2, 3, 4]

    short = RingBuffer(16, preroll=8)
    short.write([1, 2])
    short.finish()
    assert short.read_into(out) == 2 and out.tolist() == [1, 2, 0, 0]


def test_write_blocks_while_full_and_resumes_as_space_frees():
    ring = RingBuffer(4)
    thread, taken = _writer(ring, np.arange(10), 4)
    assert thread.is_alive() and taken == []  # 4 of 10 taken, the rest waits for space
    got, out = [], np.empty(3, np.float32)
    deadline = time.monotonic() + 10
    while len(got) < 10 and time.monotonic() < deadline:
        got += out[: ring.read_into(out)].tolist()
    _join(thread)
    assert taken == [10] and got == list(range(10))


def test_stop_unblocks_a_blocked_writer_and_silences_reads():
    ring = RingBuffer(4)
    thread, taken = _writer(ring, np.ones(10), 4)
    assert thread.is_alive()
    ring.stop()
    _join(thread)
    assert taken == [4]
    out = np.full(4, 9, np.float32)
    assert ring.read_into(out) == 0 and out.tolist() == [0] * 4
    assert ring.write(np.ones(3)) == 0


def test_read_path_does_not_allocate():
    block = 4096  # any temporary copy of a block would show up as >= 16 KiB
    ring = RingBuffer(block * 5 // 2)  # read offsets cycle through 0, 4096, 8192 (wrapping), 2048, ...
    out = np.empty(block, np.float32)
    data = np.ones(block, np.float32)
    ring.write(data)
    ring.read_into(out)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(500):
            ring.write(data)  # float32 input: taken without a copy
            ring.read_into(out)
            ring.read_into(out)  # dry: zero-fill and underrun path
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ring.read_total == 501 * block and ring.underruns == 500
    assert peak - base < 2048, f"read path allocated: peak grew by {peak - base} bytes"
    assert current - base < 512


# ---------------------------------------------------------------- real PortAudio stream


def _threads_settle(baseline: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


def test_plays_in_real_time_and_accounts_every_sample(pulse_device):
    """The writer runs 1.5 s ahead of the sink, so only a stall longer than that would underrun. Playing cannot
    be faster than real time under any load; the upper bound only catches a device that stopped."""
    seconds = 3.0
    chunks = [0.1 * np.sin(np.arange(i, i + 2400) * 0.05, dtype=np.float32) for i in range(0, int(seconds * SR), 2400)]
    t0 = time.monotonic()
    with AudioPlayer(pulse_device, capacity_s=1.5) as player:
        for chunk in chunks:
            player.write(chunk)
    elapsed = time.monotonic() - t0
    assert 0.75 * seconds < elapsed < seconds + 10, f"{seconds} s of audio took {elapsed:.2f} s"
    assert player.played_samples == int(seconds * SR)
    assert player.underruns == 0


def test_producer_stall_is_counted_as_an_underrun(pulse_device):
    """0.2 s of audio, then a 1.5 s stall: the ring runs dry once, with 1.3 s to spare for a slow device."""
    player = AudioPlayer(pulse_device, preroll_s=0.1)
    player.write(np.zeros(int(0.2 * SR), np.float32))
    time.sleep(1.5)
    player.write(np.zeros(int(0.2 * SR), np.float32))
    player.finish()
    assert player.underruns == 1
    assert player.played_samples == int(0.4 * SR)


def test_stop_mid_stream_drops_the_rest_and_leaves_no_thread(pulse_device):
    """That stop() does not wait for queued audio is shown where nothing plays at all (the next test); here,
    on a real device: the blocked writer is released, nothing more is played, no thread is left."""
    baseline = threading.active_count()
    player = AudioPlayer(pulse_device, capacity_s=0.3)
    producer = threading.Thread(target=player.write, args=(np.zeros(5 * SR, np.float32),))
    producer.start()
    _wait_for(lambda: player.played_samples > 0, "nothing was played")
    assert producer.is_alive(), "writer should be blocked on the full buffer"  # 5 s cannot be taken this soon
    player.stop()
    _join(producer)
    played = player.played_samples
    assert 0 < played < 5 * SR
    time.sleep(0.1)
    assert player.played_samples == played, "still playing after stop()"
    assert _threads_settle(baseline) == baseline
    player.finish()  # after stop(): returns at once


def test_device_by_index(pulse_device):
    import sounddevice as sd

    index = [d["name"] for d in sd.query_devices()].index(pulse_device)
    with AudioPlayer(index, preroll_s=0) as player:
        player.write(np.zeros(480, np.float32))
    assert player.played_samples == 480
    assert any(line.split()[-1] == pulse_device for line in list_devices().splitlines())


@pytest.mark.parametrize("device", ["no-such-card", 999, "e"])  # "e": both "pulse" and "default"
def test_unknown_or_ambiguous_device_is_a_clear_error(pulse_device, device):
    with pytest.raises(AudioDeviceError, match=r"output device; choose one of") as err:
        AudioPlayer(device)
    assert pulse_device in str(err.value)


def test_no_output_device_at_all():
    """Real PortAudio, started where it can find nothing: no sound card and a PulseAudio that isn't there."""
    if os.path.exists("/dev/snd"):
        pytest.skip("this machine has sound cards: PortAudio cannot be made to see no device")
    code = "from higgs_rt.audio_out import list_devices\nlist_devices()"
    env = {**os.environ, "PULSE_SERVER": "unix:/nonexistent/native", "PULSE_COOKIE": os.devnull}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if "PortAudio library not found" in proc.stderr:
        _unavailable("libportaudio2 not installed")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "higgs_rt.audio_out.AudioDeviceError: no audio output device found: use --out FILE.wav to write a file instead"
    )


class _FakeSoundDevice:
    """Stands in for the sounddevice module: a fixed device table, streams that record their device."""

    class PortAudioError(Exception):
        pass

    class CallbackStop(Exception):
        pass

    def __init__(self, devices, default_out):
        self.devices = [{"name": name, "max_output_channels": outs} for name, outs in devices]
        self.default = types.SimpleNamespace(device=[-1, default_out])
        self.opened = []

    def query_devices(self):
        return self.devices

    def OutputStream(self, device, **kwargs):
        self.opened.append(device)
        return _FakeStream()


class _FakeStream:
    """An output stream that never calls its callback: nothing is ever played."""

    latency = 0.01

    def __init__(self):
        self.closed = False

    def start(self):
        pass

    def abort(self):
        pass

    def close(self):
        self.closed = True


@pytest.fixture
def fake_sd(monkeypatch):
    fake = _FakeSoundDevice([("Mic", 0), ("Speakers", 2), ("USB Speakers", 2), ("HDMI", 8)], default_out=1)
    monkeypatch.setitem(sys.modules, "sounddevice", fake)
    return fake


def test_stop_does_not_wait_for_queued_audio(fake_sd):
    """On a device that plays nothing the queue never drains, so a stop() that waited for it would never
    return: it returns, releases the blocked writer and closes the stream (the joins' timeouts only report a
    hang)."""
    player = AudioPlayer(capacity_s=0.1)
    producer = threading.Thread(target=player.write, args=(np.zeros(SR, np.float32),), daemon=True)
    producer.start()
    _wait_for(lambda: player._ring.available == int(0.1 * SR), "the writer never filled the queue")
    stopper = threading.Thread(target=player.stop, daemon=True)
    stopper.start()
    _join(stopper)
    _join(producer)
    assert player.stopped and player.played_samples == 0 and player._stream.closed
    player.finish()  # after stop(): returns at once


def test_list_devices_shows_outputs_only_and_marks_the_default(fake_sd):
    assert list_devices() == "*   1  Speakers\n    2  USB Speakers\n    3  HDMI"


@pytest.mark.parametrize(("device", "index"), [(None, None), ("speakers", 1), ("usb", 2), ("hdmi", 3), (3, 3)])
def test_device_choice(fake_sd, device, index):
    AudioPlayer(device)
    assert fake_sd.opened == [index]


@pytest.mark.parametrize("device", ["speak", "nope", 0, 7])
def test_device_choice_errors_list_the_candidates(fake_sd, device):
    with pytest.raises(AudioDeviceError, match="choose one of") as err:
        AudioPlayer(device)
    assert "USB Speakers" in str(err.value) and "Mic" not in str(err.value)


def test_no_output_device_from_query(fake_sd):
    fake_sd.devices = fake_sd.devices[:1]
    with pytest.raises(AudioDeviceError, match="^no audio output device found: use --out FILE.wav"):
        AudioPlayer()


def test_missing_sounddevice_or_portaudio(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sounddevice", None)
    with pytest.raises(AudioDeviceError, match="sounddevice is not installed"):
        list_devices()
    # what sounddevice raises at import when libportaudio is absent
    (tmp_path / "sounddevice.py").write_text("raise OSError('PortAudio library not found')\n")
    monkeypatch.delitem(sys.modules, "sounddevice")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AudioDeviceError, match="PortAudio library not found.*--out FILE.wav"):
        AudioPlayer()
