"""Incremental text sessions (higgs_rt.session) on the tiny random model, on TTS (one slot) and on BatchEngine:
pieces cut anywhere speak exactly the audio of the same segments given whole; the order of events; flush, close,
cancel (counted in frames and slot state, never timed); bounds and errors."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from higgs_rt.batch import BatchEngine, QueueFull
from higgs_rt.engine import TTS
from higgs_rt.prompt import PromptError
from higgs_rt.session import SessionClosed, SessionFull
from higgs_rt.text_split import clause_segments
from higgs_rt.types import BufferFull

PARAMS = {"seed": 7, "max_frames": 24}
TEXT = "Hello there, how are you today? I am fine."
PIECES = ["Hel", "", "lo the", "re, how a", "re you", "", " today? I", " am fi", "ne."]  # mid-word, mid-sentence
TIMEOUT = 300  # seconds for one event: only a hang gets near it on a loaded 2-core machine


@pytest.fixture(scope="module")
def tts(random_model):
    return TTS(random_model, device="cpu", chunk=1)  # a chunk per frame: audio comes mid-utterance


@pytest.fixture(scope="module")
def endless(tts):
    """A TTS on the same model whose utterances never sample EOS, so they run to max_frames and their audio flows
    mid-utterance, as the real model's does (the tiny random one ends its utterances within a codec chunk)."""
    endless = TTS(tts.model, chunk=1)
    decoder = tts.model.decoder(1, ignore_eos=True)
    start = decoder.start
    decoder.start = lambda slot, prompt, params: start(slot, prompt, params, ignore_eos=True)
    endless._decoder = decoder
    return endless


@pytest.fixture(scope="module")
def engine(tts):
    eng = BatchEngine(tts, slots=2, queue=0, benchmark=True)  # queue 0: a busy slot refuses at once
    yield eng
    eng.close()


@pytest.fixture(params=["tts", "engine"])
def on(request, tts, engine):
    """The object sessions are opened on: the TTS or the batch engine (the same contract)."""
    return tts if request.param == "tts" else engine


def drain(session) -> list:
    """Every event until the iteration ends."""
    events = []
    while (event := session.read(TIMEOUT)) is not None:
        events.append(event)
    return events


def pcm(events) -> np.ndarray:
    chunks = [e.pcm for e in events if e.kind == "audio"]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


