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


MAX_INT = 2**31 - 1  # the largest size or id a config may give: far above any model's, and torch's int32 index range


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
            value = getattr(self, name)
            need(1 <= value <= MAX_INT, f"config: {name} must be an integer in [1, {MAX_INT}], got {short_value(value)}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"config: num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads "
             f"({self.num_kv_heads})")
        need(self.head_dim % 2 == 0, f"config: head_dim must be even for RoPE, got {self.head_dim}")
        need((self.stream_bos_id, self.stream_eos_id) == (self.num_codes, self.num_codes + 1),
             f"config: stream BOS/EOS ids must be {self.num_codes}/{self.num_codes + 1} (right after the "
             f"{self.num_codes} real codes), got {self.stream_bos_id}/{self.stream_eos_id}")
        for name, token in (("audio_token_id", self.audio_out_token_id), ("audio_delay_token_id",
                                                                          self.audio_delay_token_id)):
            need(token is None or 0 <= token < self.vocab_size,
                 f"config: {name} {short_value(token)} is not a token id of the {self.vocab_size}-token vocabulary")
        # an epsilon: 1e300 is inf in fp32 and zeroes every activation
        need(0 < self.rms_norm_eps < 1, f"config: rms_norm_eps must be in (0, 1), got {short_value(self.rms_norm_eps)}")
        # RoPE's base: at or below 1 the frequencies theta^(-2i/d) grow (to inf: NaN rotations) instead of falling
        need(self.rope_theta > 1, f"config: rope_theta must be above 1, got {short_value(self.rope_theta)}")
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
        """The directory's config.json; a bad field's ConfigError names the file, as the codec config's do."""
        raw = read_config(model_dir)
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{Path(model_dir) / 'config.json'}: {e}") from None


