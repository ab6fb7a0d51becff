"""Device -> host copies that never stall other threads: through pinned memory, waiting on an event.

`tensor.cpu()` of a CUDA tensor copies into pageable memory, and the driver holds its copy path for as long as
that copy waits for its stream; meanwhile every other thread's `cudaMemcpyAsync` waits too. In the batch
engine the codec thread's PCM copies (each waiting for a batched codec call) stalled the decode loop's frame
copies by 7.6 ms per step at 64 streams (H200 profile, benchmarks/bench_engine.py). A copy into pinned memory
is asynchronous, and `Event.synchronize` waits (without the GIL) for that stream only.
"""

from __future__ import annotations

import torch


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
