"""higgs_rt.audio_in: reference recordings (espeak-ng speech at several rates, stereo, int/float) -> 24 kHz mono,
and one clear ReferenceAudioError for everything a user can get wrong."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import soundfile as sf
import torch

from higgs_rt.audio_in import ReferenceAudioError, check_transcript, load_reference, resample_to

SR = 24000


@pytest.mark.parametrize("variant", ["22k", "8k", "48k", "flac", "stereo"])
def test_speech_files_become_24k_mono(speech, variant):
    info = sf.info(speech[variant])
    ref = load_reference(speech[variant])
    assert ref.sample_rate == SR and ref.samples.dtype == torch.float32 and ref.samples.dim() == 1
    assert abs(ref.seconds - info.duration) < 1e-3
    assert ref.sha256 == hashlib.sha256(speech[variant].read_bytes()).hexdigest()
    assert 0.02 < float(ref.samples.pow(2).mean().sqrt()) < 1


def test_rates_agree_after_resampling(speech):
    """The same speech rendered at 22.05 kHz and resampled by sox to 48 kHz gives nearly the same 24 kHz signal."""
    a, b = load_reference(speech["22k"]).samples, load_reference(speech["48k"]).samples
    n = min(len(a), len(b))
    assert (a[:n] - b[:n]).pow(2).mean() < 1e-3 * a[:n].pow(2).mean()


def test_stereo_is_the_mean_of_its_channels(speech):
    data, rate = sf.read(speech["stereo"], dtype="float32")
    want = torch.from_numpy(resample_to(data.mean(1), rate, SR))
    for source, given_rate in ((speech["stereo"], None), (data, rate), (data.T.copy(), rate),
                               (torch.from_numpy(data), rate)):
        assert torch.allclose(load_reference(source, given_rate).samples, want, atol=1e-6)


def test_int_and_float_arrays_agree(speech):
    pcm, rate = sf.read(speech["22k"], dtype="int16")
    as_float = load_reference(pcm.astype(np.float32) / 32768, rate).samples
    assert torch.equal(load_reference(pcm, rate).samples, as_float)
    assert torch.allclose(load_reference(pcm.astype(np.int32) << 16, rate).samples, as_float, atol=1e-7)
    assert torch.equal(load_reference(speech["22k"]).samples, as_float)  # soundfile scales int16 the same way


def test_array_hash_depends_on_samples_and_rate():
    x = 0.1 * np.random.default_rng(0).standard_normal(24000).astype(np.float32)
    assert load_reference(x, 24000).sha256 == load_reference(x.copy(), 24000).sha256
    assert load_reference(x, 24000).sha256 != load_reference(x, 16000).sha256
    assert load_reference(x, 24000).sha256 != load_reference(x * 0.5, 24000).sha256


def test_soxr_keeps_a_tone_and_gives_the_length():
    for rate in (8000, 22051, 44100, 192000):
        t = np.arange(int(0.75 * rate)) / rate
        ref = load_reference((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate)
        assert abs(ref.samples.shape[0] - 0.75 * SR) <= 1
        want = 0.5 * np.sin(2 * np.pi * 440 * np.arange(ref.samples.shape[0]) / SR)
        middle = slice(SR // 20, -SR // 20)  # away from the edges
        assert np.abs(ref.samples.numpy()[middle] - want[middle]).max() < 1e-3, rate


ODD_RATES = (22051, 24001, 44101, 192000)
MEMORY_PROBE = """
import io, json, resource, sys, time
import numpy as np, soundfile as sf
from higgs_rt.audio_in import load_reference
def wav(rate, seconds):
    out = io.BytesIO()
    sf.write(out, 0.1 * np.random.default_rng(0).standard_normal(int(rate * seconds)), rate, format="WAV",
             subtype="PCM_16")
    return out.getvalue()
