"""L2 prefetch of decode-step weights (csrc/cuda/l2_prefetch.cu). A hint: it changes no result, so its
reference is to do nothing."""

from __future__ import annotations

from torch import Tensor

from .library import OPS, aligned16, cuda_kernel, register_fake

L2_PREFETCH_RANGES = 3


def l2_prefetch(*tensors: Tensor) -> None:
    """Bring the bytes of up to three contiguous tensors on one CUDA device into L2, from a kernel that lets the
    next one launch at once and ends only after the previous one has (so it can sit between two kernels of the
    decode step without breaking their order). Each tensor 16-byte aligned with a multiple of 16 bytes. On the
    CPU, inside `references()` or without the CUDA kernels: nothing."""
    if not 1 <= len(tensors) <= L2_PREFETCH_RANGES:
        raise ValueError(f"l2_prefetch: takes 1 to {L2_PREFETCH_RANGES} tensors, got {len(tensors)}")
    first = tensors[0]
    for t in tensors:
        if not isinstance(t, Tensor) or t.device != first.device or not t.is_contiguous():
            raise ValueError("l2_prefetch: every argument must be a contiguous tensor on the first one's device")
        if t.numel() * t.element_size() % 16:
            raise ValueError(f"l2_prefetch: each tensor must hold a multiple of 16 bytes, got "
                             f"{t.numel() * t.element_size()}")
    if not cuda_kernel(first):
        return
    if not aligned16(*tensors):
        raise ValueError("l2_prefetch: every tensor must be 16-byte aligned")
    empty = first.reshape(-1)[:0]
    OPS.l2_prefetch(*tensors, *(empty,) * (L2_PREFETCH_RANGES - len(tensors)))


@register_fake("l2_prefetch")
def _(a, b, c):
    return None
