"""CUDA graph capture, shared by every graphed path (decode steps, prefill buckets, the streaming codec)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture_graph(fn: Callable[[], T], warmup: int = 1, pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` `warmup` times on a side stream (kernels load, workspaces get allocated), then capture one call;
    returns the graph and the captured call's (static) outputs. pool: a memory pool shared with graphs that never
    replay concurrently with this one (`torch.cuda.graph_pool_handle()`).

    The capture is thread-local: another thread may keep launching, allocating and synchronizing on its own
    streams meanwhile (the batch engine's codec thread and decode thread capture while the other runs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
