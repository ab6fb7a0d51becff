"""Waking asyncio consumers from the engine's threads: `LoopWaker`, one `call_soon_threadsafe` per batch of wakes."""

from __future__ import annotations

import asyncio
import threading
import weakref


class LoopWaker:
    """Sets asyncio Events of one event loop from other threads with one `call_soon_threadsafe` per batch. The codec
    thread hands a push's chunks to up to 64 jobs at once; a call per chunk would be a write to the loop's wake-up
    pipe each (a system call, and a GIL hand-off with the loop thread, which is by then running the last one's
    callback). Events set while a batch waits for the loop join it without another call. A closed (or collected)
    loop has nobody left to wake: waking it does nothing, so a consumer that went away never fails the thread that
    feeds it."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker]" = weakref.WeakKeyDictionary()
    _registry = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # the registry's key: a strong reference would keep every loop alive
        self._lock = threading.Lock()
        self._pending: dict[asyncio.Event, None] = {}  # in order, each once

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopWaker":
        with cls._registry:
            waker = cls._by_loop.get(loop)
            if waker is None:
                waker = cls._by_loop[loop] = cls(loop)
            return waker

    def wake(self, event: asyncio.Event) -> None:
        """From any thread: `event.set()` on the loop, soon."""
        loop = self._loop()
        with self._lock:
            if loop is None or loop.is_closed():
                self._pending.clear()
                return
            first = not self._pending
            self._pending[event] = None
        if first:
            try:
                loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # closed meanwhile
                with self._lock:
                    self._pending.clear()

    def _flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, {}
        for event in events:
            event.set()
