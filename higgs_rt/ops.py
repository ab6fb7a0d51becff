"""The one home of higgs-rt's custom ops: delay-pattern revert, RVQ lookup, DualFFN routing, and the decode
step's skinny GEMM (`gemv`) and split-K attention over the KV cache (`decode_attention`).

Each public op validates its inputs (ValueError naming the argument), makes them
contiguous and calls a `torch.library.custom_op` (so it works under
`torch.compile(fullgraph=True)` and CUDA graph capture; plain eager calls skip the
dispatcher, see `_call`). The custom op runs the
compiled kernel from `higgs_rt._C` (C++ on CPU, CUDA on GPU, launched on torch's
current stream) and falls back to the pure-torch `*_ref` implementation when the
extension is missing or lacks the tensor's device. The `*_ref` functions are also
the test oracle.

`gemv` and `decode_attention` have CUDA kernels only: on CPU (and for shapes or
alignments their kernels do not take) they run their torch reference.

Layout: codes are int64, time-major [B, T, Q]. Out-of-range codes are clamped to
[0, K - 1] everywhere (stream BOS = K and EOS = K + 1 become K - 1).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    from higgs_rt import _C
except ImportError:
    _C = None

HAS_EXTENSION: bool = _C is not None
HAS_CUDA_KERNELS: bool = HAS_EXTENSION and bool(_C.has_cuda)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
# The int handle of a device's current stream; the private getter (what inductor's generated code
# uses) costs 0.2 µs against 6.5 µs for torch.cuda.current_stream(i).cuda_stream on an H200.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda i: torch.cuda.current_stream(i).cuda_stream)
_TABLE_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # TableDType in csrc/ops.h
_HALF_DTYPES = (torch.bfloat16, torch.float16)
GEMV_MAX_BATCH = 8
DECODE_ATTENTION_HEAD_DIMS = (64, 128)  # head dims with a CUDA kernel; others run the reference


# ----------------------------------------------------------------------------- helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check(name: str, t, dtypes: tuple[torch.dtype, ...], ndim: int, like: Tensor | None = None) -> Tensor:
    """Validate one tensor argument; return it contiguous."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(_dtype_name(d) for d in dtypes)
        raise ValueError(f"{name} must be {want}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {t.device}")
    return t.contiguous()


