"""The fused sampler (csrc/cuda/sample_frame.cu): one frame of every slot's generation state machine in two
launches. Its reference is the torch path of `higgs_rt.sampling.FrameSampler`, which calls this op on CUDA."""

from __future__ import annotations

from torch import Tensor

from .library import OPS, cuda_kernel, register_fake

MAX_VOCAB = 2048  # the kernel sorts one codebook's vocabulary in shared memory


def sample_frame_supported(logits: Tensor) -> bool:
    return cuda_kernel(logits) and 3 <= logits.shape[-1] <= MAX_VOCAB


def sample_frame(logits: Tensor, seeds: Tensor, frame: Tensor, eos_start: Tensor, done: Tensor, history: Tensor,
                 temperature: Tensor, top_k: Tensor, top_p: Tensor, greedy: Tensor, ras_on: Tensor, ras_max: Tensor,
                 lengths: Tensor, window: int) -> Tensor:
    """logits [B, Q, V] fp32 -> frames [B, Q] int64; updates frame, eos_start, done, history and lengths (+1 for
    slots not done) in place. The per-slot tensors are FrameSampler's state (see its docstring)."""
    return OPS.sample_frame(logits, seeds, frame, eos_start, done, history, temperature, top_k, top_p, greedy,
                            ras_on, ras_max, lengths, window)


@register_fake("sample_frame")
def _(logits, seeds, frame, eos_start, done, history, temperature, top_k, top_p, greedy, ras_on, ras_max, lengths,
      window):
    return logits.new_empty(logits.shape[:2], dtype=seeds.dtype)