files = {rate: wav(rate, float(sys.argv[1])) for rate in map(int, sys.argv[2:])}
load_reference(np.sin(np.arange(12000, dtype=np.float32)), 16000)  # imports and first-call allocations before the baseline
path = __import__("pathlib").Path("probe.wav")  # in the working directory the test gives
rows = {}
for rate, data in files.items():
    path.write_bytes(data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    ref = load_reference(path)
    rows[rate] = dict(seconds=time.perf_counter() - start, samples=int(ref.samples.shape[0]),
                      peak_mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
print(json.dumps(rows))
"""


def test_odd_rates_cost_little_memory_and_time(tmp_path):
    """The hand-written sinc resampler needed 10.6 GB and 65 s for 22051 Hz; soxr's cost is linear in the samples.
    Measured in a fresh process (ru_maxrss is the peak of the whole process): the growth of the peak across the
    loads. The first odd rate's file is 26 KB of 16-bit samples, as in the report."""
    r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, "0.6", *map(str, ODD_RATES)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {int(k): v for k, v in json.loads(r.stdout).items()}
    for rate in ODD_RATES:
        assert abs(rows[rate]["samples"] - 0.6 * SR) <= 1
        assert rows[rate]["peak_mb"] < 200, rows
        assert rows[rate]["seconds"] < 30, rows  # ~10 ms unloaded; generous for a loaded 2-core CI machine


def test_a_small_file_cannot_decode_into_gigabytes(tmp_path):
    """FLAC stores a constant signal in a few bytes per block: the header's length is checked before reading."""
    long = tmp_path / "long.flac"
    sf.write(long, np.full(192000 * 60, 0.25, np.float32), 192000, format="FLAC", subtype="PCM_16")
    assert long.stat().st_size < 2 << 20
    with pytest.raises(ReferenceAudioError, match=r"60\.00 s long"):
        load_reference(long)
    many = tmp_path / "many.wav"
    sf.write(many, noise(0.6, 8000)[:, None].repeat(9, 1), 8000)
    with pytest.raises(ReferenceAudioError, match="9 channels: use 1 to 8"):
        load_reference(many)
    slow = tmp_path / "slow.wav"
    sf.write(slow, noise(1, 4000), 4000)
    with pytest.raises(ReferenceAudioError, match="from 8000 to 192000 Hz, got 4000"):
        load_reference(slow)


def noise(seconds: float, rate: int = 16000, level: float = 0.1) -> np.ndarray:
    return level * np.random.default_rng(1).standard_normal(int(seconds * rate)).astype(np.float32)


@pytest.mark.parametrize("audio,rate,message", [
    (noise(0.3), 16000, r"0\.30 s long: use 0\.5 to 30 s"),
    (noise(31), 16000, r"31\.00 s long: use 0\.5 to 30 s"),
    (np.zeros(16000, np.float32), 16000, r"silent \(RMS -inf dBFS"),
    (noise(1, level=10 ** (-70 / 20)), 16000, r"silent \(RMS -70\.\d dBFS, below -60 dBFS\)"),
    (np.full(16000, np.nan, np.float32), 16000, "NaN or infinite"),
    (noise(1, level=3.3e37), 16000, r"peaks at \d\.\d+e\+38, far above full scale"),
    (noise(1, level=8000.0), 16000, r"peaks at 3\.\d+e\+04, far above full scale \(1\.0\)"),
    (noise(1), None, "needs its sample_rate"),
    (noise(1), 16000.5, "integer from 8000 to 192000 Hz"),
    (noise(1, 4000), 4000, "integer from 8000 to 192000 Hz, got 4000"),
    (noise(0.6, 192001), 192001, "integer from 8000 to 192000 Hz, got 192001"),
    (noise(1)[None, None], 16000, r"must be \[samples\] or \[samples, channels\]"),
    (np.array(["a"] * 16000), 16000, "must be numbers"),
    (np.zeros((16000, 9), np.float32), 16000, "has 9 channels: use 1 to 8"),
    (np.zeros((100, 16000), np.int16), 16000, "has 100 channels: use 1 to 8"),
    (np.zeros((200, 200), np.float32), 8000, "has 200 channels"),
    (np.zeros(16000 * 40, np.int16), 16000, r"40\.00 s long"),
    ([[0.1, 0.2], [0.3]], 16000, "must be an array of samples"),
])
def test_bad_arrays_are_refused(audio, rate, message):
    with pytest.raises(ReferenceAudioError, match=message):
        load_reference(audio, rate)


@pytest.mark.parametrize("left,right", [(np.inf, -np.inf), (np.nan, 0.0), (3e38, 3e38)])
def test_non_finite_or_huge_channels_are_refused_without_a_numpy_warning(left, right):
    """Mixing such channels to mono overflowed or met inf - inf: numpy printed a RuntimeWarning on stderr before
    the one-line refusal (found by fuzzing files' bytes)."""
    audio = np.stack([noise(1), noise(1)], 1)
    audio[100, :] = left, right
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ReferenceAudioError, match="NaN or infinite|far above full scale"):
            load_reference(audio, 16000)


def test_bad_files_are_refused(speech, tmp_path):
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(speech["22k"].read_bytes()[:30])
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not audio at all" * 100)
    for path in (truncated, garbage):
        with pytest.raises(ReferenceAudioError, match=f"{path.name} is not a readable WAV/FLAC file") as e:
            load_reference(path)
        assert "BytesIO" not in str(e.value) and " at 0x" not in str(e.value)  # libsndfile's words, not a repr
    with pytest.raises(ReferenceAudioError, match="cannot read reference audio .*missing.wav"):
        load_reference(tmp_path / "missing.wav")
    with pytest.raises(ReferenceAudioError, match="is 22050 Hz, but sample_rate=16000"):
        load_reference(speech["22k"], 16000)
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(24000, np.int16), 24000)
    with pytest.raises(ReferenceAudioError, match="silent"):
        load_reference(silent)
    buf = io.BytesIO()
    sf.write(buf, noise(5, 24000), 24000, format="FLAC")
    streamed = bytearray(buf.getvalue())  # STREAMINFO's 36-bit sample count (bytes 21-25) zeroed: "unknown"
    streamed[21] &= 0xF0
    streamed[22:26] = bytes(4)
    (tmp_path / "streamed.flac").write_bytes(streamed)
    with pytest.raises(ReferenceAudioError, match="streamed.flac does not say how long it is"):
        load_reference(tmp_path / "streamed.flac")
    loud = tmp_path / "loud.wav"
    sf.write(loud, noise(1, 24000, level=1e9), 24000, subtype="FLOAT")
    with pytest.raises(ReferenceAudioError, match="far above full scale"):
        load_reference(loud)
    assert issubclass(ReferenceAudioError, ValueError)


