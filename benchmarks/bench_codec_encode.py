"""Voice-clone encode time: a 10 s reference -> codes with the codec's encode path at the released shapes.

Random weights (higgs_rt.fixtures.codec, size "full": DAC encoder 64 channels, HuBERT base, 1024 x 64 codebooks),
fp32. The reference is espeak-ng speech (falls back to noise without espeak-ng), looped to --seconds, read and
resampled from 22.05 kHz by higgs_rt.audio_in as a user's file would be. Reports the time to load the encode
weights and the median of --repeats encodes after one warm-up, on CPU (and CUDA when there is one).

    PYTHONPATH=. python benchmarks/bench_codec_encode.py [--seconds 10] [--repeats 3] [--threads N] [--codec DIR]

Prints a table and writes benchmarks/results/codec_encode.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from higgs_rt.audio_in import load_reference
from higgs_rt.codec import load_encoder
from higgs_rt.fixtures.codec import make_codec

RESULTS = Path(__file__).parent / "results" / "codec_encode.json"
TEXT = ("The sun rises in the east and sets in the west. A quick brown fox jumps over the lazy dog, "
        "and then it runs into the forest to find its friends.")


def reference(path: Path, seconds: float) -> Path:
    rate = 22050
    if shutil.which("espeak-ng"):
        subprocess.run(["espeak-ng", "-w", str(path), TEXT], check=True, capture_output=True)
        speech, rate = sf.read(path, dtype="float32")
    else:
        speech = 0.1 * np.random.default_rng(0).standard_normal(rate).astype(np.float32)
    sf.write(path, np.resize(speech, int(seconds * rate)), rate)
    return path


def run(device: str, codec_dir: Path, wav: torch.Tensor, repeats: int) -> dict:
    start = time.perf_counter()
    encoder = load_encoder(codec_dir, device=device)
    loaded = time.perf_counter() - start
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    codes = encoder.encode(wav)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        encoder.encode(wav)
        sync()
        times.append(time.perf_counter() - start)
    return {"device": device, "threads": torch.get_num_threads(), "load_s": round(loaded, 2),
            "encode_s": round(statistics.median(times), 3), "frames": int(codes.shape[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--codec", type=Path, help="a real codec directory instead of random full-size weights")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        codec_dir = args.codec or make_codec(Path(tmp) / "codec", "full")
        wav = load_reference(reference(Path(tmp) / "ref.wav", args.seconds)).samples
        rows = [run("cpu", codec_dir, wav, args.repeats)]
        if torch.cuda.is_available():
            rows.append(run("cuda", codec_dir, wav, args.repeats))
    print(f"encode of a {args.seconds:g} s reference, {'given' if args.codec else 'random full-size'} codec, fp32")
    print(f"{'device':>6} {'threads':>7} {'load s':>7} {'encode s':>9} {'frames':>6}")
    for r in rows:
        print(f"{r['device']:>6} {r['threads']:>7} {r['load_s']:>7} {r['encode_s']:>9} {r['frames']:>6}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"seconds": args.seconds, "codec": str(args.codec or "random full"),
                                   "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
