"""The streaming codec's kernels (CUDA: csrc/cuda/codec_window.cu, tap_sum.cu and codec_conv.cu), with their
torch references. `higgs_rt.codec.stateful` runs a layer of the channels-last stream as

    full, snaked = codec_window(x, state, ...)   # [kept samples; mask * Snake(x + addend)], Snake(full)
    y = codec_conv(snaked, weight, bias, alpha)  # several lanes: Snake(conv + bias) on tensor cores (3xTF32)
    products = bmm(taps of full, weights)        # one lane: the K taps' GEMMs as one batched call
    y = tap_sum(products, bias, alpha)           # Snake(sum over taps + bias)

codec_window and tap_sum round each step as their references do (IEEE fp32, the taps summed in ascending order,
Snake as `snake_ref`): on CUDA they give the references' bits. codec_conv's sums are fp32-accurate, not the
reference's bits (its order is the MMAs'; the same for every lane count).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .library import OPS, aligned16, check, check_int, cuda_kernel, register_fake
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


def codec_conv_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None, alpha: Tensor | None = None,
                   taps: int = 1, dilation: int = 1) -> Tensor:
    b, length, c = x.shape
    width = length - (taps - 1) * dilation
    cols = torch.cat([x[:, j * dilation: j * dilation + width] for j in range(taps)], 2)  # [B, W, taps * C]
    out = cols @ weight
    if bias is not None:
        out = out + bias
    return out if alpha is None else snake_ref(out, alpha)


def codec_conv_supported(x: Tensor, n: int) -> bool:
    """codec_conv's kernel takes x (float32 [B, L, C] on CUDA) and n output channels: C and n multiples of 32."""
    return cuda_kernel(x) and x.dtype == torch.float32 and x.dim() == 3 and x.shape[2] % 32 == 0 and n % 32 == 0


def codec_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None, alpha: Tensor | None = None,
               taps: int = 1, dilation: int = 1) -> Tensor:
    """A channels-last convolution without padding: x [B, L, C] float32, weight [taps * C, N] (tap-major: row
    j * C + c is tap j's channel c) -> Snake(conv + bias) [B, L - (taps - 1) * dilation, N]; bias and alpha [N],
    each optional. On CUDA (C and N multiples of 32: `codec_conv_supported`) one implicit-GEMM kernel on tensor
    cores with fp32 accuracy (3xTF32), no im2col copy; elsewhere `codec_conv_ref`."""
    op = "codec_conv"
    x = check(op, "x", x, (torch.float32,), 3)
    weight = check(op, "weight", weight, (torch.float32,), 2, like=x)
    taps = check_int(op, "taps", taps, 1, 1 << 16)
    dilation = check_int(op, "dilation", dilation, 1, 1 << 16)
    b, length, c = x.shape
    if weight.shape[0] != taps * c:
        raise ValueError(f"{op}: weight must be [{taps * c}, N] (taps x x's channels), got {tuple(weight.shape)}")
    if length <= (taps - 1) * dilation:
        raise ValueError(f"{op}: x {tuple(x.shape)} is shorter than the kernel's reach {(taps - 1) * dilation + 1}")
    n = weight.shape[1]
    for name, a in (("bias", bias), ("alpha", alpha)):
        if a is not None and check(op, name, a, (torch.float32,), 1, like=x).shape[0] != n:
            raise ValueError(f"{op}: {name} must be [{n}] (weight's output channels), got {tuple(a.shape)}")
    if not codec_conv_supported(x, n) or not aligned16(x, weight):
        return codec_conv_ref(x, weight, bias, alpha, taps, dilation)
    return OPS.codec_conv(x, weight, bias, alpha, taps, dilation)


@register_fake("codec_conv")
def _(x, weight, bias, alpha, taps, dilation):
    b, length, _ = x.shape
    return x.new_empty((b, length - (taps - 1) * dilation, weight.shape[1]))
