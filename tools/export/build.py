"""`export_artifacts`: load a checkpoint as the runtime does, compile its programs with AOTInductor, write the
manifest last (a directory without one is never used)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from higgs_rt import ops
from higgs_rt.audio_file import OutputRefused, OutputUnwritable
from higgs_rt.codec import load_codec, resolve_codec_dir
from higgs_rt.compiled import CODEC, MANIFEST, PREFILL, SUBDIR, file_sha256, state_spec, step_file, target
from higgs_rt.config import TalkerConfig, short_value
from higgs_rt.model import default_device, resolve_dtype as _dtype
from higgs_rt.generate import DEFAULT_CONTEXT, Decoder
from higgs_rt.hub import resolve_model_dir
from higgs_rt.params import check_context
from higgs_rt.talker import KVCache, KVCacheTooLarge, Talker
from higgs_rt.torch_compat import aoti_compile_and_package, check_torch

from .buffers import cache_copies
from .host import WEIGHTS, write_host_weights
from .probe import ExportProbeError, command, run_probe
from .programs import export_codec, export_prefill, export_step
from .toolchain import choose_cxx, inductor_configs

KERNELS = ("higgs-rt", "torch")
MAX_BATCH_SIZES = 8  # step packages one export writes (1, 2, 4, ... 64 is 7)
# Weights stay out of the packages: the runtime binds its loaded tensors (higgs_rt.compiled).
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}
# On CPU, inductor's C++ vectoriser spends minutes on the sampler's fused integer hashing; realising
# intermediates of more than 8 ops cut the tiny step's compile from 57 s to 13 s at the same speed.
CPU_INDUCTOR_CONFIGS = {"realize_opcount_threshold": 8}


def custom_ops(program) -> list[str]:
    """The higgs-rt kernels (`higgs_rt::*` ops) a program calls: they run inside its package. An op that mutates
    an input (the KV-cache write, the attention counters) appears wrapped in `auto_functionalized(_v2)`, which
    Inductor turns back into the in-place call."""
    found = set()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if getattr(target, "namespace", None) == "higgs_rt":
            found.add(target.name())
        elif getattr(target, "namespace", None) == "higher_order" and node.args and \
                getattr(node.args[0], "namespace", None) == "higgs_rt":
            found.add(node.args[0].name())
    return sorted(found)


def package_configs(device: torch.device, cxx: str | None = None) -> dict:
    """The Inductor config every package is compiled with."""
    return {**INDUCTOR_CONFIGS, **(CPU_INDUCTOR_CONFIGS if device.type == "cpu" else {}), **inductor_configs(cxx)}


def _compile(program, path: Path, device: torch.device, cxx: str | None, log) -> dict:
    nodes = sum(1 for node in program.graph.nodes if node.op == "call_function")
    log(f"  {path.name}: compiling {nodes} ops")  # a compile that never ends still says which package, how large
    start = time.perf_counter()
    aoti_compile_and_package(program, path, package_configs(device, cxx))
    seconds = time.perf_counter() - start
    kernels = custom_ops(program)
    log(f"  {path.name}: {seconds:.1f} s, {path.stat().st_size / 1e6:.1f} MB, kernels: {', '.join(kernels) or '-'}")
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size, "compile_s": round(seconds, 1),
            "custom_ops": kernels}


def package(what: str, batch: int | None, talker: Talker | None, code2wav, out: Path, device: torch.device,
            cxx: str | None, context: int, log) -> tuple[str, dict]:
    """Export and compile one package, "prefill", "step" (of `batch` slots) or "codec" (run under no_grad, and
    under ops.references() for kernels="torch") -> (its file name, its manifest entry)."""
    if what == "prefill":
        return PREFILL, _compile(export_prefill(talker, context), out / PREFILL, device, cxx, log)
    if what == "step":
        decoder = Decoder(talker, batch=batch, context=context)
        entry = _compile(export_step(decoder), out / step_file(batch), device, cxx, log)
        return step_file(batch), {**entry, "batch": batch, "state": state_spec(decoder)}
    return CODEC, _compile(export_codec(code2wav), out / CODEC, device, cxx, log)


def default_jobs(packages: int) -> int:
    """Packages compiled at once: one per 8 cores (each compile runs its own C++ and Triton builds side by side)."""
    return max(1, min(packages, (os.cpu_count() or 1) // 8))


def _gpu_needs(packages: list[tuple[str, int | None]], talker: Talker, code2wav, context: int) -> dict:
    """Device bytes a worker holds for each package, roughly: the weights it loads, the KV cache of its step (the
    prefill's and the codec's: none), and 2 GiB for activations and the compiler's autotuning."""
    weights = sum(t.numel() * t.element_size() for m in (talker, code2wav)
                  for t in (*m.parameters(), *m.buffers()))
    return {(what, batch): weights + 2**31 + (KVCache.nbytes(talker.cfg, batch, context, talker.dtype)
                                             if what == "step" else 0) for what, batch in packages}


