"""The decode step's matmuls (csrc/cuda/gemv.cu): x [B, K] @ w[N, K]^T for 1 <= B <= 64, with what a Llama layer
does around each one fused in: RMSNorm before (the `norm_*` ops), and after it the residual add, SiLU(gate) * up,
RoPE + KV-cache write, or fp32 logits.

Each op has a pure-torch `*_ref` in fp32 (the oracle of the tests) and runs it on the CPU, in `references()`,
and wherever the CUDA kernel does not take the arguments (fp32, K % 8 != 0, misaligned data, B > 64). The kernel
rounds x * norm_weight to the weights' dtype before the tensor-core products; the references do not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .library import HALF_DTYPES, OPS, aligned16, check, check_int, cuda_kernel, register_fake

GEMV_MAX_BATCH = 64


def _args(op: str, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    x = check(op, "x", x, HALF_DTYPES + (torch.float32,), 2)
    w = check(op, "w", w, (x.dtype,), 2, like=x)
    if not 1 <= x.shape[0] <= GEMV_MAX_BATCH:
        raise ValueError(f"{op}: x must have 1 to {GEMV_MAX_BATCH} rows, got shape {tuple(x.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: w must have K={x.shape[1]} columns (x's last dim), got shape {tuple(w.shape)}")
    return x, w


def _norm_weight(op: str, norm_weight: Tensor, x: Tensor, eps: float) -> Tensor:
    norm_weight = check(op, "norm_weight", norm_weight, (x.dtype,), 1, like=x)
    if norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: norm_weight must have {x.shape[1]} entries, got shape {tuple(norm_weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    return norm_weight


def _ahead(op: str, ahead: Tensor | None, x: Tensor) -> Tensor | None:
    """The `ahead` hint: rows [R, K] or runs of rows [P, R, K] of a weight a later op streams, each run contiguous
    (a slice of the weight, or of its stacked halves: `w.view(2, -1, K)[:, :r]`), 16-byte aligned runs of a
    multiple of 16 bytes, never copied. The CUDA kernel asks L2 for those bytes ($HIGGS_RT_L2_AHEAD_AT says when);
    y does not depend on it."""
    if ahead is None:
        return None
    if not isinstance(ahead, Tensor):
        raise ValueError(f"{op}: ahead must be a torch.Tensor or None, got {type(ahead).__name__}")
    if ahead.device != x.device:
        raise ValueError(f"{op}: ahead must be on {x.device}, got {ahead.device}")
    if ahead.dim() not in (2, 3):
        raise ValueError(f"{op}: ahead must be rows [R, K] or runs of rows [P, R, K], got shape {tuple(ahead.shape)}")
    if ahead.stride(-1) != 1 or (ahead.shape[-2] > 1 and ahead.stride(-2) != ahead.shape[-1]):
        raise ValueError(f"{op}: each run of ahead's rows must be contiguous, got shape {tuple(ahead.shape)} with "
                         f"strides {ahead.stride()}")
    size = ahead.element_size()
    run, apart = ahead.shape[-2] * ahead.shape[-1] * size, (ahead.stride(0) * size if ahead.dim() == 3 else 0)
    if not aligned16(ahead) or run % 16 or apart % 16:
        raise ValueError(f"{op}: ahead's runs must be 16-byte aligned and a multiple of 16 bytes, got shape "
                         f"{tuple(ahead.shape)} with strides {ahead.stride()}")
    return ahead


def _kernel(x: Tensor, *tensors: Tensor) -> bool:
    return cuda_kernel(x) and x.dtype in HALF_DTYPES and x.shape[1] % 8 == 0 and aligned16(x, *tensors)


def _normed(x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * norm_weight."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()


# ----------------------------------------------------------------------------- plain and residual


def gemv_ref(x: Tensor, w: Tensor) -> Tensor:
    """y = x @ w.T accumulated in fp32, returned in x's dtype (x [B, K], w [N, K])."""
    return (x.float() @ w.float().t()).to(x.dtype)


