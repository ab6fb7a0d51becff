"""The codec's Snake activation, masked, channels last (C++ and CUDA kernels), with its torch reference.

out[b, t, c] = (x + 1 / (alpha[c] + 1e-9) * sin(alpha[c] * x)^2) * mask[b, t], x = x[b, t, c]: `codec.layers.Snake`
op for op (the streaming codec's GEMM path applies it to channels-last activations and masks the samples outside
the utterance). The kernels round each step as the reference does; the CUDA one gives its bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .library import OPS, check, native, register_fake


def snake_ref(x: Tensor, alpha: Tensor, mask: Tensor | None = None) -> Tensor:
    """x [B, T, C], alpha [C], mask [B, T] or None -> [B, T, C]."""
    y = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    return y if mask is None else y * mask[..., None]


def snake(x: Tensor, alpha: Tensor, mask: Tensor | None = None) -> Tensor:
    """Snake over float32 x [B, T, C] (channels contiguous; other strides free) with alpha [C], times mask [B, T]
    (rows contiguous) where given."""
    if not isinstance(x, Tensor) or x.dtype != torch.float32 or x.dim() != 3:
        raise ValueError(f"snake: x must be a float32 [B, T, C] tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    alpha = check("snake", "alpha", alpha, (torch.float32,), 1, like=x)
    if alpha.shape[0] != x.shape[2]:
        raise ValueError(f"snake: alpha must be [{x.shape[2]}] (x's channels), got {tuple(alpha.shape)}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.float32 or tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"snake: mask must be float32 {list(x.shape[:2])}, got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
        if mask.device != x.device:
            raise ValueError(f"snake: mask must be on {x.device}, got {mask.device}")
        if mask.shape[1] > 1 and mask.stride(1) != 1:
            mask = mask.contiguous()
    if not native(x):
        return snake_ref(x, alpha, mask)
    if x.stride(2) != 1:
        x = x.contiguous()
    return OPS.snake(x, alpha, mask)


@register_fake("snake")
def _(x, alpha, mask):
    return x.new_empty(x.shape)
