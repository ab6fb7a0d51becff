"""The speech server live on loopback with the tiny random model: the official openai client and raw HTTP,
WAV/PCM/FLAC streamed and not, SSE, concurrency and seeds, disconnects, the queue bound, rejected requests,
cloned voices, and the `serve` / `client` commands. Every request has a timeout; request counts are bounded."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from higgs_rt.batch import BatchEngine  # noqa: E402
from higgs_rt.engine import TTS  # noqa: E402
from higgs_rt.server import create_app  # noqa: E402
from conftest import wait_for  # noqa: E402

SLOTS, QUEUE, MAX_BODY, MAX_UPLOAD = 8, 2, 1 << 20, 256 << 10
TIMEOUT = 30
HOP = 960
LONG = " ".join(f"Sentence {i} goes on." for i in range(100))  # about 100 utterances: seconds of work


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="module")
def server(random_model, tmp_path_factory):
    tts = TTS(random_model, device="cpu", voices_dir=tmp_path_factory.mktemp("voices"))
    engine = BatchEngine(tts, slots=SLOTS, queue=QUEUE)
    app = create_app(tts, engine, "tiny", max_body=MAX_BODY, max_upload=MAX_UPLOAD)
    sock = _listening_socket()
    host, port = sock.getsockname()
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started, "the server did not start"
    yield SimpleNamespace(host=host, port=port, url=f"http://{host}:{port}", engine=engine, tts=tts)
    uv.should_exit = True
    thread.join(10)
    engine.close()
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def post(server, body, path="/v1/audio/speech", raw: bytes | None = None, headers=None):
    """(status, headers, body bytes) of one request."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get(server, path):
    with urllib.request.urlopen(server.url + path, timeout=TIMEOUT) as r:
        return r.read().decode()