def gemv(x: Tensor, w: Tensor) -> Tensor:
    """Decode-time linear layer: x [B, K] (1 <= B <= 64), w [N, K] (nn.Linear layout) -> x @ w.T [B, N].

    bf16 or fp16 on CUDA: a weight-streaming kernel reads w once for all B rows, fp32 accumulation; elsewhere
    gemv_ref.
    """
    x, w = _args("gemv", x, w)
    return OPS.gemv(x, w) if _kernel(x, w) else gemv_ref(x, w)


@register_fake("gemv")
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


def gemv_residual_ref(x: Tensor, w: Tensor, residual: Tensor) -> Tensor:
    return (residual.float() + x.float() @ w.float().t()).to(x.dtype)


def gemv_residual(x: Tensor, w: Tensor, residual: Tensor, ahead: Tensor | None = None) -> Tensor:
    """residual + x @ w.T (the attention output and MLP down projections with their residual add); `ahead`: a
    later op's weights to warm in L2 meanwhile (_ahead)."""
    x, w = _args("gemv_residual", x, w)
    residual = check("gemv_residual", "residual", residual, (x.dtype,), 2, like=x)
    if residual.shape != (x.shape[0], w.shape[0]):
        raise ValueError(f"gemv_residual: residual must have shape {(x.shape[0], w.shape[0])}, got "
                         f"{tuple(residual.shape)}")
    ahead = _ahead("gemv_residual", ahead, x)
    return OPS.gemv_residual(x, w, residual, ahead) if _kernel(x, w) else gemv_residual_ref(x, w, residual)


@register_fake("gemv_residual")
def _(x, w, residual, ahead=None):
    return x.new_empty((x.shape[0], w.shape[0]))


# ----------------------------------------------------------------------------- RMSNorm in front


