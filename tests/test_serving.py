"""The serving engine on the tiny random model, asserted by counts (never by wall time): the utterance state
machine on both paths, seeds at any slot count and under load, admission within the prefill budget, cancellations
that leave nothing behind, and the buffered-audio cap."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from higgs_rt.batch import BatchEngine, BufferFull
from higgs_rt.engine import TTS
from higgs_rt.params import SynthesisParams
from higgs_rt.utterance import Speech
from conftest import wait_for

LONG = " ".join(f"Sentence {i} goes on and on." for i in range(60))


@pytest.fixture(scope="module")
def tts(random_model):
    return TTS(random_model, device="cpu")


# ---- the utterance state machine ------------------------------------------------------------------------------
def test_speech_eos_max_frames_stop_and_reference_chaining(tts):
    speech = Speech(tts.model, "One. " * 3 + "x" * 0, None, SynthesisParams.create(max_frames=12))
    q, eos = speech.q, speech.eos
    code = torch.zeros(q, dtype=torch.long)
    speech.segments = ["First part.", "Second part.", "Third part."]
    first = speech.start()
    assert first is not None and speech.running and speech.frames == 1
    assert not speech.push(code) and not speech.push(code)
    assert speech.push(torch.full((q,), eos))  # all-EOS: finished
    assert speech.results[0].finished and speech.ended_at() == 3 and speech.results[0].frames.shape == (4, q)
    second = speech.start()  # prompted with the first utterance as its reference: longer than the first
    assert len(second) > len(first) and speech.sampling().seed == speech.params.seed + 1
    pushed = [speech.push(code) for _ in range(11)]
    assert pushed == [False] * 10 + [True]  # max_frames counts the all-BOS frame
    assert not speech.results[1].finished and speech.ended_at() == 12 and speech.stats.truncated == 1
    speech.start()
    speech.push(code)
    speech.stop()
    assert speech.done and speech.stats.stopped and speech.start() is None
    assert speech.stats.utterances == 3 and speech.stats.frames == 4 + 12 + 2
    with pytest.raises(RuntimeError, match="no utterance"):
        speech.push(code)


def run_path(path: str, tts: TTS, text: str, engine=None, stop: bool = False, **params):
    """(audio, stats, frames) of one request through TTS.stream or a BatchEngine; stop: stopped after its first
    chunk (`TTS.stop`, `Job.cancel`), the rest of its stream read to the end."""
    stream = tts.stream(text, **params) if path == "tts" else engine.submit(text, **params)
    chunks = iter(stream)
    got = [next(chunks)] if stop else []
    if stop:
        tts.stop() if path == "tts" else stream.cancel()
    got += list(chunks)
    return np.concatenate(got) if got else np.zeros(0, np.float32), stream.stats, stream.frames


def aligned(tts: TTS, frames) -> int:
    """Aligned frames of a call's utterances (the codec's offline post-processing of each)."""
    return sum(tts.codec.postprocess(f).shape[0] for f in frames)


@pytest.fixture(scope="module")
def engine2(tts):
    engine = BatchEngine(tts, slots=2, queue=8)
    yield engine
    engine.close()


@pytest.mark.parametrize("path", ["tts", "engine"])
def test_state_machine_on_both_paths(path, tts, engine2):
    eos = tts.talker.cfg.stream_eos_id
    audio, stats, frames = run_path(path, tts, "Hello there.", engine2, seed=3)
    assert stats.utterances == len(frames) == 1 and bool((frames[0][-1] == eos).all())  # EOS ends it
    assert audio.size == aligned(tts, frames) * 960
    _, stats, frames = run_path(path, tts, "Cut short here.", engine2, seed=0, max_frames=9)
    assert stats.truncated == 1 and frames[0].shape[0] == 9  # max_frames
    audio, stats, frames = run_path(path, tts, LONG, engine2, seed=1, max_frames=30)
    assert stats.utterances == len(frames) > 1 and stats.frames == sum(f.shape[0] for f in frames)  # long text
    assert audio.size == aligned(tts, frames) * 960
    whole = stats.utterances
    audio, stats, frames = run_path(path, tts, LONG, engine2, stop=True, seed=1, max_frames=30)
    assert stats.stopped and 0 < audio.size and stats.utterances < whole  # stop


# ---- seeds -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 3, 4])
def test_same_seed_same_audio_at_any_slot_count_and_under_load(tts, slots):
    texts = [("Seeds repeat on a server.", 11), ("Another request speaks too.", 12)]
    want = {seed: tts.synthesize(text, seed=seed) for text, seed in texts}
    engine = BatchEngine(tts, slots=slots, queue=16)
    try:
        noise = [engine.submit(f"Background {i} talks a while.", seed=50 + i) for i in range(slots + 2)]
        jobs = [(engine.submit(text, seed=seed), seed) for text, seed in texts]
        for job, seed in jobs:
            np.testing.assert_array_equal(np.concatenate(list(job)), want[seed])
        for job in noise:
            list(job)
    finally:
        engine.close()


# ---- admission -------------------------------------------------------------------------------------------------
def test_arrivals_stay_within_the_prefill_budget_and_running_slots_keep_stepping(tts):
    prompt = len(tts.model.prompt("Arrival number 10 speaks.", None, SynthesisParams.create()))
    budget = 2 * prompt + 4  # two prompts per tick
    engine = BatchEngine(tts, slots=8, queue=16, prefill_tokens=budget, benchmark=True)
    try:
        running = [engine.submit(f"Running {i}.", seed=i, max_frames=120, ignore_eos=True) for i in range(2)]
        assert wait_for(lambda: engine.metrics()["active_slots"] == 2)
        streams = [iter(job) for job in running]
        for s in streams:
            next(s)
        start = len(engine.ticks)
        arrivals = [engine.submit(f"Arrival number {10 + i} speaks.", seed=i) for i in range(6)]
        for job in arrivals:
            list(job)
        for s in streams:
            list(s)
        ticks = list(engine.ticks)[start:]
        admitted = [t for t in ticks if t[1]]
        assert sum(t[1] for t in ticks) >= 6 and all(t[0] <= budget for t in ticks)
        assert max(t[1] for t in ticks) == 2 and len(admitted) >= 3  # six arrivals over at least three ticks
        assert all(rows >= 1 for _, _, busy, rows in ticks if busy)  # every tick with a busy slot stepped
        assert all(job.stats.frames == 120 for job in running)  # the running streams lost no step
        assert [j.slot for j in running] == [0, 1]
    finally:
        engine.close()


def test_arrivals_take_the_open_seats_of_the_tick_s_prefill_forwards(tts):
    """With batched prefill forwards of a fixed number of prompts (CUDA's `BucketedPrefill`, here eager on the
    CPU), prompts past the token budget still start in this tick when they take a seat left open in a forward
    already chosen: the forward runs anyway."""
    from higgs_rt.prefill import BucketedPrefill

    texts = [f"Arrival number {10 + i} speaks." for i in range(8)]
    prompts = [tts.model.prompt(text, None, SynthesisParams.create()) for text in texts]
    budget = len(prompts[0]) + 1  # one prompt's tokens a tick
    engine = BatchEngine(tts, slots=8, queue=16, prefill_tokens=budget, benchmark=True)
    try:
        engine.decoder.prefill_fn = prefill = BucketedPrefill(tts.model.talker, engine.decoder.cache, graphs=False)
        (key, group), = {prefill.group(p.ids) for p in prompts}  # one bucket
        assert 1 < group < len(texts)
        start = len(engine.ticks)
        with engine._cond:  # all arrive before the next tick's admission
            jobs = [engine.submit(text, seed=i, max_frames=12) for i, text in enumerate(texts)]
        for job in jobs:
            assert len(np.concatenate(list(job))) > 0
        admitted = [(tokens, n) for tokens, n, _, _ in list(engine.ticks)[start:] if n]
        want = [group] * (len(texts) // group) + ([len(texts) % group] if len(texts) % group else [])
        assert [n for _, n in admitted] == want and all(tokens <= budget for tokens, _ in admitted)
    finally:
        engine.close()


def test_admission_computes_each_prompt_s_prefill_bucket_once(tts):
    """The admission's `prefill_group` (seats, budget) gives each prompt's bucket, which the prefill takes on
    (`Decoder.start_many(..., groups)`, `BucketedPrefill.many`) instead of computing it again; same forwards."""
    from higgs_rt.prefill import BucketedPrefill

    texts = [f"Arrival number {10 + i} speaks." for i in range(4)]
    engine = BatchEngine(tts, slots=4, queue=8, benchmark=True)  # the default budget takes all four in one tick
    try:
        engine.decoder.prefill_fn = prefill = BucketedPrefill(tts.model.talker, engine.decoder.cache, graphs=False)
        bucket, computed, forwards = prefill.bucket, [], []
        prefill.bucket = lambda ids: computed.append(ids.shape[0]) or bucket(ids)
        run = prefill._run
        prefill._run = lambda key, items: forwards.append((key, len(items))) or run(key, items)
        start = len(engine.ticks)
        with engine._cond:  # all arrive before the next tick's admission
            jobs = [engine.submit(text, seed=i, max_frames=12) for i, text in enumerate(texts)]
        for job in jobs:
            assert len(np.concatenate(list(job))) > 0
        assert [n for _, n, _, _ in list(engine.ticks)[start:] if n] == [4]  # one admission
        assert len(computed) == len(texts)  # once each: was twice (admission, then the prefill)
        assert len({key for key, _ in forwards}) == 1 and sum(n for _, n in forwards) == len(texts)  # batched
    finally:
        engine.close()


# ---- cancellation ----------------------------------------------------------------------------------------------
def test_a_hundred_cancellations_leave_nothing_behind(tts, monkeypatch):
    baseline = threading.active_count()
    # a job left running unread ends at a 2 s cap (BufferFull), so the streamed ones behind it get a slot soon
    engine = BatchEngine(tts, slots=4, queue=200, max_buffered_s=2.0, benchmark=True)
    prefill, cut_in_prefill = engine.decoder.prefill_fn, []

    def cancelling(cache, slot, ids, audio_frames=None):  # 8 jobs (not the streamed ones) cancelled inside theirs
        out = prefill(cache, slot, ids, audio_frames)
        job = engine._slots[slot]
        if len(cut_in_prefill) < 8 and job is not None and job.params.seed % 20 != 1:
            cut_in_prefill.append(job)
            job.cancel()
        return out

    monkeypatch.setattr(engine.decoder, "prefill_fn", cancelling)
    try:
        jobs = []
        for i in range(100):
            job = engine.submit(LONG, seed=i, max_frames=200, ignore_eos=True)  # none can finish before its cancel
            jobs.append(job)
            if i % 20 == 1:
                chunks = iter(job)
                next(chunks)  # mid-step / mid-codec: it is streaming
                chunks.close()
            elif i % 2 == 0:
                job.cancel()  # waiting, or mid-prefill
        for job in jobs:
            job.cancel()  # the rest: waiting, in a slot awaiting its prefill, or running
        assert wait_for(lambda: all(job._ended for job in jobs))
        assert wait_for(lambda: engine.metrics()["active_slots"] == 0 and engine.metrics()["queue_depth"] == 0)
        assert [(i, j.error) for i, j in enumerate(jobs) if not j.stats.stopped] == []
        m = engine.metrics()
        # a job running unread for long enough hits the buffered-audio cap first: cancelled with BufferFull
        assert m["jobs_cancelled"] + m["jobs_failed"] == 100 and m["jobs_completed"] == 0
        assert all(j.error is None or isinstance(j.error, BufferFull) for j in jobs)
        assert engine._slots == [None] * 4 and engine._live == [None] * 4 and not engine._waiting
        assert wait_for(lambda: engine.codec.lanes_in_use == 0)  # no codec lane left streaming or draining
        assert bool(engine.decoder.sampler.done.all()) and int(engine.decoder.cache.lengths.sum()) == 0
        assert cut_in_prefill and all(j.stats.stopped for j in cut_in_prefill)
        list(engine.submit("Still serving.", seed=1))  # the engine is whole
        # and holds nothing of the jobs: no queue entry, codec lane, audio or tensor of theirs is kept alive
        refs = [weakref.ref(j) for j in jobs]
        jobs.clear()
        job = chunks = None
        cut_in_prefill.clear()
        gc.collect()
        assert [i for i, r in enumerate(refs) if r() is not None] == []
    finally:
        engine.close()
    assert threading.active_count() <= baseline


# ---- backpressure ----------------------------------------------------------------------------------------------
def test_a_client_that_stops_reading_is_cancelled_at_the_cap(tts):
    engine = BatchEngine(tts, slots=2, queue=4, max_buffered_s=1.0, benchmark=True)
    try:
        job = engine.submit("Nobody reads this.", seed=1, max_frames=400, ignore_eos=True)  # 15.7 s of audio
        assert wait_for(lambda: job._ended)
        assert job.buffered_samples == 0 and job._items.qsize() == 1  # the audio was dropped, only the error left
        assert engine.metrics()["jobs_failed"] == 1 and engine.metrics()["active_slots"] == 0
        assert job.stats.audio_s <= 1.0 + 0.5 and job.stats.frames < 400  # stopped near the cap, not at the end
        with pytest.raises(BufferFull, match="unread"):
            list(job)
    finally:
        engine.close()
