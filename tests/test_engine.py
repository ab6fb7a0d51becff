"""The TTS engine on a tiny random model: streaming equals offline decode, seeds, long text, stop, playback."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from higgs_rt.engine import TTS, Stream, Voice
from higgs_rt.params import SynthesisParams
from higgs_rt.prompt import PromptError

LONG = " ".join(f"This is sentence number {i} of a long text." for i in range(40))
TIMEOUT = 300  # seconds: only a hang gets near it on a loaded 2-core machine


@pytest.fixture(scope="module")
def tts(random_model):
    return TTS(random_model, device="cpu")


def offline(tts: TTS, frames: list[torch.Tensor]) -> np.ndarray:
    """A call's audio decoded offline, utterance by utterance, from its frames."""
    parts = [tts.codec.decode(tts.codec.postprocess(f)[None])[0] for f in frames]
    return torch.cat(parts).numpy() if parts else np.zeros(0, np.float32)


def spoken(tts: TTS, text: str, **params) -> tuple[np.ndarray, Stream]:
    """One call's whole audio (as `synthesize` joins it) and its ended stream, which carries its stats and frames."""
    with tts.stream(text, **params) as stream:
        chunks = list(stream)
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), stream


def test_synthesize_equals_offline_decode_of_the_frames(tts):
    audio, stream = spoken(tts, "Hello there. How are you today?", seed=3)
    np.testing.assert_array_equal(tts.synthesize("Hello there. How are you today?", seed=3), audio)
    assert audio.dtype == np.float32 and audio.ndim == 1 and audio.size > 0
    assert audio.size % 960 == 0
    aligned = sum(f.shape[0] - 1 - 8 for f in stream.frames)  # drop BOS frame and all-EOS frame, undo delay
    assert all(bool((f[-1] == tts.talker.cfg.stream_eos_id).all()) for f in stream.frames)
    assert audio.size == aligned * 960
    np.testing.assert_allclose(audio, offline(tts, stream.frames), atol=1e-5)
    assert stream.stats.audio_s == pytest.approx(audio.size / 24000)


def test_stream_chunks_and_callback(tts):
    seen = []
    stream = tts.stream("Streaming works in chunks.", seed=4, on_chunk=seen.append)
    chunks = list(stream)
    assert len(chunks) == len(seen) >= 1 and all(a is b for a, b in zip(chunks, seen))
    np.testing.assert_allclose(np.concatenate(chunks), offline(tts, stream.frames), atol=1e-5)
    stats = stream.stats
    assert stats.first_audio_s is not None and 0 < stats.first_audio_s <= stats.synthesis_s
    assert stats.rtf == pytest.approx(stats.synthesis_s / stats.audio_s)


def test_same_seed_same_audio_different_seed_different_audio(tts):
    a = tts.synthesize("Reproducible speech.", seed=9)
    b = tts.synthesize("Reproducible speech.", seed=9)
    c = tts.synthesize("Reproducible speech.", seed=10)
    np.testing.assert_array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)


def test_long_text_is_split_and_streamed_back_to_back(tts):
    audio, stream = spoken(tts, LONG, seed=1, max_frames=40)
    stats = stream.stats
    assert stats.utterances == len(stream.frames) > 1
    np.testing.assert_allclose(audio, offline(tts, stream.frames), atol=1e-5)


def test_truncated_utterance_is_reported(tts):
    _, stream = spoken(tts, "Cut short.", seed=0, max_frames=9)
    assert stream.stats.truncated == 1


def test_long_text_is_split_at_clauses_before_words(tts):
    """The engine's segments come from text_split: a sentence too long for the budget is cut at its comma."""
    text = "The quick brown fox jumps over the lazy dog, and the cat sleeps."
    p = SynthesisParams.create(max_frames=100)  # a budget of 44 characters
    assert tts.model.segments(text, None, p) == ["The quick brown fox jumps over the lazy dog,", "and the cat sleeps."]


