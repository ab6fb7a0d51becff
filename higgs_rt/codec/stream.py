"""Streaming decode: the Talker's delayed frames in, PCM chunks out, concatenating to the offline decode.

Each chunk of aligned frames [start, stop) is decoded from the window [start - left_context, stop + lookahead)
and cropped. Output frame t of the decoder depends on latent frames t - left .. t + right (`receptive_field`:
(10, 10) frames for the released geometry), so left_context >= left and lookahead >= right make the stream equal
the offline decode up to float noise; a shorter look-ahead trades exactness for latency.

Default look-ahead (benchmarks/bench_codec_stream.py: random weights at the released shapes, fp32, 3 utterances of
60 frames, schedules first+chunk 1+1, 2+5, 4+8, 12+25, worst SNR vs offline decode):
    look-ahead  0    2    4     5     6     7     8     9     10 frames
    SNR (dB)    2.2  6.3  12.5  14.3  16.7  23.3  36.0  65.4  104.3
9 frames is the smallest with >= 60 dB on every schedule; it costs 9 x 40 ms = 360 ms of latency. (Random
weights weigh the far taps of the receptive field more than trained ones may: re-measure on real weights with
`--codec DIR`.) Aligned frame t is complete only after delayed frame t + Q - 1, so the first PCM needs the leading
BOS frame + (Q - 1 + first_chunk + lookahead) generated frames.
"""

from __future__ import annotations

import torch

from higgs_rt.ops import delay_revert

from .config import CodecConfig
from .layers import DILATIONS, KERNEL, upsample_geometry
from .model import Code2Wav

DEFAULT_LOOKAHEAD = 9
DEFAULT_FIRST_CHUNK = 4
DEFAULT_CHUNK = 8


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


