"""The streaming codec's fused steps around its GEMMs (CUDA kernels csrc/cuda/codec_window.cu and tap_sum.cu),
with their torch references. `higgs_rt.codec.stateful` runs a layer of the channels-last stream as

    full, snaked = codec_window(x, state, ...)   # [kept samples; mask * Snake(x + addend)], Snake(full)
    products = bmm(taps of full, weights)        # one lane: the K taps' GEMMs as one batched call
    y = tap_sum(products, bias, alpha)           # Snake(sum over taps + bias)

The kernels round each step as the references do (IEEE fp32, the taps summed in ascending order, Snake as
`snake_ref`): on CUDA they give the references' bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .library import OPS, check, cuda_kernel, register_fake
from .snake import snake_ref


def codec_window_ref(x: Tensor, state: Tensor, first: Tensor, length: Tensor, rate: int, lag: int,
                     addend: Tensor | None = None, alpha: Tensor | None = None, alpha_full: Tensor | None = None
                     ) -> tuple[Tensor, Tensor | None]:
    b, w, _ = x.shape
    v = x if addend is None else x + addend
    pos = first[:, None] * rate - lag + torch.arange(w, device=x.device)
    mask = ((pos >= 0) & (pos < length[:, None] * rate)).to(x.dtype)
    v = v * mask[..., None] if alpha is None else snake_ref(v, alpha, mask)
    full = torch.cat([state[:b], v], 1)
    return full, None if alpha_full is None else snake_ref(full, alpha_full)


def codec_window(x: Tensor, state: Tensor, first: Tensor, length: Tensor, rate: int, lag: int,
                 addend: Tensor | None = None, alpha: Tensor | None = None, alpha_full: Tensor | None = None
                 ) -> tuple[Tensor, Tensor | None]:
    """A streamed layer's input window for lanes 0 .. B - 1: x [B, W, C] float32 (plus addend, shaped as x),
    Snake with alpha [C] where given, times the padding mask (sample t of lane b holds position
    first[b] * rate - lag + t; audio where 0 <= position < length[b] * rate), after the lane's kept samples
    state[b] ([>= B, keep, C]) -> (full [B, keep + W, C], Snake(full, alpha_full) or None). first, length: [B]
    int64. The caller keeps full[:, W:] as the next call's state."""
    op = "codec_window"
    if not isinstance(x, Tensor) or x.dtype != torch.float32 or x.dim() != 3:
        raise ValueError(f"{op}: x must be a float32 [B, W, C] tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    b, _, c = x.shape
    state = check(op, "state", state, (torch.float32,), 3, like=x)
    if state.shape[0] < b or state.shape[2] != c:
        raise ValueError(f"{op}: state must be [>= {b}, keep, {c}], got {tuple(state.shape)}")
    first = check(op, "first", first, (torch.int64,), 1, like=x)
    length = check(op, "length", length, (torch.int64,), 1, like=x)
    if first.shape[0] != b or length.shape[0] != b:
        raise ValueError(f"{op}: first and length must be [{b}], got {tuple(first.shape)} and {tuple(length.shape)}")
    if rate < 1 or lag < 0:
        raise ValueError(f"{op}: rate must be >= 1 and lag >= 0, got {rate} and {lag}")
    if addend is not None and (not isinstance(addend, Tensor) or addend.dtype != torch.float32
                               or addend.shape != x.shape or addend.device != x.device):
        raise ValueError(f"{op}: addend must be float32 {tuple(x.shape)} on {x.device}, got "
                         f"{getattr(addend, 'dtype', type(addend).__name__)} {tuple(getattr(addend, 'shape', ()))}")
    for name, a in (("alpha", alpha), ("alpha_full", alpha_full)):
        if a is not None and check(op, name, a, (torch.float32,), 1, like=x).shape[0] != c:
            raise ValueError(f"{op}: {name} must be [{c}] (x's channels), got {tuple(a.shape)}")
    if not cuda_kernel(x):
        return codec_window_ref(x, state, first, length, rate, lag, addend, alpha, alpha_full)
    if x.stride(2) != 1:
        x = x.contiguous()
    if addend is not None and addend.stride(2) != 1:
        addend = addend.contiguous()
    full, snaked = OPS.codec_window(x, addend, state, first, length, rate, lag, alpha, alpha_full)
    return full, None if alpha_full is None else snaked


@register_fake("codec_window")
def _(x, addend, state, first, length, rate, lag, alpha, alpha_full):
    b, w, c = x.shape
    size = (b, state.shape[1] + w, c)
    return x.new_empty(size), x.new_empty(size if alpha_full is not None else (0,))


def tap_sum_ref(products: Tensor, bias: Tensor | None = None, alpha: Tensor | None = None) -> Tensor:
    out = products[0]
    for k in range(1, products.shape[0]):  # ascending, one rounding per tap: the kernel's order
        out = out + products[k]
    if bias is not None:
        out = out + bias
    out = out[None]
    return out if alpha is None else snake_ref(out, alpha)


def tap_sum(products: Tensor, bias: Tensor | None = None, alpha: Tensor | None = None) -> Tensor:
    """products [K, W, C] float32 (a one-lane convolution's per-tap GEMMs) -> Snake(sum_k products[k] + bias)
    [1, W, C]; bias and alpha [C], each optional."""
    products = check("tap_sum", "products", products, (torch.float32,), 3)
    if products.shape[0] < 1:
        raise ValueError(f"tap_sum: products must hold at least one tap, got {tuple(products.shape)}")
    c = products.shape[2]
    for name, a in (("bias", bias), ("alpha", alpha)):
        if a is not None and check("tap_sum", name, a, (torch.float32,), 1, like=products).shape[0] != c:
            raise ValueError(f"tap_sum: {name} must be [{c}] (the products' channels), got {tuple(a.shape)}")
    if not cuda_kernel(products):
        return tap_sum_ref(products, bias, alpha)
    return OPS.tap_sum(products, bias, alpha)


@register_fake("tap_sum")
def _(products, bias, alpha):
    return products.new_empty((1, *products.shape[1:]))