def next_package(waiting: list, running: list, needs: dict | None, budget: int | None):
    """The first waiting package whose need fits beside the running ones' (any, when none runs or nothing is
    counted), or None."""
    held = sum(needs[key] for key in running) if needs else 0
    return next((key for key in waiting if not running or not needs or held + needs[key] <= budget), None)


def _in_workers(packages: list[tuple[str, int | None]], jobs: int, spec: dict, log, needs: dict | None = None,
                budget: int | None = None) -> dict:
    """`package` for each of `packages`, `jobs` at a time, each in a fresh process (`tools.export.worker`) that
    loads what its package needs; the entries in the order of `packages`. A worker that fails stops the others.
    needs / budget: device bytes per package and the device's free bytes: a package waits while the running
    ones' needs and its own would pass the budget (the first always starts; five at once ran an H100 out of
    memory with the batch-64 step beside the others).
    Each worker's whole stderr (torch's logs included, e.g. with TORCH_LOGS set) goes to a log file that is removed
    at the end, unless $HIGGS_RT_EXPORT_LOGS names a directory to keep them in (WHAT.log)."""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    root = Path(__file__).resolve().parents[2]
    results, running, waiting = {}, [], list(packages)
    keep = os.environ.get("HIGGS_RT_EXPORT_LOGS")
    with tempfile.TemporaryDirectory(prefix="higgs-rt-export-") as tmp:
        logs = Path(keep) if keep else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            while waiting or running:
                while waiting and len(running) < jobs:
                    key = next_package(waiting, [r[1] for r in running], needs, budget)
                    if key is None:
                        break
                    waiting.remove(key)
                    what, batch = key
                    stem = what if batch is None else f"{what}_b{batch}"
                    label = f"{what} package" if batch is None else f"{what} package (batch {batch})"
                    result, errors = Path(tmp) / f"{stem}.json", open(logs / f"{stem}.log", "w+")
                    proc = subprocess.Popen([sys.executable, "-m", "tools.export.worker", json.dumps(
                        {**spec, "what": what, "batch": batch, "result": str(result)})], cwd=root, env=env,
                        stdout=subprocess.DEVNULL, stderr=errors)
                    running.append([proc, (what, batch), label, result, errors, 0])
                for item in running:  # the workers' own log lines as they come, not the compilers' warnings
                    item[5] = _forward(item[4], item[5], log)
                for item in [r for r in running if r[0].poll() is not None]:
                    proc, key, label, result, errors, offset = item
                    running.remove(item)
                    _forward(errors, offset, log, final=True)
                    errors.seek(0)
                    lines = errors.read().splitlines()
                    errors.close()
                    if proc.returncode != 0 or not result.is_file():
                        last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
                        raise RuntimeError(f"export: the {label} failed in its worker process "
                                           f"(exit {proc.returncode}): {last[:300]}")
                    name, entry = json.loads(result.read_text())
                    results[key] = (name, entry)
                time.sleep(0.1)
        finally:
            for proc, _, _, _, errors, _ in running:
                proc.kill()
                proc.wait()
                errors.close()
    return dict(results[key] for key in packages)


