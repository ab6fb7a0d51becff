"""Text streamed in, audio streamed out: an incremental text session over `TTS` (one slot) or `BatchEngine`.

    session = tts.session(voice=None, on_audio=None, on_event=None, max_chars=None, **sampling_params)
    session = engine.session(...)      # the same class and contract on a BatchEngine
    session.feed("Hello th")           # never waits for synthesis; pieces may split anywhere; "" is fine
    session.feed("ere, how are you?")  # "Hello there," is complete: it is being spoken now
    session.flush()                    # speak what is buffered even without a boundary
    session.close()                    # flush, and no more text; iteration ends after the last audio
    session.cancel()                   # barge-in: no audio event after it returns, the slot is freed within one
                                       # frame, buffered text dropped
    for event in session: ...          # `higgs_rt.types.SessionEvent`s: start, audio, end, ..., closed

The contract:
- Text pieces accumulate; an utterance is spoken as soon as the buffered text holds a complete sentence or clause
  (`higgs_rt.text_split.next_segment`: the splitter's boundaries; a clause longer than `max_chars` is cut at
  words), so where the text is cut depends on the text only, never on how it was cut into pieces: the segments
  of a closed session are `text_split.clause_segments(all its text, max_chars)` (plus a cut at each `flush`),
  and `session.segments` lists them. A boundary needs what follows it (a space, a newline, the next word): a
  piece "Hi." is spoken once " " or the next piece has come, or at flush/close.
- One `higgs_rt.utterance.Speech` carries the utterances: each is prompted with the previous one's text and codes
  (or the cloned voice) and utterance i uses seed + i, so the audio equals `tts.stream(session.segments, seed=...)`
  exactly.
- A session waiting for text holds no decode slot: each utterance is its own turn at the engine (`TTS`: its one
  slot, waiting while another stream holds it; `BatchEngine`: one job per utterance). Utterances run one after
  another on the session's own thread, which ends once a session dropped unclosed has nothing left to speak.
- Events: "start" (an utterance's text), "audio" (float32 PCM at `sample_rate`), "end" (its `StreamStats`);
  "error" then "closed" when synthesis fails (the engine refused the utterance, the audio was not read...);
  "closed" is always the last one (after close: when the last audio is out; after cancel: at once). After
  `cancel()` no "audio" or "end" event comes.
- Callbacks run on the session's thread, in order: `on_event(event)` takes every event (iteration then yields
  none and just waits for the end), `on_audio(pcm)` every audio chunk (iteration yields the other events). A
  callback that raises fails the session ("error", then "closed"); one raising on those two still lets it end.
  A callback that starts a stream on the session's own `TTS` while an utterance holds its slot gets the engine's
  RuntimeError (it would wait for itself): start it from another thread; so does one that reads the session's
  events or feeds it with `wait=True`.
  Iterate with `for` (blocking), `async for` (asyncio) or `read(timeout)`.
- Bounds: text not yet spoken (`max_buffered_chars`, default 4096: `feed` raises SessionFull, the piece is not
  taken, the session goes on; `feed(text, wait=True)` waits for room instead) and audio not yet read (`max_buffered_s`, default 30 s: the session fails with
  BufferFull). `feed`/`flush` after close, cancel or a failure raise SessionClosed; text that cannot be spoken (a [SPEAKERn]
  tag) raises PromptError from the `feed`, `flush` or `close` that completes its segment, which is then dropped
  (the segments around it are spoken; a `close` that raises has closed the session all the same).
"""

from __future__ import annotations

import asyncio
import atexit
import math
import threading
import time
import weakref
from collections import deque
from typing import Callable, Iterator

import numpy as np

from .loop_waker import LoopWaker
from .params import DEFAULT_MAX_BUFFERED_S, ParamError
from .prompt import PromptError
from .text_split import next_segment
from .types import BufferFull, SessionEvent, StreamStats, SynthesisParams, Voice, check_callback
from .utterance import Speech

DEFAULT_MAX_BUFFERED_CHARS = 4096


def error_line(error: BaseException) -> str:
    """An exception's message on one line (whitespace runs as one space), or its type's name when it has none:
    what an "error" event, and a server's error message, carries."""
    return " ".join(str(error).split()) or type(error).__name__


