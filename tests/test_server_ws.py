"""The speech WebSocket (/v1/audio/speech/stream) live on loopback with the tiny random model and the `websockets`
client: utterances in sequence on one connection, audio equal to the HTTP API's, barge-in, protocol errors
(malformed JSON, unknown types, binary, out of order, too large) and content errors (the connection goes on),
the open message checked as the HTTP body, the guards (Origin, Host, API key), the connection bound, the idle
timeout, a disconnect mid-audio freeing its slot, and the README's client. Every wait has a generous bound and
none decides a result."""

from __future__ import annotations

import json
import re
import socket
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

uvicorn = pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from higgs_rt.batch import BatchEngine  # noqa: E402
from higgs_rt.engine import TTS  # noqa: E402
from higgs_rt.server import create_app  # noqa: E402
from higgs_rt.server_process import WS_OPTIONS  # noqa: E402
from conftest import wait_for  # noqa: E402

PATH = "/v1/audio/speech/stream"
TIMEOUT = 60  # generous: a loaded 2-core CI machine
HOP = 960  # samples per frame at 24 kHz
MAX_CHARS, MAX_WS = 2000, 3
SAY = {"seed": 3, "max_new_tokens": 16}
SENTENCES = 80
LONG = " ".join(f"Sentence {i} goes on." for i in range(SENTENCES))  # 80 utterances: seconds of work


