"""Typed configuration of the codec, read from either checkpoint layout's config.json: `CodecConfig` (the decode
path) and `EncodeConfig` (the encode path, for voice cloning: DAC encoder, HuBERT, semantic encoder).

- transformers (`model_type: higgs_audio_v2_tokenizer`): the DAC decoder in `acoustic_model_config`; the number of
  quantizers is derived from `target_bandwidths` exactly as transformers does.
- Boson (bosonai/higgs-audio-v2-tokenizer): flat `ratios`, `n_q`, `bins`, `D`, `codebook_dim`. Boson's code fixes
  the decoder width (1024) and the semantic width (768); the optional keys `decoder_channels` and `semantic_dim`
  (higgs-rt's, written only by the tiny test fixture) override them; likewise `encoder_channels` (DAC encoder,
  64) and `semantic_model_config` (HuBERT base, as transformers' conversion assumes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from higgs_rt.config import read_config

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
        raw = read_config(path, "codec config")
        file = Path(path) / "config.json"
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


# HuBERT base (transformers' HubertConfig defaults): what Boson's hubert_base_general is.
_HUBERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                "conv_dim": [512] * 7, "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "conv_stride": [5, 2, 2, 2, 2, 2, 2],
                "conv_bias": False, "num_conv_pos_embeddings": 128, "num_conv_pos_embedding_groups": 16,
                "layer_norm_eps": 1e-5, "feat_proj_layer_norm": True}
# The one HuBERT variant implemented (HuBERT base): anything else is refused rather than computed wrongly.
_HUBERT_FIXED = {"feat_extract_norm": "group", "do_stable_layer_norm": False, "hidden_act": "gelu",
                 "feat_extract_activation": "gelu", "conv_pos_batch_norm": False}
_TF_ENCODE_DEFAULTS = {"kernel_size": 3, "channel_ratios": [1, 1], "strides": [1, 1], "block_dilations": [1, 1],
                       "unit_kernel_size": 3, "semantic_sample_rate": 16000, "downsample_factor": 320}
_BOSON_ENCODER_CHANNELS = 64


@dataclass(frozen=True)
class HubertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    conv_dim: tuple[int, ...]
    conv_kernel: tuple[int, ...]
    conv_stride: tuple[int, ...]
    conv_bias: bool
    pos_kernel: int
    pos_groups: int
    eps: float
    feat_proj_layer_norm: bool

    @classmethod
    def from_dict(cls, raw: dict | None) -> "HubertConfig":
        c = {**_HUBERT_BASE, **(raw or {})}
        for key, want in _HUBERT_FIXED.items():
            if c.get(key, want) != want:
                raise ValueError(f"semantic model: {key}={c[key]!r} is not supported (HuBERT base has {want!r})")
        if not len(c["conv_dim"]) == len(c["conv_kernel"]) == len(c["conv_stride"]):
            raise ValueError("semantic model: conv_dim, conv_kernel and conv_stride differ in length")
        if c["hidden_size"] % c["num_attention_heads"]:
            raise ValueError(f"semantic model: hidden_size {c['hidden_size']} is not a multiple of "
                             f"num_attention_heads {c['num_attention_heads']}")
        return cls(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["intermediate_size"],
                   tuple(c["conv_dim"]), tuple(c["conv_kernel"]), tuple(c["conv_stride"]), bool(c["conv_bias"]),
                   c["num_conv_pos_embeddings"], c["num_conv_pos_embedding_groups"], float(c["layer_norm_eps"]),
                   bool(c["feat_proj_layer_norm"]))


@dataclass(frozen=True)
class EncodeConfig:
    """Shapes of the encode path: waveform -> [DAC encoder (latent_dim) ; HuBERT -> semantic encoder] -> fc
    (hidden_dim) -> RVQ encode; `codec` is the decode config it shares the quantizers with."""

    codec: CodecConfig
    encoder_channels: int
    downsampling_ratios: tuple[int, ...]
    hubert: HubertConfig
    semantic_sample_rate: int
    semantic_downsample: int  # HuBERT steps per codec frame (2: 50 Hz -> 25 Hz)
    semantic_kernel: int
    channel_ratios: tuple[float, ...]
    strides: tuple[int, ...]
    block_dilations: tuple[int, ...]
    unit_kernel: int

    def __post_init__(self):
        codec = self.codec
        if math.prod(self.downsampling_ratios) != codec.hop_length:
            raise ValueError(f"codec config: downsampling_ratios {list(self.downsampling_ratios)} do not give the "
                             f"hop length {codec.hop_length}")
        if len(self.strides) != len(self.channel_ratios):
            raise ValueError("codec config: semantic strides and channel_ratios differ in length")
        semantic_out = int(self.hubert.hidden_size * self.channel_ratios[-1])
        if codec.latent_dim + semantic_out != codec.hidden_dim:
            raise ValueError(f"codec config: acoustic {codec.latent_dim} + semantic {semantic_out} channels do not "
                             f"make the quantizer width {codec.hidden_dim}")
        if self.semantic_downsample < 1:
            raise ValueError(f"codec config: the semantic rate is below the frame rate "
                             f"(downsample {self.semantic_downsample})")

    @classmethod
    def from_dict(cls, raw: dict) -> "EncodeConfig":
        codec = CodecConfig.from_dict(raw)
        if codec.layout == "transformers":
            top = {**_TF_ENCODE_DEFAULTS, **raw}
            acoustic = {**_TF_ACOUSTIC_DEFAULTS, "encoder_hidden_size": _BOSON_ENCODER_CHANNELS,
                        **(raw.get("acoustic_model_config") or {})}
            channels, ratios = acoustic["encoder_hidden_size"], acoustic["downsampling_ratios"]
            hubert = HubertConfig.from_dict(raw.get("semantic_model_config"))
        else:
            top = {**_TF_ENCODE_DEFAULTS, "semantic_sample_rate": raw.get("semantic_sample_rate", 16000)}
            channels, ratios = raw.get("encoder_channels", _BOSON_ENCODER_CHANNELS), raw["ratios"]
            hubert = HubertConfig.from_dict(raw.get("semantic_model_config"))
        # transformers' semantic_downsample_factor: HuBERT frames (one per `downsample_factor` samples at the
        # semantic rate) per codec frame
        per_frame = codec.hop_length / (codec.sample_rate / top["semantic_sample_rate"]) / top["downsample_factor"]
        return cls(codec, channels, tuple(ratios), hubert, top["semantic_sample_rate"], int(per_frame),
                   top["kernel_size"], tuple(top["channel_ratios"]), tuple(top["strides"]),
                   tuple(top["block_dilations"]), top["unit_kernel_size"])

    @classmethod
    def from_dir(cls, path: str | Path) -> "EncodeConfig":
        file = Path(path) / "config.json"
        CodecConfig.from_dir(path)  # the same errors as the decode path
        try:
            return cls.from_dict(read_config(path, "codec config"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{file}: {e}") from None
