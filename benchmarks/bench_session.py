"""Text sessions (higgs_rt.session): the piece that completes a clause -> that clause's first audio, against the
plain time to first audio of the same clause, and barge-in: cancel -> audio stopped and slot free, in decode steps.

On `TTS` (one slot) and on `BatchEngine` (the server's), interleaved run by run, medians of --runs warm runs:
  plain_first_audio_ms    tts.stream(CLAUSE) / engine.submit(CLAUSE) called -> its first PCM chunk in hand
  session_first_audio_ms  a fresh session has been fed the clause's words; feed(", and") (the piece that completes
                          the clause) called -> the first audio event in hand (iteration on the caller's thread);
                          the same utterance as the plain one (same text, same seed, no reference)
  overhead_ms             session - plain (the issue's target: at most 5 ms)
  plain_new_thread_first_audio  the plain stream called and read on a thread started for it; overhead_vs_new_
                          thread_ms: session - that. On the CPU a thread other than the caller's runs torch in an
                          OpenMP team of its own, made cold, and while two teams exist libgomp stops spinning
                          between parallel regions (more OpenMP threads than cores), so each of the codec's many
                          small regions waits on a futex wake-up. A TTS therefore runs every session's utterances
                          on one model thread of its own, on one OpenMP thread (higgs_rt/model_thread.py)
  cancel: an utterance that ignores EOS (so it is still running) is cancelled at its first audio event; counted:
  decode steps run after cancel() returned until "closed" (target: at most one frame), audio events after
  cancel() (0), the slot free when "closed" comes, and cancel() -> "closed" in ms.

    higgs-rt make-random-checkpoint /tmp/tiny        # or --size full for the released shapes (GPU)
    PYTHONPATH=. python benchmarks/bench_session.py --model /tmp/tiny [--runs 20] [--compute cpu|cuda]
        [--dtype bf16] [--slots 8] [--out benchmarks/results/session_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from benchmarks.meta import add_model_args, run_info
from higgs_rt.batch import BatchEngine
from higgs_rt.engine import TTS

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog"]
CLAUSE = "".join(WORDS) + ","
COMPLETES = ", and"  # the piece that completes the clause: its comma and what follows it


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def plain_first_audio(on, seed: int) -> float:
    t0 = time.perf_counter()
    if isinstance(on, TTS):
        stream = on.stream(CLAUSE, seed=seed)
        next(stream)
        t1 = time.perf_counter()
        stream.close()
    else:
        job = on.submit(CLAUSE, seed=seed)
        chunks = iter(job)
        next(chunks)
        t1 = time.perf_counter()
        chunks.close()  # cancels the job
    return t1 - t0


def plain_new_thread_first_audio(on, seed: int) -> float:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(plain_first_audio(on, seed)))
    thread.start()
    thread.join()
    return out[0]


def session_first_audio(on, seed: int) -> tuple[float, float]:
    """(consumer-side latency, the session's own first_audio_s)."""
    session = on.session(seed=seed)
    for word in WORDS:
        session.feed(word)
    t0 = time.perf_counter()
    session.feed(COMPLETES)
    while session.read().kind != "audio":
        pass
    t1 = time.perf_counter()
    session.cancel()
    while session.read() is not None:
        pass
    first = session.stats.first_audio_s
    if session.segments[0] != CLAUSE:
        raise AssertionError(f"the session spoke {session.segments[0]!r}, not {CLAUSE!r}")
    return t1 - t0, first if first is not None else float("nan")


def count_steps(on) -> list[int]:
    """[decode steps so far], counted by wrapping the decoder's step functions."""
    count = [0]
    if isinstance(on, TTS):
        step = on.decoder.step_fn
        on.decoder.step_fn = lambda *args: (count.__setitem__(0, count[0] + 1), step(*args))[1]
    else:
        for n, step in list(on.decoder.steps.items()):
            on.decoder.steps[n] = lambda *args, _s=step: (count.__setitem__(0, count[0] + 1), _s(*args))[1]
    return count


def endless_tts(tts: TTS) -> TTS:
    """A TTS on the same model whose utterances never sample EOS: still running when cancelled."""
    endless = TTS(tts.model, **tts.chunking)
    decoder = tts.model.decoder(1, ignore_eos=True)
    start = decoder.start
    decoder.start = lambda slot, prompt, params: start(slot, prompt, params, ignore_eos=True)
    endless._decoder = decoder
    return endless


def cancel_run(on, steps: list[int], seed: int) -> dict:
    extra = {} if isinstance(on, TTS) else {"ignore_eos": True}
    session = on.session(seed=seed, max_frames=400, **extra)
    session.feed(CLAUSE + " ")
    while session.read().kind != "audio":
        pass
    t0 = time.perf_counter()
    session.cancel()
    at_return = steps[0]
    audio_after = 0
    while (event := session.read()) is not None:
        audio_after += event.kind == "audio"
        closed = event
    t1 = time.perf_counter()
    free = not on._busy.locked() if isinstance(on, TTS) else on.metrics()["active_slots"] == 0
    result = session.speech.results[0]
    return {"steps_after_cancel": steps[0] - at_return, "audio_events_after_cancel": audio_after,
            "slot_free_at_closed": free and closed.cancelled, "cancel_to_closed_ms": ms(t1 - t0),
            "utterance_frames": result.frames.shape[0], "cut_mid_utterance": result.stopped and not result.finished}


def summary(values: list[float]) -> dict:
    return {"median_ms": ms(statistics.median(values)), "min_ms": ms(min(values)), "max_ms": ms(max(values))}


def speaking_seeds(tts: TTS, n: int) -> list[int]:
    """Seeds whose utterance of CLAUSE has audio (random weights can end one before its first audio frame)."""
    seeds, seed = [], 1000
    while len(seeds) < n:
        if tts.synthesize(CLAUSE, seed=seed).size:
            seeds.append(seed)
        seed += 1
    return seeds


def bench(on, seeds: list[int], warmup: int, cancel_on) -> dict:
    plain, session, own, thread = [], [], [], []
    for r, seed in enumerate(seeds):
        p = plain_first_audio(on, seed)
        s, first = session_first_audio(on, seed)
        t = plain_new_thread_first_audio(on, seed)
        if r >= warmup:
            plain.append(p)
            session.append(s)
            own.append(first)
            thread.append(t)
    steps = count_steps(cancel_on)
    cancels = [cancel_run(cancel_on, steps, 2000 + r) for r in range(len(seeds))][warmup:]
    out = {"plain_first_audio": summary(plain), "session_first_audio": summary(session),
           "session_own_first_audio_s": summary(own),
           "overhead_ms": ms(statistics.median(session) - statistics.median(plain)),
           "plain_new_thread_first_audio": summary(thread),
           "overhead_vs_new_thread_ms": ms(statistics.median(session) - statistics.median(thread)),
           "cancel": {"steps_after_cancel_max": max(c["steps_after_cancel"] for c in cancels),
                      "steps_after_cancel_median": statistics.median(c["steps_after_cancel"] for c in cancels),
                      "audio_events_after_cancel": sum(c["audio_events_after_cancel"] for c in cancels),
                      "slot_free_at_closed": all(c["slot_free_at_closed"] for c in cancels),
                      "cut_mid_utterance": all(c["cut_mid_utterance"] for c in cancels),
                      "cancel_to_closed": summary([c["cancel_to_closed_ms"] / 1e3 for c in cancels])}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8, help="the BatchEngine's slots")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.runs < 20:
        ap.error("--runs must be at least 20 (medians of >= 20 warm runs)")
    tts = TTS(args.model, args.codec, device=args.compute, dtype=args.dtype)
    engine = BatchEngine(tts, slots=args.slots, benchmark=True)
    seeds = speaking_seeds(tts, args.warmup + args.runs)
    try:
        results = {"run": run_info(tts.device), "model": args.model, "dtype": str(tts.dtype), "runs": args.runs,
                   "clause": CLAUSE, "completing_piece": COMPLETES,
                   "tts": bench(tts, seeds, args.warmup, endless_tts(tts)),
                   f"batch_engine_{args.slots}_slots": bench(engine, seeds, args.warmup, engine)}
    finally:
        engine.close()
    out = args.out or ROOT / "benchmarks" / "results" / f"session_{'gpu' if args.compute == 'cuda' else 'cpu'}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