def value_of(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def metric(server, name: str) -> float:
    return value_of(get(server, "/metrics"), name)


def wav_pcm(data: bytes, streamed: bool) -> np.ndarray:
    """Check a 16-bit mono 24 kHz WAV (exact sizes, or 0xFFFFFFFF when streamed) and return its samples."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    riff, size = struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[40:44])[0]
    channels, rate, bits = struct.unpack("<H", data[22:24])[0], struct.unpack("<I", data[24:28])[0], data[34]
    assert (channels, rate, bits) == (1, 24000, 16)
    if streamed:
        assert riff == size == 0xFFFFFFFF
    else:
        assert (riff, size) == (len(data) - 8, len(data) - 44)
    return np.frombuffer(data[44:], "<i2")


def check_audio(samples: np.ndarray) -> None:
    assert samples.size > 0 and samples.size % HOP == 0


# ---- formats ------------------------------------------------------------------------------------------------
def test_openai_client_wav_and_pcm(server, client):
    wav = client.audio.speech.create(model="tts-1", voice="default", input="Hello from the server.",
                                     response_format="wav", extra_body={"seed": 3}).content
    samples = wav_pcm(wav, streamed=False)
    check_audio(samples)
    pcm = client.audio.speech.create(model="tts-1", voice="default", input="Hello from the server.",
                                     response_format="pcm", extra_body={"seed": 3}).content
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), samples)
    direct = server.tts.synthesize("Hello from the server.", seed=3)  # batched = batch-1 here (see README)
    from higgs_rt.pcm import to_int16

    np.testing.assert_array_equal(samples, to_int16(direct))


def test_openai_client_streaming_response(server, client):
    want = client.audio.speech.create(model="tts-1", voice="default", input="Streaming speech.",
                                      extra_body={"seed": 4}).content
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="default", input="Streaming speech.", response_format="wav",
            extra_body={"seed": 4, "stream": True}) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert "content-length" not in response.headers
        got = b"".join(response.iter_bytes())
    np.testing.assert_array_equal(wav_pcm(got, streamed=True), wav_pcm(want, streamed=False))


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac"])
@pytest.mark.parametrize("stream", [False, True])
def test_raw_http_formats(server, fmt, stream):
    body = {"model": "x", "input": "Formats over raw HTTP.", "response_format": fmt, "seed": 5, "stream": stream}
    status, headers, data = post(server, body)
    if fmt == "flac" and stream:
        assert status == 400 and json.loads(data)["error"]["param"] == "response_format"
        return
    assert status == 200, data
    assert headers["content-type"] == f"audio/{fmt}"
    if stream:
        assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers
    else:
        assert int(headers["content-length"]) == len(data)
    _, _, reference = post(server, {**body, "response_format": "pcm", "stream": False})
    want = np.frombuffer(reference, "<i2")
    if fmt == "wav":
        samples = wav_pcm(data, streamed=stream)
    elif fmt == "pcm":
        samples = np.frombuffer(data, "<i2")
    else:
        samples, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == 24000
    check_audio(samples)
    np.testing.assert_array_equal(samples, want)


def test_speech_that_ends_before_its_first_audio_is_still_a_file_of_its_format(server):
    """Nine frames (the fewest a request may ask for) are mostly delay pattern, and with the random model's leading
    all-BOS frames some seeds give no audio at all: the PCM is then empty and the WAV a header without samples; a
    FLAC cannot hold zero samples (libsndfile wrote a 0-byte body, which no reader takes), so it holds one silent
    sample (the fuzzer found the 0-byte FLAC)."""
    body = {"input": "Hello there.", "max_new_tokens": 9, "response_format": "pcm"}
    seed = next((s for s in range(40) if post(server, {**body, "seed": s})[2] == b""), None)
    assert seed is not None, "no seed of 40 gave a synthesis without audio"
    status, headers, data = post(server, {**body, "seed": seed, "response_format": "wav"})
    assert status == 200 and headers["content-type"] == "audio/wav" and len(wav_pcm(data, streamed=False)) == 0
    status, headers, data = post(server, {**body, "seed": seed, "response_format": "flac"})
    assert status == 200 and headers["content-type"] == "audio/flac"
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and samples.tolist() == [0]


def test_sse_events(server):
    body = {"input": "Server-sent events.", "seed": 6, "stream_format": "sse"}
    status, headers, data = post(server, body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    _, _, want = post(server, {"input": "Server-sent events.", "seed": 6})
    np.testing.assert_array_equal(wav_pcm(audio, streamed=True), wav_pcm(want, streamed=False))


def test_max_new_tokens_caps_the_audio(server):
    for cap in (9, 12, 20):
        status, _, data = post(server, {"input": "A short one.", "response_format": "pcm", "max_new_tokens": cap,
                                        "seed": 1})
        assert status == 200 and len(data) // 2 <= cap * HOP


# ---- concurrency ----------------------------------------------------------------------------------------------
def test_eight_concurrent_requests_repeat_their_seeds(server):
    bodies = [{"input": f"Concurrent request {i} is speaking.", "seed": 20 + i, "response_format": "wav"}
              for i in range(8)]
    alone = [wav_pcm(post(server, b)[2], streamed=False) for b in bodies]
    for _ in range(2):
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda b: post(server, b), bodies))
        for (status, _, data), want in zip(results, alone):
            assert status == 200
            samples = wav_pcm(data, streamed=False)
            check_audio(samples)
            np.testing.assert_array_equal(samples, want)  # same seed, same slot count: the same audio


def _open_stream(server, body) -> tuple[socket.socket, bytes]:
    """A streamed request on a raw socket; returns it once the response head has arrived."""
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    head = b""
    while b"\r\n\r\n" not in head:
        piece = sock.recv(4096)
        assert piece, "the server closed the stream"
        head += piece
    return sock, head


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_slot(server, stream):
    assert wait_for(lambda: metric(server, "higgs_rt_active_slots") == 0)
    cancelled = metric(server, "higgs_rt_requests_cancelled_total")
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
    data = json.dumps({"input": LONG, "max_new_tokens": 20, "stream": stream, "seed": 1}).encode()
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    if stream:  # mid-stream: some audio has arrived
        received = b""
        while len(received) < 1000 + 4 * HOP:
            received += sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
    assert wait_for(lambda: metric(server, "higgs_rt_active_slots") == 1)
    sock.close()
    assert wait_for(lambda: metric(server, "higgs_rt_active_slots") == 0, 3.0)  # the whole text takes >4 s
    assert metric(server, "higgs_rt_requests_cancelled_total") == cancelled + 1


def test_queue_overflow_gets_429_and_the_server_recovers(server, client):
    streams = [_open_stream(server, {"input": LONG, "max_new_tokens": 20, "stream": True})[0]
               for _ in range(SLOTS + QUEUE)]
    try:
        assert wait_for(lambda: metric(server, "higgs_rt_active_slots") == SLOTS)
        assert metric(server, "higgs_rt_queue_depth") == QUEUE
        status, headers, data = post(server, {"input": "One too many."})
        assert status == 429 and json.loads(data)["error"]["code"] == "queue_full"
        assert int(headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client.audio.speech.create(model="tts-1", voice="default", input="One too many.")
    finally:
        for sock in streams:
            sock.close()
    assert wait_for(lambda: metric(server, "higgs_rt_active_slots") == 0 and
                    metric(server, "higgs_rt_queue_depth") == 0, 5.0)
    assert post(server, {"input": "Served again."})[0] == 200


# ---- rejected requests ---------------------------------------------------------------------------------------
REJECTED = [
    ({"input": "Hi.", "instructions": "Speak calmly."}, "instructions"),
    ({"input": "Hi.", "task_type": "CustomVoice"}, "task_type"),
    ({"input": "Hi.", "language": "English"}, "language"),
    ({"input": "Hi.", "speed": 1.5}, "speed"),
    ({"input": "Hi.", "x_vector_only_mode": True}, "x_vector_only_mode"),
    ({"input": "Hi.", "speaker_embedding": [0.1, 0.2]}, "speaker_embedding"),
    ({"input": "[SPEAKER0] Hi. [SPEAKER1] Hello."}, "input"),
    ({"input": "   "}, "input"),
    ({"voice": "default"}, "input"),
    ({"input": "Hi.", "volume": 3}, "volume"),
    ({"input": 42}, "input"),
    ({"input": "Hi.", "stream": "yes"}, "stream"),
    ({"input": "Hi.", "seed": 1.5}, "seed"),
    ({"input": "Hi.", "temperature": "hot"}, "temperature"),
    ({"input": "Hi.", "top_p": 2.0}, "top_p"),
    ({"input": "Hi.", "max_new_tokens": 3}, "max_new_tokens"),
    ({"input": "Hi.", "response_format": "mp3"}, "response_format"),
    ({"input": "Hi.", "stream_format": "ogg"}, "stream_format"),
    ({"input": "Hi.", "ref_audio": "data:audio/wav;base64,@@not base64@@", "ref_text": "Hi."}, "ref_audio"),
    ({"input": "Hi.", "ref_audio": "UklGRg=="}, "ref_text"),
    ({"input": "Hi.", "ref_text": "Hello."}, "ref_audio"),
    ({"input": "Hi.", "instructions": 0}, "instructions"),  # 0 == False, yet no "nothing"
    ({"input": "Hi.", "language": 0}, "language"),
    ({"input": "Hi.", "voice": {"id": None}}, "voice"),
    ({"input": "\u200b\ufeff"}, "input"),
    ({"input": "Hi.", "response_format": "\ud800"}, "response_format"),  # lone surrogates, quoted back escaped
    ({"input": "Hi.", "model": "\ud800"}, "model"),
    ({"input": "Hi.", "\ud800": 1}, "\\ud800"),
]


@pytest.mark.parametrize("body,param", REJECTED, ids=[p for _, p in REJECTED])
def test_rejected_fields_name_the_field(server, body, param):
    status, _, data = post(server, body)
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_malformed_and_huge_bodies_then_the_server_keeps_serving(server, client):
    for raw in (b'{"input": "Hi."', b"\xff\xfe", b"[1, 2]", b""):
        status, _, data = post(server, None, raw=raw)
        assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"
    status, _, data = post(server, {"input": "x" * (MAX_BODY + 1)})
    assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="tts-1", voice="default", input="Hi.", instructions="Whisper.")
    assert e.value.body["param"] == "instructions"
    assert post(server, {"input": "Hi."}, path="/v1/nothing")[0] == 404
    assert json.loads(get(server, "/health"))["status"] == "ok"
    assert post(server, {"input": "Still serving."})[0] == 200


def test_a_500_keeps_the_connection_for_the_next_request(server, monkeypatch):
    """Starlette's handler for Exception re-raises after answering, and uvicorn then drops the socket: the next
    request on the same keep-alive connection failed. One connection: a request that fails inside, then a good
    one."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    try:
        monkeypatch.setattr(server.engine, "submit", broken)
        conn.request("POST", "/v1/audio/speech", json.dumps({"input": "Fails."}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == 500 and error["type"] == "server_error" and "injected failure" in error["message"]
        monkeypatch.undo()
        sock = conn.sock
        conn.request("POST", "/v1/audio/speech", json.dumps({"input": "Works.", "response_format": "pcm"}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and len(r.read()) > 0
        assert conn.sock is sock  # the same connection, not a silent reconnect
    finally:
        conn.close()


# ---- service endpoints -------------------------------------------------------------------------------------------
def test_models_health_and_metrics(server, client):
    assert post(server, {"input": "Counted.", "stream": True, "response_format": "pcm"})[0] == 200  # one at least
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = json.loads(get(server, "/health"))
    assert health["slots"] == SLOTS and health["model"] == "tiny"
    text = get(server, "/metrics")
    for name in ("higgs_rt_time_to_first_audio_seconds_bucket", "higgs_rt_real_time_factor_count",
                 "higgs_rt_frames_per_second", "higgs_rt_queue_depth", "higgs_rt_active_slots"):
        assert re.search(rf"^{name}\S* \S+$", text, re.M), name
    assert metric(server, "higgs_rt_time_to_first_audio_seconds_count") > 0
    # the event loop's probe runs from the first request on, whoever made the loop (here plain uvicorn)
    assert wait_for(lambda: metric(server, "higgs_rt_event_loop_lag_seconds_count") >= 2, TIMEOUT)
    assert 50e6 < metric(server, "higgs_rt_process_peak_rss_bytes") < 64e9  # a Python process with torch in it
    assert "higgs_rt_gpu_memory_peak_bytes" not in text  # the CPU server has no GPU memory to report
    # where the decode and codec threads' time went: the decode loop by phase, the codec's calls (requests ran)
    phases = dict(re.findall(r'^higgs_rt_decode_loop_seconds_total\{phase="(\w+)"\} (\S+)$', text, re.M))
    assert set(phases) == {"idle", "admit", "prefill", "step", "codec_tick", "wait", "route", "other"}
    assert float(phases["step"]) > 0 and all(float(v) >= 0 for v in phases.values())
    calls = metric(server, "higgs_rt_codec_calls_total")
    assert calls > 0  # each call spans at least one lane and decodes at least one frame
    assert metric(server, "higgs_rt_codec_call_lanes_total") >= calls
    assert metric(server, "higgs_rt_codec_call_frames_total") >= calls
    assert 0 < metric(server, "higgs_rt_codec_call_seconds_total") <= metric(server, "higgs_rt_codec_busy_seconds_total")
    assert metric(server, "higgs_rt_codec_warm_seconds") == 0.0  # the CPU captures no CUDA graphs
    # how arrivals were taken in: ticks that prefilled <= prompts prefilled <= forwards (the CPU: one a prompt)
    ticks, prompts = metric(server, "higgs_rt_prefill_ticks_total"), metric(server, "higgs_rt_prefill_prompts_total")
    assert 0 < ticks <= prompts <= metric(server, "higgs_rt_prefill_forwards_total")
    # the time to first audio by stage adds up to the histogram's sum, over the same requests, each stage >= 0
    text = get(server, "/metrics")
    stages = {k: float(v) for k, v in
              re.findall(r'^higgs_rt_first_audio_stage_seconds_total\{stage="(\w+)"\} (\S+)$', text, re.M)}
    assert list(stages) == ["parse", "slot", "admit", "prefill", "first_frame", "first_chunk", "codec", "send"]
    assert all(v >= 0 for v in stages.values()) and stages["first_chunk"] > 0 and stages["codec"] > 0
    staged = value_of(text, "higgs_rt_first_audio_staged_requests_total")
    assert staged == value_of(text, "higgs_rt_time_to_first_audio_seconds_count") > 0
    assert sum(stages.values()) == pytest.approx(value_of(text, "higgs_rt_time_to_first_audio_seconds_sum"), rel=1e-6)


# ---- cloned voices ------------------------------------------------------------------------------------------------
def reference_wav(seconds: float = 1.5, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, 0.1 * np.random.default_rng(1).standard_normal(int(seconds * rate)), rate, format="WAV",
             subtype="PCM_16")
    return out.getvalue()


def multipart(fields: dict, files: dict) -> tuple[bytes, dict]:
    boundary = "higgs-rt-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'.encode()
             + (v if isinstance(v, bytes) else v.encode()) + b"\r\n" for k, v in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="ref.wav"\r\n'
              f"Content-Type: audio/wav\r\n\r\n".encode() + data + b"\r\n" for k, data in files.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), {
        "Content-Type": f"multipart/form-data; boundary={boundary}"}


def upload(server, **fields):
    files = {"audio_sample": fields.pop("audio_sample")} if "audio_sample" in fields else {}
    body, headers = multipart(fields, files)
    status, _, data = post(server, None, "/v1/audio/voices", raw=body, headers=headers)
    return status, json.loads(data)


def test_voice_store_upload_speak_delete(server, client):
    status, voice = upload(server, name="alice", consent="cons_1", ref_text="Hello there.",
                           audio_sample=reference_wav())
    assert status == 200 and (voice["id"], voice["object"]) == ("alice", "audio.voice")
    assert [v["id"] for v in json.loads(get(server, "/v1/audio/voices"))["data"]] == ["alice"]
    status, headers, data = post(server, {"input": "In the cloned voice.", "voice": "alice", "stream": True,
                                          "seed": 2})
    assert status == 200 and headers.get("transfer-encoding") == "chunked"
    check_audio(wav_pcm(data, streamed=True))
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice={"id": "alice"}, input="Again.",
                                                            extra_body={"stream": True}) as r:
        check_audio(wav_pcm(b"".join(r.iter_bytes()), streamed=True))
    assert upload(server, name="alice", consent="c", ref_text="Hi.", audio_sample=reference_wav())[0] == 409
    deleted = client.audio.voices.delete("alice")
    assert deleted.deleted and deleted.id == "alice"
    assert post(server, {"input": "Gone.", "voice": "alice"})[0] == 400
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete("alice")


def test_voice_upload_errors(server):
    wav = reference_wav()
    for fields, param in [(dict(consent="c", ref_text="Hi.", audio_sample=wav), "name"),
                          (dict(name="bob", ref_text="Hi.", audio_sample=wav), "consent"),
                          (dict(name="bob", consent="c", audio_sample=wav), "ref_text"),
                          (dict(name="bob", consent="c", ref_text="Hi."), "audio_sample"),
                          (dict(name="../bob", consent="c", ref_text="Hi.", audio_sample=wav), "name"),
                          (dict(name="bob", consent="c", ref_text="Hi.", audio_sample=b"not audio"), "audio_sample"),
                          (dict(name="bob", consent="c", ref_text="Hi.", audio_sample=reference_wav(0.1)),
                           "audio_sample"),
                          (dict(name="bob", consent="c", ref_text=b"Hi \xff\xfe there.", audio_sample=wav), "ref_text"),
                          (dict(name="bob", consent="c", ref_text="Hi.", bogus="1", audio_sample=wav), "bogus")]:
        status, error = upload(server, **fields)
        assert status == 400 and error["error"]["param"] == param, (fields.keys(), error)
    status, error = upload(server, name="bob", consent="c", ref_text="Hi.", audio_sample=reference_wav(10))
    assert status == 413
    assert json.loads(get(server, "/v1/audio/voices"))["data"] == []
    status, voice = upload(server, name="carol", consent="c", ref_text="Ça va? Grüß dich, 你好.", audio_sample=wav)
    assert status == 200 and voice["id"] == "carol", voice  # UTF-8 beyond ASCII is read as such
    server.tts.remove_voice("carol")


def test_the_voice_store_is_bounded(random_model, tmp_path):
    """Uploads fill the store up to max_voices, then get 409 voice_store_full; a DELETE makes room."""
    from starlette.testclient import TestClient

    tts = TTS(random_model, device="cpu", voices_dir=tmp_path / "voices")
    engine = BatchEngine(tts, slots=1, queue=1)
    try:
        with TestClient(create_app(tts, engine, "tiny", max_voices=2), base_url="http://127.0.0.1") as client:
            def add(name):
                return client.post("/v1/audio/voices", data=dict(name=name, consent="c", ref_text="Hello there."),
                                   files={"audio_sample": ("ref.wav", reference_wav(), "audio/wav")})

            assert [add(n).status_code for n in ("v1", "v2")] == [200, 200]
            full = add("v3")
            assert full.status_code == 409 and full.json()["error"]["code"] == "voice_store_full", full.text
            assert "at most 2 voices" in full.json()["error"]["message"]
            assert client.delete("/v1/audio/voices/v1").status_code == 200
            assert add("v3").status_code == 200 and sorted(tts.voices()) == ["v2", "v3"]
    finally:
        engine.close()


def test_ref_audio_clone_streams(server):
    ref = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    status, _, data = post(server, {"input": "Cloned per request.", "ref_audio": ref, "ref_text": "Hello there.",
                                    "stream": True, "response_format": "pcm", "seed": 3})
    assert status == 200
    check_audio(np.frombuffer(data, "<i2"))
    bad = "data:audio/wav;base64," + base64.b64encode(b"RIFF but not audio").decode()
    status, _, data = post(server, {"input": "Hi.", "ref_audio": bad, "ref_text": "Hello."})
    assert status == 400 and json.loads(data)["error"]["param"] == "ref_audio"



def test_a_reference_without_samples_is_a_400_saying_so(server):
    """A WAV of a header only (its data chunk empty) was refused as "0.00 s long": the 400 names the field and says
    the file holds no audio samples, as a per-request reference and as an upload to the voice store."""
    from higgs_rt.pcm import wav_header

    empty = "data:audio/wav;base64," + base64.b64encode(wav_header(24000, 0)).decode()
    status, _, data = post(server, {"input": "Hi.", "ref_audio": empty, "ref_text": "Hello."})
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "ref_audio", error
    assert error["message"].startswith("reference audio ref_audio holds no audio samples"), error
    status, error = upload(server, name="empty", consent="c", ref_text="Hi.", audio_sample=wav_header(24000, 0))
    assert status == 400 and error["error"]["param"] == "audio_sample", error
    assert "audio_sample holds no audio samples" in error["error"]["message"], error


def test_a_transcript_that_leaves_the_text_no_room_is_a_400_naming_it(server):
    """A reference transcript that leaves the text no room in the context was a 400 naming 'input' ("shorten the
    text"): it names 'ref_text' (a stored voice's: 'voice') and says how many tokens the transcript takes and how
    many fit."""
    transcript = " ".join(["a"] * 2000)  # 2000 tokens
    ref = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    status, _, data = post(server, {"input": "Hi.", "ref_audio": ref, "ref_text": transcript, "max_new_tokens": 3000})
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "ref_text", error
    assert re.fullmatch(r"the reference transcript takes 2000 tokens: at most \d+ fit in the context of 4096 "
                        r"positions beside the reference's \d+ audio frames, max_new_tokens \(3000\) and a few words "
                        r"of text: shorten the transcript \(or lower max_new_tokens\)", error["message"]), error
    status, voice = upload(server, name="talker", consent="c", ref_text=transcript, audio_sample=reference_wav())
    assert status == 200, voice  # stored: whether it leaves room depends on each request's max_new_tokens
    try:
        status, _, data = post(server, {"input": "Hi.", "voice": "talker", "max_new_tokens": 3000})
        error = json.loads(data)["error"]
        assert status == 400 and error["param"] == "voice" and "transcript takes 2000 tokens" in error["message"]
        assert post(server, {"input": "Hi.", "voice": "talker", "max_new_tokens": 16})[0] == 200
    finally:
        server.tts.remove_voice("talker")

def test_max_new_tokens_that_leaves_no_room_is_a_400_naming_it(server):
    """A max_new_tokens that leaves no room for any utterance (beside a reference, or alone) was a 400 naming
    'input' (the engine's ValueErrors were all the text's): it names 'max_new_tokens', as the WebSocket's open does,
    from the error's type (a ParamError), and a reference's transcript is still named as its own fault."""
    ref = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    for body in ({"input": "Hi.", "ref_audio": ref, "ref_text": "Hello there.", "max_new_tokens": 4080},
                 {"input": "Hi.", "max_new_tokens": 4095}):
        status, _, data = post(server, body)
        error = json.loads(data)["error"]
        assert status == 400 and error["param"] == "max_new_tokens" and error["code"] == "out_of_range", error
        assert re.fullmatch(r"max_new_tokens \((4080|4095)\) leaves no room for any utterance: with its prompt \(\d+ "
                            r"tokens for one letter( and the reference)?\) it passes the context of 4096 positions; "
                            r"use .*", error["message"]), error
    status, _, data = post(server, {"input": "Hi. " * 200, "max_new_tokens": 4000})  # the text's fault: 'input'
    assert status == 400 and json.loads(data)["error"]["param"] == "input", data


# ---- the commands ----------------------------------------------------------------------------------------------
def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "higgs_rt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_client_command(server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The first prompt.\n\nThe second prompt.\n")
    out = tmp_path / "out"
    r = cli("client", "--base-url", server.url + "/v1", "--prompts", prompts, "--output-dir", out, "--seed", 1,
            "--concurrency", 2, "--max-new-tokens", 200, "--timeout-s", TIMEOUT)
    assert r.returncode == 0, r.stderr
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["0001.wav", "0002.wav"]
    for f in files:
        check_audio(wav_pcm(f.read_bytes(), streamed=False))
    r = cli("client", "--prompts", prompts, "--output-dir", out, "--ref-audio", files[0])
    assert r.returncode == 2 and "--ref-text" in r.stderr


def test_serve_command(random_model):
    sock = _listening_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "higgs_rt.cli", "serve", "--model", str(random_model), "--port",
                             str(port), "--slots", "2", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        target = SimpleNamespace(host="127.0.0.1", port=port, url=f"http://127.0.0.1:{port}")

        def up() -> bool:
            try:
                return json.loads(get(target, "/health"))["slots"] == 2
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                return False

        assert wait_for(up, 60)
        status, _, data = post(target, {"input": "From the serve command.", "seed": 2})
        assert status == 200
        check_audio(wav_pcm(data, streamed=False))
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert cli("serve", "--slots", "0").returncode == 2


def test_a_long_transcript_is_an_error_of_ref_text(random_model, tmp_path):
    """With --max-input-chars over the transcript's bound (4096), a longer ref_text passed the request's check and
    was refused by the reference's: a 400 naming 'ref_audio' / 'audio_sample', the field that was fine."""
    from starlette.testclient import TestClient

    tts = TTS(random_model, device="cpu", voices_dir=tmp_path / "voices")
    engine = BatchEngine(tts, slots=1, queue=1)
    text = "word " * 1000
    try:
        with TestClient(create_app(tts, engine, "tiny", max_input_chars=10000), base_url="http://127.0.0.1") as client:
            ref = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
            r = client.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": ref, "ref_text": text})
            assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text", r.text
            assert "the reference transcript has 4999 characters: at most 4096" in r.json()["error"]["message"]
            r = client.post("/v1/audio/voices", data=dict(name="v", consent="c", ref_text=text),
                            files={"audio_sample": ("ref.wav", reference_wav(), "audio/wav")})
            assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text", r.text
    finally:
        engine.close()