def test_pieces_cut_anywhere_speak_exactly_the_segments_given_whole(on, tts):
    session = on.session(**PARAMS)
    for piece in PIECES:
        session.feed(piece)
    session.close()
    events = drain(session)
    segments = clause_segments(TEXT, session.max_chars)
    assert session.segments == segments == ["Hello there,", "how are you today?", "I am fine."]
    stream = tts.stream(segments, **PARAMS)
    want = list(stream)
    assert np.array_equal(pcm(events), np.concatenate(want))  # exactly: same codes, same seeds, same reference
    assert [f.tolist() for f in session.frames] == [f.tolist() for f in stream.frames]
    # the events, in order: per utterance start, audio..., end; then closed with the whole session's stats
    kinds = [(e.kind, e.utterance) for e in events if e.kind != "audio"]
    assert kinds == [("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2), ("end", 2), ("closed", None)]
    for i, segment in enumerate(segments):
        mine = [j for j, e in enumerate(events) if e.utterance == i]
        assert events[mine[0]].kind == "start" and events[mine[-1]].kind == "end" and len(mine) > 2
        assert events[mine[0]].text == events[mine[-1]].text == segment
        assert {events[j].kind for j in mine[1:-1]} == {"audio"}
    ends = [e.stats for e in events if e.kind == "end"]
    closed = events[-1]
    assert not closed.cancelled and closed.error is None and closed.stats is session.stats
    assert closed.stats.utterances == 3 and closed.stats.frames == sum(s.frames for s in ends) == stream.stats.frames
    assert closed.stats.audio_s == pytest.approx(pcm(events).size / tts.sample_rate)
    assert all(s.first_audio_s is not None and s.first_audio_s > 0 for s in ends)
    # one piece holding it all speaks the same
    whole = on.session(**PARAMS)
    whole.feed(TEXT)
    whole.close()
    assert np.array_equal(pcm(drain(whole)), pcm(events))


def test_audio_for_a_clause_comes_before_the_next_piece_is_fed(on):
    """The order is asserted by sequence: the test itself waits for the first clause's audio before feeding the
    next piece, so a session that held the clause back until more text came would never get there."""
    log = []
    with on.session(**PARAMS) as session:
        for i, piece in enumerate(["Hello there, ", "how are you? ", "Fine."]):
            session.feed(piece)
            log.append(("fed", i))
            while i < 2 and (event := session.read(TIMEOUT)).kind != "audio":
                log.append((event.kind, event.utterance))
            if i < 2:
                log.append(("audio", event.utterance))
    assert log == [("fed", 0), ("start", 0), ("audio", 0), ("fed", 1), ("end", 0), ("start", 1), ("audio", 1),
                   ("fed", 2)]


def test_waiting_for_text_holds_no_slot(tts, engine):
    """Between utterances the session holds nothing: another stream runs on the TTS's one slot, and on the
    engine (queue 0) two other jobs take both slots, while the session waits for its next piece."""
    for on in (tts, engine):
        session = on.session(**PARAMS)
        session.feed("First clause, ")
        while session.read(TIMEOUT).kind != "end":
            pass
        if on is tts:
            assert tts.synthesize("Another stream.", seed=1).size > 0  # would raise "already streaming"
            held = tts.stream("Holds the slot.", seed=1)
            next(held)
            session.feed("the next clause waits for it, ")  # the session's thread waits for the slot
            held.close()
            while session.read(TIMEOUT).kind != "end":
                pass
        else:
            assert engine.metrics()["active_slots"] == 0
            others = [engine.submit("Another stream.", seed=1), engine.submit("And one more.", seed=2)]
            assert all(len(list(job)) > 0 for job in others)
        session.feed("then the second.")
        session.close()
        assert [e.kind for e in drain(session) if e.kind != "audio"] == ["start", "end", "closed"]


class WatchedCondition(threading.Condition):
    """A Condition that says when someone has started waiting on it."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def test_a_waiter_for_the_tts_slot_is_woken_by_its_release_and_a_waiting_session_by_cancel(tts, monkeypatch):
    """Waiting for the TTS's one slot is a wait on its release, not a poll: with the poll made an hour long, a
    session waiting for the slot still ends at once on cancel (never taking the slot), and a stream waiting with
    an abort callable still starts as soon as the holder lets go."""
    monkeypatch.setattr(tts, "SLOT_POLL_S", 3600.0)
    monkeypatch.setattr(tts, "_freed", WatchedCondition())
    held = tts.stream("Holds the slot.", seed=1)
    next(held)
    session = tts.session(**PARAMS)
    session.feed("Waits for the slot, ")
    assert session.read(TIMEOUT).kind == "start"
    assert tts._freed.waiting.wait(TIMEOUT)  # the session's thread waits for the slot
    session.cancel()
    events = drain(session)
    assert [(e.kind, e.cancelled) for e in events] == [("closed", True)]
    assert session.speech.results == [] and session.stats.stopped  # it never took the slot
    tts._freed.waiting.clear()
    chunks = []
    waiter = threading.Thread(target=lambda: chunks.extend(
        tts.stream("Next in line.", seed=2, wait=True, abort=lambda: False)))
    waiter.start()
    assert tts._freed.waiting.wait(TIMEOUT)  # it waits for the slot
    held.close()  # releases the slot: the waiter takes it now, not an hour later
    waiter.join(TIMEOUT)
    assert not waiter.is_alive() and len(chunks) > 0
    assert not tts._busy.locked()


def test_a_session_builds_each_prompt_once_to_check_it_and_once_to_speak_it(tts, monkeypatch):
    built = []
    prompt = tts.model.prompt
    monkeypatch.setattr(tts.model, "prompt", lambda text, *args: (built.append(text), prompt(text, *args))[1])
    session = tts.session(**PARAMS)
    assert built == ["a"]  # the shortest utterance's prompt: max_frames leaves it room
    built.clear()
    session.feed("One clause, ")
    assert built == ["One clause,"]  # checked in feed: a segment that cannot be spoken raises there
    session.close()
    assert [e.kind for e in drain(session) if e.kind != "audio"] == ["start", "end", "closed"]
    assert built == ["One clause,", "One clause,"]  # and built once more to speak it, not re-checked


def test_flush_speaks_a_partial_clause_and_flush_without_text_does_nothing(on):
    session = on.session(**PARAMS)
    session.flush()  # nothing buffered: no utterance
    session.feed("No boundary here")
    assert session.segments == []  # cut in feed itself, not later: nothing is complete yet
    session.feed(" yet")
    session.flush()
    assert session.segments == ["No boundary here yet"]
    session.feed("   ")
    session.flush()
    session.close()
    session.close()  # a no-op
    events = drain(session)
    assert [(e.kind, e.text) for e in events if e.kind in ("start", "end")] == [
        ("start", "No boundary here yet"), ("end", "No boundary here yet")]
    assert events[-1].kind == "closed" and session.read(TIMEOUT) is None  # the iteration has ended
    empty = on.session(**PARAMS)
    empty.close()
    assert [e.kind for e in drain(empty)] == ["closed"]


def test_feed_after_close_or_cancel_and_bad_input_are_clear_errors(on):
    session = on.session(**PARAMS)
    with pytest.raises(TypeError, match="feed\\(\\) takes a str, got int"):
        session.feed(5)
    with pytest.raises(PromptError, match="SPEAKER"):
        session.feed("[SPEAKER1] hello, ")
    assert session.segments == []  # that clause was dropped; the session goes on
    session.feed("Still open.")
    session.close()
    with pytest.raises(SessionClosed, match="feed\\(\\) on a closed session"):
        session.feed("More.")
    with pytest.raises(SessionClosed, match="flush\\(\\) on a closed session"):
        session.flush()
    assert [e.text for e in drain(session) if e.kind == "start"] == ["Still open."]
    around = on.session(**PARAMS)  # the segments around an unspeakable one are spoken, in one feed or at close
    with pytest.raises(PromptError, match="SPEAKER"):
        around.feed("First one. [SPEAKER1] Not this. Last one. And")
    around.feed(" the end. [SPEAKER2] nor this")  # that segment is not complete yet
    with pytest.raises(PromptError, match="SPEAKER"):
        around.close()  # the close that completes an unspeakable segment still closes
    assert around.closed and around.segments == ["First one.", "Last one.", "And the end."]
    assert [e.text for e in drain(around) if e.kind == "start"] == ["First one.", "Last one.", "And the end."]
    cancelled = on.session(**PARAMS)
    cancelled.cancel()
    with pytest.raises(SessionClosed, match="cancelled session"):
        cancelled.feed("Too late.")
    assert [(e.kind, e.cancelled) for e in drain(cancelled)] == [("closed", True)]
    for bad, words in [(dict(max_chars=0), "max_chars must be an integer in \\[1, "),
                       (dict(max_chars=10**6), "max_chars must be an integer in"),
                       (dict(max_buffered_chars=0), "max_buffered_chars >= 1"),
                       (dict(temperature=-1), "temperature must be in"),
                       (dict(speed=2), "unknown synthesis parameter")]:
        with pytest.raises((ValueError, TypeError), match=words):
            on.session(**PARAMS, **bad)


def test_long_pieces_are_cut_at_max_chars_and_unspoken_text_is_bounded(on):
    run_on = "the quick brown fox jumps over the lazy dog and keeps on running without a pause"
    session = on.session(**PARAMS, max_chars=20, max_buffered_chars=100)
    session.feed(run_on[:50])  # no boundary, but past max_chars: cut at the most words that fit
    assert session.segments == ["the quick brown fox", "jumps over the lazy"]
    with pytest.raises(SessionFull, match="not yet spoken and this piece has 101: at most 100"):
        session.feed("x" * 101)  # refused whole; the session goes on
    session.feed(run_on[50:])
    session.close()
    assert session.segments == clause_segments(run_on, 20)
    assert all(len(s) <= 20 for s in session.segments)
    events = drain(session)
    assert [e.text for e in events if e.kind == "end"] == session.segments and events[-1].error is None


def test_feed_with_wait_takes_a_piece_larger_than_the_room_in_parts(on):
    """A producer faster than speech (`speak - --stream-text`): a piece larger than the room left beside a clause
    still being written goes in as utterances start; the cut is the text's, as if fed at once."""
    text = " ".join(f"word{i}" for i in range(60))  # 409 characters, no boundary
    session = on.session(**PARAMS, max_chars=20, max_buffered_chars=100)
    session.feed(text[:30])  # "word6 wo" stays: the clause goes on
    with pytest.raises(SessionFull):
        session.feed(text[30:])
    session.feed(text[30:], wait=True)
    session.close()
    assert session.segments == clause_segments(text, 20)
    events = drain(session)
    assert [e.text for e in events if e.kind == "end"] == session.segments and events[-1].error is None


def test_pieces_fed_with_wait_from_two_threads_are_never_interleaved(on):
    """Two producers feeding one session with wait=True into a small buffer: each piece goes in whole (its parts
    were interleaved with the other thread's, mid-word)."""
    pieces = [" ".join(["aaaa"] * 30) + ". ", " ".join(["bbbb"] * 30) + ". "]
    session = on.session(**PARAMS, max_chars=20, max_buffered_chars=40)
    threads = [threading.Thread(target=session.feed, args=(piece,), kwargs=dict(wait=True)) for piece in pieces]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(SessionFull, match="at most 40"):
        session.feed("c" * 41)
    session.close()
    assert drain(session)[-1].error is None
    letters = "".join(w[0] for w in " ".join(session.segments).split())
    assert sorted(letters) == sorted("a" * 30 + "b" * 30)
    assert letters in ("a" * 30 + "b" * 30, "b" * 30 + "a" * 30), session.segments


def test_feed_with_wait_speaks_a_full_buffer_that_no_boundary_cuts(on):
    session = on.session(**PARAMS, max_chars=30, max_buffered_chars=30)
    session.feed("x" * 30)  # a word as long as max_chars: its cut needs one more character
    session.feed("yz.", wait=True)  # no room, nothing to wait for: what is buffered is spoken
    session.close()
    assert session.segments == ["x" * 30, "yz."]
    assert drain(session)[-1].error is None


def test_whitespace_before_any_text_is_not_held_as_unspoken_text(on):
    session = on.session(**PARAMS, max_buffered_chars=100)
    session.feed(" " * 100)
    session.feed("\n" * 500)  # more than the bound, but nothing to speak
    session.feed("Hi there. ")
    session.feed(" " * 99)  # after a cut segment: the rest is whitespace, not kept either
    session.feed("Bye.")
    session.close()
    assert session.segments == ["Hi there.", "Bye."]
    assert drain(session)[-1].error is None


def count_steps(on, monkeypatch) -> list[int]:
    """[decode steps so far], kept up to date: barge-in is measured in frames, not milliseconds."""
    count = [0]
    if isinstance(on, TTS):
        step = on.decoder.step_fn

        def counted(*args):
            count[0] += 1
            return step(*args)

        monkeypatch.setattr(on.decoder, "step_fn", counted)
    else:
        for n, step in list(on.decoder.steps.items()):
            def counted(*args, _step=step):
                count[0] += 1
                return _step(*args)

            monkeypatch.setitem(on.decoder.steps, n, counted)
    return count


@pytest.mark.parametrize("kind", ["tts", "engine"])
def test_cancel_mid_audio_stops_within_a_frame_and_frees_the_slot(kind, endless, engine, monkeypatch):
    """Cancel at an utterance's first audio chunk, from the audio callback, while the utterance (EOS ignored,
    200 frames) is mid-way: at most the one step already queued runs after cancel() returns, no audio or end
    event follows, the next clause never starts, and the slot is free once "closed" has come."""
    on = endless if kind == "tts" else engine
    steps = count_steps(on, monkeypatch)
    at_cancel, events = [], []
    state = {}

    def on_audio(chunk):
        if not at_cancel:
            state["session"].cancel()
            at_cancel.append(steps[0])

    extra = dict(ignore_eos=True) if on is engine else {}
    session = state["session"] = on.session(**{**PARAMS, "max_frames": 200}, **extra, on_audio=on_audio,
                                            on_event=events.append)
    session.feed("Hello there, how are you? ")
    assert session.read(TIMEOUT) is None  # everything went to on_event: iteration just waited for the end
    assert [e.kind for e in events] == ["start", "audio", "closed"] and events[-1].cancelled
    assert steps[0] - at_cancel[0] <= 1
    (result,) = session.speech.results  # the second clause never started
    assert result.stopped and not result.finished and session.stats.stopped
    assert result.frames.shape[0] < 100  # cut mid-way, far from its 200 frames
    if on is engine:
        assert engine.metrics()["active_slots"] == 0 and engine.jobs_cancelled >= 1
    else:
        assert endless.synthesize("Free again.", seed=1, max_frames=12).size > 0  # the one slot is free


@pytest.mark.parametrize("call", ["stream_wait", "stream", "synthesize"])
def test_an_on_audio_callback_starting_a_stream_on_its_own_engine_raises_instead_of_hanging(endless, call):
    """on_audio runs on the session's thread, which reads the utterance the model thread runs while it holds the
    engine's one slot: a stream started there with wait=True waited for that slot forever (and the model thread for
    its reader). It raises the engine's error for a callback of its own stream, which says what to do instead;
    the session speaks on, and the engine is free after it."""
    start = {"stream_wait": lambda: list(endless.stream("From the callback.", seed=1, max_frames=12, wait=True)),
             "stream": lambda: list(endless.stream("From the callback.", seed=1, max_frames=12)),
             "synthesize": lambda: endless.synthesize("From the callback.", seed=1, max_frames=12)}[call]
    errors, audio = [], []

    def on_audio(pcm):
        audio.append(pcm)
        if len(audio) == 1:  # the utterance (EOS ignored) runs on: its turn holds the slot
            try:
                start()
            except RuntimeError as e:
                errors.append(str(e))

    session = endless.session(**PARAMS, on_audio=on_audio)
    session.feed("Hello there, ")
    session.close()
    if not session.join(TIMEOUT):
        endless.stop()  # let the wedged callback and session go, so the other tests can run
        pytest.fail("a session callback waiting for its own engine's slot hung")
    assert len(errors) == 1 and "callback of its stream or session" in errors[0]
    assert "start it from another thread" in errors[0]
    assert session.error is None and session.stats.frames == PARAMS["max_frames"] and len(audio) > 1
    assert endless.synthesize("Free again.", seed=1, max_frames=12).size > 0


def test_a_callback_waiting_for_its_own_session_raises_instead_of_hanging(on):
    """A callback runs on the session's thread, which makes the room for text and the events: feed(wait=True)
    there, with the buffer full of clauses to speak, waited for itself forever, and so did read(); join() there
    raised Python's "cannot join current thread". All raise at once, whatever the buffer holds, saying what to do instead; the session speaks on."""
    state, errors, returned = {}, [], threading.Event()

    def on_audio(pcm):
        if returned.is_set():
            return
        for call in (lambda: state["session"].feed(" More words here, and more." * 10, wait=True),
                     lambda: state["session"].read(), lambda: state["session"].join(0.01)):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))
        returned.set()

    session = state["session"] = on.session(**PARAMS, on_audio=on_audio, max_buffered_chars=40)
    session.feed("Hello there, how are you today? I am")  # the room is full of clauses to speak
    if not returned.wait(TIMEOUT):
        session.cancel()  # the waiting feed ends with SessionClosed: the other tests can run
        pytest.fail("a callback waiting for its own session hung")
    session.close()
    assert session.join(TIMEOUT) and session.error is None and len(session.segments) == 3
    assert len(errors) == 3, errors
    assert errors[0].startswith("feed(text, wait=True) from a callback of this session would wait for itself")
    assert errors[1].startswith("reading its events from a callback of this session would wait for itself")
    assert errors[2].startswith("join() from a callback of this session would wait for itself")
    assert all("call it from another thread" in e for e in errors)