@contextmanager
def serving(tts, engine, max_input_chars: int = MAX_CHARS, **options):
    """The app on a loopback port, in uvicorn with `serve`'s WebSocket settings."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(tts, engine, "tiny", max_input_chars=max_input_chars, **options)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", **WS_OPTIONS))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    assert wait_for(lambda: uv.started or not thread.is_alive()) and uv.started, "the server did not start"
    try:
        yield SimpleNamespace(port=port, url=f"ws://127.0.0.1:{port}{PATH}", http=f"http://127.0.0.1:{port}",
                              engine=engine, app=app)
    finally:
        uv.should_exit = True
        thread.join(TIMEOUT)
        sock.close()


@pytest.fixture(scope="module")
def tts_engine(random_model, tmp_path_factory):
    tts = TTS(random_model, device="cpu", voices_dir=tmp_path_factory.mktemp("voices"))
    engine = BatchEngine(tts, slots=2, queue=2)
    yield tts, engine
    engine.close()


@pytest.fixture(scope="module")
def server(tts_engine):
    with serving(*tts_engine, max_ws_connections=MAX_WS) as s:
        yield s


def health(server) -> dict:
    import urllib.request

    with urllib.request.urlopen(server.http + "/health", timeout=TIMEOUT) as r:
        return json.loads(r.read())


def idle(server) -> bool:
    """No WebSocket open and no slot busy (a closed connection is counted down once its handler has ended)."""
    h = health(server)
    return h["ws_connections"] == 0 and h["active_slots"] == 0


def send(ws, kind: str, **fields) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def receive(ws):
    """The next message: a JSON event (dict) or a binary frame (bytes)."""
    message = ws.recv(timeout=TIMEOUT)
    return message if isinstance(message, bytes) else json.loads(message)


@contextmanager
def opened(server, **settings):
    """A connection whose open message was answered with "opened"."""
    with connect(server.url, open_timeout=TIMEOUT, close_timeout=TIMEOUT) as ws:
        send(ws, "open", **settings)
        event = receive(ws)
        assert event["type"] == "opened", event
        assert (event["sample_rate"], event["channels"], event["format"]) == (24000, 1, "pcm_s16le")
        yield ws


def mid_audio(ws) -> None:
    """Feed LONG and return once its first audio has come."""
    send(ws, "text", text=LONG)
    got = until(ws, "start")
    while not isinstance(got[-1], bytes):
        got.append(receive(ws))


def until(ws, kind: str, errors: bool = False) -> list:
    """Messages up to and including the first event of `kind` (error events only where `errors`)."""
    got = []
    while not (got and isinstance(got[-1], dict) and got[-1]["type"] == kind):
        got.append(receive(ws))
        assert errors or not (isinstance(got[-1], dict) and got[-1]["type"] == "error"), got[-1]
    return got


def utterances(messages: list) -> list[tuple[str, bytes]]:
    """(text, PCM) per utterance: every binary frame between its start and end events."""
    out, text, pcm = [], None, b""
    for m in messages:
        if isinstance(m, bytes):
            assert text is not None, "audio outside an utterance"
            pcm += m
        elif m["type"] == "start":
            assert text is None
            text, pcm = m["text"], b""
        elif m["type"] == "end":
            out.append((text, pcm))
            text = None
    return out


def closed_with(ws, code: int) -> None:
    with pytest.raises(ConnectionClosed):
        while True:
            ws.recv(timeout=TIMEOUT)
    assert ws.close_code == code, (ws.close_code, ws.close_reason)


def fatal(ws, code: str, close_code: int = 1008, param=None) -> dict:
    event = receive(ws)
    assert event["type"] == "error" and set(event) == {"type", "error"}, event
    error = event["error"]
    assert (error["code"], error["param"]) == (code, param) and error["message"], error
    assert error["type"] == "invalid_request_error"
    closed_with(ws, close_code)
    return error


# ---- speech ----------------------------------------------------------------------------------------------------
def test_utterances_in_sequence_on_one_connection(server):
    with opened(server, **SAY) as ws:
        for piece in ("Hel", "lo the", "re, how are", " you? ", ""):  # split mid-word and mid-clause
            send(ws, "text", text=piece)
        first = until(ws, "end")
        assert first[0] == {"type": "start", "utterance": 0, "text": "Hello there,"}
        second = until(ws, "end")
        assert second[0] == {"type": "start", "utterance": 1, "text": "how are you?"}
        send(ws, "text", text="Then one more")  # no boundary: spoken at the flush
        send(ws, "flush")
        third = until(ws, "end")
        assert third[0] == {"type": "start", "utterance": 2, "text": "Then one more"}
        send(ws, "text", text="And the last.")
        send(ws, "close")
        rest = until(ws, "closed")
        closed_with(ws, 1000)
    spoken = utterances(first + second + third + rest)
    assert [t for t, _ in spoken] == ["Hello there,", "how are you?", "Then one more", "And the last."]
    for (_, pcm), end in zip(spoken, [first[-1], second[-1], third[-1], rest[-2]]):
        stats = end["stats"]
        assert len(pcm) > 0 and len(pcm) % (2 * HOP) == 0
        assert stats["audio_s"] == pytest.approx(len(pcm) / 2 / 24000) and stats["frames"] > 0
        assert stats["rtf"] > 0 and stats["utterances"] == 1
    assert rest[-1] == {"type": "closed"}


def test_audio_equals_the_http_apis_pcm_for_the_same_text_and_seed(server):
    """Two sentences too long to share an utterance: the session and the whole text are split the same way."""
    import urllib.request

    text = "This is the first sentence here. And this is the second one."
    with opened(server, **SAY) as ws:
        for i in range(0, len(text), 7):
            send(ws, "text", text=text[i:i + 7])
        send(ws, "close")
        spoken = utterances(until(ws, "closed"))
    assert [t for t, _ in spoken] == ["This is the first sentence here.", "And this is the second one."]
    body = json.dumps({"input": text, "response_format": "pcm", **SAY}).encode()
    request = urllib.request.Request(server.http + "/v1/audio/speech", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
        whole = r.read()
    assert b"".join(pcm for _, pcm in spoken) == whole


# LONG's 80 utterances take seconds; the cancel or disconnect comes at its first audio, so its speech is cut (what
# is asserted: fewer than 80 utterances ended), never finished first
def test_cancel_is_a_barge_in_and_the_connection_goes_on(server):
    assert wait_for(lambda: idle(server))
    with opened(server, **SAY) as ws:
        mid_audio(ws)
        send(ws, "cancel")
        before = until(ws, "cancelled")
        # "cancelled" comes once the utterance has stopped and its slot is free
        assert server.engine.metrics()["active_slots"] == 0
        spoken = sum(isinstance(m, dict) and m["type"] == "end" for m in before)
        assert spoken < SENTENCES
        send(ws, "text", text="After the barge-in.")
        send(ws, "close")
        rest = until(ws, "closed")
    # no audio of the cancelled text after "cancelled": the next message is the new text's start
    assert isinstance(rest[0], dict) and rest[0]["type"] == "start" and rest[0]["text"] == "After the barge-in."
    assert rest[0]["utterance"] > spoken  # numbered across the connection's sessions
    assert len(utterances(rest)) == 1


def test_disconnect_mid_audio_frees_the_slot(server):
    assert wait_for(lambda: idle(server))
    completed = server.engine.metrics()["jobs_completed"]
    with opened(server, **SAY) as ws:
        mid_audio(ws)
        ws.socket.shutdown(socket.SHUT_RDWR)  # gone without a close frame
        ws.socket.close()
    assert wait_for(lambda: idle(server))  # the session ended: its slot free, its connection counted down
    assert server.engine.metrics()["jobs_completed"] - completed < SENTENCES


def test_an_utterance_the_engine_refuses_is_an_error_and_the_connection_goes_on(tts_engine):
    """One slot, no queue, held by a request of LONG (seconds of work) while the session's utterance comes."""
    tts, _ = tts_engine
    engine = BatchEngine(tts, slots=1, queue=0)
    try:
        with serving(tts, engine) as s, opened(s, **SAY) as ws:
            holder = engine.submit(LONG, max_frames=16)
            send(ws, "text", text="Refused here. ")
            got = until(ws, "error", errors=True)
            assert got[0] == {"type": "start", "utterance": 0, "text": "Refused here."}
            error = got[-1]["error"]
            assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error"), error
            holder.cancel()
            assert wait_for(lambda: engine.metrics()["active_slots"] == 0)
            send(ws, "text", text="Spoken now.")
            send(ws, "close")
            assert [t for t, _ in utterances(until(ws, "closed"))] == ["Spoken now."]
    finally:
        engine.close()


