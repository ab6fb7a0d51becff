"""`Wav2Code`: the codec's encode path (voice cloning), 24 kHz mono waveform -> aligned codes [T, Q].

Acoustic branch: the DAC encoder on the waveform -> [latent_dim, T]. Semantic branch (`semantic`): HuBERT
features -> semantic encoder -> [semantic_dim, T]. When the DAC encoder's frame count differs from the semantic
branch's, the waveform is padded by hop / 2 on each side first (transformers' rule; it makes the two agree for
every length). Then concat -> fc -> residual VQ over Q quantizers: project_in (hidden -> codebook_dim), the
nearest codebook entry (Euclidean), and the residual loses that entry's project_out. Module names follow
transformers' `HiggsAudioV2TokenizerModel`; `load_encoder` fills them from either layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncodeConfig
from .layers import AcousticEncoder
from .semantic import Hubert, SemanticEncoder, semantic_features


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed", torch.zeros(size, dim))

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the closest entry (squared Euclidean distance) for each row of x [N, dim]."""
        distance = x.pow(2).sum(1, keepdim=True) - 2 * x @ self.embed.t() + self.embed.pow(2).sum(1)
        return distance.argmin(1)


class VectorQuantizer(nn.Module):
    def __init__(self, hidden: int, dim: int, size: int):
        super().__init__()
        self.project_in = nn.Linear(hidden, dim)
        self.codebook = Codebook(size, dim)
        self.project_out = nn.Linear(dim, hidden)


class ResidualVQ(nn.Module):
    def __init__(self, num_quantizers: int, hidden: int, dim: int, size: int):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantizer(hidden, dim, size) for _ in range(num_quantizers))

    def encode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, T, hidden] -> codes [B, T, Q]."""
        residual = latents.reshape(-1, latents.shape[-1])
        codes = []
        for q in self.quantizers:
            index = q.codebook.nearest(q.project_in(residual))
            residual = residual - q.project_out(F.embedding(index, q.codebook.embed))
            codes.append(index)
        return torch.stack(codes, -1).reshape(*latents.shape[:-1], len(codes))


class Wav2Code(nn.Module):
    def __init__(self, config: EncodeConfig):
        super().__init__()
        self.config = config
        codec = config.codec
        self.acoustic_encoder = AcousticEncoder(config.encoder_channels, config.downsampling_ratios, codec.latent_dim)
        self.semantic_model = Hubert(config.hubert)
        self.encoder_semantic = SemanticEncoder(config)
        self.fc = nn.Linear(codec.hidden_dim, codec.hidden_dim)
        self.quantizer = ResidualVQ(codec.num_quantizers, codec.hidden_dim, codec.codebook_dim, codec.codebook_size)

    @property
    def sample_rate(self) -> int:
        return self.config.codec.sample_rate

    @torch.inference_mode()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """Mono float waveform [n] or [B, n] at `sample_rate` -> codes [T, Q] or [B, T, Q] int64 (25 frames/s)."""
        if waveform.dim() not in (1, 2) or not waveform.is_floating_point():
            raise ValueError(f"waveform must be float [n] or [B, n], got {waveform.dtype} {tuple(waveform.shape)}")
        fc = self.fc.weight
        wav = waveform.reshape(-1, waveform.shape[-1]).to(device=fc.device, dtype=fc.dtype)
        hop = self.config.codec.hop_length
        if wav.shape[-1] < hop:
            raise ValueError(f"waveform too short to encode: {wav.shape[-1]} samples, need at least {hop}")
        semantic = self.encoder_semantic(semantic_features(self.semantic_model, wav, self.config).transpose(1, 2))
        frames = semantic.shape[-1]
        if self.acoustic_encoder.output_length(wav.shape[-1]) != frames:
            wav = F.pad(wav, (hop // 2, hop // 2))
        acoustic = self.acoustic_encoder(wav[:, None])
        if acoustic.shape[-1] != frames:  # cannot happen with the released ratios; say so if a config does it
            raise ValueError(f"acoustic ({acoustic.shape[-1]}) and semantic ({frames}) frame counts differ")
        latents = self.fc(torch.cat([acoustic, semantic], 1).transpose(1, 2))
        codes = self.quantizer.encode(latents)
        return codes[0] if waveform.dim() == 1 else codes
