"""What a connection to `higgs-rt serve` may hold before it carries a request: the time it has to send a request
head, and how many connections may be open at once. uvicorn bounds neither: its keep-alive timeout closes only a
connection idle after a response (the first byte of a next head stops it), and its limit_concurrency answers
only a complete head, so connections that send nothing pile up until the process runs out of file descriptors.
`protocol()` is uvicorn's HTTP protocol (httptools', as uvicorn picks it, else h11's) with both bounds.

The head timeout runs from the connection's opening, and from the end of each response on a kept-alive
connection, until a request head is complete; bytes arriving do not extend it, so a head sent a byte at a time is
cut like a silent one. A connection that sent part of a head gets a 408 (`request_timeout`, `Connection: close`);
one that sent nothing is closed without an answer, as uvicorn closes an idle kept-alive one: a client that sends
its request on it later sees a closed connection and retries, where an answer nobody asked for would be read as
its request's. The body has its own timeout (the app's --body-timeout); once a WebSocket handshake is through,
the connection is the WebSocket protocol's and no head timer runs.

The cap counts the open connections, HTTP and WebSocket: one accepted beyond it is answered at once with a 503
(`too_many_connections`, `Connection: close`, `Retry-After`) and closed without waiting for its request, so a
flood of connections costs a descriptor each only while it is answered. `connection_cap` keeps a cap within the
descriptor limit (RLIMIT_NOFILE, whose soft limit it raises up to the hard one as needed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from http import HTTPStatus

from .server import RETRY_AFTER_S
from .speech_api import ApiError

log = logging.getLogger("uvicorn.error")

MIN_CONNECTIONS = 256
FD_RESERVE = 256  # descriptors kept for all but connections: voice and reference files, uploads, threads, logs


def default_connections(slots: int, queue: int, max_ws_connections: int) -> int:
    """Every request the server runs or queues and every WebSocket session, four times over: room for kept-alive
    clients, probes and the requests answered 429; at least MIN_CONNECTIONS."""
    return max(MIN_CONNECTIONS, 4 * (slots + queue + max_ws_connections))


def _open_fds() -> int:
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(listing))
        except OSError:
            pass
    return 0


def connection_cap(wanted: int) -> tuple[int, int | None]:
    """(wanted or fewer, the descriptor limit): fewer if the limit, its soft value raised toward the hard one as
    needed, leaves fewer beside the descriptors open now and FD_RESERVE (at least 1); None: no limit known."""
    try:
        import resource
    except ImportError:  # Windows
        return wanted, None
    unlimited = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _open_fds() + FD_RESERVE + wanted
    if soft != unlimited and need > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == unlimited else min(need, hard), hard))
        except (ValueError, OSError):
            pass
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == unlimited:
        return wanted, None
    return max(1, min(wanted, soft - _open_fds() - FD_RESERVE)), soft


def raw_answer(e: ApiError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The error as a whole HTTP/1.1 response that closes the connection, written to the transport directly."""
    body = json.dumps(e.body(), separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {e.status} {HTTPStatus(e.status).phrase}".encode(),
             *(name + b": " + value for name, value in default_headers),
             *(f"{name.lower()}: {value}".encode() for name, value in e.headers.items()),
             b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class _Bounded:
    """Mixed into uvicorn's httptools or h11 protocol: the head timer and the cap (module docstring). It relies on
    what both share: `cycle` is made when a request head is complete, `on_response_complete` ends a response, and
    a WebSocket upgrade hands the transport to another protocol."""

    head_timeout: float
    max_connections: int
    refusing = False  # on the class: the cap's warning is logged once per flood, not per connection
    _refused = False
    _head_timer: asyncio.TimerHandle | None = None
    _head_begun = False

    def connection_made(self, transport) -> None:
        if len(self.server_state.connections) >= self.max_connections:
            self.transport, self._refused = transport, True
            if not type(self).refusing:
                type(self).refusing = True
                log.warning("%d connections are open (--max-connections): refusing more with 503",
                            self.max_connections)
            transport.write(raw_answer(ApiError(
                f"{self.max_connections} connections are open: at most that many are served at once", status=503,
                code="too_many_connections", kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)}),
                self.server_state.default_headers))
            transport.close()
            return
        type(self).refusing = False
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        if not self._refused:
            self._disarm()
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._head_begun = self._head_begun or (self._head_timer is not None and bool(data))
        super().data_received(data)
        if self.transport.get_protocol() is not self or self._in_request():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._arm()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_begun = False
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_begun:
            self.transport.write(raw_answer(ApiError(
                f"the request head did not arrive within {self.head_timeout:g} s", status=408,
                code="request_timeout"), self.server_state.default_headers))
        self.transport.close()


def protocol(head_timeout: float, max_connections: int, base: type | None = None) -> type[asyncio.Protocol]:
    """An HTTP protocol class for uvicorn.Config(http=...): `base` (default: uvicorn's choice, httptools' where
    installed) with the head timeout and the cap."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    return type(f"Bounded{base.__name__}", (_Bounded, base),
                dict(head_timeout=head_timeout, max_connections=max_connections))
