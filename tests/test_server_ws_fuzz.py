"""Fuzzing the speech WebSocket (/v1/audio/speech/stream) with hypothesis (derandomized, no example database, no
deadline), on uvicorn over a loopback socket with `serve`'s WebSocket settings.

Each example is one connection and a script of messages: an open whose fields mix plausible, hostile and any
JSON values (the HTTP fuzz's material, `fuzz_values`), then texts plausible and hostile (lone surrogates as
JSON escapes, over the piece limit), flushes, cancels, closes, and protocol breakers (binary frames, non-JSON,
JSON that is not an object, unknown types, unknown fields, a second open, a message over the size limit). After
the script the client reads until the server closes, sending a close if the script did not.

For every connection: each event is one of the protocol's, in its shape; no error event says the server failed
(`server_error`, status 500) and no close is 1011; an error event's `param` names a field of the message or is
None for the message as a whole; audio comes only inside an utterance (between its start and end) and is whole
16-bit samples; a connection whose script was all valid ends with "closed" and 1000. At the end the server has
no connection open and no slot busy, and it still speaks. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("websockets")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from conftest import wait_for  # noqa: E402
from fuzz_values import BAD_TEXTS, FIELDS, SENTENCES, json_any, texts  # noqa: E402
from higgs_rt.batch import BatchEngine  # noqa: E402
from higgs_rt.engine import TTS  # noqa: E402
from higgs_rt.server import create_app  # noqa: E402
from higgs_rt.server_process import WS_OPTIONS  # noqa: E402
from higgs_rt.speech_api import SESSION_FIELDS  # noqa: E402
from higgs_rt.speech_ws import PATH  # noqa: E402

N_CONNECTIONS = 400
MAX_CHARS = 300  # --max-input-chars: a message over 16 x this is over the size limit
TIMEOUT = 60
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
EVENTS = {"opened", "start", "end", "error", "cancelled", "closed"}
CLOSES = {1000, 1003, 1008, 1009}  # normal, binary, policy, too big; never 1011 (the server failed)
# the session's fields; max_new_tokens always present and valid only in 9..12, so every utterance is short
OPEN_FIELDS = {name: values for name, values in FIELDS.items() if name in SESSION_FIELDS}
OPEN_FIELDS["max_chars"] = (st.integers(1, 40), [0, -1, 41, 10**30, 1.5, "9"])  # 40: what max_new_tokens 9 allows
OPEN_FIELDS["voice"] = (st.sampled_from(["default", "alloy", "nova", {"id": "echo"}]),  # no voice is stored here
                        OPEN_FIELDS["voice"][1] + ["v1"])
OPEN_FIELDS["response_format"] = (st.just("pcm"), ["wav", "flac", "", "PCM"])  # a session's audio is PCM alone
TEXT_PIECES = st.one_of(st.sampled_from(SENTENCES), st.sampled_from(BAD_TEXTS), texts, st.just("x" * (MAX_CHARS + 1)),
                        st.sampled_from(["Half a sen", "tence. ", "Done.", " ", ""]))
PLAIN = {"flush": {"type": "flush"}, "cancel": {"type": "cancel"}, "close": {"type": "close"}}


@st.composite
def open_message(draw) -> tuple[str, bool]:
    """(the open message, whether every field is plausible)."""
    mode = draw(st.sampled_from(["valid", "valid", "valid", "one hostile", "mixed"]))
    body = {"type": "open", "max_new_tokens": draw(OPEN_FIELDS["max_new_tokens"][0])}
    for name, (plausible, _) in OPEN_FIELDS.items():
        if name not in body and draw(st.integers(0, 9)) < 2:
            body[name] = draw(plausible)
    if mode == "one hostile":
        name = draw(st.sampled_from(sorted(OPEN_FIELDS)))
        body[name] = draw(st.one_of(st.sampled_from(OPEN_FIELDS[name][1]), json_any))
    elif mode == "mixed":
        for name in list(body)[1:]:
            if draw(st.booleans()):
                body[name] = draw(json_any)
        if draw(st.booleans()):
            body[draw(st.text(min_size=1, max_size=8))] = draw(json_any)
    return json.dumps(body), mode == "valid"


@st.composite
def message(draw) -> tuple[str | bytes, bool]:
    """(one message after the open, whether it is a well-formed one of the protocol's)."""
    kind = draw(st.sampled_from(["text"] * 6 + ["flush", "flush", "cancel", "close", "breaker"]))
    if kind == "text":
        return json.dumps({"type": "text", "text": draw(TEXT_PIECES)}), True
    if kind != "breaker":
        return json.dumps(PLAIN[kind]), True
    return draw(st.sampled_from([
        b"\x00\x01binary", "not json", "[1, 2]", "null", '"text"', json.dumps({"type": "speak", "text": "Hi."}),
        json.dumps({"text": "no type"}), json.dumps({"type": ["text"]}), json.dumps({"type": {"a": 1}}),
        json.dumps({"type": "text", "text": "Hi.", "extra": 1}), json.dumps({"type": "text", "text": 5}),
        json.dumps({"type": "flush", "now": True}), json.dumps({"type": "open", "max_new_tokens": 10}),
        json.dumps({"type": "text", "text": "x" * (16 * MAX_CHARS + 1)}), "{" * 2000,
    ])), False


scripts = st.tuples(open_message(), st.lists(message(), max_size=8))


def check_connection(script, received: list, close_code: int | None) -> None:
    (opening, open_ok), messages = script
    where = f"{opening} {[m for m, _ in messages]} -> {received[:12]} ... close {close_code}"
    assert close_code in CLOSES, where
    in_utterance = False
    for m in received:
        if isinstance(m, bytes):
            assert in_utterance and len(m) % 2 == 0, where
            continue
        assert m["type"] in EVENTS, where
        if m["type"] == "error":
            error = m["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], where
            assert error["type"] != "server_error" and "internal error" not in error["message"], where
            assert error["param"] is None or error["param"] in SESSION_FIELDS | {"type", "text"} \
                or error["code"] == "unknown_parameter", where
        elif m["type"] == "start":
            assert not in_utterance, where
            in_utterance = True
        elif m["type"] == "end":
            assert in_utterance and m["stats"]["frames"] >= 1, where
            in_utterance = False
        elif m["type"] == "cancelled":
            in_utterance = False  # the cut utterance gets no end event
    if open_ok and all(ok for _, ok in messages):
        assert received[0]["type"] == "opened", where
        assert received[-1] == {"type": "closed"} and close_code == 1000, where


def converse(url: str, script) -> tuple[list, int | None]:
    """Send the script, then read until the server closes (sending a close first if the script has none)."""
    (opening, _), messages = script
    received = []
    with connect(url, open_timeout=TIMEOUT, close_timeout=TIMEOUT, max_size=None) as ws:
        try:
            ws.send(opening)
            for data, _ in messages:
                ws.send(data)
            if not any(data == json.dumps(PLAIN["close"]) for data, _ in messages):
                ws.send(json.dumps(PLAIN["close"]))
        except ConnectionClosed:
            pass  # the server closed on a protocol error: what it sent is read below
        deadline = time.monotonic() + TIMEOUT
        try:
            while time.monotonic() < deadline:
                m = ws.recv(timeout=TIMEOUT)
                received.append(m if isinstance(m, bytes) else json.loads(m))
        except ConnectionClosed:
            pass
        return received, ws.close_code


@pytest.fixture(scope="module")
def served(random_model, tmp_path_factory):
    tts = TTS(random_model, device="cpu", context=512, voices_dir=tmp_path_factory.mktemp("ws-fuzz-voices"))
    engine = BatchEngine(tts, slots=2, queue=4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(tts, engine, "tiny", max_input_chars=MAX_CHARS, max_ws_connections=4)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", **WS_OPTIONS))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    assert wait_for(lambda: server.started or not thread.is_alive()) and server.started, "the server did not start"
    yield f"127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(TIMEOUT)
    sock.close()
    engine.close()


def test_fuzz_the_speech_websocket(served):
    address, engine = served
    url = f"ws://{address}{PATH}"
    seen = {"connections": 0, "audio": 0, "errors": 0, "closes": {}}

    def one(script) -> None:
        received, code = converse(url, script)
        seen["connections"] += 1
        seen["audio"] += sum(isinstance(m, bytes) for m in received)
        seen["errors"] += sum(isinstance(m, dict) and m["type"] == "error" for m in received)
        seen["closes"][code] = seen["closes"].get(code, 0) + 1
        check_connection(script, received, code)

    started = time.perf_counter()
    given(scripts)(settings(max_examples=N_CONNECTIONS, **SETTINGS)(one))()
    print(f"ws fuzz: {seen} in {time.perf_counter() - started:.0f} s")
    assert seen["connections"] >= N_CONNECTIONS - 5
    assert seen["audio"] > 0 and seen["errors"] > 0 and {1000, 1008} <= set(seen["closes"])
    health = lambda: json.loads(_get(f"http://{address}/health"))  # noqa: E731
    assert wait_for(lambda: health()["ws_connections"] == 0 and health()["active_slots"] == 0, TIMEOUT), health()
    received, code = converse(url, ((json.dumps({"type": "open", "max_new_tokens": 10}), True),
                                    [(json.dumps({"type": "text", "text": "Still speaking."}), True)]))
    assert code == 1000 and any(isinstance(m, bytes) for m in received), received[:5]


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
        return r.read()
