"""`higgs_rt.connections` on both of uvicorn's HTTP/1.1 protocols (httptools', which `serve` runs where installed,
and h11's), in uvicorn on loopback with a stand-in app: a silent connection is closed and a head sent slowly gets
a 408 about --head-timeout after the opening or the last response, a slow body and a WebSocket are not cut; beyond
the cap a connection is answered 503 at once, and the server serves again once connections close. The cap's
default and its fit in the descriptor limit. Every wait has a generous bound; a lower bound (half the timeout)
checks only that a close is the timer's, not an early one."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

uvicorn = pytest.importorskip("uvicorn")
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402

from higgs_rt import connections  # noqa: E402
from higgs_rt.connections import connection_cap, default_connections, protocol  # noqa: E402
from conftest import dribble, read_all, wait_for  # noqa: E402

TIMEOUT = 60  # generous: a loaded 2-core CI machine
HEAD = 1.0  # the head timeout of the timing tests
BASES = [pytest.param(H11Protocol, id="h11")]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    BASES.insert(0, pytest.param(HttpToolsProtocol, id="httptools"))
except ImportError:  # without httptools uvicorn runs h11, as `serve` then does
    pass


async def app(scope, receive, send) -> None:
    """HTTP: the body's length; a WebSocket: its text messages echoed."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": message["text"]})
        return
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(base, head_timeout: float = HEAD, max_connections: int = 100):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=protocol(head_timeout, max_connections, base), log_level="warning",
                            lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    assert wait_for(lambda: uv.started or not thread.is_alive()) and uv.started, "the server did not start"
    try:
        yield SimpleNamespace(address=sock.getsockname(), url="http://%s:%d/" % sock.getsockname())
    finally:
        uv.should_exit = True
        thread.join(TIMEOUT)
        sock.close()


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def error_of(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status) and b"\r\nconnection: close" in head.lower(), answer
    return json.loads(body)["error"]


def closed_after(connect_at: float, sock: socket.socket) -> tuple[bytes, float]:
    """What the server sent until it closed, and when it closed, in seconds after connect_at."""
    data = read_all(sock)
    return data, time.monotonic() - connect_at


GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.mark.parametrize("base", BASES)
def test_heads_are_bounded_bodies_and_websockets_are_not(base):
    with serving(base) as s:
        # silent: closed without an answer; a head sent a byte every 0.2 s (the bytes do not extend its time): 408
        started = time.monotonic()
        silent = socket.create_connection(s.address, timeout=TIMEOUT)
        dribbled = socket.create_connection(s.address, timeout=TIMEOUT)

        dribble(dribbled, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200)
        # meanwhile a request whose body comes after the head timeout: the body's time is not the head's
        slow_body = socket.create_connection(s.address, timeout=TIMEOUT)
        slow_body.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\n")
        answers = {}
        waits = [threading.Thread(target=lambda k=k, c=c: answers.__setitem__(k, closed_after(started, c)))
                 for k, c in (("silent", silent), ("dribbled", dribbled))]
        for t in waits:
            t.start()
        time.sleep(1.5 * HEAD)
        slow_body.sendall(b"hello")
        assert read_response(slow_body).endswith(b"\r\n\r\n5")
        for t in waits:
            t.join(TIMEOUT)
        assert answers["silent"][0] == b"" and 0.5 * HEAD <= answers["silent"][1] < 10
        assert error_of(answers["dribbled"][0], 408)["code"] == "request_timeout"
        assert 0.5 * HEAD <= answers["dribbled"][1] < 10
        # after a response, a kept-alive connection has the same time for its next head
        slow_body.sendall(b"GET / HT")
        started = time.monotonic()
        answer, after = closed_after(started, slow_body)
        assert error_of(answer, 408)["code"] == "request_timeout" and 0.5 * HEAD <= after < 10
        # a WebSocket, once through its handshake, is not the head timer's
        from websockets.sync.client import connect

        with connect("ws://%s:%d/" % s.address, open_timeout=TIMEOUT) as ws:
            time.sleep(1.5 * HEAD)
            ws.send("still here")
            assert ws.recv(timeout=TIMEOUT) == "still here"


@pytest.mark.parametrize("base", BASES)
def test_connections_beyond_the_cap_get_503_at_once_and_the_server_serves_again(base):
    with serving(base, head_timeout=TIMEOUT, max_connections=4) as s:
        idle = [socket.create_connection(s.address, timeout=TIMEOUT) for _ in range(10)]
        for sock in idle[4:]:  # accepted in order: the first 4 are held, the others answered before sending
            error = error_of(read_all(sock), 503)
            assert error["code"] == "too_many_connections" and error["type"] == "server_error"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(s.url, timeout=TIMEOUT)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
        assert json.loads(refused.value.read())["error"]["code"] == "too_many_connections"
        idle[0].sendall(GET)  # a held connection is served as any
        assert read_response(idle[0]).startswith(b"HTTP/1.1 200 ")
        for sock in idle:
            sock.close()

        def served() -> bool:
            try:
                with urllib.request.urlopen(s.url, timeout=TIMEOUT) as r:
                    return r.status == 200
            except urllib.error.HTTPError:
                return False

        assert wait_for(served, TIMEOUT)  # once the server has seen the closes


def test_the_default_cap_follows_the_server_limits():
    assert default_connections(slots=64, queue=32, max_ws_connections=32) == 512
    assert default_connections(slots=4, queue=32, max_ws_connections=32) == 272
    assert default_connections(slots=1, queue=0, max_ws_connections=1) == connections.MIN_CONNECTIONS


class FakeLimits:
    """resource's RLIMIT_NOFILE calls, over a soft and a hard limit."""
    RLIMIT_NOFILE, RLIM_INFINITY = 7, -1

    def __init__(self, soft: int, hard: int):
        self.limits = (soft, hard)

    def getrlimit(self, which):
        return self.limits

    def setrlimit(self, which, limits):
        self.limits = limits


@pytest.mark.parametrize("soft,hard,wanted,cap,limit", [
    (20000, 20000, 512, 512, 20000),  # room enough: as asked
    (1024, 4096, 2000, 2000, 2000 + 100 + 256),  # the soft limit raised as far as needed
    (1024, 1024, 2000, 1024 - 100 - 256, 1024),  # no further than the hard one: fewer connections
    (1024, -1, 2000, 2000, 2000 + 100 + 256),  # the hard limit unlimited
    (300, 300, 512, 1, 300),  # no room at all: one connection
])
def test_the_cap_fits_the_descriptor_limit(monkeypatch, soft, hard, wanted, cap, limit):
    fake = FakeLimits(soft, hard)
    monkeypatch.setitem(sys.modules, "resource", fake)
    monkeypatch.setattr(connections, "_open_fds", lambda: 100)
    assert connection_cap(wanted) == (cap, limit)
    assert fake.limits[0] == limit