def norm_gemv_silu_ref(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor) -> Tensor:
    gate, up = (_normed(x, norm_weight, eps) @ w.float().t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def norm_gemv_silu(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor) -> Tensor:
    """The gated MLP's first half: w stacks gate and up [2 * hidden, K]; -> silu(gate) * up [B, hidden] of
    RMSNorm(x) * norm_weight."""
    x, w = _args("norm_gemv_silu", x, w)
    norm_weight = _norm_weight("norm_gemv_silu", norm_weight, x, eps)
    if w.shape[0] % 2:
        raise ValueError(f"norm_gemv_silu: w must stack gate and up rows (an even count), got shape {tuple(w.shape)}")
    if _kernel(x, w, norm_weight) and w.shape[0] % 16 == 0:
        return OPS.norm_gemv_silu(x, norm_weight, eps, w)
    return norm_gemv_silu_ref(x, norm_weight, eps, w)


@register_fake("norm_gemv_silu")
def _(x, norm_weight, eps, w):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


def norm_gemv_logits_ref(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor) -> Tensor:
    return (_normed(x, norm_weight, eps) @ w.float().t()).to(x.dtype).float()


def norm_gemv_logits(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, ahead: Tensor | None = None) -> Tensor:
    """The head: RMSNorm(x) * norm_weight @ w.T, rounded to x's dtype, as fp32 [B, N]; `ahead` as gemv_residual's."""
    x, w = _args("norm_gemv_logits", x, w)
    norm_weight = _norm_weight("norm_gemv_logits", norm_weight, x, eps)
    ahead = _ahead("norm_gemv_logits", ahead, x)
    if _kernel(x, w, norm_weight):
        return OPS.norm_gemv_logits(x, norm_weight, eps, w, ahead)
    return norm_gemv_logits_ref(x, norm_weight, eps, w)


@register_fake("norm_gemv_logits")
def _(x, norm_weight, eps, w, ahead=None):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def rotate(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate-half RoPE in fp32: x [B, H, D], positions [B], inv_freq [D / 2]."""
    angles = positions.float()[:, None, None] * inv_freq.float()
    cos, sin = angles.cos(), angles.sin()
    lo, hi = x.float().chunk(2, dim=-1)
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


def norm_qkv_rope_ref(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, inv_freq: Tensor, lengths: Tensor,
                      k_cache: Tensor, v_cache: Tensor, layer: int) -> Tensor:
    _, _, hkv, s, d = k_cache.shape
    b = x.shape[0]
    hq = w.shape[0] // d - 2 * hkv
    qkv = (_normed(x, norm_weight, eps) @ w.float().t()).view(b, hq + 2 * hkv, d)
    pos = lengths.clamp(0, s - 1)
    q = rotate(qkv[:, :hq], pos, inv_freq)
    k = rotate(qkv[:, hq:hq + hkv], pos, inv_freq)
    rows = torch.arange(b, device=x.device)
    k_cache[layer, rows, :, pos] = k.to(k_cache.dtype)
    v_cache[layer, rows, :, pos] = qkv[:, hq + hkv:].to(v_cache.dtype)
    return q.to(x.dtype)


def norm_qkv_rope(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, inv_freq: Tensor, lengths: Tensor,
                  k_cache: Tensor, v_cache: Tensor, layer: int) -> Tensor:
    """Attention's input side for one decode position per slot: RMSNorm(x) * norm_weight @ w.T with w the fused
    q/k/v projection [(Hq + 2 Hkv) * D, K]; RoPE (rotate-half, angles pos * inv_freq, pos = clamp(lengths[b], 0,
    S - 1)) on q and k; k and v written into k_cache / v_cache [layers, slots >= B, Hkv, S, D] at (layer, b, :,
    pos): the first B slots (a step over the lowest slots of a larger cache).
    Returns q [B, Hq, D]. The caches are updated in place (declared mutated in the op's schema), so they must be
    contiguous."""
    op = "norm_qkv_rope"
    x, w = _args(op, x, w)
    norm_weight = _norm_weight(op, norm_weight, x, eps)
    k_cache = check(op, "k_cache", k_cache, (x.dtype,), 5, like=x, mutated=True)
    v_cache = check(op, "v_cache", v_cache, (x.dtype,), 5, like=x, mutated=True)
    lengths = check(op, "lengths", lengths, (torch.int64,), 1, like=x)
    inv_freq = check(op, "inv_freq", inv_freq, (torch.float32,), 1, like=x)
    n_layers, slots, hkv, s, d = k_cache.shape
    b = x.shape[0]
    if v_cache.shape != k_cache.shape or slots < b or s < 1:
        raise ValueError(f"{op}: caches must be [layers, slots >= B={x.shape[0]}, Hkv, S, D], got k_cache "
                         f"{tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    if d % 2 or w.shape[0] % d or w.shape[0] // d <= 2 * hkv:
        raise ValueError(f"{op}: w must be [(Hq + 2 Hkv) * D, K] with Hkv={hkv}, D={d}, got {tuple(w.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"{op}: lengths must have shape ({b},), got {tuple(lengths.shape)}")
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"{op}: inv_freq must have shape ({d // 2},), got {tuple(inv_freq.shape)}")
    check_int(op, "layer", layer, 0, n_layers - 1)
    if _kernel(x, w, norm_weight, k_cache, v_cache) and d % 16 == 0:
        return OPS.norm_qkv_rope(x, norm_weight, eps, w, inv_freq, lengths, k_cache, v_cache, layer)
    return norm_qkv_rope_ref(x, norm_weight, eps, w, inv_freq, lengths, k_cache, v_cache, layer)


@register_fake("norm_qkv_rope")
def _(x, norm_weight, eps, w, inv_freq, lengths, k_cache, v_cache, layer):
    d, hkv = k_cache.shape[4], k_cache.shape[2]
    return x.new_empty((x.shape[0], w.shape[0] // d - 2 * hkv, d))
