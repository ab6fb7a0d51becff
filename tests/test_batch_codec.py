"""The batch engine's codec thread (higgs_rt.batch_codec), driven tick by tick as the decode loop drives it.

Every job's audio must be what `StreamingDecoder` gives for the same frames (the path `TTS.stream` takes), bit for
bit and in its chunk sizes, whatever the other lanes do, with the codec run only when a chunk is due.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import pytest
import torch

from conftest import wait_for
from higgs_rt.batch_codec import BatchCodec, _Clock, _Utterance, lane_bucket
from higgs_rt.codec import StreamingDecoder
from higgs_rt.fixtures.codec import delayed_frames, make_codec

K, Q = 16, 8
BOS, EOS = K, K + 1
TICK_S = 0.002  # `drive`'s ticks on the codec's clock: a fast step's


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    from higgs_rt.codec import load_codec

    return load_codec(make_codec(tmp_path_factory.mktemp("codec"), seed=3), device="cpu")


def utterance(frames: int, seed: int, extra_bos: int = 0, eos: bool = True) -> torch.Tensor:
    """Delayed frames as the Talker emits them after its all-BOS frame 0: extra all-BOS frames first (a sampler
    can draw BOS in codebook 0), then the codes' frames, then the all-EOS frame (eos) or nothing."""
    codes = torch.randint(0, K, (frames, Q), generator=torch.Generator().manual_seed(seed))
    delayed = delayed_frames(codes, K)[1:]  # without frame 0
    if not eos:
        delayed = delayed[:-1]
    return torch.cat([torch.full((extra_bos, Q), BOS, dtype=torch.long), delayed])


def alone(codec, delayed: torch.Tensor, chunk: int = 8) -> list[np.ndarray]:
    """StreamingDecoder's chunks for one utterance pushed a frame at a time (as TTS.stream does)."""
    decoder = StreamingDecoder(codec, chunk=chunk)
    chunks = [decoder.push(frame[None]) for frame in delayed] + [decoder.flush()]
    return [c.cpu().numpy() for c in chunks if c.numel()]


class Sink:
    """emit / on_done for BatchCodec: each job's chunks, and an event when it has ended."""

    def __init__(self):
        self.chunks: dict[str, list[np.ndarray]] = {}
        self.errors: dict[str, BaseException | None] = {}
        self.ended: dict[str, threading.Event] = {}

    def job(self, name: str) -> str:
        self.chunks[name], self.ended[name] = [], threading.Event()
        return name

    def emit(self, job, chunk):
        self.chunks[job].append(np.array(chunk))

    def on_done(self, job, error):
        self.errors[job] = error
        self.ended[job].set()

    def wait(self, job) -> list[np.ndarray]:
        assert self.ended[job].wait(60), f"{job} never ended"
        assert self.errors[job] is None
        return self.chunks[job]


