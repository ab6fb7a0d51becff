"""`higgs-rt serve` as a process (loopback only): every start-up error is one line with its documented exit
code, before the model loads; SIGTERM/SIGINT stop it within --shutdown-timeout, a second signal at once, and
the exit code says which (0 clean, 3 requests cut, 130 forced), without "Event loop is closed" or a traceback;
connections are bounded: a request head must come within --head-timeout, and beyond --max-connections a
connection is answered 503 at once (both protocols in detail: tests/test_connections.py)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from higgs_rt.cli import main  # noqa: E402
from conftest import dribble, read_all, wait_for  # noqa: E402

TIMEOUT = 60  # generous: a loaded 2-core CI machine
LONG = " ".join(f"Sentence {i} goes on." for i in range(100))  # about 100 utterances: > 4 s of work


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- start-up errors: one line, the documented code, nothing loaded ---------------------------------------------
def one_line_error(capsys, code: int, argv: list[str]) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("higgs-rt: error: ") and "Traceback" not in err, err
    return err


def test_port_in_use_is_exit_1_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model does not exist: had it been looked for first, the error would name it
        err = one_line_error(capsys, 1, ["serve", "--model", "/nonexistent/model", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1 port {port}" in err and "in use" in err


@pytest.mark.parametrize("argv,message", [
    (["--port", "0"], "--port must be in 1..65535"),
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--slots", "0"], "--slots must be >= 1"),
    (["--queue", "-1"], "--queue >= 0"),
    (["--max-input-chars", "0"], "--max-input-chars must be >= 1"),
    (["--ref-cache-mb", "nan"], "--ref-cache-mb a finite number >= 0"),
    (["--ref-cache-mb", "inf"], "--ref-cache-mb a finite number >= 0"),
    (["--context", "0"], "--context must be an integer in [16, 131072], got 0"),
    (["--context", "99999999"], "--context must be an integer in [16, 131072], got 99999999"),
    (["--shutdown-timeout", "0"], "--shutdown-timeout must be a positive number"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a positive number"),
    (["--body-timeout", "inf"], "--body-timeout must be a positive number"),
    (["--ws-idle-timeout", "0"], "--ws-idle-timeout must be a positive number"),
    (["--max-ws-connections", "0"], "--max-ws-connections must be >= 1"),
    (["--head-timeout", "0"], "--head-timeout must be a positive number"),
    (["--head-timeout", "inf"], "--head-timeout must be a positive number"),
    (["--max-connections", "0"], "--max-connections must be >= 1"),
    (["--max-voices", "-1"], "--max-voices must be >= 0"),
    (["--prefill-tokens", "0"], "--prefill-tokens must be >= 1"),
    (["--chunk", "0"], "--chunk must be in 1..64 frames"),
    (["--chunk", "65"], "--chunk must be in 1..64 frames"),
    (["--max-buffered-s", "0"], "--max-buffered-s must be a positive number"),
    (["--max-buffered-s", "nan"], "--max-buffered-s must be a positive number"),
    (["--api-key", "k", "--no-auth"], "--api-key and --no-auth are alternatives"),
    (["--api-key", ""], "--api-key must be a non-empty key"),
    (["--allowed-hosts", "a*.example"], "a wildcard must look like '*.example.com'"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond this machine: give --api-key KEY"),
])
def test_bad_serve_arguments_are_exit_2(capsys, argv, message):
    err = one_line_error(capsys, 2, ["serve", "--model", "/nonexistent/model", "--port", str(free_port()), *argv])
    assert message in err


def test_chunk_reaches_the_batch_engines_codec(random_model):
    from argparse import Namespace

    from higgs_rt.batch import BatchEngine
    from higgs_rt.cli_options import load_tts

    args = Namespace(model=str(random_model), codec=None, compute="cpu", dtype=None, context=256, compiled=None,
                     chunk=16)
    engine = BatchEngine(load_tts(args, slot=False), slots=1)
    try:
        assert engine.codec.chunk == 16 and engine.codec.widths == [1, 2, 4, 8, 16]
    finally:
        engine.close()


def test_unknown_host_and_missing_model_are_exit_1(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line_error(capsys, 1, ["serve", "--model", "/nonexistent/model", "--host", "no-such-host.invalid"])
    assert "cannot listen on no-such-host.invalid" in err
    port = str(free_port())
    err = one_line_error(capsys, 1, ["serve", "--model", "/nonexistent/model", "--port", port])
    assert "no model directory at /nonexistent/model" in err
    # beyond loopback with --no-auth: the address check passes, the model is looked for next
    err = one_line_error(capsys, 1, ["serve", "--model", "/nonexistent/model", "--port", port, "--host", "0.0.0.0",
                                     "--no-auth"])
    assert "no model directory" in err


@pytest.mark.parametrize("argv", [["--port", "eighty"], ["--shutdown-timeout"], ["--log-level", "loud"]])
def test_argparse_errors_end_with_one_line(argv):
    r = subprocess.run([sys.executable, "-m", "higgs_rt.cli", "serve", *argv], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("higgs-rt serve: error: ")
    assert "Traceback" not in r.stderr


# ---- a running server -----------------------------------------------------------------------------------------
class Served:
    """A `higgs-rt serve` subprocess on a free loopback port, its stderr collected line by line."""

    def __init__(self, model, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "higgs_rt.cli", "serve", "--model", str(model), "--port",
                                      str(self.port), "--slots", "2", "--log-level", "info", *args],
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()
        assert wait_for(self._up, TIMEOUT), self.stderr

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.stderr
        try:
            return self.get("/health")["status"] == "ok"
        except OSError:
            return False

    def get(self, path: str, headers: dict | None = None) -> dict:
        return json.loads(self.text(path, headers))

    def text(self, path: str, headers: dict | None = None) -> str:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.read().decode()

    def active(self) -> int:
        return self.get("/health")["active_slots"]

    def stream(self, body: dict, headers: bytes = b"") -> socket.socket:
        """A streamed request on a raw socket, left to the caller to read."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT)
        data = json.dumps({"stream": True, "response_format": "pcm", **body}).encode()
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"%sContent-Length: %d\r\n\r\n%s" % (headers, len(data), data))
        return sock

    def exit_code(self) -> int:
        try:
            return self.proc.wait(TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(TIMEOUT)


def clean(stderr: str) -> None:
    assert "Event loop is closed" not in stderr and "Traceback" not in stderr, stderr


@pytest.fixture
def served(random_model):
    servers = []

    def start(*args: str) -> Served:
        servers.append(Served(random_model, *args))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_sigterm_lets_running_requests_finish_then_exits_0(served):
    s = served("--shutdown-timeout", "120", "--verbose")
    # --verbose: the start-up's stages, up to "ready" (the batch engine built, before the port serves)
    for stage in ("import torch", "TTS()", "talker weights", "tokenizer (prompt builder)", "batch engine", "ready"):
        assert any(line.split("   [")[0].rstrip().endswith("  " + stage) for line in s.lines), (stage, s.stderr)
    assert "higgs-rt: ready " in s.stderr and "s after import torch returned" in s.stderr
    sock = s.stream({"input": LONG, "max_new_tokens": 20, "seed": 1})
    assert wait_for(lambda: s.active() == 1, TIMEOUT)
    lag = lambda: int(re.search(r"^higgs_rt_event_loop_lag_seconds_count (\d+)$", s.text("/metrics"), re.M)[1])  # noqa: E731
    assert wait_for(lambda: lag() >= 2, TIMEOUT)  # the event loop's probe runs beside uvicorn
    s.proc.send_signal(signal.SIGTERM)
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n0\r\n\r\n")  # the whole chunked stream
    assert s.exit_code() == 0
    clean(s.stderr)


def test_requests_left_at_the_shutdown_timeout_are_cut_exit_3(served):
    s = served("--shutdown-timeout", "1")
    socks = [s.stream({"input": LONG, "max_new_tokens": 20, "seed": i}) for i in range(2)]
    assert wait_for(lambda: s.active() == 2, TIMEOUT)
    s.proc.send_signal(signal.SIGTERM)
    assert s.exit_code() == 3  # LONG takes several seconds: both were still running after 1 s
    for sock in socks:
        assert not read_all(sock).endswith(b"\r\n0\r\n\r\n")  # cut, not completed
    clean(s.stderr)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_forces_exit_130(served, sig):
    s = served("--shutdown-timeout", "120")
    socks = [s.stream({"input": LONG, "max_new_tokens": 20, "seed": i}) for i in range(2)]
    assert wait_for(lambda: s.active() == 2, TIMEOUT)
    s.proc.send_signal(sig)
    assert wait_for(lambda: "Shutting down" in s.stderr, TIMEOUT), s.stderr
    s.proc.send_signal(sig)
    assert s.exit_code() == 130
    for sock in socks:
        sock.close()
    clean(s.stderr)


def test_sigterm_closes_websockets_with_1012_and_a_cut_session_is_exit_3(served):
    """At the first signal a WebSocket is closed at once (1012: service restart), whatever the timeout, and what it
    was speaking is cancelled: LONG's 100 utterances take seconds, the signal comes at the first audio."""
    websockets = pytest.importorskip("websockets")
    from websockets.sync.client import connect

    s = served("--shutdown-timeout", "120")
    with connect(f"ws://127.0.0.1:{s.port}/v1/audio/speech/stream", open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps({"type": "open", "max_new_tokens": 20, "seed": 1}))
        ws.send(json.dumps({"type": "text", "text": LONG}))
        while not isinstance(ws.recv(timeout=TIMEOUT), bytes):
            pass
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            while True:
                ws.recv(timeout=TIMEOUT)
        assert ws.close_code == 1012
    assert s.exit_code() == 3
    clean(s.stderr)


def test_api_key_over_a_real_socket_with_the_openai_client_and_the_client_command(served, tmp_path):
    s = served("--api-key", "k3y")
    keyed = openai.OpenAI(base_url=s.url + "/v1", api_key="k3y", max_retries=0, timeout=TIMEOUT)
    audio = keyed.audio.speech.create(model="tts-1", voice="alloy", input="With a key.", response_format="pcm",
                                      extra_body={"max_new_tokens": 12}).content
    assert len(audio) > 0
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.body["param"] == "Authorization"
    assert s.get("/health")["status"] == "ok"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Through the client command.\n")
    command = [sys.executable, "-m", "higgs_rt.cli", "client", "--base-url", s.url, "--prompts", str(prompts),
               "--output-dir", str(tmp_path / "out"), "--max-new-tokens", "12"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1 and "HTTP 401" in r.stdout
    r = subprocess.run([*command, "--api-key", "k3y"], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and (tmp_path / "out" / "0001.wav").stat().st_size > 44, r.stdout + r.stderr
    s.proc.send_signal(signal.SIGTERM)
    assert s.exit_code() == 0
    clean(s.stderr)


@pytest.mark.parametrize("argv,code,message", [
    (["--base-url", "ftp://x"], 2, "--base-url must be an http:// or https:// URL with a host, got 'ftp://x'"),
    (["--base-url", "localhost:8094"], 2, "--base-url must be an http:// or https:// URL with a host"),
    (["--base-url", "http://[::1"], 2, "--base-url 'http://[::1' is not a URL"),
    (["--timeout-s", "nan"], 2, "--timeout-s in (0, 86400]"),
    (["--concurrency", "0"], 2, "--concurrency must be in [1, 256]"),
    (["--prompts", "{binary}"], 2, "is not UTF-8 text"),
    (["--prompts", "{missing}"], 1, "cannot read --prompts"),
    (["--output-dir", "{file}"], 1, "cannot write to --output-dir"),
    (["--ref-audio", "{missing}", "--ref-text", "Hi."], 1, "cannot read --ref-audio"),
    (["--timeout-s", "1e10"], 2, "--timeout-s in (0, 86400]"),  # was socket.settimeout's OverflowError
    (["--concurrency", "100000"], 2, "--concurrency must be in [1, 256]"),  # a thread each
    (["--seed", "-1"], 2, "--seed must be in [0, 9223372036854775807], got -1"),  # was a 400 per prompt
    (["--seed", str(2**63 - 1)], 2, "--seed + 1 (the last prompt's) must be in"),  # two prompts: seed, seed + 1
    (["--max-new-tokens", "0"], 2, "--max-new-tokens must be in [9, 65536], got 0"),
    (["--prompts", "/dev/zero"], 2, "--prompts /dev/zero is larger than 16 MiB"),  # was a MemoryError
    (["--ref-audio", "/dev/zero", "--ref-text", "Hi."], 2, "--ref-audio /dev/zero is larger than 12 MiB"),
    (["--api-key", "s3cret\nX-Evil: 1"], 2, "--api-key must be printable ASCII without spaces"),  # not echoed
    (["--base-url", "http://127.0.0.1:1/v1?x=1"], 2, "--base-url takes no query, fragment or user@"),
])
def test_bad_client_arguments_are_one_line_before_any_request(capsys, tmp_path, argv, code, message):
    """Refused before the first request: the server named does not exist (a request would fail otherwise)."""
    paths = {"binary": tmp_path / "binary.txt", "missing": tmp_path / "missing", "file": tmp_path / "prompts.txt"}
    paths["binary"].write_bytes(b"\xa7\xff\x00 not text")
    paths["file"].write_text("Hello.\nWorld.\n")
    defaults = {"--base-url": "http://127.0.0.1:1", "--prompts": str(paths["file"]),
                "--output-dir": str(tmp_path / "out")}
    args = [a.format(**paths) for a in argv]
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    err = one_line_error(capsys, code, ["client", *args])
    assert message in err and "s3cret" not in err
    assert not (tmp_path / "out").exists()  # nothing made for a call that was refused


@pytest.mark.parametrize("argv,env,option", [
    (["--voice", ""], None, "--voice"),  # was a failed request per prompt, exit 1
    (["--model", " "], None, "--model"),  # likewise
    (["--ref-audio", "{file}", "--ref-text", ""], None, "--ref-text"),  # likewise
    (["--api-key", ""], None, "--api-key"),  # was sent without a key: a 401 per prompt
    ([], "", "--api-key"),  # $HIGGS_RT_API_KEY set empty: the same
])
def test_empty_client_options_are_usage_errors_before_any_request(capsys, tmp_path, monkeypatch, argv, env, option):
    if env is not None:
        monkeypatch.setenv("HIGGS_RT_API_KEY", env)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello.\n")
    args = [a.format(file=prompts) for a in argv]
    with pytest.raises(SystemExit) as exited:  # argparse's usage error
        main(["client", *args, "--base-url", "http://127.0.0.1:1", "--prompts", str(prompts),
              "--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"higgs-rt client: error: argument {option}: an empty value (see higgs-rt client --help)"]


def _answering(answer) -> tuple[socket.socket, str]:
    """A loopback server that reads a request and sends `answer` (bytes, or a callable given the connection) on
    each connection, forever; -> (its socket, to close; its URL)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one(conn):
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:  # the whole request: closing on unread bytes would reset it
                request += conn.recv(1 << 16)
            length = int(re.search(rb"content-length: *(\d+)", request, re.I).group(1))
            while len(request.partition(b"\r\n\r\n")[2]) < length:
                request += conn.recv(1 << 16)
            try:
                answer(conn) if callable(answer) else conn.sendall(answer)
            except OSError:  # the client gave up
                pass

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


def _trickle(conn) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: audio/wav\r\nContent-Length: 100000\r\n\r\nRIFF\0\0\0\0WAVE")
    for _ in range(100):  # a byte each 0.1 s: every read within the timeout, the whole far beyond it
        conn.sendall(b"x")
        time.sleep(0.1)


def _endless(conn) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: audio/wav\r\n\r\nRIFF\0\0\0\0WAVE")
    while True:
        conn.sendall(bytes(1 << 16))


def _ok(kind: bytes, body: bytes, status: bytes = b"200 OK", length: int | None = None) -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (status, kind, len(body) if length is None else length) + body)


def test_the_client_s_line_helper_is_named_for_what_it_does():
    """`client.printable_line` makes a server's or a user's text one printable line, at most `limit` characters;
    the name `one_line` (also session's exception formatter, another job) is gone from both modules."""
    from higgs_rt import client, session

    assert client.printable_line("red\x1b[31m\n  second\tline", None) == "red\\x1b[31m second line"
    assert client.printable_line("x" * 300) == "x" * 200 and client.printable_line("abc", 2) == "ab"
    assert not hasattr(client, "one_line") and not hasattr(session, "one_line")


@pytest.mark.parametrize("answer,message", [
    (b"\x00\xffnot HTTP\r\n\r\n", "the server's answer is not HTTP (BadStatusLine"),  # was a traceback
    (_ok(b"text/html", b"<html>hi</html>"), "(15 bytes, text/html) is not wav audio"),  # was written as 0001.wav
    (_ok(b"audio/wav", b""), "(0 bytes, audio/wav) is not wav audio"),  # likewise, an empty 0001.wav
    (_ok(b"audio/wav", b"RIFF\0\0\0\0WAVE", length=100), "cut short (12 bytes, 88 more expected)"),  # traceback
    (_ok(b"application/json", b'{"error": {"message": "red\\u001b[31m\\nsecond line"}}', b"400 Bad"),
     "HTTP 400: red\\x1b[31m second line"),  # the server's text reached the terminal raw, on two lines
    (_trickle, "timed out (--timeout-s) while the answer arrived"),  # was a hang: each read within the timeout
    (_endless, "the answer is larger than 1 MiB"),  # was a MemoryError (or all of the machine's memory)
])
def test_a_server_answering_garbage_fails_each_prompt_in_one_line(capsys, tmp_path, monkeypatch, answer, message):
    from higgs_rt import client

    monkeypatch.setattr(client, "MAX_AUDIO_BYTES", 1 << 20)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("One.\nTwo.\n")
    listener, url = _answering(answer)
    started = time.monotonic()
    try:
        code = main(["client", "--base-url", url, "--prompts", str(prompts), "--output-dir", str(tmp_path / "out"),
                     "--timeout-s", "1", "--concurrency", "2"])
    finally:
        listener.close()
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err and err.strip() == f"0 of 2 prompts written to {tmp_path / 'out'}"
    lines = sorted(out.splitlines())
    assert [line.split(": failed: ")[0] for line in lines] == ["0001.wav", "0002.wav"], out
    assert all(message in line for line in lines), out
    assert time.monotonic() - started < 8  # --timeout-s 1: the whole answer, not each read (give or take one)
    assert list((tmp_path / "out").iterdir()) == []  # no file of garbage, no partial file left


# ---- connections ----------------------------------------------------------------------------------------------
def test_a_head_not_sent_within_head_timeout_is_cut_while_requests_go_on(served):
    s = served("--head-timeout", "1")
    # the default cap: 4 x (2 slots + 32 queued + 32 WebSockets)
    assert wait_for(lambda: "At most 264 connections, each with 1 s for a request head" in s.stderr, TIMEOUT)
    started = time.monotonic()
    silent = socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT)
    dribbled = socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT)

    dribble(dribbled, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200)  # the bytes do not
    # extend the head's time
    ends = {}
    waits = [threading.Thread(target=lambda k=k, c=c: ends.__setitem__(k, (read_all(c), time.monotonic() - started)))
             for k, c in (("silent", silent), ("dribbled", dribbled))]
    for t in waits:
        t.start()
    # meanwhile a request on another connection is answered whole
    answer = read_all(s.stream({"input": "Meanwhile.", "max_new_tokens": 12, "seed": 1},
                               headers=b"Connection: close\r\n"))
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n0\r\n\r\n")
    for t in waits:
        t.join(TIMEOUT)
    assert ends["silent"][0] == b"" and 0.5 <= ends["silent"][1] < 10  # closed without an answer
    head, _, body = ends["dribbled"][0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"\r\nconnection: close" in head.lower(), ends["dribbled"][0]
    assert json.loads(body)["error"]["code"] == "request_timeout" and 0.5 <= ends["dribbled"][1] < 10
    assert s.get("/health")["status"] == "ok"
    s.proc.send_signal(signal.SIGTERM)
    assert s.exit_code() == 0
    clean(s.stderr)


def test_connections_beyond_max_connections_get_503_and_serving_resumes_after(served):
    s = served("--max-connections", "4", "--head-timeout", "120")
    assert wait_for(lambda: "At most 4 connections" in s.stderr, TIMEOUT)
    idle = [socket.create_connection(("127.0.0.1", s.port), timeout=TIMEOUT) for _ in range(10)]
    with pytest.raises(urllib.error.HTTPError) as refused:
        s.get("/health")
    error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 503 and error["code"] == "too_many_connections", error
    assert refused.value.headers["Retry-After"] == "1" and refused.value.headers["Connection"] == "close"
    # those beyond the cap were answered at once, without sending anything (at most 4 are held)
    answered = [sock for sock in idle[4:] if read_all(sock).startswith(b"HTTP/1.1 503")]
    assert len(answered) == 6
    for sock in idle:
        sock.close()

    def serves() -> bool:
        try:
            return s.get("/health")["status"] == "ok"
        except urllib.error.HTTPError:
            return False

    assert wait_for(serves, TIMEOUT)  # once the server has seen the closes
    assert wait_for(lambda: "refusing more with 503" in s.stderr, TIMEOUT)
    s.proc.send_signal(signal.SIGTERM)
    assert s.exit_code() == 0
    assert s.stderr.count("refusing more with 503") == 1  # once for the flood, not once a connection
    clean(s.stderr)
