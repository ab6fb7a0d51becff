"""Continuous batching: many requests share one Decoder's slots, advanced together by one thread.

`BatchEngine(tts, slots, queue)` owns a `Decoder(tts.talker, batch=slots)` and the thread that runs its decode
loop. Between steps the thread admits waiting jobs into free slots (prefill); each step advances every slot at
once; the step's frames [B, Q] reach the host through one asynchronous copy that is read one step later, so the
device never waits for the host. Each slot's frame goes to its job's streaming codec decoder and the PCM to the
job's queue. A slot is freed at its all-EOS frame, at max_frames, or as soon as its job is cancelled (a client
that went away). Long text is split and prompted as `TTS` does (`Utterances`); a job keeps its slot from one
utterance to the next. Each job keeps its own seed and sampling state in its slot.

Every step runs all `slots` rows whatever their state, so a job's frames do not depend on what the other slots
hold: a seed repeats for a given slot count. A batch of B rows may round differently from batch 1 (other
matmul kernels), so audio from `BatchEngine` can differ from `TTS.stream` for the same seed.
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

from .codec import StreamingDecoder
from .engine import TTS, CodecLane, StreamStats, SynthesisParams, Utterances, Voice
from .generate import Decoder, Generation, HostFrames
from .prompt import Prompt, check_budget, check_text

_END = object()
RATE_WINDOW_S = 5.0


class QueueFull(RuntimeError):
    """Every slot is busy and the wait queue is full."""


class Job:
    """One request. Its float32 PCM chunks (at the codec's sample rate) arrive in order through `__iter__` or
    `chunks()`; an error in generation is raised there. Leaving either iteration early cancels the job.
    `stats` is complete once the chunks have ended."""

    def __init__(self, engine: "BatchEngine", plan: Utterances, params: SynthesisParams, prompt: Prompt):
        self.params, self.stats = params, StreamStats()
        self.prompt_tokens = 0  # over the utterances started so far
        self.submitted = time.perf_counter()
        self.cancelled = False
        self._engine, self._plan = engine, plan
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = None  # set by an async consumer: called from the decode thread after each item
        self._ended = False
        # decode-thread state of the current utterance
        self.slot: int | None = None
        self._utterance = 0
        self._prompt: Prompt | None = prompt  # the next utterance's prompt, until it is started
        self._frames: list[torch.Tensor] = []
        self._codec: StreamingDecoder | None = None
        self._lane: CodecLane | None = None  # the job's codec work, on its own CUDA stream
        self._started = 0.0

    def cancel(self) -> None:
        """Stop generating (from any thread); the slot is freed before the next step."""
        self._engine._cancel(self)

    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            while (item := self._items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # a no-op once the job has ended

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        """The PCM chunks for an asyncio consumer: waiting never blocks the event loop."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            while True:
                try:
                    item = self._items.get_nowait()
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
            self.cancel()

    def _put(self, item) -> None:
        self._items.put(item)
        wake = self._wake
        if wake is not None:
            wake()

    def _decode(self, work, *args, wait: bool = False) -> None:
        """Codec work (the streaming decoder's push or flush) on the job's lane; landed PCM to the consumer."""
        self._lane.submit(work, *args)
        for chunk in self._lane.ready(wait=wait):
            if self.stats.first_audio_s is None:
                self.stats.first_audio_s = time.perf_counter() - self.submitted
            self.stats.audio_s += chunk.shape[0] / self._engine.tts.sample_rate
            self._put(chunk)

    def _end(self, error: BaseException | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if self._started:
            self.stats.synthesis_s = time.perf_counter() - self._started
        self.stats.stopped = self.cancelled
        self._put(error if error is not None else _END)


class BatchEngine:
    """Continuous batching over `slots` decoder slots of a loaded `TTS`, with at most `queue` jobs waiting.

    compile / cuda_graph: as `Decoder` (cuda_graph None: on for CUDA). `submit` validates and returns a `Job` at
    once (QueueFull when full).
    """

    def __init__(self, tts: TTS, slots: int = 8, queue: int = 32, compile: str | None = None,
                 cuda_graph: bool | None = None):
        if slots < 1 or queue < 0:
            raise ValueError(f"need slots >= 1 and queue >= 0, got {slots} and {queue}")
        self.tts, self.max_queue = tts, queue
        graph = tts.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.decoder = Decoder(tts.talker, batch=slots, context=tts.decoder.context, compile=compile,
                               cuda_graph=graph, compiled=tts.compiled)
        cfg = tts.talker.cfg
        self._q, self._bos, self._eos = cfg.num_codebooks, cfg.stream_bos_id, cfg.stream_eos_id
        self._slots: list[Job | None] = [None] * slots
        self._epochs = [0] * slots  # bumped whenever a slot's utterance starts or ends: stale frames are dropped
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        # counters, read by `metrics()`
        self.frames_total = self.steps_total = 0
        self.jobs_completed = self.jobs_cancelled = self.jobs_failed = self.jobs_rejected = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, frames) of recent steps
        self._thread = threading.Thread(target=self._loop, name="higgs-rt-batch", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a decode thread still running at exit would abort the interpreter

    @property
    def slots(self) -> int:
        return len(self._slots)

    # ---- any thread -------------------------------------------------------------------------------------
    def submit(self, text: str, *, voice: Voice | None = None, **params) -> Job:
        """Queue a request; errors in the text or params raise here (PromptError / ValueError / TypeError)."""
        p = SynthesisParams.create(**params)
        plan = Utterances(self.tts, check_text(text), voice, p)
        self._check_utterances(plan, voice, p)
        job = Job(self, plan, p, plan.prompt(0))
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch engine is closed")
            if len(self._waiting) >= self.max_queue + self._slots.count(None):
                self.jobs_rejected += 1
                raise QueueFull(f"all {self.slots} slots are busy and {self.max_queue} requests are waiting")
            self._waiting.append(job)
            self._cond.notify()
        return job

    def _check_utterances(self, plan: Utterances, voice: Voice | None, p: SynthesisParams) -> None:
        """Every utterance's prompt must fit the context with the longest reference it can be given (without a
        voice: the previous utterance's text and up to max_frames of its frames), so that a request fails here,
        at submit, and never after its first audio has gone out."""
        longest = torch.zeros(min(p.max_frames, self.decoder.context), self._q, dtype=torch.long)
        for i, segment in enumerate(plan.segments):
            reference = voice if voice is not None or i == 0 else Voice(plan.segments[i - 1], longest)
            check_budget(len(self.tts._prompt(segment, reference, p)), p.max_frames, self.decoder.context)

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
                    jobs_rejected=self.jobs_rejected)

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
                self.jobs_cancelled += 1
                job._end()
            self._cond.notify()

    # ---- the decode thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        frames = torch.full((self.slots, self._q), self._eos, dtype=torch.long, device=self.tts.device)
        host = HostFrames(2, self.slots * self._q, self.tts.device)
        in_flight: tuple[int, list[int]] | None = None  # (host buffer, slot epochs) of the step not yet read
        step = 0
        while True:
            with self._cond:
                while not (self._closed or in_flight or self._waiting or any(self._slots)):
                    self._cond.wait()
                if self._closed:
                    break
                self._release_cancelled()
                admitted = self._admit()
            try:
                for job in admitted:
                    self._start(job, frames)
                queued = None
                if any(self._slots):
                    frames = self.decoder.step_fn(frames)
                    queued = (step % 2, list(self._epochs))
                    host.put(step % 2, frames.reshape(-1))
                    step += 1
                if in_flight is not None:
                    self._route(host.get(in_flight[0]).view(self.slots, self._q), in_flight[1])
                in_flight = queued
            except Exception as e:  # a bug or a device error: fail what is running, keep serving
                self._fail_all(e)
                in_flight = None
        self._fail_all(RuntimeError("the batch engine was closed"), waiting=True)

    def _release_cancelled(self) -> None:
        for slot, job in enumerate(self._slots):
            if job is not None and job.cancelled:
                self._free(slot)
                self.jobs_cancelled += 1
                job._end()

    def _admit(self) -> list[Job]:
        """Jobs that start an utterance before the next step: new ones in free slots, and next utterances."""
        admitted = [job for job in self._slots if job is not None and job._prompt is not None]
        for slot, job in enumerate(self._slots):
            if job is None and self._waiting:
                job = self._slots[slot] = self._waiting.popleft()
                job.slot = slot
                admitted.append(job)
        return admitted

    def _start(self, job: Job, frames: torch.Tensor) -> None:
        prompt, job._prompt = job._prompt, None
        try:
            check_budget(len(prompt), job.params.max_frames, self.decoder.context)
            frames[job.slot] = self.decoder.start(job.slot, prompt, job.params.sampling(job._utterance))
        except Exception as e:
            self._finish(job, e)
            return
        self._epochs[job.slot] += 1
        job.prompt_tokens += len(prompt)
        job._started = job._started or time.perf_counter()
        job._frames = [torch.full((self._q,), self._bos, dtype=torch.long)]
        job._codec = StreamingDecoder(self.tts.codec, **self.tts.chunking)
        job._lane = job._lane or CodecLane(self.tts.device)

    def _route(self, frames: torch.Tensor, epochs: list[int]) -> None:
        """One step's host frames [B, Q] to the jobs whose utterance was running when it was queued."""
        routed = 0
        for slot, job in enumerate(self._slots):
            if job is None or epochs[slot] != self._epochs[slot] or job.cancelled:
                continue
            frame = frames[slot].clone()
            job._frames.append(frame)
            routed += 1
            job._decode(job._codec.push, frame[None])
            ended = bool((frame == self._eos).all())
            if ended or len(job._frames) >= job.params.max_frames:
                self._end_utterance(job, finished=ended)
        self.frames_total += routed
        self.steps_total += 1
        now = time.perf_counter()
        self._recent.append((now, routed))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def _end_utterance(self, job: Job, finished: bool) -> None:
        job._decode(job._codec.flush, wait=True)
        result = Generation(torch.stack(job._frames), finished=finished)
        job.stats.frames += result.frames.shape[0]
        job.stats.utterances += 1
        job.stats.truncated += not finished
        self._epochs[job.slot] += 1
        job._plan.done(job._utterance, result)
        if job._utterance + 1 < len(job._plan):
            job._utterance += 1
            try:
                job._prompt = job._plan.prompt(job._utterance)  # started before the next step, in this slot
            except Exception as e:
                self._finish(job, e)
        else:
            self._finish(job)

    def _finish(self, job: Job, error: BaseException | None = None) -> None:
        with self._cond:
            if job.slot is not None and self._slots[job.slot] is job:
                self._free(job.slot)
            if error is None:
                self.jobs_completed += 1
            else:
                self.jobs_failed += 1
            job._end(error)

    def _free(self, slot: int) -> None:
        self.decoder.release(slot)
        self._epochs[slot] += 1
        self._slots[slot] = None

    def _fail_all(self, error: BaseException, waiting: bool = False) -> None:
        for job in [j for j in self._slots if j is not None]:
            self._finish(job, error)
        with self._cond:
            while waiting and self._waiting:
                self.jobs_failed += 1
                self._waiting.popleft()._end(error)
