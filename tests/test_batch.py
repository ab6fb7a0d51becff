"""Continuous batching (higgs_rt.batch) on the tiny random model: equality with batch-1 generation, slot reuse,
per-job seeds, cancellation, the bounded queue, the loop's and the codec thread's counters, asyncio consumers."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from higgs_rt.batch import FIRST_AUDIO_STAGES, LOOP_PHASES, BatchEngine, QueueFull
from higgs_rt.engine import TTS
from higgs_rt.params import ParamError
from higgs_rt.prompt import PromptError
from conftest import wait_for

LONG = " ".join(f"Sentence {i} goes on." for i in range(100))  # about 100 utterances: seconds of work
TIMEOUT = 60  # generous: a loaded 2-core CI machine; no result depends on it


@pytest.fixture(scope="module")
def tts(random_model):
    return TTS(random_model, device="cpu")


@pytest.fixture
def engine(request, tts):
    slots, queue = getattr(request, "param", (2, 4))
    eng = BatchEngine(tts, slots=slots, queue=queue)
    yield eng
    eng.close()


def audio(job) -> np.ndarray:
    chunks = list(job)
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


@pytest.mark.parametrize("engine", [(1, 1)], indirect=True)
def test_alone_in_one_slot_equals_batch_1_generation(engine, tts):
    for text, params in [("Hello there. How are you today?", dict(seed=3)),
                         (" ".join(f"This is sentence {i}." for i in range(12)), dict(seed=1, max_frames=30))]:
        with tts.stream(text, **params) as stream:
            want = audio(stream)
        job = engine.submit(text, **params)
        np.testing.assert_array_equal(audio(job), want)
        assert job.stats.utterances == stream.stats.utterances and job.stats.frames == stream.stats.frames


def test_slots_are_reused_and_each_job_keeps_its_seed(engine):
    texts = [f"Request number {i} speaks." for i in range(5)]
    alone = [audio(engine.submit(t, seed=10 + i)) for i, t in enumerate(texts)]
    jobs = [engine.submit(t, seed=10 + i) for i, t in enumerate(texts)]  # 5 jobs share 2 slots
    for job, want in zip(jobs, alone):
        np.testing.assert_array_equal(audio(job), want)
        assert job.stats.first_audio_s is not None and job.stats.audio_s == pytest.approx(want.size / 24000)
    m = engine.metrics()
    assert m["jobs_completed"] == 10 and m["active_slots"] == 0 and m["queue_depth"] == 0
    assert m["frames_total"] >= sum(j.stats.frames - j.stats.utterances for j in jobs)


def test_int16_jobs_get_the_float_jobs_samples_as_to_int16_rounds_them(engine):
    from higgs_rt.pcm import to_int16

    texts = [("Hello there. How are you today?", 3), ("A second voice speaks beside it.", 4)]
    floats = [engine.submit(t, seed=s) for t, s in texts]
    ints = [engine.submit(t, seed=s, int16=True) for t, s in texts]  # mixed with float jobs in the same pushes
    for f, i in zip(floats, ints):
        chunks = list(i)
        assert chunks and all(c.dtype == np.int16 and c.ndim == 1 for c in chunks)
        want = to_int16(audio(f))
        np.testing.assert_array_equal(np.concatenate(chunks), want)
        assert np.abs(want.astype(np.int32)).max() > 0  # not silence


def test_an_int16_session_gets_the_float_sessions_samples_as_to_int16_rounds_them(engine):
    from higgs_rt.pcm import to_int16

    def spoken(**kw):
        pcm = []
        session = engine.session(seed=5, max_frames=20, on_audio=pcm.append, **kw)
        session.feed("First one. Second one.")
        session.close()
        assert session.join(TIMEOUT)
        return pcm

    floats, ints = spoken(), spoken(int16=True)
    assert ints and all(c.dtype == np.int16 for c in ints)
    np.testing.assert_array_equal(np.concatenate(ints), to_int16(np.concatenate(floats)))


def test_a_sessions_utterances_are_one_listener_for_the_codec_and_requests_each_their_own(engine, monkeypatch):
    """The codec's urgency waiver counts a listener's audio ahead across its utterances (`BatchCodec.start`'s
    player): a session's utterances are jobs of their own and one player; each request is its own."""
    players = []
    start = engine.codec.start
    monkeypatch.setattr(engine.codec, "start", lambda lane, job, int16=False, player=None: (
        players.append((job, player)), start(lane, job, int16, player))[1])
    session = engine.session(seed=5, max_frames=12)
    session.feed("First one. Second one.")
    session.close()
    assert session.join(TIMEOUT)
    requests = [engine.submit("Hello there. How are you today?", seed=s, max_frames=12) for s in range(2)]
    for job in requests:
        list(job)
    spoken, asked = players[:2], players[2:]
    assert len(spoken) == 2 and spoken[0][0] is not spoken[1][0] and spoken[0][1] is spoken[1][1]
    assert {job for job, _ in asked} == set(requests) and all(player is job.player for job, player in asked)
    assert len({id(player) for _, player in asked}) == 2 and spoken[0][1] not in [player for _, player in asked]


