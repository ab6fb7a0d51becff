"""Reference audio in: time and peak memory of reading and resampling a reference (any rate -> 24 kHz, soxr).

Each case runs in its own fresh process, so the peak (ru_maxrss) is the case's own: the growth of the peak
over the process's state before the load (imports and a first 16 kHz load done). Rates: the odd ones that made
the old hand-written resampler build multi-gigabyte filter banks (22051, 24001, 44101 Hz), common ones, and the
bounds (8 and 192 kHz); lengths: 0.6 s (a 26 KB WAV at 22 kHz, as in issue 16) and 30 s (the longest accepted).

    python benchmarks/bench_resample.py [--rates 22051 24001 ...] [--seconds 0.6 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATES = (8000, 16000, 22050, 22051, 24001, 44100, 44101, 48000, 192000)


def child(rate: int, seconds: float, path: Path) -> dict:
    import numpy as np
    import soundfile as sf

    from higgs_rt.audio_in import load_reference

    out = io.BytesIO()
    sf.write(out, 0.1 * np.random.default_rng(0).standard_normal(int(rate * seconds)), rate, format="WAV",
             subtype="PCM_16")
    path.write_bytes(out.getvalue())
    load_reference(np.ones(12000, np.float32), 16000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    ref = load_reference(path)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rate": rate, "seconds": seconds, "file_bytes": path.stat().st_size, "load_s": round(elapsed, 4),
            "peak_growth_mb": round((peak - before) / 1024, 1), "process_peak_mb": round(peak / 1024, 1),
            "out_samples": int(ref.samples.shape[0])}


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "higgs_rt"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=int, nargs="+", default=list(RATES))
    ap.add_argument("--seconds", type=float, nargs="+", default=[0.6, 30.0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "resample.json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(int(args.child[0]), float(args.child[1]), Path(args.child[2]))))
        return

    import soxr
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seconds in args.seconds:
            for rate in args.rates:
                proc = subprocess.run([sys.executable, __file__, "--child", str(rate), str(seconds),
                                       str(Path(tmp) / "ref.wav")], capture_output=True, text=True, check=True,
                                      cwd=ROOT)
                row = json.loads(proc.stdout.split("RESULT ", 1)[1])
                rows.append(row)
                print(f"{rate:>7} Hz {seconds:>5g} s: {row['load_s'] * 1e3:8.1f} ms, peak +{row['peak_growth_mb']} MB"
                      f" (process {row['process_peak_mb']} MB)", flush=True)
    result = {"device": "cpu", "torch_version": torch.__version__, "soxr_version": soxr.__version__,
              "commit": git_commit(), "what": "load_reference(path): read WAV, check, mono, soxr HQ to 24 kHz",
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
