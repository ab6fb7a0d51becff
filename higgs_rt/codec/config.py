"""Typed configuration of the codec, read from either checkpoint layout's config.json: `CodecConfig` (the decode
path) and `EncodeConfig` (the encode path, for voice cloning: DAC encoder, HuBERT, semantic encoder).

- transformers (`model_type: higgs_audio_v2_tokenizer`): the DAC decoder in `acoustic_model_config`; the number of
  quantizers is derived from `target_bandwidths` exactly as transformers does.
- Boson (bosonai/higgs-audio-v2-tokenizer): flat `ratios`, `n_q`, `bins`, `D`, `codebook_dim`. Boson's code fixes
  the decoder width (1024) and the semantic width (768); the optional keys `decoder_channels` and `semantic_dim`
  (higgs-rt's, written only by the tiny test fixture) override them; likewise `encoder_channels` (DAC encoder,
  64) and `semantic_model_config` (HuBERT base, as transformers' conversion assumes).

A field of the wrong type or out of range is a `higgs_rt.config.ConfigError` naming it (the Talker config's
error and checks: `from_dir` adds the file), never a TypeError or an arithmetic error from the shapes derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from higgs_rt.config import MAX_INT, ConfigError, config_float, config_size, read_config, short_value
from higgs_rt.resample import MAX_KERNEL_TAPS, MAX_RATE, MIN_RATE, filter_bank_taps

WHERE = "codec config"
TRANSFORMERS_MODEL_TYPE = "higgs_audio_v2_tokenizer"
BOSON_KEYS = ("ratios", "n_q", "bins", "D")

# Defaults transformers fills in for fields a config.json leaves out.
_TF_ACOUSTIC_DEFAULTS = {"downsampling_ratios": [8, 5, 4, 2], "upsampling_ratios": [8, 5, 4, 2],
                         "decoder_hidden_size": 1024, "hidden_size": 256}
_TF_DEFAULTS = {"sample_rate": 24000, "codebook_size": 1024, "codebook_dim": 64,
                "target_bandwidths": [0.5, 1, 1.5, 2, 4]}
_SEMANTIC_DIM = 768
_BOSON_DECODER_CHANNELS = 1024


def _positive(value, name: str) -> int:
    """A field that must be an integer in [1, MAX_INT]; else a ConfigError naming it."""
    return config_size(value, name, WHERE)


def _sample_rate(value, name: str = "sample_rate") -> int:
    """An output sample rate, in [MIN_RATE, MAX_RATE] Hz (8 kHz to 192 kHz: 2 Hz wrote a 24-minute WAV of a
    sentence); else a ConfigError naming it."""
    rate = _positive(value, name)
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ConfigError(f"{WHERE}: {name} must be from {MIN_RATE} to {MAX_RATE} Hz, got {rate}")
    return rate


def _list(value, name: str, item) -> tuple:
    """A field that must be a non-empty list, each item read by `item(value, name)`."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{WHERE}: {name} must be a non-empty list, got {short_value(value)}")
    return tuple(item(v, name) for v in value)


def _ratio(value, name: str) -> float:
    number = config_float(value, name, WHERE)
    if not 0 < number <= MAX_INT:
        raise ConfigError(f"{WHERE}: {name} must be in (0, {MAX_INT}], got {short_value(value)}")
    return number


def _epsilon(value, name: str) -> float:
    """A norm's epsilon, in (0, 1): a larger one (1e300 is inf in fp32) zeroes every activation, as the Talker's."""
    number = config_float(value, name, WHERE)
    if not 0 < number < 1:
        raise ConfigError(f"{WHERE}: {name} must be in (0, 1), got {short_value(value)}")
    return number


def _object(value, name: str) -> dict:
    """A field that must be a JSON object (absent or null: empty)."""
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{WHERE}: {name} must be an object, got {short_value(value)}")
    return value or {}


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{WHERE}: {name} must be true or false, got {short_value(value)}")
    return value


