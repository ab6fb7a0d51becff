"""The Talker: Llama-3.2 body with a DualFFN per layer and an audio-only head (gpt-fast style).

Weights (`Talker`) are shared and stateless; per-stream state is a `KVCache` of batch slots, each with its
own length. Entry points with static shapes:
- `prefill(cache, slot, ids, audio_frames)`: one prompt into one slot (mixed text/audio positions): cuBLAS and
  SDPA, and between them the row-wise ops (`higgs_rt.ops.rowwise`: RMSNorm with the residual add, RoPE with the
  head split, SwiGLU), CUDA kernels there;
- `step(cache, frames)`: every slot advances by one audio frame, each at its own position, on the same layer
  code (under `ops.references()` plain torch: the reference of the decode step);
- `fused_step(cache, frames)`: the same forward as five fused kernels per layer (`higgs_rt.ops`: RMSNorm + QKV +
  RoPE + cache write, attention over live lengths, output projection + residual, RMSNorm + gate/up + SwiGLU,
  down projection + residual) and one for the head; on CUDA in bf16/fp16 (`decode_kernels`), elsewhere the same
  calls run the ops' torch references.
Every decoding position is audio, so the steps only ever run the audio norms and the audio FFN.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .config import RopeScaling, TalkerConfig, short_value
from .weights import format_bytes, load_talker_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class FFN(nn.Module):
    """Gated SiLU MLP with gate and up fused into one matrix."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(ops.silu_mul(self.w13(x)))


