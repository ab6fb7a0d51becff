"""CUDA graph capture, shared by every graphed path (decode steps, prefill buckets, the streaming codec)."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

# One capture at a time in the process. The batch engine captures on two threads (prefill buckets and steps on the
# decode thread, codec buckets on the codec thread); two captures at once is legal CUDA, but one thread's capture
# must never meet a device-wide call from the other.
_CAPTURE = threading.Lock()


_sides = threading.local()  # per thread: {device index: the side stream its captures run on}


def _side_stream() -> torch.cuda.Stream:
    """The calling thread's side stream for the current device, made once: the caching allocator reuses a freed
    block only on the stream it was allocated on, so with a new stream per capture neither the warm-up calls'
    memory nor a shared graph pool's freed blocks served the next capture (the codec's 100 graphs held 27.6 GiB of
    private pools on an H100, and the server ran out of memory)."""
    streams = getattr(_sides, "streams", None)
    if streams is None:
        streams = _sides.streams = {}
    device = torch.cuda.current_device()
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def capture_graph(fn: Callable[[], T], warmup: int = 1, pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` `warmup` times on a side stream (kernels load, workspaces get allocated), then capture one call;
    returns the graph and the captured call's (static) outputs. pool: a memory pool shared with graphs that never
    replay concurrently with this one (`torch.cuda.graph_pool_handle()`).

    The capture is thread-local and makes no device-wide call: `torch.cuda.graph` would synchronize the device and
    empty the allocator's cache first, which fails (and poisons the other capture) while another thread captures.
    Ordering comes from the streams alone: the side stream waits for the caller's and the caller's for it."""
    side = _side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE:
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture is void already: keep fn's error, the one that says why
                    pass
                raise
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out
