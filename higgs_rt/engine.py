"""The embedding API: `TTS`, loaded once, streams speech for text (whisper.cpp style).

`TTS` is the friendly facade over a shared `Model` (weights, codec, prompt builder, exported artifacts) and one
slot of per-stream state (a batch-1 `Decoder`, made on first use). Each call is a params struct plus callbacks,
and returns a `Stream` that carries its own results:

    tts = TTS("path/to/model", codec="path/to/codec")
    stream = tts.stream("Hello there.", seed=1)       # float32 chunks at tts.sample_rate
    for pcm in stream:
        ...
    stream.stats, stream.frames                        # complete once the stream has ended
    tts.stop()                                         # from any thread: ends the stream within one frame
    session = tts.session(seed=1)                      # text fed in pieces as it comes (higgs_rt.session)

What the frames mean (long text split into utterances, each prompted with the previous one's text and codes, EOS,
max_frames, stop) is `higgs_rt.utterance.Speech`, the same state machine `BatchEngine` drives for many slots.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from . import timing
from .generate import DEFAULT_CONTEXT, Decoder, HostFrames, check_compile
from .model import Model, default_device
from .model_thread import ModelThread, model_thread_for, one_cpu_thread
from .params import DEFAULT_MAX_BUFFERED_S
from .session import DEFAULT_MAX_BUFFERED_CHARS, Session
from .types import Stream, StreamStats, SynthesisParams, Voice, check_callback
from .utterance import Speech

__all__ = ["TTS", "Stream", "StreamStats", "Voice", "default_device"]


class TTS:
    def __init__(self, model: str | Path | Model | None = None, codec: str | Path | None = None,
                 device: str | None = None, dtype: torch.dtype | str | None = None, context: int = DEFAULT_CONTEXT,
                 first_chunk: int | None = None, chunk: int | None = None,
                 progress: bool = False, voices_dir: str | Path | None = None, compile: str | None = None,
                 warmup: bool | None = None, compiled: str | Path | bool | None = None):
        """model: a model directory or id, or an already loaded `Model` (then codec, device, dtype, context,
        progress and compiled are its own). compiled: a directory of `higgs-rt export` artifacts (None:
        MODEL/compiled if present; False: none); the exported step binds (or warns why not) with the slot, on first
        use. warmup: speak one short utterance now (None: on CUDA), which
        pays the first call's one-time costs (graph captures, kernel loading) during construction; they are paid on
        first use anyway, so a process that speaks once (`higgs-rt speak`) gets its first audio sooner without.
        first_chunk, chunk: the codec's chunk schedule in frames, 1 to 64 (`higgs_rt.codec.stream`; None: 1 and 8).
        A bad argument is a TypeError or ValueError naming it, raised before the weights load."""
        from .codec.stream import check_chunking

        check_compile(compile)
        check_chunking(first_chunk, chunk)
        with timing.stage("TTS()"):
            self.model = model if isinstance(model, Model) else Model(
                model, codec, device=device, dtype=dtype, context=context, progress=progress, compiled=compiled)
            self.device, self.dtype = self.model.device, self.model.dtype
            self.talker, self.codec, self.codec_dir = self.model.talker, self.model.codec, self.model.codec_dir
            self.prompts, self.compiled = self.model.prompts, self.model.compiled
            self.voices_dir = voices_dir
            self._voice_library = None  # made (and the codec's encoder loaded) only when a voice is cloned
            self._compile = compile
            self._decoder: Decoder | None = None  # one slot, made on first use: a server never needs it
            self._lane: CodecLane | None = None  # its streaming codec, made on first use too
            self.chunking = {k: v for k, v in dict(first_chunk=first_chunk, chunk=chunk).items() if v is not None}
            self._busy = threading.Lock()  # the one slot
            self._holder: _Turn | None = None  # the stream holding it (changed with _busy, under _freed)
            self._freed = threading.Condition()  # notified when the slot is released or a waiter is cancelled
            self._stops: weakref.WeakSet[threading.Event] = weakref.WeakSet()  # one per live stream (its generator)
            self._stops_lock = threading.Lock()
            self._player = None
            self._model_thread: ModelThread | None = None  # runs session utterances (made by the first session)
            self._model_thread_lock = threading.Lock()
            if self.device.type == "cuda" if warmup is None else warmup:
                with timing.stage("warm-up", '"Warm up.", at most 40 frames'):
                    self.warmup()
            else:
                with timing.stage("warm-up", "skipped: one-time costs are paid on first use"):
                    pass

    @property
    def decoder(self) -> Decoder:
        """The one slot `stream` steps (made on first use)."""
        if self._decoder is None:
            what = "KV cache, sampler" + (", decode-step CUDA graph capture" if self.device.type == "cuda" else "")
            with timing.stage("decoder", what):
                self._decoder = self.model.decoder(1, compile=self._compile)
        return self._decoder

    def warmup(self) -> None:
        """One short utterance end to end, so kernels, autotuning and allocators are ready before the first call."""
        for _ in self.stream("Warm up.", seed=0, max_frames=40):
            pass

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    # ---- control --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the current stream (from any thread): generation stops within one frame, playback at once.
        Every stream made before this call ends, including one made but not yet iterated (it yields nothing) or
        waiting for the slot; a stream made after it is not affected. The slot is free for the next stream once
        this returns: taken back here from a stream suspended between chunks (its consumer busy elsewhere; it
        ends when resumed, touching nothing), or let go by a running one within one frame (or once its
        on_chunk callback returns), which a new stream waits for instead of raising."""
        with self._stops_lock:
            for stop in self._stops:
                stop.set()
        player = self._player
        if player is not None:
            player.stop()
        self._reclaim()

    def _reclaim(self) -> None:
        """After a stop flag was set: the slot back now from its stream if that one is suspended between chunks
        (it never works again, see `_locked`); the streams waiting for the slot woken."""
        turn = self._holder
        if turn is not None and turn.stop.is_set() and turn.running.acquire(blocking=False):
            try:
                self._release(turn)
            finally:
                turn.running.release()
        self._wake_waiters()

    # ---- cloned voices (higgs_rt.voices) -----------------------------------------------------------------------
    @property
    def voice_library(self):
        if self._voice_library is None:
            from .voices import VoiceLibrary, VoiceStore

            self._voice_library = VoiceLibrary(self.codec_dir, self.device, VoiceStore(self.voices_dir))
        return self._voice_library

    def add_voice(self, name: str, audio, text: str, sample_rate: int | None = None) -> Voice:
        """Encode a reference recording (path, or array + sample_rate) and its transcript; keep it as `name`."""
        self.voice_library.add(name, audio, text, sample_rate)
        return self.voice_library.voice(name)

    def voices(self) -> list[str]:
        return self.voice_library.names()

    def remove_voice(self, name: str) -> None:
        self.voice_library.remove(name)

    def clone_voice(self, audio, text: str, sample_rate: int | None = None) -> Voice:
        """A one-off reference (not named); its codes are cached by audio hash and codec."""
        return self.voice_library.reference(audio, text, sample_rate)

    def resolve_voice(self, voice: Voice | str | None) -> Voice | None:
        """A stored voice's name -> its `Voice`; a `Voice` or None as it is."""
        return self.voice_library.voice(voice) if isinstance(voice, str) else voice

    # ---- synthesis ------------------------------------------------------------------------------------------
    def stream(self, text: str | list[str], *, voice: Voice | str | None = None,
               on_chunk: Callable[[np.ndarray], None] | None = None, abort: Callable[[], bool] | None = None,
               wait: bool = False, **params) -> Stream:
        """A `Stream` of float32 PCM chunks, decoded as they come; its `stats` and `frames` are complete once it
        has ended. text: one text (split into utterances that fit the frame budget) or a list of segments,
        spoken as given, one utterance each (as a text session splits). Params: the fields of SynthesisParams;
        `voice` is a `Voice`, a stored voice's name (see `add_voice`) or None (the model's own voice). Text and
        params are checked here, before any work. The engine has one slot: a second stream at the same time
        raises, unless `wait` (then it waits for the slot, or for abort)."""
        check_callback("on_chunk", on_chunk)
        check_callback("abort", abort)
        p = SynthesisParams.create(**params)
        speech = Speech(self.model, text, self.resolve_voice(voice), p)
        stop = self._new_stop()
        return Stream(self._locked(speech, on_chunk, abort, wait, stop=stop), speech.stats, speech.results,
                      end=speech.end, stop=lambda: (stop.set(), self._reclaim()))

    def _new_stop(self) -> threading.Event:
        """A stream's own stop flag, set by `stop()` from the moment the stream is made (held by its generator:
        one never iterated is forgotten with it)."""
        stop = threading.Event()
        with self._stops_lock:
            self._stops.add(stop)
        return stop

    def session(self, voice: Voice | str | None = None, *, on_audio: Callable[[np.ndarray], None] | None = None,
                on_event: Callable | None = None, max_chars: int | None = None,
                max_buffered_chars: int = DEFAULT_MAX_BUFFERED_CHARS,
                max_buffered_s: float = DEFAULT_MAX_BUFFERED_S, **params) -> Session:
        """An incremental text session (`higgs_rt.session.Session`): feed text as it comes, audio comes out
        clause by clause. Its utterances take this engine's one slot in turn (waiting while another stream
        holds it). Params: the fields of SynthesisParams, checked here."""
        p = SynthesisParams.create(**params)
        session = Session(self.model, self._session_utterance, self.resolve_voice(voice), p, on_audio=on_audio,
                          on_event=on_event, max_chars=max_chars, max_buffered_chars=max_buffered_chars,
                          max_buffered_s=max_buffered_s)
        self._session_thread()  # started (and warmed) before the first text arrives
        return session

    def _session_thread(self) -> ModelThread:
        with self._model_thread_lock:
            if self._model_thread is None:
                self._model_thread = model_thread_for(self, warm=one_cpu_thread if self.device.type == "cpu" else None)
            return self._model_thread

    def _session_utterance(self, speech: Speech, cancel) -> Iterator[np.ndarray]:
        """A session's utterance, run on the engine's model thread (higgs_rt.model_thread): every session's
        utterances run on one warm thread."""
        stop, reader = self._new_stop(), threading.current_thread()  # the session's thread: runs the callbacks
        started = yield from self._session_thread().iterate(
            lambda: self._locked(speech, None, cancel.is_set, wait=True, cancel=cancel, stop=stop, reader=reader),
            cancel)
        if started is False:  # cancelled before the model thread reached it
            speech.stop()

    def _locked(self, speech: Speech, on_chunk, abort, wait: bool = False, cancel=None, *,
                stop: threading.Event, reader: threading.Thread | None = None) -> Iterator[np.ndarray]:
        """The stream, holding the engine's one slot; wait: for another stream to end first (until abort or
        stop). cancel: a session's `CancelToken`, which wakes the wait at once, as stop() does (abort is polled).
        reader: the thread that reads the chunks and runs the callbacks when it is not the one running this
        generator (a session's, whose utterances run on the model thread), for `_take_slot`'s guard.
        The slot's decoder and codec lane belong to its holder only while it holds `turn.running`: once stopped,
        the stream never steps them again (`stop()` may have given the slot to the next stream), and work it
        queued before (on CUDA, one step and its copies) is ordered before the next stream's on the same streams."""
        turn, run = _Turn(stop, reader), None
        gave_up = lambda: stop.is_set() or (abort is not None and abort())  # noqa: E731
        try:
            if not self._take_slot(turn, wait, gave_up, poll=abort is not None and cancel is None, cancel=cancel):
                return
            run = self._run(speech, on_chunk, abort, stop)
            while True:
                with turn.running:
                    if stop.is_set():  # stopped while suspended: the slot may be another stream's already
                        return
                    turn.thread = threading.current_thread()  # its callbacks run on it now (see `_take_slot`)
                    if reader is None:
                        turn.consumer = turn.thread
                    try:
                        chunk = next(run, None)
                    finally:
                        turn.thread = None
                    if chunk is None:
                        return
                    if stop.is_set():  # stopped mid-chunk: this chunk is the last, and the slot is free before it
                        self._release(turn)
                yield chunk
        finally:
            if run is not None:
                run.close()
            speech.end()  # closed early or stopped: stats.stopped, and the running utterance keeps its frames
            self._release(turn)

    SLOT_POLL_S = 0.05  # how often a waiter polls an `abort` callable; the slot's release wakes it at once

    def _take_slot(self, turn: "_Turn", wait: bool, gave_up, poll: bool, cancel=None) -> bool:
        """Take the slot for `turn` as soon as it is released (True), or give up once gave_up() is true (False).
        Without wait, a slot held by a running stream raises; one held by a stopped stream is waited for (it is let
        go within a frame). A call from a callback of the stream or session holding the slot (on the thread running
        its step, or on the session's thread, which reads its chunks: either would wait for itself) raises, with
        wait or without; so does a wait on the thread that reads the holding stream's chunks. The slot's release,
        `stop()` and cancel wake the wait; poll: also wake every SLOT_POLL_S (for an abort callable)."""
        unhook = cancel.hook(self._wake_waiters) if cancel is not None else None
        try:
            with self._freed:  # released and notified under this lock: a release is never missed
                while not self._busy.acquire(blocking=False):
                    holder = self._holder
                    me = threading.current_thread()  # not its ident: a new thread may reuse an ended one's
                    if me in (holder.thread, holder.reader):
                        raise RuntimeError("this TTS engine is already streaming: a callback of its stream or "
                                           "session cannot start another stream on it, which would wait for itself "
                                           "(start it from another thread, or once this stream has ended)")
                    if not wait and not holder.stop.is_set():
                        raise RuntimeError("this TTS engine is already streaming: one stream at a time per engine")
                    if me is holder.consumer and not holder.stop.is_set():
                        raise RuntimeError("this TTS engine is already streaming to this thread: waiting here for "
                                           "the slot would wait for itself (read the stream to its end or close it "
                                           "first, or wait from another thread)")
                    if gave_up():
                        return False
                    self._freed.wait(self.SLOT_POLL_S if poll else None)
                self._holder = turn
                return True
        finally:
            if unhook is not None:
                unhook()

    def _release(self, turn: "_Turn") -> None:
        """Give the slot back if `turn` still holds it (`stop()` may have taken it back already)."""
        with self._freed:
            if self._holder is turn:
                self._holder = None
                self._busy.release()
                self._freed.notify_all()

    def _wake_waiters(self) -> None:
        with self._freed:
            self._freed.notify_all()

    def synthesize(self, text: str, *, voice: Voice | str | None = None, **params) -> np.ndarray:
        """The whole utterance as one float32 array at sample_rate (for its stats and frames, join a `stream`)."""
        chunks = list(self.stream(text, voice=voice, **params))
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    def speak(self, text: str, *, voice: Voice | str | None = None, device: int | str | None = None,
              on_chunk: Callable[[np.ndarray], None] | None = None, **params) -> StreamStats:
        """Play the speech on an output device as it is generated; returns the call's stats. The arguments are
        checked before the device opens."""
        from .audio_out import AudioPlayer

        check_callback("on_chunk", on_chunk)
        player = None

        def play(chunk: np.ndarray) -> None:
            player.write(chunk)
            if on_chunk is not None:
                on_chunk(chunk)

        stream = self.stream(text, voice=voice, on_chunk=play, **params)
        with timing.stage("audio output open"):
            player = AudioPlayer(device=device, samplerate=self.sample_rate)
        with player:
            self._player = player
            try:
                for _ in stream:
                    pass
                player.stop() if stream.stats.stopped else player.finish()
            except BaseException:  # Ctrl-C or an error: silence now, then let it propagate
                player.stop()
                raise
            finally:
                self._player = None
                stream.stats.underruns = player.underruns
        return stream.stats

    # ---- the loop: one slot, pipelined one step ahead of the host ----------------------------------------
    def _run(self, speech: Speech, on_chunk, abort, stop: threading.Event) -> Iterator[np.ndarray]:
        stats, start = speech.stats, time.perf_counter()
        stopped = lambda: stop.is_set() or (abort is not None and abort())  # noqa: E731
        if self._lane is None:
            self._lane = CodecLane(self.model.codec, self.chunking)
        lane = self._lane
        decoder = self.decoder
        host = HostFrames(2, self.talker.cfg.num_codebooks, self.device, keep_device=True)  # two frames in flight
        while True:
            if stopped():  # barge-in between utterances: the next one is not even prefilled
                speech.stop()
                break
            prompt = speech.start()
            if prompt is None:
                break
            with timing.stage("prefill", f"{len(prompt)} positions"):
                codec_stream = lane.restart()
                frames = decoder.start(0, prompt, speech.sampling())[None]
            t = 0  # the frame the host reads next; frame 0 (all-BOS) is the Speech's already
            while speech.running:
                if t + 1 < speech.params.max_frames:  # queue the next step before reading this frame
                    frames = decoder.step_fn(frames)
                    host.put((t + 1) % 2, frames[0])
                if t > 0:
                    frame = host.get(t % 2).clone()
                    ended = speech.push(frame)
                    if not stop.is_set():  # barge-in: no more codec work either
                        # the codes reach the codec on the device; the host copy serves its BOS/EOS checks
                        lane.submit(codec_stream.push, host.device(t % 2)[None], frame[None])
                        # the first chunk is waited for (it lands while the queued step runs); later ones polled
                        yield from self._emit(lane.ready(wait=stats.first_audio_s is None), stats, start, on_chunk)
                    if ended:
                        break
                if stopped():
                    speech.stop()
                    break
                t += 1
            if speech.stopped:
                break
            lane.submit(codec_stream.flush)
            yield from self._emit(lane.ready(wait=True), stats, start, on_chunk)
        stats.synthesis_s = time.perf_counter() - start

    def _emit(self, chunks: Iterator[np.ndarray], stats: StreamStats, start: float, on_chunk) -> Iterator[np.ndarray]:
        for chunk in chunks:
            if stats.first_audio_s is None:
                stats.first_audio_s = time.perf_counter() - start
                timing.mark("first audio", "decode steps and codec up to the first PCM chunk", final=True)
            stats.audio_s += chunk.shape[0] / self.sample_rate
            if on_chunk is not None:
                on_chunk(chunk)
            yield chunk


