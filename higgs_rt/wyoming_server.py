"""`higgs-rt wyoming`: a Wyoming text-to-speech server (the protocol Home Assistant and the local-assistant
projects speak to piper and the other local engines), on the `wyoming` package.

Events answered (one connection may send any number of requests, one after another):
    describe                                  -> info: the model as one TTS program, its voices (the model's own
                                                 voice, `default`, and every stored voice), streaming supported
    synthesize {text, voice?}                 -> audio-start, audio-chunk..., audio-stop (24 kHz, 16-bit, mono)
    synthesize-start, -chunk..., -stop        -> audio-start, audio-chunk..., audio-stop, synthesize-stopped: each
                                                 clause is spoken as soon as its chunks have come (an incremental
                                                 text session, `higgs_rt.session`), not at synthesize-stop; the
                                                 `synthesize` a streaming client sends beside them (for older
                                                 servers) is not spoken twice
Bad input (empty or too long text, an unknown voice, text the model cannot read, a field of the wrong type, a
stored voice whose transcript leaves the text no room in the context: `bad_voice`) gets one `error` event naming the
problem, before any audio, and the connection stays usable. An event that cannot be read (a header
that is not a JSON object with a string `type`, data that is not a JSON object, a length field that is not an
integer within its bound: MAX_HEADER_BYTES, MAX_DATA_BYTES, MAX_PAYLOAD_BYTES) gets one `bad_event` error, and
the connection is closed: the byte stream cannot be trusted past it.

A streamed request's clauses are utterances of one session, so the voice carries across them as it does for long
text (the audio equals `tts.stream(session's segments)`). The engine has one slot: a plain synthesis and each
utterance of a streamed one take it in turn, so a streamed request waiting for its next chunk holds nothing.
Audio chunks go out as they are decoded; a client that disconnects stops its synthesis within a frame. Bounds:
--max-connections at once (more get an error and are closed as they connect), --max-input-chars per request (a
streamed request past it is cancelled), --idle-timeout (a connection that sends no whole event while nothing is
spoken to it, or reads nothing while audio waits for it, is closed), and the session's bound on audio the client
has not read. Wyoming has no authentication: the server binds to loopback unless --no-auth is given with another
address.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from urllib.parse import urlparse

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.server import AsyncEventHandler, AsyncServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from . import __version__
from .audio_in import TranscriptError
from .params import ParamError
from .pcm import pcm16_bytes
from .prompt import PromptError, check_text
from .session import Session, SessionFull, error_line
from .voices import VoiceError

log = logging.getLogger("higgs_rt.wyoming")

DEFAULT_URI = "tcp://127.0.0.1:10200"
MAX_HEADER_BYTES = 1 << 16  # an event's JSON header line (also asyncio's default stream limit)
MAX_DATA_BYTES = 1 << 20  # its data: a synthesize holds at most --max-input-chars characters of text
MAX_PAYLOAD_BYTES = 1 << 20  # its binary payload: a TTS server takes none (read and dropped)
LINGER_S, LINGER_BYTES = 2.0, 1 << 20  # input dropped after the server's last event, before it closes
MAX_LINGERING = 64  # connections doing so at once (more, as in a flood of refused ones, close at once)
IDLE_TIMEOUT_S = 300.0
DEFAULT_VOICE = "default"  # the model's own voice
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WIDTH, CHANNELS = 2, 1
_DONE, _STARTED = object(), object()


def refusal_code(error: Exception, voice) -> str:
    """The error code of the engine's refusal of a request, raised as its stream or session is made (before any
    audio): `bad_voice` where the stored voice is to blame (its transcript, or its recording beside the server's
    --max-frames, leaves the text no room in the context: another voice works, or this one added again with a
    shorter transcript), `bad_text` for text that cannot be spoken (too long for the context), else
    `synthesis_failed`."""
    if voice is not None and isinstance(error, (TranscriptError, ParamError)):
        return "bad_voice"
    if isinstance(error, PromptError):
        return "bad_text"
    return "synthesis_failed"


class WyomingError(Exception):
    """An address that cannot be bound; one line."""


class BadEvent(Exception):
    """An event that cannot be read, or a field of the wrong type; one line."""

    code = "bad_event"


class Idle(Exception):
    """No whole event came for the idle timeout while nothing was spoken; one line."""

    code = "idle_timeout"


async def read_event(reader: asyncio.StreamReader) -> Event | None:
    """The next event, every length bounded (the `wyoming` package's reader trusts the client's lengths);
    None once the client has gone, BadEvent for an event that cannot be read."""
    try:
        line = await reader.readline()
    except ValueError:  # past the reader's own limit (asyncio's default: MAX_HEADER_BYTES)
        line = None
    if line is None or len(line) > MAX_HEADER_BYTES:
        raise BadEvent(f"an event header is longer than {MAX_HEADER_BYTES} bytes")
    if not line.endswith(b"\n"):
        return None  # the end of the stream, or the client left mid-line
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        raise BadEvent("an event header is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise BadEvent("an event header must be a JSON object with a string 'type'")
    data = header.get("data")
    if not isinstance(data, (dict, type(None))):
        raise BadEvent("an event's 'data' must be a JSON object")
    data = dict(data or {})
    lengths = {}
    for key, limit in (("data_length", MAX_DATA_BYTES), ("payload_length", MAX_PAYLOAD_BYTES)):
        n = header.get(key)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= limit):
            raise BadEvent(f"an event's '{key}' must be an integer in [0, {limit}]")
        lengths[key] = n or 0
    try:
        extra = await reader.readexactly(lengths["data_length"]) if lengths["data_length"] else None
        payload = await reader.readexactly(lengths["payload_length"]) if lengths["payload_length"] else None
    except asyncio.IncompleteReadError:
        return None
    if extra is not None:
        try:
            more = json.loads(extra)
        except (ValueError, RecursionError):
            raise BadEvent("an event's data is not JSON") from None
        if not isinstance(more, dict):
            raise BadEvent("an event's data must be a JSON object")
        data.update(more)
    return Event(type=header["type"], data=data, payload=payload)


def text_field(event: Event) -> str:
    """A synthesize or synthesize-chunk event's text."""
    text = event.data.get("text")
    if not isinstance(text, str):
        raise BadEvent(f"{event.type}: 'text' must be a string")
    return text