class Layer(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.wqkv = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.wo = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.attn_norm, self.audio_attn_norm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.ffn_norm, self.audio_ffn_norm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.ffn = FFN(h, cfg.intermediate_size)
        self.audio_ffn = FFN(h, cfg.audio_intermediate_size)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, H] (normed) -> q [B, Hq, T, D], k and v [B, Hkv, T, D], RoPE applied (cos, sin [B or 1, T, D])."""
        return ops.rope_qkv(self.wqkv(x), cos, sin, self.n_heads, self.n_kv)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        b, _, t, _ = q.shape
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=self.n_heads != self.n_kv)
        return self.wo(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies [head_dim / 2] in fp64, with llama3's low/high frequency scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, (1 - smooth) * scaled / scaling.factor + smooth * scaled, scaled)


# At up to this many slots the fused step's o-proj and head GEMVs may ask L2 for the first bytes of the weights that
# follow them (gate/up; the next step's first q/k/v) while decode attention and the sampler leave the bus idle.
L2_AHEAD_MAX_BATCH = 8
# gate/up's first MB asked by o-proj on sm_90 (bulk prefetches, after o-proj's PDL wait: csrc/cuda/gemv.cu's
# ahead_at); H100, f949e68: b1 2.375 against 2.398 ms, b8 2.503 against 2.507. Before sm_90 the hint is a prefetch
# a line, which lost at 8 slots (2.537 against 2.497): none there.
L2_AHEAD_DEFAULT_MB = 16


def l2_ahead_bytes(name: str = "HIGGS_RT_L2_AHEAD_MB", default_mb: int = 0) -> int:
    """$HIGGS_RT_L2_AHEAD_MB (gate/up's first bytes, asked by o-proj) or $HIGGS_RT_L2_NEXT_STEP_MB (the next step's
    first q/k/v bytes, asked by the head) in bytes, `default_mb` where unset; 0 asks nothing (the next step's 32
    MB gained nothing on an H100: csrc/cuda/NOTES.md)."""
    value = os.environ.get(name, "") or str(default_mb)
    if not value.isdigit():
        raise ValueError(f"{name} must be a whole number of MB, got {value!r}")
    return int(value) << 20


def l2_ahead_default_mb(device: torch.device) -> int:
    """L2_AHEAD_DEFAULT_MB on a CUDA device of compute capability 9.0 or more, else 0."""
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return L2_AHEAD_DEFAULT_MB if sm90 else 0


def first_rows(w: Tensor, nbytes: int, halves: int = 1) -> Tensor | None:
    """The first rows of each of w's `halves` stacked parts, about `nbytes` in all (a view, for ops' `ahead`
    hint), or None for 0 bytes."""
    if nbytes <= 0:
        return None
    parts = w.view(halves, w.shape[0] // halves, w.shape[1])
    rows = min(parts.shape[1], max(1, nbytes // (halves * w.shape[1] * w.element_size())))
    return parts[:, :rows] if halves > 1 else parts[0, :rows]


class KVCacheTooLarge(MemoryError):
    """The KV cache asked for does not fit the device's memory; one line: what it `needs`, then the `advice` of
    what to lower (a caller whose options are named otherwise, export's --batch, gives its own)."""

    def __init__(self, needs: str, advice: str):
        super().__init__(needs, advice)
        self.needs, self.advice = needs, advice

    def __str__(self) -> str:
        return f"{self.needs}: {self.advice}"


CACHE_SHARE = 0.9  # of the memory available that a KV cache may take: the rest is for activations, sampler, codec


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take now (None: not known). CUDA: the driver's free memory and what
    torch's allocator holds unused; the CPU: MemAvailable (/proc/meminfo), or less where a cgroup v2 limit (a
    container's) leaves less: the limit, less what the group uses, reclaimable page cache not counted."""
    if device.type == "cuda":
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    meminfo = re.search(r"^MemAvailable:\s+(\d+) kB", _read("/proc/meminfo"), re.M)
    found = [int(meminfo[1]) << 10] if meminfo else []
    limit, used = _read("/sys/fs/cgroup/memory.max").strip(), _read("/sys/fs/cgroup/memory.current").strip()
    if limit.isdigit() and used.isdigit():
        cache = re.search(r"^inactive_file (\d+)", _read("/sys/fs/cgroup/memory.stat"), re.M)
        found.append(int(limit) - int(used) + (int(cache[1]) if cache else 0))
    return min(found, default=None)


class KVCache:
    """Per-stream state: keys and values of every layer for `batch` slots of `max_len` positions.

    `lengths[b]` is how many positions slot b holds; `step` writes at that index and advances it.
    STATE declares the tensors a decode step reads and writes (attribute -> written by the step): k and v [L, B,
    Hkv, S, D] in the model's dtype, lengths [B] int64, attention_counters [B * Hq] int32 (decode_attention's,
    kept zero). Exported steps take exactly these as inputs (`higgs_rt.compiled.step_state`).
    Every cache is made here, and `check_fits` first: one the device cannot hold is KVCacheTooLarge.
    """

    STATE = {"k": True, "v": True, "lengths": True, "attention_counters": True}

    @staticmethod
    def nbytes(cfg: TalkerConfig, batch: int, max_len: int, dtype: torch.dtype) -> int:
        """The bytes of k and v together."""
        return 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_len * cfg.head_dim * dtype.itemsize

    @classmethod
    def check_fits(cls, cfg: TalkerConfig, batch: int, max_len: int, dtype: torch.dtype,
                   device: str | torch.device) -> None:
        """KVCacheTooLarge for a cache past `CACHE_SHARE` of the device's available memory, said before allocating
        it: on the CPU such an allocation succeeds (Linux overcommits) and zero-filling it gets the process
        killed. Past torch's int64 byte count, too, where its error would be an overflow."""
        nbytes, free = cls.nbytes(cfg, batch, max_len, dtype), available_memory(torch.device(device))
        if nbytes >= 2**63 or (free is not None and nbytes > CACHE_SHARE * free):
            raise _too_large(batch, max_len, nbytes, device, free)

    def __init__(self, cfg: TalkerConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: str | torch.device):
        self.check_fits(cfg, batch, max_len, dtype, device)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        try:  # it may still not fit (fragmentation, other processes); then the allocator says so
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            raise _too_large(batch, max_len, self.nbytes(cfg, batch, max_len, dtype), device, None) from None
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.attention_counters = ops.attention_counters(batch, cfg.num_heads, device)  # kept zero by the kernel
        self.batch, self.max_len = batch, max_len


def _too_large(batch: int, max_len: int, nbytes: int, device, free: int | None) -> KVCacheTooLarge:
    size = format_bytes(nbytes) if nbytes < 2**63 else f"over {2**63 / 1e9:.0f} GB"
    device = torch.device(device)
    limit = f"{device} can allocate" if free is None else \
        f"{CACHE_SHARE:.0%} of the {format_bytes(free)} available on {device}"
    advice = "lower the context (--context)" + (" or the slots (--slots)" if batch > 1 else "")
    return KVCacheTooLarge(f"the KV cache of {short_value(batch)} slot(s) x {max_len} positions needs {size}, "
                           f"more than {limit}", advice)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig, max_positions: int = 4096):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        # Built on the meta device, then given the loaded weights. Random init (Embedding's, without `_weight`)
        # and aranges on the meta device run torch's reference ops, which import torch._dynamo: a second or
        # more of cold start; so the embeddings skip init and the small buffers start on the CPU.
        audio_vocab = cfg.num_codebooks * cfg.codebook_vocab
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h))
        self.audio_embeddings = nn.Embedding(audio_vocab, h, _weight=torch.empty(audio_vocab, h))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.audio_head = nn.Linear(h, cfg.num_codebooks * cfg.codebook_vocab, bias=False)
        self.requires_grad_(False)
        self.register_buffer("codebook_offsets", torch.arange(cfg.num_codebooks, device="cpu") * cfg.codebook_vocab,
                             persistent=False)
        self.register_buffer("inv_freq", rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).float(),
                             persistent=False)
        self.max_positions = max_positions

    # ---- building ---------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir, dtype: torch.dtype = torch.float32, device="cpu",
                        max_positions: int = 4096, progress: bool = False) -> "Talker":
        cfg = TalkerConfig.from_dir(model_dir)
        return cls.from_weights(cfg, load_talker_weights(model_dir, cfg, dtype=dtype, device=device,
                                                         progress=progress), max_positions)

    @classmethod
    def from_weights(cls, cfg: TalkerConfig, weights: dict[str, Tensor], max_positions: int = 4096) -> "Talker":
        """Build around already mapped weights (`weights.map_weights`), without copying them."""
        device = weights["audio_head"].device
        with torch.device("meta"):
            model = cls(cfg, max_positions)
        model.load_state_dict({f"{k}.weight": v for k, v in weights.items()}, strict=True, assign=True)
        model.codebook_offsets = model.codebook_offsets.to(device)
        model.inv_freq = model.inv_freq.to(device)
        return model.eval()

    @property
    def decode_kernels(self) -> bool:
        """Decode with the fused kernels (`fused_step` and the fused sampler): on CUDA in bf16/fp16 when the
        library has CUDA kernels; HIGGS_RT_DECODE_KERNELS=0 or `ops.references()` turns them off."""
        return (self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                and ops.HAS_CUDA_KERNELS and os.environ.get("HIGGS_RT_DECODE_KERNELS", "1") != "0"
                and not ops.using_references())

    @property
    def dtype(self) -> torch.dtype:
        return self.audio_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.audio_head.weight.device

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, batch, max_len or self.max_positions, self.dtype, self.device)

    # ---- pieces -----------------------------------------------------------------------------------------
    def embed_frames(self, frames: Tensor) -> Tensor:
        """Audio frames [..., Q] -> the sum of their codebook embeddings [..., H]."""
        return self.audio_embeddings(frames + self.codebook_offsets).sum(dim=-2)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, T, D] in the model's dtype."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def head(self, x: Tensor) -> Tensor:
        """Final hidden states [B, H] -> audio logits [B, Q, V] in fp32."""
        logits = self.audio_head(self.norm(x))
        return logits.float().view(x.shape[0], self.cfg.num_codebooks, self.cfg.codebook_vocab)

    # ---- entry points -----------------------------------------------------------------------------------
    def prefill(self, cache: KVCache, slot: int, ids: Tensor, audio_frames: Tensor | None = None) -> Tensor:
        """Fill `slot` from scratch with a prompt; returns the last position's audio logits [Q, V].

        ids [T] are token ids; positions holding an audio token id take, in order, the summed embeddings of
        `audio_frames` [N, Q] (N = number of audio positions). The audio positions run the audio norms and
        FFN, the others the text ones (DualFFN), routed by the custom op.
        """
        ids, audio_frames = self.check_prompt(ids, audio_frames, cache.max_len)
        t = ids.shape[0]

        def store(i: int, k: Tensor, v: Tensor) -> None:
            cache.k[i, slot, :, :t] = k
            cache.v[i, slot, :, :t] = v

        logits = self.prompt_forward(ids, audio_frames, store)
        cache.lengths[slot].fill_(t)
        return logits

    def check_prompt(self, ids: Tensor, audio_frames: Tensor | None, max_len: int,
                     on_device: bool = True) -> tuple[Tensor, Tensor | None]:
        """The prompt checked (1 to max_len positions, one frame per audio position), on the model's device (or
        as given, `on_device=False`)."""
        t = ids.shape[0]
        if t == 0 or t > max_len:
            raise ValueError(f"prefill: the prompt has {t} positions; the cache holds 1 to {max_len}")
        n_audio = int(self.audio_mask(ids).sum())  # counted where the prompt was built (the host): no device sync
        n_frames = 0 if audio_frames is None else audio_frames.shape[0]
        if n_frames != n_audio:
            raise ValueError(f"prefill: the prompt has {n_audio} audio positions but {n_frames} audio frames")
        if not on_device:
            return ids, audio_frames
        return ids.to(self.device), None if audio_frames is None else audio_frames.to(self.device)

    def audio_mask(self, ids: Tensor) -> Tensor:
        """Positions holding an audio token id (compared with constants: no host-to-device copy, so it runs inside a
        CUDA graph capture)."""
        first, *rest = self.cfg.audio_token_ids
        mask = ids == first
        for token in rest:
            mask |= ids == token
        return mask

    def prompt_forward(self, ids: Tensor, audio_frames: Tensor | None, store: Callable[[int, Tensor, Tensor], None],
                       always_route: bool = False, last: Tensor | None = None) -> Tensor:
        """A checked prompt (`check_prompt`) through every layer -> the last position's audio logits [Q, V];
        store(i, k, v) receives layer i's keys and values [Hkv, T, D].

        ids may also be [n, T]: n prompts of one width side by side (a padded batch, `higgs_rt.prefill`), with
        audio_frames holding their audio positions' frames in order (prompt 0's first); then store gets
        [n, Hkv, T, D] and the logits are [n, Q, V].
        always_route: one branch-free path for any number of audio positions (N = audio_frames.shape[0], 0
        included), which is what torch.export traces; eager calls skip the routing when the prompt is all text.
        last: an index tensor ([1], or [n] for n prompts) choosing the position whose logits are returned (a padded
        prompt's last real one).
        """
        batched = ids.dim() == 2
        ids = ids if batched else ids[None]
        n, t = ids.shape
        audio_mask = self.audio_mask(ids)
        n_audio = 0 if audio_frames is None else audio_frames.shape[0]
        mixed = always_route or 0 < n_audio < n * t
        x = self.tok_embeddings(ids.masked_fill(audio_mask, 0))
        if always_route or n_audio:
            x = x.masked_scatter(audio_mask[..., None], self.embed_frames(audio_frames))
        cos, sin = self.rotary(torch.arange(t, device=self.device)[None])
        rows = audio_mask.view(-1)

        def norm(text: RMSNorm, audio: RMSNorm) -> tuple:  # a norm's arguments: a weight per row where mixed
            if mixed:
                return text.weight, text.eps, audio.weight, audio_mask
            return (audio if n_audio else text).weight, text.eps, None, None

        first = self.layers[0]
        h = ops.rms_norm(x, *norm(first.attn_norm, first.audio_attn_norm))
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h, cos, sin)
            store(i, k, v) if batched else store(i, k[0], v[0])
            x, h = ops.add_rms_norm(x, layer.attend(q, k, v, None, causal=True),
                                    *norm(layer.ffn_norm, layer.audio_ffn_norm))
            f = self._dual_ffn(layer, h.view(n * t, -1), rows, n_audio, mixed).view(n, t, -1)
            if i + 1 < len(self.layers):
                after = self.layers[i + 1]
                x, h = ops.add_rms_norm(x, f, *norm(after.attn_norm, after.audio_attn_norm))
            else:
                x = x + f
        if last is None:
            out = x[:, -1]
        elif batched:
            out = x.view(n * t, -1).index_select(0, last + torch.arange(n, device=self.device) * t)
        else:
            out = x[0].index_select(0, last)
        logits = self.head(out)
        return logits if batched else logits[0]

    @staticmethod
    def _dual_ffn(layer: Layer, h: Tensor, audio_mask: Tensor, n_audio: int, mixed: bool) -> Tensor:
        """Each normed row through its own FFN (text or audio): rows partitioned by the routing op, then put back."""
        if not mixed:
            return (layer.audio_ffn if n_audio else layer.ffn)(h)
        routed, perm, _ = ops.dualffn_route(h, audio_mask)
        text, audio = routed.split([h.shape[0] - n_audio, n_audio])  # sizes, not slices: exact under symbolic shapes
        return ops.dualffn_unroute(torch.cat((layer.ffn(text), layer.audio_ffn(audio))), perm)

    def step(self, cache: KVCache, frames: Tensor, advance: Tensor | None = None) -> Tensor:
        """Advance every slot by one audio frame: frames [B, Q] -> logits [B, Q, V], in plain torch.

        Slot b's frame goes to position lengths[b]; attention sees positions 0..lengths[b]. `advance` [B] bool
        says which slots keep the new position (idle slots compute and stay where they are). Static shapes,
        no host sync: safe to compile and to capture in a CUDA graph.
        """
        b = frames.shape[0]  # slots 0..b-1 of the cache (b <= cache.batch); the others are untouched
        pos = cache.lengths[:b].clamp(max=cache.max_len - 1)  # an idle slot may run on; never writes past the end
        x = self.embed_frames(frames)[:, None]
        cos, sin = self.rotary(pos[:, None])
        rows = torch.arange(b, device=frames.device)
        # the layer as an index tensor too: a write into the whole cache stays in place when exported, where one
        # into the view cache.k[i] becomes a copy of that layer (functionalisation, then Inductor)
        layers = torch.arange(len(self.layers), device=frames.device)[:, None].expand(-1, b)
        mask = (torch.arange(cache.max_len, device=frames.device)[None] <= pos[:, None])[:, None, None]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.audio_attn_norm(x), cos, sin)
            cache.k[layers[i], rows, :, pos] = k[:, :, 0]
            cache.v[layers[i], rows, :, pos] = v[:, :, 0]
            o = F.scaled_dot_product_attention(q, cache.k[i][:b], cache.v[i][:b], attn_mask=mask,
                                               enable_gqa=layer.n_heads != layer.n_kv).transpose(1, 2)
            x = x + layer.wo(o.reshape(b, 1, -1))
            x = x + layer.audio_ffn(layer.audio_ffn_norm(x))
        cache.lengths[:b].add_(1 if advance is None else advance.long())
        return self.head(x[:, 0])

    def fused_step(self, cache: KVCache, frames: Tensor) -> Tensor:
        """`step`'s forward as fused ops: frames [B, Q] -> logits [B, Q, V] (fp32, rounded to the model's dtype),
        B <= cache.batch: the frames are those of the cache's lowest B slots.

        Writes each slot's new keys and values at lengths[b] (clamped to the cache) but leaves the lengths to
        the caller (the fused sampler advances them). Static shapes, no host sync, CUDA-graph safe.
        """
        b, eps = frames.shape[0], self.cfg.rms_norm_eps
        table = self.audio_embeddings.weight.view(self.cfg.num_codebooks, self.cfg.codebook_vocab, -1)
        lengths = cache.lengths[:b]  # B <= the cache's slots: the step covers the lowest B
        keys = lengths.clamp(max=cache.max_len - 1) + 1  # the new position included
        x = ops.rvq_lookup(frames[:, None], table)[:, 0]  # last before the layers: their first kernel follows it
        few = b <= L2_AHEAD_MAX_BATCH
        ahead, next_step = 0, 0
        if few:
            ahead = l2_ahead_bytes(default_mb=l2_ahead_default_mb(frames.device))
            next_step = l2_ahead_bytes("HIGGS_RT_L2_NEXT_STEP_MB")
        for i, layer in enumerate(self.layers):
            q = ops.norm_qkv_rope(x, layer.audio_attn_norm.weight, eps, layer.wqkv.weight, self.inv_freq,
                                  lengths, cache.k, cache.v, i)
            o = ops.decode_attention(q, cache.k[i], cache.v[i], keys, cache.attention_counters)
            w13 = layer.audio_ffn.w13.weight
            x = ops.gemv_residual(o.view(b, -1), layer.wo.weight, x, ahead=first_rows(w13, ahead, halves=2))
            h = ops.norm_gemv_silu(x, layer.audio_ffn_norm.weight, eps, w13)
            x = ops.gemv_residual(h, layer.audio_ffn.w2.weight, x)
        logits = ops.norm_gemv_logits(x, self.norm.weight, eps, self.audio_head.weight,
                                      ahead=first_rows(self.layers[0].wqkv.weight, next_step))
        return logits.view(b, self.cfg.num_codebooks, self.cfg.codebook_vocab)