def test_cancel_from_another_thread_drops_audio_not_yet_read(on):
    session = on.session(**PARAMS)
    session.feed(TEXT)
    assert session.read(TIMEOUT).kind == "start"
    threading.Thread(target=session.cancel).start()
    session.join(TIMEOUT)  # ended: every event it made is queued by now
    rest = drain(session)
    assert rest[-1].kind == "closed" and rest[-1].cancelled
    assert all(e.kind in ("start", "end") for e in rest[:-1])  # the audio queued before cancel() was dropped
    assert session.stats.stopped


def test_callbacks_get_the_events_and_async_iteration(on):
    audio, events = [], []
    session = on.session(**PARAMS, on_audio=audio.append)
    session.feed("Callbacks, ")
    session.close()
    rest = drain(session)  # with on_audio only, iteration yields the other events
    assert [e.kind for e in rest] == ["start", "end", "closed"] and len(audio) > 0

    async def consume():
        s = on.session(**PARAMS, on_event=events.append)
        s.feed("Async, ")
        s.close()
        return [e async for e in s]

    assert asyncio.run(consume()) == [] and [e.kind for e in events if e.kind != "audio"] == ["start", "end",
                                                                                              "closed"]

    async def iterate():
        s = on.session(**PARAMS)
        s.feed("Async, ")
        s.close()
        return [e async for e in s]

    got = asyncio.run(iterate())
    assert [e.kind for e in got if e.kind != "audio"] == ["start", "end", "closed"]
    assert np.array_equal(pcm(got), np.concatenate([e.pcm for e in events if e.kind == "audio"]))