def _delay_window(codes: Tensor, num_codes: int, offset: int, length: int | None) -> int:
    """Validate the revert window; return its length L (frames out)."""
    _, s, q = codes.shape
    if num_codes < 1:
        raise ValueError(f"num_codes must be >= 1, got {num_codes}")
    if q < 1:
        raise ValueError(f"codes must have at least one codebook, got shape {tuple(codes.shape)}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    available = s - offset - q + 1
    if length is None:
        length = available
    if length < 0 or length > available:
        raise ValueError(
            f"length {length} with offset {offset} needs {offset + length + q - 1} delayed frames "
            f"(Q={q}), codes has {s}"
        )
    return length


def _native(t: Tensor) -> bool:
    """True if the compiled extension has a kernel for t's device."""
    if not HAS_EXTENSION:
        return False
    return t.device.type == "cpu" or (t.device.type == "cuda" and HAS_CUDA_KERNELS)


def _cuda_kernel(t: Tensor) -> bool:
    """True if t is on a GPU and the extension has CUDA kernels (for the CUDA-only ops)."""
    return t.device.type == "cuda" and HAS_CUDA_KERNELS


def _aligned16(*tensors: Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _attention_splits(b: int, hq: int, hkv: int, s: int, device: torch.device) -> int:
    """Key splits per (slot, KV head) for decode_attention: about 4 blocks per SM, at least 16 keys a split.

    A function of the shapes only (the kernel's grid must not depend on the lengths), so a CUDA graph stays
    valid. B = 1 with 8 KV heads on 132 SMs gives 66 splits.
    """
    g = hq // hkv
    blocks_per_split = b * hkv * (1 if g <= 4 else -(-g // 8))
    want = -(-4 * _sm_count(device.index) // max(1, blocks_per_split))
    return max(1, min(want, -(-s // 16), 256))


def _launch(kernel: str, like: Tensor, *args) -> None:
    """Call _C.<kernel>(*args, device, stream): CPU is device -1; CUDA uses torch's current stream."""
    if like.device.type == "cuda":
        device, stream = like.device.index, _raw_stream(like.device.index)
    else:
        device, stream = -1, 0
    getattr(_C, kernel)(*args, device, stream)


_use_references = False


@contextlib.contextmanager
def references() -> Iterator[None]:
    """Inside, every op runs its pure-torch `*_ref` (traced as plain aten ops) and `Talker.decode_kernels` is
    off: what `higgs-rt export --kernels torch` traces, so that its packages call nothing in Python."""
    global _use_references
    previous, _use_references = _use_references, True
    try:
        yield
    finally:
        _use_references = previous


def using_references() -> bool:
    return _use_references


def _call(impl, op, *args):
    """Run custom op `op` (whose body is `impl`). Plain eager calls run `impl` directly, skipping the
    torch.library dispatcher (~28 µs a call on an H200); compiled, traced, fake or mode-wrapped calls
    go through `op`; inside `references()` its reference runs. Inference only: no path supports autograd."""
    if _use_references:
        return _REFERENCE_OF[op](*args)
    if (
        not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, Tensor))
    ):
        return impl(*args)
    return op(*args)


# ----------------------------------------------------------------------------- references


def delay_revert_ref(codes: Tensor, num_codes: int, offset: int = 0, length: int | None = None) -> Tensor:
    """[B, S, Q] delayed -> [B, L, Q] aligned: out[b, t, k] = clip(codes[b, offset + t + k, k], 0, K - 1)."""
    b, _, q = codes.shape
    length = _delay_window(codes, num_codes, offset, length)
    t = torch.arange(length, device=codes.device)[:, None]
    k = torch.arange(q, device=codes.device)[None, :]
    index = (offset + t + k).expand(b, length, q)
    return codes.gather(1, index).clamp(0, num_codes - 1)


def rvq_lookup_ref(codes: Tensor, table: Tensor) -> Tensor:
    """out[b, t] = sum_q table[q, clamp(codes[b, t, q], 0, K - 1)], summed in fp32 in q order."""
    q, k, d = table.shape
    codes = codes.clamp(0, k - 1)
    acc = torch.zeros(*codes.shape[:2], d, dtype=torch.float32, device=table.device)
    for i in range(q):
        acc += table[i][codes[..., i]].float()
    return acc.to(table.dtype)


def dualffn_route_ref(hidden: Tensor, audio_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Text rows first then audio rows, stable: (hidden[perm], perm, n_audio as a 0-d int64 tensor)."""
    perm = torch.argsort(audio_mask.to(torch.int8), stable=True)
    n_audio = audio_mask.sum(dtype=torch.int64)
    return hidden[perm], perm, n_audio


def dualffn_unroute_ref(y: Tensor, perm: Tensor) -> Tensor:
    """Inverse of the routing gather: out[perm[i]] = y[i]."""
    return torch.empty_like(y).index_copy_(0, perm, y)


def gemv_ref(x: Tensor, w: Tensor) -> Tensor:
    """y = x @ w.T accumulated in fp32, returned in x's dtype (x [B, K], w [N, K])."""
    return (x.float() @ w.float().t()).to(x.dtype)


def decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> Tensor:
    """Masked SDPA (fp32) of q [B, Hq, D] over the first lengths[b] positions of k/v [B, Hkv, S, D]; GQA maps
    query head h to KV head h // (Hq / Hkv). Lengths are clamped to [0, S]; a slot of length 0 gives zeros."""
    b, hq, _ = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    valid = torch.arange(s, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k_cache.float(), v_cache.float(),
                                         attn_mask=valid[:, None, None, :], enable_gqa=hq != hkv)[:, :, 0]
    return out.masked_fill((lengths <= 0)[:, None, None], 0.0).to(q.dtype)  # all-masked rows are NaN in SDPA


# ----------------------------------------------------------------------------- custom ops


def _delay_revert_impl(codes: Tensor, num_codes: int, offset: int, length: int) -> Tensor:
    if not _native(codes):
        return delay_revert_ref(codes, num_codes, offset, length)
    b, s, q = codes.shape
    out = codes.new_empty((b, length, q))
    _launch("delay_revert", codes, codes.data_ptr(), out.data_ptr(), b, s, q, length, offset, num_codes)
    return out


_delay_revert_op = torch.library.custom_op("higgs_rt::delay_revert", _delay_revert_impl, mutates_args=())


@_delay_revert_op.register_fake
def _(codes, num_codes, offset, length):
    return codes.new_empty((codes.shape[0], length, codes.shape[2]))


def _rvq_lookup_impl(codes: Tensor, table: Tensor) -> Tensor:
    if not _native(codes):
        return rvq_lookup_ref(codes, table)
    b, t, q = codes.shape
    _, k, d = table.shape
    out = table.new_empty((b, t, d))
    _launch(
        "rvq_lookup", codes,
        codes.data_ptr(), table.data_ptr(), out.data_ptr(), b * t, q, k, d, _TABLE_DTYPE_CODE[table.dtype],
    )
    return out


_rvq_lookup_op = torch.library.custom_op("higgs_rt::rvq_lookup", _rvq_lookup_impl, mutates_args=())


@_rvq_lookup_op.register_fake
def _(codes, table):
    return table.new_empty((codes.shape[0], codes.shape[1], table.shape[2]))


def _dualffn_route_impl(hidden: Tensor, audio_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if not _native(hidden):
        return dualffn_route_ref(hidden, audio_mask)
    n, h = hidden.shape
    routed = torch.empty_like(hidden)
    perm = hidden.new_empty((n,), dtype=torch.int64)
    n_audio = hidden.new_empty((), dtype=torch.int64)
    _launch(
        "dualffn_route", hidden,
        hidden.data_ptr(), audio_mask.data_ptr(), routed.data_ptr(), perm.data_ptr(), n_audio.data_ptr(),
        n, h * hidden.element_size(),
    )
    return routed, perm, n_audio


_dualffn_route_op = torch.library.custom_op("higgs_rt::dualffn_route", _dualffn_route_impl, mutates_args=())


@_dualffn_route_op.register_fake
def _(hidden, audio_mask):
    n = hidden.shape[0]
    return torch.empty_like(hidden), hidden.new_empty((n,), dtype=torch.int64), hidden.new_empty((), dtype=torch.int64)


def _dualffn_unroute_impl(y: Tensor, perm: Tensor) -> Tensor:
    if not _native(y):
        return dualffn_unroute_ref(y, perm)
    n, h = y.shape
    out = torch.empty_like(y)
    _launch("dualffn_unroute", y, y.data_ptr(), perm.data_ptr(), out.data_ptr(), n, h * y.element_size())
    return out


_dualffn_unroute_op = torch.library.custom_op("higgs_rt::dualffn_unroute", _dualffn_unroute_impl, mutates_args=())


@_dualffn_unroute_op.register_fake
def _(y, perm):
    return torch.empty_like(y)


def _gemv_impl(x: Tensor, w: Tensor) -> Tensor:
    b, k = x.shape
    if not (_cuda_kernel(x) and k % 8 == 0 and _aligned16(x, w)):
        return gemv_ref(x, w)
    n = w.shape[0]
    y = x.new_empty((b, n))
    _launch("gemv", x, x.data_ptr(), w.data_ptr(), y.data_ptr(), b, n, k, _TABLE_DTYPE_CODE[x.dtype])
    return y


_gemv_op = torch.library.custom_op("higgs_rt::gemv", _gemv_impl, mutates_args=())


@_gemv_op.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


def _decode_attention_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> Tensor:
    b, hq, d = q.shape
    _, hkv, s, _ = k_cache.shape
    if not (_cuda_kernel(q) and d in DECODE_ATTENTION_HEAD_DIMS and _aligned16(q, k_cache, v_cache)):
        return decode_attention_ref(q, k_cache, v_cache, lengths)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    nsplit = _attention_splits(b, hq, hkv, s, q.device)
    # Partials of the split kernel, [B, Hq, nsplit, D] sums then [B, Hq, nsplit, 2] (max, denominator).
    workspace = q.new_empty((b * hq * nsplit * (d + 2),), dtype=torch.float32) if nsplit > 1 else None
    _launch(
        "decode_attention", q,
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), lengths.data_ptr(), out.data_ptr(),
        0 if workspace is None else workspace.data_ptr(), b, hq, hkv, s, d, nsplit, _TABLE_DTYPE_CODE[q.dtype],
    )
    return out


_decode_attention_op = torch.library.custom_op("higgs_rt::decode_attention", _decode_attention_impl, mutates_args=())


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, lengths):
    return torch.empty_like(q)


_REFERENCE_OF = {_delay_revert_op: delay_revert_ref, _rvq_lookup_op: rvq_lookup_ref,
                 _dualffn_route_op: dualffn_route_ref, _dualffn_unroute_op: dualffn_unroute_ref,
                 _gemv_op: gemv_ref, _decode_attention_op: decode_attention_ref}


# ----------------------------------------------------------------------------- public API


def delay_revert(codes: Tensor, num_codes: int, offset: int = 0, length: int | None = None) -> Tensor:
    """Revert the delay pattern of frames [B, S, Q] (codebook k lags k frames) -> aligned [B, L, Q].

    out[b, t, k] = clip(codes[b, offset + t + k, k], 0, num_codes - 1); L defaults to S - offset - Q + 1.
    """
    codes = _check("codes", codes, (torch.int64,), 3)
    length = _delay_window(codes, num_codes, offset, length)
    return _call(_delay_revert_impl, _delay_revert_op, codes, num_codes, offset, length)


def rvq_lookup(codes: Tensor, table: Tensor) -> Tensor:
    """codes [B, T, Q] int64, table [Q, K, D] -> [B, T, D] = sum_q table[q, codes[..., q]] (fp32 accumulation)."""
    codes = _check("codes", codes, (torch.int64,), 3)
    table = _check("table", table, _FLOAT_DTYPES, 3, like=codes)
    if table.shape[0] != codes.shape[2]:
        raise ValueError(f"table must have Q={codes.shape[2]} codebooks (codes' last dim), got shape {tuple(table.shape)}")
    if table.shape[1] < 1:
        raise ValueError(f"table must have at least one code per codebook, got shape {tuple(table.shape)}")
    return _call(_rvq_lookup_impl, _rvq_lookup_op, codes, table)


def dualffn_route(hidden: Tensor, audio_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], audio_mask [N] bool -> (routed [N, H], perm [N] int64, n_audio 0-d int64), no host sync.

    perm lists text rows then audio rows (stable); routed = hidden[perm]; audio rows are routed[N - n_audio:].
    """
    hidden = _check("hidden", hidden, _FLOAT_DTYPES, 2)
    audio_mask = _check("audio_mask", audio_mask, (torch.bool,), 1, like=hidden)
    if audio_mask.shape[0] != hidden.shape[0]:
        raise ValueError(f"audio_mask must have shape ({hidden.shape[0]},), got {tuple(audio_mask.shape)}")
    return _call(_dualffn_route_impl, _dualffn_route_op, hidden, audio_mask)


def dualffn_unroute(y: Tensor, perm: Tensor) -> Tensor:
    """Undo dualffn_route: out[perm[i]] = y[i]."""
    y = _check("y", y, _FLOAT_DTYPES, 2)
    perm = _check("perm", perm, (torch.int64,), 1, like=y)
    if perm.shape[0] != y.shape[0]:
        raise ValueError(f"perm must have shape ({y.shape[0]},), got {tuple(perm.shape)}")
    return _call(_dualffn_unroute_impl, _dualffn_unroute_op, y, perm)


def gemv(x: Tensor, w: Tensor) -> Tensor:
    """Decode-time linear layer: x [B, K] (1 <= B <= 8), w [N, K] (nn.Linear layout) -> x @ w.T [B, N].

    bf16 or fp16 (both the same), fp32 accumulation, output in x's dtype. On CUDA a weight-streaming kernel
    reads w once for all B rows; on CPU, or when K % 8 != 0 or x / w are not 16-byte aligned, it is gemv_ref.
    """
    x = _check("x", x, _HALF_DTYPES, 2)
    w = _check("w", w, (x.dtype,), 2, like=x)
    if not 1 <= x.shape[0] <= GEMV_MAX_BATCH:
        raise ValueError(f"x must have 1 to {GEMV_MAX_BATCH} rows, got shape {tuple(x.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w must have K={x.shape[1]} columns (x's last dim), got shape {tuple(w.shape)}")
    return _call(_gemv_impl, _gemv_op, x, w)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> Tensor:
    """One decode step's attention: q [B, Hq, D] over k_cache / v_cache [B, Hkv, S, D] -> [B, Hq, D].

    out[b, h] = softmax(q[b, h] . k[b, h // (Hq / Hkv), :L] * D^-0.5) @ v[b, h // (Hq / Hkv), :L] with
    L = lengths[b] (int64 on q's device, clamped to [0, S]; the new position is already in the cache, so L
    counts it; L = 0 gives zeros). fp32 softmax; q and the caches share one dtype (fp32, bf16 or fp16).
    On CUDA the lengths are read by the kernel (no host sync, CUDA-graph safe: change them between replays)
    and the keys are split across blocks (flash-decoding) for D in DECODE_ATTENTION_HEAD_DIMS; otherwise,
    and on CPU, it is decode_attention_ref.
    """
    q = _check("q", q, _FLOAT_DTYPES, 3)
    k_cache = _check("k_cache", k_cache, (q.dtype,), 4, like=q)
    v_cache = _check("v_cache", v_cache, (q.dtype,), 4, like=q)
    lengths = _check("lengths", lengths, (torch.int64,), 1, like=q)
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or k_cache.shape[1] < 1 or k_cache.shape[2] < 1:
        raise ValueError(f"k_cache must be [B={b}, Hkv, S, D={d}] with Hkv, S >= 1, got shape {tuple(k_cache.shape)}")
    if hq % k_cache.shape[1] != 0:
        raise ValueError(f"k_cache's {k_cache.shape[1]} KV heads must divide q's {hq} heads")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must have shape ({b},), got {tuple(lengths.shape)}")
    return _call(_decode_attention_impl, _decode_attention_op, q, k_cache, v_cache, lengths)
