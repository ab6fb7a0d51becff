"""Before the manifest makes them visible, a fresh process loads the packages just written, binds the weights
and runs them: prefill, every exported step (in a CUDA graph on CUDA), the codec. A package that kills its
process (an AOTInductor loader can segfault, where Python cannot catch it) then fails the export, naming the
stage it died in, instead of crashing every later `higgs-rt speak`.

    python -m tools.export.probe MODEL CODEC ARTIFACTS STAGED_MANIFEST DEVICE DTYPE   (run by export_artifacts)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path

PREFIX = "probe: "
TIMEOUT_S = 600


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


def main(model_dir: str, codec_dir: str, out: str, staged: str, device: str, dtype: str) -> None:
    import torch

    from higgs_rt.codec import load_codec
    from higgs_rt.compiled import CompiledArtifactsWarning, load_compiled
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
    compiled = load_compiled(out, Path(model_dir), Path(codec_dir), talker, codec, context, manifest_file=staged)
    prompt = PromptBuilder(model_dir, talker.cfg.audio_out_token_id).tts("Probe.")
    for batch in manifest["batch_sizes"]:
        stage(f"loading and capturing step_b{batch}.pt2")
        decoder = Decoder(talker, batch=batch, context=context, compiled=compiled,
                          cuda_graph=talker.device.type == "cuda")
        stage(f"running prefill.pt2 and step_b{batch}.pt2")
        frames = generate(decoder, prompt, SamplingParams(seed=0), max_frames=12).frames
    stage("running codec.pt2")
    codes = frames.clamp(max=codec.codebook_size - 1)[None].to(talker.device)
    codec.decode(codes)
    if talker.device.type == "cuda":
        torch.cuda.synchronize()
    stage("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
