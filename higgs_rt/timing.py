"""Where a cold start's time goes: named stages on one clock, recorded only while a `Timeline` is active.

The loader and the engine mark their stages where they happen (`stage`, `note`, `mark`); every one is a no-op
unless a timeline is recording, which `--verbose` starts at the command line's entry (`higgs-rt speak`, `serve`,
`wyoming`), with its origin at the process's start. The command prints the report (`report`) once its cold start
is over: `speak` after it has spoken, the servers once they are ready.

    higgs-rt: cold start (--verbose), seconds since the process started:
       0.000  0.214  start-up (interpreter, higgs_rt.cli)
       0.214  1.832  import torch
       ...
       2.970  0.051    talker weights   [33 MB float32 -> cpu ...]
       ...
    higgs-rt: first audio 5.12 s after the process started, 3.08 s after import torch returned

Stages nest (the loader's inside `TTS()`), shown indented. `mark(name)` records a stage that began when the
previous stage at its depth ended: "first audio" is the time from the end of the prefill to the first PCM chunk.
A `final` mark at the top level (speak's first audio, a server's "ready") ends the recording: later utterances
record nothing. One timeline per process (a module global, so a load in any thread records): cold start is a
process-wide event. On CUDA each stage ends with a device synchronize, so asynchronous work is counted in the
stage that queued it (only while recording: without --verbose nothing waits).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, TextIO

__all__ = ["Stage", "Timeline", "start", "stop", "current", "stage", "note", "mark", "report", "process_start"]


@dataclass
class Stage:
    name: str
    start: float  # seconds since the timeline's origin
    seconds: float | None = None  # None while open
    depth: int = 0
    detail: str = ""

    @property
    def end(self) -> float:
        return self.start + (self.seconds or 0.0)


class _Ignored:
    """What `stage` yields when nothing records: accepts a detail and forgets it."""

    detail = ""

    def __setattr__(self, name, value) -> None:
        pass


_IGNORED = _Ignored()


def process_start() -> float | None:
    """When this process started, on `time.perf_counter`'s clock (Linux: /proc/self/stat and CLOCK_BOOTTIME,
    10 ms resolution), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime, after the (comm) field
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.perf_counter() - age if 0 <= age < 3600 else None


