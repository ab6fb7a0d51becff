"""Continuous batching: many requests share one Decoder's slots, advanced together by one thread.

`BatchEngine(model_or_tts, slots, queue)` makes a `Decoder` of `slots` slots from the shared `Model` and runs its
decode loop on one thread. What the frames mean (utterances, EOS, max_frames, reference chaining, stats) is the
same `higgs_rt.utterance.Speech` that `TTS.stream` drives for one slot; this module only admits, steps and routes.

A tick: release cancelled jobs; admit (below); one step of slots [0, n), n the smallest bucket (1, 2, 4, ...
slots) holding the highest busy slot, new jobs always taking the lowest free slot, so a lone request steps at the
batch-1 size; the previous step's frames, read from one asynchronous host copy (the device never waits for the
host), go to their jobs' Speech, which says where each utterance ends; then this step's frames go, still on the
device, to the codec thread (`higgs_rt.batch_codec`: every stream's codec in one batched call, on its own CUDA
stream, which puts the PCM in the jobs' queues), each row to its utterance's lane unless the utterance has just
ended (a frame past the end fed to a lane before the codec heard of the end changed that stream's last audio).

Admission: prefill under a per-tick token budget (`prefill_tokens`). Whole prompts are taken in arrival order (next
utterances of running jobs first) until the next one would pass the budget, and prefilled together: on CUDA the
prompts of one (text, audio) bucket share batched forwards of a fixed number of prompts (`group_of`: eight
sentences, or one clone prompt, at CUDA's 512 positions; `BucketedPrefill.many`), so the weights are read once per
group rather than once per prompt. Later arrivals then take the seats left open in the tick's last forward of their
bucket, which runs anyway (an open seat repeats a prompt), outside the budget; the rest wait for the next tick, and
every tick with a busy slot steps. A prompt longer than the budget runs alone in its tick.
Batched whole prompts rather than prompt chunks riding along with the decode step: the decode step stays the fused
kernels' (no mixed attention), and the budget bounds what arrivals cost the running streams per tick.

Backpressure: a job whose consumer has not taken `max_buffered_s` seconds of audio (default 30) is cancelled and
its stream ends with `BufferFull`, so a client that stops reading cannot grow the server's memory.

Seeds: the torch step is batch-invariant on the CPU in fp32 (tests/test_batch.py checks the audio of one request
against `TTS.stream` at several slot counts and under load); on CUDA the fused step's rounding is the lead's
concern (the fused-step issue).
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import time
from collections import deque
from typing import AsyncIterator, Iterator

import numpy as np
import torch

from .batch_codec import BatchCodec
from .loop_waker import LoopWaker
from .prompt import Prompt
from .params import DEFAULT_MAX_BUFFERED_S, DEFAULT_PREFILL_TOKENS
from .session import DEFAULT_MAX_BUFFERED_CHARS, Session
from .types import BufferFull, SynthesisParams, Voice
from .utterance import Speech

_END = object()
RATE_WINDOW_S = 5.0
# the decode loop's host wall time per phase of a tick (`BatchEngine.loop_seconds`): idle is waiting for work (or
# sleeping while slots wait for a codec lane), "other" the rest (bookkeeping, the host copy's launch), so the phases
# add up to the loop's whole time
LOOP_PHASES = ("idle", "admit", "prefill", "step", "codec_tick", "wait", "route", "other")


# where a request's time to first audio goes: each stage ends at the named mark (`Job.marks`), the first from the
# request's arrival (the server's) and the last at the server taking the chunk: parse (read, validated, queued),
# slot (waiting for a free slot), admit (the next tick, the prompt, the token budget, a codec lane), prefill (the
# host's part: on CUDA its kernels may still run during first_frame), first_frame (steps until the codec thread
# sees the first frame past the all-BOS ones), first_chunk (the first chunk's frames, the delay pattern and the
# codec's look-ahead, then the codec thread's turn), codec (the call that completes the first chunk), send (the
# codec thread's chunk reaching the event loop)
FIRST_AUDIO_STAGES = (("parse", "submitted"), ("slot", "slot"), ("admit", "admitted"), ("prefill", "prefilled"),
                      ("first_frame", "first_frame"), ("first_chunk", "push"), ("codec", "emitted"),
                      ("send", "sent"))

DEFAULT_SLOTS_CUDA, DEFAULT_SLOTS_CPU = 64, 4  # the fused step's batch range; a small CPU default


def default_slots(device: torch.device) -> int:
    return DEFAULT_SLOTS_CUDA if device.type == "cuda" else DEFAULT_SLOTS_CPU


class QueueFull(RuntimeError):
    """Every slot is busy and the wait queue is full."""


class Job:
    """One request. Its PCM chunks (float32, or int16 when submitted so; at the codec's sample rate) arrive in
    order through `__iter__` or `chunks()`; an error in generation is raised there. Leaving either iteration
    early cancels the job. `stats` and `frames` are complete once the chunks have ended."""

    def __init__(self, engine: "BatchEngine", speech: Speech, ignore_eos: bool = False, int16: bool = False,
                 player: object | None = None):
        self.speech, self.params, self.stats = speech, speech.params, speech.stats
        # the listener its audio continues (`BatchCodec.start`): its own, or its text session's; a bare token, so
        # the codec's clock for it holds nothing of the job
        self.player = object() if player is None else player
        self.ignore_eos, self.int16 = ignore_eos, int16
        self.submitted = time.perf_counter()
        self.marks: dict[str, float] = {"submitted": self.submitted}  # first times, FIRST_AUDIO_STAGES' ends
        self.cancelled = False
        self.error: BaseException | None = None  # set when the engine cancels the job itself (BufferFull)
        self._engine = engine
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._buffered = 0  # samples put and not yet taken
        self._wake = None  # set by an async consumer: called from the decode thread after each item
        self._ended = False
        # decode-thread state
        self.slot: int | None = None
        self.lane: int | None = None  # the running utterance's codec lane
        self._prompt: Prompt | None = None  # started, waiting for its prefill

    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def frames(self) -> list[torch.Tensor]:
        """Each finished utterance's delayed frames [T, Q]."""
        return [r.frames for r in self.speech.results]

    @property
    def buffered_samples(self) -> int:
        return self._buffered

    def mark(self, name: str, at: float | None = None) -> None:
        """The first time the job passed `name` (perf_counter; now when `at` is None), from any thread."""
        self.marks.setdefault(name, time.perf_counter() if at is None else at)

    def first_audio_stages(self, arrived: float, sent: float) -> dict[str, float]:
        """Seconds per FIRST_AUDIO_STAGES stage from `arrived` to `sent` (the first chunk taken), for the stages
        whose marks are all there (a stage past a missing mark counts from the last mark present)."""
        marks, out, last = self.marks | {"sent": sent}, {}, arrived
        for stage, mark in FIRST_AUDIO_STAGES:
            if mark in marks:
                out[stage], last = marks[mark] - last, marks[mark]
        return out

    def cancel(self) -> None:
        """Stop generating (from any thread); the slot is freed before the next step."""
        self._engine._cancel(self)

    def _take(self, item):
        if isinstance(item, np.ndarray):
            with self._lock:
                self._buffered -= item.shape[0]
        return item

    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            while (item := self._take(self._items.get())) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # a no-op once the job has ended

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        """The PCM chunks for an asyncio consumer: waiting never blocks the event loop."""
        ready = asyncio.Event()
        waker = LoopWaker.of(asyncio.get_running_loop())
        self._wake = lambda: waker.wake(ready)
        try:
            while True:
                try:
                    item = self._take(self._items.get_nowait())
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._wake = None  # nobody waits any more (and the loop may close)
            self.cancel()

    def _put(self, item) -> None:
        with self._lock:
            if self._ended:
                return
            if isinstance(item, np.ndarray):
                self._buffered += item.shape[0]
            self._items.put(item)
        wake = self._wake
        if wake is not None:
            wake()

    def _end(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._ended:
                return
            if error is not None:  # what the consumer did not take is dropped: the memory goes now
                while True:
                    try:
                        self._items.get_nowait()
                    except queue.Empty:
                        break
                self._buffered = 0
            self.stats.stopped = self.cancelled
            self._items.put(error if error is not None else _END)
            self._ended = True
        wake = self._wake
        if wake is not None:
            wake()


class BatchEngine:
    """Continuous batching over `slots` decoder slots of a loaded model, with at most `queue` jobs waiting.

    model: a `higgs_rt.model.Model` or a `TTS` (its model and chunking). slots: None for `default_slots`.
    compile / cuda_graph: as `Decoder` (cuda_graph None: on for CUDA). prefill_tokens: the admission budget per
    tick. max_buffered_s: audio a job may hold unread before it is cancelled with `BufferFull`. benchmark: allow
    `submit(..., ignore_eos=True)` (utterances of known length for benchmarks; never for users).
    `submit` validates and returns a `Job` at once (QueueFull when full).
    """

    def __init__(self, model, slots: int | None = None, queue: int = 32, compile: str | None = None,
                 cuda_graph: bool | None = None, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 max_buffered_s: float = DEFAULT_MAX_BUFFERED_S, benchmark: bool = False):
        self.tts = model if hasattr(model, "model") else None  # the facade, when given one (voices, chunking)
        self.model = model.model if self.tts is not None else model
        slots = default_slots(self.model.device) if slots is None else slots
        if slots < 1 or queue < 0 or prefill_tokens < 1 or max_buffered_s <= 0:
            raise ValueError(f"need slots >= 1, queue >= 0, prefill_tokens >= 1 and max_buffered_s > 0, got "
                             f"{slots}, {queue}, {prefill_tokens} and {max_buffered_s}")
        self.max_queue, self.prefill_tokens, self.benchmark = queue, prefill_tokens, benchmark
        self.chunking = self.tts.chunking if self.tts is not None else {}
        self.max_buffered_s = max_buffered_s  # also the default of the engine's sessions
        self.max_buffered = int(max_buffered_s * self.model.sample_rate)
        self.decoder = self.model.decoder(slots, compile=compile, cuda_graph=cuda_graph, ignore_eos=benchmark)
        warm = getattr(self.decoder.prefill_fn, "warm", None)
        if warm is not None:  # the batched prefill's graphs for sentence-length prompts, before any arrival
            warm()
        cfg = self.model.talker.cfg
        self._q, self._eos = cfg.num_codebooks, cfg.stream_eos_id
        self._slots: list[Job | None] = [None] * slots
        # lanes outlive slots by the codec's right receptive field: twice the slots leave room to drain
        self.codec = BatchCodec(self.model.codec, 2 * slots, self._emit, self._job_done, **self.chunking,
                                on_mark=Job.mark)
        try:  # on CUDA every push's graph before any arrival, not mid-stream (`BatchCodec.warm`)
            self.codec_warm_s = self.codec.warm()
        except BaseException as e:
            self.codec.close(e)
            raise
        self._live: list[Job | None] = [None] * slots  # the job whose utterance the slot's steps belong to
        self._epochs = [0] * slots  # bumped whenever a slot's utterance starts or ends: stale frames are dropped
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        # counters, read by `metrics()`; `ticks` records (prefill tokens, prompts, busy slots, rows stepped) per
        # tick for tests and benchmarks
        self.frames_total = self.steps_total = 0
        self.jobs_completed = self.jobs_cancelled = self.jobs_failed = self.jobs_rejected = 0
        self.ticks: deque[tuple[int, int, int, int]] = deque(maxlen=100_000)
        self._recent: deque[tuple[float, int]] = deque()  # (time, frames) of recent steps
        self.reset_loop_seconds()
        self._thread = threading.Thread(target=self._loop, name="higgs-rt-decode", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a decode thread still running at exit would abort the interpreter

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate

    # ---- any thread -------------------------------------------------------------------------------------
    def submit(self, text: str | list[str], *, voice: Voice | None = None, ignore_eos: bool = False,
               int16: bool = False, **params) -> Job:
        """Queue a request (text: one text, or a list of segments spoken as given, as `TTS.stream`); errors in
        the text or params raise here (PromptError / ValueError / TypeError). int16: chunks of int16 samples (a
        WAV's, `pcm.to_int16`) instead of float32, converted on the codec thread once per codec call for every
        such job: a server's event loop then only copies bytes (converting each chunk there took the loop a GIL
        hand-off per numpy pass, two thirds of its busy time at 64 streams)."""
        if ignore_eos and not self.benchmark:
            raise ValueError("ignore_eos is a benchmark option: start the engine with benchmark=True")
        p = SynthesisParams.create(**params)
        return self._queue(Job(self, Speech(self.model, text, voice, p).check(), ignore_eos, int16))

    def session(self, voice: Voice | str | None = None, *, on_audio=None, on_event=None,
                max_chars: int | None = None, max_buffered_chars: int = DEFAULT_MAX_BUFFERED_CHARS,
                max_buffered_s: float | None = None, ignore_eos: bool = False, int16: bool = False,
                **params) -> Session:
        """An incremental text session (`higgs_rt.session.Session`, as `TTS.session`): each utterance is one job
        (a slot only while it speaks; QueueFull ends the session with an error event). voice: a `Voice`, None,
        or a stored voice's name when the engine was made from a TTS. max_buffered_s: None for the engine's.
        ignore_eos, int16: as `submit`'s (int16: the audio events' pcm)."""
        if ignore_eos and not self.benchmark:
            raise ValueError("ignore_eos is a benchmark option: start the engine with benchmark=True")
        p = SynthesisParams.create(**params)
        if isinstance(voice, str):
            if self.tts is None:
                raise TypeError("a voice by name needs an engine made from a TTS (its voice library)")
            voice = self.tts.resolve_voice(voice)
        player = object()  # the session's utterances are jobs of their own and one listener
        utterance = lambda speech, cancel: self._session_utterance(speech, cancel, player, ignore_eos,  # noqa: E731
                                                                   int16)
        return Session(self.model, utterance, voice, p, on_audio=on_audio, on_event=on_event, max_chars=max_chars,
                       max_buffered_chars=max_buffered_chars,
                       max_buffered_s=self.max_buffered_s if max_buffered_s is None else max_buffered_s)

    def _session_utterance(self, speech: Speech, cancel, player: object, ignore_eos: bool = False,
                           int16: bool = False) -> Iterator[np.ndarray]:
        """A session's next utterance as one job; the session's cancel cancels it."""
        job = self._queue(Job(self, speech, ignore_eos, int16, player))
        unhook = cancel.hook(job.cancel)
        try:
            yield from job
        finally:
            unhook()

    def _queue(self, job: Job) -> Job:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch engine is closed")
            if len(self._waiting) >= self.max_queue + self._slots.count(None):
                self.jobs_rejected += 1
                raise QueueFull(f"all {self.slots} slots are busy and {self.max_queue} requests are waiting")
            self._waiting.append(job)
            self._cond.notify()
        return job

    def reset_loop_seconds(self) -> None:
        """Zero the decode loop's counters: host seconds per phase (LOOP_PHASES), ticks, steps, and over the steps
        the busy slots (`rows`) and the rows stepped (`stepped`: busy rounded up to the bucket) summed, the ticks
        that prefilled (`prefill_ticks`) and the prompts they prefilled (`prefill_prompts`). Read it whole (a copy)
        for deltas."""
        self.loop_seconds: dict[str, float] = dict.fromkeys(LOOP_PHASES, 0.0) | dict(
            ticks=0, steps=0, rows=0, stepped=0, prefill_ticks=0, prefill_prompts=0)

    def metrics(self) -> dict[str, float]:
        with self._cond:
            active, waiting = self.slots - self._slots.count(None), len(self._waiting)
            now = time.perf_counter()
            recent = [(t, n) for t, n in self._recent if now - t <= RATE_WINDOW_S]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        fps = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        return dict(slots=self.slots, active_slots=active, queue_depth=waiting, frames_total=self.frames_total,
                    steps_total=self.steps_total, frames_per_second=fps, jobs_completed=self.jobs_completed,
                    jobs_cancelled=self.jobs_cancelled, jobs_failed=self.jobs_failed,
                    jobs_rejected=self.jobs_rejected, **{f"loop_{k}": v for k, v in self.loop_seconds.items()},
                    prefill_forwards=self.decoder.prefill_forwards, codec_warm_s=self.codec_warm_s,
                    **{f"codec_{k}": self.codec.work[k] for k in ("busy_s", "push_s", "gpu_s", "pushes", "push_lanes",
                                                                    "push_frames")})

    def close(self) -> None:
        """Stop the decode thread; jobs still running or waiting end with an error."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        atexit.unregister(self.close)

    def _cancel(self, job: Job) -> None:
        with self._cond:
            if job._ended or job.cancelled:
                return
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                self._close_job(job)
            self._cond.notify()

    def _close_job(self, job: Job, error: BaseException | None = None) -> None:
        """End the job's stream once, counted as completed, cancelled or failed (any thread)."""
        with self._cond:
            if job._ended:
                return
            if error is not None:
                self.jobs_failed += 1
            elif job.cancelled:
                self.jobs_cancelled += 1
            else:
                self.jobs_completed += 1
            job._end(error)

    # ---- the codec thread's callbacks -------------------------------------------------------------------
    def _emit(self, job: Job, chunk: np.ndarray) -> None:
        if job.cancelled:
            return
        if job.stats.first_audio_s is None:
            now = time.perf_counter()
            job.mark("emitted", now)
            job.stats.first_audio_s = now - job.submitted
        job.stats.audio_s += chunk.shape[0] / self.sample_rate
        job._put(chunk)
        if job._buffered > self.max_buffered:
            self._overflow(job)

    def _job_done(self, job: Job, error: BaseException | None) -> None:
        """The job's last audio has been sent (error None), or its codec work failed."""
        self._close_job(job, error if error is not None else job.error)

    def _overflow(self, job: Job) -> None:
        """The job's consumer is not reading: cancel it with BufferFull (the decode thread frees its slot; a job
        whose last utterance is only draining in the codec ends here)."""
        seconds = self.max_buffered / self.sample_rate
        error = BufferFull(f"more than {seconds:g} s of audio was waiting unread: the request was cancelled "
                           "(read the stream as it comes)")
        with self._cond:
            job.error, job.cancelled = error, True
            holds_slot = job.slot is not None and self._slots[job.slot] is job
            self._cond.notify()
        if not holds_slot:
            self.codec.drop(job)
            self._close_job(job, error)

    # ---- the decode thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        device, b = self.model.device, self.slots
        frames = torch.full((b, self._q), self._eos, dtype=torch.long, device=device)
        host = torch.empty((2, b, self._q), dtype=torch.long, pin_memory=device.type == "cuda")
        try:
            self._decode_loop(frames, host)
        finally:
            self.codec.close(RuntimeError("the batch engine was closed"))

    def _decode_loop(self, frames: torch.Tensor, host: torch.Tensor) -> None:
        device = self.model.device
        events = [torch.cuda.Event(), torch.cuda.Event()] if device.type == "cuda" else None
        in_flight: tuple[int, list[int]] | None = None  # (host buffer, slot epochs) of the step not yet read
        step = 0
        last = time.perf_counter()

        def lap(phase: str) -> None:  # the host time since the last lap goes to `phase`
            nonlocal last
            now = time.perf_counter()
            self.loop_seconds[phase] += now - last
            last = now

        while True:
            with self._cond:
                lap("admit")  # the lock
                while not (self._closed or in_flight or self._waiting or any(self._slots)):
                    self._cond.wait()
                lap("idle")
                if self._closed:
                    break
                self._release_cancelled()
                candidates = self._admit()
            lap("admit")
            try:
                tokens, prompts = self._start_within_budget(candidates, frames)
                lap("prefill")
                if prompts:
                    self.loop_seconds["prefill_ticks"] += 1
                    self.loop_seconds["prefill_prompts"] += prompts
                queued, busy = None, [s for s, j in enumerate(self._live) if j is not None]
                n = 0
                if busy:
                    n = self.decoder.bucket(busy[-1] + 1)
                    lap("other")
                    frames[:n] = self.decoder.steps[n](frames[:n])
                    lap("step")
                    counts = self.loop_seconds
                    counts["steps"] += 1
                    counts["rows"] += len(busy)
                    counts["stepped"] += n
                    i = step % 2
                    host[i, :n].copy_(frames[:n], non_blocking=True)
                    if events:
                        events[i].record()
                    queued = (i, n, list(self._epochs))
                    step += 1
                self.ticks.append((tokens, prompts, len(busy), n))
                self.loop_seconds["ticks"] += 1
                if in_flight is not None:
                    i, m, epochs = in_flight
                    lap("other")
                    if events:
                        events[i].synchronize()
                    lap("wait")
                    self._route(host[i, :m], epochs)
                    lap("route")
                if queued is not None:  # after the route: a row whose utterance has just ended feeds no lane
                    self.codec.tick(frames[:n], tuple(-1 if j is None else j.lane for j in self._live[:n]))
                    lap("codec_tick")
                in_flight = queued
                lap("other")
                if not busy and tokens == 0 and any(self._slots):
                    time.sleep(1e-3)  # slots wait for a codec lane to drain: let the codec thread run
                    lap("idle")
            except Exception as e:  # a bug or a device error: fail what is running, keep serving
                self._fail_all(e)
                in_flight = None
        self._fail_all(RuntimeError("the batch engine was closed"), waiting=True)

    def _release_cancelled(self) -> None:
        for slot, job in enumerate(self._slots):
            if job is not None and job.cancelled:
                self._free(slot)
                job.speech.stop()
                self.codec.drop(job)
                self._close_job(job, job.error)

    def _admit(self) -> list[Job]:
        """Jobs that may start an utterance this tick, in order: next utterances of jobs holding a slot, then
        waiting jobs, each given the lowest free slot."""
        candidates = [job for job in self._slots if job is not None and self._live[job.slot] is None]
        for slot, job in enumerate(self._slots):
            if job is None and self._waiting:
                job = self._slots[slot] = self._waiting.popleft()
                job.slot = slot
                job.mark("slot")
                candidates.append(job)
        return candidates

    def _start_within_budget(self, candidates: list[Job], frames: torch.Tensor) -> tuple[int, int]:
        """Prefill candidates in order until the next prompt would pass the tick's token budget (the first always
        runs), then later candidates that take a seat left open in a forward already chosen (the forwards of a
        bucket have a fixed number of prompts: a seat not taken repeats a prompt), in one `Decoder.start_many`;
        returns (the budget's prompt tokens, prompts) prefilled."""
        chosen, tokens, full = [], 0, False
        seats: dict[object, int] = {}  # a forward group -> seats still open in its last forward this tick
        for job in candidates:
            if full and not any(seats.values()):
                break
            try:
                if job._prompt is None:
                    job._prompt = job.speech.start()
                prompt = job._prompt
                group = self.decoder.prefill_group(prompt)
                seat = group is not None and seats.get(group[0], 0) > 0
                if chosen and not seat and (full or tokens + len(prompt) > self.prefill_tokens):
                    full = True  # it keeps its prompt (and its slot) for the next tick
                    continue
                params = job.speech.sampling()
                lane = self.codec.acquire()
                if lane is None:
                    break  # every codec lane is draining: next tick
            except Exception as e:
                self._finish(job, e)
                continue
            job._prompt, job.lane = None, lane
            chosen.append((job, (job.slot, prompt, params, job.ignore_eos), group))
            if seat:
                seats[group[0]] -= 1
            else:
                tokens += len(prompt)
                if group is not None:
                    seats[group[0]] = group[1] - 1
        if not chosen:
            return 0, 0
        starts = [start for _, start, _ in chosen]
        now = time.perf_counter()
        for job, _, _ in chosen:
            job.mark("admitted", now)
        try:
            firsts = self.decoder.start_many(starts, [group for *_, group in chosen])  # the buckets computed above
        except Exception:  # one bad prompt: start them one by one, so only its job fails
            firsts = []
            for start in starts:
                try:
                    firsts.append(self.decoder.start(*start))
                except Exception as e:
                    firsts.append(e)
        started, now = 0, time.perf_counter()
        for (job, _, _), first in zip(chosen, firsts):
            if isinstance(first, Exception):
                self.codec.unacquire(job.lane)
                self._finish(job, first)
                continue
            frames[job.slot] = first
            job.mark("prefilled", now)
            started += 1
            self._epochs[job.slot] += 1
            self._live[job.slot] = job
            self.codec.start(job.lane, job, job.int16, player=job.player)
        return tokens, started

    def _route(self, frames: torch.Tensor, epochs: list[int]) -> None:
        """One step's host frames [n, Q] to the jobs whose utterance was running when it was queued."""
        routed = 0
        frames = frames.clone()  # one copy per tick (the host buffer is reused two steps later); rows are views
        ended = (frames == self._eos).all(dim=1).tolist()
        for slot, frame in enumerate(frames.unbind(0)):
            job = self._live[slot]
            if job is None or epochs[slot] != self._epochs[slot] or job.cancelled:
                continue
            routed += 1
            if job.speech.push(frame, eos=ended[slot]):
                self._end_utterance(job)
        self.frames_total += routed
        self.steps_total += 1
        now = time.perf_counter()
        self._recent.append((now, routed))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def _end_utterance(self, job: Job) -> None:
        """The utterance's frames are all in: its codec lane drains on its own; the slot goes to the job's next
        utterance, or back to the pool (the job ends once the codec has sent its last audio).

        Whether the job is done is read once, before the codec hears of the end: from then on the job may end on
        the codec thread, and a text session then adds its next utterance to the same Speech (as a new job); read
        again, that would keep this slot for the old job, which would start the new utterance a second time."""
        final, ended_at = job.speech.done, job.speech.ended_at()
        self._epochs[job.slot] += 1
        self._live[job.slot] = None
        self.decoder.release(job.slot)
        if final:
            with self._cond:
                self._free(job.slot)
        self.codec.end(job.lane, ended_at, final=final)

    def _finish(self, job: Job, error: BaseException) -> None:
        """The job failed (its prompt, or the device): its slot and codec lanes go now."""
        with self._cond:
            if job.slot is not None and self._slots[job.slot] is job:
                self._free(job.slot)
        self.codec.drop(job)
        self._close_job(job, error)

    def _free(self, slot: int) -> None:
        self.decoder.release(slot)
        self._epochs[slot] += 1
        self._slots[slot] = self._live[slot] = None

    def _fail_all(self, error: BaseException, waiting: bool = False) -> None:
        for job in [j for j in self._slots if j is not None]:
            self._finish(job, error)
        with self._cond:
            while waiting and self._waiting:
                self._close_job(self._waiting.popleft(), error)
