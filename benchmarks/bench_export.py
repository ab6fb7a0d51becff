"""Exported artifacts against the other decode paths: cold start to first audio and ms per frame.

On a full-size random checkpoint (bf16 on CUDA; `--size tiny` for a CPU smoke run), written once under --work,
with artifacts exported once (`export_artifacts`, batch sizes --batch). Then one fresh process per path, each
timed from its spawn to the first PCM chunk of its first `TTS.stream` (TTS construction included: weight
loading, CUDA graph capture, warm-up, and compilation where the path compiles), and then its decoder's ms per
frame (benchmarks/bench_frame_latency.py's loop):
    eager     TTS(compiled=False): eager step + CUDA graph, the default without artifacts
    compile   TTS(compile=MODE, compiled=False), a fresh Inductor cache: torch.compile + CUDA graph
    exported  TTS(compiled=DIR): the exported prefill and codec, and the exported step where the export's probe
              timed it faster than the eager one (`used_exported_step`); the same process then times the
              exported step itself (graphed, without a graph, batch 8 if exported), Code2Wav chunks eager vs
              exported, and how many leading frames match the eager path.
Each path reports its peak GPU memory up to its ms-per-frame run: the packages hold no weights, so exported
should be close to eager.

    python benchmarks/bench_export.py [--work DIR] [--out JSON] [--frames 300] [--compile default] [--batch 1 8] [--jobs N]

Re-running resumes: the checkpoint, the artifacts and every finished path are kept in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frame_latency import SENTENCE, codec_chunk_ms, summarize, time_steps  # noqa: E402
from meta import run_info  # noqa: E402

PATHS = ("eager", "exported", "compile")


def prepare(work: Path, size: str, batch: list[int], context: int, jobs: int | None = None) -> dict:
    """The random checkpoint and its artifacts, made once; returns what making them took."""
    from higgs_rt.fixtures.codec import make_codec
    from higgs_rt.fixtures.talker import make_talker

    made = {}
    model = work / "model"
    if not (model / "done").exists():
        start = time.perf_counter()
        make_talker(model, size)
        make_codec(model / "audio_tokenizer", "full" if size == "full" else "tiny")
        (model / "done").touch()
        made["checkpoint_s"] = time.perf_counter() - start
    if not (work / "artifacts" / "manifest.json").exists():
        from tools.export import ExportProbeError, export_artifacts

        start = time.perf_counter()
        try:
            export_artifacts(model, work / "artifacts", batch_sizes=tuple(batch), context=context, jobs=jobs)
        except ExportProbeError as e:  # the other paths are still worth measuring
            return {**made, "export_error": str(e), "export_s": time.perf_counter() - start}
        made["export_s"] = time.perf_counter() - start
    manifest = json.loads((work / "artifacts" / "manifest.json").read_text())
    made["jobs"], made["compile_s"] = manifest.get("jobs"), manifest.get("compile_s")  # packages at once; their wall time
    made["artifacts"] = {name: {k: v for k, v in entry.items() if k != "state"}
                         for name, entry in manifest["artifacts"].items()}
    return made


def child(path: str, work: Path, frames: int, compile_mode: str, context: int) -> dict:
    """One path in this fresh process: TTS construction to first audio, then per-frame timings."""
    started = float(os.environ["BENCH_SPAWNED_AT"])
    from higgs_rt.engine import TTS
    from higgs_rt.generate import Decoder
    from higgs_rt.talker import KVCacheTooLarge

    imported = time.time()
    model = work / "model"
    kwargs = {"eager": dict(compiled=False), "compile": dict(compiled=False, compile=compile_mode),
              "exported": dict(compiled=work / "artifacts")}[path]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tts = TTS(model, device=str(device), context=context, **kwargs)
    built = time.time()
    stream = tts.stream(SENTENCE, seed=1, max_frames=200)
    next(stream)
    first = time.time()
    stream.close()
    result = {"cold_start_to_first_audio_s": first - started, "import_s": imported - started,
              "tts_init_s": built - imported, "first_request_first_audio_s": first - built,
              "ms_per_frame": summarize(time_steps(tts.decoder, frames, device))}
    if device.type == "cuda":
        result["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    if path == "exported":
        assert tts.compiled is not None, "the artifacts were not used"
        from higgs_rt.compiled import CodecRunner, PrefillRunner

        probed = {name: {k: entry[k] for k in ("probe_ms_per_step", "probe_ms_per_call", "faster_than_eager")
                         if k in entry} for name, entry in tts.compiled.manifest["artifacts"].items()}
        result["used_exported_step"] = tts.decoder.uses_exported_step
        result["used_exported_prefill"] = isinstance(tts.decoder.prefill_fn, PrefillRunner)
        result["used_exported_codec"] = isinstance(tts.codec.exported, CodecRunner)
        result["probe"] = probed
        tts.compiled.choice = "always"  # from here on: the exported step itself, used or not
        graphed = Decoder(tts.talker, batch=1, context=context, compiled=tts.compiled, cuda_graph=device.type == "cuda")
        result["exported_step_ms_per_frame"] = summarize(time_steps(graphed, frames, device))
        graphless = Decoder(tts.talker, batch=1, context=context, compiled=tts.compiled)
        result["exported_step_ms_per_frame_no_graph"] = summarize(time_steps(graphless, frames, device))
        del graphed, graphless  # their caches go at once (a Decoder holds its step weakly)
        ratios = {}
        for batch in tts.compiled.manifest["batch_sizes"]:  # the exported step against the eager graphed step
            n = max(frames // max(batch // 8, 1), 40)
            timed = {}
            for name, compiled in (("exported", tts.compiled), ("eager", None)):
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                try:
                    decoder = Decoder(tts.talker, batch=batch, context=context, compiled=compiled,
                                      cuda_graph=device.type == "cuda")
                except KVCacheTooLarge as e:  # this batch's figure is lost, not the others'
                    timed[name] = {"error": str(e), "allocated_GiB": torch.cuda.memory_allocated() / 2**30
                                   if device.type == "cuda" else None}
                    continue
                timed[name] = summarize(time_steps(decoder, n, device))
                del decoder
            result[f"step_b{batch}_ms_per_frame"] = timed
            if all("median_ms" in t for t in timed.values()):
                ratios[f"b{batch}_ratio"] = timed["exported"]["median_ms"] / timed["eager"]["median_ms"]
        result.update(ratios)
        if result["used_exported_codec"]:
            result["codec_chunk_ms"] = {"exported": codec_chunk_ms(tts.codec, device, 8)}
            tts.codec.exported = None  # back to the eager decode
            result["codec_chunk_ms"]["eager"] = codec_chunk_ms(tts.codec, device, 8)
        result["leading_frames_equal_to_eager"] = leading_equal_frames(tts, context, device)
    return result


def leading_equal_frames(tts, context: int, device) -> dict:
    """Exported vs eager decoder (both graphed on CUDA), same prompt and seed: frames equal before the first
    difference (bf16 kernels differ, so sampled codes may drift apart), and both lengths."""
    from higgs_rt.generate import Decoder, generate
    from higgs_rt.sampling import SamplingParams

    prompt = tts.prompts.tts(SENTENCE)
    runs = []
    for compiled in (tts.compiled, None):
        decoder = Decoder(tts.talker, batch=1, context=context, compiled=compiled, cuda_graph=device.type == "cuda")
        runs.append(generate(decoder, prompt, SamplingParams(seed=3), max_frames=200).frames)
    a, b = runs
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).any(-1).nonzero()
    return {"equal": int(differ[0]) if len(differ) else n, "exported_frames": len(a), "eager_frames": len(b)}


def run_path(path: str, args) -> dict:
    env = dict(os.environ, BENCH_SPAWNED_AT=repr(time.time()))
    if path == "compile":  # cold: nothing compiled before in this cache
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    cmd = [sys.executable, __file__, "--child", path, "--work", str(args.work), "--frames", str(args.frames),
           "--compile", args.compile, "--context", str(args.context)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "higgs-rt-bench-export")
    ap.add_argument("--out", type=Path, help="JSON results (default: WORK/results.json)")
    ap.add_argument("--size", choices=("full", "tiny"), default="full" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--compile", default="default", help="torch.compile mode of the compile path")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="exported step batch sizes")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--jobs", type=int, help="packages compiled at once (default: higgs-rt export's)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.work, args.frames, args.compile, args.context)))
        return

    args.work.mkdir(parents=True, exist_ok=True)
    saved = args.work / "results.json"
    result = json.loads(saved.read_text()) if saved.exists() else {}
    out = args.out or saved

    def save() -> None:
        for file in {saved, out}:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(result, indent=2) + "\n")

    result.update(**run_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")), size=args.size, context=args.context, compile_mode=args.compile)
    result.setdefault("prepare", {}).pop("export_error", None)
    result["prepare"].update(prepare(args.work, args.size, args.batch, args.context, args.jobs))
    save()
    for path in args.paths:
        if path == "exported" and "export_error" in result["prepare"]:
            result[path] = {"error": result["prepare"]["export_error"]}
        elif path not in result or "error" in result[path]:
            print(f"{path} ...", file=sys.stderr, flush=True)
            result[path] = run_path(path, args)
            save()
    summary = {k: result["exported"][k] for k in result.get("exported", {}) if k.endswith("_ratio")}
    if "export_s" in result["prepare"]:
        summary["export_s"] = result["prepare"]["export_s"]
    if all("cold_start_to_first_audio_s" in result.get(p, {}) for p in ("eager", "exported")):
        summary["cold_start_added_s"] = (result["exported"]["cold_start_to_first_audio_s"]
                                         - result["eager"]["cold_start_to_first_audio_s"])
    result.update(summary)  # the fields, at the top
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
