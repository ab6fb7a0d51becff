"""Code2Wav evaluated as a stream over `slots` lanes, every convolution with its own left state.

`StatefulDecoder.step` takes n aligned code frames for each of the lanes [0, m) and returns n * hop samples per lane
(lanes from m on are left as they are: a caller keeps its busy lanes lowest and steps a bucket of them). Each
convolution keeps, per lane, the input samples it still needs ([slots, C, keep]) and emits an output sample only
once its whole receptive field is known: a "same" conv (kernel k, dilation d) keeps (k - 1) * d samples and lags
(k - 1) / 2 * d; the transposed conv (kernel 2s, stride s, padding P) keeps one input sample and lags P at its
output rate; the RVQ lookup, fc2, the k1 convs and Snake are pointwise. So every frame is decoded once and the
output is `lag_frames` frames behind the input: the decoder's right receptive field.

Zero padding is a mask. Every layer's input is a stream at `rate` samples per frame; in a call whose first frame
sits at position F, its sample j holds position F * rate - lag + j. Samples at positions outside
[0, length * rate) enter the convolution as zeros, exactly as the offline decode pads each convolution's input
(Snake(0) = 0, so masking after a Snake is the same as before it). Positions and lengths are per-lane device
tensors, so a call has no host sync, and a lane that has not started yet or has ended is computed alongside the
others and masked. The last conv's output lags `lag` samples; a delay line of `lag_frames * hop - lag` samples
aligns the output to whole frames.

Rounding: on the CPU in fp32 every convolution (fc2 as a k1 convolution too, the upsamplers as polyphase
convolutions) goes through oneDNN's forward convolution, whose sums depend neither on the width, nor on the batch,
nor on the thread count, so a lane's samples are the same bits for every chunk size and whatever the other lanes
hold (tests/test_codec_stream.py checks all three). The offline decode lets PyTorch pick an algorithm per layer
(by size and thread count), so the stream equals it to float rounding, not bit for bit (tests/test_codec_stream.py
measures it).

On CUDA the layers run channels last, every convolution one IEEE fp32 GEMM or, over several lanes, one
tensor-core convolution at fp32 accuracy (`gemm`; the offline decode there runs the GEMMs over whole utterances);
a layer's input window (the residual add of the unit before, Snake, the mask from each lane's first frame and
length, the kept samples) is one kernel (`ops.codec_window`). A call has no host
sync and reads and writes only the state tensors, so `stream.StreamingCodec` replays it inside CUDA graphs.

The modules' own parameters are used (shared, not copied); the GEMM path's weights, laid out anew, are made once
per codec (`gemm.prepare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from higgs_rt.ops import codec_window, rvq_lookup

from . import gemm as gemm_layers
from .layers import ResidualUnit, Snake, UpsampleBlock, ieee_fp32
from .model import Code2Wav


@dataclass(frozen=True)
class _Layer:
    """One convolution fed a stream at `rate` samples per frame, `lag` samples behind the frames."""

    kind: str  # "conv" (same-padded conv1d), "up" (transposed conv), "res" (residual unit)
    module: nn.Module
    snake: Snake | None  # applied to the input before the mask ("conv", "up")
    rate: int
    lag: int
    keep: int  # input samples kept per lane between calls
    channels: int
    polyphase: tuple[torch.Tensor, torch.Tensor | None] | None = None  # "up" on the CPU: see `_upsample`


def _plan(codec: Code2Wav) -> tuple[list[_Layer], int]:
    """The acoustic decoder's convolutions in order, each with its input's rate and lag; and the output's lag."""
    decoder = codec.acoustic_decoder
    layers, rate, lag = [], 1, 0

    def conv(module: nn.Conv1d, snake: Snake | None) -> None:
        nonlocal lag
        reach = module.padding[0]
        layers.append(_Layer("conv", module, snake, rate, lag, 2 * reach, module.in_channels))
        lag += reach

    conv(decoder.conv1, None)
    for block in decoder.block:
        block: UpsampleBlock
        up = block.conv_t1
        layers.append(_Layer("up", up, block.snake1, rate, lag, 1, up.in_channels))
        rate, lag = rate * up.stride[0], lag * up.stride[0] + up.padding[0]
        for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
            unit: ResidualUnit
            reach = unit.conv1.padding[0]
            layers.append(_Layer("res", unit, None, rate, lag, 2 * reach, unit.conv1.in_channels))
            lag += reach
    conv(decoder.conv2, decoder.snake1)
    return layers, lag


