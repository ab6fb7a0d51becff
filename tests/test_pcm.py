"""higgs_rt.pcm: int16 conversion, WAV files, the streaming header, and the crash-safe incremental writer."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile
import torch

from higgs_rt.pcm import WavWriter, to_int16, wav_header_streaming, write_wav


def test_to_int16_clips_and_rounds():
    pcm = np.array([-2.0, -1.0, -0.5, 0.0, 1e-5, 0.5, 1.0, 3.0], dtype=np.float32)
    assert to_int16(pcm).tolist() == [-32767, -32767, -16384, 0, 0, 16384, 32767, 32767]
    assert to_int16(torch.from_numpy(pcm)).tolist() == to_int16(pcm).tolist()
    assert to_int16(pcm).dtype == np.int16


def test_write_wav_roundtrip(tmp_path):
    pcm = 0.8 * np.sin(np.linspace(0, 200, 24000, dtype=np.float32))
    write_wav(tmp_path / "a.wav", torch.from_numpy(pcm), 24000)
    data, sr = soundfile.read(tmp_path / "a.wav", dtype="int16")
    info = soundfile.info(tmp_path / "a.wav")
    assert sr == 24000 and info.subtype == "PCM_16" and info.channels == 1
    assert np.array_equal(data, to_int16(pcm))


@pytest.mark.parametrize("sr", [24000, 16000])
def test_streaming_header_fields(sr):
    header = wav_header_streaming(sr)
    assert len(header) == 44
    riff, riff_size, wave, fmt, fmt_size = struct.unpack("<4sI4s4sI", header[:20])
    audio_format, channels, rate, byte_rate, block_align, bits = struct.unpack("<HHIIHH", header[20:36])
    data, data_size = struct.unpack("<4sI", header[36:])
    assert (riff, wave, fmt, data) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert riff_size == data_size == 0xFFFFFFFF and fmt_size == 16
    assert (audio_format, channels, rate, byte_rate, block_align, bits) == (1, 1, sr, sr * 2, 2, 16)


def test_streamed_bytes_are_readable():
    pcm = np.linspace(-1, 1, 4801, dtype=np.float32)
    stream = io.BytesIO(wav_header_streaming(24000) + to_int16(pcm).tobytes())
    data, sr = soundfile.read(stream, dtype="int16")
    assert sr == 24000 and np.array_equal(data, to_int16(pcm))


def test_wav_writer_patches_sizes_and_survives_interruption(tmp_path):
    chunks = [np.full(960 * n, 0.1 * n, dtype=np.float32) for n in (1, 3, 2)]
    path = tmp_path / "interrupted.wav"
    with pytest.raises(KeyboardInterrupt):
        with WavWriter(path, 24000) as writer:
            writer.write(chunks[0])
            writer.write(torch.from_numpy(chunks[1]))
            # still open, as after a hard kill: already a valid file of what was written
            data, _ = soundfile.read(path, dtype="int16")
            assert len(data) == 960 * 4
            raise KeyboardInterrupt
    data, sr = soundfile.read(path, dtype="int16")
    assert sr == 24000 and np.array_equal(data, to_int16(np.concatenate(chunks[:2])))
    raw = path.read_bytes()
    assert struct.unpack("<I", raw[4:8])[0] == len(raw) - 8 and struct.unpack("<I", raw[40:44])[0] == len(raw) - 44


def test_wav_writer_on_a_pipe_uses_streaming_header():
    class Pipe(io.BytesIO):
        def seekable(self):
            return False

    pipe = Pipe()
    with WavWriter(pipe, 16000) as writer:
        writer.write(np.zeros(100, dtype=np.float32))
    raw = pipe.getvalue()
    assert raw[:44] == wav_header_streaming(16000) and len(raw) == 44 + 200
