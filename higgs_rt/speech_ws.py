"""The speech WebSocket, `/v1/audio/speech/stream`: one incremental text session (`higgs_rt.session`) per
connection, for a voice assistant whose reply arrives token by token. The README documents the protocol.

In, JSON text messages with a `type`: "open" (first and once: the session's settings, the speech request's
fields checked by `speech_api.parse_session`), "text" (a piece, any length from empty up to --max-input-chars),
"flush", "cancel" (barge-in: no audio of what was fed before follows; the connection stays open), "close"
(speak what is left, then close). Out: "opened"; per utterance "start", its audio as binary frames (16-bit
little-endian PCM, mono, at "opened"'s sample_rate) and "end" with its stats; "cancelled"; "error" with the HTTP
API's error object; "closed" before a normal close.

What a message says that cannot be done (a piece too long or not Unicode, more text than the session may hold
unspoken, text the model cannot speak) gets an error event and the connection goes on; so does a failed
utterance, which ends its session (the next text starts a new one, with the same settings, as after a cancel).
A message that is not one of the protocol's (not JSON, not an object, an unknown or missing type, anything
before a valid open, a bad open) gets an error event and then the close (`Fatal`): 1008, or 1003 for binary,
1009 over the size limit. A connection with nothing to speak and no message for `idle_timeout_s` is closed
(1008). The server bounds how many connections are open (`SpeechServer`), uvicorn the size of a message, the
session the text and audio it holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

from .batch import BatchEngine, QueueFull
from .http_guards import CLOSE_POLICY, close_reason
from .pcm import pcm16_bytes
from .prompt import PromptError
from .speech_api import (ApiError, SpeechRequest, checked_piece, engine_error, in_api_terms, parse_json,
                         parse_session)
from .session import SessionClosed, SessionFull
from .types import BufferFull, StreamStats

log = logging.getLogger("uvicorn.error")

PATH = "/v1/audio/speech/stream"
CLOSE_NORMAL, CLOSE_BINARY, CLOSE_TOO_BIG, CLOSE_ERROR = 1000, 1003, 1009, 1011  # and CLOSE_POLICY, 1008
CLOSE_RESTART = 1012  # uvicorn closes every WebSocket with it when the server shuts down
MESSAGES = ("open", "text", "flush", "cancel", "close")
FIELDS = {"text": {"type", "text"}, "flush": {"type"}, "cancel": {"type"}, "close": {"type"}}
IDLE_TIMEOUT_S = 300.0
MAX_CONNECTIONS = 32
MESSAGE_CHARS_PER_TEXT_CHAR = 16  # a message other than open: JSON of a piece, escapes and all
MAX_UNSENT_SESSIONS = 8  # sessions (cancelled or failed ones) whose events wait for the writer: a client that
# cancels and feeds again without reading what comes is closed, rather than piling them up


class Fatal(Exception):
    """A protocol error: the error event, then the connection closes with `code`."""

    def __init__(self, error: ApiError, code: int = CLOSE_POLICY):
        super().__init__(error.message)
        self.error, self.code = error, code


@dataclass
class Settings:
    """What an open message set up, for every session of the connection."""

    request: SpeechRequest
    voice: object  # a Voice, or None for the model's own


def read_message(message: dict, opened: bool, max_input_chars: int) -> dict:
    """An ASGI websocket.receive message -> its JSON object, whose `type` is known; `Fatal` otherwise."""
    if message.get("text") is None:
        raise Fatal(ApiError("binary messages are not accepted: send JSON text messages (the audio goes the other "
                             "way)", code="unsupported_data"), CLOSE_BINARY)
    text = message["text"]
    limit = MESSAGE_CHARS_PER_TEXT_CHAR * max_input_chars
    if opened and len(text) > limit:
        raise Fatal(ApiError(f"the message is {len(text)} characters long: at most {limit} are accepted",
                             code="message_too_large"), CLOSE_TOO_BIG)
    try:
        body = parse_json(text, "the message")
    except ApiError as e:
        raise Fatal(e) from None
    if not isinstance(body, dict):
        raise Fatal(ApiError("a message must be a JSON object with a 'type'", code="invalid_json"))
    kind = body.get("type")
    if kind not in MESSAGES:  # `in` compares: an unhashable type is just unknown
        shown = json.dumps(kind)[:40] if isinstance(kind, (str, int, float, bool)) or kind is None else "an object"
        raise Fatal(ApiError(f"unknown message type {shown}: one of {', '.join(MESSAGES)}", "type",
                             code="unknown_message_type"))
    if opened == (kind == "open"):
        why = "the session is open already" if opened else "the first message must be an 'open'"
        raise Fatal(ApiError(f"'{kind}' here is out of order: {why}", "type", code="unexpected_message"))
    return body


def check_fields(body: dict) -> None:
    """A text, flush, cancel or close message holds only its own fields (an ApiError otherwise)."""
    for name in body:
        if name not in FIELDS[body["type"]]:
            raise ApiError(f"unknown field '{name}' in a '{body['type']}' message", name, code="unknown_parameter")


def event(kind: str, **fields) -> str:
    return json.dumps({"type": kind, **fields}, allow_nan=False)


def error_event(e: ApiError) -> str:
    return event("error", **e.body())


def stats_fields(s: StreamStats) -> dict:
    """A StreamStats as JSON: rtf is null without audio (it is infinite)."""
    return {"frames": s.frames, "audio_s": s.audio_s, "synthesis_s": s.synthesis_s, "first_audio_s": s.first_audio_s,
            "rtf": s.rtf if s.audio_s else None, "utterances": s.utterances, "truncated": s.truncated,
            "prompt_tokens": s.prompt_tokens}


def session_error(error: BaseException | None, message: str | None) -> ApiError:
    """A session's failure in the API's terms."""
    text = in_api_terms(error if error is not None else (message or "the session failed"))
    if isinstance(error, QueueFull):
        return ApiError(text, status=429, code="queue_full", kind="rate_limit_error")
    if isinstance(error, BufferFull):
        return ApiError(text, code="buffer_full")
    if isinstance(error, (PromptError, ValueError)):
        return ApiError(text, "text")
    return ApiError(f"the utterance failed: {text}", status=500, kind="server_error")


class SpeechSocket:
    """One accepted connection: `run()` reads the client's messages here and sends the sessions' events from a
    writer task, one session after another; either side ending ends both and cancels what is being spoken."""

    def __init__(self, ws: WebSocket, engine: BatchEngine, model_id: str, voice_for: Callable[[SpeechRequest],
                 Awaitable[object]], *, max_input_chars: int, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.ws, self.engine, self.model_id, self.voice_for = ws, engine, model_id, voice_for
        self.max_input_chars, self.idle_timeout_s = max_input_chars, idle_timeout_s
        self.settings: Settings | None = None
        self.session = None  # the session taking text (higgs_rt.session.Session)
        self.sessions: asyncio.Queue = asyncio.Queue()  # for the writer, in order; None: the connection closes
        self.closing = False  # a close message came
        self.utterances = 0  # started on this connection (numbering across its sessions)
        self.ended: dict[object, int] = {}  # session not yet over -> its utterances that ended

    async def run(self) -> bool:
        """Serve the connection until it closes; True if the server's shutdown cut it while it was speaking."""
        await self.ws.accept()
        writer = asyncio.ensure_future(self._write())
        try:
            return await self._read() == CLOSE_RESTART and self._busy()
        except Fatal as e:
            await self._send(error_event(e.error))
            await self._close(e.code, e.error.message)
        except Exception as e:  # a bug: said in one line to the client, with its traceback in the log
            log.exception("WebSocket %s failed", PATH)
            await self._send(error_event(ApiError(f"internal error: {type(e).__name__}: {e}", status=500,
                                                  kind="server_error")))
            await self._close(CLOSE_ERROR, "internal error")
        finally:
            if self.session is not None:
                self.session.cancel()  # frees the slot before the next step
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        return False

    # ---- messages in -------------------------------------------------------------------------------------
    async def _read(self) -> int:
        """Handle messages until the client goes; returns the close code."""
        while True:
            try:
                message = await asyncio.wait_for(self.ws.receive(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                if self._busy():
                    continue
                raise Fatal(ApiError(f"nothing was sent or spoken for {self.idle_timeout_s:g} s: the connection "
                                     "is closed", status=408, code="idle_timeout")) from None
            if message["type"] == "websocket.disconnect":
                return message.get("code", CLOSE_NORMAL)
            body = read_message(message, self.settings is not None, self.max_input_chars)
            try:
                await self._handle(body)
            except ApiError as e:
                if body["type"] == "open":
                    raise Fatal(e) from None
                await self._send(error_event(e))

    async def _handle(self, body: dict) -> None:
        kind = body["type"]
        if kind == "open":
            await self._open(body)
            return
        check_fields(body)
        if kind == "text":
            text = body.get("text")
            if not isinstance(text, str):
                raise ApiError("'text' must be a string", "text", code="invalid_type")
            text = checked_piece(text, "text", self.max_input_chars)
            self._to_session(lambda session: session.feed(text))
        elif kind == "flush":
            self._to_session(lambda session: session.flush())
        elif kind == "cancel":
            if self.session is not None:
                self.session.cancel()
                self.session = None
        elif not self.closing:  # close
            self.closing = True
            try:
                if self.session is not None:
                    self.session.close()
            except PromptError as e:  # the last segment cannot be spoken: dropped, the rest is spoken
                raise ApiError(str(e), "text") from None
            finally:
                self.sessions.put_nowait(None)

    async def _open(self, body: dict) -> None:
        req = parse_session({k: v for k, v in body.items() if k != "type"}, self.max_input_chars,
                            self.engine.benchmark)
        self.settings = Settings(req, await self.voice_for(req))
        session = self._live_session()
        await self._send(event("opened", model=self.model_id, sample_rate=self.engine.sample_rate, channels=1,
                               format="pcm_s16le", max_chars=session.max_chars))

    def _to_session(self, call) -> None:
        """Feed or flush the live session; one that ended on its own meanwhile (SessionClosed) is replaced."""
        try:
            try:
                call(self._live_session())
            except SessionClosed:
                self.session = None
                call(self._live_session())
        except SessionFull as e:
            raise ApiError(str(e), "text", status=413, code="text_buffer_full") from None
        except PromptError as e:  # the segment it completed cannot be spoken: dropped, the session goes on
            raise ApiError(str(e), "text") from None

    def _live_session(self):
        """The session taking text: a new one after a cancel or a failure (the same settings)."""
        if self.closing:
            raise ApiError("the connection is closing: no more text is taken", "type", code="session_closed")
        if self.session is None or self.session.closed or self.session.error is not None:
            if self.sessions.qsize() >= MAX_UNSENT_SESSIONS:
                raise Fatal(ApiError(f"{MAX_UNSENT_SESSIONS} sessions are waiting for their events to be read: "
                                     "read the events as they come", code="buffer_full"))
            req = self.settings.request
            try:
                self.session = self.engine.session(self.settings.voice, max_chars=req.max_chars,
                                                   max_buffered_chars=self.max_input_chars, int16=True, **req.params)
            except (ValueError, TypeError) as e:  # a parameter's or the transcript's fault: no text is fed yet
                raise engine_error(e, req, None) from None
            self.ended[self.session] = 0
            self.sessions.put_nowait(self.session)
        return self.session

    def _busy(self) -> bool:
        """Something is being spoken or waits to be: the connection is not idle."""
        s = self.session
        return s in self.ended and len(s.segments) > self.ended[s]

    # ---- events out --------------------------------------------------------------------------------------
    async def _write(self) -> None:
        """The sessions' events in order; after a close message, "closed" and the close once all is spoken."""
        try:
            await self._write_sessions()
        except Exception as e:  # a bug: as in `run`
            log.exception("WebSocket %s failed", PATH)
            await self._send(error_event(ApiError(f"internal error: {type(e).__name__}: {e}", status=500,
                                                  kind="server_error")))
            await self._close(CLOSE_ERROR, "internal error")

    async def _write_sessions(self) -> None:
        while (session := await self.sessions.get()) is not None:
            base = self.utterances
            async for e in session:
                if e.kind == "audio":
                    await self._send(pcm16_bytes(e.pcm))  # int16 already, from the codec thread
                elif e.kind == "start":
                    self.utterances = base + e.utterance + 1
                    await self._send(event("start", utterance=base + e.utterance, text=e.text))
                elif e.kind == "end":
                    self.ended[session] += 1
                    await self._send(event("end", utterance=base + e.utterance, stats=stats_fields(e.stats)))
                elif e.kind == "error":
                    await self._send(error_event(session_error(session.error, e.error)))
                elif e.kind == "closed" and e.cancelled:
                    await self._send(event("cancelled"))
            self.ended.pop(session, None)
        await self._send(event("closed"))
        await self._close(CLOSE_NORMAL)

    async def _send(self, data: str | bytes) -> bool:
        """Send one message; False once the connection is gone (its reader will see the disconnect)."""
        try:
            if isinstance(data, bytes):
                await self.ws.send_bytes(data)
            else:
                await self.ws.send_text(data)
            return True
        except GONE:
            return False

    async def _close(self, code: int, reason: str = "") -> None:
        try:
            await self.ws.close(code, close_reason(reason))
        except GONE:
            pass


# what sending raises once the client is gone (uvicorn's ClientDisconnected is an OSError) or the close was sent
GONE = (OSError, RuntimeError, WebSocketDisconnect)
