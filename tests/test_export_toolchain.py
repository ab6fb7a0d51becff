"""The export's C++ compiler check (tools/export/toolchain.py): a compiler that links libstdc++ statically into a
package's library makes packages that fail to load next to torch, so export picks another or refuses it before
compiling anything."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from higgs_rt.cli import main
from tools.export.loadcheck import build, check
from tools.export.toolchain import ToolchainError, choose_cxx, links_shared_libstdcxx, needed_libraries

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("g++"),
                                reason="needs Linux and g++")

# What the GPU machine's $CXX does: shared libraries get their own copy of libstdc++.
STATIC_WRAPPER = '#!/bin/sh\ncase " $* " in *" -shared "*) exec g++ -static-libstdc++ "$@";; *) exec g++ "$@";; esac\n'


@pytest.fixture
def static_cxx(tmp_path):
    path = tmp_path / "g++-static"
    path.write_text(STATIC_WRAPPER)
    path.chmod(0o755)
    return str(path)


def test_needed_libraries_reads_the_dynamic_section(tmp_path, static_cxx):
    source = tmp_path / "f.cpp"
    source.write_text("#include <string>\nstd::size_t f() { return std::string(\"x\").size(); }\n")
    for cxx, name in (("g++", "shared.so"), (static_cxx, "static.so")):
        subprocess.run([cxx, "-shared", "-fPIC", str(source), "-o", str(tmp_path / name)], check=True)
    assert {"libstdc++.so.6", "libc.so.6"} <= set(needed_libraries(tmp_path / "shared.so"))
    static = needed_libraries(tmp_path / "static.so")
    assert "libc.so.6" in static and not any(n.startswith("libstdc++") for n in static)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        needed_libraries(source)


def test_choose_cxx_passes_over_a_static_cxx_and_refuses_one_asked_for(static_cxx, monkeypatch):
    assert links_shared_libstdcxx("g++") and not links_shared_libstdcxx(static_cxx)
    assert not links_shared_libstdcxx("gcc")  # a C driver links no libstdc++ at all
    monkeypatch.setenv("CXX", static_cxx)
    cxx, note = choose_cxx()
    assert cxx == shutil.which("g++") and f"CXX={static_cxx} does not link the shared libstdc++" in note
    with pytest.raises(ToolchainError, match="its packages would crash at load"):
        choose_cxx(static_cxx)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert choose_cxx()[0] == shutil.which("g++")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ToolchainError, match="none of no-such-compiler, g\\+\\+, c\\+\\+ links"):
        choose_cxx()


def test_export_refuses_a_static_cxx_in_one_line_before_loading_the_model(static_cxx, capsys):
    assert main(["export", "--model", "/nonexistent/model", "--compute", "cpu", "--cxx", static_cxx]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"higgs-rt: error: --cxx {static_cxx} does not link a shared library against the shared "
                   "libstdc++; its packages would crash at load (pass a compiler that does, e.g. the system g++)"]


def test_a_package_from_a_static_cxx_does_not_load(static_cxx, tmp_path):
    """Why the check exists: the same one-layer package loads when g++ builds it (test_export's loadcheck test)."""
    ended = check("plain", build("plain", tmp_path, "cpu", static_cxx), "cpu")
    assert ended != "ok" and ended.endswith("while loading"), ended
