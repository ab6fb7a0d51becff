"""Every private torch API higgs-rt uses, in one place, for the torch versions it was checked with.

AOTInductor's entry points and the loader of its packages live under private names (`torch._inductor`,
`torch._C._aoti`), as does the switch that traces size-oblivious dynamic dims. They change between torch
releases, so each use is a function here, and each first checks the running torch against `TESTED`: an
unsupported torch gets one clear `UnsupportedTorch` line (export exits 1 with it; the runtime warns and runs eager),
never an AttributeError from deep inside torch. Importing this module imports nothing private; the runtime's
per-call path is `Package.__call__`, the loader's `run` bound once at load. Packages are loaded from a directory
higgs-rt owns (`load_package`, `higgs_rt.unpacked`), so none leaves an extraction of torch's behind.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

TESTED = ((2, 11), (2, 13))  # first and last torch (major, minor) these uses were checked with


class UnsupportedTorch(RuntimeError):
    """The running torch is outside the versions whose private APIs higgs-rt's export path was checked with."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(version: str | None = None) -> None:
    """Raise UnsupportedTorch unless `version` (default: the running torch) is within TESTED."""
    if not TESTED[0] <= torch_version(version) <= TESTED[1]:
        first, last = (".".join(map(str, v)) for v in TESTED)
        raise UnsupportedTorch(f"torch {version or torch.__version__} is not supported by higgs-rt's exported "
                               f"packages (AOTInductor's APIs are private; checked with torch {first} to {last})")


def aoti_compile_and_package(program: torch.export.ExportedProgram, path: Path, configs: dict) -> None:
    """Compile an exported program into an AOTInductor package at `path` with these Inductor configs."""
    check_torch()
    import torch._inductor

    with short_operator_text():
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)


def _operator_text(target, args, kwargs) -> str:
    """An op and its arguments in one short line each: Inductor IR nodes by class and buffer name only."""
    def text(arg) -> str:
        if isinstance(arg, (list, tuple)):
            return "[" + ", ".join(map(text, arg)) + "]"
        name = getattr(arg, "get_name", None)
        if callable(name) and type(arg).__module__.startswith("torch._inductor"):
            try:
                return f"{type(arg).__name__}({name()})"
            except Exception:  # an IR node without a buffer (a view of one): its class says enough
                return type(arg).__name__
        return repr(arg)[:80]

    lines = [f"target: {target}"] + [f"args[{i}]: {text(arg)}" for i, arg in enumerate(args)]
    lines += [f"kwargs: {', '.join(f'{k}={text(v)}' for k, v in kwargs.items())}"] if kwargs else []
    return "\n".join("  " + line for line in lines)


def _set_operator_str(func):
    """Make `func` Inductor's `OperatorIssue.operator_str`; returns the one it replaces (None, and nothing changed,
    on a torch without it: outside TESTED)."""
    try:
        from torch._inductor.exc import OperatorIssue
    except ImportError:
        return None
    original = OperatorIssue.__dict__.get("operator_str")
    if original is not None:
        OperatorIssue.operator_str = func if isinstance(func, staticmethod) else staticmethod(func)
    return original


def compile_modes() -> list[str]:
    """The modes `torch.compile(mode=...)` takes, as the running torch's Inductor lists them; where it cannot (a
    torch that moved the list), the documented ones: this serves a check of an argument, never an error of its own."""
    try:
        from torch._inductor import list_mode_options

        return list(list_mode_options())
    except (ImportError, AttributeError, TypeError):
        return ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def use_short_operator_text() -> None:
    """`short_operator_text` for the rest of the process: for `torch.compile`, which compiles at a step's first
    calls (each bucket's, each recompile's), not at one place a context could cover. Only a log line's text, and
    only on a torch within TESTED (`torch.compile` is public: elsewhere it runs as it is, with no error)."""
    if TESTED[0] <= torch_version() <= TESTED[1]:
        _set_operator_str(_operator_text)


@contextlib.contextmanager
def short_operator_text() -> Iterator[None]:
    """Inductor, lowering the first call of an op it has no lowering for (every higgs-rt op), formats a log line
    of its arguments: torch 2.11 builds it even with the log off (2.13 builds it lazily). An IR node's text nests
    its inputs' text, so the line grows exponentially with the depth of the op chain: the CUDA step package's
    compile, a chain of ~150 higgs-rt ops, never ended (py-spy: `OperatorIssue.operator_str` under
    `GraphLowering.call_function`). While this is active the line names each argument instead."""
    original = _set_operator_str(_operator_text)
    try:
        yield
    finally:
        if original is not None:
            _set_operator_str(original)


@contextlib.contextmanager
def size_oblivious_tracing() -> Iterator[None]:
    """Trace dynamic dims without specialising sizes 0 and 1 (`backed_size_oblivious`)."""
    check_torch()
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True):
        yield


class Package:
    """A loaded AOTInductor package: bind its constants once, then call it with its flat tensor inputs. `hold`:
    what must live as long as the loader (the lock on the unpacked directory it was loaded from)."""

    def __init__(self, loader, hold=None):
        self._loader, self._hold = loader, hold
        self._run = loader.run  # inputs it mutates are updated in place; returns the flat outputs

    def constant_names(self) -> list[str]:
        """The constants (weights) the package needs bound: the original module's names (`talker.norm.weight`)."""
        return self._loader.get_constant_fqns()

    def bind_constants(self, tensors: dict[str, Tensor]) -> None:
        """Use these tensors as its constants, by pointer (no copy: keep them alive); every name must be given."""
        self._loader.load_constants(tensors, False, True, True)  # use_inactive, check_full_update, user_managed

    def __call__(self, *inputs: Tensor) -> list[Tensor]:
        return self._run(inputs)


LOADS_DIRECTORIES = (2, 13)  # the first torch whose package loader was checked to take an unpacked directory


def load_package(path: Path, device_index: int, single_threaded: bool = False, sha256: str | None = None) -> Package:
    """Load a package for the CPU (device_index -1) or one CUDA device, as torch's C++ loader does: without
    `aoti_load_package`'s device survey, which compiles and loads test programs (tens of seconds in a fresh
    process on the GPU machine) only to log a mismatch that higgs-rt's manifest already rules out.

    From LOADS_DIRECTORIES on, the loader gets the package unpacked under higgs-rt's home (`higgs_rt.unpacked`,
    by its content's `sha256`, computed when not given), not the .pt2, which it would extract into a $TMPDIR
    directory that a failed load or a killed process leaves behind; where the home cannot be written or is
    mounted noexec, and on older torch, it gets the .pt2."""
    check_torch()
    source, hold = path, None
    if torch_version() >= LOADS_DIRECTORIES:
        from .unpacked import unpack

        try:
            source, hold = unpack(path, sha256)
        except OSError:
            pass
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(source), "model", single_threaded, 1, device_index)
    except BaseException:
        if hold is not None:
            hold.close()
        raise
    return Package(loader, hold)
