"""Typed configuration of the codec's decode path, read from either checkpoint layout's config.json.

- transformers (`model_type: higgs_audio_v2_tokenizer`): the DAC decoder in `acoustic_model_config`; the number of
  quantizers is derived from `target_bandwidths` exactly as transformers does.
- Boson (bosonai/higgs-audio-v2-tokenizer): flat `ratios`, `n_q`, `bins`, `D`, `codebook_dim`. Boson's code fixes
  the decoder width (1024) and the semantic width (768); the optional keys `decoder_channels` and `semantic_dim`
  (higgs-rt's, written only by the tiny test fixture) override them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRANSFORMERS_MODEL_TYPE = "higgs_audio_v2_tokenizer"
BOSON_KEYS = ("ratios", "n_q", "bins", "D")

# Defaults transformers fills in for fields a config.json leaves out.
_TF_ACOUSTIC_DEFAULTS = {"downsampling_ratios": [8, 5, 4, 2], "upsampling_ratios": [8, 5, 4, 2],
                         "decoder_hidden_size": 1024, "hidden_size": 256}
_TF_DEFAULTS = {"sample_rate": 24000, "codebook_size": 1024, "codebook_dim": 64,
                "target_bandwidths": [0.5, 1, 1.5, 2, 4]}
_SEMANTIC_DIM = 768
_BOSON_DECODER_CHANNELS = 1024


@dataclass(frozen=True)
class CodecConfig:
    """Shapes of the decode path: codes -> RVQ sum (hidden_dim) -> fc2 (latent_dim) -> DAC decoder -> waveform."""

    layout: str  # "transformers" or "boson"
    sample_rate: int
    upsampling_ratios: tuple[int, ...]
    decoder_channels: int
    latent_dim: int
    hidden_dim: int
    codebook_dim: int
    codebook_size: int
    num_quantizers: int

    def __post_init__(self):
        ints = {"sample_rate": self.sample_rate, "decoder_channels": self.decoder_channels,
                "latent_dim": self.latent_dim, "hidden_dim": self.hidden_dim, "codebook_dim": self.codebook_dim,
                "codebook_size": self.codebook_size, "num_quantizers": self.num_quantizers}
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"codec config: {name} must be a positive integer, got {value!r}")
        if not self.upsampling_ratios or any(not isinstance(r, int) or r < 1 for r in self.upsampling_ratios):
            raise ValueError(f"codec config: ratios must be positive integers, got {self.upsampling_ratios!r}")
        if self.decoder_channels % 2 ** len(self.upsampling_ratios):
            raise ValueError(
                f"codec config: decoder width {self.decoder_channels} must halve {len(self.upsampling_ratios)} times"
            )

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsampling_ratios)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length

    @classmethod
    def from_dict(cls, raw: dict) -> "CodecConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"codec config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type == TRANSFORMERS_MODEL_TYPE:
            return cls._from_transformers(raw)
        if model_type is None and all(k in raw for k in BOSON_KEYS):
            return cls._from_boson(raw)
        raise ValueError(
            f"not a Higgs-Audio v2 codec config (model_type={model_type!r}): expected model_type "
            f"{TRANSFORMERS_MODEL_TYPE!r} or Boson's keys {', '.join(BOSON_KEYS)}"
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "CodecConfig":
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"codec config not found: {file}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"codec config {file} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    @classmethod
    def _from_transformers(cls, raw: dict) -> "CodecConfig":
        top = {**_TF_DEFAULTS, **raw}
        acoustic = {**_TF_ACOUSTIC_DEFAULTS, **(raw.get("acoustic_model_config") or {})}
        semantic_dim = (raw.get("semantic_model_config") or {}).get("hidden_size", _SEMANTIC_DIM)
        up, down = acoustic["upsampling_ratios"], acoustic["downsampling_ratios"]
        if math.prod(up) != math.prod(down):
            raise ValueError(f"upsampling_ratios {up} and downsampling_ratios {down} give different hop lengths")
        sample_rate, codebook_size = top["sample_rate"], top["codebook_size"]
        bandwidths = top["target_bandwidths"]
        if not bandwidths or not isinstance(codebook_size, int) or codebook_size < 2:
            raise ValueError(f"need target_bandwidths and codebook_size >= 2, got {bandwidths!r}, {codebook_size!r}")
        bits_per_frame = math.ceil(sample_rate / math.prod(down)) * math.ceil(math.log2(codebook_size))
        return cls(
            layout="transformers",
            sample_rate=sample_rate,
            upsampling_ratios=tuple(up),
            decoder_channels=acoustic["decoder_hidden_size"],
            latent_dim=acoustic["hidden_size"],
            hidden_dim=acoustic["hidden_size"] + semantic_dim,
            codebook_dim=top["codebook_dim"],
            codebook_size=codebook_size,
            num_quantizers=int(1000 * bandwidths[-1] // bits_per_frame),
        )

    @classmethod
    def _from_boson(cls, raw: dict) -> "CodecConfig":
        if not isinstance(raw["bins"], int):
            raise ValueError(f"bins={raw['bins']!r}: only the RVQ codec (integer bins) is supported, not RFSQ")
        latent = raw["D"]
        hidden = (latent + raw.get("semantic_dim", _SEMANTIC_DIM)) // raw.get("vq_scale", 1)
        return cls(
            layout="boson",
            sample_rate=raw.get("sample_rate", 24000),
            upsampling_ratios=tuple(raw["ratios"]),
            decoder_channels=raw.get("decoder_channels", _BOSON_DECODER_CHANNELS),
            latent_dim=latent,
            hidden_dim=hidden,
            codebook_dim=raw.get("codebook_dim"),  # None (no projection) is not a released codec: rejected
            codebook_size=raw["bins"],
            num_quantizers=raw["n_q"],
        )
