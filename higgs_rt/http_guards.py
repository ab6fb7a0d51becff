"""The server's ASGI middleware: what every request passes before a handler, and the last-resort error answer.

Outermost first (`guards()`): `ServerErrors`; the Host check (Starlette's TrustedHostMiddleware: a DNS-rebinding
page reaches the server under its own host name); the Origin check (a browser page of another origin is
refused, unless --allow-origin names it, whose preflights CORSMiddleware then answers); the API key. Refusals are
OpenAI-style errors naming the header at fault. WebSocket handshakes pass the same checks (browsers apply no CORS
to WebSockets: the Origin check is what keeps a web page out) and are refused before they are accepted, with the
same HTTP status and body as the handshake's answer (`refuse`).

`ServerErrors` turns an exception no handler caught into an OpenAI-style 500 and does not re-raise it, so the
keep-alive connection carries the next request (Starlette's own handler for `Exception` sends its answer and
then re-raises, and uvicorn drops the socket without `Connection: close`); a client gone mid-body is no error.
`QuietCuts` keeps uvicorn's log of a stream cut on purpose to one line.
"""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .speech_api import ApiError, printable
from .types import BufferFull

log = logging.getLogger("uvicorn.error")


def error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **(headers or {})})


CLOSE_POLICY = 1008  # WebSocket close code: the endpoint refuses what was sent (RFC 6455)
GUARDED = ("http", "websocket")


def close_reason(text: str) -> str:
    """A WebSocket close reason: at most 123 bytes of UTF-8 (cut at a character), whatever the text holds."""
    return printable(text).encode()[:123].decode("utf-8", errors="ignore")


async def refuse(scope: Scope, receive: Receive, send: Send, e: ApiError) -> None:
    """Answer an HTTP request or a WebSocket handshake not yet accepted with the error. A server without the
    ASGI WebSocket denial-response extension gets a close instead (its clients see a 403 without the body)."""
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": CLOSE_POLICY, "reason": close_reason(e.message)})
        return
    await error_response(e)(scope, receive, send)


class ServerErrors:
    """An unhandled exception -> 500 JSON, logged with its traceback. Once the answer has started (a stream),
    nothing can be added to it: the exception goes on, and uvicorn ends that connection."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # gone while its body was read: nobody to answer, nothing went wrong here
            log.info("%s %s: the client went away before its body was read", scope.get("method"), scope.get("path"))
        except Exception as e:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            error = ApiError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
            await error_response(error)(scope, receive, send)


class QuietCuts(logging.Filter):
    """For uvicorn's error log: a stream the server cut on purpose (its client stopped reading: `BufferFull`) is
    logged as one warning line, not as an application error with its traceback. The cut itself is uvicorn's, on
    the exception: the client sees the stream end short, never a complete-looking answer."""

    def filter(self, record: logging.LogRecord) -> bool:
        cut = _buffer_full(record.exc_info[1] if record.exc_info else None)
        if cut is not None:
            record.msg, record.args, record.exc_info, record.exc_text = f"stream cut: {cut}", (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _buffer_full(e: BaseException | None) -> BufferFull | None:
    inner = getattr(e, "exceptions", None)  # an exception group (Python 3.11), raised from a task group
    if isinstance(inner, tuple):
        return next((c for c in map(_buffer_full, inner) if c is not None), None)
    return e if isinstance(e, BufferFull) else None


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
OPEN_PATHS = {("GET", "/health"), ("GET", "/metrics")}  # no API key: probes and scrapers carry none, and neither
# answer holds anything a request sent


class Refusals:
    """Runs a Starlette middleware that may answer a request itself in plain text (TrustedHostMiddleware,
    CORSMiddleware). Such an answer with a 4xx status, given before the request reached the app, becomes an
    OpenAI-style error naming `param`; everything else passes unchanged."""

    def __init__(self, app: ASGIApp, middleware, param: str, **options):
        self.app, self.param = app, param
        self.key = f"higgs_rt.passed.{param}"
        self.inner = middleware(self._passed, **options)

    async def _passed(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[self.key] = True
        await self.app(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in GUARDED:
            await self.inner(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal start, body
            kind = message["type"].removeprefix("websocket.")  # a handshake's answer: websocket.http.response.*
            if scope.get(self.key) or (start is None and kind == "http.response.start" and message["status"] < 400):
                scope[self.key] = True
                await send(message)
            elif kind == "http.response.start":
                start = message
            elif kind == "http.response.body":
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    text = body.decode(errors="replace").strip() or "refused"
                    await refuse(scope, receive, send, ApiError(text, self.param, status=start["status"]))

        await self.inner(scope, receive, rewrite)


class OriginCheck:
    """A request that carries an Origin header (a browser's, from a web page) is refused with 403 unless the
    origin is allowed: a page cannot make the server synthesize, store voices or read answers. CORSMiddleware
    (inside this) then answers the allowed origins' preflights and adds their headers."""

    def __init__(self, app: ASGIApp, allow_origins: tuple[str, ...] = ()):
        self.app, self.allow = app, set(allow_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = Headers(scope=scope).get("origin") if scope["type"] in GUARDED else None
        if origin is None or "*" in self.allow or origin in self.allow:
            await self.app(scope, receive, send)
            return
        error = ApiError(f"cross-origin requests from {origin!r} are refused: start the server with "
                         f"--allow-origin {origin} to allow them", "Origin", status=403, code="origin_not_allowed")
        await refuse(scope, receive, send, error)


class ApiKeyCheck:
    """`Authorization: Bearer KEY`, as OpenAI clients send their api_key; 401 without it (GET /health is open)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in GUARDED or (scope.get("method"), scope["path"]) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode()
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = ApiError("missing or wrong API key: send 'Authorization: Bearer KEY' with the server's --api-key",
                         "Authorization", status=401, code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await refuse(scope, receive, send, error)


def guards(allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS, allow_origins: tuple[str, ...] = (),
           api_key: str | None = None) -> list[Middleware]:
    """The middleware every request passes, outermost first: errors, Host (DNS rebinding), Origin, CORS, key."""
    stack = [Middleware(ServerErrors),
             Middleware(Refusals, TrustedHostMiddleware, "Host", allowed_hosts=list(allowed_hosts),
                        www_redirect=False),
             Middleware(OriginCheck, tuple(allow_origins))]
    if allow_origins:
        stack.append(Middleware(Refusals, CORSMiddleware, "Origin", allow_origins=list(allow_origins),
                                allow_methods=["GET", "POST", "DELETE"],
                                allow_headers=["authorization", "content-type"]))
    if api_key is not None:
        stack.append(Middleware(ApiKeyCheck, api_key))
    return stack