class _Turn:
    """One stream's hold on the slot: its stop flag, and `running`, held while its generator works between chunks,
    so that `stop()` takes the slot back only from a stream suspended at a chunk, never from one mid-frame. The
    threads its callbacks run on (`_take_slot` refuses them): `thread`, the one inside its step now (a plain
    stream's consumer, which runs on_chunk), and `reader`, a session's thread for the whole turn; `consumer`, the
    thread that last took a chunk of a plain stream (its next chunk is that thread's to take: it waiting for the
    slot would wait for itself)."""

    __slots__ = ("stop", "running", "thread", "reader", "consumer")

    def __init__(self, stop: threading.Event, reader: threading.Thread | None = None):
        self.stop, self.running, self.thread, self.reader = stop, threading.Lock(), None, reader
        self.consumer = None


class CodecLane:
    """One slot's streaming codec (`higgs_rt.codec.StreamingDecoder`) beside the Talker: on CUDA its kernels run
    on their own stream and its PCM reaches the host through asynchronous copies, polled once per frame, so codec
    chunks never stall the decode loop. A lane serves utterance after utterance (`restart`), which keeps the
    codec's CUDA graphs and orders each utterance's codec work after the previous one's on the same stream."""

    def __init__(self, codec, chunking: dict[str, int]):
        from .codec import StreamingDecoder

        device = codec.table.device
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None  # ahead of steps
        self.pending: deque[tuple[torch.cuda.Event | None, torch.Tensor]] = deque()
        self.codec = StreamingDecoder(codec, **chunking)

    def restart(self):
        """A new utterance: chunks of the last one still in flight are dropped; returns the reset decoder."""
        self.pending.clear()
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            self.codec.reset()
        return self.codec

    def submit(self, decode: Callable[..., torch.Tensor], *args) -> None:
        """Queue decode(*args) on the lane's stream; its PCM is copied to the host (`ready`). Device tensors among
        args must be complete when submitted (they are then only read, on the lane's stream)."""
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.is_cuda:
                arg.record_stream(self.stream)  # not reused by the caller's stream while the lane may read it
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            pcm = decode(*args).detach()
            if pcm.numel() == 0:
                return
            if self.stream is None:
                self.pending.append((None, pcm.float()))
                return
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(pcm, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
            self.pending.append((done, host))

    def ready(self, wait: bool = False) -> Iterator[np.ndarray]:
        """Chunks whose copy has landed, in order; with wait, all of them."""
        while self.pending:
            done, host = self.pending[0]
            if done is not None:
                if not (wait or done.query()):
                    return
                done.synchronize()
            self.pending.popleft()
            yield host.numpy()