def drive(codec, sink: Sink, plan: list[tuple[str, int, int, torch.Tensor, bool]], rows: int,
          lanes: int = 8, call_s: float | None = None, chunk: int | None = None,
          drops: dict[int, str] | None = None, players: dict[str, str] | None = None,
          warm: bool = False) -> BatchCodec:
    """Run the decode loop's side: plan[i] = (job, row, start tick, delayed frames, final) of an utterance; each
    tick sends every row's frame (random codes where no utterance runs) and, a tick later, the ends. call_s: the
    codec calls' duration to start from (a whole window of them at every width), with the load-adapted first
    chunk on. chunk: the steady chunk's frames (None: the default). drops: tick -> a job cancelled before that
    tick's frames (its rows feed no lane from then on); the ticks come TICK_S apart on the codec's clock,
    however fast this loop runs (the first chunk's rule counts them). players: job -> the player its utterances continue
    (`BatchCodec.start`; None: the job's own). warm: `BatchCodec.warm` first."""
    dropped = set()
    engine = BatchCodec(codec, lanes, sink.emit, sink.on_done, adaptive_first=call_s is not None, chunk=chunk)
    if warm:
        engine.warm()
    if call_s is not None:
        for width in range(1, lanes + 1):
            engine.recent_calls[width] = deque([call_s] * 9, maxlen=9)
    lane_of: dict[int, int] = {}
    ends: list[tuple[int, int, bool]] = []
    last = max(start + len(frames) for _, _, start, frames, _ in plan)
    for tick in range(last + 1):
        for lane, ended_at, final in ends:  # the host reads a step's frames a tick after it ran
            engine.end(lane, ended_at, final)
        ends = []
        if drops and tick in drops:
            engine.drop(drops[tick])
            dropped.add(drops[tick])
        for i, (job, _, start, frames, final) in enumerate(plan):
            if tick == start and job not in dropped:
                lane_of[i] = engine.acquire()
                engine.start(lane_of[i], job, player=(players or {}).get(job))
        step = torch.randint(0, K, (rows, Q), generator=torch.Generator().manual_seed(1000 + tick))
        lanes_of_rows = [-1] * rows
        for i, (job, row, start, frames, final) in enumerate(plan):
            if start <= tick < start + len(frames) and job not in dropped:
                assert lanes_of_rows[row] == -1, "the plan puts two utterances on one row"
                step[row] = frames[tick - start]
                lanes_of_rows[row] = lane_of[i]
                if tick == start + len(frames) - 1:
                    eos = bool((frames[-1] == EOS).all())
                    ends.append((lane_of[i], len(frames) if eos else len(frames) + 1, final))
        engine.tick(step.to(engine.device), tuple(lanes_of_rows), at=tick * TICK_S)
    for lane, ended_at, final in ends:
        engine.end(lane, ended_at, final)
    return engine