def count_work(tts: TTS, monkeypatch) -> dict[str, int]:
    """{"start": utterances prefilled, "step_fn": decode steps} so far, kept up to date: barge-in is measured
    in frames, not milliseconds."""
    counts = {}
    for name in ("start", "step_fn"):
        counts[name] = 0

        def counted(*args, _name=name, _fn=getattr(tts.decoder, name)):
            counts[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(tts.decoder, name, counted)
    return counts


def stop_in_a_thread(tts: TTS, counts: dict[str, int]) -> list[dict[str, int]]:
    """tts.stop() from another thread; returns [the counts when stop() had returned] once it has."""
    at_stop = []
    stopper = threading.Thread(target=lambda: (tts.stop(), at_stop.append(dict(counts))), daemon=True)
    stopper.start()
    return at_stop


def test_stop_from_another_thread_ends_the_stream_within_a_frame(tts, monkeypatch):
    """At most the step already queued runs after stop(), and no later utterance starts (counted, not timed)."""
    counts, chunks, at_stop = count_work(tts, monkeypatch), 0, None
    stream = tts.stream(LONG, seed=2, max_frames=60)
    for _ in stream:
        chunks += 1
        if chunks == 2:
            at_stop = stop_in_a_thread(tts, counts)
            deadline = time.monotonic() + 30  # only a hang of stop() itself gets this far
            while not at_stop and time.monotonic() < deadline:
                time.sleep(0.001)
            assert at_stop, "stop() did not return"
    assert stream.stats.stopped and stream.stats.utterances == at_stop[0]["start"] < len(tts.model.segments(
        LONG, None, SynthesisParams.create(max_frames=60)))  # no utterance began after stop()
    assert counts["start"] == at_stop[0]["start"] and counts["step_fn"] - at_stop[0]["step_fn"] <= 1


def test_stop_before_the_first_chunk_ends_that_stream_only(tts, monkeypatch):
    """stop() between stream() and its first iteration ends that stream (nothing prefilled); a stream waiting for
    the slot is woken and ends too; a stream made after stop() runs whole."""
    counts = count_work(tts, monkeypatch)
    made = tts.stream("Never spoken.", seed=1)
    tts.stop()
    assert list(made) == [] and made.stats.stopped and counts["start"] == 0
    after = tts.stream("Spoken.", seed=1, max_frames=30)
    assert len(list(after)) >= 1 and not after.stats.stopped and counts["start"] == 1

    holder = tts.stream(LONG, seed=2)
    next(holder)  # holds the slot
    waiter, result = tts.stream("Waiting.", seed=1, wait=True), []
    thread = threading.Thread(target=lambda: result.append(list(waiter)), daemon=True)
    thread.start()
    time.sleep(0.05)  # the waiter is (most likely) asleep on the slot; stop() must wake it either way
    tts.stop()
    thread.join(30)
    assert not thread.is_alive() and result == [[]] and waiter.stats.stopped
    assert list(holder) == [] or holder.stats.stopped
    holder.close()
    assert tts.synthesize("Free again.", max_frames=30).size > 0


def test_stop_frees_the_slot_of_a_stream_whose_consumer_is_busy(tts, monkeypatch):
    """Barge-in while the consumer of the running stream is busy elsewhere (it holds a chunk, as a blocking audio
    sink does): the next call starts once stop() has returned, and the stopped stream, when its consumer comes
    back, ends without stepping the decoder again (the slot is the new call's by then)."""
    counts = count_work(tts, monkeypatch)
    got_chunk, resume, chunks = threading.Event(), threading.Event(), []

    def consumer(stream):
        for pcm in stream:
            chunks.append(pcm)
            got_chunk.set()
            resume.wait(TIMEOUT)  # busy with its chunk

    old = tts.stream(LONG, seed=2, max_frames=60)
    thread = threading.Thread(target=consumer, args=(old,), daemon=True)
    thread.start()
    assert got_chunk.wait(TIMEOUT)
    tts.stop()
    assert tts.synthesize("Next reply.", seed=1, max_frames=30).size > 0  # was: "already streaming"
    at_new = dict(counts)
    resume.set()
    thread.join(TIMEOUT)
    assert not thread.is_alive() and len(chunks) == 1 and old.stats.stopped
    assert counts == at_new  # the stopped stream, resumed, neither prefilled nor stepped

    held = tts.stream(LONG, seed=2, max_frames=60)
    for _ in held:
        break  # still referenced: not closed
    tts.stop()
    assert tts.synthesize("Next reply.", seed=1, max_frames=30).size > 0
    at_new = dict(counts)
    assert list(held) == [] and held.stats.stopped and counts == at_new


def test_a_stream_stopped_mid_chunk_lets_the_next_one_wait_for_the_slot(tts):
    """stop() while the stream is working (here: inside its on_chunk callback) cannot take the slot back; a call
    made after it waits for the stream to let go (it does at that chunk) instead of raising. The same call made
    from that callback, which would wait for itself, raises."""
    in_callback, leave, old_chunks, new_audio = threading.Event(), threading.Event(), [], []

    def on_chunk(pcm):
        in_callback.set()
        leave.wait(TIMEOUT)

    old = tts.stream(LONG, seed=2, max_frames=60, on_chunk=on_chunk)
    thread = threading.Thread(target=lambda: old_chunks.extend(old), daemon=True)
    thread.start()
    assert in_callback.wait(TIMEOUT)
    tts.stop()
    new = threading.Thread(target=lambda: new_audio.append(tts.synthesize("Next reply.", seed=1, max_frames=30)),
                           daemon=True)
    new.start()
    time.sleep(0.05)  # the new call (most likely) waits for the slot; it must get it either way
    leave.set()
    new.join(TIMEOUT)
    thread.join(TIMEOUT)
    assert not new.is_alive() and not thread.is_alive() and old.stats.stopped
    assert len(old_chunks) == 1 and new_audio[0].size > 0  # the chunk stop() came in was the stream's last

    errors = []

    def reentrant(pcm):
        tts.stop()
        try:
            tts.synthesize("From the callback.")
        except RuntimeError as e:
            errors.append(str(e))

    assert len(list(tts.stream(LONG, seed=2, max_frames=60, on_chunk=reentrant))) == 1
    assert errors and "already streaming" in errors[0]


def test_a_callback_that_waits_for_its_own_engine_raises_instead_of_hanging(tts):
    """on_chunk starting a stream with wait=True on the same engine (stopped first or not) would wait for the
    stream it runs in, forever: it raises, and both the outer stream and the engine go on."""
    errors, chunks, done = [], [], threading.Event()

    def reentrant(stop: bool):
        def on_chunk(pcm):
            if stop:
                tts.stop()
            try:
                list(tts.stream("From the callback.", seed=1, max_frames=20, wait=True))
            except RuntimeError as e:
                errors.append(str(e))
        return on_chunk

    def run():
        try:
            for stop in (False, True):
                chunks.append(len(list(tts.stream(LONG, seed=2, max_frames=60, on_chunk=reentrant(stop)))))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(TIMEOUT):
        tts.stop()  # let the wedged stream go, so the other tests can run
        pytest.fail("a callback waiting for its own engine's slot hung")
    assert chunks[0] > 1 and chunks[1] == 1 and len(errors) == chunks[0] + 1
    assert all("callback of its stream" in e for e in errors)
    assert tts.synthesize("Free again.", max_frames=30).size > 0


def test_a_stream_closed_early_reports_it_stopped(tts):
    stream = tts.stream(LONG, seed=2, max_frames=60)
    next(stream)
    stream.close()
    assert stream.stats.stopped and stream.stats.utterances == 1 and stream.frames[0].shape[0] > 1  # kept
    with tts.stream(LONG, seed=2, max_frames=60) as stream:
        next(stream)
    assert stream.stats.stopped
    with tts.stream(LONG, seed=2) as stream:  # never iterated
        pass
    assert stream.stats.stopped and stream.frames == []
    with tts.stream("Whole.", seed=2, max_frames=30) as stream:
        assert len(list(stream)) >= 1
    assert not stream.stats.stopped  # ended before it was closed


def test_a_stream_closed_from_another_thread_while_its_consumer_is_in_next_stops(tts):
    """Stream.close() from another thread while the consumer is inside next() (here: in on_chunk) was a ValueError
    ("generator already executing") and the stream ran on: now it stops the stream (that chunk is its last) and the
    slot is free for the next call once that chunk is out."""
    in_callback, leave, chunks, done = threading.Event(), threading.Event(), [], threading.Event()
    stream = tts.stream(LONG, seed=2, max_frames=60, on_chunk=lambda pcm: (in_callback.set(), leave.wait(TIMEOUT)))

    def consume():
        try:
            chunks.extend(stream)
        finally:
            done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert in_callback.wait(TIMEOUT)
    stream.close()  # was: ValueError
    leave.set()
    assert done.wait(TIMEOUT) and len(chunks) == 1 and stream.stats.stopped
    assert tts.synthesize("Free again.", max_frames=30).size > 0
    stream.close()  # ended: closing again is a no-op


def test_abort_callback_and_one_stream_at_a_time(tts):
    calls = []
    stream = tts.stream(LONG, seed=2, abort=lambda: calls.append(1) or len(calls) > 3)
    audio = list(stream)
    # polled before the utterance's prefill, then once per frame: True at the 4th poll, after frame 3
    assert stream.stats.stopped and stream.stats.frames == 3 and len(calls) == 4
    first = tts.stream("A.", seed=1)
    next(first)
    with pytest.raises(RuntimeError, match="already streaming"):
        next(tts.stream("B.", seed=1))
    first.close()
    assert tts.synthesize("Free again.").size > 0
    del audio


def test_waiting_for_the_slot_on_the_thread_reading_the_stream_that_holds_it_raises(tts):
    """The thread that reads a stream (suspended at a chunk) waiting for the slot would wait for itself: the
    stream moves on only when that thread reads it. It raised nothing and hung; it raises at once now. Another
    thread's wait is still served once the stream ends."""
    first = tts.stream(LONG, seed=1)
    outcome = []

    def second():
        try:
            next(tts.stream("B.", seed=1, wait=True))
            outcome.append("ran")
        except RuntimeError as e:
            outcome.append(str(e))

    def reads_first_then_waits():
        next(first)
        second()

    try:
        same = threading.Thread(target=reads_first_then_waits, daemon=True)
        same.start()
        same.join(TIMEOUT)
        assert not same.is_alive(), "the wait on the thread reading the stream hung"
        assert outcome == ["this TTS engine is already streaming to this thread: waiting here for the slot would "
                           "wait for itself (read the stream to its end or close it first, or wait from another "
                           "thread)"]
        # another thread (which may reuse the ended reader's ident: the guard compares threads, not idents) waits,
        # then runs once `first` ends
        other = threading.Thread(target=second, daemon=True)
        other.start()
        time.sleep(0.2)
        assert outcome[1:] == []
        first.close()
        other.join(TIMEOUT)
        assert outcome[1:] == ["ran"]
    finally:
        first.close()  # a failure here leaves the module's TTS free for the next tests


@pytest.mark.parametrize("device,message", [
    ("banana", r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'banana'$"),
    ("meta", r"^device 'meta': higgs-rt runs on 'cpu' or 'cuda'$"),
    ("cuda:99", r"^device 'cuda:99': (this torch build has no CUDA|no CUDA GPU is visible|this machine has \d+ CUDA)"),
    pytest.param("cuda", r"^device 'cuda': (this torch build has no CUDA|no CUDA GPU is visible) \(use 'cpu'\)$",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_a_device_this_machine_cannot_use_is_one_line(random_model, device, message):
    with pytest.raises(ValueError, match=message):
        TTS(random_model, device=device)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dtype=torch.int8), ValueError, r"^dtype must be torch.float32, torch.bfloat16, torch.float16 or one of fp32, "
                                         r"float32, bf16, bfloat16, fp16, float16, got torch.int8$"),
    (dict(dtype=torch.float64), ValueError, r"^dtype must be torch.float32, .*, got torch.float64$"),
    (dict(dtype="fp64"), ValueError, r"^dtype must be torch.float32, .*, got 'fp64'$"),
    (dict(compile="bogus"), ValueError, r"^compile must be None \(eager\) or a torch.compile mode \(default, .*"
                                        r"max-autotune.*\), got 'bogus'$"),
    (dict(first_chunk="a"), TypeError, r"^first_chunk must be an integer number of frames in 1\.\.64, got str$"),
    (dict(chunk=0), ValueError, r"^chunk must be an integer number of frames in 1\.\.64, got 0$"),
    (dict(first_chunk=65), ValueError, r"^first_chunk must be an integer number of frames in 1\.\.64, got 65$"),
    (dict(model=123), TypeError, r"^model must be a model directory or a Hugging Face repo id \(str or Path\), "
                                 r"got int$"),
])
def test_constructor_arguments_are_checked_before_the_model_loads(tmp_path, kwargs, error, message):
    """Each was taken and failed only later: a dtype the kernels cannot run at the first synthesis ("rms_norm: x
    must be a float tensor"), compile inside torch.compile, first_chunk comparing str and int, a model that is no
    name as "no model directory at 123". With a model directory that does not exist, the argument's own error
    comes first."""
    with pytest.raises(error, match=message):
        TTS(**{"model": tmp_path / "absent", "device": "cpu", **kwargs})


def test_callbacks_that_are_not_callable_are_refused_at_the_call(tts):
    """They were a bare "'int' object is not callable" once iterating."""
    for name in ("on_chunk", "abort"):
        with pytest.raises(TypeError, match=f"^{name} must be callable or None, got int$"):
            tts.stream("Hi.", **{name: 5})
    with pytest.raises(TypeError, match="^on_chunk must be callable or None, got str$"):
        tts.speak("Hi.", on_chunk="print")
    assert tts.synthesize("Still works.", seed=1, max_frames=20).size  # nothing was left holding the slot


def test_speak_checks_its_arguments_before_it_opens_the_device(tts, monkeypatch):
    """An argument error, not the device's (a machine without sound said AudioDeviceError for a bad parameter)."""
    import higgs_rt.audio_out

    opened = []
    monkeypatch.setattr(higgs_rt.audio_out, "AudioPlayer", lambda **kw: opened.append(kw) or pytest.fail("opened"))
    with pytest.raises(TypeError, match="unknown synthesis parameter"):
        tts.speak("", bogus=1)
    with pytest.raises(ValueError, match="temperature"):
        tts.speak("Hi.", temperature=-1)
    with pytest.raises(PromptError, match="empty"):
        tts.speak("  ")
    with pytest.raises(TypeError, match="voice must be a Voice"):
        tts.speak("Hi.", voice=5)
    assert opened == []


def test_bad_parameters(tts):
    with pytest.raises(TypeError, match="unknown synthesis parameter"):
        tts.synthesize("x", speed=2.0)
    with pytest.raises(ValueError, match="temperature"):
        tts.synthesize("x", temperature=-1)
    with pytest.raises(ValueError, match="max_frames"):
        tts.synthesize("x", max_frames=5)
    with pytest.raises(PromptError, match="empty"):
        tts.synthesize("   ")


def test_text_none_and_a_voice_of_the_wrong_type_are_refused(tts):
    """text=None gave an empty stream (no audio, no error: None is how a text session starts its Speech), and a
    voice that is neither a Voice, a name nor None an AttributeError from inside the prompt builder."""
    with pytest.raises(PromptError, match="text must be a string, got NoneType"):
        tts.stream(None)
    with pytest.raises(PromptError, match="text must be a string, got NoneType"):
        tts.synthesize(None)
    for voice in (5, b"alice", {"name": "alice"}):
        with pytest.raises(TypeError, match=f"voice must be a Voice, a stored voice's name or None, got "
                                            f"{type(voice).__name__}"):
            tts.stream("Hello.", voice=voice)
    with pytest.raises(TypeError, match="voice must be a Voice"):
        tts.session(voice=5)
    with pytest.raises(ValueError, match=r"max_buffered_s > 0 \(finite\), got 4096 and inf"):
        tts.session(max_buffered_s=float("inf"))  # was an OverflowError from int(inf * sample_rate)
    assert tts.synthesize("Still works.", seed=1, max_frames=20).size  # nothing was left holding the slot


def test_voice_prompt_uses_the_reference(tts):
    ref, stream = spoken(tts, "A reference utterance.", seed=5)
    frames = stream.frames[0]
    voice = Voice("A reference utterance.", frames)
    a = tts.synthesize("Same words.", voice=voice, seed=6)
    b = tts.synthesize("Same words.", seed=6)
    assert ref.size and (a.shape != b.shape or not np.array_equal(a, b))


def test_speak_plays_through_portaudio(tts, pulse_device):
    chunks = []
    stats = tts.speak("Playing on a real stream.", device=pulse_device, seed=3, on_chunk=chunks.append)
    assert stats.audio_s > 0 and stats.underruns >= 0 and not stats.stopped
    assert sum(c.size for c in chunks) == round(stats.audio_s * 24000)


def test_stop_during_speak_ends_within_a_frame_and_leaves_no_thread(tts, pulse_device, monkeypatch):
    """stop() while speak() plays (from a thread started at the first chunk, so never before the stream began):
    at most one more step, the call reports it stopped, no thread is left. That stop() does not wait for queued
    audio is tested on its own in test_audio_out.py."""
    baseline = threading.active_count()
    counts, at_stop = count_work(tts, monkeypatch), []

    def first_chunk(chunk):
        if not at_stop:
            at_stop.append(stop_in_a_thread(tts, counts))

    stats = tts.speak(LONG * 3, device=pulse_device, seed=3, max_frames=60, on_chunk=first_chunk)
    deadline = time.monotonic() + 30  # generous: only a hang gets this far
    while (not at_stop[0] or threading.active_count() > baseline) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats.stopped and at_stop[0], "stop() did not return"
    assert stats.utterances == counts["start"] == at_stop[0][0]["start"]  # no utterance began after stop()
    assert counts["step_fn"] - at_stop[0][0]["step_fn"] <= 1
    assert threading.active_count() <= baseline


def test_the_stream_carries_its_results(tts):
    stream = tts.stream("Results travel with the stream.", seed=7)
    assert stream.stats.frames == 0 and stream.frames == []  # nothing runs before the first chunk is asked for
    audio = np.concatenate(list(stream))
    assert stream.stats.utterances == len(stream.frames) == 1 and stream.stats.frames == stream.frames[0].shape[0]
    assert stream.stats.audio_s == pytest.approx(audio.size / 24000) and stream.stats.prompt_tokens > 0
    other = tts.stream("Another call.", seed=8)
    list(other)
    assert stream.stats.frames == stream.frames[0].shape[0] and other.frames[0] is not stream.frames[0]
    assert other.stats is not stream.stats and other.stats.frames == other.frames[0].shape[0]  # each its own


def test_a_model_built_from_parts_speaks_as_the_loaded_one(tts):
    """`Model.from_parts` (what the benchmarks build around random weights in memory) gives a TTS the same audio
    for the same seed as the model loaded from its directory, and it refuses a context the Talker cannot hold."""
    from higgs_rt.model import Model

    parts = Model.from_parts(tts.talker, tts.codec, tts.prompts, context=tts.model.context)
    assert parts.model_dir is None and parts.compiled is None and parts.device == tts.device
    other = TTS(parts, warmup=False)
    np.testing.assert_array_equal(other.synthesize("Built from parts.", seed=6),
                                  tts.synthesize("Built from parts.", seed=6))
    with pytest.raises(ValueError, match="longer than the talker's"):
        Model.from_parts(tts.talker, tts.codec, tts.prompts, context=tts.talker.max_positions + 1)