def _sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timeline:
    """Stages on `time.perf_counter`'s clock, in seconds since `origin` (default: now)."""

    def __init__(self, origin: float | None = None, sync: bool = True):
        self.origin = time.perf_counter() if origin is None else origin
        self.sync = sync
        self.stages: list[Stage] = []
        self.recording = True
        self.final: Stage | None = None  # the mark that ended the recording
        self._open: list[Stage] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, name: str, start: float, end: float, detail: str = "") -> Stage:
        """A stage measured elsewhere (times since the origin)."""
        s = Stage(name, start, end - start, len(self._open), detail)
        with self._lock:
            self.stages.append(s)
        return s

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[Stage]:
        if not self.recording:
            yield _IGNORED
            return
        s = Stage(name, self.now(), None, len(self._open), detail)
        with self._lock:
            self.stages.append(s)
            self._open.append(s)
        try:
            yield s
        finally:
            if self.sync:
                _sync()
            s.seconds = self.now() - s.start
            with self._lock:
                self._open.remove(s)

    def note(self, detail: str) -> None:
        """Set the innermost open stage's detail."""
        if self._open:
            self._open[-1].detail = detail

    def mark(self, name: str, detail: str = "", final: bool = False) -> None:
        """A stage from the end of the previous stage at this depth (or the enclosing stage's start) to now;
        `final` at the top level ends the recording."""
        if not self.recording:
            return
        if self.sync:
            _sync()
        depth = len(self._open)
        parent = self._open[-1] if self._open else None
        siblings = [s for s in self.stages if s.depth == depth and s.seconds is not None
                    and (parent is None or s.start >= parent.start)]
        start = siblings[-1].end if siblings else parent.start if parent else 0.0
        s = self.add(name, start, self.now(), detail)
        if final and depth == 0:
            self.final = s
            self.recording = False

    def stage_seconds(self, name: str) -> float | None:
        """The first recorded stage of that name: its seconds (None: not recorded)."""
        return next((s.seconds for s in self.stages if s.name == name), None)

    def paths(self) -> list[str]:
        """Each stage's name prefixed by its enclosing stages' ("TTS()/warm-up/prefill")."""
        names: list[str] = []
        out = []
        for s in self.stages:  # a stage is recorded after its parent
            names[s.depth:] = [s.name]
            out.append("/".join(names))
        return out

    def to_dict(self) -> dict:
        return {"stages": [{"name": s.name, "path": path, "start_s": s.start, "seconds": s.seconds,
                            "depth": s.depth, "detail": s.detail} for s, path in zip(self.stages, self.paths())],
                "final": None if self.final is None else self.final.name,
                "final_s": None if self.final is None else self.final.end,
                "import_torch_end_s": self._import_torch_end()}

    def _import_torch_end(self) -> float | None:
        s = next((s for s in self.stages if s.name == "import torch"), None)
        return None if s is None or s.seconds is None else s.end

    def lines(self) -> list[str]:
        """The report: one line per stage (start, seconds, name indented by depth, detail), then the totals."""
        out = ["higgs-rt: cold start (--verbose), seconds since the process started:"]
        for s in self.stages:
            took = "   ..." if s.seconds is None else f"{s.seconds:6.3f}"
            detail = f"   [{s.detail}]" if s.detail else ""
            out.append(f"  {s.start:7.3f} {took}  {'  ' * s.depth}{s.name}{detail}")
        end = self.final.end if self.final is not None else self.now()
        top = sum(s.seconds or 0.0 for s in self.stages if s.depth == 0)
        out.append(f"  {'':7} {end - top:6.3f}  (between the stages above)")
        what = self.final.name if self.final is not None else "now"
        after = self._import_torch_end()
        torch_part = f", {end - after:.2f} s after import torch returned" if after is not None else ""
        out.append(f"higgs-rt: {what} {end:.2f} s after the process started{torch_part}")
        return out


_active: Timeline | None = None


def start(timeline: Timeline | None = None, from_process_start: bool = True) -> Timeline:
    """Make `timeline` (default: a new one from the process's start, else from now) the one that records; a
    start-up stage covers the time before this call."""
    global _active
    if timeline is None:
        origin = process_start() if from_process_start else None
        timeline = Timeline(origin)
        if origin is not None:
            timeline.add("start-up (interpreter, imports before the command)", 0.0, timeline.now())
    _active = timeline
    return timeline


def stop() -> Timeline | None:
    """Stop recording; returns the timeline (still `current()` until the next `start`)."""
    if _active is not None:
        _active.recording = False
    return _active


def current() -> Timeline | None:
    return _active


def stage(name: str, detail: str = ""):
    """A context manager timing `name` on the active timeline (yields the `Stage`, whose `detail` may be set);
    nothing when none records."""
    if _active is None or not _active.recording:
        return _NOTHING
    return _active.stage(name, detail)


_NOTHING = nullcontext(_IGNORED)  # reusable: it holds no state


def recording() -> bool:
    return _active is not None and _active.recording


def note(detail: str) -> None:
    """Detail for the innermost open stage (e.g. bytes and rates), if a timeline records."""
    if _active is not None and _active.recording:
        _active.note(detail)


def mark(name: str, detail: str = "", final: bool = False) -> None:
    if _active is not None:
        _active.mark(name, detail, final)


def report(file: TextIO | None = None) -> None:
    """Print the active timeline's report (stderr by default) and stop recording; nothing when none is active."""
    timeline = stop()
    if timeline is None:
        return
    print("\n".join(timeline.lines()), file=file or sys.stderr, flush=True)
