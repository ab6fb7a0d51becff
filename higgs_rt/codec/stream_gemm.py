"""The streaming decoder's layers as GEMMs over channels-last activations: `stateful`'s path on CUDA.

Activations are [lanes, samples, channels]. A convolution (kernel K, dilation d, C_in -> C_out) over a call's
input [m, L, C_in] is one GEMM: the im2col rows of its m * (L - (K - 1) * d) outputs, [rows, K * C_in] (one copy
of the input, tap-major), times the weight laid out [K * C_in, C_out]; a k1 convolution is the GEMM alone. The
transposed convolution (kernel 2s, stride s) is its polyphase form: K = 2 over the kept input sample and the new
ones, with s * C_out outputs per input ordered (phase, channel), so the GEMM's rows, read as [rows * s, C_out],
are the upsampled samples in order. Snake (with the padding mask) is one kernel (`higgs_rt.ops.snake`).

Why: cuDNN's heuristics pick per shape, and at the streaming shapes some picks were slow (its FFT convolutions
and the data-gradient kernel behind conv_transpose1d took most of a 64-lane push on the H200; a 64-lane push of 4
frames took 105 ms), and torch's Snake is five kernels. cuBLAS's SGEMM runs every layer with the same kind of
kernel, in IEEE fp32 (`layers.ieee_fp32`).

Rounding: the sums are the same products as cuDNN's, in another order, so the stream and the offline decode
differ by fp32 rounding (benchmarks/bench_codec_stream.py measures how much).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from higgs_rt.ops import snake

from .layers import ResidualUnit, Snake


@dataclass(frozen=True)
class Gemm:
    """One convolution as a GEMM: weight [K * C_in, C_out] (tap-major), bias [C_out] or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: int
    dilation: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[m, L, C_in] -> [m, L - (K - 1) * d, C_out] (contiguous)."""
        x = x.contiguous()
        m, length, c = x.shape
        width = length - (self.kernel - 1) * self.dilation
        if self.kernel == 1:
            cols = x.view(m * length, c)
        else:
            cols = x.as_strided((m, width, self.kernel, c), (length * c, c, self.dilation * c, 1))
            cols = cols.reshape(m * width, self.kernel * c)
        out = cols @ self.weight if self.bias is None else torch.addmm(self.bias, cols, self.weight)
        return out.view(m, width, -1)


def conv_gemm(module: nn.Conv1d) -> Gemm:
    weight = module.weight.detach()  # [C_out, C_in, K]
    k = weight.shape[2]
    bias = None if module.bias is None else module.bias.detach().contiguous()
    return Gemm(weight.permute(2, 1, 0).reshape(k * weight.shape[1], weight.shape[0]).contiguous(), bias, k,
                module.dilation[0])


def upsample_gemm(polyphase: tuple[torch.Tensor, torch.Tensor | None], stride: int) -> Gemm:
    """`stateful._polyphase`'s kernel-2 conv (output channel o * s + r, tap 0 on the previous input) reordered so
    output column r * C_out + o: the rows of [R, s * C_out] read as [R * s, C_out] are the upsampled samples."""
    weight, bias = polyphase  # [C_out * s, C_in, 2], [C_out * s]
    c_in = weight.shape[1]
    c_out = weight.shape[0] // stride
    w = weight.view(c_out, stride, c_in, 2).permute(3, 2, 1, 0).reshape(2 * c_in, stride * c_out).contiguous()
    b = None if bias is None else bias.view(c_out, stride).t().reshape(-1).contiguous()
    return Gemm(w, b, 2, 1)


def snake_of(module: Snake, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """`Snake` over [m, W, C] (channels last), times mask [m, W] where given."""
    return snake(x, module.alpha.view(-1), mask)


@dataclass(frozen=True)
class Residual:
    unit: ResidualUnit
    conv1: Gemm
    conv2: Gemm

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        """full: [m, keep + W, C], the kept samples then the call's; -> [m, W, C]."""
        h = self.conv2(snake_of(self.unit.snake2, self.conv1(snake_of(self.unit.snake1, full))))
        reach = self.unit.conv1.padding[0]
        return h.add_(full[:, reach: reach + h.shape[1]])


def residual_gemm(unit: ResidualUnit) -> Residual:
    return Residual(unit, conv_gemm(unit.conv1), conv_gemm(unit.conv2))
