"""The Talker layer's row-wise steps around its matmuls, for the prompt forward (CUDA kernels in csrc/cuda/:
rms_norm.cu, rope_qkv.cu, silu_mul.cu) with their torch references.

- rms_norm / add_rms_norm: RMSNorm (a weight per row where a prompt mixes text and audio), the residual add before it;
- rope_qkv: the fused q/k/v projection split into heads, rotate-half RoPE on q and k;
- silu_mul: SwiGLU of the fused gate/up projection.
The references are the Talker's layer as written in torch (transformers' rounding: statistics in fp32, each
product rounded to the dtype). The kernels round every step the same way; RoPE and SwiGLU give torch's bits on
CUDA, RMSNorm differs only in the order of its fp32 sum of squares. They run on CUDA in any float dtype; the
references run on the CPU and inside `references()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .library import FLOAT_DTYPES, OPS, check, cuda_kernel, register_fake

# ----------------------------------------------------------------------------- RMSNorm


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, audio_weight: Tensor | None = None,
                 audio_rows: Tensor | None = None) -> Tensor:
    """weight * round(x * rsqrt(mean(x^2) + eps)) over the last dim, statistics in fp32; audio_weight instead on the
    rows where audio_rows (bool, x's leading dims) is set."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if audio_rows is None:
        return weight * normed
    return torch.where(audio_rows[..., None], audio_weight * normed, weight * normed)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float, audio_weight: Tensor | None = None,
                     audio_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    s = x + residual
    return s, rms_norm_ref(s, weight, eps, audio_weight, audio_rows)


def _norm_args(op: str, x: Tensor, weight: Tensor, eps: float, audio_weight: Tensor | None,
               audio_rows: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    if not isinstance(x, Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() < 1:
        raise ValueError(f"{op}: x must be a float tensor [..., H], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    h = x.shape[-1]
    for name, w in (("weight", weight), ("audio_weight", audio_weight)):
        if (w is not None or name == "weight") and check(op, name, w, (x.dtype,), 1, like=x).shape[0] != h:
            raise ValueError(f"{op}: {name} must have {h} entries (x's last dim), got shape {tuple(w.shape)}")
    if (audio_weight is None) != (audio_rows is None):
        raise ValueError(f"{op}: audio_weight and audio_rows come together")
    if audio_rows is not None:
        audio_rows = check(op, "audio_rows", audio_rows, (torch.bool,), x.dim() - 1, like=x)
        if tuple(audio_rows.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"{op}: audio_rows must be {list(x.shape[:-1])} (x's rows), got {tuple(audio_rows.shape)}")
    if not eps >= 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    return weight.contiguous(), None if audio_weight is None else audio_weight.contiguous(), audio_rows


def rms_norm(x: Tensor, weight: Tensor, eps: float, audio_weight: Tensor | None = None,
             audio_rows: Tensor | None = None) -> Tensor:
    """RMSNorm of x [..., H] with weight [H] (audio_weight [H] on the rows where audio_rows is set)."""
    weight, audio_weight, audio_rows = _norm_args("rms_norm", x, weight, eps, audio_weight, audio_rows)
    if not cuda_kernel(x):
        return rms_norm_ref(x, weight, eps, audio_weight, audio_rows)
    rows = None if audio_rows is None else audio_rows.reshape(-1)
    return OPS.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, audio_weight, rows, eps).view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, audio_weight: Tensor | None = None,
                 audio_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x + residual, rms_norm(x + residual, ...)): a layer's residual add and the next norm in one pass."""
    weight, audio_weight, audio_rows = _norm_args("add_rms_norm", x, weight, eps, audio_weight, audio_rows)
    residual = check("add_rms_norm", "residual", residual, (x.dtype,), x.dim(), like=x)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual must be shaped as x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not cuda_kernel(x):
        return add_rms_norm_ref(x, residual, weight, eps, audio_weight, audio_rows)
    rows = None if audio_rows is None else audio_rows.reshape(-1)
    h = x.shape[-1]
    s, normed = OPS.add_rms_norm(x.reshape(-1, h).contiguous(), residual.view(-1, h), weight, audio_weight, rows, eps)
    return s.view(x.shape), normed.view(x.shape)


@register_fake("rms_norm")
def _(x, weight, audio_weight, audio_rows, eps):
    return torch.empty_like(x)


@register_fake("add_rms_norm")
def _(x, residual, weight, audio_weight, audio_rows, eps):
    return torch.empty_like(x), torch.empty_like(x)


# ----------------------------------------------------------------------------- RoPE


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (the Llama/transformers convention) on x [B, H, T, D]; cos and sin [B or 1, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_qkv_ref(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int
                 ) -> tuple[Tensor, Tensor, Tensor]:
    b, t, _ = qkv.shape
    d = cos.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q.view(b, t, num_heads, d).transpose(1, 2)
    k = k.view(b, t, num_kv_heads, d).transpose(1, 2)
    v = v.view(b, t, num_kv_heads, d).transpose(1, 2)
    return rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None]), v


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int
             ) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [B, T, (Hq + 2 Hkv) * D], cos and sin [B or 1, T, D] -> q [B, Hq, T, D], k and v [B, Hkv, T, D]."""
    qkv = check("rope_qkv", "qkv", qkv, FLOAT_DTYPES, 3)
    cos = check("rope_qkv", "cos", cos, (qkv.dtype,), 3, like=qkv)
    sin = check("rope_qkv", "sin", sin, (qkv.dtype,), 3, like=qkv)
    b, t, width = qkv.shape
    d = cos.shape[-1]
    if num_heads < 1 or num_kv_heads < 1 or d < 2 or d % 2 or width != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"rope_qkv: qkv {tuple(qkv.shape)} is not {num_heads} + 2 x {num_kv_heads} heads of "
                         f"cos's {d}")
    if cos.shape[0] not in (1, b) or cos.shape[1] != t or sin.shape != cos.shape:
        raise ValueError(f"rope_qkv: cos and sin must be [1 or {b}, {t}, {d}], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if not cuda_kernel(qkv):
        return rope_qkv_ref(qkv, cos, sin, num_heads, num_kv_heads)
    return OPS.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads)


@register_fake("rope_qkv")
def _(qkv, cos, sin, num_heads, num_kv_heads):
    b, t, _ = qkv.shape
    d = cos.shape[-1]
    return (qkv.new_empty((b, num_heads, t, d)), qkv.new_empty((b, num_kv_heads, t, d)),
            qkv.new_empty((b, num_kv_heads, t, d)))


# ----------------------------------------------------------------------------- SwiGLU


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate first) -> [..., I]."""
    if not isinstance(gate_up, Tensor) or gate_up.dtype not in FLOAT_DTYPES or gate_up.dim() < 1 \
            or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up must be a float tensor [..., 2I], got "
                         f"{getattr(gate_up, 'dtype', type(gate_up).__name__)} {tuple(getattr(gate_up, 'shape', ()))}")
    if not cuda_kernel(gate_up):
        return silu_mul_ref(gate_up)
    width = gate_up.shape[-1]
    out = OPS.silu_mul(gate_up.reshape(-1, width).contiguous())
    return out.view(*gate_up.shape[:-1], width // 2)


@register_fake("silu_mul")
def _(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