@pytest.mark.parametrize("text", [None, "", "   \n"])
def test_a_reference_needs_its_transcript(text):
    with pytest.raises(ReferenceAudioError, match="needs its transcript"):
        check_transcript(text)
    assert check_transcript("  Hello.  ") == "Hello."


def test_a_transcript_is_bounded():
    assert check_transcript("x" * 4096) == "x" * 4096
    with pytest.raises(ReferenceAudioError, match="the reference transcript has 4097 characters: at most 4096"):
        check_transcript("x" * 4097)


def test_a_huge_file_is_not_read_whole(tmp_path, monkeypatch):
    """A reference file is read no further than the largest usable one can be (30 s at 192 kHz in 8 channels of
    64-bit samples): a file of gigabytes, or /dev/zero, was read whole into memory before its header was
    looked at. (The bound is lowered here so that the test reads little.)"""
    import higgs_rt.audio_in as audio_in

    assert getattr(audio_in, "MAX_FILE_BYTES", 0) >= 30 * 192000 * 8 * 8  # every usable reference fits
    monkeypatch.setattr(audio_in, "MAX_FILE_BYTES", 1 << 16, raising=False)
    big = tmp_path / "big.wav"
    sf.write(big, noise(1), 16000)  # 32 KB of samples, then a 100 MB tail (sparse: no disk used)
    with big.open("r+b") as f:
        f.truncate(100 << 20)
    with pytest.raises(ReferenceAudioError, match=r"big\.wav is larger than 0 MiB, more than 30 s of audio"):
        load_reference(big)
    for device in ("/dev/zero", "/dev/urandom"):
        if os.path.exists(device):
            with pytest.raises(ReferenceAudioError, match=f"{device} is not a regular file"):
                load_reference(device)


def test_float_samples_a_little_over_full_scale_are_kept():
    hot = np.sin(np.linspace(0, 2000, 24000, dtype=np.float32)) * 1.5  # a clipped float mix, peak +3.5 dBFS
    ref = load_reference(hot, 24000)
    assert ref.samples.shape == (24000,) and float(ref.samples.abs().max()) == pytest.approx(1.5, abs=1e-3)


