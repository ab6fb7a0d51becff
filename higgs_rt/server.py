"""`higgs-rt serve`: the OpenAI-compatible speech server, a starlette app on uvicorn over one `BatchEngine`.

Endpoints: POST /v1/audio/speech, GET /v1/models, GET /health, GET /metrics (Prometheus text), the voice
store: POST /v1/audio/voices (multipart), GET /v1/audio/voices, DELETE /v1/audio/voices/{name}, and the
WebSocket /v1/audio/speech/stream (text in pieces, audio out: `higgs_rt.speech_ws`), at most
`max_ws_connections` at once (more are refused with 429 before the handshake completes).
Model work never runs on the event loop: prompting and voice encoding go to worker threads, generation to the
batch engine's decode thread, whose PCM the handlers await. A client that disconnects cancels its job, which
frees its slot before the next step. Errors are OpenAI-style JSON bodies that name the offending field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import AsyncIterator

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from .audio_in import ReferenceAudioError, TranscriptError
from .batch import FIRST_AUDIO_STAGES, LOOP_PHASES, BatchEngine, Job, QueueFull
from .engine import TTS
from .http_guards import LOOPBACK_HOSTS, error_response, guards, refuse
from .metrics import LATENCY_BUCKETS, QUEUE_DEPTH, RTF_BUCKETS, Histogram, labelled, memory_samples, sample
from .params import MAX_BODY_BYTES
from .pcm import not_empty, pcm16_bytes, wav_header, wav_header_streaming
from .prompt import PromptError
from .speech_api import (DEFAULT_VOICE, FORMATS, MAX_INPUT_CHARS, OPENAI_VOICES, ApiError, SpeechRequest,
                         checked_text, engine_error, parse_json, parse_speech)
from .speech_ws import IDLE_TIMEOUT_S, MAX_CONNECTIONS, PATH as WS_PATH, SpeechSocket
from .voices import REF_CACHE_BYTES, VoiceError, check_name

MAX_UPLOAD_BYTES = 10 << 20  # a voice sample, as OpenAI's limit
VOICE_FORM_FIELDS = ("audio_sample", "name", "consent", "ref_text")  # an upload's multipart form, nothing else
MAX_VOICES = 100  # stored voices the upload endpoint fills the store up to (up to ~3 MB each: a 30 s reference)
BODY_TIMEOUT_S = 30.0  # to receive a whole request body: a slow client does not hold its connection longer
MAX_ENCODES = 4  # reference recordings being encoded (one at a time) or waiting to be, per server
DRAIN_BYTES = 64 << 20  # an oversized body is read and dropped up to this, so the client sees the 413
RETRY_AFTER_S = 1  # a 429's hint: slots free as utterances end, typically within a second
LOOP_PROBE_S = 0.02  # the event loop's lag is sampled by a timer due this often
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)  # uvloop's timers: 1 ms resolution


class SpeechServer:
    def __init__(self, tts: TTS, engine: BatchEngine, model_id: str, *, max_body: int = MAX_BODY_BYTES,
                 max_upload: int = MAX_UPLOAD_BYTES, max_input_chars: int = MAX_INPUT_CHARS,
                 body_timeout_s: float = BODY_TIMEOUT_S, ref_cache_bytes: int = REF_CACHE_BYTES,
                 allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS, allow_origins: tuple[str, ...] = (),
                 api_key: str | None = None, max_ws_connections: int = MAX_CONNECTIONS,
                 ws_idle_timeout_s: float = IDLE_TIMEOUT_S, max_voices: int = MAX_VOICES):
        self.tts, self.engine, self.model_id = tts, engine, model_id
        self.max_voices = max_voices
        self.max_body, self.max_upload, self.max_input_chars = max_body, max_upload, max_input_chars
        self.body_timeout_s = body_timeout_s
        self.max_ws_connections, self.ws_idle_timeout_s = max_ws_connections, ws_idle_timeout_s
        self.ws_connections = 0  # open WebSocket sessions (counted on the event loop)
        self.ws_cut = 0  # sessions the server's shutdown closed while they were speaking
        self.access = dict(allowed_hosts=tuple(allowed_hosts), allow_origins=tuple(allow_origins), api_key=api_key)
        tts.voice_library.store.max_ref_bytes = ref_cache_bytes
        self.created = int(time.time())
        self._voice_lock = threading.Lock()  # one voice encode or store change at a time
        self._encodes = threading.BoundedSemaphore(MAX_ENCODES)  # running or waiting for the lock: more get 429
        self.first_audio = Histogram("higgs_rt_time_to_first_audio_seconds",
                                     "Request received to its first audio byte ready to send.", LATENCY_BUCKETS)
        self.rtf = Histogram("higgs_rt_real_time_factor",
                             "Per request: synthesis time / audio duration (below 1 is faster than real time).",
                             RTF_BUCKETS)
        self.loop_lag = Histogram("higgs_rt_event_loop_lag_seconds", "How late the event loop ran a timer (one due "
                                  f"every {LOOP_PROBE_S * 1e3:g} ms from the first request on): what every "
                                  "request's reads and writes wait for when the loop is busy.", LOOP_LAG_BUCKETS)
        self._probe: asyncio.Task | None = None
        # seconds of the requests' time to first audio by stage (FIRST_AUDIO_STAGES), and the requests counted
        self.first_audio_stage_s = dict.fromkeys((stage for stage, _ in FIRST_AUDIO_STAGES), 0.0)
        self.first_audio_staged = 0

    def app(self) -> Starlette:
        routes = [
            Route("/v1/audio/speech", self.speech, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/audio/voices", self.add_voice, methods=["POST"]),
            Route("/v1/audio/voices", self.list_voices, methods=["GET"]),
            Route("/v1/audio/voices/{name:path}", self.remove_voice, methods=["DELETE"]),
            WebSocketRoute(WS_PATH, self.speech_socket),
        ]
        handlers = {ApiError: _api_error, HTTPException: _http_error}
        app = Starlette(routes=routes, exception_handlers=handlers, middleware=guards(**self.access))
        app.router.redirect_slashes = False  # a trailing slash is a 404 (or a bad voice name), never a redirect
        return app

    # ---- speech -----------------------------------------------------------------------------------------
    async def speech(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self._watch_loop()
        _require_type(request, "application/json")
        req = parse_speech(parse_json(await self._body(request, self.max_body)), self.max_input_chars,
                           self.engine.benchmark)
        # the model's own voice needs no file: no thread hop (under load each hop waits for the GIL)
        voice = None if req.ref_audio is None and req.voice == DEFAULT_VOICE else \
            await run_in_threadpool(self._voice_for, req)
        try:
            job = self.engine.submit(req.input, voice=voice, int16=True, **req.params)  # checks and queues: no I/O
        except QueueFull as e:
            raise ApiError(str(e), status=429, code="queue_full", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (PromptError, ValueError, TypeError) as e:  # the text's, a parameter's or the transcript's fault
            raise engine_error(e, req, "input") from None
        audio = self._encoded(job, req, arrived)
        if req.stream_format == "sse":
            return JobResponse(job, self._sse(job, audio), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        media = FORMATS[req.response_format]
        if req.streamed:
            return JobResponse(job, audio, media_type=media)
        body = await _unless_disconnected(request, job, _join(audio))
        if req.response_format == "wav":
            body = wav_header(self.tts.sample_rate, len(body)) + body
        elif req.response_format == "flac":
            body = await run_in_threadpool(self._flac, body)
        return Response(body, media_type=media)

    async def _encoded(self, job: Job, req: SpeechRequest, arrived: float) -> AsyncIterator[bytes]:
        """The job's audio as bytes: 16-bit little-endian PCM, behind a streaming WAV header when streamed."""
        header = wav_header_streaming(self.tts.sample_rate) if req.streamed and req.response_format == "wav" else b""
        async for chunk in job.chunks():  # int16 already (converted on the codec thread)
            data = pcm16_bytes(chunk)
            if header is not None:
                now = time.perf_counter()
                self.first_audio.observe(now - arrived)
                for stage, seconds in job.first_audio_stages(arrived, now).items():
                    self.first_audio_stage_s[stage] += seconds
                self.first_audio_staged += 1
                data, header = header + data, None
            yield data
        if header:  # no audio at all: a streamed WAV is still a WAV
            yield header
        if job.stats.audio_s > 0 and not job.cancelled:
            self.rtf.observe(job.stats.rtf)

    async def _sse(self, job: Job, audio: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """OpenAI's speech stream events: speech.audio.delta (base64 audio), then speech.audio.done."""
        async for data in audio:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        frames = job.stats.frames
        yield _event({"type": "speech.audio.done",
                      "usage": {"input_tokens": job.prompt_tokens, "output_tokens": frames,
                                "total_tokens": job.prompt_tokens + frames}})

    def _flac(self, pcm: bytes) -> bytes:
        import soundfile

        out = io.BytesIO()
        samples = not_empty(np.frombuffer(pcm, "<i2"))  # no audio: still a FLAC
        soundfile.write(out, samples, self.tts.sample_rate, format="FLAC", subtype="PCM_16")
        return out.getvalue()

    def _voice_for(self, req: SpeechRequest):
        """The Voice a request speaks with: its reference, a stored voice by name, or None (the model's own voice)
        for 'default' and OpenAI's built-in names. A stored voice wins over a built-in name it shares."""
        if req.ref_audio is not None:
            return self._encode(req.ref_audio, "ref_audio", lambda path: self.tts.clone_voice(path, req.ref_text))
        if req.voice == DEFAULT_VOICE:
            return None
        if req.voice in self.tts.voices():
            try:
                return self.tts.resolve_voice(req.voice)
            except VoiceError as e:
                raise ApiError(str(e), "voice") from None
        if req.voice in OPENAI_VOICES:
            return None
        raise ApiError(f"unknown voice '{req.voice}': use '{DEFAULT_VOICE}', an OpenAI voice name (the model's own "
                       "voice) or a name from GET /v1/audio/voices", "voice", code="voice_not_found")

    def _encode(self, audio: bytes, param: str, encode):
        """Run a voice encode on the uploaded bytes (as a temporary file); bad audio is a 400 naming `param`.
        Encodes run one at a time: past MAX_ENCODES running or waiting, a request gets 429 at once (each holds its
        recording in memory and a worker thread while it waits)."""
        if not self._encodes.acquire(blocking=False):
            raise ApiError(f"{MAX_ENCODES} reference recordings are being encoded or wait to be: retry shortly, or "
                           "store the voice once (POST /v1/audio/voices) and speak with it by name", param,
                           status=429, code="busy_encoding", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            return self._encode_now(audio, param, encode)
        finally:
            self._encodes.release()

    def _encode_now(self, audio: bytes, param: str, encode):
        with tempfile.TemporaryDirectory(prefix="higgs-rt-upload-") as tmp:
            path = Path(tmp) / "reference"
            path.write_bytes(audio)
            try:
                return self._locked(encode, path)
            except TranscriptError as e:
                raise ApiError(str(e), "ref_text") from None
            except ReferenceAudioError as e:
                raise ApiError(str(e).replace(str(path), param), param) from None
            except PromptError as e:
                raise ApiError(str(e), "ref_text") from None
            except VoiceError as e:
                raise ApiError(str(e), "name") from None

    # ---- the WebSocket ----------------------------------------------------------------------------------
    async def speech_socket(self, ws: WebSocket) -> None:
        self._watch_loop()
        if self.ws_connections >= self.max_ws_connections:
            await refuse(ws.scope, ws.receive, ws.send, ApiError(
                f"{self.max_ws_connections} WebSocket connections are open: at most that many are served at once",
                status=429, code="too_many_connections", kind="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)}))
            return
        self.ws_connections += 1
        try:
            cut = await SpeechSocket(ws, self.engine, self.model_id, lambda req: run_in_threadpool(self._voice_for, req),
                                     max_input_chars=self.max_input_chars, idle_timeout_s=self.ws_idle_timeout_s).run()
            self.ws_cut += cut
        finally:
            self.ws_connections -= 1

    # ---- voices -----------------------------------------------------------------------------------------
    async def add_voice(self, request: Request) -> Response:
        """Multipart: audio_sample (file), name, consent, ref_text (the sample's transcript)."""
        _require_type(request, "multipart/form-data")
        body = await self._body(request, self.max_upload)
        form = await _form(request, body)
        for field in form:
            if field not in VOICE_FORM_FIELDS:
                raise ApiError(f"unknown field '{field}'", field, code="unknown_parameter")
        name, consent, text = (_form_text(form, body, f) for f in ("name", "consent", "ref_text"))
        sample = form.get("audio_sample")
        if isinstance(sample, str) or sample is None:
            raise ApiError("'audio_sample' must be an uploaded audio file (WAV or FLAC)", "audio_sample",
                           code="missing_parameter")
        for field, value in (("name", name), ("consent", consent)):
            if not value:
                raise ApiError(f"'{field}' is required", field, code="missing_parameter")
        if not text:
            raise ApiError("'ref_text' (the sample's transcript) is required: this server has no speech recognizer",
                           "ref_text", code="missing_parameter")
        _check_voice_name(name)
        text = checked_text(text, "ref_text", self.max_input_chars)
        audio = await sample.read()
        await run_in_threadpool(self._encode, audio, "audio_sample", lambda path: self._add_new(name, path, text))
        return JSONResponse(self._voice_object(name))

    def _add_new(self, name: str, path: Path, text: str) -> None:
        """Under the voice lock: of concurrent uploads of one name, the first is stored and the rest get 409; a
        store of max_voices voices takes no more (each is a few MB on disk)."""
        stored = self.tts.voices()
        if name == DEFAULT_VOICE or name in stored:
            raise ApiError(f"a voice named '{name}' exists: DELETE it first", "name", status=409,
                           code="voice_exists")
        if len(stored) >= self.max_voices:
            raise ApiError(f"the server keeps at most {self.max_voices} voices: DELETE one first", "name",
                           status=409, code="voice_store_full")
        self.tts.add_voice(name, path, text)

    async def list_voices(self, request: Request) -> Response:
        names = await run_in_threadpool(self.tts.voices)
        return JSONResponse({"object": "list", "data": [self._voice_object(n) for n in names]})

    async def remove_voice(self, request: Request) -> Response:
        name = _check_voice_name(request.path_params["name"])
        await run_in_threadpool(self._locked, self._remove, name)
        return JSONResponse({"id": name, "object": "audio.voice.deleted", "deleted": True})

    def _remove(self, name: str) -> None:
        if name not in self.tts.voices():
            raise ApiError(f"no voice named '{name}'", "name", status=404, code="voice_not_found")
        self.tts.remove_voice(name)

    async def _body(self, request: Request, limit: int) -> bytes:
        """The whole body within body_timeout_s (408 and the connection closed otherwise), at most `limit` bytes."""
        try:
            return await asyncio.wait_for(_read_body(request, limit), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(f"the request body did not arrive within {self.body_timeout_s:g} s", status=408,
                           code="request_timeout", headers={"Connection": "close"}) from None

    def _locked(self, work, *args):
        with self._voice_lock:
            return work(*args)

    def _voice_object(self, name: str) -> dict:
        path = self.tts.voice_library.store.path(name)
        created = int(path.stat().st_mtime) if path.exists() else 0
        return {"id": name, "object": "audio.voice", "name": name, "created_at": created, "type": "audio_sample"}

    def _watch_loop(self) -> None:
        """Start `loop_lag`'s probe on the serving loop once, at its first request (uvicorn's loop or a Ray
        replica's alike); it runs until the loop ends."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            due = time.perf_counter() + LOOP_PROBE_S
            await asyncio.sleep(LOOP_PROBE_S)
            self.loop_lag.observe(max(0.0, time.perf_counter() - due))

    # ---- service ----------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "higgs-rt"}]})

    async def health(self, request: Request) -> Response:
        self._watch_loop()
        m = self.engine.metrics()
        return JSONResponse({"status": "ok", "model": self.model_id, "slots": m["slots"],
                             "active_slots": m["active_slots"], "queue_depth": m["queue_depth"],
                             "ws_connections": self.ws_connections})

    async def metrics(self, request: Request) -> Response:
        self._watch_loop()
        m = self.engine.metrics()
        text = "\n".join([
            self.first_audio.render(),
            self.rtf.render(),
            self.loop_lag.render(),
            sample("higgs_rt_frames_per_second", "gauge", "Frames generated per second over all slots, "
                   "last 5 s.", m["frames_per_second"]),
            sample("higgs_rt_frames_total", "counter", "Frames generated.", m["frames_total"]),
            sample("higgs_rt_steps_total", "counter", "Decode steps (each advances every slot).", m["steps_total"]),
            sample(QUEUE_DEPTH, "gauge", "Requests waiting for a slot.", m["queue_depth"]),
            sample("higgs_rt_active_slots", "gauge", "Slots generating.", m["active_slots"]),
            sample("higgs_rt_slots", "gauge", "Decode slots.", m["slots"]),
            sample("higgs_rt_ws_connections", "gauge", "Open WebSocket sessions.", self.ws_connections),
            *(sample(f"higgs_rt_requests_{what}_total", "counter", f"Requests {what}.", m[f"jobs_{what}"])
              for what in ("completed", "cancelled", "failed", "rejected")),
            labelled("higgs_rt_decode_loop_seconds_total", "counter", "The decode thread's wall time by phase (idle: "
                     "waiting for work).", "phase", {k: m[f"loop_{k}"] for k in LOOP_PHASES}),
            sample("higgs_rt_prefill_ticks_total", "counter", "Decode-loop ticks that prefilled prompts.",
                   m["loop_prefill_ticks"]),
            sample("higgs_rt_prefill_prompts_total", "counter", "Prompts prefilled.", m["loop_prefill_prompts"]),
            sample("higgs_rt_prefill_forwards_total", "counter", "Prefill forwards (a batched one counts once).",
                   m["prefill_forwards"]),
            sample("higgs_rt_codec_busy_seconds_total", "counter", "Seconds the codec thread was not waiting for "
                   "work.", m["codec_busy_s"]),
            sample("higgs_rt_codec_gpu_seconds_total", "counter", "On CUDA, the GPU's time from each codec call's "
                   "first kernel to its last (concurrent with the decode step's).", m["codec_gpu_s"]),
            sample("higgs_rt_codec_calls_total", "counter", "Batched codec calls (pushes).", m["codec_pushes"]),
            sample("higgs_rt_codec_call_lanes_total", "counter", "Codec lanes the calls spanned (a call's width: on "
                   "CUDA the lane bucket holding every lane in use).", m["codec_push_lanes"]),
            sample("higgs_rt_codec_call_frames_total", "counter", "Frames the codec calls decoded per lane.",
                   m["codec_push_frames"]),
            sample("higgs_rt_codec_call_seconds_total", "counter", "Seconds in codec calls, their PCM's wait and "
                   "sending the chunks.", m["codec_push_s"]),
            sample("higgs_rt_codec_warm_seconds", "gauge", "Seconds the codec's CUDA graphs took to capture at the "
                   "engine's start (0 on the CPU).", m["codec_warm_s"]),
            labelled("higgs_rt_first_audio_stage_seconds_total", "counter", "Requests' time to first audio "
                     "by stage (higgs_rt.batch.FIRST_AUDIO_STAGES).", "stage", self.first_audio_stage_s),
            sample("higgs_rt_first_audio_staged_requests_total", "counter", "Requests counted in "
                   "higgs_rt_first_audio_stage_seconds_total.", self.first_audio_staged),
            *memory_samples(self.tts.device),
        ])
        return PlainTextResponse(text + "\n", media_type="text/plain; version=0.0.4")


class JobResponse(StreamingResponse):
    """A streamed job: however the response ends (done, client gone, error), the job is cancelled with it."""

    def __init__(self, job: Job, content: AsyncIterator[bytes], **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a no-op once it has ended


def create_app(tts: TTS, engine: BatchEngine, model_id: str, **options) -> Starlette:
    """The ASGI app; options: the keyword arguments of `SpeechServer` (limits and access)."""
    return SpeechServer(tts, engine, model_id, **options).app()


# ---- helpers ------------------------------------------------------------------------------------------------
async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 once it passes `limit` bytes (what follows is drained, not kept)."""
    body, size = bytearray(), 0
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    async for piece in request.stream():
        size += len(piece)
        too_big = too_big or size > limit
        if too_big and size > DRAIN_BYTES:
            break
        if not too_big:
            body += piece
    if too_big:
        raise ApiError(f"the request body is larger than {limit} bytes", status=413, code="request_too_large",
                       headers={"Connection": "close"})
    return bytes(body)


def _require_type(request: Request, media_type: str) -> None:
    """JSON and uploads only with their own Content-Type: a web page's no-preflight form posts are not read."""
    given = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if given != media_type:
        raise ApiError(f"Content-Type must be {media_type}, got {given or 'none'}", "Content-Type", status=415,
                       code="unsupported_media_type")


def _check_voice_name(name: str) -> str:
    try:
        return check_name(name)
    except VoiceError as e:
        raise ApiError(str(e), "name") from None


async def _form(request: Request, body: bytes):
    """The multipart form of an already read (size-checked) body."""

    async def replay() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=1, max_fields=8)
    except HTTPException as e:  # python-multipart could not parse it
        raise ApiError(f"the multipart body cannot be read: {e.detail}", code="invalid_multipart") from None


def _form_text(form, body: bytes, name: str) -> str | None:
    """A text field, stripped. Starlette reads a part that is not UTF-8 as Latin-1 instead of failing: a value
    decoded from UTF-8 is in the body as its UTF-8 bytes, a Latin-1 fallback (almost surely) is not."""
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(f"'{name}' must be a text field, not a file", name, code="invalid_type")
    if value and not value.isascii() and value.encode("utf-8") not in body:
        raise ApiError(f"'{name}' is not valid UTF-8", name)
    return value.strip() if value else None


async def _join(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in chunks])


async def _unless_disconnected(request: Request, job: Job, work):
    """Run `work` while watching the connection: a client that goes away cancels the job."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    finally:
        watcher.cancel()


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _api_error(request: Request, e: ApiError) -> Response:
    return error_response(e)


async def _http_error(request: Request, e: HTTPException) -> Response:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(ApiError(str(e.detail), status=e.status_code, code=code, kind=kind), e.headers)