@pytest.mark.parametrize("raises_on", [("start", "audio", "end", "error", "closed"), ("closed",)])
def test_an_on_event_callback_that_raises_ends_the_session_instead_of_hanging_its_readers(on, raises_on):
    """on_event raising on the "error" or "closed" event killed the session's thread before the session was marked
    finished: read() and iteration then waited forever. Now the session ends (its last event reached on_event)
    and keeps the callback's error."""
    seen = []

    def on_event(event):
        seen.append(event.kind)
        if event.kind in raises_on:
            raise ValueError(f"callback failed on {event.kind}")

    session = on.session(**PARAMS, on_event=on_event)
    session.feed("Hello there. ")
    session.close()
    assert session.join(TIMEOUT) and session.read(TIMEOUT) is None and list(session) == []
    assert seen[-1] == "closed" and seen.count("closed") == 1
    assert isinstance(session.error, ValueError) and f"on {raises_on[0]}" in str(session.error)
    if raises_on[0] == "start":
        assert seen == ["start", "error", "closed"]


def test_a_session_dropped_unclosed_leaves_no_thread(on):
    """A session dropped without close() (an exception path that skipped it) kept its thread waiting for text
    forever, one more per dropped session. Its thread holds it only while it has work: once nothing is left to
    speak, the session is collected and its thread ends."""
    threads = []
    for text in ("Hello", "Hello there, and"):  # nothing to speak yet; a clause to speak first
        for _ in range(3):
            session = on.session(**PARAMS)
            session.feed(text)
            threads.append(session._thread)
    del session
    gc.collect()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)


