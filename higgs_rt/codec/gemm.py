"""The acoustic decoder's layers as GEMMs over channels-last activations: the codec's decode on CUDA, streamed
(`stateful`) and offline (`decode`, what `Code2Wav.decode` runs there).

Activations are [lanes, samples, channels]. A convolution (kernel K, dilation d, C_in -> C_out) over a call's
input [m, L, C_in] is one GEMM: the im2col rows of its m * (L - (K - 1) * d) outputs, [rows, K * C_in] (one copy
of the input, tap-major), times the weight laid out [K * C_in, C_out]; a k1 convolution is the GEMM alone. The
transposed convolution (kernel 2s, stride s) is its polyphase form: K = 2 over the kept input sample and the new
ones, with s * C_out outputs per input ordered (phase, channel), so the GEMM's rows, read as [rows * s, C_out],
are the upsampled samples in order. Snake is one kernel (`higgs_rt.ops.snake`); the stream's fused steps around the
GEMMs are `ops.codec_window` (a layer's input window) and `ops.tap_sum` (a one-lane convolution's tap sum, bias and
the next Snake).

Why: cuDNN's heuristics pick per shape, and at the streaming shapes some picks were slow (its FFT convolutions
and the data-gradient kernel behind conv_transpose1d took most of a 64-lane push on the H200; a 64-lane push of 4
frames took 105 ms), and torch's Snake is five kernels. cuBLAS's SGEMM runs every layer with the same kind of
kernel, in IEEE fp32 (`layers.ieee_fp32`). A push over several lanes runs its convolutions (channels in and out
multiples of 32: all but the last) as `ops.codec_conv` instead: one implicit-GEMM kernel on tensor cores at fp32
accuracy (3xTF32), no im2col copy, the bias and Snake in its epilogue (H100, an 8-frame push of 8 lanes 2.26 ->
2.11 ms, of 64 lanes 11.8 -> 11.2 ms; the server's 8 streams 86.8% -> 89.4% of the batch-8 step's frames/s).

Rounding: cuBLAS picks its kernel by shape. The stream's short GEMMs get split-K kernels (shorter sequential sums);
the offline decode's long ones would not: as one GEMM per convolution it was 100.4 dB from an fp64 decode at the
released shapes against the stream's 107.6-109.2 (benchmarks/bench_codec_stream.py), the two 99.8 dB apart. So the
offline decode splits every convolution by tap (`by_tap`): one GEMM per tap over a strided view of the input (no
im2col copy), accumulated into the output tap after tap, sums of C_in terms as the stream's split-K kernels make.
Against cuDNN's convolutions (the CPU decode, and the oracle's), the sums differ in order.

The re-laid-out weights (about 80 MB at the released shapes) are made once per decoder module (`prepare`; the
module's weights are fixed once loaded) and shared by every stream and call.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from higgs_rt.ops import codec_conv, codec_conv_supported, snake, tap_sum

from .layers import AcousticDecoder, ResidualUnit, Snake


def enabled(like: torch.Tensor) -> bool:
    """The default for a codec whose weights are like `like`: fp32 on CUDA, unless the environment sets
    HIGGS_RT_CODEC_GEMM=0 (cuDNN's convolutions, for comparison)."""
    return like.is_cuda and like.dtype == torch.float32 and os.environ.get("HIGGS_RT_CODEC_GEMM", "1") != "0"


# The stream's convolutions over several lanes on tensor cores (`ops.codec_conv`), unless HIGGS_RT_CODEC_CONV=0
# (cuBLAS's SGEMM over im2col rows, for comparison); read once.
_TENSOR_CORES = os.environ.get("HIGGS_RT_CODEC_CONV", "1") != "0"


@dataclass(frozen=True)
class Gemm:
    """One convolution as a GEMM: weight [K * C_in, C_out] (tap-major), bias [C_out] or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: int
    dilation: int

    def __call__(self, x: torch.Tensor, by_tap: bool = False, alpha: torch.Tensor | None = None) -> torch.Tensor:
        """[m, L, C_in] -> [m, L - (K - 1) * d, C_out] (contiguous), then Snake with alpha [C_out] where given.
        by_tap: one GEMM per tap (no im2col copy), accumulated tap by tap (the offline decode: see the module's
        note on rounding). One lane (m = 1) takes the taps as one batched GEMM and `tap_sum` adds the K products,
        the bias and Snake in one kernel: K times the thread blocks of one GEMM over the im2col rows, whose few
        rows (a streamed chunk) leave most SMs idle, and no im2col copy. Several lanes on CUDA (channels in and
        out multiples of 32) take `ops.codec_conv`: the convolution on tensor cores at fp32 accuracy, bias and Snake
        in its epilogue."""
        x = x.contiguous()
        m, length, c = x.shape
        width = length - (self.kernel - 1) * self.dilation
        if m > 1 and not by_tap and _TENSOR_CORES and codec_conv_supported(x, self.weight.shape[1]):
            return codec_conv(x, self.weight, self.bias, alpha, self.kernel, self.dilation)
        if self.kernel > 1 and m == 1 and not by_tap:
            taps = self.weight.view(self.kernel, c, -1)
            views = x[0].as_strided((self.kernel, width, c), (self.dilation * c, c, 1))
            return tap_sum(torch.bmm(views, taps), self.bias, alpha)
        if self.kernel > 1 and by_tap:
            taps = self.weight.view(self.kernel, c, -1)
            out = torch.bmm(x[:, :width], taps[0].expand(m, -1, -1))
            for j in range(1, self.kernel):
                start = j * self.dilation
                out.baddbmm_(x[:, start: start + width], taps[j].expand(m, -1, -1))
            if self.bias is not None:
                out.add_(self.bias)
        else:
            if self.kernel == 1:
                cols = x.view(m * length, c)
            else:
                cols = x.as_strided((m, width, self.kernel, c), (length * c, c, self.dilation * c, 1))
                cols = cols.reshape(m * width, self.kernel * c)
            out = cols @ self.weight if self.bias is None else torch.addmm(self.bias, cols, self.weight)
            out = out.view(m, width, -1)
        return out if alpha is None else snake(out, alpha)


def conv_gemm(module: nn.Conv1d) -> Gemm:
    weight = module.weight.detach()  # [C_out, C_in, K]
    k = weight.shape[2]
    bias = None if module.bias is None else module.bias.detach().contiguous()
    return Gemm(weight.permute(2, 1, 0).reshape(k * weight.shape[1], weight.shape[0]).contiguous(), bias, k,
                module.dilation[0])


def polyphase(m: nn.ConvTranspose1d) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transposed conv (kernel 2s, stride s) as a kernel-2 conv with s * C_out output channels: [C_in, C_out,
    2s] -> weight [C_out * s, C_in, 2] (output b * s + r of channel o is channel o * s + r at step b; tap 0 sees
    input b - 1, through kernel taps s .. 2s - 1; tap 1 sees input b, through taps 0 .. s - 1) and bias
    [C_out * s]."""
    stride = m.stride[0]
    c_in, c_out, kernel = m.weight.shape
    if kernel != 2 * stride:
        raise ValueError(f"the streaming upsampler needs kernel = 2 * stride, got {kernel} and {stride}")
    with torch.no_grad():
        w = m.weight.detach().view(c_in, c_out, 2, stride)
        weight = torch.stack([w[:, :, 1], w[:, :, 0]], -1).permute(1, 2, 0, 3).reshape(c_out * stride, c_in, 2)
        bias = None if m.bias is None else m.bias.detach().repeat_interleave(stride)
    return weight.contiguous(), bias


def upsample_gemm(m: nn.ConvTranspose1d) -> Gemm:
    """`polyphase`'s kernel-2 conv reordered so output column r * C_out + o: the rows of [R, s * C_out] read as
    [R * s, C_out] are the upsampled samples."""
    stride = m.stride[0]
    weight, bias = polyphase(m)  # [C_out * s, C_in, 2], [C_out * s]
    c_in = weight.shape[1]
    c_out = weight.shape[0] // stride
    w = weight.view(c_out, stride, c_in, 2).permute(3, 2, 1, 0).reshape(2 * c_in, stride * c_out).contiguous()
    b = None if bias is None else bias.view(c_out, stride).t().reshape(-1).contiguous()
    return Gemm(w, b, 2, 1)


def alpha_of(module: Snake) -> torch.Tensor:
    return module.alpha.view(-1)


def snake_of(module: Snake, x: torch.Tensor) -> torch.Tensor:
    """`Snake` over [m, W, C] (channels last)."""
    return snake(x, alpha_of(module))


@dataclass(frozen=True)
class Residual:
    unit: ResidualUnit
    conv1: Gemm
    conv2: Gemm

    def __call__(self, full: torch.Tensor, by_tap: bool = False) -> torch.Tensor:
        """full: [m, keep + W, C], the kept samples then the call's; -> [m, W, C]."""
        h = self.conv2(self.conv1(snake_of(self.unit.snake1, full), by_tap, alpha_of(self.unit.snake2)))
        reach = self.unit.conv1.padding[0]
        return h.add_(full[:, reach: reach + h.shape[1]])


def residual_gemm(unit: ResidualUnit) -> Residual:
    return Residual(unit, conv_gemm(unit.conv1), conv_gemm(unit.conv2))


_prepared: weakref.WeakKeyDictionary[AcousticDecoder, list[Gemm | Residual]] = weakref.WeakKeyDictionary()


def prepare(decoder: AcousticDecoder) -> list[Gemm | Residual]:
    """The decoder's convolutions as GEMMs, in order: conv1; per block the upsampler and its 3 residual units;
    conv2. Made once per module (its weights are fixed once loaded)."""
    gemms = _prepared.get(decoder)
    if gemms is None:
        gemms = [conv_gemm(decoder.conv1)]
        for block in decoder.block:
            gemms += [upsample_gemm(block.conv_t1), *(residual_gemm(u) for u in (block.res_unit1, block.res_unit2,
                                                                                  block.res_unit3))]
        gemms.append(conv_gemm(decoder.conv2))
        _prepared[decoder] = gemms
    return gemms


def _pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    return F.pad(x, (0, 0, left, right))


def decode(decoder: AcousticDecoder, latents: torch.Tensor) -> torch.Tensor:
    """The offline decode channels last: latents [B, T, D] -> waveform [B, T * hop], every convolution's input
    zero-padded as `AcousticDecoder.forward` pads it. Run it under `layers.ieee_fp32`."""
    gemms = iter(prepare(decoder))
    conv1 = next(gemms)
    x = conv1(_pad(latents, *(2 * [decoder.conv1.padding[0]])), by_tap=True)
    for block in decoder.block:
        up, stride, frames = next(gemms), block.conv_t1.stride[0], x.shape[1]
        # the polyphase conv over one zero either side gives the transposed conv's (frames + 1) * s outputs before
        # its padding P is cropped from the front and the output padding fills the back
        y = up(_pad(snake_of(block.snake1, x), 1, 1), by_tap=True)
        start = block.conv_t1.padding[0]
        x = y.view(y.shape[0], -1, block.conv_t1.out_channels)[:, start: start + frames * stride]
        for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
            x = next(gemms)(_pad(x, *(2 * [unit.conv1.padding[0]])), by_tap=True)
    conv2 = next(gemms)
    out = conv2(_pad(snake_of(decoder.snake1, x), *(2 * [decoder.conv2.padding[0]])), by_tap=True)
    return out.view(out.shape[0], -1)
