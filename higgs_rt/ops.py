"""The one home of higgs-rt's custom ops: delay-pattern revert, RVQ lookup, DualFFN routing.

Each public op validates its inputs (ValueError naming the argument), makes them
contiguous and calls a `torch.library.custom_op` (so it works under
`torch.compile(fullgraph=True)` and CUDA graph capture; plain eager calls skip the
dispatcher, see `_call`). The custom op runs the
compiled kernel from `higgs_rt._C` (C++ on CPU, CUDA on GPU, launched on torch's
current stream) and falls back to the pure-torch `*_ref` implementation when the
extension is missing or lacks the tensor's device. The `*_ref` functions are also
the test oracle.

Layout: codes are int64, time-major [B, T, Q]. Out-of-range codes are clamped to
[0, K - 1] everywhere (stream BOS = K and EOS = K + 1 become K - 1).
"""

from __future__ import annotations

import torch
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
_TABLE_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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


def _launch(kernel: str, like: Tensor, *args) -> None:
    """Call _C.<kernel>(*args, device, stream): CPU is device -1; CUDA uses torch's current stream."""
    if like.device.type == "cuda":
        device, stream = like.device.index, _raw_stream(like.device.index)
    else:
        device, stream = -1, 0
    getattr(_C, kernel)(*args, device, stream)


def _call(impl, op, *args):
    """Run custom op `op` (whose body is `impl`). Plain eager calls run `impl` directly, skipping the
    torch.library dispatcher (~28 µs a call on an H200); compiled, traced, fake or mode-wrapped calls
    go through `op`. Inference only: neither path supports autograd."""
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
