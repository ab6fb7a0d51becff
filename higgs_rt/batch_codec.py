"""The batch engine's codec: every stream's Code2Wav in one batched call, on its own thread and CUDA stream.

The decode thread hands over, in order: per step, the step's frames (a device copy, with an event on CUDA) and
which codec lane each row feeds (`tick`); per utterance, its lane (`start`, from `acquire`) and where it ends
(`end`); per cancelled job, `drop`. This thread keeps every utterance's codec state in one `StreamingCodec` of
`lanes` lanes, so the decode loop never waits for the codec, and decides when to run it:

- A push runs when some lane has a chunk due (`chunk_target`, the schedule `StreamingDecoder` keeps for
  `TTS.stream`: its first `first_chunk` frames, then chunks doubling up to `chunk` frames, then its end) that
  should not wait: a short first chunk or an end, unless its job's audio sent so far is more than two chunks and
  a call ahead of real time (a text's later sentences: their player has the earlier ones' audio to play); lanes
  due a full chunk wait until `chunk` ticks are pending (one codec call per `chunk` ticks for all of them, not
  one per lane). It carries every lane's frames since the last push, so a lone stream runs the codec as often as
  `TTS.stream` does and 64 streams share each call. The codec's CUDA stream has high priority: its kernels go
  ahead of the decode step's. The decode thread's lanes are names: this thread streams each utterance in the
  lowest free slot of one `StreamingCodec` and, when a slot frees below busy ones, moves the highest busy stream
  down into it (`_compact`), so a push covers exactly the busy slots 0 .. m - 1 (on CUDA m is rounded up to a
  bucket, `lane_bucket`, and a push is split into widths of the powers of two below `chunk` and `chunk` frames,
  each a CUDA graph: `warm` captures them all before the first utterance, else each is captured on first use).
- Under load a codec call takes long (64 lanes: ~28 ms on the H200, more on an H100), and a stream's second chunk
  comes at best one call after its first: a first chunk of f frames leaves the second (2f frames, made in 2f
  ticks while the player plays f) f * (40 ms - 2 ticks) for its call, and less than 1.5 calls there
  (`FIRST_CHUNK_CALLS`, at the median of the last 9 calls as wide as the pushes are then, the ticks' at the median
  of the last 9) left players without audio (the H100 at 64 streams; the H200 at 64 whole texts, whose sentences'
  prefills made ticks of 11 ms). So on CUDA an utterance's first chunk is `first_chunk` frames or that many,
  whichever is more (at most `chunk`), decided anew until it is sent (64 requests arriving together start on
  narrow, fast calls); alone, a call takes a few ms and the first chunk stays one frame. Only where chunks are cut
  changes: the samples are the same.
- Each lane's PCM is cut on the host into the chunks `StreamingDecoder` emits (`chunk_size`; the tail, which
  drains with the ticks, in chunks as it comes), so a job's audio does not depend on the other jobs: bit for bit
  on the CPU in fp32, where the codec's convolutions round the same for any batch, width and thread count
  (`codec.stateful`).
- Leading all-BOS frames are dropped, as `StreamingDecoder` and the offline post-processing do: each tick's
  frames are read on this thread (after the step's event), and a lane starts at its first other frame.
- A lane outlives its decoder slot: after an utterance's last frame the codec still needs the decoder's right
  receptive field of padding. The lane drains with later pushes, or with one flush once no utterance is running,
  while its slot already serves the next utterance on another lane. A job whose utterances overlap in lanes gets
  their audio in order; it ends (`on_done`) after its last lane's last chunk.
"""

from __future__ import annotations

import math
import os
import queue
import statistics
import threading
import time
from collections import OrderedDict, deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .codec import StreamingCodec
from .codec.stateful import StatefulDecoder
from .codec.stream import check_chunking, chunk_size, chunk_target
from .host_copy import to_device, to_host
from .model_thread import one_cpu_thread
from .params import DEFAULT_CHUNK, DEFAULT_FIRST_CHUNK
from .pcm import to_int16

_INDEXES = 32  # row -> lane maps kept on the device
FIRST_CHUNK_CALLS = 1.5  # a first chunk holds at least this many codec calls' time of audio
_CALLS_KEPT = 9  # the codec calls whose median duration counts (a CUDA graph's capture is one slow outlier)


