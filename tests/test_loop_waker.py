"""LoopWaker: wakes from other threads reach the loop's events, one call_soon_threadsafe per batch."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

from higgs_rt.loop_waker import LoopWaker


def test_loop_waker_coalesces_wakes_from_other_threads():
    loop = asyncio.new_event_loop()
    try:
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        waker = LoopWaker.of(loop)
        assert LoopWaker.of(loop) is waker
        events = [asyncio.Event() for _ in range(64)]
        thread = threading.Thread(target=lambda: [waker.wake(e) for e in events + events[:8]])
        thread.start()
        thread.join()
        assert len(calls) == 1 and not any(e.is_set() for e in events)  # the loop has not run yet
        loop.run_until_complete(asyncio.sleep(0))
        assert all(e.is_set() for e in events)
        events[0].clear()
        waker.wake(events[0])  # a batch after the flush takes a call of its own
        assert len(calls) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert events[0].is_set()
    finally:
        loop.close()
    waker.wake(asyncio.Event())  # a closed loop has nobody to wake: nothing happens, nothing is kept
    assert len(calls) == 2 and not waker._pending


def test_the_registry_does_not_keep_loops_alive():
    loop = asyncio.new_event_loop()
    LoopWaker.of(loop)
    ref = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert ref() is None
