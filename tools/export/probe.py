"""Before the manifest makes them visible, a fresh process loads the packages just written, binds the weights
and runs them: prefill, every exported step (in a CUDA graph on CUDA), the codec. A package that kills its
process (an AOTInductor loader can segfault, where Python cannot catch it) then fails the export, naming the
stage it died in, instead of crashing every later `higgs-rt speak`.

It also times each package against the eager path it replaces (the steps both graphed on CUDA; the prefill on a
sentence-long prompt, the codec on the probe's 12 frames) and records both and the runtime's choice in the
manifest (`probe_ms_per_step` or `probe_ms_per_call`, `faster_than_eager`): the runtime uses a package only where
it was faster (on the H200 the eager step with higgs-rt's kernels beats Inductor's; on the CPU the packages win).

    python -m tools.export.probe MODEL CODEC ARTIFACTS STAGED_MANIFEST DEVICE DTYPE   (run by export_artifacts)
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

PREFIX = "probe: "
TIMEOUT_S = 600
# a prompt of ordinary length: the exported prefill has dynamic shapes, so it is timed away from tiny sizes
PROMPT = "The probe times the exported prompt prefill against the eager one on a sentence of ordinary length."


class ExportProbeError(RuntimeError):
    """The exported packages fail in a fresh process: no manifest is written."""


def command(model_dir: Path, codec_dir: Path, out: Path, staged: Path, device: str, dtype: str) -> list[str]:
    return [sys.executable, "-m", "tools.export.probe", str(model_dir), str(codec_dir), str(out), str(staged),
            device, dtype]


def stage(text: str) -> None:
    """Report progress from a child process (`run_staged` reads it); the last stage of a success is "ok"."""
    print(PREFIX + text, flush=True)


def run_staged(cmd: list[str], cwd: Path, timeout: float | None = None) -> tuple[str, str] | None:
    """Run a child that reports its `stage`s: None when it exits 0 after "ok", else (how it ended, where)."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    stages = [line.removeprefix(PREFIX) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode == 0 and stages[-1:] == ["ok"]:
        return None
    if proc.returncode < 0:
        how = f"killed by {signal.Signals(-proc.returncode).name}"
    else:
        last = next((line for line in reversed(proc.stderr.strip().splitlines()) if line.strip()), "no output")
        how = f"failed ({last.strip()[:300]})"
    return how, f"while {stages[-1]}" if stages else "before loading anything"


def run_probe(cmd: list[str], cwd: Path) -> None:
    """Run the probe command; raise ExportProbeError naming how and where it ended unless it printed its last stage."""
    try:
        ended = run_staged(cmd, cwd, TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ExportProbeError(f"the exported packages did not finish a probe run in {TIMEOUT_S} s") from None
    if ended is not None:
        how, where = ended
        how = f"were {how}" if how.startswith("killed") else how
        raise ExportProbeError(f"the exported packages {how} in a fresh process {where}; no manifest written, so the "
                               "runtime keeps its eager path")


def median_ms(call, device, runs: int = 20, warmup: int = 3) -> float:
    """Median ms of one synchronised call, after `warmup` calls."""
    import torch

    times = []
    for _ in range(warmup + runs):
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[warmup:])


def ms_per_step(decoder) -> float:
    """Median ms of one decode step, every slot busy 16 positions in."""
    import torch

    from higgs_rt.sampling import SamplingParams

    cfg, device = decoder.talker.cfg, decoder.talker.device
    frames = torch.full((decoder.cache.batch, cfg.num_codebooks), cfg.stream_bos_id, dtype=torch.long, device=device)
    for slot in range(decoder.cache.batch):
        decoder.sampler.reset(slot, SamplingParams(seed=slot))
    decoder.cache.lengths.fill_(16)

    def step() -> None:
        nonlocal frames
        frames = decoder.step_fn(frames)

    return median_ms(step, device)


def record(entry: dict, key: str, exported: float, eager: float) -> None:
    """The timings and the runtime's choice: the exported package only where it was faster.

    The verdict is taken from the rounded times the manifest records, so a reader can check it from the manifest
    alone (a tie at the recorded precision goes to eager)."""
    timed = {"exported": round(exported, 3), "eager": round(eager, 3)}
    entry[key] = timed
    entry["faster_than_eager"] = timed["exported"] < timed["eager"]


def main(model_dir: str, codec_dir: str, out: str, staged: str, device: str, dtype: str) -> None:
    import torch

    from higgs_rt.codec import load_codec
    from higgs_rt.compiled import CODEC, PREFILL, CompiledArtifactsWarning, load_compiled, step_file
    from higgs_rt.generate import Decoder, generate
    from higgs_rt.prompt import PromptBuilder
    from higgs_rt.sampling import SamplingParams
    from higgs_rt.talker import Talker

    warnings.simplefilter("error", CompiledArtifactsWarning)  # any misfit ends the probe with its reason
    manifest = json.loads(Path(staged).read_text())
    context = manifest["context"]
    talker = Talker.from_pretrained(model_dir, dtype=getattr(torch, dtype), device=device, max_positions=context)
    codec = load_codec(codec_dir, device=device)
    stage("loading prefill.pt2 and codec.pt2")
    compiled = load_compiled(out, Path(model_dir), Path(codec_dir), talker, codec, context, manifest_file=staged,
                             choice="always")  # the probe runs and times every package whatever $HIGGS_RT_EXPORTED says
    prompt = PromptBuilder(model_dir, talker.cfg.audio_out_token_id).tts(PROMPT)
    graphed = talker.device.type == "cuda"
    for batch in manifest["batch_sizes"]:
        stage(f"loading and capturing step_b{batch}.pt2")
        decoder = Decoder(talker, batch=batch, context=context, compiled=compiled, cuda_graph=graphed)
        stage(f"running prefill.pt2 and step_b{batch}.pt2")
        frames = generate(decoder, prompt, SamplingParams(seed=0), max_frames=12).frames
        stage(f"timing step_b{batch}.pt2 against the eager step")
        eager = Decoder(talker, batch=batch, context=context, cuda_graph=graphed)
        record(manifest["artifacts"][step_file(batch)], "probe_ms_per_step", ms_per_step(decoder), ms_per_step(eager))
        del decoder, eager
    stage("running codec.pt2")
    codes = frames.clamp(max=codec.codebook_size - 1)[None].to(talker.device)
    codec.decode(codes)
    stage("timing prefill.pt2 and codec.pt2 against the eager ones")
    cache = talker.new_cache(1, context)
    record(manifest["artifacts"][PREFILL], "probe_ms_per_call",
           median_ms(lambda: compiled.prefill(cache, 0, prompt.ids), talker.device),
           median_ms(lambda: talker.prefill(cache, 0, prompt.ids), talker.device))
    record(manifest["artifacts"][CODEC], "probe_ms_per_call", median_ms(lambda: codec.decode(codes), talker.device),
           median_ms(lambda: type(codec).decode(codec, codes), talker.device))
    Path(staged).write_text(json.dumps(manifest, indent=2))
    stage("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