# ---- messages that are not the protocol's: an error event, then the close --------------------------------------
@pytest.mark.parametrize("raw,code,param", [
    ("{not json", "invalid_json", None),
    ('["open"]', "invalid_json", None),
    ('{"type": "speak", "text": "Hi."}', "unknown_message_type", "type"),
    ('{"text": "Hi."}', "unknown_message_type", "type"),
    ('{"type": ["text"]}', "unknown_message_type", "type"),
    ('{"type": "text", "text": "Hi."}', "unexpected_message", "type"),  # before the open
])
def test_malformed_and_unknown_messages_close_with_1008(server, raw, code, param):
    with connect(server.url, open_timeout=TIMEOUT) as ws:
        ws.send(raw)
        fatal(ws, code, param=param)


def test_unknown_type_and_a_second_open_after_the_open(server):
    with opened(server) as ws:
        send(ws, "pause")
        assert "one of open, text, flush, cancel, close" in fatal(ws, "unknown_message_type", param="type")["message"]
    with opened(server) as ws:
        send(ws, "open")
        fatal(ws, "unexpected_message", param="type")


def test_binary_from_the_client_closes_with_1003(server):
    with opened(server) as ws:
        ws.send(b"\x00\x01" * 100)
        fatal(ws, "unsupported_data", close_code=1003)


def test_a_message_over_the_size_limit_closes_with_1009(server):
    with opened(server) as ws:
        send(ws, "text", text="a" * (16 * MAX_CHARS))
        fatal(ws, "message_too_large", close_code=1009)


