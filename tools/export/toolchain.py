"""The C++ compiler AOTInductor builds each package's library with, checked before minutes of compiling.

A package library that carries its own static copy of libstdc++ crashes when it is loaded into a process that
already uses the shared one (torch's): the two copies share `std::locale` state, and the model's constructor
dies in `std::regex` (seen on the GPU machine, whose `CXX` wrapper links `-static-libstdc++`: every package
SIGSEGVed in `aoti_load_package`; the same packages built with the system g++ load and run). So the chosen
compiler first links a one-function shared library, and its ELF dependencies must name libstdc++.so.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE_SOURCE = "#include <locale>\n#include <string>\nstd::size_t probe() { return std::locale().name().size(); }\n"


class ToolchainError(RuntimeError):
    """No C++ compiler here builds package libraries that load next to torch."""


def inductor_configs(cxx: str | None) -> dict:
    """The Inductor config that makes AOTInductor build with `cxx` (None: Inductor's own choice)."""
    return {"cpp.cxx": (cxx,)} if cxx else {}


def needed_libraries(path: Path) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared library."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                names.append(data[strtab + value:data.index(b"\0", strtab + value)].decode())
    return names


def links_shared_libstdcxx(cxx: str) -> bool:
    """Whether `cxx` links a shared library against the shared libstdc++ (False also when it cannot link one)."""
    with tempfile.TemporaryDirectory(prefix="higgs-rt-cxx-") as tmp:
        source, library = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        source.write_text(PROBE_SOURCE)
        try:
            proc = subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(source), "-o", str(library)],
                                  capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return proc.returncode == 0 and any(n.startswith("libstdc++.so") for n in needed_libraries(library))


def choose_cxx(requested: str | None = None) -> tuple[str | None, str]:
    """(compiler for AOTInductor or None where nothing needs checking, a line saying why it was chosen).

    `requested` (--cxx) must pass the check; else $CXX, then g++ and c++ on PATH, the first that passes.
    """
    if not sys.platform.startswith("linux"):
        return None, "C++ compiler: Inductor's default"
    if requested is not None:
        if not requested.strip():  # not "the default": an empty value is a mistake, said before anything loads
            raise ValueError("--cxx is empty: name a C++ compiler, or leave --cxx out for $CXX, g++ or c++")
        if not links_shared_libstdcxx(requested):
            raise ToolchainError(f"--cxx {requested} does not link a shared library against the shared libstdc++; "
                                 "its packages would crash at load (pass a compiler that does, e.g. the system g++)")
        return requested, f"C++ compiler: {requested} (--cxx)"
    env = os.environ.get("CXX")
    candidates = [c for c in (env, "g++", "c++") if c]
    for cxx in dict.fromkeys(candidates):
        path = shutil.which(cxx)
        if path and links_shared_libstdcxx(path):
            why = ("" if cxx == env or not env
                   else f" (CXX={env} does not link the shared libstdc++: its packages would crash)")
            return path, f"C++ compiler: {path}{why}"
    raise ToolchainError(f"none of {', '.join(candidates)} links a shared library against the shared libstdc++, "
                         "so AOTInductor packages would crash at load; install g++ or pass --cxx")
