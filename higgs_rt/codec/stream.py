"""Streaming decode: the Talker's delayed frames in, PCM out, equal to the offline decode by construction.

- `StreamingCodec`: `slots` lanes in one batched state (`stateful.StatefulDecoder`: every convolution keeps its
  own left state, so no frame is decoded twice). Each lane is started, pushed, ended and released on its own; one
  `push` advances the lanes 0 .. m - 1 by the same number of delayed frames in one batched codec call (the batch
  engine's codec, `higgs_rt.batch_codec`, keeps its busy lanes lowest and pushes a bucket of them). The delay-pattern
  revert (`higgs_rt.ops.delay_revert`), the EOS check and the padding masks run on the codec's device, from the
  frames as the Talker left them there; the host keeps only integers (where each lane is, where it ends), so a
  push has no host sync and the codes need not leave the GPU. On CUDA a push of a width in `graph_widths` replays
  one CUDA graph of all of that device work (one per width and lane count, captured on first use): a push is ~130
  small kernels, and launching them one by one, with the bookkeeping around them, cost more than their work.
- `StreamingDecoder`: one utterance on a one-lane `StreamingCodec`, with the BOS/EOS checks on host copies of the
  frames and a chunk schedule (`first_chunk`, doubling up to `chunk`, then every `chunk` frames): the path
  `TTS` and `BatchEngine` use.

Exactness: output frame t depends on latent frames t - left .. t + right (`receptive_field`: (10, 10) for the
released geometry). The stream emits frame t once latent frame t + right is in, never earlier, with the offline
decode's zero padding at both ends, so a T-frame utterance streams exactly T * hop samples, equal to
`Code2Wav.decode` up to float rounding (see `stateful` for when the bits match).

Latency: aligned frame t is complete with delayed frame t + Q (the all-BOS frame is delayed frame 0), so the first
PCM (first_chunk frames) needs the leading BOS frame + (Q - 1) delay frames + first_chunk + right generated frames:
1 + 7 + 1 + 10 = 19 frames for the released model, i.e. 18 decode steps after the prefill's frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from higgs_rt.cuda_graph import capture_graph
from higgs_rt.ops import delay_revert
from higgs_rt.params import DEFAULT_CHUNK, DEFAULT_FIRST_CHUNK, MAX_CHUNK

from .config import CodecConfig
from .layers import DILATIONS, KERNEL, ieee_fp32, upsample_geometry
from .model import Code2Wav
from .stateful import StatefulDecoder

_UNENDED = 1 << 40  # a lane's length while its end is not known (times any rate, far inside int64)


def receptive_field(config: CodecConfig) -> tuple[int, int]:
    """(left, right) in frames: the output samples of frame t depend on latent frames t - left .. t + right."""
    hop, reach = config.hop_length, (KERNEL - 1) // 2
    frame = 1000  # far from both ends, where no padding is seen
    lo, hi = frame * hop - reach, (frame + 1) * hop - 1 + reach  # final conv
    for stride in reversed(config.upsampling_ratios):
        lo -= reach * sum(DILATIONS)
        hi += reach * sum(DILATIONS)
        kernel, padding, _ = upsample_geometry(stride)
        # output o = i * stride - padding + j for 0 <= j < kernel
        lo, hi = -((-(lo + padding - kernel + 1)) // stride), (hi + padding) // stride
    return frame - (lo - reach), (hi + reach) - frame


def check_chunking(first_chunk, chunk) -> None:
    """A chunk schedule's sizes, in frames: integers in 1..MAX_CHUNK or None (the default), else a TypeError or
    ValueError naming the argument (the codec's buffers and graphs grow with a chunk)."""
    for name, value in (("first_chunk", first_chunk), ("chunk", chunk)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer number of frames in 1..{MAX_CHUNK}, got {type(value).__name__}")
        if not 1 <= value <= MAX_CHUNK:
            raise ValueError(f"{name} must be an integer number of frames in 1..{MAX_CHUNK}, got {value}")


def _ramp(first_chunk: int, chunk: int) -> tuple[list[tuple[int, int]], int]:
    """The chunk schedule: the (start, size) of each chunk before the steady ones (first_chunk, then doubling up
    to chunk), and the aligned frame from which every chunk is `chunk` frames."""
    ramp, point, size = [], 0, first_chunk
    while True:
        ramp.append((point, size))
        point += size
        if size >= chunk:
            return ramp, point
        size = min(chunk, 2 * size)


def chunk_size(start: int, first_chunk: int, chunk: int) -> int:
    """How many frames the chunk that starts at aligned frame `start` (a chunk point) holds: first_chunk, then
    doubling up to chunk, then chunk (1, 2, 4, 8, 8, ... by default). Each chunk takes at most twice the decode
    steps of the one before it, so a player that started on the first chunk is not starved while the second is
    made (with 1 then 8, the second needed 8 steps within the first's 40 ms of audio)."""
    ramp, steady = _ramp(first_chunk, chunk)
    return next((size for point, size in ramp if point >= start), chunk) if start < steady else chunk


def chunk_target(ready: int, end: int | None, first_chunk: int, chunk: int) -> int:
    """With `ready` frames decodable (their receptive field in) and the utterance's length `end` (None: not known
    yet), the frame the output should have reached: the last chunk point (`chunk_size`'s schedule) at or below
    ready; the end once ready reaches it."""
    if end is not None and ready >= end:
        return end
    ramp, steady = _ramp(first_chunk, chunk)
    if ready >= steady:
        point = steady + (ready - steady) // chunk * chunk
    else:
        point = max((start + size for start, size in ramp if start + size <= ready), default=0)
    return point if end is None else min(point, end)


@dataclass
class _Lane:
    next: int  # the lane's index of the next pushed delayed frame (its all-BOS frame is 0)
    length: int | None = None  # aligned frames, once the host knows the end


class StreamingCodec:
    """`slots` independent streams sharing one batched codec call per `push`.

    Per lane: `start(slot)`; every `push(frames)` [slots, n, Q] carries n delayed frames of each lane (lanes not
    started, or done, are computed alongside and ignored); `end(slot, eos_at)` once the host knows where the
    lane's utterance ends; keep pushing (any codes for that lane) until `done(slot)`, or `flush()` once every live
    lane has ended; then `release(slot)`. `move(src, dst)` carries a live lane into a free one. A push returns the
    PCM [slots, n * hop] and, per lane, the span (start, stop) of its samples that are audio; a lane's spans
    concatenate to its offline decode. The PCM of a push is `lag` frames behind its input.

    The all-EOS frame is also found on the device, so the padding is right even before the host calls `end`; `end`
    must still come before the lane's output reaches its end (within `lag` frames of pushing the all-EOS frame),
    or the spans run past the audio.

    graph_widths: the push widths (frames) replayed as CUDA graphs on a CUDA codec; others run eagerly.
    """

    def __init__(self, codec: Code2Wav, slots: int, graph_widths: tuple[int, ...] = ()):
        self.codec, self.slots = codec, slots
        self.decoder = StatefulDecoder(codec, slots)
        self.lag = self.decoder.lag_frames
        self.hop = codec.hop_length
        q = codec.num_quantizers
        with torch.inference_mode():
            self._history = torch.zeros(slots, q - 1, q, dtype=torch.int64, device=self.device)  # last Q - 1 frames
            self._next = torch.zeros(slots, dtype=torch.int64, device=self.device)  # as _Lane.next, on the device
            self._length = torch.full((slots,), _UNENDED, dtype=torch.int64, device=self.device)
        self._lanes: list[_Lane | None] = [None] * slots
        self._ramps: dict[int, torch.Tensor] = {}
        self.graph_widths = set(graph_widths) if self.device.type == "cuda" else set()
        self._graphs: dict[tuple[int, int], _GraphedPush] = {}
        self._pool = None  # one memory pool for the graphs: they never replay at the same time

    @property
    def device(self) -> torch.device:
        return self.codec.table.device

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")

    def _lane(self, slot: int) -> _Lane:
        self._check_slot(slot)
        lane = self._lanes[slot]
        if lane is None:
            raise RuntimeError(f"slot {slot} has no stream: start() it first")
        return lane

    @torch.inference_mode()
    def start(self, slot: int, bos_at: int = 0) -> None:
        """A new utterance in `slot`: frame `bos_at` of the next push is its all-BOS frame (-1: that frame is not
        pushed; the next push starts with the frame after it). A lane still streaming is restarted."""
        self._check_slot(slot)
        if bos_at < -1:
            raise ValueError(f"bos_at must be >= -1, got {bos_at}")
        self.decoder.reset(slot)
        self._history[slot].zero_()  # fills, not `t[i] = n` (a pageable copy that waits for the stream)
        self._next[slot].fill_(-bos_at)
        self._length[slot].fill_(_UNENDED)
        self._lanes[slot] = _Lane(next=-bos_at)

    @torch.inference_mode()
    def end(self, slot: int, eos_at: int | None = None) -> None:
        """The utterance in `slot` ends at its all-EOS frame, the lane's frame `eos_at` (None: right after the
        frames pushed so far, as when generation stopped without an EOS)."""
        lane = self._lane(slot)
        eos_at = lane.next if eos_at is None else eos_at
        if eos_at < 1:
            raise ValueError(f"eos_at must be >= 1 (frame 0 is the all-BOS frame), got {eos_at}")
        length = max(0, eos_at - self.codec.num_quantizers)
        lane.length = length if lane.length is None else min(lane.length, length)
        self._length[slot: slot + 1].clamp_(max=length)

    def remaining(self, slot: int) -> int | None:
        """Frames still to push before the lane is done (None while its end is not known)."""
        lane = self._lane(slot)
        if lane.length is None:
            return None
        return max(0, lane.length - self._first_out(lane)) if lane.length else 0

    def done(self, slot: int) -> bool:
        """All of the lane's audio has been returned."""
        return self.remaining(slot) == 0

    def release(self, slot: int) -> None:
        self._lane(slot)
        self._lanes[slot] = None

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Lane src's stream continues in the free lane dst, as if it had been there from its start (its state
        copied on the codec's device, no sync); src is left free."""
        lane = self._lane(src)
        self._check_slot(dst)
        if self._lanes[dst] is not None:
            raise RuntimeError(f"slot {dst} is streaming: release it before moving slot {src} there")
        for t in self._state():
            t[dst].copy_(t[src])
        self._lanes[dst], self._lanes[src] = lane, None

    def _state(self) -> list[torch.Tensor]:
        """Every per-lane tensor a push reads and writes, lanes first: the decoder's and the delay revert's."""
        return [*self.decoder.states, self.decoder.delay, self._history, self._next, self._length]

    def _first_out(self, lane: _Lane) -> int:
        """The frame position of the next push's first output frame."""
        return lane.next - self.codec.num_quantizers - self.lag

    @torch.inference_mode()
    def push(self, frames: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Delayed frames [m, n, Q] for lanes 0 .. m - 1 (m <= slots; moved to the codec's device if elsewhere)
        -> (PCM [m, n * hop], per lane 0 .. m - 1 the (start, stop) of its audio samples in it; (0, 0) for none).
        Lanes m .. slots - 1 must not be streaming (they are not advanced)."""
        q = self.codec.num_quantizers
        if frames.dim() != 3 or not 1 <= frames.shape[0] <= self.slots or frames.shape[2] != q:
            raise ValueError(f"frames must be [m, n, {q}] with 1 <= m <= {self.slots}, got {tuple(frames.shape)}")
        m, n = frames.shape[:2]
        beyond = [slot for slot in range(m, self.slots) if self._lanes[slot] is not None]
        if beyond:
            raise ValueError(f"a push of {m} lanes would leave streaming slot(s) {beyond} behind")
        spans = [(0, 0) if lane is None else self._span(lane, n) for lane in self._lanes[:m]]
        if n == 0:
            return self.codec.table.new_zeros(m, 0), spans
        if n in self.graph_widths:
            pcm = self.capture(m, n)(frames)
        else:
            pcm = self._advance(frames.to(self.device, torch.int64, non_blocking=True))
        for lane in self._lanes[:m]:
            if lane is not None:
                lane.next += n
        return pcm, spans

    def capture(self, m: int, n: int) -> "_GraphedPush":
        """The CUDA graph of a push of m lanes and n frames (n in graph_widths), captured now if it was not: a
        caller may capture the shapes it will push before the first one (a capture takes a few calls' time)."""
        if n not in self.graph_widths or not 1 <= m <= self.slots:
            raise ValueError(f"no CUDA graph for a push of {m} lanes and {n} frames (slots {self.slots}, graphed "
                             f"widths {sorted(self.graph_widths)})")
        graphed = self._graphs.get((m, n))
        if graphed is None:
            graphed = self._graphs[m, n] = _GraphedPush(self, m, n)
        return graphed

    def _advance(self, frames: torch.Tensor) -> torch.Tensor:
        """A push's device work, frames [m, n, Q] on the device -> PCM [m, n * hop]: the delay revert over each
        lane's last Q - 1 frames and these, the all-EOS frame found (the lane's length), the decoder's step."""
        q, (m, n) = self.codec.num_quantizers, frames.shape[:2]
        history, next_, length = self._history[:m], self._next[:m], self._length[:m]
        window = torch.cat([history, frames], 1)
        aligned = delay_revert(window, self.codec.codebook_size, 0, n)  # lane positions next - Q + j
        history.copy_(window[:, n:])
        index = next_[:, None] + self._ramp(n)  # each pushed frame's lane index
        eos = (frames == self.codec.codebook_size + 1).all(-1) & (index >= 1)
        found = torch.where(eos, index - q, _UNENDED).amin(1).clamp_(min=0)
        torch.minimum(length, found, out=length)
        pcm = self.decoder.step(aligned, next_ - q, length)
        next_ += n
        return pcm

    def flush(self) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Push padding until every live lane is done, in one call (as `push`); every live lane must have ended."""
        open_ = [slot for slot, lane in enumerate(self._lanes) if lane is not None and lane.length is None]
        if open_:
            raise RuntimeError(f"flush: slot(s) {open_} have not ended")
        n = max((self.remaining(slot) for slot, lane in enumerate(self._lanes) if lane is not None), default=0)
        q = self.codec.num_quantizers
        return self.push(torch.zeros(self.slots, n, q, dtype=torch.int64, device=self.device))

    def _span(self, lane: _Lane, n: int) -> tuple[int, int]:
        first = self._first_out(lane)
        start = max(first, 0)
        stop = first + n if lane.length is None else min(first + n, lane.length)
        return ((start - first) * self.hop, (stop - first) * self.hop) if stop > start else (0, 0)

    def _ramp(self, n: int) -> torch.Tensor:
        ramp = self._ramps.get(n)
        if ramp is None:
            ramp = self._ramps[n] = torch.arange(n, device=self.device)
        return ramp


class _GraphedPush:
    """`StreamingCodec._advance` for m lanes and n frames as a CUDA graph; a push copies its frames in and replays
    it. The graph reads and writes the codec's own state tensors, so graphed and eager pushes interleave freely and
    give the same bits. The warm-up runs and the capture advance that state: it is saved before and put back
    after, so capturing is invisible to the stream."""

    def __init__(self, codec: StreamingCodec, m: int, n: int):
        self.frames = torch.zeros(m, n, codec.codec.num_quantizers, dtype=torch.int64, device=codec.device)
        state = codec._state()
        saved = [t.clone() for t in state]
        if codec._pool is None:
            codec._pool = torch.cuda.graph_pool_handle()
        with ieee_fp32():
            self.graph, self.out = capture_graph(lambda: codec._advance(self.frames), 2, codec._pool)
        for t, s in zip(state, saved):
            t.copy_(s)

    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        self.frames.copy_(frames, non_blocking=True)
        self.graph.replay()
        return self.out.clone()  # the static output is overwritten by the next replay


class StreamingDecoder:
    """One utterance: `push` delayed frames [n, Q] as they come, get PCM [samples]; `flush` at the end.

    Leading all-BOS frames are dropped; the utterance ends at its first all-EOS frame (later frames are ignored),
    or at `flush` after its last complete frame. The codec runs once `first_chunk` frames can be emitted, then
    for chunks doubling up to `chunk` frames (`chunk_size`); `lookahead` (the decoder's right receptive field) is
    not a choice. Chunks are on the codec's device and dtype, and concatenate to exactly T * hop samples for T
    aligned frames.

    Frames may live on the codec's device (no copy, no sync): pass their host copy as `host`, which the BOS and EOS
    checks read. One decoder serves utterance after utterance (`reset`); on CUDA its first chunk and its later
    chunks replay CUDA graphs captured on first use (`stateful`), so keep it rather than make one per utterance.
    """

    def __init__(self, codec: Code2Wav, first_chunk: int = DEFAULT_FIRST_CHUNK, chunk: int = DEFAULT_CHUNK):
        check_chunking(first_chunk, chunk)
        self.codec = codec
        self.first_chunk, self.chunk = first_chunk, chunk
        lag = StatefulDecoder.lag_frames_of(codec)
        # the widths of the pushes that carry a chunk: the first (the leading delay and look-ahead frames, then
        # first_chunk), those of the ramp and every later one
        ramp = {size for _, size in _ramp(first_chunk, chunk)[0][1:]}
        widths = sorted({first_chunk + codec.num_quantizers - 1 + lag, chunk} | ramp)
        self._lanes = StreamingCodec(codec, 1, graph_widths=tuple(widths))
        self.lookahead = self._lanes.lag
        self.reset()

    def reset(self) -> None:
        """Start a new utterance."""
        self._lanes.start(0, bos_at=-1)  # leading all-BOS frames are dropped, never pushed
        self._started = False
        self._finished = False
        self._pending: list[torch.Tensor] = []  # frames received but not pushed, on the codec's device
        self._received = 1  # the utterance's delayed frames so far, its all-BOS frame (0) included
        self._pushed = 1
        self._end: int | None = None  # aligned frames, once the all-EOS frame arrived
        self.num_samples = 0  # samples of audio returned so far

    def push(self, frames: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
        if self._finished:
            raise RuntimeError("push() after flush(): call reset() to start a new utterance")
        q = self.codec.num_quantizers
        if frames.dim() != 2 or frames.shape[1] != q:
            raise ValueError(f"frames must be [n, {q}], got {tuple(frames.shape)}")
        if host is None:
            if frames.device.type != "cpu":
                raise ValueError("frames on a device need their host copy (host=...) for the BOS and EOS checks")
            host = frames
        elif host.shape != frames.shape or host.device.type != "cpu":
            raise ValueError(f"host must be a CPU copy of frames {tuple(frames.shape)}, got {tuple(host.shape)} "
                             f"on {host.device}")
        if not self._started:
            data = (host != self.codec.codebook_size).any(-1).nonzero()
            if len(data) == 0:
                return self._empty()
            self._started = True
            frames, host = frames[int(data[0]):], host[int(data[0]):]
        if self._end is None:
            stops = (host == self.codec.codebook_size + 1).all(-1).nonzero()
            if len(stops):
                eos_at = self._received + int(stops[0])
                self._end = max(0, eos_at - q)
                self._lanes.end(0, eos_at)
                frames = frames[: int(stops[0])]  # frames from the all-EOS one on are padding
            if len(frames):
                # a copy: the caller may reuse its buffer (a CUDA graph's output is overwritten by the next step)
                self._pending.append(frames.to(self._lanes.device, torch.int64, non_blocking=True, copy=True))
                self._received += len(frames)
        return self._emit(final=False)

    def flush(self) -> torch.Tensor:
        """The rest of the utterance (ended at its last complete frame if no all-EOS frame came)."""
        if self._finished:
            return self._empty()
        if self._end is None:
            self._end = max(0, self._received - self.codec.num_quantizers)
            self._lanes.end(0, self._received)
        out = self._emit(final=True)
        self._finished = True
        return out

    def _empty(self) -> torch.Tensor:
        return self.codec.table.new_zeros(0)

    def _target(self, final: bool) -> int:
        """The frame the output should reach now."""
        if final:
            return self._end
        ready = self._received - self.codec.num_quantizers - self.lookahead  # frames whose receptive field is in
        return chunk_target(ready, self._end, self.first_chunk, self.chunk)

    @torch.inference_mode()
    def _emit(self, final: bool) -> torch.Tensor:
        q = self.codec.num_quantizers
        reached = self._pushed - q - self.lookahead  # the output has reached this frame (negative: the lag)
        target = self._target(final)
        if target <= max(reached, 0):
            return self._empty()
        n = target - reached
        frames = torch.cat(self._pending) if self._pending else torch.zeros(0, q, dtype=torch.int64,
                                                                             device=self._lanes.device)
        if frames.shape[0] < n:  # the end: padding, masked whatever it holds
            frames = torch.cat([frames, frames.new_zeros(n - frames.shape[0], q)])
        self._pending = [frames[n:]] if frames.shape[0] > n else []
        pcm, ((start, stop),) = self._lanes.push(frames[None, :n])
        self._pushed += n
        self.num_samples += stop - start
        return pcm[0, start:stop]