def assert_same_chunks(got: list[np.ndarray], want: list[np.ndarray], atol: float = 0.0, chunk: int = 8) -> None:
    """The same audio, bit for bit, in StreamingDecoder's chunks (1, 2, 4, ... doubling up to `chunk`, a power of
    two, then `chunk` frames at a time); the tail may come in other pieces (a lane drains with the ticks,
    StreamingDecoder flushes at once)."""
    join = lambda chunks: np.concatenate(chunks) if chunks else np.zeros(0, np.float32)  # noqa: E731
    if atol:
        np.testing.assert_allclose(join(got), join(want), rtol=0, atol=atol)
    else:
        np.testing.assert_array_equal(join(got), join(want))
    sizes = [c.shape[0] // 960 for c in got]
    ramp = [1 << i for i in range(chunk.bit_length() - 1)]
    assert sizes[:-1] == (ramp + [chunk] * len(sizes))[:max(len(sizes) - 1, 0)]


def test_streams_starting_and_ending_apart_get_streaming_decoders_chunks(codec):
    sink = Sink()
    plan = [(sink.job("a"), 0, 0, utterance(30, 1), True), (sink.job("b"), 1, 3, utterance(12, 2, extra_bos=2), True),
            (sink.job("c"), 2, 5, utterance(45, 3, eos=False), True), (sink.job("d"), 3, 9, utterance(0, 4), True),
            (sink.job("e"), 1, 40, utterance(9, 9), True)]  # b's row again, while b's lane may still drain
    engine = drive(codec, sink, plan, rows=4, lanes=16)  # drive does not wait for lanes to come back
    try:
        for job, _, _, frames, _ in plan:
            assert_same_chunks(sink.wait(job), alone(codec, frames))
        assert sink.chunks["d"] == []
    finally:
        engine.close(RuntimeError("closed"))


def test_a_lone_stream_runs_the_codec_as_often_as_streaming_decoder(codec):
    sink = Sink()
    frames = utterance(40, 5)
    engine = drive(codec, sink, [(sink.job("a"), 0, 0, frames, True)], rows=1)
    try:
        want = alone(codec, frames)
        assert_same_chunks(sink.wait("a"), want)
        # one codec call per chunk, not per tick; the end is known a tick late (the host reads a step's frames a
        # tick after it ran), which can complete one more chunk before the tail
        assert len(want) <= engine.pushes <= len(want) + 1
    finally:
        engine.close(RuntimeError("closed"))


def test_staggered_streams_in_full_chunks_share_codec_calls(codec):
    """Four streams three ticks apart: each gets StreamingDecoder's audio and chunks, while lanes due a full chunk
    wait for one call per `chunk` ticks (21 calls here; one per lane and chunk would be 44)."""
    sink = Sink()
    plan = [(sink.job(f"s{i}"), i, 3 * i, utterance(80, 20 + i), True) for i in range(4)]
    engine = drive(codec, sink, plan, rows=4, lanes=16)  # drive does not wait for lanes to come back
    try:
        for job, _, _, frames, _ in plan:
            assert_same_chunks(sink.wait(job), alone(codec, frames))
        assert engine.pushes <= 24
    finally:
        engine.close(RuntimeError("closed"))


def test_longer_chunks_take_fewer_codec_calls_for_the_same_audio(codec):
    """`serve --chunk 16`: four streams three ticks apart get StreamingDecoder's audio in its 16-frame chunks, from
    fewer codec calls (17 here; the same plan at 8 frames takes 21)."""
    sink = Sink()
    plan = [(sink.job(f"s{i}"), i, 3 * i, utterance(80, 20 + i), True) for i in range(4)]
    engine = drive(codec, sink, plan, rows=4, chunk=16)
    try:
        assert engine.widths == [1, 2, 4, 8, 16]
        for job, _, _, frames, _ in plan:
            assert_same_chunks(sink.wait(job), alone(codec, frames, chunk=16), chunk=16)
        assert engine.pushes <= 17
    finally:
        engine.close(RuntimeError("closed"))


def test_a_jobs_utterances_in_overlapping_lanes_come_out_in_order(codec):
    sink = Sink()
    job = sink.job("long")
    first, second = utterance(10, 6), utterance(20, 7)
    # the second utterance starts the tick after the first's last frame, while the first's lane still drains
    plan = [(job, 0, 0, first, False), (job, 0, len(first), second, True),
            (sink.job("other"), 1, 2, utterance(50, 8), True)]
    engine = drive(codec, sink, plan, rows=2)
    try:
        got = np.concatenate(sink.wait(job))
        want = np.concatenate(alone(codec, first) + alone(codec, second))
        np.testing.assert_array_equal(got, want)
    finally:
        engine.close(RuntimeError("closed"))


@pytest.fixture
def recorded(monkeypatch):
    """Each push's (width, busy slots) and each `StreamingCodec.move`'s (src, dst), as the codec thread makes
    them."""
    from higgs_rt.codec import StreamingCodec

    widths, moves = [], []
    push, move = BatchCodec._push, StreamingCodec.move

    def recording_push(self, frames):
        widths.append((self._width(), len(self._live)))
        return push(self, frames)

    def recording_move(self, src, dst):
        moves.append((src, dst))
        return move(self, src, dst)

    monkeypatch.setattr(BatchCodec, "_push", recording_push)
    monkeypatch.setattr(StreamingCodec, "move", recording_move)
    return widths, moves


def test_pushes_span_only_busy_slots_while_utterances_drain(codec, recorded):
    """Jobs of three utterances each on 4 rows, each next utterance starting while the one before drains: the
    drained utterances' slots are filled by moving the highest busy streams down, so every push spans exactly the
    busy slots (without the moves a next utterance kept a slot above the others' for its whole length), and every
    job's audio is still its utterances' StreamingDecoder audio, bit for bit."""
    widths, moves = recorded
    sink, plan, parts = Sink(), [], {}
    for row, lengths in enumerate([(12, 30, 9), (25, 8, 20), (6, 40, 10), (18, 18, 18)]):
        job, start = sink.job(f"job{row}"), row * 3
        for i, n in enumerate(lengths):
            frames = utterance(n, 100 * row + i)
            plan.append((job, row, start, frames, i == len(lengths) - 1))
            parts.setdefault(job, []).append(frames)
            start += len(frames)
    engine = drive(codec, sink, plan, rows=4, lanes=16)  # drive does not wait for lanes to come back
    try:
        for job, utterances in parts.items():
            want = np.concatenate([c for frames in utterances for c in alone(codec, frames)])
            np.testing.assert_array_equal(np.concatenate(sink.wait(job)), want)
        assert moves and all(dst < src for src, dst in moves)
        assert widths and all(width == busy for width, busy in widths), widths
        assert max(busy for _, busy in widths) > 4  # some pushes carried a draining utterance beside 4 running
    finally:
        engine.close(RuntimeError("closed"))


@pytest.mark.parametrize("extra_bos", [1, 14])
def test_a_cancelled_jobs_slot_is_filled_without_changing_the_others_audio(codec, recorded, extra_bos):
    """The job in slot 0 is dropped mid-stream: the highest busy stream moves down into slot 0 at once (pending
    frames and all; with 14 leading all-BOS frames it has not started in the codec yet, so only its frames move),
    and the jobs still streaming get StreamingDecoder's audio bit for bit."""
    widths, moves = recorded
    sink = Sink()
    plan = [(sink.job("gone"), 0, 0, utterance(60, 11), True), (sink.job("a"), 1, 1, utterance(40, 12), True),
            (sink.job("b"), 2, 2, utterance(35, 13, extra_bos=extra_bos), True)]
    engine = drive(codec, sink, plan, rows=3, drops={13: "gone"})
    try:
        for job, _, _, frames, _ in plan[1:]:
            assert_same_chunks(sink.wait(job), alone(codec, frames))
        assert moves[0] == (2, 0) if extra_bos == 1 else moves == []  # a stream not started moves no state
        assert widths and all(width == busy for width, busy in widths), widths
        assert "gone" not in sink.errors
    finally:
        engine.close(RuntimeError("closed"))


@pytest.mark.parametrize("ahead, jobs, shared", [(False, 1, False), (True, 1, False), (True, 3, True),
                                                 (True, 3, False)])
def test_later_sentences_ahead_of_real_time_wait_for_the_full_chunk_push(codec, monkeypatch, ahead, jobs, shared):
    """A text of three sentences beside a long stream, its audio sent in no time (the clock made deterministic:
    the wall stands still, or the audio is never ahead). Ahead (past two chunks and a call), the later
    sentences' short first chunks and the ends wait for the push every `chunk` ticks; not ahead, each is a codec
    call of its own, as for a first sentence. The audio and its chunks are the same either way, but for the tails.
    jobs=3: the sentences are jobs of their own, each started a few ticks after the one before ends, as a text
    session's; shared, they name one player (`start`), else each is a player of its own and not ahead."""
    monkeypatch.setattr(_Clock, "sent", lambda self, seconds, now: setattr(self, "until", (self.until or 0) + seconds))
    monkeypatch.setattr(_Clock, "ahead_s", lambda self, now: (self.until or 0.0) if ahead else 0.0)
    sink = Sink()
    names = ["text"] * 3 if jobs == 1 else [f"text{i}" for i in range(3)]
    for name in {*names, "other"}:
        sink.job(name)
    sentences = [utterance(30, 21 + i) for i in range(3)]
    plan, start = [("other", 1, 0, utterance(150, 30), True)], 0
    for i, frames in enumerate(sentences):
        plan.append((names[i], 0, start, frames, i == 2 or jobs > 1))
        start += len(frames) + (0 if jobs == 1 else 4)
    engine = drive(codec, sink, plan, rows=2, players={name: "text" for name in names} if shared else None)
    try:
        got = [c for name in dict.fromkeys(names) for c in sink.wait(name)]
        want = [c for frames in sentences for c in alone(codec, frames)]
        np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
        assert [c.shape[0] for c in got][:4] == [c.shape[0] for c in want][:4]  # 1, 2, 4, 8 frames
        assert_same_chunks(sink.wait("other"), alone(codec, plan[0][3]))
        pushes = engine.pushes
    finally:
        engine.close(RuntimeError("closed"))
    # 159 ticks: 20 pushes of 8 when none is urgent (20 here when ahead), 25 here when not: an urgent push also
    # empties the pending ticks, so the cadence's pushes shift rather than add up
    assert pushes <= 21 if ahead and (jobs == 1 or shared) else pushes >= 24, pushes


def test_a_players_clock_runs_with_the_audio_sent_and_waits_when_it_runs_dry():
    clock = _Clock()
    assert clock.ahead_s(5.0) == 0.0
    clock.sent(2.0, now=10.0)
    assert clock.ahead_s(10.5) == 1.5
    clock.sent(1.0, now=11.0)  # queued behind the first
    assert clock.ahead_s(12.0) == 1.0 and clock.ahead_s(14.0) == 0.0
    clock.sent(0.5, now=20.0)  # the player ran dry at 13 and starts again now
    assert clock.ahead_s(20.0) == 0.5


def test_clocks_are_forgotten_once_unused_and_played(codec):
    """A player's clock lives while an utterance uses it or its audio plays: the map stays as small as the live
    players, however many requests and sessions have come and gone."""
    sink = Sink()
    engine = BatchCodec(codec, 3, sink.emit, sink.on_done)
    try:
        for name, player in (("a", None), ("b", "session")):
            engine.start(engine.acquire(), sink.job(name), player=player)
        engine.end(0, 1, final=True)  # both end at their first frame: no audio, nothing ahead
        engine.end(1, 1, final=True)
        assert sink.ended["a"].wait(30) and sink.ended["b"].wait(30)
        assert wait_for(lambda: engine.lanes_in_use == 0)  # the codec thread frees the lanes
        engine.start(engine.acquire(), sink.job("c"), player="session")
        wait_for(lambda: list(engine._clocks) == ["session"])
        assert list(engine._clocks) == ["session"] and engine._clocks["session"].users == 1
    finally:
        engine.close(RuntimeError("closed"))


def test_lanes_lowest_first_and_given_back(codec):
    sink = Sink()
    engine = BatchCodec(codec, 3, sink.emit, sink.on_done)
    try:
        assert [engine.acquire() for _ in range(4)] == [0, 1, 2, None]
        for lane, name in enumerate("xyz"):
            engine.start(lane, sink.job(name))
        engine.drop("y")  # cancelled: its lane comes back, nothing is sent
        engine.end(0, 1, final=True)  # an utterance that ended at its first frame: no audio
        assert sink.ended["x"].wait(30) and sink.chunks["x"] == []
        wait_for(lambda: engine.lanes_in_use == 1)  # the codec thread frees x's and y's lanes
        assert engine.lanes_in_use == 1 and engine.acquire() == 0 and engine.acquire() == 1 and engine.acquire() is None
        assert "y" not in sink.errors and not sink.chunks["y"]
    finally:
        engine.close(RuntimeError("closed"))
    assert isinstance(sink.errors["z"], RuntimeError)  # still streaming at close: ended with the error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_chunks_are_streaming_decoders(tmp_path, recorded):
    """On CUDA the codec thread runs its pushes as CUDA graphs of lane buckets on its own stream, every one
    captured by `warm` before the first utterance (eleven utterances, at most all at once: buckets of 12 and 10
    lanes as well as powers of two); the audio is StreamingDecoder's (eager, one lane) up to the convolutions'
    rounding, in its chunk sizes; its pushes' GPU time is counted, and is less than the pushes' host time (which
    waits for it)."""
    from higgs_rt.codec import load_codec

    cuda_codec = load_codec(make_codec(tmp_path, seed=3), device="cuda")
    sink = Sink()
    plan = [(sink.job("a"), 0, 0, utterance(30, 1), True), (sink.job("b"), 1, 3, utterance(12, 2, extra_bos=2), True),
            (sink.job("c"), 2, 5, utterance(45, 3, eos=False), True)]
    plan += [(sink.job(f"d{i}"), 3 + i, 8 + i, utterance(20 + 3 * i, 10 + i), True) for i in range(8)]
    engine = drive(cuda_codec, sink, plan, rows=11, lanes=16, warm=True)
    try:
        for job, _, _, frames, _ in plan:
            assert_same_chunks(sink.wait(job), alone(cuda_codec, frames), atol=1e-4)
        assert 0 < engine.work["gpu_s"] < engine.work["push_s"]
        assert {10, 12} <= {m for m, _ in recorded[0]} <= {1, 2, 4, 8, 10, 12, 14, 16}
        assert sorted(engine.codec._graphs) == engine.graph_shapes()  # all captured by warm, none since
    finally:
        engine.close(RuntimeError("closed"))


def test_lane_buckets_are_powers_of_two_then_quarter_octaves():
    assert [lane_bucket(m, 128) for m in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20]
    assert [lane_bucket(m, 128) for m in (33, 40, 41, 64, 65, 72, 81, 97, 113, 128)] == [40, 40, 48, 64, 80, 80, 96,
                                                                                       112, 128, 128]
    assert lane_bucket(65, 70) == 70 and lane_bucket(3, 3) == 3  # never past the lanes there are
    assert len({lane_bucket(m, 128) for m in range(1, 129)}) == 20  # CUDA graphs: 20 widths in lanes at most


def test_the_graphs_warm_captures_are_every_bucket_at_every_graphed_width(codec):
    engine = BatchCodec(codec, 16, None, None)
    try:
        widths = [1, 2, 4, 8, engine._first]  # a chunk's pieces and a lone lane's first push
        assert engine._first > 8
        assert engine.graph_shapes() == [(m, n) for m in (1, 2, 4, 8, 10, 12, 14, 16) for n in widths]
        assert engine.warm() == 0.0 and not engine.codec._graphs  # the CPU runs its pushes eagerly
        with pytest.raises(ValueError, match="no CUDA graph for a push of 4 lanes and 8 frames"):
            engine.codec.capture(4, 8)
    finally:
        engine.close(RuntimeError("done"))


def test_bad_settings(codec, monkeypatch):
    with pytest.raises(ValueError, match="lanes >= 1"):
        BatchCodec(None, 0, None, None)
    monkeypatch.setenv("HIGGS_RT_CODEC_PRIORITY", "high")
    from higgs_rt.batch_codec import _stream_priority

    with pytest.raises(ValueError, match="HIGGS_RT_CODEC_PRIORITY must be -1"):
        _stream_priority()


def test_to_host_passes_cpu_tensors_and_pins_device_ones():
    from higgs_rt.host_copy import to_host

    cpu = torch.arange(6).view(2, 3)
    assert to_host(cpu)[0] is cpu
    if not torch.cuda.is_available():
        return
    a, b = torch.randn(64, 960, device="cuda"), torch.arange(8, device="cuda")
    host_a, host_b, same = to_host(a, b, cpu)
    assert host_a.is_pinned() and host_b.is_pinned() and same is cpu
    assert torch.equal(host_a, a.cpu()) and torch.equal(host_b, b.cpu())


def test_copies_to_the_device_never_wait_for_the_stream():
    from higgs_rt.host_copy import copy_to, to_device

    src = torch.arange(12).view(3, 4)
    dst = torch.zeros(3, 4, dtype=torch.long)
    assert copy_to(dst, src) is dst and torch.equal(dst, src)
    assert to_device(src, torch.device("cpu")) is src and to_device(src, "cpu") is src
    if not torch.cuda.is_available():
        return
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host wait for the stream raises
    try:
        for _ in range(20):
            busy = busy @ busy / 64  # the stream has queued work the copies must not wait for
        on_gpu = to_device(src, "cuda")
        dst = torch.zeros(3, 4, dtype=torch.long, device="cuda")
        pinned = torch.ones(3, 4, dtype=torch.long).pin_memory()
        copy_to(dst, pinned)
        pinned.fill_(5)  # the caller's host tensor may change at once: the copy was staged
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_gpu.cpu(), src) and torch.equal(dst.cpu(), torch.ones(3, 4, dtype=torch.long))


