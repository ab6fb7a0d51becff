"""The server's ASGI middleware: what every request passes before a handler, and the last-resort error answer.

`ServerErrors` turns an exception no handler caught into an OpenAI-style 500 and does not re-raise it, so the
keep-alive connection carries the next request (Starlette's own handler for `Exception` sends its answer and
then re-raises, and uvicorn drops the socket without `Connection: close`).
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .speech_api import ApiError

log = logging.getLogger("uvicorn.error")


def error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **(headers or {})})


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
        except Exception as e:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            error = ApiError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
            await error_response(error)(scope, receive, send)