def _forward(log_file, offset: int, log, final: bool = False) -> int:
    """Pass on a worker's log lines (those indented, its own) written past byte `offset` of its log file; a line
    still being written waits for the next call unless `final`. -> the new offset."""
    with open(log_file.name, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = len(data) if final else data.rfind(b"\n") + 1
    for line in data[:end].decode(errors="replace").splitlines():
        if line.startswith("  "):
            log(line)
    return offset + end


def _check_cache(cfg: TalkerConfig, batch: int, context: int, dtype: torch.dtype, device: torch.device) -> None:
    """The largest step's KV cache against the device's memory (`KVCache.check_fits`, nothing allocated) before
    the weights load and anything compiles: one the device cannot hold is said at once (KVCacheTooLarge naming
    --batch), not after the prefill has compiled."""
    try:
        KVCache.check_fits(cfg, batch, context, dtype, device)
    except KVCacheTooLarge as e:
        raise KVCacheTooLarge(f"--batch {short_value(batch)}: {e.needs}", "lower --batch or --context") from None


def export_artifacts(model: str | Path | None = None, out: str | Path | None = None, *,
                     codec: str | Path | None = None, device: str | None = None, dtype: torch.dtype | str | None = None,
                     batch_sizes: tuple[int, ...] = (1,), context: int = DEFAULT_CONTEXT, progress: bool = False,
                     kernels: str = "higgs-rt", probe: bool = True, cxx: str | None = None,
                     host_weights: bool = True, jobs: int | None = None,
                     log=lambda line: print(line, file=sys.stderr)) -> Path:
    """Write prefill, step (one per batch size) and codec packages and their manifest; returns the directory
    (default MODEL/compiled/, where the runtime finds it). With `probe`, the manifest is written only once a
    fresh process has loaded and run every package (`tools.export.probe`); else ExportProbeError.

    kernels: "higgs-rt" calls higgs-rt's kernels from the packages (torch operators registered in C++ by
    libhiggs_rt_ops.so); "torch" traces their pure-torch references and the cuBLAS/SDPA decode path instead.
    cxx: the C++ compiler for the packages' libraries (default: $CXX, g++, c++: the first that links the shared
    libstdc++, `tools.export.toolchain`); ToolchainError when none does.
    host_weights: also write weights.pt, the weights and facts a host without Python binds (`tools.export.host`).
    jobs: packages compiled at once, each in a process of its own (`tools.export.worker`; default `default_jobs`,
    one per 8 cores); 1 compiles them one after another in this process.
    """
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch sizes must be >= 1, got {list(batch_sizes)}")
    if len(set(batch_sizes)) > MAX_BATCH_SIZES:  # each is a package: minutes of compiling and its disk
        raise ValueError(f"--batch: at most {MAX_BATCH_SIZES} sizes (one step package each), got "
                         f"{len(set(batch_sizes))}")
    check_context(context, "--context")
    packages = [("prefill", None), *(("step", b) for b in sorted(set(batch_sizes))), ("codec", None)]
    jobs = default_jobs(len(packages)) if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    check_torch()
    cxx, compiler_note = choose_cxx(cxx)
    # absolute: the probe and the workers run in the source checkout, where a relative path names something else
    model_dir = resolve_model_dir(model, progress=progress).absolute()
    device = torch.device(device or default_device())
    dtype = _dtype(dtype, device)
    out = Path(out).absolute() if out is not None else model_dir / SUBDIR
    if out.exists() and not out.is_dir():
        raise OutputRefused(f"--out {out} exists and is not a directory")
    _check_cache(TalkerConfig.from_dir(model_dir), max(batch_sizes), context, dtype, device)
    talker = Talker.from_pretrained(model_dir, dtype=dtype, device=device, max_positions=context, progress=progress)
    codec_dir = resolve_codec_dir(codec, model_dir).absolute()
    code2wav = load_codec(codec_dir, device=device)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputUnwritable(f"--out {out}: cannot write there ({e.strerror or e})") from None
    (out / MANIFEST).unlink(missing_ok=True)
    log(f"exporting {model_dir} ({device.type}, {str(dtype).removeprefix('torch.')}, context {context}) to {out}")
    log(f"  {compiler_note}")
    decode_kernels = talker.decode_kernels
    started = time.perf_counter()
    if jobs == 1:
        tracing = ops.references() if kernels == "torch" else contextlib.nullcontext()
        with torch.no_grad(), tracing:  # Decoder.step's own no_grad would otherwise hide its state updates from export
            artifacts = dict(package(what, batch, talker, code2wav, out, device, cxx, context, log)
                             for what, batch in packages)
    else:
        log(f"  {len(packages)} packages, {jobs} at a time, each in a worker process")
        spec = {"model": str(model_dir), "codec": str(codec_dir), "out": str(out), "device": str(device),
                "dtype": str(dtype).removeprefix("torch."), "context": context, "kernels": kernels, "cxx": cxx}
        needs = budget = None
        if device.type == "cuda":
            needs, budget = _gpu_needs(packages, talker, code2wav, context), torch.cuda.mem_get_info(device)[0]
        artifacts = _in_workers(packages, jobs, spec, log, needs, budget)
    log(f"  compiled in {time.perf_counter() - started:.1f} s")
    manifest = {**target(talker, code2wav, model_dir, codec_dir, context), "batch_sizes": sorted(set(batch_sizes)),
                "kernels": kernels, "decode_kernels": decode_kernels, "cxx": cxx, "jobs": jobs,
                "compile_s": round(time.perf_counter() - started, 1), "artifacts": artifacts}
    staged = out / (MANIFEST + ".tmp")
    staged.write_text(json.dumps(manifest, indent=2))
    if probe:
        log("  probing the packages in a fresh process")
        try:
            run_probe(command(model_dir, codec_dir, out, staged, device.type, str(dtype).removeprefix("torch.")),
                      cwd=Path(__file__).resolve().parents[2])
        except ExportProbeError:
            staged.unlink()
            raise
        for name, entry in json.loads(staged.read_text())["artifacts"].items():
            log(f"  {name}: {runtime_choice(entry)}")
    _record_cache_copies(staged, out, log)
    if host_weights:
        manifest = json.loads(staged.read_text())
        manifest["host_weights"] = write_host_weights(out, talker, code2wav, manifest)
        staged.write_text(json.dumps(manifest, indent=2))
        log(f"  {WEIGHTS}: {manifest['host_weights']['bytes'] / 1e6:.1f} MB, the weights for hosts without Python "
            "(examples/host)")
    else:
        (out / WEIGHTS).unlink(missing_ok=True)
    staged.replace(out / MANIFEST)
    return out


def runtime_choice(entry: dict) -> str:
    """The probe's timing of one package and what the runtime makes of it, in words."""
    unit, timed = ("step", entry["probe_ms_per_step"]) if "probe_ms_per_step" in entry else \
        ("call", entry["probe_ms_per_call"])
    verdict = "the runtime uses it" if entry["faster_than_eager"] else "slower: the runtime runs eager"
    return f"{timed['exported']:.2f} ms/{unit}, eager {timed['eager']:.2f}: {verdict}"


def _record_cache_copies(staged: Path, out: Path, log) -> None:
    """Scan each step package for copies of the KV cache (`buffers.cache_copies`) and record them."""
    manifest = json.loads(staged.read_text())
    for name, entry in manifest["artifacts"].items():
        if "state" in entry:
            k_cache = next(shape for state, shape, _, _ in entry["state"] if state == "cache.k")
            entry["cache_copies"] = cache_copies(out / name, math.prod(k_cache[1:]))  # one layer of keys
            if entry["cache_copies"]:
                log(f"  {name} copies the KV cache on every call: {'; '.join(entry['cache_copies'])}")
    staged.write_text(json.dumps(manifest, indent=2))
