"""Typed configuration of the Talker, read from a model directory's config.json.

Two layouts exist for the same model:
- transformers (`model_type: higgs_audio_v2`): flat fields, `codebook_size` counts the two stream ids (1026);
- original Boson (`model_type: higgs_audio`): a Llama `text_config` plus `audio_*` fields, where
  `audio_codebook_size` counts only the real codes (1024).
Both are normalised to one `TalkerConfig`. The codec's config lives with the codec (`higgs_rt.codec`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that higgs-rt cannot run, with the reason in one line."""


@dataclass(frozen=True)
class RopeScaling:
    """llama3 frequency scaling; the two spellings of the same factors give identical frequencies."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class TalkerConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    audio_intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    num_codebooks: int
    num_codes: int  # real codes per codebook; the stream ids follow them
    stream_bos_id: int
    stream_eos_id: int
    audio_out_token_id: int  # <|AUDIO_OUT|>: an audio position in a prompt
    audio_delay_token_id: int | None  # transformers writes it for delayed reference frames: also audio
    layout: str = "transformers"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def codebook_vocab(self) -> int:
        """Rows per codebook in the audio embedding and head: the real codes plus stream BOS and EOS."""
        return self.num_codes + 2

    @property
    def audio_token_ids(self) -> tuple[int, ...]:
        ids = (self.audio_out_token_id, self.audio_delay_token_id)
        return tuple(i for i in ids if i is not None)

    def validate(self) -> "TalkerConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "audio_intermediate_size", "vocab_size", "num_codebooks", "num_codes"):
            need(int(getattr(self, name)) > 0, f"config: {name} must be positive, got {getattr(self, name)}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"config: num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads "
             f"({self.num_kv_heads})")
        need(self.head_dim % 2 == 0, f"config: head_dim must be even for RoPE, got {self.head_dim}")
        need((self.stream_bos_id, self.stream_eos_id) == (self.num_codes, self.num_codes + 1),
             f"config: stream BOS/EOS ids must be {self.num_codes}/{self.num_codes + 1} (right after the "
             f"{self.num_codes} real codes), got {self.stream_bos_id}/{self.stream_eos_id}")
        need(self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps), "config: rms_norm_eps must be positive")
        return self

    # ---- reading ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict) -> "TalkerConfig":
        kind = cfg.get("model_type")
        if kind == "higgs_audio_v2":
            return _from_transformers(cfg).validate()
        if kind == "higgs_audio":
            return _from_boson(cfg).validate()
        raise ConfigError(
            f"config: model_type {kind!r} is not a Higgs-Audio v2 Talker (expected 'higgs_audio_v2' or 'higgs_audio')")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TalkerConfig":
        return cls.from_dict(read_config(model_dir))


def read_config(directory: str | Path, what: str = "config") -> dict:
    """A checkpoint directory's config.json; absent or not JSON is a ConfigError saying which."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what}: no config.json in {directory}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: {path} is not valid JSON ({e})") from None


def _rope(params: dict | None) -> RopeScaling | None:
    if not params or params.get("rope_type", params.get("type")) in (None, "default"):
        return None
    kind = params.get("rope_type", params.get("type"))
    if kind != "llama3":
        raise ConfigError(f"config: rope type {kind!r} is not supported (Higgs-Audio v2 uses 'llama3')")
    try:
        return RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                           float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"config: llama3 rope parameters lack {e.args[0]!r}") from None


def _require(cfg: dict, key: str, where: str = "config"):
    if key not in cfg:
        raise ConfigError(f"{where}: missing field {key!r}")
    return cfg[key]


def _llama_body(t: dict, where: str) -> dict:
    hidden, heads = int(_require(t, "hidden_size", where)), int(_require(t, "num_attention_heads", where))
    rope = t.get("rope_parameters") or t.get("rope_scaling")
    theta = (t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))
    return dict(
        hidden_size=hidden,
        num_layers=int(_require(t, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(t, "intermediate_size", where)),
        vocab_size=int(_require(t, "vocab_size", where)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=_rope(rope),
    )


def _no_bias(t: dict, where: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if t.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported (Higgs-Audio v2 has no biases)")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {t.get('hidden_act')!r} is not supported (expected 'silu')")


def _from_transformers(cfg: dict) -> TalkerConfig:
    _no_bias(cfg, "config")
    body = _llama_body(cfg, "config")
    vocab = int(_require(cfg, "codebook_size"))
    if vocab < 3:
        raise ConfigError(f"config: codebook_size must count the real codes plus stream BOS and EOS, got {vocab}")
    return TalkerConfig(
        **body,
        audio_intermediate_size=body["intermediate_size"],
        num_codebooks=int(_require(cfg, "num_codebooks")),
        num_codes=vocab - 2,
        stream_bos_id=int(cfg.get("audio_stream_bos_id", vocab - 2)),
        stream_eos_id=int(cfg.get("audio_stream_eos_id", vocab - 1)),
        audio_out_token_id=int(_require(cfg, "audio_token_id")),
        audio_delay_token_id=cfg.get("audio_delay_token_id"),
        layout="transformers",
        extra=cfg,
    )


def _from_boson(cfg: dict) -> TalkerConfig:
    text = _require(cfg, "text_config")
    _no_bias(text, "config.text_config")
    body = _llama_body(text, "config.text_config")
    adapter = cfg.get("audio_adapter_type")
    if adapter not in ("dual_ffn", "dual_ffn_fast_forward"):
        raise ConfigError(f"config: audio_adapter_type {adapter!r} is not supported (expected a DualFFN adapter)")
    layers = cfg.get("audio_dual_ffn_layers")
    if layers is not None and sorted(layers) != list(range(body["num_layers"])):
        raise ConfigError("config: audio_dual_ffn_layers must list every layer (a DualFFN in each layer)")
    for flag in ("use_audio_out_self_attention", "use_rq_transformer", "use_audio_out_embed_projector"):
        if cfg.get(flag):
            raise ConfigError(f"config: {flag}=true is not supported by higgs-rt")
    if cfg.get("audio_decoder_proj_num_layers", 0):
        raise ConfigError("config: audio_decoder_proj_num_layers > 0 is not supported by higgs-rt")
    if not cfg.get("use_delay_pattern", True):
        raise ConfigError("config: use_delay_pattern=false is not supported (Higgs-Audio v2 uses the delay pattern)")
    ffn_hidden = int(cfg.get("audio_ffn_hidden_size", body["hidden_size"]))
    if ffn_hidden != body["hidden_size"]:
        raise ConfigError(f"config: audio_ffn_hidden_size {ffn_hidden} differs from hidden_size {body['hidden_size']}")
    codes = int(_require(cfg, "audio_codebook_size"))
    return TalkerConfig(
        **body,
        audio_intermediate_size=int(cfg.get("audio_ffn_intermediate_size", body["intermediate_size"])),
        num_codebooks=int(_require(cfg, "audio_num_codebooks")),
        num_codes=codes,
        stream_bos_id=int(cfg.get("audio_stream_bos_id", codes)),
        stream_eos_id=int(cfg.get("audio_stream_eos_id", codes + 1)),
        audio_out_token_id=int(_require(cfg, "audio_out_token_idx")),
        audio_delay_token_id=None,
        layout="boson",
        extra=cfg,
    )
