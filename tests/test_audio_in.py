"""higgs_rt.audio_in: reference recordings (espeak-ng speech at several rates, stereo, int/float) -> 24 kHz mono,
and one clear ReferenceAudioError for everything a user can get wrong."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import soundfile as sf
import torch

from higgs_rt.audio_in import ReferenceAudioError, check_transcript, load_reference
from higgs_rt.resample import resample

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
    want = resample(torch.from_numpy(data.mean(1)), rate, SR)
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


def noise(seconds: float, rate: int = 16000, level: float = 0.1) -> np.ndarray:
    return level * np.random.default_rng(1).standard_normal(int(seconds * rate)).astype(np.float32)


@pytest.mark.parametrize("audio,rate,message", [
    (noise(0.3), 16000, r"0\.30 s long: use 0\.5 to 30 s"),
    (noise(31), 16000, r"31\.00 s long: use 0\.5 to 30 s"),
    (np.zeros(16000, np.float32), 16000, r"silent \(RMS -inf dBFS"),
    (noise(1, level=10 ** (-70 / 20)), 16000, r"silent \(RMS -70\.\d dBFS, below -60 dBFS\)"),
    (np.full(16000, np.nan, np.float32), 16000, "NaN or infinite"),
    (noise(1), None, "needs its sample_rate"),
    (noise(1), 16000.5, "integer of at least 1000 Hz"),
    (noise(1)[None, None], 16000, r"must be \[samples\] or \[samples, channels\]"),
    (np.array(["a"] * 16000), 16000, "must be numbers"),
])
def test_bad_arrays_are_refused(audio, rate, message):
    with pytest.raises(ReferenceAudioError, match=message):
        load_reference(audio, rate)


def test_bad_files_are_refused(speech, tmp_path):
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(speech["22k"].read_bytes()[:30])
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not audio at all" * 100)
    for path in (truncated, garbage):
        with pytest.raises(ReferenceAudioError, match=f"{path.name} is not a readable WAV/FLAC file"):
            load_reference(path)
    with pytest.raises(ReferenceAudioError, match="cannot read reference audio .*missing.wav"):
        load_reference(tmp_path / "missing.wav")
    with pytest.raises(ReferenceAudioError, match="is 22050 Hz, but sample_rate=16000"):
        load_reference(speech["22k"], 16000)
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(24000, np.int16), 24000)
    with pytest.raises(ReferenceAudioError, match="silent"):
        load_reference(silent)
    assert issubclass(ReferenceAudioError, ValueError)


@pytest.mark.parametrize("text", [None, "", "   \n"])
def test_a_reference_needs_its_transcript(text):
    with pytest.raises(ReferenceAudioError, match="needs its transcript"):
        check_transcript(text)
    assert check_transcript("  Hello.  ") == "Hello."