def test_audio_nobody_reads_is_bounded(on):
    session = on.session(**PARAMS, max_buffered_s=0.01)
    session.feed(TEXT)
    session.close()
    assert session.join(TIMEOUT)
    events = drain(session)
    assert [e.kind for e in events] == ["start", "error", "closed"]
    assert "unread" in events[1].error and events[-1].error == events[1].error and not events[-1].cancelled
    assert isinstance(session.error, BufferFull)


def test_an_error_event_carries_the_exception_on_one_line_or_its_type():
    from higgs_rt.session import error_line

    assert error_line(ValueError("bad\n  input\there")) == "bad input here"
    assert error_line(BufferFull()) == "BufferFull" and error_line(ValueError("  ")) == "ValueError"


def test_feed_after_a_failure_says_so_instead_of_keeping_the_text(on):
    session = on.session(**PARAMS, max_buffered_s=0.01)
    session.feed("Hello there. ")  # its audio is not read: the session fails
    assert session.join(TIMEOUT) and isinstance(session.error, BufferFull)
    for call in (lambda: session.feed("More."), session.flush):
        with pytest.raises(SessionClosed, match=r"on a session that failed \(more than 0\.01 s of audio"):
            call()


def test_an_engines_sessions_take_its_unread_audio_cap(tts):
    engine = BatchEngine(tts, slots=1, queue=1, max_buffered_s=0.01)  # `serve --max-buffered-s`
    try:
        session = engine.session(**PARAMS)
        session.feed(TEXT)
        session.close()
        assert session.join(TIMEOUT) and isinstance(session.error, BufferFull)
        assert "more than 0.01 s of audio" in str(session.error)
    finally:
        engine.close()


