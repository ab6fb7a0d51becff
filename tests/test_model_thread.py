"""higgs_rt.model_thread: a TTS engine's session utterances run on one long-lived thread."""

from __future__ import annotations

import gc
import threading

import pytest

from higgs_rt.model_thread import ModelThread, model_thread_for
from higgs_rt.session import CancelToken


@pytest.fixture
def worker():
    thread = ModelThread(name="test-model")
    yield thread
    thread.close()
    assert thread.join(10)


def test_items_come_in_order_from_one_thread_across_jobs(worker):
    seen = []

    def job(n):
        for i in range(n):
            seen.append(threading.current_thread().name)
            yield i

    assert list(worker.iterate(lambda: job(5))) == [0, 1, 2, 3, 4]
    assert list(worker.iterate(lambda: job(3))) == [0, 1, 2]
    assert seen == ["test-model"] * 8


def test_the_producer_runs_at_most_one_item_ahead(worker):
    made = []

    def job():
        for i in range(10):
            made.append(i)
            yield i

    items = worker.iterate(job)
    assert next(items) == 0
    threading.Event().wait(0.2)
    assert len(made) <= 3  # the item read, the one waiting, the one being put
    assert list(items) == list(range(1, 10))


def test_an_error_reaches_the_caller_and_the_thread_goes_on(worker):
    def job():
        yield 1
        raise ValueError("bad frame")

    items = worker.iterate(job)
    assert next(items) == 1
    with pytest.raises(ValueError, match="bad frame"):
        next(items)
    assert list(worker.iterate(lambda: iter([7]))) == [7]


def test_a_job_cancelled_before_it_starts_is_dropped_at_once(worker):
    release, started, made = threading.Event(), threading.Event(), []

    def blocker():
        started.set()
        release.wait(10)
        yield "first"

    first = worker.iterate(blocker)
    got = []
    reader = threading.Thread(target=lambda: got.extend(first))
    reader.start()
    assert started.wait(10)

    cancel = CancelToken()
    second = worker.iterate(lambda: made.append(1) or iter(["never"]), cancel)
    result = []
    waiter = threading.Thread(target=lambda: result.append(list_and_return(second)))
    waiter.start()
    cancel.set()
    waiter.join(5)
    assert not waiter.is_alive() and result == [([], False)]  # returned while the first job still runs
    release.set()
    reader.join(10)
    assert got == ["first"]
    assert list(worker.iterate(lambda: iter([3]))) == [3]
    assert made == []  # the dropped job never ran


def list_and_return(gen):
    items = []
    while True:
        try:
            items.append(next(gen))
        except StopIteration as stop:
            return items, stop.value


def test_a_caller_that_stops_reading_has_the_generator_closed_on_the_model_thread(worker):
    closed_on = []

    def job():
        try:
            for i in range(1000):
                yield i
        finally:
            closed_on.append(threading.current_thread().name)

    items = worker.iterate(job)
    assert next(items) == 0
    items.close()
    assert list(worker.iterate(lambda: iter([5]))) == [5]  # the model thread is free again
    assert closed_on == ["test-model"]


def test_closed_thread_ends_and_refuses_jobs():
    thread = ModelThread()
    thread.close()
    assert thread.join(10)
    with pytest.raises(RuntimeError, match="closed"):
        next(thread.iterate(lambda: iter([1])))


def test_the_thread_ends_with_its_owner():
    class Owner:
        pass

    owner = Owner()
    thread = model_thread_for(owner)
    assert list(thread.iterate(lambda: iter([1, 2]))) == [1, 2]
    del owner
    gc.collect()
    assert thread.join(10)