def test_a_fifo_a_directory_or_a_bad_path_is_refused_at_once(tmp_path):
    """A FIFO without a writer made the open wait forever; a directory, a device and a NUL in the path were
    other errors (or a read of up to MAX_FILE_BYTES): each is one line, without reading."""
    fifo = tmp_path / "ref.wav"
    os.mkfifo(fifo)
    probe = ("from higgs_rt.audio_in import load_reference, ReferenceAudioError\n"
             "try:\n    load_reference(__import__('sys').argv[1])\n"
             "except ReferenceAudioError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", probe, str(fifo)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and "ref.wav is not a regular file" in r.stdout, (r.stdout, r.stderr)
    for path in (tmp_path, "/dev/zero"):
        with pytest.raises(ReferenceAudioError, match="is not a regular file"):
            load_reference(path)
    with pytest.raises(ReferenceAudioError, match="cannot read reference audio .*embedded null byte"):
        load_reference(str(tmp_path / "a\0b.wav"))


def test_a_long_file_is_refused_from_its_header_before_its_samples_are_read(tmp_path):
    """A 2-hour WAV (115 MB here; up to MAX_FILE_BYTES, 352 MiB) was read whole into memory before its header
    said it was too long: now the header is read from the file and the samples are never read."""
    import tracemalloc

    long = tmp_path / "long.wav"
    with sf.SoundFile(long, "w", 8000, 1, "PCM_16") as f:
        f.write(noise(1, 8000))
    with long.open("r+b") as f:  # a data chunk of 2 hours, sparse on disk
        f.seek(40)
        f.write((8000 * 2 * 7200).to_bytes(4, "little"))
        f.truncate(44 + 8000 * 2 * 7200)
    tracemalloc.start()
    try:
        with pytest.raises(ReferenceAudioError, match=r"7200\.00 s long"):
            load_reference(long)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_tensors_of_any_float_type_and_device_are_taken():
    """A bfloat16 tensor was a TypeError from .numpy() (no such numpy type), and a tensor's layout was checked
    only after it was copied to the host: now its shape is checked first, then it is converted."""
    x = torch.from_numpy(noise(1, 24000))
    want = load_reference(x.to(torch.bfloat16).float(), 24000).samples
    assert torch.equal(load_reference(x.to(torch.bfloat16), 24000).samples, want)
    with pytest.raises(ReferenceAudioError, match=r"40\.00 s long"):
        load_reference(torch.empty(40 * 24000, device="meta"), 24000)  # no data: refused from the shape alone
    with pytest.raises(ReferenceAudioError, match="has 9 channels"):
        load_reference(torch.empty(9, 24000, device="meta"), 24000)


def test_a_meta_or_sparse_tensor_is_taken_or_refused_in_one_line():
    """A meta tensor of a valid shape was a NotImplementedError from its copy to the host, a sparse one a TypeError
    from .numpy(): the meta one is refused (it holds no samples), the sparse one read as its dense samples."""
    with pytest.raises(ReferenceAudioError, match="a tensor on the meta device: it holds no samples"):
        load_reference(torch.empty(24000, device="meta"), 24000)
    x = torch.from_numpy(noise(1, 24000))
    assert torch.equal(load_reference(x.to_sparse(), 24000).samples, load_reference(x, 24000).samples)
    stereo = torch.stack([x, x.flip(0)], 1)
    assert torch.equal(load_reference(stereo.to_sparse(), 24000).samples, load_reference(stereo, 24000).samples)


def test_unsigned_integer_arrays_are_centred():
    """uint16/uint32/uint64 arrays were divided as if signed: the speech rode on a DC offset of +1.0 (peak 1.4),
    accepted without a word. Unsigned PCM is centred on half its range, as uint8 always was."""
    x = noise(1, 24000).astype(np.float64)
    want = load_reference(x.astype(np.float32), 24000).samples
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        half = 2.0 ** (8 * np.dtype(dtype).itemsize - 1)
        pcm = np.round(x * (half - 1) + half).astype(dtype)
        got = load_reference(pcm, 24000).samples
        assert abs(float(got.mean())) < 1e-3 and torch.allclose(got, want, atol=2 / half + 1e-6), dtype


def test_a_constant_offset_is_silence(tmp_path):
    """A constant signal (an 8-bit WAV of zero bytes reads as -1.0; a float array of 0.5) has an RMS of 0 dBFS and
    passed the silence check: it was encoded as a voice. The RMS is now measured around the mean."""
    zeros = tmp_path / "zeros.wav"
    sf.write(zeros, np.full(24000, -1.0), 24000, subtype="PCM_U8")
    with pytest.raises(ReferenceAudioError, match=r"silent \(RMS -inf dBFS, below -60 dBFS, apart from a constant "
                                                  r"offset of -1\.00\)"):
        load_reference(zeros)
    with pytest.raises(ReferenceAudioError, match=r"silent .*offset of \+0\.50"):
        load_reference(np.full(16000, 0.5, np.float32) + noise(1, level=1e-5), 16000)
    speech_on_dc = noise(1) + 0.5  # sound on an offset is still sound
    assert load_reference(speech_on_dc, 16000).samples.shape == (24000,)


def test_channels_that_cancel_when_mixed_say_so(tmp_path):
    """Out-of-phase stereo (x and -x) mixes to silence: refused, saying why (it said only "silent")."""
    x = noise(1)
    stereo = tmp_path / "phase.wav"
    sf.write(stereo, np.stack([x, -x], axis=1), 16000)
    with pytest.raises(ReferenceAudioError, match=r"silent \(RMS [-\w.]+ dBFS, below -60 dBFS\): its channels "
                                                  r"cancel when mixed to mono"):
        load_reference(stereo)
    with pytest.raises(ReferenceAudioError, match=r"silent \(RMS -inf dBFS, below -60 dBFS\)$"):
        load_reference(np.zeros((16000, 2), np.float32), 16000)  # silent channels: nothing about mixing


def test_a_wav_without_samples_says_so(tmp_path):
    """A WAV whose data chunk is empty (a 44-byte header: a writer stopped before its first sample, or a size of 0
    before the samples) was "reference audio is 0.00 s long": now it says the file holds no audio samples. An empty
    array says so too (it was "must be [samples] or [samples, channels], got shape (0,)")."""
    from higgs_rt.pcm import pcm16_bytes, wav_header

    pcm = pcm16_bytes(noise(1))
    for name, data in (("header.wav", wav_header(16000, 0)), ("zero-size.wav", wav_header(16000, 0) + pcm)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ReferenceAudioError, match=rf"{name} holds no audio samples \(its header says there are "
                                                      r"none: .*\): give 0\.5 to 30 s of speech$"):
            load_reference(tmp_path / name)
    for empty in (np.zeros(0, np.float32), np.zeros((0, 2), np.int16), torch.zeros(2, 0)):
        with pytest.raises(ReferenceAudioError, match=r"holds no audio samples \(shape \((0,|0, 2|2, 0)\)\)"):
            load_reference(empty, 16000)


def test_a_wav_cut_short_is_read_as_far_as_it_goes(tmp_path):
    """A header that says more samples than the file holds (a truncated upload): what is there is decoded, the same
    samples as the whole file's, and a cut left too short is refused with its true length (a few samples were
    "0.00 s long")."""
    from higgs_rt.pcm import pcm16_bytes, wav_header

    x = noise(2)
    whole, cut, tiny = tmp_path / "whole.wav", tmp_path / "cut.wav", tmp_path / "tiny.wav"
    whole.write_bytes(wav_header(16000, 2 * len(x)) + pcm16_bytes(x))
    cut.write_bytes(whole.read_bytes()[:44 + 2 * 12000])  # 0.75 s of the 2 s its header says
    tiny.write_bytes(whole.read_bytes()[:44 + 2 * 50])  # 50 samples
    first = load_reference(cut).samples
    assert first.shape == (18000,)
    assert torch.equal(first, load_reference(sf.read(cut, dtype="int16")[0], 16000).samples)
    assert torch.allclose(first[2000:-2000], load_reference(whole).samples[2000:16000], atol=1e-4)  # away from the cut
    with pytest.raises(ReferenceAudioError, match=r"tiny\.wav is 0\.0031 s long: use 0\.5 to 30 s"):
        load_reference(tiny)


def test_a_short_read_is_not_padded(tmp_path):
    """A file whose decoder gives fewer samples than its header says (an MP3 cut short) is as long as what was
    decoded, never padded with stale samples (soundfile's `blocks` pads a short read so)."""
    if not sf.check_format("MP3", "MPEG_LAYER_III"):
        pytest.skip("this libsndfile cannot write MP3")
    buf = io.BytesIO()
    sf.write(buf, noise(2), 16000, format="MP3", subtype="MPEG_LAYER_III")
    cut = tmp_path / "cut.mp3"
    cut.write_bytes(buf.getvalue()[:len(buf.getvalue()) // 8])
    assert sf.info(cut).frames == 32000 and len(sf.read(cut)[0]) < 8000  # the header's length, what decodes
    with pytest.raises(ReferenceAudioError, match=r"cut\.mp3 is 0\.\d+ s long"):
        load_reference(cut)


@pytest.mark.parametrize("subtype,tolerance", [("PCM_U8", 1 / 128), ("PCM_16", 1 / 32768), ("PCM_24", 1e-6),
                                               ("PCM_32", 1e-6), ("FLOAT", 1e-6), ("DOUBLE", 1e-6)])
def test_every_sample_format_reads_as_the_same_signal(tmp_path, subtype, tolerance):
    """8-bit (unsigned, centred), 16-, 24- and 32-bit integer and 32/64-bit float WAVs read as the signal written;
    so do they with more chunks (LIST INFO, an unknown one of odd size and its pad byte) between fmt and data."""
    import struct

    x = noise(1, level=0.2)  # peak ~0.9: no clipping in the integer formats
    want = load_reference(x, 16000).samples
    path = tmp_path / "x.wav"
    sf.write(path, x, 16000, subtype=subtype)
    assert torch.allclose(load_reference(path).samples, want, rtol=0, atol=2 * tolerance)
    chunk = lambda tag, payload: tag + struct.pack("<I", len(payload)) + payload + bytes(len(payload) % 2)  # noqa
    data = path.read_bytes()
    at = data.index(b"data")
    body = data[12:at] + chunk(b"LIST", b"INFO" + chunk(b"INAM", b"A voice\0")) + chunk(b"junk", b"odd") + data[at:]
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body)
    assert torch.allclose(load_reference(path).samples, want, rtol=0, atol=2 * tolerance)


@pytest.mark.parametrize("rate,channels,bits", [(0, 1, 16), (0xFFFFFFFF, 1, 16), (1, 1, 16), (7999, 1, 16),
                                                (192001, 1, 16), (16000, 0, 16), (16000, 9, 16),
                                                (16000, 65535, 16), (16000, 1, 0), (16000, 1, 64)])
def test_a_hostile_wav_header_is_one_clear_error(tmp_path, rate, channels, bits):
    """Rates, channel counts and sample sizes no recording has, written by hand into a header: each is one
    ReferenceAudioError naming the file (or the rate), never a traceback or a read of what the header promises."""
    import struct

    block = max(1, channels * bits // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", 1, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
    data = bytes(32000)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path = tmp_path / "hostile.wav"
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    with pytest.raises(ReferenceAudioError, match=r"hostile\.wav|sample rate must be an integer from 8000 to 192000 "
                                                  r"Hz|has (9|65535) channels") as e:
        load_reference(path)
    assert "\n" not in str(e.value)


def test_a_symlink_to_a_device_is_refused(tmp_path):
    link = tmp_path / "ref.wav"
    link.symlink_to("/dev/zero")
    with pytest.raises(ReferenceAudioError, match=r"ref\.wav is not a regular file"):
        load_reference(link)


HEAVY_FLAC_PROBE = """
import resource, sys
import numpy as np, soundfile as sf
from higgs_rt.audio_in import ReferenceAudioError, load_reference
rate, channels = 192000, 8
with sf.SoundFile("heavy.flac", "w", rate, channels, "PCM_16", format="FLAC") as f:  # 29.9 s of a constant
    block = np.full((rate // 10, channels), 0.25, np.float32)
    for _ in range(299):
        f.write(block)
load_reference(np.sin(np.arange(12000, dtype=np.float32)), 16000)  # imports and first-call allocations first
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_reference("heavy.flac")
except ReferenceAudioError as e:
    print(e, file=sys.stderr)
print(__import__("os").path.getsize("heavy.flac"), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_a_small_flac_of_many_channels_costs_little_memory(tmp_path):
    """A constant FLAC of 30 s at 192 kHz in 8 channels is ~50 KB, and was decoded whole in its 8 channels
    (184 MB of float32) and copied twice more for its checks: 550 MB for a 50 KB upload. Now it is read a block at
    a time and mixed to mono as it comes (23 MB). Measured in a fresh process, as the odd rates are."""
    r = subprocess.run([sys.executable, "-c", HEAVY_FLAC_PROBE], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "is silent" in r.stderr, r.stderr
    size, peak_mb = map(float, r.stdout.split())
    assert size < 100_000 and peak_mb < 150, (size, peak_mb)


def encoded(fmt: str, subtype: str, seconds: float = 2, rate: int = 16000) -> bytes:
    """noise(seconds) as a file of that format, or a skip where this libsndfile cannot write it."""
    if not sf.check_format(fmt, subtype):
        pytest.skip(f"this libsndfile cannot write {fmt}/{subtype}")
    buf = io.BytesIO()
    sf.write(buf, noise(seconds, rate), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def patched(data: bytes, at: int, new: bytes) -> bytes:
    return data[:at] + new + data[at + len(new):]


def flac_audio_start(flac: bytes) -> int:
    """Where a FLAC's first frame begins: after "fLaC" and its metadata blocks (the last one flagged)."""
    at = 4
    while True:
        last, size = flac[at] & 0x80, int.from_bytes(flac[at + 1:at + 4], "big")
        at += 4 + size
        if last:
            return at


REFUSED_HEADERS = {  # name: (the file, what its message says)
    "rate0.wav": (lambda: patched(encoded("WAV", "PCM_16"), 24, bytes(4)),
                  r"rate0\.wav: its header says the sample rate is 0 Hz \(or over 2 GHz\): the file is damaged or "
                  r"was written wrong; re-encode it, e.g. as WAV$"),
    "float-rate0.wav": (lambda: patched(encoded("WAV", "FLOAT"), 24, bytes(4)),
                        r"float-rate0\.wav: its header says the sample rate is 0 Hz"),
    # STREAMINFO's 20-bit rate: two bytes and the top nibble of the third (0 at 16 kHz, asserted below)
    "rate0.flac": (lambda: patched(encoded("FLAC", "PCM_16"), 18, bytes(2)),
                   r"rate0\.flac: its header says the sample rate is 0 Hz"),
    "mono0.wav": (lambda: patched(encoded("WAV", "PCM_16"), 22, bytes(2)),
                  r"mono0\.wav: its header says it has 0 channels: the file is damaged"),
    "wide.wav": (lambda: patched(encoded("WAV", "PCM_16"), 22, b"\xff\xff"),
                 r"wide\.wav: its header says it has over 1024 channels: use 1 to 8$"),
    "int64.wav": (lambda: patched(encoded("WAV", "PCM_16"), 34, b"\x40\x00"),
                  r"int64\.wav: its samples are in an encoding that cannot be decoded \(or its header gives a sample "
                  r"size of 0 or 64 bits\)"),
}


@pytest.mark.parametrize("name", REFUSED_HEADERS)
def test_a_header_libsndfile_refuses_says_what_is_wrong(tmp_path, name):
    """A header that says 0 Hz was "not a readable WAV/FLAC file: Internal error : SF_INFO struct incomplete.", one
    that says 0 channels "...: Channel count is zero.": each now says what the header gives, naming the file."""
    make, message = REFUSED_HEADERS[name]
    data = make()
    if name == "rate0.flac":
        assert data[20] >> 4 == 0  # 16000 Hz is 0x03E80: the two bytes zeroed were all of it
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ReferenceAudioError, match=message) as e:
        load_reference(tmp_path / name)
    assert "\n" not in str(e.value) and "SF_INFO" not in str(e.value)


FLAC_CUTS = {  # name: the bytes kept of a 2 s FLAC (its frames start at `audio`)
    "header-only": lambda flac, audio: flac[:audio],
    "first-frame": lambda flac, audio: flac[:audio + 100],
    "half": lambda flac, audio: flac[:len(flac) // 2],
    "last-byte": lambda flac, audio: flac[:-1],
    "garbage-audio": lambda flac, audio: flac[:audio] + np.random.default_rng(2).bytes(len(flac) - audio),
    "garbage-half": lambda flac, audio: flac[:len(flac) // 2] + bytes(len(flac) - len(flac) // 2),
}


@pytest.mark.parametrize("cut", FLAC_CUTS)
def test_a_flac_cut_short_or_damaged_says_so(tmp_path, cut):
    """A FLAC cut short (an upload that stopped) or with garbage after a valid header was "not a readable WAV/FLAC
    file: Error : flac decoder lost sync." (or "Internal psf_fseek() failed." for a header only): now it says the file
    ends, or is damaged, inside its audio data. Bytes after the whole file are no harm: reading stops at its length."""
    flac = encoded("FLAC", "PCM_16")
    path = tmp_path / "ref.flac"
    path.write_bytes(FLAC_CUTS[cut](flac, flac_audio_start(flac)))
    with pytest.raises(ReferenceAudioError, match=r"ref\.flac ends inside its audio data \(truncated\?\) or is "
                                                  r"damaged there \((flac decoder lost sync|Internal psf_fseek\(\) "
                                                  r"failed)\): give the whole file$"):
        load_reference(path)
    path.write_bytes(flac + b"junk" * 100)
    assert load_reference(path).seconds == pytest.approx(2)


@pytest.mark.parametrize("subtype", ["VORBIS", "OPUS"])
def test_an_ogg_cut_short_or_damaged_says_so(tmp_path, subtype):
    """libsndfile takes an Ogg file's length from its last whole page, so an Ogg cut short read as a shorter file
    (1.77 s of 2, its transcript then wrong for it), as "holds no audio samples (its header says there are none...)"
    when cut in its first audio page, or as "Supported file format but file is malformed." when cut in its headers:
    now each says the file ends inside its audio data. A whole one, and one of no samples, read as before."""
    ogg = encoded("OGG", subtype, rate=48000 if subtype == "OPUS" else 16000)
    path = tmp_path / "ref.ogg"
    last_page = ogg.rindex(b"OggS")
    assert ogg[last_page + 5] & 4  # the end-of-stream flag the whole file ends with
    for data in (ogg[:100], ogg[:len(ogg) // 4], ogg[:len(ogg) // 2], ogg[:last_page], ogg[:-1],
                 ogg[:last_page] + bytes(len(ogg) - last_page), ogg + b"junk"):
        path.write_bytes(data)
        with pytest.raises(ReferenceAudioError, match=r"ref\.ogg ends inside its audio data \(truncated\?\) or is "
                                                      r"damaged there \(its Ogg stream stops before its end\): give "
                                                      r"the whole file$"):
            load_reference(path)
    path.write_bytes(ogg)
    assert load_reference(path).seconds == pytest.approx(2, abs=0.01)
    if subtype == "VORBIS":  # (libsndfile ends an Opus stream of no samples without its end-of-stream page)
        path.write_bytes(encoded("OGG", subtype, seconds=0))
        with pytest.raises(ReferenceAudioError, match=r"ref\.ogg holds no audio samples"):
            load_reference(path)


def test_a_damaged_aiff_or_mp3_is_one_line_without_a_traceback(tmp_path, monkeypatch):
    """An AIFF whose SSND chunk is misnamed made libsndfile seek to -1: the file's OSError was printed as a
    traceback ("Exception ignored from cffi callback ... vio_seek", sys.unraisablehook's) before the one-line
    error. An MP3 cut in its first frame was "File does not exist or is not a regular file (possibly a pipe?)", of
    a regular file."""
    aiff = tmp_path / "ref.aiff"
    data = encoded("AIFF", "PCM_16")
    aiff.write_bytes(patched(data, data.index(b"SSND"), b"X"))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ReferenceAudioError, match=r"ref\.aiff: its header does not parse: the file is damaged or was "
                                                  r"written wrong; re-encode it, e\.g\. as WAV$"):
        load_reference(aiff)
    assert not unraisable, unraisable[0].exc_value
    mp3 = tmp_path / "ref.mp3"
    mp3.write_bytes(encoded("MP3", "MPEG_LAYER_III")[:200])  # cut in its first frame
    with pytest.raises(ReferenceAudioError, match=r"ref\.mp3: its audio does not decode \(an MP3 cut short, or "
                                                  r"damaged\?\): give the whole file"):
        load_reference(mp3)


def test_the_mp3_decoders_notes_on_a_damaged_file_stay_off_stderr(tmp_path, capfd):
    """libmpg123 (libsndfile's MP3 decoder) prints "Note: Illegal Audio-MPEG-Header ...", "[src/libmpg123/...]
    error: ..." straight to fd 2 on a damaged MP3 (libsndfile issue 958): a CLI user saw them above the answer. They
    are dropped while the file is read; the file, decodable past the damage, is read."""
    data = encoded("MP3", "MPEG_LAYER_III", seconds=3, rate=24000)
    mp3 = tmp_path / "damaged.mp3"
    mp3.write_bytes(patched(patched(data, 2000, bytes([data[2000] ^ 0xFF])), 3000, bytes(10)))
    sf.read(mp3)
    assert "Note: Illegal Audio-MPEG-Header" in capfd.readouterr().err  # what libsndfile alone prints
    assert abs(load_reference(mp3).seconds - 3) < 0.1
    assert capfd.readouterr().err == ""


def test_output_of_other_code_during_a_read_reaches_stderr(capfd):
    """Only the decoder's own lines are dropped: whatever else reached fd 2 while a file was read (another thread's
    output) is written back, in order, and fd 2 is the same afterwards."""
    from higgs_rt.audio_in import _decoder_chatter_dropped

    os.write(2, b"before\n")
    with _decoder_chatter_dropped():
        os.write(2, b"first\nNote: Trying to resync...\n[src/libmpg123/layer3.c:1] error: x\nWarning: Xing y\n")
        os.write(2, b"second\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before\nfirst\nsecond\nafter\n"


def test_a_flac_with_garbage_after_its_stream_info_says_it_is_damaged(tmp_path):
    """libsndfile's "unknown error in flac decoder" at open (the header or first frame is garbage) reads as what it
    means to a user."""
    flac = tmp_path / "ref.flac"
    garbage = np.random.default_rng(0).integers(0, 256, 3000, np.uint8).tobytes()
    flac.write_bytes(encoded("FLAC", "PCM_16")[:42] + garbage)  # "fLaC" and the stream info block, then garbage
    with pytest.raises(ReferenceAudioError, match=r"ref\.flac: its FLAC header or first frame does not decode: "
                                                  r"the file is damaged or was written wrong; re-encode it, e\.g\. "
                                                  r"as WAV$"):
        load_reference(flac)