def test_a_busy_engine_ends_the_session_with_an_error(tts):
    engine = BatchEngine(tts, slots=1, queue=0, benchmark=True)
    try:
        busy = engine.submit("Holds the only slot.", seed=1, ignore_eos=True, max_frames=2000)
        session = engine.session(**PARAMS)
        session.feed("No slot for me. ")
        events = drain(session)
        assert [e.kind for e in events] == ["start", "error", "closed"]
        assert "all 1 slots are busy" in events[1].error and isinstance(session.error, QueueFull)
        busy.cancel()
    finally:
        engine.close()


def test_the_plain_api_takes_a_list_of_segments(tts, engine):
    segments = ["First sentence.", "Second one."]
    stream = tts.stream(segments, **PARAMS)
    audio = np.concatenate(list(stream))
    assert stream.stats.utterances == 2
    assert np.array_equal(np.concatenate(list(engine.submit(segments, **PARAMS))), audio)
    for bad, words in [([], "the list of segments is empty"), (["Fine.", "  "], "segment 1 is empty"),
                       (["Fine.", 3], "segment 1 must be a string")]:
        with pytest.raises(PromptError, match=words):
            tts.stream(bad)
        with pytest.raises(PromptError, match=words):
            engine.submit(bad)


@pytest.mark.parametrize("name", ["on_audio", "on_event"])
def test_callbacks_that_are_not_callable_are_refused_when_the_session_opens(on, name):
    """They failed only later, as the session's "error" event."""
    with pytest.raises(TypeError, match=f"^{name} must be callable or None, got int$"):
        on.session(**PARAMS, **{name: 5})


def test_a_session_whose_max_frames_leaves_no_room_for_any_utterance_is_refused(tts):
    context = tts.model.context
    with pytest.raises(ValueError, match=rf"max_frames \({context - 3}\) leaves no room for any utterance.*context "
                                         rf"of {context} positions; use at most \d+"):
        tts.session(max_frames=context - 3)
    most = int(str(pytest.raises(ValueError, tts.session, max_frames=context - 3).value).rsplit(" ", 1)[1])
    tts.session(max_frames=most).close()  # the bound it names is one that works
