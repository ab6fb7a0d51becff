"""Streaming vs offline codec decode: SNR per look-ahead and chunk schedule, at the released codec's shapes.

Random weights (higgs_rt.fixtures.codec, size "full"), fp32, CPU. Each utterance is pushed into
`StreamingDecoder` one delayed frame at a time, as the Talker emits them, and compared with `Code2Wav.decode`
of the whole utterance. The default look-ahead in higgs_rt/codec/stream.py is the smallest one here with
SNR >= 60 dB for every schedule.

    PYTHONPATH=. python benchmarks/bench_codec_stream.py [--frames 60] [--seeds 3] [--codec DIR]

Prints a table and writes benchmarks/results/codec_stream.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from higgs_rt.codec import StreamingDecoder, load_codec, receptive_field
from higgs_rt.fixtures.codec import delayed_frames, make_codec

SCHEDULES = ((1, 1), (2, 5), (4, 8), (12, 25))  # (first_chunk, chunk) in frames
THRESHOLD_DB = 60.0
FRAME_MS = 40
RESULTS = Path(__file__).parent / "results" / "codec_stream.json"


def snr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (test.double() - reference.double()).pow(2).sum().clamp_min(1e-300)
    return round(float(10 * torch.log10(reference.double().pow(2).sum() / noise)), 1)


def stream(codec, delayed: torch.Tensor, first_chunk: int, chunk: int, lookahead: int) -> torch.Tensor:
    decoder = StreamingDecoder(codec, first_chunk=first_chunk, chunk=chunk, lookahead=lookahead)
    pieces = [decoder.push(frame[None]) for frame in delayed]
    return torch.cat(pieces + [decoder.flush()])


def measure(codec, frames: int, seeds: int, max_lookahead: int) -> dict[str, dict[int, float]]:
    """Worst SNR over the utterances, per schedule and look-ahead."""
    table: dict[str, dict[int, float]] = {f"{f}+{c}": {} for f, c in SCHEDULES}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, codec.codebook_size, (frames, codec.num_quantizers), generator=g)
        offline = codec.decode(codes[None])[0]
        delayed = delayed_frames(codes, codec.codebook_size)
        for first, chunk in SCHEDULES:
            row = table[f"{first}+{chunk}"]
            for lookahead in range(max_lookahead + 1):
                snr = snr_db(offline, stream(codec, delayed, first, chunk, lookahead))
                row[lookahead] = min(snr, row.get(lookahead, snr))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=60, help="frames per utterance (40 ms each)")
    parser.add_argument("--seeds", type=int, default=3, help="utterances (random codes) per cell; the worst counts")
    parser.add_argument("--max-lookahead", type=int, default=10)
    parser.add_argument("--codec", type=Path, help="codec dir (default: a random one at the released shapes)")
    args = parser.parse_args()

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        codec = load_codec(args.codec or make_codec(tmp, size="full", seed=0))
    table = measure(codec, args.frames, args.seeds, args.max_lookahead)

    lookaheads = range(args.max_lookahead + 1)
    worst = {la: min(row[la] for row in table.values()) for la in lookaheads}
    chosen = next((la for la in lookaheads if worst[la] >= THRESHOLD_DB), None)
    print(f"SNR (dB) of streaming vs offline decode, {args.frames} frames x {args.seeds} utterances, worst case")
    print("schedule (first+chunk) | " + " ".join(f"la={la:<5}" for la in lookaheads))
    for name, row in table.items():
        print(f"{name:>22} | " + " ".join(f"{row[la]:<8}" for la in lookaheads))
    print(f"{'worst':>22} | " + " ".join(f"{worst[la]:<8}" for la in lookaheads))
    if chosen is None:
        print(f"no look-ahead up to {args.max_lookahead} reaches {THRESHOLD_DB} dB on every schedule")
    else:
        print(f"smallest look-ahead with >= {THRESHOLD_DB} dB everywhere: {chosen} frames = {chosen * FRAME_MS} ms")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "what": "SNR of StreamingDecoder vs Code2Wav.decode, worst over utterances",
        "weights": str(args.codec) if args.codec else "random, released shapes (higgs_rt.fixtures.codec 'full')",
        "dtype": "float32", "device": "cpu", "frames": args.frames, "utterances": args.seeds,
        "receptive_field_frames": list(receptive_field(codec.config)),
        "snr_db": table, "worst_snr_db": worst, "threshold_db": THRESHOLD_DB,
        "chosen_lookahead": chosen, "latency_ms": None if chosen is None else chosen * FRAME_MS,
        "seconds": round(time.time() - started, 1),
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
