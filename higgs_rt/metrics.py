"""Prometheus text exposition (format 0.0.4) for the server: histograms, counters and gauges, no dependency."""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
QUEUE_DEPTH = "higgs_rt_queue_depth"  # the gauge an autoscaler reads (deploy/kubernetes/hpa.yaml)


class Histogram:
    """Cumulative buckets, sum and count; `observe` from any thread."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self) -> str:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines, running = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"], 0
        for bound, n in zip(self.buckets + (float("inf"),), counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {total!r}", f"{self.name}_count {running}"]
        return "\n".join(lines)


def sample(name: str, kind: str, help: str, value: float) -> str:
    """One counter or gauge."""
    return f"# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value!r}"


def labelled(name: str, kind: str, help: str, label: str, values: dict[str, float]) -> str:
    """One counter or gauge with a sample per value of `label`."""
    lines = "\n".join(f'{name}{{{label}="{key}"}} {value!r}' for key, value in values.items())
    return f"# HELP {name} {help}\n# TYPE {name} {kind}\n{lines}"


def memory_samples(device) -> list[str]:
    """Peak memory gauges: the process's resident set, and on CUDA the most torch's allocator has held."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    out = [sample("higgs_rt_process_peak_rss_bytes", "gauge", "Peak resident set of the server process.", rss)]
    if getattr(device, "type", None) == "cuda":
        import torch

        out.append(sample("higgs_rt_gpu_memory_peak_bytes", "gauge", "Peak GPU memory held by torch's allocator "
                          "for tensors (weights, caches, activations).", torch.cuda.max_memory_allocated(device)))
    return out
