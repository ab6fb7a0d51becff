"""The batch engine in process (no HTTP): where a tick of the decode loop and the codec thread spend their time.

Runs `BatchEngine` on a model directory with --slots slots (`codec_warm_s`: the codec's CUDA graphs captured at
its start, `BatchCodec.warm`), warms it up (one short level), then for each concurrency level C runs C consumer
threads, each submitting its next job as soon as the previous one's PCM has been drained, --requests jobs per
thread. Every job is one utterance of exactly --max-new-tokens frames (the text's first sentence, `ignore_eos`),
or with --sentences N that sentence N times, N utterances of that length (a text's later sentences: the codec's
lanes drain between them, and their first chunks come while the earlier audio still plays). Per level:

  frames_per_s, steps_per_s   the engine's frame and step counters over the level's wall time
  ttfb_p50_ms / p90 / mean    job.stats.first_audio_s (submit -> first PCM chunk emitted by the codec thread)
  first_audio_stage_ms        the mean of each stage from submit to the consumer taking its first chunk
                              (`higgs_rt.batch.FIRST_AUDIO_STAGES`; parse is 0 here, send the consumer's wake)
  busy_rows_per_step          busy slots per step (stepped_rows_per_step: rounded up to the step's bucket)
  loop_ms_per_tick            the decode thread's host time per tick by phase (`BatchEngine.loop_seconds`: idle,
                              admit, prefill, step, codec_tick, wait, route, other); idle here is the wall time
                              less the other phases (the counter's would include the wait before the level began,
                              while the last level's audio drained), so they add up to the wall time
  codec                       the codec thread (`BatchCodec.work`): pushes per second, mean frames and lanes per
                              push, its busy fraction of the wall time (and the parts in ticks and in pushes),
                              the most messages it found waiting

With --profile-dir, the highest level is run once more under torch.profiler (CPU, and CUDA on a GPU): started
after --profile-after-s of the level, stopped --profile-window-s later, from the main thread while the consumers
run (its own entry, `profiled`, so the timed levels carry no profiler overhead). Its summary: the device time per
CUDA stream in the window (kernel time summed and busy time as the union of intervals; the decode step runs on
the default stream, the codec on its own), the busy time of all streams together, the 15 kernels with the most
time, and the steps and ticks in the window; the Chrome trace goes, gzipped, to the directory. A failure there
is recorded as `profiled.error`, not raised.

    higgs-rt make-random-checkpoint /tmp/tiny                    # or --size full for the released shapes (GPU)
    PYTHONPATH=. python -m benchmarks.bench_engine --model /tmp/tiny --compute cpu --slots 4 --concurrency 1 4 \
        --requests 2 --max-new-tokens 40 --out benchmarks/results/engine_cpu.json
    python3 -m benchmarks.bench_engine --model /tmp/full --compute cuda --dtype bf16 --slots 64 --concurrency 8 64 \
        --requests 4 --max-new-tokens 300 --out engine_gpu.json --profile-dir profile/
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.meta import add_model_args, p90, run_info
from higgs_rt.batch import FIRST_AUDIO_STAGES, LOOP_PHASES, BatchEngine
from higgs_rt.engine import TTS

TEXT = "The sun rises in the east and sets in the west."  # one utterance: ignore_eos makes it max frames long
TRACE_MAX_BYTES = 20 << 20


def wait(threads: list[threading.Thread], seconds: float) -> bool:
    """Wait up to `seconds` for the threads to end; True while some still run."""
    deadline = time.perf_counter() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    return any(t.is_alive() for t in threads)


def level(engine: BatchEngine, concurrency: int, requests: int, max_frames: int, during=None,
          sentences: int = 1) -> dict:
    """C consumer threads, `requests` jobs each; `during(threads)` runs on this thread while they do."""
    ttfb, errors, stages = [], [], []
    text = TEXT if sentences == 1 else [TEXT] * sentences

    def consumer(c: int) -> None:
        for r in range(requests):
            try:
                job = engine.submit(text, ignore_eos=True, max_frames=max_frames, seed=1000 * c + r)
                taken = None
                for _ in job:
                    taken = taken or time.perf_counter()
                if job.stats.first_audio_s is not None:
                    ttfb.append(job.stats.first_audio_s)
                    stages.append(job.first_audio_stages(job.submitted, taken))
            except Exception as e:  # counted and shown; the level goes on
                errors.append(f"{type(e).__name__}: {e}")

    engine.codec.work["backlog_max"] = 0  # this level's
    loop0, codec0 = dict(engine.loop_seconds), dict(engine.codec.work)
    frames0, steps0 = engine.frames_total, engine.steps_total
    start = time.perf_counter()
    threads = [threading.Thread(target=consumer, args=(c,)) for c in range(concurrency)]
    for t in threads:
        t.start()
    extra = during(threads) if during is not None else None
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    loop = {k: v - loop0[k] for k, v in engine.loop_seconds.items()}
    loop["idle"] = max(0.0, wall - sum(loop[p] for p in LOOP_PHASES if p != "idle"))
    codec = {k: v - codec0[k] for k, v in engine.codec.work.items() if k != "backlog_max"}
    frames, steps, ticks = engine.frames_total - frames0, engine.steps_total - steps0, max(loop["ticks"], 1)
    ms = sorted(1e3 * t for t in ttfb)
    pushes = max(codec["pushes"], 1)
    out = {"concurrency": concurrency, "requests": concurrency * requests - len(errors), "errors": len(errors),
           "wall_s": round(wall, 3), "frames": frames, "frames_per_s": round(frames / wall, 1),
           "steps": steps, "steps_per_s": round(steps / wall, 1), "ticks": loop["ticks"],
           "ttfb_p50_ms": round(statistics.median(ms), 1) if ms else None,
           "ttfb_p90_ms": round(p90(ms), 1) if ms else None,
           "ttfb_mean_ms": round(statistics.fmean(ms), 1) if ms else None,
           "first_audio_stage_ms": {stage: round(1e3 * statistics.fmean(s.get(stage, 0.0) for s in stages), 2)
                                    for stage, _ in FIRST_AUDIO_STAGES} if stages else {},
           "busy_rows_per_step": round(loop["rows"] / max(loop["steps"], 1), 2),
           "stepped_rows_per_step": round(loop["stepped"] / max(loop["steps"], 1), 2),
           "loop_ms_per_tick": {p: round(1e3 * loop[p] / ticks, 4) for p in LOOP_PHASES},
           "loop_fraction_of_wall": {p: round(loop[p] / wall, 4) for p in LOOP_PHASES},
           "codec": {"pushes_per_s": round(codec["pushes"] / wall, 1),
                     "frames_per_push": round(codec["push_frames"] / pushes, 2),
                     "lanes_per_push": round(codec["push_lanes"] / pushes, 2),
                     "busy_fraction": round(codec["busy_s"] / wall, 4),
                     "tick_fraction": round(codec["tick_s"] / wall, 4),
                     "push_fraction": round(codec["push_s"] / wall, 4),
                     "ms_per_push": round(1e3 * codec["push_s"] / pushes, 3),
                     "ms_per_tick": round(1e3 * codec["tick_s"] / max(codec["ticks"], 1), 4),
                     "backlog_max": engine.codec.work["backlog_max"]}}
    if errors:
        out["first_error"] = errors[0]
    if extra is not None:
        out["profile"] = extra
    return out


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def stream_of(event) -> int | None:
    """The CUDA stream of a device event: Kineto's "stream" metadata where torch has it, else the event's device
    resource id (the stream, for device events)."""
    stream = getattr(getattr(event, "event_metadata", None), "stream", None)
    return stream if stream is not None else getattr(event, "device_resource_id", None)


def summary(prof, window_s: float) -> dict:
    """Device time per stream in the window, all streams together, the top 15 kernels (names cut short), and the
    top 15 host ops by self time."""
    from torch.autograd import DeviceType

    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    by_stream, names = defaultdict(list), defaultdict(lambda: [0.0, 0, set()])
    for e in device:
        span = (e.time_range.start, e.time_range.end)
        by_stream[stream_of(e)].append(span)
        names[e.name][0] += span[1] - span[0]
        names[e.name][1] += 1
        names[e.name][2].add(str(stream_of(e)))
    ops = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.device_type == DeviceType.CPU:
            ops[e.name][0] += e.self_cpu_time_total
            ops[e.name][1] += 1
    window_us = 1e6 * window_s
    streams = {str(s): {"events": len(v), "kernel_ms": round(sum(b - a for a, b in v) / 1e3, 3),
                        "busy_ms": round(union_us(v) / 1e3, 3), "busy_fraction": round(union_us(v) / window_us, 4)}
               for s, v in sorted(by_stream.items(), key=lambda kv: -len(kv[1]))}
    every = [span for v in by_stream.values() for span in v]
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:15]
    return {"device_events": len(device), "streams": streams,
            "all_streams_busy_ms": round(union_us(every) / 1e3, 3),
            "all_streams_busy_fraction": round(union_us(every) / window_us, 4),
            "top_kernels": [{"name": name[:160], "total_ms": round(us / 1e3, 3), "calls": calls,
                             "mean_us": round(us / calls, 2), "streams": sorted(on)} for name, (us, calls, on) in top],
            "top_host_ops": [{"name": name[:160], "self_ms": round(us / 1e3, 3), "calls": n}
                             for name, (us, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:15]]}


def trace_summary(trace: dict, window_s: float, consumers: list[threading.Thread]) -> dict:
    """Per host thread of the Chrome trace (the decode and codec threads by name, the consumer threads together):
    per category (cpu_op, cuda_runtime, cuda_driver, ...) its events and the time they cover (the union, so nested
    ops count once), and its 8 event names with the most time (CUDA API calls show where a thread waits)."""
    names = {t.native_id: t.name for t in threading.enumerate()} | {t.native_id: "consumers" for t in consumers}
    pid = os.getpid()
    spans, totals = defaultdict(list), defaultdict(lambda: [0.0, 0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("pid") != pid or "dur" not in e:  # the device's events have its pid
            continue
        thread = names.get(e["tid"], str(e["tid"]))
        spans[thread, e.get("cat")].append((e["ts"], e["ts"] + e["dur"]))
        totals[thread, e.get("cat"), e.get("name", "")][0] += e["dur"]
        totals[thread, e.get("cat"), e.get("name", "")][1] += 1
    out: dict = defaultdict(dict)
    for (thread, cat), v in sorted(spans.items(), key=lambda kv: -len(kv[1])):
        out[thread][cat] = {"events": len(v), "busy_ms": round(union_us(v) / 1e3, 3),
                            "busy_fraction": round(union_us(v) / (1e6 * window_s), 4)}
    for thread in out:
        top = sorted(((k, v) for k, v in totals.items() if k[0] == thread), key=lambda kv: -kv[1][0])[:8]
        out[thread]["top"] = [{"cat": cat, "name": name[:120], "total_ms": round(us / 1e3, 3), "calls": n}
                              for (_, cat, name), (us, n) in top]
    return dict(out)


def experimental_config():
    """The profiler options this torch has, of: record the ops of every thread (the decode and codec threads', not
    only this one's), Kineto's event metadata (a kernel's stream), CUDA synchronizations as events."""
    from torch._C._profiler import _ExperimentalConfig

    wanted = dict(profile_all_threads=True, expose_kineto_event_metadata=True, enable_cuda_sync_events=True)
    for names in (wanted, ("profile_all_threads", "enable_cuda_sync_events"), ("profile_all_threads",), ()):
        options = {k: True for k in names}
        try:
            return _ExperimentalConfig(**options), sorted(options)
        except TypeError:  # an option this torch lacks
            continue


def profiler(engine: BatchEngine, device: torch.device, out_dir: Path, after_s: float, window_s: float):
    """A `during` for `level`: profile `window_s` seconds of the level from `after_s` on; errors are recorded."""

    def during(threads: list[threading.Thread]) -> dict:
        result: dict = {}
        try:
            from torch.profiler import ProfilerActivity, profile

            if not wait(threads, after_s):
                return {"error": f"the level ended within {after_s} s, before the profiler started"}
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            config, options = experimental_config()
            result["profiler_options"] = options
            prof = profile(activities=activities, experimental_config=config)
            loop0 = dict(engine.loop_seconds)
            prof.start()
            began = time.perf_counter()
            try:
                ran = wait(threads, window_s)
                window = time.perf_counter() - began
            finally:
                prof.stop()
            loop = {k: engine.loop_seconds[k] - loop0[k] for k in ("ticks", "steps", "rows")}
            result |= {"window_s": round(window, 3), "level_running_at_stop": ran, **loop}
            result |= summary(prof, window)
            out_dir.mkdir(parents=True, exist_ok=True)
            raw = out_dir / f"engine_c{len(threads)}_trace.json"
            prof.export_chrome_trace(str(raw))
            try:
                result["host_threads"] = trace_summary(json.loads(raw.read_text()), window, threads)
            except Exception as e:
                result["host_threads"] = {"error": f"{type(e).__name__}: {e}"}
            trace = raw.with_suffix(".json.gz")
            with raw.open("rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            if trace.stat().st_size > TRACE_MAX_BYTES:
                result["trace"] = f"dropped: {trace.stat().st_size >> 20} MiB gzipped"
                trace.unlink()
            else:
                result["trace"] = trace.name
        except Exception as e:  # the profile is a bonus: the benchmark's numbers stand without it
            result["error"] = f"{type(e).__name__}: {e}"
        return result

    return during


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--requests", type=int, default=4, help="jobs per consumer thread and level")
    ap.add_argument("--max-new-tokens", type=int, default=300, help="frames per utterance")
    ap.add_argument("--sentences", type=int, default=1, help="utterances per job, one after another")
    ap.add_argument("--warmup-tokens", type=int, default=40, help="frames per job of the warm-up level")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile-dir", type=Path, help="profile the highest level once more; its trace goes here")
    ap.add_argument("--profile-after-s", type=float, default=2.0)
    ap.add_argument("--profile-window-s", type=float, default=1.5)
    args = ap.parse_args()
    if max(args.concurrency) > args.slots:
        ap.error("a concurrency above --slots would measure the queue, not the engine")
    if args.sentences < 1:
        ap.error("--sentences must be at least 1")

    t0 = time.perf_counter()
    tts = TTS(args.model, args.codec, device=args.compute, dtype=args.dtype, warmup=False)
    engine = BatchEngine(tts, slots=args.slots, queue=max(args.concurrency), benchmark=True)
    out = run_info(tts.device) | {"model": args.model, "dtype": str(tts.dtype), "slots": args.slots,
                                  "requests": args.requests, "max_new_tokens": args.max_new_tokens,
                                  "sentences": args.sentences,
                                  "load_s": round(time.perf_counter() - t0, 2),
                                  "codec_warm_s": round(engine.codec_warm_s, 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each level too: a crash in the profiler keeps what was measured
        args.out.write_text(json.dumps(out, indent=1) + "\n")

    try:
        t0 = time.perf_counter()
        # every step bucket up to the top level's and the codec's first pushes, captured before timing
        level(engine, max(args.concurrency), 1, args.warmup_tokens)
        out["warmup_s"] = round(time.perf_counter() - t0, 2)
        for c in args.concurrency:
            out[f"c{c}"] = r = level(engine, c, args.requests, args.max_new_tokens, sentences=args.sentences)
            save()
            print(f"c{c}: {r['frames_per_s']} frames/s, {r['steps_per_s']} steps/s, TTFB p50 {r['ttfb_p50_ms']} ms, "
                  f"{r['busy_rows_per_step']} rows/step; ms per tick {r['loop_ms_per_tick']}; codec {r['codec']}",
                  flush=True)
        if args.profile_dir:
            c = max(args.concurrency)
            during = profiler(engine, tts.device, args.profile_dir, args.profile_after_s, args.profile_window_s)
            out["profiled"] = level(engine, c, args.requests, args.max_new_tokens, during, args.sentences)
            profile = out["profiled"].get("profile", {})
            brief = profile.get("error") or {k: profile.get(k) for k in ("window_s", "steps", "streams")}
            print(f"profiled c{c}: {brief}", flush=True)
        if tts.device.type == "cuda":
            out["gpu_memory_peak_GiB"] = round(torch.cuda.max_memory_allocated(tts.device) / 2**30, 2)
    finally:
        engine.close()
    save()


if __name__ == "__main__":
    main()
