"""The DAC acoustic decoder of the Higgs-Audio v2 codec: latent frames [B, D, T] -> waveform [B, 1, T * hop];
and its acoustic encoder (voice cloning): waveform [B, 1, samples] -> latent frames [B, D, about samples / hop].

Module names follow transformers' `acoustic_decoder` / `acoustic_encoder` so that layout loads without renaming.
Decoder geometry: conv k7 D -> C; per ratio s a block (Snake, ConvTranspose1d C -> C/2 with kernel 2s, stride s,
padding ceil(s/2), output_padding s % 2, so exactly s samples per input sample; then residual units with dilations
1, 3, 9); Snake; conv k7 -> 1. No tanh. The geometry constants are also what the streaming decoder's receptive
field is built from. Encoder: conv k7 1 -> C; per ratio s a block (residual units 1, 3, 9; Snake; conv C -> 2C
with kernel 2s, stride s, padding ceil(s/2)); Snake; conv k3 -> D.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager

import torch
from torch import nn

KERNEL = 7
DILATIONS = (1, 3, 9)


_ieee = threading.Lock()
_ieee_users = 0
_ieee_saved = (True, False)
# Measurement only: $HIGGS_RT_CODEC_TF32=1 lets the codec's CUDA GEMMs and convolutions round their inputs to TF32
# (tensor cores) instead, to time what the codec's share of the GPU would be at that precision (on the CPU, a TF32
# decode is ~46 dB from the fp32 one: csrc/cuda/NOTES.md). Not a supported mode: parity tests assume IEEE fp32.
_TF32 = os.environ.get("HIGGS_RT_CODEC_TF32") == "1"


@contextmanager
def ieee_fp32():
    """cuDNN convolutions and cuBLAS matmuls in IEEE fp32 (no TF32) while any codec call runs, on any thread.

    cuDNN's default lets some algorithms round inputs to TF32 and not others, so the streamed decode (narrow
    windows) and the offline one (whole utterances) would differ by ~1e-3 relative per layer: with IEEE fp32 they
    differ by float rounding only. The Talker's matmuls are bf16, which the flags do not touch."""
    global _ieee_users, _ieee_saved
    with _ieee:
        if _ieee_users == 0:
            _ieee_saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = _TF32
        _ieee_users += 1
    try:
        yield
    finally:
        with _ieee:
            _ieee_users -= 1
            if _ieee_users == 0:
                torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = _ieee_saved


def upsample_geometry(stride: int) -> tuple[int, int, int]:
    """(kernel, padding, output_padding) of the transposed conv that turns n samples into n * stride."""
    return 2 * stride, math.ceil(stride / 2), stride % 2


class Snake(nn.Module):
    """x + sin(alpha * x)^2 / (alpha + 1e-9), one alpha per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, KERNEL, dilation=dilation, padding=(KERNEL - 1) // 2 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class UpsampleBlock(nn.Module):
    def __init__(self, channels: int, stride: int):
        super().__init__()
        kernel, padding, output_padding = upsample_geometry(stride)
        self.snake1 = Snake(channels)
        self.conv_t1 = nn.ConvTranspose1d(channels, channels // 2, kernel, stride, padding, output_padding)
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(channels // 2, d) for d in DILATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class AcousticDecoder(nn.Module):
    def __init__(self, latent_dim: int, channels: int, ratios: tuple[int, ...]):
        super().__init__()
        self.conv1 = nn.Conv1d(latent_dim, channels, KERNEL, padding=(KERNEL - 1) // 2)
        self.block = nn.ModuleList(UpsampleBlock(channels // 2**i, s) for i, s in enumerate(ratios))
        out_channels = channels // 2 ** len(ratios)
        self.snake1 = Snake(out_channels)
        self.conv2 = nn.Conv1d(out_channels, 1, KERNEL, padding=(KERNEL - 1) // 2)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.conv1(latents)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class DownsampleBlock(nn.Module):
    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(channels, d) for d in DILATIONS)
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, 2 * channels, 2 * stride, stride, math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv1(self.snake1(self.res_unit3(self.res_unit2(self.res_unit1(x)))))


class AcousticEncoder(nn.Module):
    def __init__(self, channels: int, ratios: tuple[int, ...], latent_dim: int):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, KERNEL, padding=(KERNEL - 1) // 2)
        self.block = nn.ModuleList(DownsampleBlock(channels * 2**i, s) for i, s in enumerate(ratios))
        out_channels = channels * 2 ** len(ratios)
        self.snake1 = Snake(out_channels)
        self.conv2 = nn.Conv1d(out_channels, latent_dim, 3, padding=1)

    def output_length(self, samples: int) -> int:
        """Frames out for `samples` in (every conv but the strided ones keeps the length)."""
        for block in self.block:
            conv = block.conv1
            samples = (samples + 2 * conv.padding[0] - conv.kernel_size[0]) // conv.stride[0] + 1
        return samples

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        x = self.conv1(waveform)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))