def test_cancel_frees_the_slot_before_the_next_step(engine):
    job = engine.submit(LONG, seed=1, max_frames=20)
    chunks = iter(job)
    next(chunks)
    assert engine.metrics()["active_slots"] == 1
    job.cancel()
    assert wait_for(lambda: engine.metrics()["active_slots"] == 0, 2.0)
    list(chunks)  # the stream ends (chunks decoded before the cancel may still come)
    assert job.stats.stopped and engine.metrics()["jobs_cancelled"] == 1
    assert job.stats.utterances < 20  # far from the whole text


@pytest.mark.parametrize("engine", [(1, 1)], indirect=True)
def test_queue_bound_then_queue_full(engine):
    running = engine.submit(LONG, seed=1, max_frames=20)
    assert wait_for(lambda: engine.metrics()["active_slots"] == 1)
    waiting = engine.submit("Waits for the slot.")
    with pytest.raises(QueueFull):
        engine.submit("One too many.")
    assert engine.metrics()["jobs_rejected"] == 1 and engine.metrics()["queue_depth"] == 1
    waiting.cancel()  # leaves the queue at once
    assert engine.metrics()["queue_depth"] == 0 and list(waiting) == []
    running.cancel()
    assert audio(engine.submit("The slot is free again.", seed=2)).size > 0