def read_config(directory: str | Path, what: str = "config") -> dict:
    """A checkpoint directory's config.json; absent or not JSON is a ConfigError saying which."""
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{what}: no config.json in {directory}") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
        raise ConfigError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{what}: {path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def config_int(value, name: str, where: str = "config") -> int:
    """A config field that must be an integer (an integral float is taken); else a ConfigError naming it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {name} must be an integer, got {short_value(value)}")
    return value


def config_size(value, name: str, where: str = "config") -> int:
    """A config field that must be an integer in [1, MAX_INT] (a size, a count, a rate); else a ConfigError naming
    it."""
    number = config_int(value, name, where)
    if not 1 <= number <= MAX_INT:
        raise ConfigError(f"{where}: {name} must be an integer in [1, {MAX_INT}], got {short_value(value)}")
    return number


def config_float(value, name: str, where: str = "config") -> float:
    """A config field that must be a finite number; else a ConfigError naming it."""
    number = math.nan if isinstance(value, bool) or not isinstance(value, (int, float)) else \
        math.inf if isinstance(value, int) and value.bit_length() > 1000 else float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{where}: {name} must be a finite number, got {short_value(value)}")
    return number


def short_value(value) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, list, dict, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rope(params: dict | None, where: str) -> RopeScaling | None:
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {short_value(params)}")
    if not params or params.get("rope_type", params.get("type")) in (None, "default"):
        return None
    kind = params.get("rope_type", params.get("type"))
    if kind != "llama3":
        raise ConfigError(f"config: rope type {kind!r} is not supported (Higgs-Audio v2 uses 'llama3')")
    try:
        floats = (config_float(params[k], f"rope {k}", where) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        scaling = RopeScaling(*floats, config_int(params["original_max_position_embeddings"],
                                                  "rope original_max_position_embeddings", where))
    except KeyError as e:
        raise ConfigError(f"{where}: llama3 rope parameters lack {e.args[0]!r}") from None
    # factor >= 1 (transformers' llama3 domain): below it, 1e-320 say, the divided frequencies overflow to inf
    if not (scaling.factor >= 1 and 0 < scaling.low_freq_factor < scaling.high_freq_factor
            and 0 < scaling.original_max_position_embeddings <= MAX_INT):
        raise ConfigError(f"{where}: llama3 rope parameters need factor >= 1, 0 < low_freq_factor < high_freq_factor "
                          f"and original_max_position_embeddings in [1, {MAX_INT}], got {short_value(params)}")
    return scaling


def _require(cfg: dict, key: str, where: str = "config"):
    if key not in cfg:
        raise ConfigError(f"{where}: missing field {key!r}")
    return cfg[key]


def _require_int(cfg: dict, key: str, where: str = "config") -> int:
    return config_int(_require(cfg, key, where), key, where)


def _require_size(cfg: dict, key: str, where: str = "config") -> int:
    return config_size(_require(cfg, key, where), key, where)


def _llama_body(t: dict, where: str) -> dict:
    hidden, heads = _require_size(t, "hidden_size", where), _require_size(t, "num_attention_heads", where)
    rope = t.get("rope_parameters") or t.get("rope_scaling")
    rope_scaling = _rope(rope, where)
    theta = (t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))
    return dict(
        hidden_size=hidden,
        num_layers=_require_size(t, "num_hidden_layers", where),
        num_heads=heads,
        # absent or null: Llama's defaults; 0 is a value (rejected), not a default
        num_kv_heads=config_size(_default(t, "num_key_value_heads", heads), "num_key_value_heads", where),
        head_dim=config_size(_default(t, "head_dim", hidden // heads), "head_dim", where),
        intermediate_size=_require_size(t, "intermediate_size", where),
        vocab_size=_require_size(t, "vocab_size", where),
        rms_norm_eps=config_float(t.get("rms_norm_eps", 1e-5), "rms_norm_eps", where),
        rope_theta=config_float(theta, "rope_theta", where),
        rope_scaling=rope_scaling,
    )


def _default(t: dict, key: str, default):
    return default if t.get(key) is None else t[key]


def _no_bias(t: dict, where: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if t.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported (Higgs-Audio v2 has no biases)")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {t.get('hidden_act')!r} is not supported (expected 'silu')")


def _from_transformers(cfg: dict) -> TalkerConfig:
    _no_bias(cfg, "config")
    body = _llama_body(cfg, "config")
    vocab = _require_size(cfg, "codebook_size")
    if vocab < 3:
        raise ConfigError(f"config: codebook_size must count the real codes plus stream BOS and EOS, got {vocab}")
    return TalkerConfig(
        **body,
        audio_intermediate_size=body["intermediate_size"],
        num_codebooks=_require_size(cfg, "num_codebooks"),
        num_codes=vocab - 2,
        stream_bos_id=config_int(cfg.get("audio_stream_bos_id", vocab - 2), "audio_stream_bos_id"),
        stream_eos_id=config_int(cfg.get("audio_stream_eos_id", vocab - 1), "audio_stream_eos_id"),
        audio_out_token_id=_require_int(cfg, "audio_token_id"),
        audio_delay_token_id=None if cfg.get("audio_delay_token_id") is None else
        config_int(cfg["audio_delay_token_id"], "audio_delay_token_id"),
        layout="transformers",
        extra=cfg,
    )


def _from_boson(cfg: dict) -> TalkerConfig:
    text = _require(cfg, "text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config: text_config must be an object, got {short_value(text)}")
    _no_bias(text, "config.text_config")
    body = _llama_body(text, "config.text_config")
    adapter = cfg.get("audio_adapter_type")
    if adapter not in ("dual_ffn", "dual_ffn_fast_forward"):
        raise ConfigError(f"config: audio_adapter_type {adapter!r} is not supported (expected a DualFFN adapter)")
    layers = cfg.get("audio_dual_ffn_layers")
    if layers is not None and (not isinstance(layers, list) or len(layers) != body["num_layers"]  # before range()
                               or not all(type(i) is int for i in layers)
                               or sorted(layers) != list(range(body["num_layers"]))):
        raise ConfigError("config: audio_dual_ffn_layers must list every layer (a DualFFN in each layer)")
    for flag in ("use_audio_out_self_attention", "use_rq_transformer", "use_audio_out_embed_projector"):
        if cfg.get(flag):
            raise ConfigError(f"config: {flag}=true is not supported by higgs-rt")
    if cfg.get("audio_decoder_proj_num_layers", 0):
        raise ConfigError("config: audio_decoder_proj_num_layers > 0 is not supported by higgs-rt")
    if not cfg.get("use_delay_pattern", True):
        raise ConfigError("config: use_delay_pattern=false is not supported (Higgs-Audio v2 uses the delay pattern)")
    ffn_hidden = config_size(cfg.get("audio_ffn_hidden_size", body["hidden_size"]), "audio_ffn_hidden_size")
    if ffn_hidden != body["hidden_size"]:
        raise ConfigError(f"config: audio_ffn_hidden_size {ffn_hidden} differs from hidden_size {body['hidden_size']}")
    codes = _require_size(cfg, "audio_codebook_size")
    return TalkerConfig(
        **body,
        audio_intermediate_size=config_size(cfg.get("audio_ffn_intermediate_size", body["intermediate_size"]),
                                            "audio_ffn_intermediate_size"),
        num_codebooks=_require_size(cfg, "audio_num_codebooks"),
        num_codes=codes,
        stream_bos_id=config_int(cfg.get("audio_stream_bos_id", codes), "audio_stream_bos_id"),
        stream_eos_id=config_int(cfg.get("audio_stream_eos_id", codes + 1), "audio_stream_eos_id"),
        audio_out_token_id=_require_int(cfg, "audio_out_token_idx"),
        audio_delay_token_id=None,
        layout="boson",
        extra=cfg,
    )
