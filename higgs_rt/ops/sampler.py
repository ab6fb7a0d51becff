"""The fused sampler (csrc/cuda/sample_frame.cu): one frame of every slot's generation state machine in two
launches. Its reference is the torch path of `higgs_rt.sampling.FrameSampler`, which calls this op on CUDA."""

from __future__ import annotations

import torch
from torch import Tensor

from .library import HAS_CUDA_KERNELS, OPS, check, check_int, cuda_kernel, register_fake

MAX_VOCAB = 2048  # the kernel sorts one codebook's vocabulary in shared memory
WRITTEN = ("frame", "eos_start", "done", "history", "lengths")  # in place: Tensor(a!) ... in the op's schema


def sample_frame_supported(logits: Tensor) -> bool:
    return cuda_kernel(logits) and 3 <= logits.shape[-1] <= MAX_VOCAB


def sample_frame(logits: Tensor, seeds: Tensor, frame: Tensor, eos_start: Tensor, done: Tensor, history: Tensor,
                 temperature: Tensor, top_k: Tensor, top_p: Tensor, greedy: Tensor, ras_on: Tensor, ras_max: Tensor,
                 lengths: Tensor, window: int) -> Tensor:
    """logits [B, Q, V] fp32 (3 <= V <= MAX_VOCAB) -> frames [B, Q] int64; updates frame, eos_start, done, history
    [B, W, Q] and lengths (+1 for slots not done) in place, so those must be contiguous; the RAS window is 0 to W.
    The per-slot tensors are FrameSampler's state (see its docstring): [B], int64 but for done, greedy and ras_on
    (bool), temperature and top_p (fp32). CUDA only: elsewhere FrameSampler runs its torch code."""
    op = "sample_frame"
    logits = check(op, "logits", logits, (torch.float32,), 3)
    b, q, v = logits.shape
    if not 3 <= v <= MAX_VOCAB:
        raise ValueError(f"{op}: logits must have 3 to {MAX_VOCAB} entries per codebook, got shape "
                         f"{tuple(logits.shape)}")

    def per_slot(name: str, t: Tensor, dtype: torch.dtype) -> Tensor:
        t = check(op, name, t, (dtype,), 1, like=logits, mutated=name in WRITTEN)
        if t.shape[0] != b:
            raise ValueError(f"{op}: {name} must have shape ({b},) (logits' slots), got {tuple(t.shape)}")
        return t

    i64, f32, bool_ = torch.int64, torch.float32, torch.bool
    seeds, frame, eos_start, done, temperature, top_k, top_p, greedy, ras_on, ras_max, lengths = (
        per_slot(name, t, dtype) for name, t, dtype in (
            ("seeds", seeds, i64), ("frame", frame, i64), ("eos_start", eos_start, i64), ("done", done, bool_),
            ("temperature", temperature, f32), ("top_k", top_k, i64), ("top_p", top_p, f32),
            ("greedy", greedy, bool_), ("ras_on", ras_on, bool_), ("ras_max", ras_max, i64),
            ("lengths", lengths, i64)))
    history = check(op, "history", history, (torch.int64,), 3, like=logits, mutated=True)
    if history.shape[0] != b or history.shape[1] < 1 or history.shape[2] != q:
        raise ValueError(f"{op}: history must be [{b}, W >= 1, {q}] (logits' slots and codebooks), got shape "
                         f"{tuple(history.shape)}")
    check_int(op, "window", window, 0, history.shape[1])
    # a trace (compile, export) of the CUDA step may run on the CPU: only an eager call needs the kernel here
    if not torch.compiler.is_compiling() and (logits.device.type != "cuda" or not HAS_CUDA_KERNELS):
        raise NotImplementedError(f"{op}: CUDA only (CUDA tensors and a CUDA build of higgs-rt), got logits on "
                                  f"{logits.device}: elsewhere FrameSampler.step runs its torch code")
    return OPS.sample_frame(logits, seeds, frame, eos_start, done, history, temperature, top_k, top_p, greedy,
                            ras_on, ras_max, lengths, window)


@register_fake("sample_frame")
def _(logits, seeds, frame, eos_start, done, history, temperature, top_k, top_p, greedy, ras_on, ras_max, lengths,
      window):
    return logits.new_empty(logits.shape[:2], dtype=seeds.dtype)
