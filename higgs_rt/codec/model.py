"""`Code2Wav`: aligned codes [B, T, Q] -> waveform [B, T * hop], and the Talker's delayed frames -> aligned codes;
`delay_pattern`, the other direction (aligned codes -> delayed frames, as a voice-clone prompt feeds them).

Each codebook's embedding -> project_out (with its bias) is folded at load into one table [Q, K, hidden_dim], so the
RVQ decode is a gather-sum (`higgs_rt.ops.rvq_lookup`, fp32 accumulation in codebook order, as the reference sums).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from higgs_rt.ops import delay_revert, rvq_lookup

from . import gemm
from .config import CodecConfig
from .layers import AcousticDecoder, ieee_fp32


def delay_pattern(codes: torch.Tensor, bos: int, eos: int) -> torch.Tensor:
    """Aligned codes [T, Q] -> delayed frames [T + Q + 1, Q]: a BOS and an EOS column around the codes, then
    codebook k shifted right by k (BOS before, EOS after). Frame 0 is all BOS, the last all EOS."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be [T, Q], got {tuple(codes.shape)}")
    frames, q = codes.shape
    out = torch.full((frames + q + 1, q), eos, dtype=torch.int64, device=codes.device)
    for k in range(q):
        out[: k + 1, k] = bos
        out[k + 1: k + 1 + frames, k] = codes[:, k]
    return out


class Code2Wav(nn.Module):
    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.register_buffer("table", torch.zeros(config.num_quantizers, config.codebook_size, config.hidden_dim))
        self.fc2 = nn.Linear(config.hidden_dim, config.latent_dim)
        self.acoustic_decoder = AcousticDecoder(config.latent_dim, config.decoder_channels, config.upsampling_ratios)
        # an exported decode (`higgs_rt.compiled.CodecRunner`): codes -> waveform, or None for shapes it lacks
        self.exported: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    @property
    def num_quantizers(self) -> int:
        return self.config.num_quantizers

    @property
    def codebook_size(self) -> int:
        """K real codes per codebook; the Talker's stream BOS is K and its EOS K + 1."""
        return self.config.codebook_size

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Aligned codes [B, T, Q] int64 -> waveform [B, T * hop] (codes outside 0..K-1 are clamped)."""
        if codes.dim() != 3 or codes.shape[2] != self.num_quantizers or codes.dtype != torch.int64:
            raise ValueError(
                f"codes must be int64 [B, T, {self.num_quantizers}], got {codes.dtype} {tuple(codes.shape)}"
            )
        batch, frames, _ = codes.shape
        if frames == 0:
            return self.table.new_zeros(batch, 0)
        if self.exported is not None and (wav := self.exported(codes)) is not None:
            return wav
        latents = self.fc2(rvq_lookup(codes.to(self.table.device), self.table))
        with ieee_fp32():
            if self.gemm_decode(latents):
                return gemm.decode(self.acoustic_decoder, latents)
            return self.acoustic_decoder(latents.transpose(1, 2)).squeeze(1)

    @staticmethod
    def gemm_decode(latents: torch.Tensor) -> bool:
        """Decode channels last as GEMMs (`gemm`, the arithmetic of the streamed decode), where `gemm.enabled`,
        run eagerly; traced (export, compile), the modules' convolutions."""
        return gemm.enabled(latents) and not torch.compiler.is_compiling()

    forward = decode

    def postprocess(self, delayed: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """The Talker's delayed frames -> aligned codes, as transformers' processor does before decoding.

        Per row: start after the last all-BOS frame, stop before the first all-EOS frame after it, undo the
        delay (codebook k lags k frames, so S frames give S - Q + 1) and clip to 0..K-1.
        [S, Q] -> [T, Q]; [B, S, Q] -> a list of B tensors [T_b, Q] (rows end at different frames).
        """
        if delayed.dim() not in (2, 3) or delayed.shape[-1] != self.num_quantizers:
            raise ValueError(f"delayed must be [S, {self.num_quantizers}] or [B, S, {self.num_quantizers}], "
                             f"got {tuple(delayed.shape)}")
        rows = [self._postprocess_row(row) for row in delayed.reshape(-1, *delayed.shape[-2:])]
        return rows[0] if delayed.dim() == 2 else rows

    def _postprocess_row(self, row: torch.Tensor) -> torch.Tensor:
        bos, eos = self.codebook_size, self.codebook_size + 1
        starts = (row == bos).all(-1).nonzero()
        row = row[int(starts[-1]) + 1:] if len(starts) else row
        ends = (row == eos).all(-1).nonzero()
        row = row[: int(ends[0])] if len(ends) else row
        if row.shape[0] < self.num_quantizers:
            return row.new_zeros(0, self.num_quantizers)
        return delay_revert(row[None].long(), self.codebook_size)[0]