def voice_field(event: Event) -> str | None:
    """The voice name a synthesize or synthesize-start event asks for (None: the model's own voice); Wyoming's
    voice is an object whose optional `name` is a string (a language alone asks for no particular voice)."""
    voice = event.data.get("voice")
    if voice is None:
        return None
    if not isinstance(voice, dict) or not isinstance(voice.get("name"), (str, type(None))):
        raise BadEvent(f"{event.type}: 'voice' must be an object whose 'name' is a string")
    return voice.get("name")


def check_uri(uri: str, no_auth: bool) -> tuple[str, int]:
    """--uri as (host, port): tcp:// only, loopback unless no_auth; a ValueError (usage) otherwise."""
    parsed = urlparse(uri)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or port is None:
        raise ValueError(f"--uri must be tcp://HOST:PORT, got {uri!r}")
    if parsed.hostname not in LOOPBACK and not no_auth:
        raise ValueError(f"Wyoming has no authentication: serving on {parsed.hostname} needs --no-auth "
                           "(anyone who reaches the port can synthesize)")
    return parsed.hostname, port


@dataclass
class Service:
    """What every connection shares: the engine, its settings and the bounds."""

    tts: object  # higgs_rt.TTS
    model_name: str
    params: dict = field(default_factory=dict)  # synthesis settings for every request (the CLI's)
    max_input_chars: int = 4096
    max_connections: int = 8
    idle_timeout_s: float = IDLE_TIMEOUT_S
    connections: int = 0
    lingering: int = 0

    def info(self) -> Info:
        attribution = Attribution(name="Boson AI", url="https://github.com/boson-ai/higgs-audio")
        voices = [TtsVoice(name=name, description=what, attribution=attribution, installed=True, version=None,
                           languages=["en"])
                  for name, what in [(DEFAULT_VOICE, f"{self.model_name}'s own voice")]
                  + [(name, "a cloned voice (higgs-rt voice add)") for name in self.tts.voices()]]
        program = TtsProgram(name="higgs-rt", description=f"Higgs-Audio v2 ({self.model_name}) on higgs-rt",
                             attribution=attribution, installed=True, version=__version__, voices=voices,
                             supports_synthesize_streaming=True)
        return Info(tts=[program])

    def check(self, text: str, voice: str | None):
        """The request's text and voice, or a ValueError/VoiceError in one line."""
        if len(text) > self.max_input_chars:
            raise ValueError(f"the text has {len(text)} characters; at most {self.max_input_chars}")
        return check_text(text), self.voice(voice)

    def voice(self, name: str | None):
        return None if name in (None, "", DEFAULT_VOICE) else self.tts.resolve_voice(name)


