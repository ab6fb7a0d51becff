"""What every benchmark result records about its run: the device, the torch version and the commit; and the
CUDA kernels of one call (`kernel_profile`).

The commit is $HIGGS_RT_COMMIT when set (the GPU machine gets a copy of the tree without .git; the script that
sends it sets the variable), else `git rev-parse --short HEAD`, with "-dirty" when tracked files differ.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    if os.environ.get("HIGGS_RT_COMMIT"):
        return os.environ["HIGGS_RT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_info(device) -> dict:
    """The device, torch, the commit, and whether higgs-rt's compiled ops were there (`extension`) with CUDA
    kernels built for which architectures (`cuda_archs`, "" for none: then a CUDA run measured the torch paths),
    and the measurement switches set (`switches`: every $HIGGS_RT_* variable but the commit's)."""
    import torch  # lazily: the HTTP benchmarks' clients need no torch

    from higgs_rt import ops

    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "commit": commit(), "extension": ops.HAS_EXTENSION, "cuda_archs": ops.CUDA_ARCHS,
            "switches": {k: v for k, v in sorted(os.environ.items())
                         if k.startswith("HIGGS_RT_") and k != "HIGGS_RT_COMMIT"}}


def add_model_args(ap, compute: str = "cpu") -> None:
    """--model, --codec, --compute and --dtype, as every benchmark that loads a model takes them."""
    ap.add_argument("--model", required=True)
    ap.add_argument("--codec")
    if compute == "auto":  # passed on to a server process
        ap.add_argument("--compute", default="auto")
    else:
        ap.add_argument("--compute", choices=("cpu", "cuda"), default=compute)
    ap.add_argument("--dtype")


def p90(sorted_samples: list[float]) -> float:
    """The 90th percentile of ascending samples as every benchmark reports it: the sample at int(0.9 * (n - 1))."""
    return sorted_samples[int(0.9 * (len(sorted_samples) - 1))]


def kernel_profile(fn, top: int = 12) -> list[dict]:
    """The CUDA kernels of one call of fn (warm: call it before), by total device time: a row with the number of
    kernels and their total microseconds, then the `top` kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels.setdefault(e.name, []).append(getattr(e, "device_time_total", None) or e.cuda_time_total)
    rows = sorted(({"kernel": k[:120], "calls": len(v), "us": round(sum(v), 1)} for k, v in kernels.items()),
                  key=lambda r: -r["us"])
    return [{"kernels": sum(r["calls"] for r in rows), "us": round(sum(r["us"] for r in rows), 1)}, *rows[:top]]