@pytest.mark.parametrize("fields,param", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 10 ** 30}, "seed"),
    ({"voice": "nobody"}, "voice"),
    ({"response_format": "wav"}, "response_format"),
    ({"instructions": "whisper"}, "instructions"),
    ({"speed": 2.0}, "speed"),
    ({"colour": "red"}, "colour"),
    ({"ref_audio": "UklGRg=="}, "ref_text"),
    ({"max_chars": 0}, "max_chars"),
    ({"max_new_tokens": 4090}, "max_new_tokens"),  # no utterance would fit the context
    ({"response_format": "\ud800"}, "response_format"),  # a lone surrogate, quoted back escaped
    ({"\ud800": 1}, "\\ud800"),
])
def test_a_bad_open_gets_the_http_apis_error_and_closes(server, fields, param):
    import urllib.error
    import urllib.request

    with connect(server.url, open_timeout=TIMEOUT) as ws:
        send(ws, "open", **fields)
        event = receive(ws)
        closed_with(ws, 1008)
    assert event["type"] == "error" and event["error"]["param"] == param, event
    if param in ("response_format", "max_chars"):  # a session's own rules: pcm only, its utterance length
        return
    body = json.dumps({"input": "Hi.", **fields}).encode()
    request = urllib.request.Request(server.http + "/v1/audio/speech", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    assert e.value.code in (400, 404) and json.loads(e.value.read()) == {"error": event["error"]}



@pytest.mark.parametrize("ref_text,max_new_tokens,param,code,words", [
    (" ".join(["a"] * 1000), 3100, "ref_text", None, "the reference transcript takes 1000 tokens: at most"),
    ("Hello there.", 4080, "max_new_tokens", "out_of_range", "max_new_tokens (4080) leaves no room for any utterance"),
])
def test_an_open_that_leaves_the_text_no_room_names_what_to_change_as_the_http_api_does(server, ref_text,
                                                                                         max_new_tokens, param, code,
                                                                                         words):
    """A session's reference transcript, or max_new_tokens, that leaves the text no room beside a reference voice:
    the open's error names that parameter (the transcript's named no field, max_new_tokens' was found in the
    message's words), and the HTTP API's error is the same (it named 'input' for both)."""
    import base64
    import io
    import urllib.error
    import urllib.request

    import soundfile as sf

    wav = io.BytesIO()
    sf.write(wav, 0.1 * np.random.default_rng(1).standard_normal(24000), 24000, format="WAV", subtype="PCM_16")
    fields = {"ref_audio": base64.b64encode(wav.getvalue()).decode(), "ref_text": ref_text,
              "max_new_tokens": max_new_tokens}
    with connect(server.url, open_timeout=TIMEOUT) as ws:
        send(ws, "open", **fields)
        event = receive(ws)
        closed_with(ws, 1008)
    assert event["type"] == "error" and event["error"]["param"] == param, event
    assert event["error"]["code"] == code and words in event["error"]["message"], event
    body = json.dumps({"input": "Hi.", **fields}).encode()
    request = urllib.request.Request(server.http + "/v1/audio/speech", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    assert e.value.code == 400 and json.loads(e.value.read()) == {"error": event["error"]}


# ---- what a message says that cannot be done: an error event, and the connection goes on ------------------------
@pytest.mark.parametrize("message,code,param", [
    ({"type": "text", "text": 42}, "invalid_type", "text"),
    ({"type": "text"}, "invalid_type", "text"),
    ({"type": "text", "text": "x" * (MAX_CHARS + 1)}, "string_above_max_length", "text"),
    ({"type": "text", "text": "lone \ud800 surrogate"}, None, "text"),
    ({"type": "text", "text": "[SPEAKER1] Hello there. "}, None, "text"),
    ({"type": "flush", "now": True}, "unknown_parameter", "now"),
])
def test_bad_content_is_an_error_event_and_the_session_goes_on(server, message, code, param):
    with opened(server, **SAY) as ws:
        ws.send(json.dumps(message))
        event = receive(ws)
        assert event["type"] == "error" and (event["error"]["code"], event["error"]["param"]) == (code, param), event
        send(ws, "text", text="Still here.")
        send(ws, "close")
        assert [t for t, _ in utterances(until(ws, "closed"))] == ["Still here."]
        closed_with(ws, 1000)


def test_a_close_that_completes_unspeakable_text_is_an_error_event_then_the_normal_close(server):
    with opened(server, **SAY) as ws:
        send(ws, "text", text="Spoken first. [SPEAKER1] not spoken")
        send(ws, "close")  # completes the tagged segment: dropped, said, and the connection closes as asked
        messages = until(ws, "closed", errors=True)
        errors = [m["error"] for m in messages if isinstance(m, dict) and m["type"] == "error"]
        assert [(e["type"], e["param"]) for e in errors] == [("invalid_request_error", "text")], errors
        assert [t for t, _ in utterances(messages)] == ["Spoken first."]
        closed_with(ws, 1000)


def test_text_beyond_the_buffer_bound_is_refused_and_the_rest_is_kept(tts_engine):
    """With --max-input-chars 300 a session holds 300 characters unspoken; max_new_tokens 1000 allows utterances
    of 444, so a 250-character clause waits for its end and nothing is spoken while the test feeds."""
    with serving(*tts_engine, max_input_chars=300) as s, opened(s, max_new_tokens=1000) as ws:
        send(ws, "text", text="word " * 50)
        send(ws, "text", text="x" * 60)
        event = receive(ws)
        assert event["type"] == "error", event
        assert (event["error"]["code"], event["error"]["param"]) == ("text_buffer_full", "text"), event
        assert "250 characters not yet spoken" in event["error"]["message"]
        send(ws, "text", text="x" * 50)  # fits
        send(ws, "cancel")
        assert [m for m in until(ws, "cancelled") if not isinstance(m, bytes)] == [{"type": "cancelled"}]


def test_text_after_close_is_an_error(server):
    with opened(server, **SAY) as ws:
        send(ws, "text", text="The end.")
        send(ws, "close")
        send(ws, "text", text="Too late.")
        got = until(ws, "closed", errors=True)
        errors = [m for m in got if isinstance(m, dict) and m["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["session_closed"]
        assert [t for t, _ in utterances(got)] == ["The end."]


# ---- who may connect, and how many -----------------------------------------------------------------------------
def refused(url: str, status: int, **kwargs) -> dict:
    with pytest.raises(InvalidStatus) as e:
        connect(url, open_timeout=TIMEOUT, **kwargs)
    response = e.value.response
    assert response.status_code == status, response
    return json.loads(response.body)["error"]


def test_a_disallowed_origin_is_refused_before_the_handshake(server, tts_engine):
    error = refused(server.url, 403, origin="https://evil.example")
    assert (error["param"], error["code"]) == ("Origin", "origin_not_allowed")
    with serving(*tts_engine, allow_origins=("https://app.example",)) as s:
        with connect(s.url, origin="https://app.example", open_timeout=TIMEOUT) as ws:
            send(ws, "open")
            assert receive(ws)["type"] == "opened"
        assert refused(s.url, 403, origin="https://evil.example")["param"] == "Origin"


def test_host_and_api_key_are_checked(server, tts_engine):
    rebound = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)  # a DNS-rebinding page's
    assert refused(f"ws://evil.example:{server.port}{PATH}", 400, sock=rebound)["param"] == "Host"
    with serving(*tts_engine, api_key="k3y") as s:
        error = refused(s.url, 401)
        assert (error["param"], error["code"]) == ("Authorization", "invalid_api_key")
        with connect(s.url, additional_headers={"Authorization": "Bearer k3y"}, open_timeout=TIMEOUT) as ws:
            send(ws, "open")
            assert receive(ws)["type"] == "opened"


def test_too_many_connections_get_429_and_a_closed_one_makes_room(server):
    assert wait_for(lambda: idle(server))
    with ExitStack() as held:
        first = held.enter_context(opened(server))
        for _ in range(MAX_WS - 1):
            held.enter_context(opened(server))
        error = refused(server.url, 429)
        assert error["code"] == "too_many_connections" and error["type"] == "rate_limit_error"
        first.close()
        assert wait_for(lambda: health(server)["ws_connections"] == MAX_WS - 1)
        held.enter_context(opened(server))


def test_an_idle_connection_is_closed(tts_engine):
    with serving(*tts_engine, ws_idle_timeout_s=0.5) as s:
        with opened(s) as ws:
            error = fatal(ws, "idle_timeout")
        assert "0.5 s" in error["message"]


# ---- the README's client ----------------------------------------------------------------------------------------
def test_the_readme_client_runs_against_the_server(server, tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(# a WebSocket client.*?)```", readme, re.S)
    assert block, "the README's WebSocket client block"
    code = block.group(1).replace("ws://127.0.0.1:8094", f"ws://127.0.0.1:{server.port}")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    pcm = np.frombuffer((tmp_path / "reply.pcm").read_bytes(), "<i2")
    assert pcm.size > 0 and pcm.size % HOP == 0
