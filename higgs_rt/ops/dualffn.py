"""DualFFN routing for the prompt prefill: text rows first, then audio rows, and back (C++ and CUDA kernels)."""

from __future__ import annotations

import torch
from torch import Tensor

from .library import FLOAT_DTYPES, OPS, check, native, register_fake


def dualffn_route_ref(hidden: Tensor, audio_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Text rows first then audio rows, stable: (hidden[perm], perm, n_audio as a 0-d int64 tensor)."""
    perm = torch.argsort(audio_mask.to(torch.int8), stable=True)
    n_audio = audio_mask.sum(dtype=torch.int64)
    return hidden[perm], perm, n_audio


def dualffn_unroute_ref(y: Tensor, perm: Tensor) -> Tensor:
    """Inverse of the routing gather: out[perm[i]] = y[i]."""
    return torch.empty_like(y).index_copy_(0, perm, y)


def dualffn_route(hidden: Tensor, audio_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], audio_mask [N] bool -> (routed [N, H], perm [N] int64, n_audio 0-d int64), no host sync.

    perm lists text rows then audio rows (stable); routed = hidden[perm]; audio rows are routed[N - n_audio:].
    """
    hidden = check("dualffn_route", "hidden", hidden, FLOAT_DTYPES, 2)
    audio_mask = check("dualffn_route", "audio_mask", audio_mask, (torch.bool,), 1, like=hidden)
    if audio_mask.shape[0] != hidden.shape[0]:
        raise ValueError(f"dualffn_route: audio_mask must have shape ({hidden.shape[0]},), got "
                         f"{tuple(audio_mask.shape)}")
    if not native(hidden):
        return dualffn_route_ref(hidden, audio_mask)
    return tuple(OPS.dualffn_route(hidden, audio_mask))


@register_fake("dualffn_route")
def _(hidden, audio_mask):
    n = hidden.shape[0]
    return torch.empty_like(hidden), hidden.new_empty((n,), dtype=torch.int64), hidden.new_empty((), dtype=torch.int64)


def dualffn_unroute(y: Tensor, perm: Tensor) -> Tensor:
    """Undo dualffn_route: out[perm[i]] = y[i].

    perm must be a permutation of 0 .. N - 1 (as dualffn_route gives). The CPU kernel raises otherwise; the CUDA
    kernel does not check (that would cost a host sync): it skips entries out of range and leaves the rows no
    entry names unwritten."""
    y = check("dualffn_unroute", "y", y, FLOAT_DTYPES, 2)
    perm = check("dualffn_unroute", "perm", perm, (torch.int64,), 1, like=y)
    if perm.shape[0] != y.shape[0]:
        raise ValueError(f"dualffn_unroute: perm must have shape ({y.shape[0]},), got {tuple(perm.shape)}")
    if not native(y):
        return dualffn_unroute_ref(y, perm)
    return OPS.dualffn_unroute(y, perm)


@register_fake("dualffn_unroute")
def _(y, perm):
    return torch.empty_like(y)
