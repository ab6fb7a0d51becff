"""Talker weights: safetensors (one file or shards + index), memory-mapped, both layouts, strict.

Both checkpoint layouts are renamed to one core naming, then mapped onto higgs-rt's parameters with
q/k/v and gate/up fused at load. The 128k-word text head is never needed to speak and is skipped by name;
any other key that higgs-rt does not know, and any key it needs that is absent, is an error that lists them.
So is a tensor stored in an integer type, and one that holds NaN or inf once loaded (`FiniteCheck`).
"""

from __future__ import annotations

import json
import re
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open

from . import timing
from .config import TalkerConfig

# Never needed to generate speech: the text head (both spellings), the audio-understanding tower, and
# buffers the original files carry.
SKIPPED = re.compile(
    r"^(model\.)?(audio_decoder_proj\.)?text_lm_head\.(weight|linear_frozen\.weight|linear_trainable\.weight)$"
    r"|^(audio_tower|audio_encoder_proj)\."
    r"|(rotary_emb\.inv_freq|rotary_emb\.original_inv_freq|audio_codebook_weights)$"
)

_LAYER = re.compile(r"^layers\.(\d+)\.")

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


def check_floating(name: str, tensor: torch.Tensor, error: type[Exception] = WeightsError) -> None:
    """A weight must be stored in a floating-point type: an integer one would be cast silently into nonsense."""
    if not tensor.is_floating_point():
        raise error(f"{name} is stored as {str(tensor.dtype).removeprefix('torch.')}, where a floating-point "
                    "tensor is expected")


class FiniteCheck:
    """Whether loaded tensors hold only finite values, checked once for all of them: `add` keeps a tensor's min
    and max on its device (NaN propagates into both, an inf is one of them; no host sync, no temporary of the
    tensor's size), `check` reads them all back in one sync and raises `error` naming the first tensor with NaN
    or inf (a corrupt checkpoint would otherwise speak 40 s of full-scale noise). `seconds`: the host's time in
    it (on CUDA the reductions run behind it, and are waited for by the final sync)."""

    def __init__(self, error: type[Exception] = WeightsError):
        self.error = error
        self.names: list[str] = []
        self.extremes: list[torch.Tensor] = []
        self.seconds = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.numel():
            start = time.perf_counter()
            self.names.append(name)
            self.extremes.extend(torch.aminmax(tensor if tensor.element_size() > 1 else tensor.float()))  # float8
            self.seconds += time.perf_counter() - start

    def check(self) -> None:
        if not self.names:
            return
        start = time.perf_counter()
        finite = torch.isfinite(torch.stack(self.extremes).view(-1, 2)).all(dim=1)
        bad = (~finite).nonzero().flatten().tolist()  # the one sync
        names, self.names, self.extremes = self.names, [], []
        self.seconds += time.perf_counter() - start
        if bad:
            more = f" (and {len(bad) - 1} more of the {len(names)} tensors)" if len(bad) > 1 else ""
            raise self.error(f"{names[bad[0]]} holds NaN or infinite values{more}: the checkpoint is corrupt")


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
        files: dict[str, str] = {}
        for path in checkpoint_files(model_dir):
            try:
                f = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for a corrupt header
                raise WeightsError(f"weights: cannot read {path}: {e}") from None
            tensors.update({key: partial(f.get_tensor, key) for key in f.keys()})
            files.update(dict.fromkeys(f.keys(), str(path)))
        return map_weights(tensors, cfg, dtype, device, progress, where=str(model_dir), files=files)


def map_weights(tensors: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]], cfg: TalkerConfig,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", progress: bool = False,
                where: str = "the state dict", writer: "DeviceWriter | None" = None,
                files: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint keys of either layout (values: tensors, or callables that read them) -> higgs-rt parameters.

    Renames, checks the key set and every shape against the config, then casts and fuses while writing each
    parameter once onto the device (`DeviceWriter`, or `writer`, which also checks dtypes and finiteness).
    files: checkpoint key -> the file holding it, for the errors (else `where`).
    """
    found: dict[str, str] = {}  # core name -> checkpoint key
    for key in tensors:
        if not SKIPPED.search(key):
            found.setdefault(core_name(key), key)  # a head stored under both names: one copy

    def read(name: str) -> list[tuple[str, torch.Tensor]]:
        """A core name's row blocks, (checkpoint key and file, tensor): one tensor, or a split module's blocks
        (stacked on the device, not here)."""
        if name not in found:
            return [t for p in SPLIT[name] for t in read(p)]
        key = found[name]
        value = tensors[key]
        return [(f"weights: {key} in {(files or {}).get(key, where)}", value() if callable(value) else value)]

    # The layer count first: names for a config's 2**31-1 layers would take gigabytes before saying they are missing.
    layers = {m[1] for key in found if (m := _LAYER.match(key))}
    if len(layers) != cfg.num_layers:
        raise WeightsError(f"weights in {where} hold {len(layers)} layer(s), the config's num_hidden_layers is "
                           f"{cfg.num_layers}")
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
    writer = writer or DeviceWriter(torch.device(device))
    out = {}
    for name, parts in tqdm(wanted.items(), desc="loading weights", unit="tensor", disable=not progress,
                            leave=False):
        sources, pieces = map(list, zip(*(t for p in parts for t in read(p))))
        shape = _fused_shape(pieces)
        if shape != shapes[name]:
            got = shape or " + ".join(str(tuple(t.shape)) for t in pieces)
            raise WeightsError(f"weights: {'+'.join(parts)} has shape {got}, the config implies {shapes[name]}")
        out[name] = writer.place(pieces, dtype, sources)
    writer.finish()
    timing.note(writer.summary())
    return out


def _fused_shape(pieces: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The shape of the pieces stacked along rows; None when they cannot stack."""
    rest = {tuple(t.shape[1:]) for t in pieces}
    if len(rest) != 1 or any(t.dim() == 0 for t in pieces):
        return tuple(pieces[0].shape) if len(pieces) == 1 else None
    return (sum(t.shape[0] for t in pieces), *rest.pop())


