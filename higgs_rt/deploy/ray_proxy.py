"""Runs in Ray Serve's HTTP proxy (not in a replica): an SSE stream whose replica died ends with an error event.

Serve loads `proxy_middlewares` when its proxy starts with RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH set to
`higgs_rt.deploy.ray_proxy:proxy_middlewares` (`higgs-rt ray-serve` sets it for the Ray it starts). When a
replica goes away mid-response, the proxy's app returns without the response's last body message: an SSE
client then gets an OpenAI-style error event and a properly ended stream; an audio stream is left cut (its
chunked body ends without the last chunk, which HTTP clients report), since no bytes could say "error" inside
audio. A client that went away, or a response that ended, is left alone. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware

IMPORT_PATH = "higgs_rt.deploy.ray_proxy:proxy_middlewares"
LOST = {"type": "error", "error": {"message": "the replica generating this stream stopped; the audio so far is "
                                              "incomplete: send the request again", "type": "server_error",
                                   "param": None, "code": "replica_lost"}}  # an ApiError body, as the server's


def proxy_middlewares() -> list:
    return [Middleware(CutSseStreams)]


class CutSseStreams:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sse = ended = False

        async def watched(message) -> None:
            nonlocal sse, ended
            if message["type"] == "http.response.start":
                sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                          for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        await self.app(scope, receive, watched)  # a cancellation (the client went away) passes through
        if sse and not ended:
            await send({"type": "http.response.body", "body": f"data: {json.dumps(LOST)}\n\n".encode(),
                        "more_body": False})
