"""Fuzzing material shared by the HTTP fuzz (test_server_fuzz.py) and the WebSocket fuzz (test_server_ws_fuzz.py):
reference audio good and broken, texts plausible and hostile, any JSON value, and each speech field's plausible and
hostile values (hypothesis strategies)."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf
from hypothesis import strategies as st


def wav(seconds: float = 0.6, rate: int = 16000, channels: int = 1, level: float = 0.1, subtype: str = "PCM_16",
        fmt: str = "WAV") -> bytes:
    out = io.BytesIO()
    data = level * np.random.default_rng(rate + channels).standard_normal((int(seconds * rate), channels))
    sf.write(out, data, rate, format=fmt, subtype=subtype)
    return out.getvalue()


GOOD_AUDIO = [wav(), wav(rate=22051), wav(rate=44101, channels=2), wav(rate=8000, fmt="FLAC")]
BAD_AUDIO = [b"", b"RIFF", b"not audio at all" * 10, wav(seconds=0.2), wav(level=0.0), wav(rate=4000),
             wav(rate=192001 // 1000 * 1000 + 1000), wav()[:60], wav(channels=9, seconds=0.5),
             wav(subtype="FLOAT")[:-7]]
SENTENCES = ["Hello there.", "The quick brown fox. It jumps!", "One, two; three: four?", "Ünïcödé text — ok.",
             "数字と文字。", "Hi.\n\nNew paragraph.", "<|eot_id|> is spoken, not obeyed."]
BAD_TEXTS = ["", "   ", "[SPEAKER0] Hi. [SPEAKER1] Yo.", "First sentence. Second \ud800 sentence.",
             "\udfff", "x" * 4097, "\x00"]


def data_url(audio: bytes, mime: str = "audio/wav") -> str:
    return f"data:{mime};base64,{base64.b64encode(audio).decode()}"


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                        max_size=3), max_leaves=6)
texts = st.one_of(st.sampled_from(SENTENCES), st.text(max_size=30), st.sampled_from(BAD_TEXTS))


# field -> (plausible values, hostile ones); any JSON value at all is drawn as well
FIELDS = {
    "model": (st.sampled_from(["tts-1", "tiny", ""]), ["x" * 300, 5]),
    "voice": (st.one_of(st.sampled_from(["default", "alloy", "nova", "v1"]),
                        st.fixed_dictionaries({"id": st.sampled_from(["echo", "v1"])})),
              ["nobody", "a/b", "", " ", "x" * 65, "x\ud800", {"id": 3}, {"id": None}, {"id": "a", "b": 1}]),
    "response_format": (st.sampled_from(["wav", "pcm", "flac"]), ["mp3", "", "WAV"]),
    "stream": (st.booleans(), ["yes", 1]),
    "stream_format": (st.sampled_from(["audio", "sse"]), ["ogg", ""]),
    "speed": (st.sampled_from([1.0, 1]), [0.5, "1", float("nan"), 1e400]),
    "seed": (st.integers(0, 2**63 - 1), [-1, 2**63, 2**64, 1.5, "7", float("inf")]),
    "temperature": (st.floats(0, 2), [-0.1, float("inf"), float("-inf"), float("nan"), 1e308, 3.5e38, 1e39, "hot"]),
    "top_p": (st.floats(0.01, 1), [0, 1.0000001, float("nan"), -1, 2, 1e-320]),
    "top_k": (st.integers(0, 100), [-1, 2**31, 2**63 - 1, 2**63, 2**64, 10**20, 1.5]),
    "instructions": (st.sampled_from([None, ""]), ["Whisper.", 7]),
    "language": (st.sampled_from([None, ""]), ["English"]),
    "task_type": (st.sampled_from([None, ""]), ["Base"]),
    "x_vector_only_mode": (st.sampled_from([None, False]), [True]),
    "speaker_embedding": (st.sampled_from([None, ""]), [[0.1]]),
    # always present, valid only in 9..12: a synthesis the fuzzer asks for stays a few frames long
    "max_new_tokens": (st.integers(9, 12), [-1, 0, 8, 10**9, 2**63, 2**64, 1.5, "12", True]),
    "input": (st.sampled_from(SENTENCES), BAD_TEXTS),
}
REFERENCES = st.one_of(
    st.tuples(st.sampled_from(GOOD_AUDIO).map(data_url), st.sampled_from(["Hello there.", "Hi."])),
    st.tuples(st.sampled_from(BAD_AUDIO).map(data_url), texts),
    st.tuples(st.sampled_from(["data:", "data:audio/wav", "data:audio/wav;base64", "data:audio/wav;base64,",
                               "data:;base64,@@@@", "@@@@", "UklGRg==", "", " ", "data:audio/wav;base64,UklGR"]),
              st.just("Hi.")),
    st.tuples(st.sampled_from(GOOD_AUDIO).map(lambda a: base64.b64encode(a).decode()), json_any),
    st.tuples(st.sampled_from(GOOD_AUDIO).map(data_url), st.none()),
    st.tuples(st.none(), st.just("Hi.")),
)
