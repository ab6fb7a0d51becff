"""Copies between host and device that never stall other threads or drain the stream: through pinned memory.

`tensor.cpu()` of a CUDA tensor copies into pageable memory, and the driver holds its copy path for as long as
that copy waits for its stream; meanwhile every other thread's `cudaMemcpyAsync` waits too. In the batch
engine the codec thread's PCM copies (each waiting for a batched codec call) stalled the decode loop's frame
copies by 7.6 ms per step at 64 streams (H200 profile, benchmarks/bench_engine.py). A copy into pinned memory
is asynchronous, and `Event.synchronize` waits (without the GIL) for that stream only.

The other way, `cuda_tensor.copy_(host_tensor)` from pageable memory waits for the stream to drain: every prefill
group of a burst of arrivals (its token ids, last positions and slots) and every new row -> lane map of the codec
thread waited for the step queued before it, so the decode loop lost its step in flight on each admission tick.
`copy_to` stages the host tensor in pinned memory and queues the copy; torch's caching host allocator keeps that
block until the copy has run.
"""

from __future__ import annotations

import torch


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, queued on the current stream without waiting for it when src is on the host and dst is
    not (the host tensor may be reused at once); returns dst."""
    if dst.is_cuda and not src.is_cuda:
        staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
        return dst.copy_(staged, non_blocking=True)
    return dst.copy_(src)


def to_device(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`src.to(device)` without waiting for the stream (see `copy_to`)."""
    device = torch.device(device)
    if device.type != "cuda" or src.is_cuda:
        return src.to(device)
    return copy_to(torch.empty(src.shape, dtype=src.dtype, device=device), src)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of `tensors` (on the current stream); CPU tensors come back as they are."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors)
    out = []
    for t in tensors:
        if not t.is_cuda:
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return out