class StreamingDecoder:
    """Stateful: `push` delayed frames [n, Q] (or [B, n, Q], rows in lockstep), get PCM; `flush` at the end.

    Leading all-BOS frames are dropped; a row ends at its first all-EOS frame (later frames of that row are
    ignored and its PCM is zero past its end; `num_samples` gives each row's true length). Chunks are [samples]
    for [n, Q] input and [B, samples] for [B, n, Q] input, on the codec's device and dtype. Frame bookkeeping
    stays on the host and only decode windows go to the device, so `push` never waits for the GPU: run it on
    a side stream and its chunks overlap the Talker's steps.
    """

    def __init__(self, codec: Code2Wav, first_chunk: int = DEFAULT_FIRST_CHUNK, chunk: int = DEFAULT_CHUNK,
                 lookahead: int = DEFAULT_LOOKAHEAD, left_context: int | None = None):
        if first_chunk < 1 or chunk < 1 or lookahead < 0 or (left_context is not None and left_context < 0):
            raise ValueError(f"need first_chunk, chunk >= 1 and lookahead, left_context >= 0, got "
                             f"{first_chunk}, {chunk}, {lookahead}, {left_context}")
        self.codec = codec
        self.first_chunk, self.chunk, self.lookahead = first_chunk, chunk, lookahead
        self.left_context = receptive_field(codec.config)[0] if left_context is None else left_context
        self.reset()

    def reset(self) -> None:
        self._single: bool | None = None
        self._started = False
        self._finished = False
        self._delayed: torch.Tensor | None = None  # delayed frames not yet turned into aligned ones
        self._codes: torch.Tensor | None = None  # aligned frames from index self._base on
        self._base = 0
        self._aligned = 0  # aligned frames known so far (lockstep over rows)
        self._ends: list[int | None] = []  # per row: aligned length once its all-EOS frame arrived
        self._emitted = 0

    @property
    def num_samples(self) -> list[int]:
        """Per row: samples of real audio emitted so far (rows that ended early stop counting at their end)."""
        hop = self.codec.hop_length
        return [min(self._emitted, end if end is not None else self._emitted) * hop for end in self._ends]

    def push(self, frames: torch.Tensor) -> torch.Tensor:
        if self._finished:
            raise RuntimeError("push() after flush(): call reset() to start a new utterance")
        single = frames.dim() == 2
        batch = frames[None] if single else frames
        q = self.codec.num_quantizers
        if batch.dim() != 3 or batch.shape[2] != q:
            raise ValueError(f"frames must be [n, {q}] or [B, n, {q}], got {tuple(frames.shape)}")
        if self._single is None:
            self._single, self._ends = single, [None] * batch.shape[0]
        elif single != self._single or batch.shape[0] != len(self._ends):
            raise ValueError(f"frames changed shape mid-stream: {tuple(frames.shape)}")
        self._ingest(batch.to(device="cpu", dtype=torch.int64))  # bookkeeping on the host: no device sync
        return self._emit(final=False)

    def flush(self) -> torch.Tensor:
        """Decode everything still held (rows that never sent EOS end at their last complete frame)."""
        if self._single is None:
            return self.codec.table.new_zeros(0)
        self._ends = [self._aligned if end is None else end for end in self._ends]
        out = self._emit(final=True)
        self._finished = True
        return out

    def _ingest(self, frames: torch.Tensor) -> None:
        bos, eos = self.codec.codebook_size, self.codec.codebook_size + 1
        if not self._started:
            data = (~(frames == bos).all(-1).all(0)).nonzero()
            if len(data) == 0:
                return
            self._started = True
            frames = frames[:, int(data[0]):]
        seen = self._aligned + (0 if self._delayed is None else self._delayed.shape[1])  # delayed frames so far
        for row, end in enumerate(self._ends):
            stops = (frames[row] == eos).all(-1).nonzero()
            if end is None and len(stops):
                self._ends[row] = max(0, seen + int(stops[0]) - self.codec.num_quantizers + 1)
        self._delayed = frames if self._delayed is None else torch.cat([self._delayed, frames], 1)
        ready = self._delayed.shape[1] - self.codec.num_quantizers + 1
        if ready > 0:
            aligned = delay_revert(self._delayed, self.codec.codebook_size, 0, ready)
            self._delayed = self._delayed[:, ready:]
            self._codes = aligned if self._codes is None else torch.cat([self._codes, aligned], 1)
            self._aligned += ready

    def _emit(self, final: bool) -> torch.Tensor:
        running = [self._aligned - self.lookahead for end in self._ends if end is None]
        limit = min(running) if running else max(self._ends, default=0)
        pieces = []
        while True:
            need = self.first_chunk if self._emitted == 0 else self.chunk
            available = limit - self._emitted
            if available <= 0 or (available < need and not final):
                break
            stop = self._emitted + (available if final else need)
            pieces.append(self._decode(self._emitted, stop))
            self._emitted = stop
        self._trim()
        out = torch.cat(pieces, 1) if pieces else self.codec.table.new_zeros(len(self._ends), 0)
        return out[0] if self._single else out

    def _decode(self, start: int, stop: int) -> torch.Tensor:
        hop = self.codec.hop_length
        out = self.codec.table.new_zeros(len(self._ends), (stop - start) * hop)
        left = max(0, start - self.left_context)
        groups: dict[int, list[int]] = {}
        for row, end in enumerate(self._ends):
            right = min(stop + self.lookahead, self._aligned if end is None else end)
            if right > start:
                groups.setdefault(right, []).append(row)
        for right, rows in groups.items():
            codes = self._codes[rows, left - self._base: right - self._base]
            wav = self.codec.decode(codes)
            valid = min(stop, right) - start
            out[rows, : valid * hop] = wav[:, (start - left) * hop: (start - left + valid) * hop]
        return out

    def _trim(self) -> None:
        keep_from = max(0, self._emitted - self.left_context)
        if self._codes is not None and keep_from > self._base:
            self._codes = self._codes[:, keep_from - self._base:]
            self._base = keep_from