def format_bytes(n: int) -> str:
    """A byte count for people: kB, MB or GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


STAGING_BYTES = 64 << 20  # one pinned staging buffer; two alternate


class DeviceWriter:
    """Checkpoint tensors (memory-mapped host views) -> parameters on `device` in `dtype`, each written once.

    A parameter that is one checkpoint tensor already on the device in the dtype is that tensor, not a copy (on
    the CPU: the memory map itself). Any other is allocated on the device and its pieces written into their row
    blocks (q/k/v and gate/up are fused in place: no per-piece copy, no concatenation). Host -> CUDA goes through
    two pinned buffers of `STAGING_BYTES` in turn: the host copies a chunk from the memory map into one (torch's
    intra-op threads; the page faults are the file's read) while the other's asynchronous copy to the device
    runs; a dtype change happens on the device, after the copy. `staged` forces the chunked path (tests run it on
    the CPU, unpinned). `host_s`: time spent copying on the host (reading); `wait_s`: waiting for the device.
    Each checkpoint tensor is also checked: its stored dtype at once, what it became on the device for NaN and
    inf (`finite`, read back once, by `finish`).
    """

    def __init__(self, device: torch.device, staged: bool | None = None, chunk_bytes: int = STAGING_BYTES):
        if device.type == "cuda" and device.index is None:  # "cuda" is the current device: name its index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.staged = device.type == "cuda" if staged is None else staged
        self.chunk_bytes = chunk_bytes
        self.bytes = 0
        self.host_s = self.wait_s = 0.0
        self.shared = 0  # parameters that are the checkpoint's own tensors
        self.finite = FiniteCheck()
        self._started = time.perf_counter()
        self._buffers: list[torch.Tensor] = []
        self._events: list = []
        self._turn = 0

    def place(self, pieces: list[torch.Tensor], dtype: torch.dtype, names: list[str]) -> torch.Tensor:
        """One parameter from its checkpoint tensors (`names`: theirs, for errors), stacked along rows."""
        for name, t in zip(names, pieces):
            check_floating(name, t)
        first = pieces[0]
        if len(pieces) == 1 and first.device == self.device:
            if first.dtype == dtype:
                self.shared += 1
                self.finite.add(names[0], first)
                return first
            if not self.staged:  # a cast on the device itself
                start = time.perf_counter()
                out = first.to(dtype)
                self.host_s += time.perf_counter() - start
                self.bytes += first.numel() * first.element_size()
                self.finite.add(names[0], out)
                return out
        out = torch.empty((sum(t.shape[0] for t in pieces), *first.shape[1:]), dtype=dtype, device=self.device)
        row = 0
        for name, t in zip(names, pieces):
            self.write(out[row: row + t.shape[0]], t)
            self.finite.add(name, out[row: row + t.shape[0]])
            row += t.shape[0]
        return out

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (contiguous, on the device) <- src (same shape, any device and dtype)."""
        self.bytes += src.numel() * src.element_size()
        if not self.staged or src.device.type != "cpu":
            start = time.perf_counter()
            dst.copy_(src)
            self.host_s += time.perf_counter() - start
            return
        src, dst = src.reshape(-1), dst.view(-1)
        step = max(1, self.chunk_bytes // src.element_size())
        for i in range(0, src.numel(), step):
            n = min(step, src.numel() - i)
            stage = self._buffer()[: n * src.element_size()].view(src.dtype)
            start = time.perf_counter()
            stage.copy_(src[i: i + n])
            self.host_s += time.perf_counter() - start
            dst[i: i + n].copy_(stage, non_blocking=True)
            if self._events:
                self._events[self._turn].record()

    def _buffer(self) -> torch.Tensor:
        """The next staging buffer, once its previous copy to the device is done."""
        cuda = self.device.type == "cuda"
        if len(self._buffers) < 2:
            self._buffers.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=cuda))
            if cuda:
                self._events.append(torch.cuda.Event())
            self._turn = len(self._buffers) - 1
            return self._buffers[-1]
        self._turn = 1 - self._turn
        if cuda:
            start = time.perf_counter()
            self._events[self._turn].synchronize()
            self.wait_s += time.perf_counter() - start
        return self._buffers[self._turn]

    def finish(self) -> None:
        """Wait for the last copies (the staging buffers are then freed), then check every tensor was finite."""
        if self.device.type == "cuda":
            start = time.perf_counter()
            torch.cuda.synchronize(self.device)
            self.wait_s += time.perf_counter() - start
        self._buffers.clear()
        self._events.clear()
        self.finite.check()

    def summary(self) -> str:
        """One line for --verbose: what was copied, and where the time went."""
        took = time.perf_counter() - self._started
        shared = f"; {self.shared} tensors used in place (memory-mapped)" if self.shared else ""
        checked = f"; checked for NaN/inf in {self.finite.seconds:.3f} s"
        if not self.staged:
            return f"{format_bytes(self.bytes)} copied in {self.host_s:.3f} s{shared}{checked}"
        rate = self.bytes / took / 1e9 if took > 0 else 0.0
        return (f"{format_bytes(self.bytes)} to {self.device} through pinned memory, {rate:.1f} GB/s: host copies "
                f"(reading the page cache) {self.host_s:.3f} s, waiting for the device {self.wait_s:.3f} s"
                f"{shared}{checked}")