class StatefulDecoder:
    """`Code2Wav` as a stream over `slots` lanes: `step(codes, first, length)` -> PCM; `reset(slot)` per utterance.

    gemm: the layers as GEMMs over channels-last activations (`gemm`); default `gemm.enabled` (fp32 on CUDA,
    unless HIGGS_RT_CODEC_GEMM=0).
    """

    def __init__(self, codec: Code2Wav, slots: int, gemm: bool | None = None):
        if slots < 1:
            raise ValueError(f"need slots >= 1, got {slots}")
        self.codec, self.slots = codec, slots
        self.layers, self.lag = _plan(codec)
        like = codec.acoustic_decoder.conv1.weight
        self.gemm = gemm_layers.enabled(like) if gemm is None else gemm
        if _onednn(like):
            self.layers = [replace(layer, polyphase=gemm_layers.polyphase(layer.module)) if layer.kind == "up"
                           else layer for layer in self.layers]
        self._gemms = gemm_layers.prepare(codec.acoustic_decoder) if self.gemm else []
        self.hop = codec.hop_length
        self.lag_frames = math.ceil(self.lag / self.hop)
        with torch.inference_mode():
            # per lane, the samples each layer keeps: [slots, C, keep], or [slots, keep, C] channels last (gemm)
            self.states = [like.new_zeros(slots, *((layer.keep, layer.channels) if self.gemm else
                                                    (layer.channels, layer.keep))) for layer in self.layers]
            self.delay = like.new_zeros(slots, 1, self.lag_frames * self.hop - self.lag)
        self._ramps: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # per width: `_masks`

    @staticmethod
    def lag_frames_of(codec: Code2Wav) -> int:
        """The output's lag in whole frames (the decoder's right receptive field)."""
        return math.ceil(_plan(codec)[1] / codec.hop_length)

    @torch.inference_mode()
    def reset(self, slot: int) -> None:
        """Zero a lane's state: a new utterance, whose past is the left zero padding."""
        for state in self.states:
            state[slot].zero_()
        self.delay[slot].zero_()

    @torch.inference_mode()
    def step(self, codes: torch.Tensor, first: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Aligned codes [m, n, Q] int64 for lanes 0 .. m - 1 (m <= slots): lane b's frames at positions
        first[b] .. first[b] + n - 1 of an utterance of length[b] frames (first, length: [m] int64 on the codec's
        device) -> [m, n * hop]: the samples of frames first - lag_frames .. first - lag_frames + n - 1 (only
        those inside 0 .. length - 1 are audio). Lanes m .. slots - 1 keep their state."""
        m = codes.shape[0]
        if not 1 <= m <= self.slots:
            raise ValueError(f"codes must cover 1 .. {self.slots} lanes, got {m}")
        with ieee_fp32():
            return self._step(codes, first, length)

    def _step(self, codes: torch.Tensor, first: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        m, n = codes.shape[:2]
        fc2 = self.codec.fc2
        hidden = rvq_lookup(codes, self.codec.table)  # [m, n, D]
        if self.gemm:
            x, addend = F.linear(hidden, fc2.weight, fc2.bias), None
            for layer, gemm, state in zip(self.layers, self._gemms, self.states):
                x, addend = self._layer_gemm(layer, gemm, state[:m], x, addend, first, length)
            x = x.transpose(1, 2)  # [m, 1, n * hop]: the last layer is a conv, no residual after it
        else:
            x = _conv1d(hidden.transpose(1, 2).contiguous(), fc2.weight[:, :, None], fc2.bias, 1)  # fc2 as a k1 conv
            for layer, state, mask in zip(self.layers, self.states, self._masks(n, first, length)):
                x = self._layer(layer, state[:m], x, mask[:, None])
        if self.delay.shape[2]:
            delay = self.delay[:m]
            full = torch.cat([delay, x], 2)
            delay.copy_(full[..., n * self.hop:])
            x = full[..., :n * self.hop]
        return x.squeeze(1)

    def _masks(self, n: int, first: torch.Tensor, length: torch.Tensor) -> list[torch.Tensor]:
        """Per layer [m, n * rate]: 1 where the call's input samples hold positions inside the utterance (all
        layers' masks from one set of kernels, then sliced)."""
        key = (n, first.device)
        plan = self._ramps.get(key)
        if plan is None:  # made on the device: a host-to-device copy would synchronize
            device = first.device
            ramps = [torch.arange(-layer.lag, n * layer.rate - layer.lag, device=device) for layer in self.layers]
            rates = [torch.full((n * layer.rate,), layer.rate, device=device) for layer in self.layers]
            plan = self._ramps[key] = (torch.cat(ramps), torch.cat(rates))
        ramp, rate = plan
        pos = first[:, None] * rate + ramp
        ok = ((pos >= 0) & (pos < length[:, None] * rate)).to(self.delay.dtype)
        return list(ok.split([n * layer.rate for layer in self.layers], 1))

    @staticmethod
    def _layer(layer: _Layer, state: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = layer.module
        if layer.snake is not None:
            x = layer.snake(x)
        width = x.shape[2]
        full = torch.cat([state, x * mask], 2)
        state.copy_(full[..., width:])
        if layer.kind == "conv":
            return _conv1d(full, m.weight, m.bias, m.dilation[0])
        if layer.kind == "up":
            # outputs from the kept input sample through the newest one; the first and last `stride` outputs
            # miss an input (before the kept one, after the newest one) and are dropped
            return _upsample(full, layer)
        reach = m.conv1.padding[0]
        h = _conv1d(m.snake1(full), m.conv1.weight, m.conv1.bias, m.conv1.dilation[0])
        return full[..., reach: reach + width] + _conv1d(m.snake2(h), m.conv2.weight, m.conv2.bias, 1)

    @staticmethod
    def _layer_gemm(layer: _Layer, gemm, state: torch.Tensor, x: torch.Tensor, addend: torch.Tensor | None,
                    first: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_layer` channels last: state [m, keep, C], x [m, W, C] (plus addend, the residual of the unit before)
        -> the layer's output and, for a residual unit, its residual (added by the next layer's window)."""
        unit = layer.module if layer.kind == "res" else None
        full, snaked = codec_window(x, state, first, length, layer.rate, layer.lag, addend,
                                    None if layer.snake is None else gemm_layers.alpha_of(layer.snake),
                                    None if unit is None else gemm_layers.alpha_of(unit.snake1))
        width = x.shape[1]
        state.copy_(full[:, width:])
        if unit is not None:
            reach = unit.conv1.padding[0]
            h = gemm.conv2(gemm.conv1(snaked, alpha=gemm_layers.alpha_of(unit.snake2)))
            return h, full[:, reach: reach + width]
        y = gemm(full)
        if layer.kind == "up":
            return y.view(y.shape[0], -1, layer.module.out_channels), None  # (step, phase) rows: the samples in order
        return y, None


def _onednn(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int) -> torch.Tensor:
    """An unpadded conv1d; on the CPU in fp32 always through oneDNN (PyTorch would pick im2col + GEMM for narrow
    batch-1 inputs, which rounds differently)."""
    if _onednn(x):
        return torch.ops.aten.mkldnn_convolution(x, weight, bias, [0], [1], [dilation], 1)
    return F.conv1d(x, weight, bias, dilation=dilation)


def _upsample(full: torch.Tensor, layer: _Layer) -> torch.Tensor:
    """The transposed conv (kernel 2s, stride s) over the kept input sample and the call's W new ones: the outputs
    s .. s * (W + 1) - 1, each of which sees two inputs (the first and last s outputs miss one and are dropped).

    On the CPU in fp32 as a polyphase convolution: a kernel-2 conv1d with s * C_out output channels (output
    b * s + r of channel o is channel o * s + r at step b), which oneDNN sums in the same order for any width,
    batch and thread count; its transposed convolution does not (with two threads the last few samples of a
    push came out a rounding apart by width)."""
    m, stride = layer.module, layer.module.stride[0]
    if layer.polyphase is None or not _onednn(full):
        return F.conv_transpose1d(full, m.weight, m.bias, stride=stride)[..., stride: stride * (full.shape[2])]
    weight, bias = layer.polyphase
    y = _conv1d(full, weight, bias, 1)  # [B, C_out * s, W]
    b, _, w = y.shape
    return y.view(b, -1, stride, w).transpose(2, 3).reshape(b, -1, w * stride)