def test_the_first_chunk_holds_one_and_a_half_codec_calls_of_audio_when_calls_are_slow(codec):
    """What a first chunk of f frames leaves for the call that makes the next (2f frames, made while the player
    plays f): f x (a frame's audio - 2 ticks); it must hold 1.5 calls."""
    engine = BatchCodec(codec, 2, None, None, adaptive_first=True)
    try:
        assert engine.frame_s == pytest.approx(0.04)
        assert engine.first_chunk_now() == 1  # no call yet
        calls = engine.recent_calls.setdefault(1, deque(maxlen=9))
        for call_s, frames in [(0.0, 1), (0.02, 1), (0.03, 2), (0.1, 4), (1.0, 8)]:  # ceil(1.5 call / 40 ms), <= 8
            calls.extend([call_s] * 5)  # a majority of the last 9
            assert engine.first_chunk_now() == frames, call_s
        calls.extend([0.01] * 8 + [5.0])  # one slow call (a graph's capture) among fast ones
        assert engine.first_chunk_now() == 1
        # by width: the calls as wide as the pushes, else the next wider seen, else the widest seen
        engine.recent_calls[4] = deque([0.1] * 9, maxlen=9)
        assert [engine.first_chunk_now(w) for w in (1, 2, 4, 8)] == [1, 4, 4, 4]
        # ticks of 11 ms (prefills riding along): each frame of the first chunk leaves 18 ms for the next's call
        engine.recent_ticks.extend([0.011] * 5 + [0.5] * 4)  # the median: idle gaps do not count
        assert [engine.first_chunk_now(w) for w in (1, 4)] == [1, 8]  # ceil(1.5 x 0.1 / 0.018) = 9, at most 8
        engine.recent_calls[4] = deque([0.03] * 9, maxlen=9)
        assert engine.first_chunk_now(4) == 3  # 2 with the ticks not counted
        engine.recent_ticks.extend([0.02] * 9)  # the stream makes audio no faster than twice real time
        assert engine.first_chunk_now(4) == 8
        engine.adaptive_first = False  # the CPU's default: StreamingDecoder's chunks whatever the load
        assert engine.first_chunk_now(4) == 1
    finally:
        engine.close(RuntimeError("done"))