class SessionClosed(RuntimeError):
    """Text fed to a session that was closed or cancelled."""


class SessionFull(ValueError):
    """More text than the session may hold unspoken."""


class CancelToken:
    """Set once by `Session.cancel`; an engine polls `is_set` per frame or `hook`s its own cancel onto it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._set = False
        self._hooks: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def hook(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn when the token is set (now, if it is); returns what unhooks it."""
        with self._lock:
            if not self._set:
                self._hooks.append(fn)
                return lambda: self._unhook(fn)
        fn()
        return lambda: None

    def _unhook(self, fn) -> None:
        with self._lock:
            if fn in self._hooks:
                self._hooks.remove(fn)


def _serve(ref: "weakref.ref[Session]", cond: threading.Condition) -> None:
    """A session's thread: its utterances one after another, then its end. It holds the session only while there
    is work (`Session._busy`), so a session dropped unclosed while waiting for text is collected, and its
    finalizer (`_wake`) ends this thread: nobody is left to feed it or read its events."""
    while True:
        with cond:
            while (session := ref()) is not None and not session._busy():
                session = None
                cond.wait()
        if session is None or not session._work():
            return
        session = None


def _wake(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()


# An engine's turn for one utterance: speak the Speech's next utterance (its last segment), yielding PCM chunks,
# and stop within one frame once the token is set.
Utterance = Callable[[Speech, CancelToken], Iterator[np.ndarray]]


_LIVE: "weakref.WeakSet[Session]" = weakref.WeakSet()


@atexit.register
def _cancel_live_sessions() -> None:
    """A session thread still running the model at exit would abort the interpreter: cancel and join them."""
    for session in list(_LIVE):
        session.cancel()
        session.join(10)


class Session:
    """See the module docstring. Made by `TTS.session` and `BatchEngine.session`, not directly."""

    def __init__(self, model, utterance: Utterance, voice: Voice | None, params: SynthesisParams, *,
                 on_audio: Callable[[np.ndarray], None] | None = None,
                 on_event: Callable[[SessionEvent], None] | None = None, max_chars: int | None = None,
                 max_buffered_chars: int = DEFAULT_MAX_BUFFERED_CHARS,
                 max_buffered_s: float = DEFAULT_MAX_BUFFERED_S):
        check_callback("on_audio", on_audio)
        check_callback("on_event", on_event)
        if max_buffered_chars < 1 or not 0 < max_buffered_s < math.inf:
            raise ValueError(f"need max_buffered_chars >= 1 and max_buffered_s > 0 (finite), got {max_buffered_chars} "
                             f"and {max_buffered_s}")
        # checks the voice, and that the shortest utterance fits the context (`Speech.check_room`)
        self.speech = Speech(model, None, voice, params, incremental=True)
        longest = min(model.max_chars(voice, params), max_buffered_chars)
        if max_chars is None:
            max_chars = longest
        elif isinstance(max_chars, bool) or not isinstance(max_chars, int) or not 1 <= max_chars <= longest:
            raise ParamError(f"max_chars must be an integer in [1, {longest}] (the longest utterance max_frames "
                             f"and max_buffered_chars allow), got {max_chars!r}", "max_chars")
        self.max_chars, self.max_buffered_chars = max_chars, max_buffered_chars
        self.sample_rate = model.sample_rate
        self.stats = StreamStats()  # the whole session's, complete once it has closed
        self.error: BaseException | None = None
        self._utterance, self._on_audio, self._on_event = utterance, on_audio, on_event
        self._max_samples = int(max_buffered_s * self.sample_rate)
        self._cancel = CancelToken()
        self._lock = threading.Condition()
        self._text = ""  # fed, not yet cut into a segment
        self._cut: list[str] = []  # every segment cut, in order (`segments`)
        self._ready: deque[tuple[str, float]] = deque()  # cut, not yet started: (text, when it was complete)
        self._ready_chars = 0
        self._closed = False  # no more text
        self._finished = False  # the "closed" event is out
        self._events: deque[SessionEvent] = deque()
        self._queued_samples = 0
        self._taken_last = False  # iteration has returned the "closed" event
        self._feeding = False  # a feed(wait=True) is taking its piece in parts (`feed`)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._lock), name="higgs-rt-session",
                                        daemon=True)
        weakref.finalize(self, _wake, self._lock)  # dropped unclosed: its thread, waiting for text, ends
        self._thread.start()
        _LIVE.add(self)

    # ---- text in (any thread) -----------------------------------------------------------------------------
    @property
    def segments(self) -> list[str]:
        """Every segment cut so far, in order: the utterances spoken, being spoken or waiting."""
        with self._lock:
            return list(self._cut)

    @property
    def closed(self) -> bool:
        """No more text is taken (closed or cancelled)."""
        return self._closed

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def frames(self):
        """Each spoken utterance's delayed frames [T, Q] (complete once the session has closed)."""
        return [r.frames for r in self.speech.results]

    def feed(self, text: str, wait: bool = False) -> None:
        """Add a piece of text; complete clauses start speaking. Never waits for synthesis, unless `wait`: a
        producer faster than speech (a pipe) then waits for room instead of getting SessionFull, its text taken
        in parts as utterances start (where text is cut never depends on its pieces); a buffer full of text no
        boundary cuts yet is flushed; its piece goes in whole before another thread's (a feed meanwhile waits for
        it with `wait`, else gets SessionFull). Whitespace before any text to speak is not kept. With `wait`, not
        from the session's own callbacks (RuntimeError): the room comes from their thread."""
        if not isinstance(text, str):
            raise TypeError(f"feed() takes a str, got {type(text).__name__}")
        if wait:
            self._check_not_own_thread("feed(text, wait=True)", "feed without wait there (SessionFull when full)")
        with self._lock:
            mine = False  # this call holds the feeding turn: its piece goes in whole before another's
            try:
                while True:
                    self._check_open("feed")
                    if self._feeding and not mine:  # a waiting feed is taking its piece in parts
                        if not wait:
                            raise SessionFull("another feed(text, wait=True) is still taking its piece: feed with "
                                              "wait=True, or after it")
                        self._lock.wait()
                        continue
                    if not self._text:
                        text = text.lstrip()
                    pending = len(self._text) + self._ready_chars
                    room = self.max_buffered_chars - pending
                    if len(text) <= room or (wait and room > 0):
                        self._text += text[:room]
                        text = text[room:]
                        self._cut_segments(final=False)
                        if not text:
                            return
                        mine = self._feeding = True
                    elif not wait:
                        raise SessionFull(f"the session holds {pending} characters not yet spoken and this piece has "
                                          f"{len(text)}: at most {self.max_buffered_chars} (feed more slowly, or "
                                          f"raise max_buffered_chars)")
                    elif not self._ready:  # full, and nothing cut to speak: waiting would not make room
                        self._cut_segments(final=True)
                    else:
                        mine = self._feeding = True
                        self._lock.wait()
            finally:
                if mine:
                    self._feeding = False
                    self._lock.notify_all()

    def flush(self) -> None:
        """Speak what is buffered now, even without a sentence or clause boundary (nothing buffered: no-op)."""
        with self._lock:
            self._check_open("flush")
            self._cut_segments(final=True)

    def close(self) -> None:
        """Flush and take no more text; the events end after the last audio. Closing twice is a no-op."""
        with self._lock:
            if self._closed:
                return
            try:
                self._cut_segments(final=True)
            finally:
                self._closed = True
                self._lock.notify_all()

    def cancel(self) -> None:
        """Barge-in: buffered text and audio not yet read are dropped, no audio event follows, the running
        utterance stops within one frame and its slot is freed; then "closed" (cancelled). Idempotent."""
        with self._lock:
            if self._finished:
                return
            self._closed = True
            self._text, self._ready_chars = "", 0
            self._ready.clear()
            self._drop_audio()
            self._cancel.set()  # under the lock: no audio event is queued after this
            self._lock.notify_all()

    def _check_not_own_thread(self, what: str, instead: str) -> None:
        """A call that waits for the session's thread, made on it (from a callback), would wait for itself."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{what} from a callback of this session would wait for itself (its thread runs the "
                               f"callbacks): {instead}, or call it from another thread")

    def _check_open(self, what: str) -> None:
        if self.error is not None:
            raise SessionClosed(f"{what}() on a session that failed ({error_line(self.error)}): open a new one")
        if self._closed:
            state = "cancelled" if self._cancel.is_set() else "closed"
            raise SessionClosed(f"{what}() on a {state} session: open a new one")

    def _cut_segments(self, final: bool) -> None:
        """Move complete segments from the text buffer to the ready queue (lock held). A segment that cannot be
        spoken is dropped and the ones after it are still cut; then the first such segment's PromptError."""
        now, dropped = time.perf_counter(), None
        while (cut := next_segment(self._text, 0, self.max_chars, final)) is not None:
            segment, rest = cut
            previous = self._cut[-1] if self._cut else None
            self._text = self._text[rest:]
            try:
                self.speech.check_segment(segment, previous)
            except PromptError as e:
                dropped = dropped or e
                continue
            self._cut.append(segment)
            self._ready.append((segment, now))
            self._ready_chars += len(segment)
            self._lock.notify_all()
        self._text = "" if final else self._text.lstrip()  # what is left: whitespace only, or the next segment's
        if dropped is not None:
            raise dropped

    # ---- events out ---------------------------------------------------------------------------------------
    def __iter__(self) -> "Session":
        return self

    def __next__(self) -> SessionEvent:
        event = self.read()
        if event is None:
            raise StopIteration
        return event

    def read(self, timeout: float | None = None) -> SessionEvent | None:
        """The next event, waiting for it; None once the "closed" event has been returned. TimeoutError when
        none came within timeout seconds. Not from the session's own callbacks (RuntimeError): their thread makes
        the events."""
        self._check_not_own_thread("reading its events", "take them with on_event")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                event = self._take()
                if event is not None or self._taken_last:
                    return event
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no session event within {timeout} s")
                self._lock.wait(left)

    def __aiter__(self) -> "Session":
        return self

    async def __anext__(self) -> SessionEvent:
        """For asyncio consumers: waiting never blocks the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                event = self._take()
                if event is not None:
                    return event
                if self._taken_last:
                    raise StopAsyncIteration
                ready = asyncio.Event()
                self._waiters.append((loop, ready))
            await ready.wait()

    def _take(self) -> SessionEvent | None:
        """The next queued event (lock held); the "closed" one ends the iteration."""
        if not self._events:
            if self._finished and (self._on_event is not None):
                self._taken_last = True  # everything went to on_event: iteration just waited for the end
            return None
        event = self._events.popleft()
        if event.kind == "audio":
            self._queued_samples -= event.pcm.shape[0]
        if event.kind == "closed":
            self._taken_last = True
        return event

    def _drop_audio(self) -> None:
        self._events = deque(e for e in self._events if e.kind != "audio")
        self._queued_samples = 0

    def _emit(self, event: SessionEvent) -> bool:
        """Deliver an event (session thread): to the callbacks, or queued for the iteration. An audio event
        after cancel is dropped (False). The "closed" event reaches on_event before iteration can end."""
        last = event.kind == "closed"
        if last and self._on_event is not None:
            try:
                self._on_event(event)
            finally:  # the session has ended, whatever the callback did: iteration and read() must see it
                self._queue(event)
            return True
        if not self._queue(event):
            return False
        if event.kind == "audio" and self._on_audio is not None:
            self._on_audio(event.pcm)
        if self._on_event is not None:
            self._on_event(event)
        if self._queued_samples > self._max_samples:
            seconds = self._max_samples / self.sample_rate
            raise BufferFull(f"more than {seconds:g} s of audio was waiting unread: the session was cancelled "
                             "(read its events as they come)")
        return True

    def _queue(self, event: SessionEvent) -> bool:
        """Queue the event for the iteration unless a callback takes it, and wake the readers (session thread). An
        audio event after cancel is dropped (False)."""
        with self._lock:
            if event.kind == "audio" and self._cancel.is_set():
                return False
            queued = self._on_event is None and not (event.kind == "audio" and self._on_audio is not None)
            if queued:
                self._events.append(event)
                if event.kind == "audio":
                    self._queued_samples += event.pcm.shape[0]
            if event.kind == "closed":
                self._finished = True
            self._lock.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ready in waiters:
            LoopWaker.of(loop).wake(ready)
        return True

    # ---- the session's thread: utterances one after another ----------------------------------------------
    def _busy(self) -> bool:
        """Something for the session's thread to do: a segment to speak, or the end (lock held)."""
        return bool(self._ready) or self._closed

    def _next(self) -> tuple[str, float] | None:
        with self._lock:
            if self._cancel.is_set() or not self._ready:
                return None
            segment, ready_at = self._ready.popleft()
            self._ready_chars -= len(segment)
            return segment, ready_at

    def _work(self) -> bool:
        """The session's thread, once `_busy`: speak the next segment (True), or end the session (False)."""
        try:
            if (item := self._next()) is not None:
                self._speak(*item)
                return True
        except BaseException as e:  # noqa: BLE001 - reported as the "error" event, never lost
            self.error = e
            with self._lock:
                self._drop_audio()
            self._cancel.set()  # stops what is running; the "closed" event says it was an error, not a cancel
            self._emit_quietly(SessionEvent("error", error=error_line(e)))
        self.stats.stopped = self._cancel.is_set()
        error = None if self.error is None else error_line(self.error)
        self._emit_quietly(SessionEvent("closed", stats=self.stats, error=error,
                                        cancelled=error is None and self._cancel.is_set()))
        return False

    def _emit_quietly(self, event: SessionEvent) -> None:
        """The "error" and "closed" events: the session is ending anyway, so neither BufferFull nor a callback that
        raises stops it (a callback's error is kept as `error` when there was none)."""
        try:
            self._emit(event)
        except BufferFull:
            pass
        except Exception as e:  # noqa: BLE001 - nowhere left to raise it: the session's thread ends here
            if self.error is None:
                self.error = e

    def _speak(self, segment: str, ready_at: float) -> None:
        speech, i = self.speech, len(self.speech.segments)
        speech.add(segment, checked=True)  # `_cut_segments` checked it against the segment before it
        results, tokens = len(speech.results), speech.stats.prompt_tokens
        stats = StreamStats(utterances=1)
        self._emit(SessionEvent("start", utterance=i, text=segment))
        begin = time.perf_counter()
        for pcm in self._utterance(speech, self._cancel):
            now = time.perf_counter()
            if pcm.shape[0] and self._emit(SessionEvent("audio", utterance=i, pcm=pcm)):
                if stats.first_audio_s is None:
                    stats.first_audio_s = now - ready_at
                stats.audio_s += pcm.shape[0] / self.sample_rate
        stats.synthesis_s = time.perf_counter() - begin
        if speech.stopped and not self._cancel.is_set():  # the engine was stopped (TTS.stop): the session ends
            self.cancel()
        ended = speech.results[results:]
        stats.frames = sum(r.frames.shape[0] for r in ended)
        stats.truncated = sum(not (r.finished or r.stopped) for r in ended)
        stats.prompt_tokens = speech.stats.prompt_tokens - tokens
        self._add(stats)
        if not self._cancel.is_set():
            self._emit(SessionEvent("end", utterance=i, text=segment, stats=stats))

    def _add(self, u: StreamStats) -> None:
        s = self.stats
        if s.first_audio_s is None:
            s.first_audio_s = u.first_audio_s
        s.synthesis_s += u.synthesis_s
        s.audio_s += u.audio_s
        s.frames += u.frames
        s.utterances += u.utterances
        s.truncated += u.truncated
        s.prompt_tokens += u.prompt_tokens

    # ---- context manager ----------------------------------------------------------------------------------
    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Leaving the block closes the session (cancels it on an exception) and waits for its end."""
        self.cancel() if exc_type is not None else self.close()
        self.join()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the session's thread to end (after close or cancel); True if it has. Not from the session's own
        callbacks (RuntimeError): their thread is the one to end."""
        self._check_not_own_thread("join()", "close() or cancel() it there and join from another thread")
        self._thread.join(timeout)
        return not self._thread.is_alive()
