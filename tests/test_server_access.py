"""Who may use the server and how much a request may take, in process (starlette's TestClient) with the tiny
random model: Content-Type, cross-origin requests, the Host check (DNS rebinding), the API key, slow bodies,
input length, voice names (OpenAI's built-in ones, concurrent uploads, trailing slashes) and 429's Retry-After."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("uvicorn")
from starlette.testclient import TestClient  # noqa: E402

from higgs_rt.batch import BatchEngine  # noqa: E402
from higgs_rt.engine import TTS  # noqa: E402
from higgs_rt.server import create_app  # noqa: E402

LOCAL = "http://127.0.0.1"
SAY = {"input": "Hello.", "max_new_tokens": 12, "seed": 1, "response_format": "pcm"}


@pytest.fixture(scope="module")
def tts_engine(random_model, tmp_path_factory):
    tts = TTS(random_model, device="cpu", voices_dir=tmp_path_factory.mktemp("voices"))
    engine = BatchEngine(tts, slots=2, queue=1)
    yield tts, engine
    engine.close()


def client(tts_engine, **options) -> TestClient:
    tts, engine = tts_engine
    return TestClient(create_app(tts, engine, "tiny", **options), base_url=LOCAL, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def plain(tts_engine):
    with client(tts_engine) as c:
        yield c


def error_of(r, status: int, param: str | None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    return error


def wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, 0.1 * np.random.default_rng(2).standard_normal(int(seconds * rate)), rate, format="WAV")
    return out.getvalue()


# ---- Content-Type ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_speech_needs_a_json_content_type(plain, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = plain.post("/v1/audio/speech", content=json.dumps(SAY), headers=headers)
    assert error_of(r, 415, "Content-Type")["code"] == "unsupported_media_type"
    r = plain.post("/v1/audio/speech", content=json.dumps(SAY),
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and len(r.content) > 0


def test_voice_upload_needs_multipart(plain):
    r = plain.post("/v1/audio/voices", json={"name": "x", "consent": "c", "ref_text": "Hi."})
    error_of(r, 415, "Content-Type")
    r = plain.post("/v1/audio/voices", content=b"--x\r\ngarbage", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---- origins ---------------------------------------------------------------------------------------------------
def test_cross_origin_requests_are_refused(plain):
    evil = {"Origin": "http://evil.example"}
    error_of(plain.post("/v1/audio/speech", json=SAY, headers=evil), 403, "Origin")
    error_of(plain.post("/v1/audio/voices", files={"audio_sample": ("a.wav", wav())},
                        data={"name": "evil", "consent": "c", "ref_text": "Hi."}, headers=evil), 403, "Origin")
    error_of(plain.get("/v1/models", headers=evil), 403, "Origin")
    preflight = {**evil, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    r = plain.options("/v1/audio/speech", headers=preflight)
    error_of(r, 403, "Origin")
    assert "access-control-allow-origin" not in r.headers
    assert plain.get("/v1/audio/voices").json()["data"] == []  # nothing was stored


def test_allowed_origins_get_cors_answers(tts_engine):
    app = {"Origin": "https://app.example"}
    with client(tts_engine, allow_origins=("https://app.example",)) as c:
        r = c.options("/v1/audio/speech", headers={**app, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "content-type,authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.post("/v1/audio/speech", json=SAY, headers=app)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        error_of(c.post("/v1/audio/speech", json=SAY, headers={"Origin": "https://other.example"}), 403, "Origin")
        r = c.options("/v1/audio/speech", headers={**app, "Access-Control-Request-Method": "PUT"})
        error_of(r, 400, "Origin")  # CORSMiddleware's own refusal, as an OpenAI-style error


# ---- Host (DNS rebinding) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8094", "127.0.0.1.evil.example", "", "[::2]"])
def test_foreign_host_headers_are_refused(plain, host):
    error_of(plain.get("/v1/models", headers={"Host": host}), 400, "Host")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8094", "localhost:1", "LOCALHOST", "[::1]:8094"])
def test_loopback_host_headers_pass(plain, host):
    assert plain.get("/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_hosts_extend_and_star_opens(tts_engine):
    with client(tts_engine, allowed_hosts=("tts.lan",)) as c:
        assert c.get("/v1/models", headers={"Host": "tts.lan:8094"}).status_code == 200
        error_of(c.get("/v1/models", headers={"Host": "127.0.0.1"}), 400, "Host")
    with client(tts_engine, allowed_hosts=("*",)) as c:
        assert c.get("/v1/models", headers={"Host": "anything.example"}).status_code == 200


# ---- API key ---------------------------------------------------------------------------------------------------
def test_api_key_is_a_bearer_token(tts_engine):
    with client(tts_engine, api_key="s3cret") as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret "}):
            r = c.post("/v1/audio/speech", json=SAY, headers=headers)
            assert error_of(r, 401, "Authorization")["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200  # liveness probes carry no key
        assert c.get("/metrics").status_code == 200  # nor do Prometheus scrapers
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/audio/speech", json=SAY, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"


# ---- limits ----------------------------------------------------------------------------------------------------
def test_input_length_is_capped(tts_engine, plain):
    error = error_of(plain.post("/v1/audio/speech", json={**SAY, "input": "a" * 4097}), 400, "input")
    assert error["code"] == "string_above_max_length" and "4097" in error["message"] and "4096" in error["message"]
    with client(tts_engine, max_input_chars=20) as c:
        assert c.post("/v1/audio/speech", json={**SAY, "input": "x" * 20}).status_code == 200
        error_of(c.post("/v1/audio/speech", json={**SAY, "input": "x" * 21}), 400, "input")
        error_of(c.post("/v1/audio/speech", json={**SAY, "ref_audio": "UklGRg==", "ref_text": "y" * 21}), 400,
                 "ref_text")


def test_a_slow_body_gets_408_and_the_connection_closes(tts_engine):
    """A client that sends its headers and then dribbles (here: stops) is answered after body_timeout_s."""
    import uvicorn

    tts, engine = tts_engine
    app = create_app(tts, engine, "tiny", body_timeout_s=0.5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        conn = socket.create_connection(sock.getsockname(), timeout=30)
        conn.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"input\": ")
        answer = b""
        while piece := conn.recv(65536):  # the server closes the connection after its answer
            answer += piece
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# ---- voices ---------------------------------------------------------------------------------------------------
def test_openai_voice_names_speak_in_the_default_voice(plain):
    want = plain.post("/v1/audio/speech", json={**SAY, "voice": "default"}).content
    for name in ("alloy", "nova", "shimmer", "verse"):
        r = plain.post("/v1/audio/speech", json={**SAY, "voice": name})
        assert r.status_code == 200 and r.content == want, name
    assert plain.post("/v1/audio/speech", json={**SAY, "voice": {"id": "echo"}}).content == want
    error_of(plain.post("/v1/audio/speech", json={**SAY, "voice": "Alloy"}), 400, "voice")  # names are exact
    error_of(plain.post("/v1/audio/speech", json={**SAY, "voice": "nobody"}), 400, "voice")


def upload(c: TestClient, name: str, **extra):
    return c.post("/v1/audio/voices", files={"audio_sample": ("ref.wav", wav())},
                  data={"name": name, "consent": "yes", "ref_text": "Hello there.", **extra})


def test_a_stored_voice_wins_over_an_openai_name(plain):
    default = plain.post("/v1/audio/speech", json={**SAY, "voice": "default"}).content
    assert upload(plain, "nova").status_code == 200
    try:
        cloned = plain.post("/v1/audio/speech", json={**SAY, "voice": "nova"})
        assert cloned.status_code == 200 and cloned.content != default
        assert plain.post("/v1/audio/speech", json={**SAY, "voice": "alloy"}).content == default
    finally:
        assert plain.delete("/v1/audio/voices/nova").json()["deleted"] is True
    assert plain.post("/v1/audio/speech", json={**SAY, "voice": "nova"}).content == default


def test_concurrent_uploads_of_one_name_store_it_once(plain):
    with ThreadPoolExecutor(4) as pool:
        statuses = sorted(r.status_code for r in pool.map(lambda _: upload(plain, "twin"), range(4)))
    try:
        assert statuses == [200, 409, 409, 409]
        assert [v["id"] for v in plain.get("/v1/audio/voices").json()["data"]] == ["twin"]
    finally:
        plain.delete("/v1/audio/voices/twin")


@pytest.mark.parametrize("path", ["/v1/audio/voices/", "/v1/audio/voices/a/b", "/v1/audio/voices/..%2Fx",
                                  "/v1/audio/voices/" + "x" * 65])
def test_bad_voice_paths_are_json_errors_not_redirects(plain, path):
    r = plain.delete(path, follow_redirects=False)
    error_of(r, 400, "name")


def test_trailing_slashes_are_not_redirected(plain):
    r = plain.post("/v1/audio/speech/", json=SAY, follow_redirects=False)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = plain.delete("/v1/audio/voices/nobody")
    error_of(r, 404, "name")


def test_every_utterance_must_fit_before_the_answer_starts(plain):
    """Later utterances are prompted with the previous one's text and frames (up to max_new_tokens of them): one
    that could not fit the context fails at submit with a 400, never after a 200 has started streaming."""
    text = " ".join(f"Sentence number {i} is here." for i in range(40))  # several utterances
    r = plain.post("/v1/audio/speech", json={**SAY, "input": text, "max_new_tokens": 2000, "stream": True})
    error = error_of(r, 400, "input")
    assert "exceeds the context" in error["message"] and "max_new_tokens" in error["message"]
    r = plain.post("/v1/audio/speech", json={**SAY, "input": "Short. Two.", "max_new_tokens": 2000,
                                             "stream": True, "seed": 3})
    assert r.status_code == 200  # the same budget with short text fits: the check is not a blanket limit


def test_ignore_eos_is_a_benchmark_field_only(plain):
    """`ignore_eos` (utterances of known length) exists only on a server started with --benchmark; the Ray
    Serve tests use it there (tests/test_deploy_ray.py)."""
    error = error_of(plain.post("/v1/audio/speech", json={**SAY, "ignore_eos": True}), 400, "ignore_eos")
    assert error["code"] == "unknown_parameter"


def test_a_client_gone_mid_body_is_no_error_and_gets_no_answer(caplog):
    import asyncio
    import logging

    from starlette.requests import ClientDisconnect

    from higgs_rt.http_guards import ServerErrors

    async def app(scope, receive, send):
        raise ClientDisconnect()

    sent = []

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        asyncio.run(ServerErrors(app)({"type": "http", "method": "POST", "path": "/v1/audio/speech"}, None, send))
    assert sent == []  # no 500 to a client that has gone
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "POST /v1/audio/speech: the client went away before its body was read")]


def test_a_stream_cut_for_its_unread_audio_is_one_warning_line():
    import logging
    import sys

    from higgs_rt.http_guards import QuietCuts
    from higgs_rt.types import BufferFull

    def record(error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException:
            return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application\n",
                                     (), sys.exc_info())

    cut = BufferFull("more than 2 s of audio was waiting unread")
    errors = [cut] + ([ExceptionGroup("task group", [cut])] if sys.version_info >= (3, 11) else [])  # noqa: F821
    for error in errors:
        r = record(error)
        assert QuietCuts().filter(r) and r.exc_info is None
        assert (r.levelname, r.getMessage()) == ("WARNING", "stream cut: more than 2 s of audio was waiting unread")
    other = record(RuntimeError("a bug"))
    assert QuietCuts().filter(other) and other.levelname == "ERROR" and other.exc_info[0] is RuntimeError


def test_reference_encodes_past_the_bound_get_429_at_once(tts_engine, plain, monkeypatch):
    """Encodes run one at a time; a burst of cloning requests beyond MAX_ENCODES is refused at once instead of
    each holding its recording in memory and a worker thread for as long as the queue takes."""
    import base64
    from concurrent.futures import FIRST_COMPLETED, wait

    from higgs_rt.audio_in import ReferenceAudioError
    from higgs_rt.server import MAX_ENCODES

    tts, _ = tts_engine
    gate = threading.Event()

    def clone_voice(path, text):
        gate.wait(120)
        raise ReferenceAudioError("refused after the wait")

    monkeypatch.setattr(tts, "clone_voice", clone_voice)
    body = {**SAY, "ref_audio": base64.b64encode(wav()).decode(), "ref_text": "Hello."}
    with ThreadPoolExecutor(MAX_ENCODES + 2) as pool:
        pending = {pool.submit(plain.post, "/v1/audio/speech", json=body) for _ in range(MAX_ENCODES + 2)}
        refused = []
        while len(refused) < 2:
            done, pending = wait(pending, timeout=120, return_when=FIRST_COMPLETED)
            assert done, "no request was refused while the encodes were held"
            refused += [f.result() for f in done]
        gate.set()
        held = [f.result() for f in pending]
    assert [error_of(r, 429, "ref_audio")["code"] for r in refused] == ["busy_encoding"] * 2
    assert refused[0].headers["retry-after"] == "1"
    assert [error_of(r, 400, "ref_audio")["message"] for r in held] == ["refused after the wait"] * MAX_ENCODES
