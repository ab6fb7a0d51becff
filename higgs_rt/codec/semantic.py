"""The codec's semantic branch (voice cloning): 24 kHz waveform -> 16 kHz -> HuBERT features -> semantic encoder.

`Hubert` is HuBERT base: a conv feature encoder (group norm on the first conv), a feature projection, a
positional conv and a post-norm transformer. Module names are transformers' `HubertModel`'s, so the codec's
`semantic_model.*` tensors load without renaming (the positional conv's weight norm is folded at load).
`SemanticBranch.features` follows transformers' `HiggsAudioV2TokenizerModel`: resample to 16 kHz with
`higgs_rt.resample`, pad 160 samples each side, average all hidden states (the input to the first layer, then
every layer's output) and keep every `semantic_downsample`-th step (50 Hz -> 25 Hz). `SemanticEncoder`: conv k3,
then per block residual units (ELU, dilated conv, ELU, 1x1 conv) and a (strided) conv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from higgs_rt.resample import resample

from .config import EncodeConfig, HubertConfig

HUBERT_PAD = 160  # samples at 16 kHz on each side, as transformers pads (half of HuBERT's 320-sample stride)


class FeatureConv(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, bias: bool, group_norm: bool):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, bias=bias)
        self.layer_norm = nn.GroupNorm(c_out, c_out) if group_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return F.gelu(x if self.layer_norm is None else self.layer_norm(x))


class FeatureEncoder(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        dims = (1, *cfg.conv_dim)
        self.conv_layers = nn.ModuleList(
            FeatureConv(dims[i], dims[i + 1], k, s, cfg.conv_bias, group_norm=i == 0)
            for i, (k, s) in enumerate(zip(cfg.conv_kernel, cfg.conv_stride))
        )

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        x = waveform[:, None]
        for layer in self.conv_layers:
            x = layer(x)
        return x.transpose(1, 2)


class FeatureProjection(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.conv_dim[-1], eps=cfg.eps) if cfg.feat_proj_layer_norm else None
        self.projection = nn.Linear(cfg.conv_dim[-1], cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x if self.layer_norm is None else self.layer_norm(x))


class PositionalConv(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.conv = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, cfg.pos_kernel, padding=cfg.pos_kernel // 2,
                              groups=cfg.pos_groups)
        self.trim = 1 - cfg.pos_kernel % 2  # an even kernel gives one step too many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.transpose(1, 2))
        return F.gelu(y[..., : y.shape[-1] - self.trim]).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                               self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.intermediate_dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output_dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attn(x)); x = LN'(x + ffn(x))."""

    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.feed_forward = FeedForward(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class Encoder(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.pos_conv_embed = PositionalConv(cfg)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.layer_norm(x + self.pos_conv_embed(x))
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return states


class Hubert(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.feature_extractor = FeatureEncoder(cfg)
        self.feature_projection = FeatureProjection(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, waveform: torch.Tensor) -> list[torch.Tensor]:
        """Waveform [B, n] at 16 kHz -> hidden states, num_layers + 1 of [B, steps, hidden]."""
        return self.encoder(self.feature_projection(self.feature_extractor(waveform)))


class EluResidualUnit(nn.Module):
    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation,
                               bias=False)
        self.conv2 = nn.Conv1d(channels, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class EncoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.res_units = nn.ModuleList(EluResidualUnit(c_in, kernel, d) for d in dilations)
        conv_kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(c_in, c_out, conv_kernel, stride, (conv_kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    def __init__(self, cfg: EncodeConfig):
        super().__init__()
        dim = cfg.hubert.hidden_size
        self.conv = nn.Conv1d(dim, dim, cfg.semantic_kernel, padding=cfg.semantic_kernel // 2, bias=False)
        widths = [dim] + [int(dim * r) for r in cfg.channel_ratios]
        self.conv_blocks = nn.ModuleList(
            EncoderBlock(widths[i], widths[i + 1], s, cfg.unit_kernel, cfg.block_dilations)
            for i, s in enumerate(cfg.strides)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


def semantic_features(hubert: Hubert, waveform: torch.Tensor, cfg: EncodeConfig) -> torch.Tensor:
    """Waveform [B, n] at the codec's rate -> HuBERT features [B, steps, hidden] at (about) the frame rate."""
    wav16 = resample(waveform, cfg.codec.sample_rate, cfg.semantic_sample_rate)
    states = hubert(F.pad(wav16, (HUBERT_PAD, HUBERT_PAD)))
    return torch.stack(states, 1).mean(1)[:, :: cfg.semantic_downsample]
