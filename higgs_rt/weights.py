"""Talker weights: safetensors (one file or shards + index), memory-mapped, both layouts, strict.

Both checkpoint layouts are renamed to one core naming, then mapped onto higgs-rt's parameters with
q/k/v and gate/up fused at load. The 128k-word text head is never needed to speak and is skipped by name;
any other key that higgs-rt does not know, and any key it needs that is absent, is an error that lists them.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open

from .config import TalkerConfig

# Never needed to generate speech: the text head (both spellings), the audio-understanding tower, and
# buffers the original files carry.
SKIPPED = re.compile(
    r"^(model\.)?(audio_decoder_proj\.)?text_lm_head\.(weight|linear_frozen\.weight|linear_trainable\.weight)$"
    r"|^(audio_tower|audio_encoder_proj)\."
    r"|(rotary_emb\.inv_freq|rotary_emb\.original_inv_freq|audio_codebook_weights)$"
)

# Boson's partially frozen modules store one matrix as two row blocks.
SPLIT = {
    "embed_tokens.weight": ("embed_tokens.embedding_frozen.weight", "embed_tokens.embedding_trainable.weight"),
    "audio_lm_head.weight": ("audio_decoder_proj.audio_lm_head.linear_frozen.weight",
                             "audio_decoder_proj.audio_lm_head.linear_trainable.weight"),
}

GLOBAL = {
    "tok_embeddings": ("embed_tokens.weight",),
    "audio_embeddings": ("audio_codebook_embeddings.weight",),
    "norm": ("norm.weight",),
    "audio_head": ("audio_lm_head.weight",),
}

PER_LAYER = {
    "attn_norm": ("input_layernorm.weight",),
    "audio_attn_norm": ("audio_input_layernorm.weight",),
    "ffn_norm": ("post_attention_layernorm.weight",),
    "audio_ffn_norm": ("audio_post_attention_layernorm.weight",),
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "ffn.w13": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "ffn.w2": ("mlp.down_proj.weight",),
    "audio_ffn.w13": ("audio_mlp.gate_proj.weight", "audio_mlp.up_proj.weight"),
    "audio_ffn.w2": ("audio_mlp.down_proj.weight",),
}


class WeightsError(ValueError):
    """A checkpoint that does not match its config, with the offending keys named."""


def core_name(key: str) -> str:
    """One naming for both layouts: Boson's, i.e. transformers' without `model.`, audio parts renamed."""
    key = key.removeprefix("model.")
    key = key.replace("embed_audio_tokens.embed_audio_tokens.", "audio_codebook_embeddings.")
    return "audio_lm_head.weight" if key == "audio_decoder_proj.audio_lm_head.weight" else key


def source_names(cfg: TalkerConfig) -> dict[str, tuple[str, ...]]:
    """higgs-rt parameter name -> the core names concatenated (along rows) to make it."""
    names = dict(GLOBAL)
    for i in range(cfg.num_layers):
        names.update({f"layers.{i}.{k}": tuple(f"layers.{i}.{s}" for s in v) for k, v in PER_LAYER.items()})
    return names


def expected_shapes(cfg: TalkerConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    shapes = {
        "tok_embeddings": (cfg.vocab_size, h),
        "audio_embeddings": (cfg.num_codebooks * cfg.codebook_vocab, h),
        "norm": (h,),
        "audio_head": (cfg.num_codebooks * cfg.codebook_vocab, h),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({p + n: (h,) for n in ("attn_norm", "audio_attn_norm", "ffn_norm", "audio_ffn_norm")})
        shapes.update({p + "wqkv": (qkv, h), p + "wo": (h, cfg.num_heads * d),
                       p + "ffn.w13": (2 * cfg.intermediate_size, h), p + "ffn.w2": (h, cfg.intermediate_size),
                       p + "audio_ffn.w13": (2 * cfg.audio_intermediate_size, h),
                       p + "audio_ffn.w2": (h, cfg.audio_intermediate_size)})
    return shapes


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"weights: {index} is not a safetensors index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"weights: no *.safetensors in {model_dir}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise WeightsError(f"weights: shard(s) named by the index are missing: {', '.join(missing)}")
    return files


def _listing(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_talker_weights(model_dir: str | Path, cfg: TalkerConfig, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", progress: bool = False) -> dict[str, torch.Tensor]:
    """Read a checkpoint directory (memory-mapped), then `map_weights`."""
    with ExitStack() as stack:
        tensors: dict[str, Callable[[], torch.Tensor]] = {}
        for path in checkpoint_files(model_dir):
            try:
                f = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for a corrupt header
                raise WeightsError(f"weights: cannot read {path}: {e}") from None
            tensors.update({key: partial(f.get_tensor, key) for key in f.keys()})
        return map_weights(tensors, cfg, dtype, device, progress, where=str(model_dir))


def map_weights(tensors: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]], cfg: TalkerConfig,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", progress: bool = False,
                where: str = "the state dict") -> dict[str, torch.Tensor]:
    """Checkpoint keys of either layout (values: tensors, or callables that read them) -> higgs-rt parameters.

    Renames, checks the key set and every shape against the config, casts and fuses.
    """
    found: dict[str, str] = {}  # core name -> checkpoint key
    for key in tensors:
        if not SKIPPED.search(key):
            found.setdefault(core_name(key), key)  # a head stored under both names: one copy

    def read(name: str) -> torch.Tensor:
        if name not in found:
            return torch.cat([read(p) for p in SPLIT[name]], dim=0)
        value = tensors[found[name]]
        return value() if callable(value) else value

    wanted = source_names(cfg)
    needed = {n for parts in wanted.values() for n in parts}
    used_split = {p for n in needed if n not in found and n in SPLIT for p in SPLIT[n]}
    available = set(found) | {n for n, parts in SPLIT.items() if all(p in found for p in parts)}
    missing = needed - available
    unexpected = set(found) - needed - used_split
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s): {_listing(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} key(s): {_listing(unexpected)}")
        raise WeightsError(f"weights in {where} do not match the config: " + "; ".join(problems))

    from tqdm.auto import tqdm

    shapes = expected_shapes(cfg)
    out = {}
    for name, parts in tqdm(wanted.items(), desc="loading weights", unit="tensor", disable=not progress,
                            leave=False):
        pieces = [read(p).to(device=device, dtype=dtype) for p in parts]
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        if tuple(t.shape) != shapes[name]:
            raise WeightsError(f"weights: {'+'.join(parts)} has shape {tuple(t.shape)}, the config implies "
                               f"{shapes[name]}")
        out[name] = t
    return out
