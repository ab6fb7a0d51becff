"""Loading higgs-rt's kernel library and what every op wrapper shares.

`libhiggs_rt_ops.so` (built from csrc/ by CMake) registers the operators `torch.ops.higgs_rt.*` in C++, with their
schemas. This module loads it once, says what it holds (`HAS_EXTENSION`, `HAS_CUDA_KERNELS`, `CUDA_ARCHS`), and
holds the argument checks and the `references()` switch that every op wrapper uses. Without the library (a
source tree that was never built) every op runs its pure-torch reference.

The wrappers raise a ValueError naming the op and the argument. The C++ ops check again (graphs call them with no
wrapper in between): the stable ABI has no ValueError of its own (STD_TORCH_CHECK raises RuntimeError), so their
checks throw std::invalid_argument, which reaches Python as ValueError too.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

LIBRARY_NAME = "libhiggs_rt_ops.so"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def library_path() -> Path | None:
    """The built libhiggs_rt_ops.so this package loads (None: not built), e.g. for a C++ host's --ops."""
    import higgs_rt

    for folder in higgs_rt.__path__:  # an editable install keeps the build output beside the sources
        path = Path(folder) / LIBRARY_NAME
        if path.is_file():
            return path
    return None


def _load() -> tuple[bool, str]:
    path = library_path()
    if path is None:
        return False, ""
    archs = ctypes.CDLL(str(path)).higgs_rt_cuda_archs
    archs.restype = ctypes.c_char_p
    torch.ops.load_library(str(path))
    return True, archs().decode()


HAS_EXTENSION, CUDA_ARCHS = _load()
HAS_CUDA_KERNELS: bool = bool(CUDA_ARCHS)
OPS = torch.ops.higgs_rt


def register_fake(name: str):
    """torch.library.register_fake for one of the library's ops (a no-op without the library)."""
    if HAS_EXTENSION:
        return torch.library.register_fake(f"higgs_rt::{name}")
    return lambda fn: fn


_use_references = False


@contextlib.contextmanager
def references() -> Iterator[None]:
    """Inside, every op runs its pure-torch reference (traced as plain aten ops) and the Talker decodes without
    the fused kernels: what `higgs-rt export --kernels torch` traces, and the oracle of every fast path."""
    global _use_references
    previous, _use_references = _use_references, True
    try:
        yield
    finally:
        _use_references = previous


def using_references() -> bool:
    return _use_references


def native(t: Tensor) -> bool:
    """Run the library's kernel for t's device: CPU kernels always, CUDA ones when built with CUDA."""
    if _use_references or not HAS_EXTENSION:
        return False
    return t.device.type == "cpu" or (t.device.type == "cuda" and HAS_CUDA_KERNELS)


def cuda_kernel(t: Tensor) -> bool:
    """Run the library's CUDA kernel (for the CUDA-only ops)."""
    return not _use_references and t.device.type == "cuda" and HAS_CUDA_KERNELS


def aligned16(*tensors: Tensor) -> bool:
    """16-byte aligned data; tensors without data (traced, fake) count as aligned, as fresh allocations are."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        try:
            if t.data_ptr() % 16:
                return False
        except RuntimeError:
            continue
    return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check(op: str, name: str, t, dtypes: tuple[torch.dtype, ...], ndim: int, like: Tensor | None = None,
          mutated: bool = False) -> Tensor:
    """Validate one tensor argument of `op` (a ValueError naming the op, the argument and its shape); return it
    contiguous. An argument the op writes in place (`mutated`) must be contiguous already: a copy would take the
    writes."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(dtype_name(d) for d in dtypes)
        raise ValueError(f"{op}: {name} must be {want}, got {dtype_name(t.dtype)} of shape {tuple(t.shape)}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{op}: {name} must be on {like.device}, got {t.device}")
    if mutated and not t.is_contiguous():
        raise ValueError(f"{op}: {name} is written in place, so it must be contiguous, got shape {tuple(t.shape)} "
                         f"with strides {t.stride()}")
    return t.contiguous()


def check_int(op: str, name: str, value, low: int, high: int) -> int:
    """Validate an int argument of `op`: low <= value <= high (a ValueError naming the op and the argument)."""
    if not isinstance(value, (int, torch.SymInt)) or not low <= value <= high:
        raise ValueError(f"{op}: {name} must be an int from {low} to {high}, got {value!r}")
    return value