class Handler(AsyncEventHandler):
    """One connection: requests in order, audio out as it is decoded."""

    def __init__(self, service: Service, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.service = service
        self.admitted = service.connections < service.max_connections
        if self.admitted:
            service.connections += 1
        self.streaming = False  # inside synthesize-start .. synthesize-stop (also one refused at its start)
        self.session: Session | None = None  # the streamed request's (None: refused, or over its bound)
        self.forwarding: asyncio.Task | None = None  # the session's events out, as Wyoming events
        self.streamed_chars = 0
        self.spoken = False  # the streamed request had text that was not only whitespace
        self.ended = 0  # its utterances spoken to the end (`busy`)

    async def run(self) -> None:
        """Events until the client goes, read with `next_event` (bounded in size and time); one that cannot be
        read, or none within the idle timeout, ends the connection after its error. A connection over
        --max-connections gets its error at once."""
        linger = False  # the server ends the connection: its last words must reach the client
        try:
            if not self.admitted:
                await self.error(f"too many connections (at most {self.service.max_connections})",
                                 "too_many_connections")
                linger = True
                return
            while True:
                try:
                    event = await self.next_event()
                except (BadEvent, Idle) as e:
                    await self.error(str(e), e.code)
                    linger = True
                    break
                if event is None:
                    break
                if not await self.handle_event(event):
                    linger = True
                    break
        except ConnectionError:
            pass
        except Exception as e:  # a bug: one line to the client, the traceback in the log
            log.exception("Wyoming connection failed")
            linger = True
            try:
                await self.error(f"internal error: {type(e).__name__}: {e}", "internal_error")
            except ConnectionError:
                pass
        finally:
            await self.disconnect()
            if linger:
                await self._linger()
            self.writer.close()

    async def next_event(self) -> Event | None:
        """`read_event` within the idle timeout: the whole event, not each byte (a half-sent header is idle);
        while the streamed request is being spoken the wait goes on."""
        timeout = self.service.idle_timeout_s
        reading = asyncio.ensure_future(read_event(self.reader))
        try:
            while not (await asyncio.wait({reading}, timeout=timeout))[0]:
                if not self.busy():
                    raise Idle(f"nothing was sent or spoken for {timeout:g} s: the connection is closed")
            return reading.result()
        finally:
            if not reading.done():
                reading.cancel()
                await asyncio.wait({reading})  # its read has let go of the reader (the linger reads next)

    def busy(self) -> bool:
        """The streamed request has text being spoken or waiting to be: the connection is not idle."""
        return (self.forwarding is not None and not self.forwarding.done()
                and len(self.session.segments) > self.ended)

    async def write_event(self, event: Event) -> None:
        """An event out; a client that reads nothing for the idle timeout while it waits is dropped (a
        ConnectionError, as if it had left)."""
        try:
            await asyncio.wait_for(super().write_event(event), self.service.idle_timeout_s)
        except asyncio.TimeoutError:
            self.writer.transport.abort()
            raise ConnectionResetError("the client read nothing for the idle timeout") from None

    async def _linger(self) -> None:
        """Stop writing, then drop what the client still sends (at most LINGER_BYTES, for LINGER_S) before the
        close: closing with its bytes unread would reset the connection, which can discard the error sent last."""
        if self.service.lingering >= MAX_LINGERING:
            return
        self.service.lingering += 1
        try:
            if self.writer.can_write_eof():
                self.writer.write_eof()
            await asyncio.wait_for(self._drop_input(), LINGER_S)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self.service.lingering -= 1

    async def _drop_input(self) -> None:
        dropped = 0
        while dropped < LINGER_BYTES and (data := await self.reader.read(1 << 16)):
            dropped += len(data)

    async def handle_event(self, event: Event) -> bool:
        try:
            return await self._handle(event)
        except BadEvent as e:  # a field of the wrong type: that request is refused, the connection goes on
            await self.error(str(e), "bad_event")
            return True
        except ConnectionError:  # the client left mid-answer: its synthesis has stopped (see synthesize)
            return False

    async def _handle(self, event: Event) -> bool:
        if Describe.is_type(event.type):
            await self.write_event(self.service.info().event())
        elif SynthesizeStart.is_type(event.type):
            await self.start_stream(event)
        elif SynthesizeChunk.is_type(event.type):
            if not self.streaming:
                await self.error("synthesize-chunk outside synthesize-start .. synthesize-stop", "bad_sequence")
            else:
                await self.feed(text_field(event))
        elif SynthesizeStop.is_type(event.type):
            if not self.streaming:
                await self.error("synthesize-stop without synthesize-start", "bad_sequence")
            else:
                await self.stop_stream()
        elif Synthesize.is_type(event.type):
            if not self.streaming:  # inside a streamed request it repeats the chunks' text for old servers
                await self.synthesize(text_field(event), voice_field(event))
        return True  # other events are dropped, as the protocol asks

    async def disconnect(self) -> None:
        session, forwarding = self.session, self.forwarding
        self.session = self.forwarding = None
        if session is not None:
            session.cancel()  # the client left (or was dropped): the utterance stops within a frame
            forwarding.cancel()  # nothing more goes out, and the task ends now: left pending, it would be collected
            await asyncio.wait({forwarding})  # with the session (whose thread holds it only weakly)
        if self.admitted:
            self.admitted = False
            self.service.connections -= 1

    async def error(self, text: str, code: str) -> None:
        await self.write_event(Error(text, code).event())

    # ---- streamed requests: one incremental text session each ---------------------------------------------
    async def start_stream(self, event: Event) -> None:
        """A streamed request begins even when its voice is refused (unknown, or of the wrong type: BadEvent):
        one error, then its chunks are dropped and its stop answered."""
        if self.streaming:  # a new request before the last one's stop: the last one is dropped
            await self.end_session(cancel=True)
        self.streaming, self.streamed_chars, self.spoken, self.ended = True, 0, False, 0
        service = self.service
        try:
            voice = service.voice(voice_field(event))
        except VoiceError as e:
            return await self.error(str(e), "unknown_voice")
        try:  # up to --max-input-chars of it may wait unspoken (the session's own default bound is lower)
            self.session = service.tts.session(voice, max_buffered_chars=service.max_input_chars, **service.params)
        except (PromptError, ValueError) as e:  # refused as it is made: its chunks are dropped, its stop answered
            return await self.error(error_line(e), refusal_code(e, voice))
        self.forwarding = asyncio.create_task(self.forward(self.session))

    async def feed(self, text: str) -> None:
        if self.session is None:  # refused at its start, or past its bound: the rest of its text is dropped
            return
        self.streamed_chars += len(text)
        self.spoken = self.spoken or bool(text.strip())
        limit = self.service.max_input_chars
        try:
            if self.streamed_chars > limit:
                raise SessionFull
            self.session.feed(text)
        except SessionFull:  # the session holds at most what the request may have: the same bound
            await self.end_session(cancel=True)
            await self.error(f"the streamed text has more than {limit} characters (the server's --max-input-chars): "
                             "the request was cancelled", "bad_text")
        except PromptError as e:  # that clause is dropped; the request goes on
            await self.error(str(e), "bad_text")

    async def stop_stream(self) -> None:
        self.streaming = False
        if self.session is not None and not self.spoken:
            await self.end_session(cancel=True)
            await self.error("text is empty", "bad_text")
        elif self.session is not None:
            try:
                self.session.close()  # the last clause is cut now
            except PromptError as e:  # it is dropped; the session is closed all the same
                await self.error(str(e), "bad_text")
            await self.end_session(cancel=False)
        await self.write_event(SynthesizeStopped().event())

    async def end_session(self, cancel: bool) -> None:
        """Close (or cancel) the streamed request's session and wait until its last event has gone out."""
        session, forwarding = self.session, self.forwarding
        self.session = self.forwarding = None
        if session is not None:
            session.cancel() if cancel else session.close()
            await forwarding

    async def forward(self, session: Session) -> None:
        """The session's events as Wyoming events: audio-start before the first chunk, audio-stop after the
        last."""
        rate, started = self.service.tts.sample_rate, False
        try:
            async for event in session:
                if event.kind == "audio":
                    if not started:
                        await self.write_event(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS).event())
                        started = True
                    audio = pcm16_bytes(event.pcm)
                    await self.write_event(AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS, audio=audio).event())
                elif event.kind == "end":
                    self.ended += 1
                elif event.kind == "error":
                    await self.error(event.error, "synthesis_failed")
                elif event.kind == "closed" and started:
                    await self.write_event(AudioStop().event())
        except ConnectionError:
            session.cancel()

    # ---- plain requests --------------------------------------------------------------------------------------
    async def synthesize(self, text: str, voice_name: str | None) -> None:
        service = self.service
        try:
            text, voice = service.check(text, voice_name)
        except VoiceError as e:
            return await self.error(str(e), "unknown_voice")
        except (PromptError, ValueError) as e:
            return await self.error(str(e), "bad_text")
        loop, chunks = asyncio.get_running_loop(), asyncio.Queue()
        gone = threading.Event()

        def run() -> None:  # on a worker thread: the stream (_STARTED once made), chunk by chunk, into the loop
            try:
                stream = service.tts.stream(text, voice=voice, abort=gone.is_set, wait=True, **service.params)
                loop.call_soon_threadsafe(chunks.put_nowait, _STARTED)
                for pcm in stream:
                    loop.call_soon_threadsafe(chunks.put_nowait, pcm16_bytes(pcm))
            except Exception as e:  # noqa: BLE001 - reported to the client as one error event
                loop.call_soon_threadsafe(chunks.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(chunks.put_nowait, _DONE)

        rate = service.tts.sample_rate
        worker = loop.run_in_executor(None, run)
        try:
            if isinstance(refused := await chunks.get(), Exception):  # as the stream was made: no audio
                return await self.error(error_line(refused), refusal_code(refused, voice))
            await self.write_event(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS).event())
            while (item := await chunks.get()) is not _DONE:
                if isinstance(item, Exception):
                    await self.error(error_line(item), "synthesis_failed")
                    continue
                await self.write_event(AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS, audio=item).event())
            await self.write_event(AudioStop().event())
        finally:
            gone.set()  # the client left (or the request ended): the stream stops within a frame
            await worker


async def serve(service: Service, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled."""
    server = AsyncServer.from_uri(f"tcp://{host}:{port}")
    await server.start(lambda reader, writer: Handler(service, reader, writer))
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def check_port(host: str, port: int) -> None:
    """Fail now, before the model loads, if the address cannot be bound (in use, not ours)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as e:
        raise WyomingError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_command(args, load) -> int:
    """`higgs-rt wyoming`: check --uri and the port, load the model (`load()`), serve until Ctrl-C or SIGTERM."""
    import signal

    from .params import cli_params

    host, port = check_uri(args.uri, args.no_auth)
    params = cli_params(args)
    for name, value, low in (("--max-connections", args.max_connections, 1),
                             ("--max-input-chars", args.max_input_chars, 1)):
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")
    if not (math.isfinite(args.idle_timeout) and args.idle_timeout > 0):
        raise ValueError(f"--idle-timeout must be a positive number of seconds, got {args.idle_timeout:g}")
    check_port(host, port)
    tts = load()

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        service = Service(tts, args.model_name, params, args.max_input_chars, args.max_connections,
                          args.idle_timeout)
        try:
            await serve(service, host, port)
        except OSError as e:
            raise WyomingError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    return 0
