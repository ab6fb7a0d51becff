"""Codec-side ops: delay-pattern revert and RVQ lookup (C++ and CUDA kernels), with their torch references.

Layout: codes are int64, time-major [B, T, Q]. Out-of-range codes are clamped to [0, K - 1] (stream BOS = K and
EOS = K + 1 become K - 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .library import FLOAT_DTYPES, OPS, check, native, register_fake


def _delay_window(codes: Tensor, num_codes: int, offset: int, length: int | None) -> int:
    """Validate the revert window; return its length L (frames out)."""
    _, s, q = codes.shape
    if num_codes < 1:
        raise ValueError(f"delay_revert: num_codes must be >= 1, got {num_codes}")
    if q < 1:
        raise ValueError(f"delay_revert: codes must have at least one codebook, got shape {tuple(codes.shape)}")
    if offset < 0:
        raise ValueError(f"delay_revert: offset must be >= 0, got {offset}")
    available = s - offset - q + 1
    if length is None:
        length = available
    if length < 0 or length > available:
        raise ValueError(f"delay_revert: length {length} with offset {offset} needs {offset + length + q - 1} "
                         f"delayed frames (Q={q}), codes has {s}")
    return length


def delay_revert_ref(codes: Tensor, num_codes: int, offset: int = 0, length: int | None = None) -> Tensor:
    """[B, S, Q] delayed -> [B, L, Q] aligned: out[b, t, k] = clip(codes[b, offset + t + k, k], 0, K - 1)."""
    b, _, q = codes.shape
    length = _delay_window(codes, num_codes, offset, length)
    t = torch.arange(length, device=codes.device)[:, None]
    k = torch.arange(q, device=codes.device)[None, :]
    index = (offset + t + k).expand(b, length, q)
    return codes.gather(1, index).clamp(0, num_codes - 1)


def delay_revert(codes: Tensor, num_codes: int, offset: int = 0, length: int | None = None) -> Tensor:
    """Revert the delay pattern of frames [B, S, Q] (codebook k lags k frames) -> aligned [B, L, Q].

    out[b, t, k] = clip(codes[b, offset + t + k, k], 0, num_codes - 1); L defaults to S - offset - Q + 1.
    """
    codes = check("delay_revert", "codes", codes, (torch.int64,), 3)
    length = _delay_window(codes, num_codes, offset, length)
    if not native(codes):
        return delay_revert_ref(codes, num_codes, offset, length)
    return OPS.delay_revert(codes, num_codes, offset, length)


@register_fake("delay_revert")
def _(codes, num_codes, offset, length):
    return codes.new_empty((codes.shape[0], length, codes.shape[2]))


def rvq_lookup_ref(codes: Tensor, table: Tensor) -> Tensor:
    """out[b, t] = sum_q table[q, clamp(codes[b, t, q], 0, K - 1)], summed in fp32 in q order."""
    q, k, d = table.shape
    codes = codes.clamp(0, k - 1)
    acc = torch.zeros(*codes.shape[:2], d, dtype=torch.float32, device=table.device)
    for i in range(q):
        acc += table[i][codes[..., i]].float()
    return acc.to(table.dtype)


def rvq_lookup(codes: Tensor, table: Tensor) -> Tensor:
    """codes [B, T, Q] int64, table [Q, K, D] -> [B, T, D] = sum_q table[q, codes[..., q]] (fp32 accumulation)."""
    codes = check("rvq_lookup", "codes", codes, (torch.int64,), 3)
    table = check("rvq_lookup", "table", table, FLOAT_DTYPES, 3, like=codes)
    if table.shape[0] != codes.shape[2]:
        raise ValueError(f"rvq_lookup: table must have Q={codes.shape[2]} codebooks (codes' last dim), "
                         f"got shape {tuple(table.shape)}")
    if table.shape[1] < 1:
        raise ValueError(f"rvq_lookup: table must have at least one code per codebook, got shape {tuple(table.shape)}")
    if not native(codes):
        return rvq_lookup_ref(codes, table)
    return OPS.rvq_lookup(codes, table)


@register_fake("rvq_lookup")
def _(codes, table):
    return table.new_empty((codes.shape[0], codes.shape[1], table.shape[2]))
