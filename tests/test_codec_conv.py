"""higgs_rt.ops.codec_conv, the streaming codec's convolutions on tensor cores (csrc/cuda/codec_conv.cu): the
reference is torch's conv1d channels last; the CUDA kernel is as close to an fp64 convolution as cuBLAS's fp32
SGEMM over the same im2col rows, gives every lane the same bits whatever the other lanes (and the tile the launch
picks), and bad input is a ValueError naming the op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import run_switched
from higgs_rt.codec.layers import ieee_fp32
from higgs_rt.ops import HAS_CUDA_KERNELS, codec_conv, codec_conv_ref, codec_conv_supported, snake_ref

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_CUDA_KERNELS),
                                reason="needs a CUDA GPU and a CUDA build of higgs-rt")


def inputs(b: int, length: int, c: int, n: int, taps: int, device: str = "cpu", seed: int = 0,
           dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, c, generator=g)
    weight = torch.randn(taps * c, n, generator=g) / (taps * c) ** 0.5
    bias, alpha = torch.randn(n, generator=g), torch.rand(n, generator=g) * 3 + 0.05
    return [t.to(device, dtype) for t in (x, weight, bias, alpha)]


@pytest.mark.parametrize("taps,dilation", [(1, 1), (2, 1), (7, 1), (7, 3), (7, 9)])
def test_the_reference_is_a_channels_last_conv1d(taps, dilation):
    x, weight, bias, alpha = inputs(3, 70, 5, 6, taps, dtype=torch.float64)
    w = weight.view(taps, 5, 6).permute(2, 1, 0)  # [N, C, taps]
    want = F.conv1d(x.transpose(1, 2), w, bias, dilation=dilation).transpose(1, 2)
    got = codec_conv_ref(x, weight, bias, None, taps, dilation)
    assert got.shape == (3, 70 - (taps - 1) * dilation, 6)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(codec_conv_ref(x, weight, bias, alpha, taps, dilation), snake_ref(want, alpha))
    on_cpu = codec_conv(x.float(), weight.float(), None, None, taps, dilation)  # the CPU runs the reference
    torch.testing.assert_close(on_cpu, (want - bias).float(), rtol=1e-5, atol=1e-5)


def test_the_kernel_takes_channels_in_and_out_in_multiples_of_32():
    x = torch.zeros(2, 9, 64)
    assert not codec_conv_supported(x, 64)  # the CPU: never
    if torch.cuda.is_available() and HAS_CUDA_KERNELS:
        assert codec_conv_supported(x.cuda(), 96)
        assert not codec_conv_supported(x.cuda(), 1) and not codec_conv_supported(x[..., :48].cuda(), 64)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(2, 9)), r"codec_conv: x must have 3 dims"),
    (dict(x=torch.zeros(2, 9, 32, dtype=torch.float64)), r"codec_conv: x must be float32"),
    (dict(weight=torch.zeros(32, 64)), r"codec_conv: weight must be \[224, N\]"),
    (dict(taps=0), r"codec_conv: taps must be an int from 1"),
    (dict(dilation=2.0), r"codec_conv: dilation must be an int from 1"),
    (dict(x=torch.zeros(2, 6, 32)), r"codec_conv: x \(2, 6, 32\) is shorter than the kernel's reach 7"),
    (dict(bias=torch.zeros(63)), r"codec_conv: bias must be \[64\]"),
    (dict(alpha=torch.zeros(64, dtype=torch.int64)), r"codec_conv: alpha must be float32"),
])
def test_bad_input_is_a_value_error_naming_the_op(bad, match):
    args = dict(x=torch.zeros(2, 9, 32), weight=torch.zeros(7 * 32, 64), bias=None, alpha=None, taps=7, dilation=1)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        codec_conv(**args)


def error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


# (lanes, samples, C, N, taps, dilation): the released decoder's layer kinds (k7 dilated, k1, the polyphase
# upsamplers' k2 with N = stride x C_out, 96 included), rows from 1 tile to many, both tile shapes
SHAPES = [(2, 14, 32, 32, 7, 1), (3, 40, 32, 96, 2, 1), (8, 120, 64, 64, 7, 3), (8, 400, 32, 32, 7, 9),
          (4, 65, 512, 512, 7, 1), (2, 9, 1024, 4096, 2, 1), (16, 700, 128, 128, 1, 1), (5, 33, 256, 1280, 2, 1),
          (64, 200, 64, 64, 7, 9)]


@needs_cuda
@pytest.mark.parametrize("b,length,c,n,taps,dilation", SHAPES)
def test_the_kernel_is_as_accurate_as_fp32_sgemm(b, length, c, n, taps, dilation):
    x, weight, bias, alpha = inputs(b, length, c, n, taps, "cuda", seed=b + c)
    exact = codec_conv_ref(x.double(), weight.double(), bias.double(), None, taps, dilation)
    with ieee_fp32():
        sgemm = codec_conv_ref(x, weight, bias, None, taps, dilation)
    got = codec_conv(x, weight, bias, None, taps, dilation)
    assert got.shape == exact.shape and got.is_contiguous()
    # 3xTF32 keeps ~22 of an operand's 24 bits, and the long sums are IEEE adds of 32-product steps: within a few
    # times SGEMM's error; plain TF32 (the small parts dropped) misses by ~1e-4 to 1e-3 of the output
    assert error(got, exact) <= max(4 * error(sgemm, exact), 1e-6), (error(got, exact), error(sgemm, exact))
    assert torch.equal(codec_conv(x, weight, bias, alpha, taps, dilation), snake_ref(got, alpha))  # the epilogue


@needs_cuda
def test_the_integer_split_keeps_the_bits(tmp_path):
    """$HIGGS_RT_CODEC_CONV_SPLIT=2 (measuring; codec_conv.cu's kInt): the operands rounded to TF32 by an integer add
    and a mask instead of cvt.rna give the default's bits, on both tile shapes and the split sums, with a quarter of
    x's values on a tie (13 low bits 0x1000: away from zero) and a quarter of the weights' rounding up (0x1fff)."""
    cases = []
    for b, length, c, n, taps, dilation in SHAPES:
        x, weight, bias, alpha = inputs(b, length, c, n, taps, "cuda", seed=b + c)
        for t, low in ((x, 0x1000), (weight, 0x1fff)):
            flat = t.view(torch.int32).view(-1)[::4]
            flat.copy_((flat & ~0x1fff) | low)
        cases.append((x, weight, bias, alpha, taps, dilation))
    (want, plain), (got, names) = run_switched("higgs_rt.ops.codec_conv", cases, "codec_conv_kernel", tmp_path,
                                               "HIGGS_RT_CODEC_CONV_SPLIT", (None, "2"))
    assert plain and all(", 0>(" in name for name in plain), plain  # the kernels' kSplit template argument
    assert names and all(", 2>(" in name for name in names), names
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"case {i}: {SHAPES[i]}"


@needs_cuda
def test_a_lane_has_the_same_bits_whatever_the_other_lanes():
    x, weight, bias, alpha = inputs(64, 400, 64, 128, 7, "cuda", seed=5)
    full = codec_conv(x, weight, bias, alpha, 7, 9)  # 128 x 32 tiles (692 of them: enough to fill the GPU)
    for lanes in (1, 2, 3, 17):
        part = codec_conv(x[:lanes], weight, bias, alpha, 7, 9)  # 64 x 32 tiles
        assert torch.equal(part, full[:lanes]), lanes
    x[5:] = torch.randn_like(x[5:])
    assert torch.equal(codec_conv(x, weight, bias, alpha, 7, 9)[:5], full[:5])


@needs_cuda
def test_unaligned_or_odd_inputs_take_the_reference():
    x, weight, bias, _ = inputs(2, 20, 32, 32, 2, "cuda")
    shifted = torch.empty(2 * 20 * 32 + 1, device="cuda")[1:].view(2, 20, 32).copy_(x)  # 4 bytes off
    torch.testing.assert_close(codec_conv(shifted, weight, bias, None, 2, 1),
                               codec_conv_ref(x, weight, bias, None, 2, 1), rtol=1e-5, atol=1e-5)
    odd = torch.randn(2, 20, 24, device="cuda")
    w = torch.randn(48, 32, device="cuda")
    assert torch.equal(codec_conv(odd, w, None, None, 2, 1), codec_conv_ref(odd, w, None, None, 2, 1))