def test_bad_requests_fail_at_submit(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.submit("   ")
    with pytest.raises(TypeError, match="unknown synthesis parameter"):
        engine.submit("Hi.", speed=2)
    with pytest.raises(ValueError, match="max_frames"):
        engine.submit("Hi.", max_frames=3)
    with pytest.raises(ParamError, match=r"^max_frames \(10000\) leaves no room for any utterance") as e:
        engine.submit("Hi.", max_frames=10_000)  # no text would fit: max_frames' fault (it was the text's)
    assert e.value.param == "max_frames"
    with pytest.raises(PromptError, match="exceeds the context"):
        engine.submit("Hi. " * 300, max_frames=4000)  # this text does not fit: its own fault
    assert engine.metrics()["queue_depth"] == 0


def test_loop_and_codec_counters_add_up(engine):
    engine.reset_loop_seconds()
    engine.codec.reset_work()
    began = time.perf_counter()
    jobs = [engine.submit(f"Counted request {i} speaks.", seed=i, max_frames=20) for i in range(3)]  # 3 jobs, 2 slots
    assert all(audio(job).size for job in jobs)
    loop, work = engine.loop_seconds, engine.codec.work
    assert wait_for(lambda: loop["steps"] == engine.steps_total and work["busy_s"] >= work["push_s"] + work["tick_s"])
    elapsed = time.perf_counter() - began
    assert loop["ticks"] >= loop["steps"] > 0 and all(loop[p] >= 0 for p in LOOP_PHASES)
    assert loop["prefill"] > 0 and loop["step"] > 0 and loop["route"] > 0
    assert sum(loop[p] for p in LOOP_PHASES if p != "idle") <= elapsed  # idle may have begun before the reset
    assert loop["steps"] <= loop["rows"] <= loop["stepped"] <= 2 * loop["steps"]
    assert 0 < work["ticks"] <= loop["steps"] and 0 < work["pushes"] == engine.codec.pushes
    assert work["push_frames"] >= work["pushes"] and work["push_lanes"] >= work["pushes"]
    assert work["push_s"] > 0 and work["tick_s"] > 0 and work["busy_s"] <= elapsed
    assert work["gpu_s"] == 0 if engine.codec.stream is None else 0 < work["gpu_s"] < work["push_s"]
    assert 0 < loop["prefill_ticks"] <= loop["prefill_prompts"] == 3  # 3 jobs of one utterance each
    m = engine.metrics()
    assert m["loop_steps"] == m["steps_total"] and m["loop_ticks"] == loop["ticks"]
    assert m["prefill_forwards"] >= 3  # the CPU's prefill runs each prompt alone, since the engine began


def test_codec_calls_span_only_the_lanes_in_use(engine):
    """Jobs of one utterance each on 2 slots: a codec lane is freed before its job ends and the busy streams are
    kept in the lowest codec slots, so no codec call spans more than 2 (on the CPU a call's width is the busy
    slots, exactly), however many jobs come one after another."""
    engine.codec.reset_work()
    for wave in range(3):
        jobs = [engine.submit(f"Wave {wave} request {i} speaks.", seed=i, max_frames=20) for i in range(2)]
        assert all(audio(job).size for job in jobs)
        assert all(job.stats.utterances == 1 for job in jobs)
    work = engine.codec.work
    assert work["pushes"] > 0 and work["pushes"] <= work["push_lanes"] <= 2 * work["pushes"]
    assert engine.codec.lanes_in_use == 0


def test_a_jobs_marks_split_its_time_to_first_audio_in_order(engine):
    """3 jobs on 2 slots: the third waits for a slot. Each job passes every mark once, in FIRST_AUDIO_STAGES'
    order, and the stages add up to its arrival -> the first chunk taken."""
    jobs = [engine.submit(f"Timed request {i} speaks.", seed=i, max_frames=20) for i in range(3)]
    for job in jobs:
        it = iter(job)
        next(it)
        taken = time.perf_counter()
        times = [job.marks[mark] for _, mark in FIRST_AUDIO_STAGES[:-1]]  # all but the server's "sent"
        assert times == sorted(times) and times[-1] <= taken
        assert times[-1] - times[0] == pytest.approx(job.stats.first_audio_s)  # emitted - submitted
        stages = job.first_audio_stages(job.submitted - 0.5, taken)
        assert list(stages) == [stage for stage, _ in FIRST_AUDIO_STAGES] and stages["parse"] == pytest.approx(0.5)
        assert sum(stages.values()) == pytest.approx(taken - job.submitted + 0.5)
        assert stages["first_chunk"] > 0 and stages["codec"] > 0
        list(it)
    assert jobs[2].marks["slot"] > max(jobs[0].marks["slot"], jobs[1].marks["slot"])  # it waited for one


@pytest.mark.parametrize("engine", [(3, 4)], indirect=True)
def test_a_failing_prefill_fails_only_its_job(engine, monkeypatch):
    """Admission starts a tick's prompts together; when one of them fails to prefill, the others still start, the
    failed job ends with the error, and its codec lane and slot are given back."""
    prefill = engine.decoder.prefill_fn

    def failing(cache, slot, ids, audio_frames=None):
        if ids.shape[0] > 60:  # the long request only
            raise RuntimeError("prefill failed for this prompt")
        return prefill(cache, slot, ids, audio_frames)

    monkeypatch.setattr(engine.decoder, "prefill_fn", failing)
    long = " ".join(f"word{i}" for i in range(40))
    jobs = [engine.submit("Hi there.", seed=1), engine.submit(long, seed=2), engine.submit("Good day.", seed=3)]
    with pytest.raises(RuntimeError, match="prefill failed for this prompt"):
        audio(jobs[1])
    assert audio(jobs[0]).size > 0 and audio(jobs[2]).size > 0
    assert wait_for(lambda: engine.codec.lanes_in_use == 0 and not any(engine._slots))


def test_a_session_utterance_that_ends_at_once_leaves_its_slot_to_the_next_one(engine):
    """A text session's utterances are one job each, sharing one Speech. Forced here: the codec thread ends a job
    (and the session adds its next utterance) before the decode thread has left `_end_utterance`. The slot must
    still go back (the job was done when its utterance ended), or the old job would start the next utterance
    too and the new one fail with "an utterance is still running"."""
    events, next_started = [], threading.Event()

    def on_event(event):
        events.append(event)
        if event.kind == "start":
            next_started.set()

    original, waits = engine.codec.end, []

    def end_then_wait_for_the_next_utterance(lane, ended_at, final):
        original(lane, ended_at, final)
        if final and len(waits) < 2:  # the first two of three utterances: their job ends, the next one starts
            next_started.clear()
            waits.append(next_started.wait(TIMEOUT))

    engine.codec.end = end_then_wait_for_the_next_utterance
    session = engine.session(seed=2, max_frames=12, on_event=on_event)
    session.feed("First one. Second one. Third one.")
    session.close()
    assert session.join(TIMEOUT)
    assert waits == [True, True] and [e.utterance for e in events if e.kind == "start"] == [0, 1, 2]
    assert [e.kind for e in events if e.kind in ("start", "end", "error")] == ["start", "end"] * 3, \
        [e.error for e in events if e.kind == "error"]
    assert wait_for(lambda: engine.metrics()["active_slots"] == 0)


def test_async_consumers_of_one_loop_get_each_jobs_audio(engine):
    texts = [f"Request number {i} speaks." for i in range(3)]
    alone = [audio(engine.submit(t, seed=20 + i)) for i, t in enumerate(texts)]

    async def consume(job):
        return [chunk async for chunk in job.chunks()]

    async def all_jobs():
        jobs = [engine.submit(t, seed=20 + i) for i, t in enumerate(texts)]
        return await asyncio.wait_for(asyncio.gather(*(consume(j) for j in jobs)), TIMEOUT)

    for chunks, want in zip(asyncio.run(all_jobs()), alone):
        np.testing.assert_array_equal(np.concatenate(chunks), want)


def test_an_async_consumer_that_leaves_with_its_loop_does_not_hurt_the_engine(engine):
    async def first_chunk():
        job = engine.submit(LONG, seed=4, max_frames=20)
        async for chunk in job.chunks():
            return job, chunk  # leaves the stream (the job is cancelled), and asyncio.run closes the loop

    job, chunk = asyncio.run(first_chunk())
    assert chunk.size > 0 and wait_for(lambda: job._ended, TIMEOUT)
    after = engine.submit("Still serving.", seed=1)
    assert wait_for(lambda: after._ended, TIMEOUT)  # the decode and codec threads live on
    assert audio(after).size > 0


def test_no_frame_past_an_utterances_end_reaches_its_codec_lane(engine, monkeypatch):
    """The decode loop queues step t + 1 before it reads step t, where an utterance may end: that step's row must
    not reach the ended utterance's lane. It did (one frame past the end), and when a push ran before the codec
    heard of the end, the frame went into the lane's convolution state: under load the last frames' audio differed
    from the same request's alone (seen through the server: `bench_server.py`'s loaded_vs_alone)."""
    received, ends = {}, []
    tick, end = engine.codec.tick, engine.codec.end

    def counting_tick(frames, lanes):
        for lane in lanes:
            if lane >= 0:
                received[lane] = received.get(lane, 0) + 1
        return tick(frames, lanes)

    def noting_end(lane, ended_at, final):
        ends.append((lane, ended_at, received.pop(lane, 0)))
        return end(lane, ended_at, final)

    monkeypatch.setattr(engine.codec, "tick", counting_tick)
    monkeypatch.setattr(engine.codec, "end", noting_end)
    jobs = [engine.submit("Hello there. How are you today?", seed=s, max_frames=30) for s in range(3)]
    for job in jobs:
        audio(job)
    assert len(ends) >= len(jobs) and all(frames <= ended_at for _, ended_at, frames in ends), ends