def lane_bucket(m: int, lanes: int) -> int:
    """The lanes a CUDA push spans for m busy ones (one CUDA graph a bucket and push width): powers of two up to
    8, then four buckets an octave (10, 12, 14, 16, 20, 24, ...), at most `lanes`. Whole texts keep a few
    utterances draining beside the running ones (64 streams held 65-72 slots): rounded to a power of two, every
    push was then twice as wide as its work (111.6 lanes a call for 64 streams on the H200, at 128 in all)."""
    if m <= 8:
        return min(1 << (m - 1).bit_length(), lanes)
    step = 1 << ((m - 1).bit_length() - 3)
    return min(-(-m // step) * step, lanes)


@dataclass
class _Clock:
    """Where a player of one stream's audio stands: it started on the stream's first chunk, plays what was sent and
    waits when it runs dry. Shared by the utterances of one stream (`start`'s player: a request, or a text
    session whose utterances are jobs of their own), so a later sentence's ramp is not urgent while the ones
    before still play."""

    until: float | None = None  # when the audio sent so far has played
    users: int = 0  # live utterances on it

    def ahead_s(self, now: float) -> float:
        return 0.0 if self.until is None else max(0.0, self.until - now)

    def sent(self, seconds: float, now: float) -> None:
        self.until = max(self.until or now, now) + seconds


@dataclass
class _Utterance:
    """One utterance's lane, as this thread sees it (frame counts include the lane's all-BOS frame 0)."""

    job: object
    lane: int  # the decode thread's name for it (`acquire`)
    slot: int  # where it streams in the `StreamingCodec`: moves down as slots below it free (`_compact`)
    int16: bool = False  # the job's chunks as int16 samples (`pcm.to_int16`), converted here once per push
    first_chunk: int = 1  # frames in its first chunk (the ramp doubles from there)
    seeking: bool = True  # no frame but all-BOS ones yet: the codec lane starts at the first other frame
    skipped: int = 0  # all-BOS frames after the first (the lane's frame 0 is the last of them)
    received: int = 1  # frames in hand, pushed or pending
    pushed: int = 1
    end: int | None = None  # aligned frames, once the decode thread has said where it ends
    final: bool = False  # the job's last utterance
    emitted: int = 0  # audio frames sent to the job
    clock: _Clock = field(default_factory=_Clock)  # its player's (`start`)
    audio: list[np.ndarray] = field(default_factory=list)  # decoded and not yet sent
    buffered: int = 0  # samples in `audio`


def _stream_priority() -> int:
    value = os.environ.get("HIGGS_RT_CODEC_PRIORITY", "-1")
    if value not in ("-1", "0"):
        raise ValueError(f"HIGGS_RT_CODEC_PRIORITY must be -1 (high, the default) or 0 (normal), got {value!r}")
    return int(value)


def _codec_stream(device: torch.device) -> torch.cuda.Stream:
    """The codec's CUDA stream, at high priority: the step's kernels fill every SM, and a codec kernel waiting
    behind them delays audio. Confining the codec to a green context of 16 or 32 SMs instead (torch's
    `green_contexts`) did not help the steps beside it: H100, 0a7f181, one call, c8 at 0.883 / 0.888 of the
    batch-8 step's frames/s against 0.891 with the high-priority stream (`server_gpu_h100_0a7f181*.json`)."""
    return torch.cuda.Stream(device, priority=_stream_priority())


class BatchCodec:
    """`lanes` streaming codec lanes driven by one thread. Decode-thread API: `acquire` (a lane or None),
    `unacquire`, `start`, `tick`, `end`, `drop`, `close`. Jobs get their PCM through `emit(job, pcm)` and their end
    through `on_done(job, error)` (error None: all audio sent), both called on this thread; `on_mark(job, name,
    at)`, when given, hears when an utterance's first frame past the all-BOS ones reached this thread
    ("first_frame") and when the push that completed its first chunk began ("push")."""

    def __init__(self, codec, lanes: int, emit: Callable, on_done: Callable, first_chunk: int | None = None,
                 chunk: int | None = None, adaptive_first: bool | None = None, on_mark: Callable | None = None):
        self.first_chunk = DEFAULT_FIRST_CHUNK if first_chunk is None else first_chunk
        self.chunk = DEFAULT_CHUNK if chunk is None else chunk
        check_chunking(self.first_chunk, self.chunk)
        if lanes < 1:
            raise ValueError(f"need lanes >= 1, got {lanes}")
        self.device = codec.table.device
        # longer first chunks while codec calls are slow (None: on CUDA; on the CPU the chunks stay those of
        # `StreamingDecoder`, whatever the machine's load)
        self.adaptive_first = self.device.type == "cuda" if adaptive_first is None else adaptive_first
        self.q, self.hop, self.bos = codec.num_quantizers, codec.hop_length, codec.codebook_size
        self.frame_s = codec.hop_length / codec.sample_rate
        # the last codec calls' durations by their width in lanes (`_push`)
        self.recent_calls: dict[int, deque[float]] = {}
        self._calls = 0  # pushes timed into recent_calls
        self.recent_ticks: deque[float] = deque(maxlen=_CALLS_KEPT)  # seconds between the last ticks (`tick`)
        self._last_tick: float | None = None
        self._first_now: tuple[tuple[int, int] | None, int] = (None, self.first_chunk)  # (width, calls), frames
        first = self.first_chunk + self.q - 1 + StatefulDecoder.lag_frames_of(codec)  # a lone lane's first push
        # pushes are split into these (and `first`) on CUDA: the powers of two below a chunk, and a chunk
        self.widths = sorted({1 << i for i in range(self.chunk.bit_length() - 1)} | {self.chunk})
        self._graphed = sorted({*self.widths, first})  # the push widths replayed as CUDA graphs (`_pieces`)
        self.codec = StreamingCodec(codec, lanes, graph_widths=tuple(self._graphed))
        self._first = first
        self.lag = self.codec.lag
        self.emit, self.on_done = emit, on_done
        self._mark = on_mark or (lambda job, name, at: None)
        # ($HIGGS_RT_CODEC_PRIORITY=0, normal, is a measurement switch: the step's speed against the audio's wait)
        self.stream = _codec_stream(self.device) if self.device.type == "cuda" else None
        self._free = list(range(lanes))  # lanes not in use, taken lowest first (decode thread) under _lock
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # codec-thread state
        self._live: dict[int, _Utterance] = {}  # codec slot -> its utterance
        self._slot_of: dict[int, int] = {}  # lane -> its utterance's codec slot
        self._order: dict[object, deque[_Utterance]] = {}  # job -> its utterances with a lane, oldest first
        # player (`start`) -> its clock, while an utterance uses it or its audio is still ahead (`_clock`)
        self._clocks: dict[object, _Clock] = {}
        self._pending: list[torch.Tensor] = []  # [slots, 1, Q] per tick since the last push
        self._indexes: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.reset_work()
        self._thread = threading.Thread(target=self._loop, name="higgs-rt-codec", daemon=True)
        self._thread.start()

    def reset_work(self) -> None:
        """Zero the thread's counters, for tests and benchmarks: host seconds busy (not waiting for a message),
        in `_on_tick` (`tick_s`) and in pushes (`push_s`: the codec call, the waits for its PCM on the host and
        sending the chunks); on CUDA the GPU's time from each push's first codec kernel to its last (`gpu_s`,
        concurrent with the decode step's kernels: how much of the GPU's wall the codec shared); ticks; pushes, with
        their frames and lanes summed; the most messages seen waiting (`backlog_max`)."""
        self.work: dict[str, float] = dict(busy_s=0.0, tick_s=0.0, push_s=0.0, gpu_s=0.0, ticks=0, pushes=0,
                                           push_frames=0, push_lanes=0, backlog_max=0)

    @property
    def pushes(self) -> int:
        """Codec calls since `reset_work`."""
        return self.work["pushes"]

    @property
    def lanes(self) -> int:
        return self.codec.slots

    @property
    def lanes_in_use(self) -> int:
        """Lanes streaming or draining."""
        with self._lock:
            return self.lanes - len(self._free)

    # ---- the decode thread -------------------------------------------------------------------------------
    def acquire(self) -> int | None:
        """The lowest free lane, or None when every lane is busy or draining (try again next tick)."""
        with self._lock:
            if not self._free:
                return None
            lane = min(self._free)
            self._free.remove(lane)
            return lane

    def unacquire(self, lane: int) -> None:
        """Give back a lane from `acquire` that no utterance started on (its prefill failed)."""
        with self._lock:
            self._free.append(lane)

    def start(self, lane: int, job, int16: bool = False, player=None) -> None:
        """An utterance of `job` on `lane`: the next tick holds its first frame after the all-BOS one. int16: send
        its chunks as int16 samples (`pcm.to_int16`), converted on this thread once per push for all such lanes.
        player: the hashable key of the audio stream it continues (None: the job), whose utterances share one
        clock (`_Clock`): a text session's utterances are jobs of their own and one player. The key is held until
        its clock is forgotten (`_clock`): a bare token keeps nothing else alive."""
        self._inbox.put(("start", lane, job, int16, job if player is None else player))

    def tick(self, frames: torch.Tensor, lanes: tuple[int, ...], at: float | None = None) -> None:
        """One step's frames [n, Q] on the device; lanes[r]: the lane row r feeds (-1: none). On CUDA the frames
        are copied on the current stream, so the caller may overwrite its buffer with the next step. at: when the
        step was queued, in `time.perf_counter` seconds (None: now; a test may keep a clock of its own)."""
        if not any(lane >= 0 for lane in lanes) and not self.lanes_in_use:
            return
        copy = frames.clone()
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()
            copy.record_stream(self.stream)
        self._inbox.put(("tick", copy, lanes, event, time.perf_counter() if at is None else at))

    def end(self, lane: int, ended_at: int, final: bool) -> None:
        """The utterance on `lane` ends at lane frame `ended_at` (`Speech.ended_at`); final: its job's last."""
        self._inbox.put(("end", lane, ended_at, final))

    def drop(self, job) -> None:
        """Forget the job's lanes and their audio (the job was cancelled or failed)."""
        self._inbox.put(("drop", job))

    def graph_shapes(self) -> list[tuple[int, int]]:
        """The (lanes, frames) of every push CUDA may replay as a graph: each lane bucket up to `lanes`, each
        graphed width (`_pieces`)."""
        buckets = sorted({lane_bucket(m, self.lanes) for m in range(1, self.lanes + 1)})
        return [(m, n) for m in buckets for n in self._graphed]

    def warm(self) -> float:
        """On CUDA, capture every push's CUDA graph now (`graph_shapes`), on the codec's thread and stream, before
        any utterance: a capture takes a few calls' time, and on first use it stalled every stream's audio (64
        arrivals pass through a dozen lane buckets). Returns the seconds taken (0 on the CPU). Call it before the
        first `start`."""
        if self.stream is None:
            return 0.0
        began, done = time.perf_counter(), queue.SimpleQueue()
        self._inbox.put(("warm", done))
        error = done.get()
        if error is not None:
            raise error
        return time.perf_counter() - began

    def close(self, error: BaseException) -> None:
        """Stop the thread; jobs still waiting for audio end with `error`."""
        self._inbox.put(("close", error))
        self._thread.join()

    # ---- the codec thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.stream is None:
            one_cpu_thread()
        with torch.inference_mode(), torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            busy = time.perf_counter()  # since when this thread has been working
            while True:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    self._idle()
                    self.work["busy_s"] += time.perf_counter() - busy
                    message = self._inbox.get()
                    busy = time.perf_counter()
                if message[0] == "close":
                    self._fail_all(message[1])
                    return
                try:
                    getattr(self, "_on_" + message[0])(*message[1:])
                    if message[0] == "tick":
                        self._maybe_push()
                except Exception as e:  # a bug or a device error: the jobs with audio in flight fail
                    self._fail_all(e)
                now = time.perf_counter()
                self.work["busy_s"] += now - busy
                busy = now

    def expected_call_s(self, width: int) -> float | None:
        """A codec call's expected duration over `width` lanes: the median of the recent calls at that width, or
        at the next wider one seen (else the widest seen); None before any call."""
        if not self.recent_calls:
            return None
        seen = sorted(self.recent_calls)
        return statistics.median(self.recent_calls[next((w for w in seen if w >= width), seen[-1])])

    def first_chunk_now(self, width: int = 1) -> int:
        """Frames in the first chunk of an utterance cut now, while pushes span `width` lanes: `first_chunk`, or
        more when such codec calls take long (FIRST_CHUNK_CALLS of them in what each of its frames leaves the next
        chunk: a frame's audio less two ticks), at most `chunk`."""
        call_s = self.expected_call_s(width) if self.adaptive_first else None
        if call_s is None:
            return self.first_chunk
        room = self.frame_s - 2 * (statistics.median(self.recent_ticks) if self.recent_ticks else 0.0)
        need = self.chunk if room <= 0 else math.ceil(FIRST_CHUNK_CALLS * call_s / room - 1e-9)
        return min(self.chunk, max(self.first_chunk, need))

    def _width(self) -> int:
        """The slots a push spans now: the busy ones, 0 .. m - 1 (`_compact`; on CUDA rounded up to a bucket)."""
        m = max(self._live) + 1 if self._live else 1
        return lane_bucket(m, self.lanes) if self.stream is not None else m

    def _first_chunk(self, utterance: _Utterance) -> int:
        """The utterance's first chunk, decided anew until its first audio is sent (the load then, not at its
        start, counts: 64 streams arriving together start with fast calls and cut their audio under slow ones)."""
        if utterance.emitted == 0 and self.adaptive_first:
            key = (self._width(), self._calls)  # the same until a push or a lane changes it: one estimate a tick
            if self._first_now[0] != key:
                self._first_now = (key, self.first_chunk_now(key[0]))
            utterance.first_chunk = self._first_now[1]
        return utterance.first_chunk

    def _on_warm(self, done: queue.SimpleQueue) -> None:
        try:
            for m, n in sorted(self.graph_shapes(), key=lambda shape: -shape[0] * shape[1]):
                self.codec.capture(m, n)  # the largest first: the smaller ones fit in the blocks it freed
        except Exception as e:  # the caller's to raise: no utterance has started
            done.put(e)
            return
        done.put(None)

    def _on_start(self, lane: int, job, int16: bool, player) -> None:
        slot = self._free_slot(self.lanes)
        utterance = self._live[slot] = _Utterance(job, lane, slot, int16, self.first_chunk, clock=self._clock(player))
        self._slot_of[lane] = slot
        self._order.setdefault(job, deque()).append(utterance)

    def _clock(self, player) -> _Clock:
        """The player's clock, taken by one more utterance. A clock no utterance uses whose audio has played is
        forgotten (a new one would stand the same): the map holds the live players and those still playing."""
        now = time.perf_counter()
        for key in [key for key, c in self._clocks.items() if not c.users and not c.ahead_s(now)]:
            del self._clocks[key]
        clock = self._clocks.setdefault(player, _Clock())
        clock.users += 1
        return clock

    def _free_slot(self, below: int) -> int | None:
        """The lowest codec slot below `below` that no utterance holds (None: all are held)."""
        return next((s for s in range(below) if s not in self._live), None)

    def _on_tick(self, frames: torch.Tensor, lanes: tuple[int, ...], event, at: float) -> None:
        began = time.perf_counter()
        if self._last_tick is not None:
            self.recent_ticks.append(at - self._last_tick)
        self._last_tick = at
        if event is not None:
            self.stream.wait_event(event)
        slots = tuple(self._slot_of.get(lane, -1) for lane in lanes)
        rows, targets = self._index(slots)
        tick = frames.new_zeros(self.lanes, 1, self.q)
        if len(rows):
            tick[targets, 0] = frames[rows]
        seeking = [(r, slot) for r, slot in enumerate(slots) if slot in self._live and self._live[slot].seeking]
        if seeking:
            host, = to_host(frames)  # waits for the step, on this thread only
            for r, slot in seeking:
                utterance = self._live[slot]
                if bool((host[r] == self.bos).all()):
                    utterance.skipped += 1
                    continue
                self.codec.start(slot, bos_at=len(self._pending) - 1)  # this tick's frame is its frame 1
                utterance.seeking = False
                self._mark(utterance.job, "first_frame", began)
        self._pending.append(tick)
        for utterance in self._live.values():
            utterance.received += not utterance.seeking
        work = self.work
        work["ticks"] += 1
        work["tick_s"] += time.perf_counter() - began
        work["backlog_max"] = max(work["backlog_max"], self._inbox.qsize())

    def _on_end(self, lane: int, ended_at: int, final: bool) -> None:
        slot = self._slot_of.get(lane)
        if slot is None:  # dropped meanwhile
            return
        utterance = self._live[slot]
        utterance.final = final
        if utterance.seeking:  # nothing but all-BOS frames: no audio
            utterance.end = 0
        else:
            ended_at -= utterance.skipped
            self.codec.end(utterance.slot, ended_at)
            utterance.end = max(0, ended_at - self.q)
        self._maybe_push()
        self._send()  # an utterance without audio is done already

    def _on_drop(self, job) -> None:
        for utterance in self._order.pop(job, ()):
            self._release(utterance)
        self._compact()

    def _index(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that feed a slot, and those slots, on the device (`slots[r]` -1: row r feeds none)."""
        index = self._indexes.get(slots)
        if index is None:
            rows = [r for r, slot in enumerate(slots) if slot >= 0]
            index = (to_device(torch.tensor(rows, dtype=torch.long), self.device),
                     to_device(torch.tensor([slots[r] for r in rows], dtype=torch.long), self.device))
            self._indexes[slots] = index
            if len(self._indexes) > _INDEXES:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(slots)
        return index

    def _due(self, utterance: _Utterance) -> bool:
        """The lane has output to produce: its chunk target is past what its pushes reached."""
        if utterance.seeking:
            return False
        ready = utterance.received - self.q - self.lag
        return chunk_target(ready, utterance.end, self._first_chunk(utterance), self.chunk) > self._reached(utterance)

    def _urgent(self, utterance: _Utterance, now: float, slack_s: float) -> bool:
        """A due lane that should not wait: in its first, short chunks (a listener has just started) or ending,
        unless its job's audio is more than slack_s ahead of real time (the second sentence of a text: the player
        has the first's audio to play meanwhile)."""
        if utterance.clock.ahead_s(now) > slack_s:
            return False
        return utterance.end is not None or chunk_size(self._reached(utterance), utterance.first_chunk,
                                                       self.chunk) < self.chunk

    def _slack_s(self) -> float:
        """How far ahead of real time a job's audio must be for its due lane to wait for the next full-chunk push:
        twice a chunk's frames (`chunk` ticks come at least that fast while the stream keeps up with real time)
        and one codec call."""
        return 2 * self.chunk * self.frame_s + (self.expected_call_s(self._width()) or 0.0)

    def _reached(self, utterance: _Utterance) -> int:
        """The aligned frame the lane's pushes have decoded up to."""
        return max(utterance.pushed - self.q - self.lag, 0)

    def _maybe_push(self) -> None:
        """Push when a lane in its first chunks (or at its end) is due and its job's audio is not already well
        ahead of real time (`_urgent`), else once `chunk` ticks are pending: lanes in full chunks fall due at
        different ticks, and one push per lane each was a codec call every tick or two (the calls cost about the
        same whatever their width: 2.4 ms for 1 frame, 2.5 for 8 on the H200)."""
        if not self._pending:
            return
        due = [u for u in self._live.values() if self._due(u)]
        if not due:
            return
        if len(self._pending) < self.chunk:
            now, slack = time.perf_counter(), self._slack_s()
            if not any(self._urgent(u, now, slack) for u in due):
                return
        self._push(torch.cat(self._pending, 1))
        self._pending.clear()

    def _idle(self) -> None:
        """No message waiting: if no utterance is still running, drain the ended lanes now, in one push (the
        frames pending, then padding)."""
        if not self._live or any(u.end is None for u in self._live.values()):
            return
        started = [slot for slot, u in self._live.items() if not u.seeking]
        pending = len(self._pending)
        pad = max((self.codec.remaining(slot) for slot in started), default=0) - pending
        if pad > 0:
            self._pending.append(torch.zeros(self.lanes, pad, self.q, dtype=torch.int64, device=self.device))
        if self._pending:
            self._push(torch.cat(self._pending, 1))
            self._pending.clear()
        else:
            self._send()  # lanes without audio

    def _push(self, frames: torch.Tensor) -> None:
        """Push frames [lanes, n, Q] over the lowest bucket holding every used lane, then send each lane's due
        chunks."""
        began = time.perf_counter()
        m = self._width()  # on CUDA a bucket: few CUDA graphs
        timed = None if self.stream is None else [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        if timed:
            timed[0].record(self.stream)
        pieces = [self.codec.push(frames[:m, a:b]) for a, b in self._pieces(frames.shape[1])]
        for utterance in self._live.values():
            utterance.pushed = utterance.received
        if timed:
            timed[1].record(self.stream)
        hosts = to_host(*(pcm.float() for pcm, _ in pieces))  # on CUDA this waits for the codec's stream only
        if timed:
            self.work["gpu_s"] += timed[0].elapsed_time(timed[1]) / 1e3
        int16 = any(u.int16 for u in self._live.values())
        for host, (_, spans) in zip(hosts, pieces):
            host = host.numpy()
            host16 = to_int16(host) if int16 else None  # one conversion for every lane, off the consumers' threads
            for slot, utterance in self._live.items():
                start, stop = spans[slot]
                if stop > start:
                    utterance.audio.append((host16 if utterance.int16 else host)[slot, start:stop])
                    utterance.buffered += stop - start
        self._send(began)
        took = time.perf_counter() - began
        self.recent_calls.setdefault(m, deque(maxlen=_CALLS_KEPT)).append(took)
        self._calls += 1
        work = self.work
        work["pushes"] += 1
        work["push_frames"] += frames.shape[1]
        work["push_lanes"] += m
        work["push_s"] += took

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        """[a, b) frame ranges of one push: whole on the CPU; on CUDA split into graphed widths."""
        if self.stream is None or n == self._first or n in self.widths:
            return [(0, n)]
        ranges, a = [], 0
        while a < n:
            width = max(w for w in self.widths if w <= n - a)
            ranges.append((a, a + width))
            a += width
        return ranges

    def _send(self, push_began: float | None = None) -> None:
        """Each job's head lane: its due chunks to the job; finished lanes released, in order. push_began: when
        the push that decoded them began (None: no push, as when an end or a flush sends what is decoded)."""
        released = False
        for job in list(self._order):
            utterances = self._order[job]
            while utterances:
                utterance = utterances[0]
                done = utterance.end is not None and (utterance.seeking or self.codec.done(utterance.slot))
                self._chunks(utterance, done, push_began)
                if not done:
                    break
                self._release(utterances.popleft())
                released = True
                if utterance.final and not utterances:
                    del self._order[job]
                    self.on_done(job, None)
            if job in self._order and not self._order[job]:
                del self._order[job]
        if released:
            self._compact()

    def _chunks(self, utterance: _Utterance, done: bool, push_began: float | None) -> None:
        """Send the utterance's decoded audio in StreamingDecoder's chunks (the rest once done)."""
        while utterance.buffered:
            frames = utterance.buffered // self.hop
            size = chunk_size(utterance.emitted, self._first_chunk(utterance), self.chunk)
            if not done and frames < size:
                return
            n = utterance.buffered if done else size * self.hop
            audio = np.concatenate(utterance.audio) if len(utterance.audio) > 1 else utterance.audio[0]
            chunk, rest = audio[:n], audio[n:]
            utterance.audio = [rest] if rest.size else []
            utterance.buffered -= n
            if utterance.emitted == 0:
                self._mark(utterance.job, "push", push_began or time.perf_counter())
            utterance.emitted += n // self.hop
            utterance.clock.sent(n / self.hop * self.frame_s, time.perf_counter())
            self.emit(utterance.job, chunk)

    def _release(self, utterance: _Utterance) -> None:
        del self._live[utterance.slot], self._slot_of[utterance.lane]
        utterance.clock.users -= 1
        if not utterance.seeking:
            self.codec.release(utterance.slot)
        with self._lock:
            self._free.append(utterance.lane)

    def _compact(self) -> None:
        """Move the highest busy slots down into the free ones below them, so a push spans only busy slots. A job's
        next utterance starts while the one before drains, so it takes a slot above every busy one; once the one
        before has drained, the hole it left kept every push that wide until the next utterance ended (11.75
        slots a push for 8 streams of whole texts on the CPU, 4.3 with the moves). The moved stream's state and
        pending frames go with it (`StreamingCodec.move`, on the codec's device): its audio is unchanged."""
        while self._live:
            top = max(self._live)
            hole = self._free_slot(top)
            if hole is None:
                return
            utterance = self._live.pop(top)
            if not utterance.seeking:
                self.codec.move(top, hole)
            for tick in self._pending:
                tick[hole] = tick[top]
            self._live[hole] = utterance
            utterance.slot = self._slot_of[utterance.lane] = hole

    def _fail_all(self, error: BaseException) -> None:
        for job in list(self._order):
            for utterance in self._order.pop(job):
                self._release(utterance)
            self.on_done(job, error)
        self._pending.clear()
