"""One long-lived thread that runs a TTS engine's session utterances.

A text session (higgs_rt.session) has its own thread for text, events and callbacks; the model work of its
utterances runs here instead, on a thread that outlives sessions. On the CPU the thread runs torch on one OpenMP
thread (`one_cpu_thread`): a second team as wide as the machine beside the caller's made both slow (2 cores,
tiny model, `benchmarks/bench_session.py`: a session's first audio 55.8 ms against 43.4 plain when each session
ran the model on its own thread; 41.9 against 40.2 on this thread), at the cost of one core for session
utterances on the CPU; on CUDA the thread only launches kernels.

`ModelThread.iterate(make)` runs the generator `make()` on this thread and yields its items on the caller's,
at most one item ahead; the generator ends by itself once its own stop checks see a cancel, and a caller that
stops reading has it closed on the model thread. A job not started yet is dropped at once when the caller's
cancel token is set (iterate returns False).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")
_LIVE: "weakref.WeakSet[ModelThread]" = weakref.WeakSet()

_ITEM, _END, _ERROR = "item", "end", "error"


class _Channel:
    """One job's items from the model thread to its caller: one in flight, and the job's state."""

    def __init__(self):
        self.cond = threading.Condition()
        self.items: deque = deque()
        self.state = "queued"  # -> "running" (the model thread took it) or "dropped" (cancelled before that)
        self.abandoned = False  # the caller stopped reading: the model thread closes the generator

    def take(self) -> bool:  # model thread: start the job unless it was dropped
        with self.cond:
            if self.state == "dropped":
                return False
            self.state = "running"
            return True

    def put(self, kind: str, value=None) -> bool:  # model thread: wait while the caller has an item unread
        with self.cond:
            while self.items and not self.abandoned:
                self.cond.wait()
            if self.abandoned:
                return False
            self.items.append((kind, value))
            self.cond.notify_all()
            return True

    def get(self, cancelled: Callable[[], bool] | None):  # caller: the next item, or None once dropped
        with self.cond:
            while not self.items:
                if self.state == "queued" and cancelled is not None and cancelled():
                    self.state = "dropped"
                    return None
                self.cond.wait()
            item = self.items.popleft()
            self.cond.notify_all()
            return item

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def abandon(self) -> None:  # caller: it reads no more
        with self.cond:
            self.abandoned = True
            if self.state == "queued":
                self.state = "dropped"
            self.cond.notify_all()


class ModelThread:
    """See the module docstring. warm: run first on the thread (e.g. a small parallel op)."""

    def __init__(self, name: str = "higgs-rt-model", warm: Callable[[], None] | None = None):
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, args=(warm,), name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def iterate(self, make: Callable[[], Iterator[T]], cancel=None) -> Iterator[T]:
        """make()'s items, produced on the model thread. cancel: a CancelToken (higgs_rt.session) whose set()
        drops the job if it has not started; returns False then (the generator's return value)."""
        channel = _Channel()
        with self._cond:
            if self._closed:
                raise RuntimeError("the model thread is closed")
            self._jobs.append((make, channel))
            self._cond.notify()
        unhook = cancel.hook(channel.wake) if cancel is not None else None
        try:
            while True:
                item = channel.get(cancel.is_set if cancel is not None else None)
                if item is None:
                    return False
                kind, value = item
                if kind == _ITEM:
                    yield value
                elif kind == _ERROR:
                    raise value
                else:
                    return True
        finally:
            channel.abandon()
            if unhook is not None:
                unhook()

    def close(self) -> None:
        """The thread ends after the jobs already queued."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self, warm) -> None:
        if warm is not None:
            try:
                warm()
            except Exception:  # noqa: BLE001 - warming is an optimisation only
                pass
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                make, channel = self._jobs.popleft()
            if not channel.take():
                continue
            items = None
            try:
                items = make()
                for item in items:
                    if not channel.put(_ITEM, item):
                        items.close()  # the caller has gone: the generator's cleanup runs here
                        break
                else:
                    channel.put(_END)
            except BaseException as e:  # noqa: BLE001 - the caller re-raises it
                channel.put(_ERROR, e)
            finally:
                items = make = channel = None  # no reference to the job's state outlives it


@atexit.register
def _close_live_threads() -> None:
    """A daemon thread still holding torch's thread pools at exit aborts the interpreter ("terminate called
    without an active exception"): end them (sessions, cancelled first by their own exit hook, drain theirs)."""
    threads = list(_LIVE)
    for thread in threads:
        thread.close()
    for thread in threads:
        thread.join(5)


def one_cpu_thread() -> None:
    """This thread's CPU ops on one OpenMP thread, the caller's thread keeping its own team: two teams as wide as
    the machine oversubscribe it, and while they exist libgomp stops spinning between parallel regions, so every
    small op of both waits on a futex wake-up (2 cores, tiny model: the batch engine's first audio 86 -> 58 ms
    with its codec thread on one thread). omp_set_num_threads is per thread, unlike torch.set_num_threads, which
    also sets what later threads start with. Where the symbol is missing (no OpenMP), nothing changes."""
    import ctypes

    import torch

    torch.get_num_threads()  # torch's own per-thread set-up first, so that it does not undo this
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (AttributeError, OSError):
        pass


def model_thread_for(owner, warm: Callable[[], None] | None = None) -> ModelThread:
    """A ModelThread that ends when `owner` is garbage collected."""
    thread = ModelThread(warm=warm)
    weakref.finalize(owner, thread.close)
    return thread