def test_the_first_chunk_follows_the_load_until_it_is_sent(codec):
    """64 requests arriving together start while calls are narrow and fast: the first chunk is decided by the
    calls as wide as the pushes when it is cut, and stays once audio went out (the ramp doubles from it)."""
    engine = BatchCodec(codec, 8, None, None, adaptive_first=True)
    try:
        engine.recent_calls[1] = deque([0.01] * 9, maxlen=9)
        engine.recent_calls[8] = deque([0.1] * 9, maxlen=9)
        utterance = _Utterance(job="a", lane=0, slot=0)
        engine._live[0] = utterance
        assert engine._first_chunk(utterance) == 1  # one lane in use: fast calls
        engine._live[7] = _Utterance(job="b", lane=7, slot=7)  # the pushes now span 8 slots (slot 7 in use)
        assert engine._first_chunk(utterance) == 4
        utterance.emitted = 4  # its first chunk went out
        del engine._live[7]
        assert engine._first_chunk(utterance) == 4
    finally:
        engine._live.clear()
        engine.close(RuntimeError("done"))


def test_a_longer_first_chunk_cuts_the_same_samples_elsewhere(codec):
    sink = Sink()
    frames = utterance(40, 5)
    # 1.5 calls of 90 ms in what each frame leaves the next chunk, 40 - 2 x 2 ms: 3.75 -> 4 frames
    engine = drive(codec, sink, [(sink.job("a"), 0, 0, frames, True)], rows=1, call_s=0.09)
    try:
        got = sink.wait("a")
    finally:
        engine.close(RuntimeError("done"))
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(alone(codec, frames)))
    sizes = [c.shape[0] // 960 for c in got]
    assert sizes[:2] == [4, 8], sizes
