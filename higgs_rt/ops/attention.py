"""Decode attention over each slot's live length (csrc/cuda/decode_attention.cu), and its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .library import FLOAT_DTYPES, OPS, aligned16, check, cuda_kernel, register_fake

DECODE_ATTENTION_HEAD_DIMS = (64, 128)  # head dims with a CUDA kernel; others run the reference


def decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> Tensor:
    """Masked SDPA (fp32) of q [B, Hq, D] over the first lengths[b] positions of k/v [slots >= B, Hkv, S, D]
    (the first B slots); GQA maps query head h to KV head h // (Hq / Hkv). Lengths are clamped to [0, S]; a slot
    of length 0 gives zeros."""
    b, hq, _ = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    k_cache, v_cache = k_cache[:b], v_cache[:b]
    valid = torch.arange(s, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k_cache.float(), v_cache.float(),
                                         attn_mask=valid[:, None, None, :], enable_gqa=hq != hkv)[:, :, 0]
    return out.masked_fill((lengths <= 0)[:, None, None], 0.0).to(q.dtype)  # all-masked rows are NaN in SDPA


def attention_counters(batch: int, query_heads: int, device) -> Tensor:
    """The zeroed int32 counters decode_attention's kernel needs; it leaves them zeroed, so keep and reuse them."""
    return torch.zeros(batch * query_heads, dtype=torch.int32, device=device)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor,
                     counters: Tensor | None = None) -> Tensor:
    """One decode step's attention: q [B, Hq, D] over k_cache / v_cache [slots, Hkv, S, D] -> [B, Hq, D]: the
    first B of the cache's slots (slots >= B: a step over the lowest slots of a larger cache).

    out[b, h] = softmax(q[b, h] . k[b, h // (Hq / Hkv), :L] * D^-0.5) @ v[b, h // (Hq / Hkv), :L] with
    L = lengths[b] (int64 on q's device, clamped to [0, S]; the new position is already in the cache, so L
    counts it; L = 0 gives zeros). fp32 softmax; q and the caches share one dtype. On CUDA (D in
    DECODE_ATTENTION_HEAD_DIMS) the lengths are read by the kernel (no host sync, CUDA-graph safe), the keys are
    split in fixed chunks across blocks and merged in the same launch, and `counters`
    (`attention_counters(B, Hq)`, contiguous, made per call when None) coordinate the merge; elsewhere
    decode_attention_ref.
    """
    op = "decode_attention"
    q = check(op, "q", q, FLOAT_DTYPES, 3)
    k_cache = check(op, "k_cache", k_cache, (q.dtype,), 4, like=q)
    v_cache = check(op, "v_cache", v_cache, (q.dtype,), 4, like=q)
    lengths = check(op, "lengths", lengths, (torch.int64,), 1, like=q)
    b, hq, d = q.shape
    if k_cache.shape[0] < b or k_cache.shape[3] != d or k_cache.shape[1] < 1 or k_cache.shape[2] < 1:
        raise ValueError(f"{op}: k_cache must be [slots >= B={b}, Hkv, S, D={d}] with Hkv, S >= 1, got shape "
                         f"{tuple(k_cache.shape)}")
    if hq % k_cache.shape[1] != 0:
        raise ValueError(f"{op}: k_cache's {k_cache.shape[1]} KV heads must divide q's {hq} heads")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"{op}: lengths must have shape ({b},), got {tuple(lengths.shape)}")
    if counters is not None:
        counters = check(op, "counters", counters, (torch.int32,), 1, like=q, mutated=True)
        if counters.shape[0] < b * hq:
            raise ValueError(f"{op}: counters must have at least B * Hq = {b * hq} entries, got shape "
                             f"{tuple(counters.shape)}")
    if not (cuda_kernel(q) and d in DECODE_ATTENTION_HEAD_DIMS and aligned16(q, k_cache, v_cache)):
        return decode_attention_ref(q, k_cache, v_cache, lengths)
    if counters is None:
        counters = attention_counters(b, hq, q.device)
    return OPS.decode_attention(q, k_cache, v_cache, lengths, counters)


@register_fake("decode_attention")
def _(q, k_cache, v_cache, lengths, counters):
    return torch.empty_like(q)
