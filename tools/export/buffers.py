"""What an exported step allocates per call, read from the C++ wrapper code AOTInductor keeps in every package.

A decode step must update the KV cache in place. A cache write that torch.export functionalises and Inductor does
not turn back into an in-place one becomes a copy: a buffer as large as a layer of the cache (or the whole cache),
written and read every frame. Every intermediate of a decode step is far smaller than one layer of the cache
(B x Hkv x context x head_dim), so any allocation that large, or any clone, is such a copy.

Except one kind of clone: AOTInductor's CUDA wrapper compiles its kernels for 16-byte aligned inputs and guards
every input so compiled (every tensor input of a GPU package) with `if (input misaligned) { clone it }`. That clone
runs only for a misaligned input, never for the runtime's state (`higgs_rt.compiled` binds only aligned state), so
the guards (`alignment_guards`) are not counted as copies.
"""

from __future__ import annotations

import math
import re
import zipfile
from pathlib import Path

_ARRAY = re.compile(r"int_array_(\d+)\[\] = \{([^}]*)\}")
_ALLOCATION = re.compile(r"aoti_torch_empty_strided\(\d+, int_array_(\d+),")
_CLONE = re.compile(r"\baoti_torch_\w*clone\w*\(")
# torch/_inductor/codegen/cpp_wrapper_gpu.py, CppWrapperGpu.codegen_inputs (some torch releases cast to long):
# `if ((reinterpret_cast<std::uintptr_t>(X.data_ptr()) & (16 -1)) != 0) { warn; clone X into X_aligned; X = it }`
_ALIGNMENT_GUARD = re.compile(
    r"if\s*\(\(\s*(?:reinterpret_cast<std::uintptr_t>|long)\((\w+)\.data_ptr\(\)\)\s*&\s*\(\s*\d+\s*-\s*1\s*\)\s*\)"
    r"\s*!=\s*0\s*\)\s*\{"
    r"[^{}]*?\baoti_torch_clone_preserve_strides\(\1,\s*&\1_aligned\);"
    r"\s*\1\s*=\s*std::move\(RAIIAtenTensorHandle\(\1_aligned\)\);\s*\}")


def wrapper_source(package: Path) -> str:
    """The generated wrapper (host) code of an AOTInductor package: the allocations and kernel calls of a run."""
    with zipfile.ZipFile(package) as archive:
        names = [n for n in archive.namelist() if n.endswith(".wrapper.cpp")]
        if len(names) != 1:
            raise ValueError(f"{package} holds {len(names)} wrapper sources, expected 1")
        return archive.read(names[0]).decode()


def allocations(source: str) -> list[tuple[int, ...]]:
    """The shape of every buffer the wrapper allocates, in code order."""
    arrays = {index: tuple(int(v.strip().rstrip("L")) for v in values.split(",") if v.strip())
              for index, values in _ARRAY.findall(source)}
    return [arrays[index] for index in _ALLOCATION.findall(source)]


def alignment_guards(source: str) -> list[str]:
    """The inputs the wrapper clones only when they are misaligned at run time (GPU packages guard every input)."""
    return _ALIGNMENT_GUARD.findall(source)


def clones(source: str) -> int:
    """The clone calls of the wrapper that run unconditionally (those of the alignment guards left out)."""
    return len(_CLONE.findall(_ALIGNMENT_GUARD.sub("", source)))


def cache_copies(package: Path, layer_elements: int) -> list[str]:
    """What in a step package copies the KV cache: allocations of at least `layer_elements` (one layer of the
    K cache for the step's batch), and clones (not an input's alignment guard). An empty list: the step writes the
    cache in place."""
    source = wrapper_source(package)
    found = [f"a buffer of shape {list(shape)}" for shape in allocations(source) if math.prod(shape) >= layer_elements]
    return found + [f"{clones(source)} clone calls"] * bool(clones(source))
