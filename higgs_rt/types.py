"""The types every layer shares: a reference `Voice`, one utterance's `Generation`, a stream's `StreamStats`, the
`Stream` a call returns (its chunks, then its stats and frames), a text session's `SessionEvent`, `BufferFull`, and
the synthesis parameters (defined in `higgs_rt.params`, re-exported here). A leaf module: it imports nothing from
higgs_rt but `params`, so the voice library, the HTTP schema, the engines and the server all take their types
from here and never from each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from .params import SamplingParams, SynthesisParams

__all__ = ["BufferFull", "Generation", "SamplingParams", "SessionEvent", "Stream", "StreamStats", "SynthesisParams",
           "Voice", "check_callback"]


def check_callback(name: str, fn) -> None:
    """A callback argument is None or callable, else a TypeError naming it when the call is made, not when the
    callback would first run."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")


@dataclass
class Voice:
    """A reference voice: its transcript and its delayed frames [N, Q] (BOS and EOS columns included)."""

    text: str
    frames: torch.Tensor


@dataclass
class Generation:
    """Delayed frames [T, Q] from the all-BOS frame 0 through the first all-EOS frame, when one came.

    `finished` is False when max_frames (or a stop request) cut the utterance before its EOS.
    """

    frames: torch.Tensor
    finished: bool = False
    stopped: bool = False


@dataclass
class StreamStats:
    """What one call measured. RTF = synthesis time / audio duration (below 1 is faster than real time)."""

    first_audio_s: float | None = None
    synthesis_s: float = 0.0
    audio_s: float = 0.0
    frames: int = 0
    utterances: int = 0
    truncated: int = 0  # utterances that hit max_frames without EOS
    stopped: bool = False
    underruns: int = 0
    prompt_tokens: int = 0  # over the utterances started

    @property
    def rtf(self) -> float:
        return self.synthesis_s / self.audio_s if self.audio_s else float("inf")

    @property
    def ms_per_frame(self) -> float:
        return 1e3 * self.synthesis_s / self.frames if self.frames else float("nan")

    def summary(self) -> str:
        first = "n/a" if self.first_audio_s is None else f"{1e3 * self.first_audio_s:.0f} ms"
        rtf = f"{self.rtf:.3f}" if self.audio_s else "n/a (no audio)"
        return (f"first audio {first}, RTF {rtf} (synthesis {self.synthesis_s:.2f} s / audio "
                f"{self.audio_s:.2f} s), {self.ms_per_frame:.1f} ms/frame, {self.underruns} underruns")


class Stream:
    """One call's audio as it comes, with its results: iterate it for float32 PCM chunks; once it has ended,
    `stats` is complete and `frames` holds each utterance's delayed frames [T, Q]. Closing it (or leaving a
    `with` block, or the iteration early and dropping it) stops the call: `stats.stopped`; closed from another
    thread while its consumer is inside `next`, it is stopped instead (that chunk is its last). end: what closing
    calls after the chunks' own close (for a call whose chunks never started); stop: what stops the call from any
    thread (within one frame)."""

    def __init__(self, chunks: Iterator[np.ndarray], stats: StreamStats, results: list[Generation],
                 end: Callable[[], None] | None = None, stop: Callable[[], None] | None = None):
        self._chunks, self.stats, self._results, self._end, self._stop = chunks, stats, results, end, stop

    @property
    def frames(self) -> list[torch.Tensor]:
        return [r.frames for r in self._results]

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> np.ndarray:
        return next(self._chunks)

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # "generator already executing": its consumer is in `next` on another thread
                if self._stop is None:
                    raise
                self._stop()  # it ends by itself, and its stats say so (the chunks' state is that thread's)
                return
        if self._end is not None:
            self._end()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BufferFull(RuntimeError):
    """The consumer stopped reading: too much audio was waiting for it, so the request was cancelled."""


@dataclass
class SessionEvent:
    """One event of a text session (`higgs_rt.session.Session`), in order:

    "start"  an utterance begins: `utterance` (0, 1, ...) and its `text`
    "audio"  `pcm`: a float32 mono chunk of that utterance at the session's sample rate
    "end"    the utterance ended: its `text` and its `stats` (first_audio_s: from the text that completed it to
             its first audio)
    "error"  the session failed (`error`: one line); "closed" follows at once
    "closed" the last event: the session ended (`stats`: the whole session's; `cancelled`: by `cancel()`;
             `error`: as the "error" event's)
    """

    kind: str
    utterance: int | None = None
    text: str | None = None
    pcm: np.ndarray | None = None
    stats: StreamStats | None = None
    error: str | None = None
    cancelled: bool = False