def _from_file(path: str | Path, parse):
    """`parse` of the codec's config.json; a ConfigError names the file."""
    file = Path(path) / "config.json"
    raw = read_config(path, WHERE)
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


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
                raise ConfigError(f"{WHERE}: {name} must be a positive integer, got {value!r}")
        if not self.upsampling_ratios or any(not isinstance(r, int) or r < 1 for r in self.upsampling_ratios):
            raise ConfigError(f"{WHERE}: ratios must be positive integers, got {self.upsampling_ratios!r}")
        if self.decoder_channels % 2 ** len(self.upsampling_ratios):
            raise ConfigError(
                f"{WHERE}: decoder width {self.decoder_channels} must halve {len(self.upsampling_ratios)} times"
            )

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsampling_ratios)

    @classmethod
    def from_dict(cls, raw: dict) -> "CodecConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{WHERE} must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type == TRANSFORMERS_MODEL_TYPE:
            return cls._from_transformers(raw)
        if model_type is None and all(k in raw for k in BOSON_KEYS):
            return cls._from_boson(raw)
        raise ConfigError(
            f"not a Higgs-Audio v2 codec config (model_type={short_value(model_type)}): expected model_type "
            f"{TRANSFORMERS_MODEL_TYPE!r} or Boson's keys {', '.join(BOSON_KEYS)}"
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "CodecConfig":
        return _from_file(path, cls.from_dict)

    @classmethod
    def _from_transformers(cls, raw: dict) -> "CodecConfig":
        top = {**_TF_DEFAULTS, **raw}
        acoustic = {**_TF_ACOUSTIC_DEFAULTS, **_object(raw.get("acoustic_model_config"), "acoustic_model_config")}
        semantic = _object(raw.get("semantic_model_config"), "semantic_model_config")
        semantic_dim = _positive(semantic.get("hidden_size", _SEMANTIC_DIM), "semantic_model_config.hidden_size")
        up = _list(acoustic["upsampling_ratios"], "acoustic_model_config.upsampling_ratios", _positive)
        down = _list(acoustic["downsampling_ratios"], "acoustic_model_config.downsampling_ratios", _positive)
        if math.prod(up) != math.prod(down):
            raise ConfigError(f"{WHERE}: upsampling_ratios {list(up)} and downsampling_ratios {list(down)} give "
                              "different hop lengths")
        sample_rate = _sample_rate(top["sample_rate"])
        codebook_size = _positive(top["codebook_size"], "codebook_size")
        if codebook_size < 2:
            raise ConfigError(f"{WHERE}: codebook_size must be >= 2, got {codebook_size}")
        bandwidth = _list(top["target_bandwidths"], "target_bandwidths", _ratio)[-1]
        bits_per_frame = -(-sample_rate // math.prod(down)) * math.ceil(math.log2(codebook_size))
        latent = _positive(acoustic["hidden_size"], "acoustic_model_config.hidden_size")
        return cls(
            layout="transformers",
            sample_rate=sample_rate,
            upsampling_ratios=up,
            decoder_channels=_positive(acoustic["decoder_hidden_size"], "acoustic_model_config.decoder_hidden_size"),
            latent_dim=latent,
            hidden_dim=latent + semantic_dim,
            codebook_dim=_positive(top["codebook_dim"], "codebook_dim"),
            codebook_size=codebook_size,
            num_quantizers=int(1000 * bandwidth // bits_per_frame),
        )

    @classmethod
    def _from_boson(cls, raw: dict) -> "CodecConfig":
        if isinstance(raw["bins"], list):
            raise ConfigError(f"{WHERE}: bins={short_value(raw['bins'])}: only the RVQ codec (integer bins) is "
                              "supported, not RFSQ")
        latent = _positive(raw["D"], "D")
        hidden = (latent + _positive(raw.get("semantic_dim", _SEMANTIC_DIM), "semantic_dim")) // \
            _positive(raw.get("vq_scale", 1), "vq_scale")
        return cls(
            layout="boson",
            sample_rate=_sample_rate(raw.get("sample_rate", 24000)),
            upsampling_ratios=_list(raw["ratios"], "ratios", _positive),
            decoder_channels=_positive(raw.get("decoder_channels", _BOSON_DECODER_CHANNELS), "decoder_channels"),
            latent_dim=latent,
            hidden_dim=hidden,
            # None (no projection) is not a released codec: rejected
            codebook_dim=_positive(raw.get("codebook_dim"), "codebook_dim"),
            codebook_size=_positive(raw["bins"], "bins"),
            num_quantizers=_positive(raw["n_q"], "n_q"),
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
        c = {**_HUBERT_BASE, **_object(raw, "semantic_model_config")}
        for key, want in _HUBERT_FIXED.items():
            if c.get(key, want) != want:
                raise ConfigError(f"{WHERE}: semantic model: {key}={short_value(c[key])} is not supported (HuBERT base "
                                  f"has {short_value(want)})")
        ints = {k: _positive(c[k], f"semantic_model_config.{k}") for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_conv_pos_embeddings",
            "num_conv_pos_embedding_groups")}
        conv = [_list(c[k], f"semantic_model_config.{k}", _positive)
                for k in ("conv_dim", "conv_kernel", "conv_stride")]
        if not len(conv[0]) == len(conv[1]) == len(conv[2]):
            raise ConfigError(f"{WHERE}: semantic model: conv_dim, conv_kernel and conv_stride differ in length")
        if ints["hidden_size"] % ints["num_attention_heads"]:
            raise ConfigError(f"{WHERE}: semantic model: hidden_size {ints['hidden_size']} is not a multiple of "
                              f"num_attention_heads {ints['num_attention_heads']}")
        return cls(ints["hidden_size"], ints["num_hidden_layers"], ints["num_attention_heads"],
                   ints["intermediate_size"], *conv, _flag(c["conv_bias"], "semantic_model_config.conv_bias"),
                   ints["num_conv_pos_embeddings"], ints["num_conv_pos_embedding_groups"],
                   _epsilon(c["layer_norm_eps"], "semantic_model_config.layer_norm_eps"),
                   _flag(c["feat_proj_layer_norm"], "semantic_model_config.feat_proj_layer_norm"))


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
            raise ConfigError(f"{WHERE}: downsampling_ratios {list(self.downsampling_ratios)} do not give the "
                              f"hop length {codec.hop_length}")
        if len(self.strides) != len(self.channel_ratios):
            raise ConfigError(f"{WHERE}: semantic strides and channel_ratios differ in length")
        semantic_out = int(self.hubert.hidden_size * self.channel_ratios[-1])
        if codec.latent_dim + semantic_out != codec.hidden_dim:
            raise ConfigError(f"{WHERE}: acoustic {codec.latent_dim} + semantic {semantic_out} channels do not "
                              f"make the quantizer width {codec.hidden_dim}")
        if self.semantic_downsample < 1:
            raise ConfigError(f"{WHERE}: the semantic rate is below the frame rate "
                              f"(downsample {self.semantic_downsample})")
        # HuBERT's features (one per prod(conv_stride) samples at the semantic rate, every semantic_downsample-th
        # kept, the semantic encoder's strides after) must come at the codec's frame rate, sample_rate / hop
        semantic_hop = math.prod(self.hubert.conv_stride) * self.semantic_downsample * math.prod(self.strides)
        if codec.sample_rate * semantic_hop != codec.hop_length * self.semantic_sample_rate:
            raise ConfigError(
                f"{WHERE}: semantic features at {self.semantic_sample_rate} / {semantic_hop} Hz (semantic_sample_rate, "
                f"semantic_model_config.conv_stride, downsample_factor, strides) do not come at the frame rate "
                f"{codec.sample_rate} / {codec.hop_length} Hz")
        if codec.sample_rate != self.semantic_sample_rate and \
                filter_bank_taps(codec.sample_rate, self.semantic_sample_rate) > MAX_KERNEL_TAPS:
            raise ConfigError(f"{WHERE}: resampling sample_rate {codec.sample_rate} to semantic_sample_rate "
                              f"{self.semantic_sample_rate} needs a filter bank past {MAX_KERNEL_TAPS} taps")

    @classmethod
    def from_dict(cls, raw: dict) -> "EncodeConfig":
        codec = CodecConfig.from_dict(raw)
        if codec.layout == "transformers":
            top = {**_TF_ENCODE_DEFAULTS, **raw}
            acoustic = {**_TF_ACOUSTIC_DEFAULTS, "encoder_hidden_size": _BOSON_ENCODER_CHANNELS,
                        **_object(raw.get("acoustic_model_config"), "acoustic_model_config")}
            channels = _positive(acoustic["encoder_hidden_size"], "acoustic_model_config.encoder_hidden_size")
            ratios = _list(acoustic["downsampling_ratios"], "acoustic_model_config.downsampling_ratios", _positive)
        else:
            top = {**_TF_ENCODE_DEFAULTS, "semantic_sample_rate": raw.get("semantic_sample_rate", 16000)}
            channels = _positive(raw.get("encoder_channels", _BOSON_ENCODER_CHANNELS), "encoder_channels")
            ratios = _list(raw["ratios"], "ratios", _positive)
        hubert = HubertConfig.from_dict(raw.get("semantic_model_config"))
        semantic_rate = _positive(top["semantic_sample_rate"], "semantic_sample_rate")
        # transformers' semantic_downsample_factor: HuBERT frames (one per `downsample_factor` samples at the
        # semantic rate) per codec frame
        downsample = _positive(top["downsample_factor"], "downsample_factor")
        per_frame = codec.hop_length / (codec.sample_rate / semantic_rate) / downsample
        return cls(codec, channels, ratios, hubert, semantic_rate, int(per_frame),
                   _positive(top["kernel_size"], "kernel_size"),
                   _list(top["channel_ratios"], "channel_ratios", _ratio),
                   _list(top["strides"], "strides", _positive),
                   _list(top["block_dilations"], "block_dilations", _positive),
                   _positive(top["unit_kernel_size"], "unit_kernel_size"))

    @classmethod
    def from_dir(cls, path: str | Path) -> "EncodeConfig":
        CodecConfig.from_dir(path)  # the same errors as the decode path
        return _from_file(path, cls.from_dict)
