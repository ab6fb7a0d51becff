"""The speech server under load: time to first audio byte and aggregate frames per second per concurrency.

Starts its own `higgs-rt serve` on a free loopback port, warms it up, then for each concurrency level C keeps C
streamed requests in flight (each client sends its next request as soon as the previous one ends) for --requests
requests per client. Each client is a process of its own, as independent clients are (`--client-threads`: threads of
one process instead, as before e10d3c0's results: their GIL delays each client's reads, which the TTFB then counts).
Time to first byte is measured at the client (request sent -> first audio byte received, the streaming WAV header
excluded); frames per second from the server's own frame counter (/metrics) over the level's wall time, so it counts
every generated frame, prefill stalls included. With --ray-replicas N the server is `higgs-rt ray-serve --replicas
N` instead (Serve's proxy in front of N replicas; /metrics is one replica's, so frames per second is left out and
audio seconds per second stays). With --ignore-eos the server runs with --benchmark and every request is the text's
first sentence, one utterance of exactly --max-new-tokens frames (random weights would otherwise end utterances
anywhere). Each level also records ttfb_mean_ms beside server_ttfb_mean_ms, the server's own mean from request
received to first audio encoded (its /metrics histogram's sum and count over the level: what the client, the network
and the HTTP layer add is the difference); headers_mean_ms: request sent -> response headers received (the server
answers as soon as the job is queued, so this is what the request's own way in costs), headers_first_mean_ms the
same for each client's first request (all sent at once as the level starts) and connect_mean_ms its part before the
TCP handshake completed (the kernel's, and the client process's own start); loop_lag_mean_ms and
loop_lag_p99_below_ms: how late the server's event loop ran its probe timer over the level (from /metrics);
max_chunk_gap_ratio: the largest gap between two of the server's chunks (audio pieces arriving within 5 ms of each
other count as one: TCP splits a chunk) over the audio duration of the chunk before it; and max_underrun_ms /
underrun_requests: how late audio came for a real-time player that starts at the first byte with no pre-roll (> 0:
it ran dry; a player's pre-roll of that much would have covered it), with where (underrun_at_chunk: how many
underrunning requests waited most at each chunk index; underrun_at_ms_median: that chunk's arrival after the first
chunk's) and first_chunk_audio_ms_p50 (the first chunk's audio). The JSON has one field per level, `c1`, `c8`, ...
(with `frames_per_step` and `wall_ms_per_step`: frames/s is their quotient, so a level's loss against the step alone
splits into slots left idle and steps made slower; `decode_loop_share`, the decode thread's wall by phase,
`codec_busy_share`, `codec_gpu_share` (the GPU's wall from each codec call's first kernel to its last, beside the
steps), `codec_calls_per_s`, `codec_call_ms_mean`: whether the codec thread set the pace, `codec_lanes_per_call` and
`codec_frames_per_call`: how wide its calls were (on CUDA a call spans the bucket holding every lane in use,
`batch_codec.lane_bucket`),
`prefill_ticks`, `prefill_prompts` and `prefill_forwards`: how arrivals were taken in, and `first_audio_stage_ms`:
the mean of each stage of the server's own time to first audio, `higgs_rt.batch.FIRST_AUDIO_STAGES`), `step_b64_ms`,
`step_b8_ms` and `c8_fraction_of_step` from --step-json (bench_frame_latency's output for the same commit on the
same machine) when given, the server's peak memory from its /metrics at the end (`serve_peak_rss_GiB`, and
`serve_gpu_memory_peak_GiB` on CUDA; `serve_codec_warm_s`: its codec's CUDA graphs captured at its start), and
`loaded_vs_alone`: one request's audio alone and again while the top level's other clients each run one
(`same_codes`: equal length and within the codec's rounding; `--probes N` runs it N times, `same_codes` only if
every run had them).

    higgs-rt make-random-checkpoint /tmp/tiny                    # or --size full for the released shapes (GPU)
    PYTHONPATH=. python benchmarks/bench_server.py --model /tmp/tiny [--codec DIR] [--concurrency 1 8]
        [--slots 8] [--requests 4] [--max-new-tokens 300] [--compute cuda --dtype bf16] [--out FILE.json]
        [--ray-replicas 2 --threads 1] [--ignore-eos] [--step-json benchmarks/results/frame_latency_gpu.json]

Random weights end utterances at random points (the tiny model after a dozen frames or so), so each request
speaks several sentences: long text is split into utterances as in real use.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.meta import p90, run_info

TEXT = ("The sun rises in the east and sets in the west. Birds sing in the trees at dawn. A gentle breeze moves "
        "across the quiet lake. Children laugh as they run through the park. The old clock in the hall strikes "
        "noon. Rain falls softly on the roof all afternoon. A cup of tea waits on the kitchen table. The city "
        "lights come on one by one as night falls.")
HEADER = 44


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    """The server's /metrics text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def value_in(text: str, name: str) -> float | None:
    """One unlabelled sample of a /metrics text (None where it has none)."""
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def labelled_in(text: str, name: str, label: str) -> dict[str, float]:
    """A labelled counter's samples in a /metrics text, by the label's value ({} where it has none)."""
    return {k: float(v) for k, v in re.findall(rf'^{name}{{{label}="(\w+)"}} (\S+)$', text, re.M)}


def gauge(port: int, name: str) -> float | None:
    """One sample of the server's /metrics (None where it has none)."""
    return value_in(scrape(port), name)


def frames_total(port: int) -> float:
    return gauge(port, "higgs_rt_frames_total")


LOOP_LAG = "higgs_rt_event_loop_lag_seconds"
THREAD_COUNTERS = ("higgs_rt_codec_busy_seconds_total", "higgs_rt_codec_gpu_seconds_total",
                   "higgs_rt_codec_calls_total", "higgs_rt_codec_call_seconds_total",
                   "higgs_rt_codec_call_lanes_total", "higgs_rt_codec_call_frames_total",
                   "higgs_rt_first_audio_staged_requests_total",
                   "higgs_rt_prefill_ticks_total", "higgs_rt_prefill_prompts_total", "higgs_rt_prefill_forwards_total")


def thread_counters(port: int) -> dict[str, float]:
    """The decode loop's seconds by phase, the codec thread's counters and the first audio's seconds by stage,
    from /metrics ({} from an older server)."""
    text = scrape(port)
    out = {f"loop_{k}": v for k, v in labelled_in(text, "higgs_rt_decode_loop_seconds_total", "phase").items()}
    out |= {f"stage_{k}": v for k, v in labelled_in(text, "higgs_rt_first_audio_stage_seconds_total", "stage").items()}
    found = {name: value_in(text, name) for name in THREAD_COUNTERS}
    return out | {name: v for name, v in found.items() if v is not None}


def thread_stats(before: dict, after: dict, wall: float) -> dict:
    """Over a level: the share of its wall each decode-loop phase took, the codec thread's busy share, calls a
    second and mean call (what says whether the codec thread, not the step, set the pace), and the requests' mean
    time to first audio by stage (`first_audio_stage_ms`: where the server's own TTFB went)."""
    if not before or not after or wall <= 0:
        return {}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    calls = delta.get("higgs_rt_codec_calls_total", 0.0)
    staged = delta.get("higgs_rt_first_audio_staged_requests_total", 0.0)
    stages = {k.removeprefix("stage_"): round(1e3 * v / staged, 1) for k, v in delta.items()
              if k.startswith("stage_")} if staged else {}
    return {"first_audio_stage_ms": stages,
            "decode_loop_share": {k.removeprefix("loop_"): round(v / wall, 3) for k, v in delta.items()
                                  if k.startswith("loop_")},
            "codec_busy_share": round(delta.get("higgs_rt_codec_busy_seconds_total", 0.0) / wall, 3),
            "codec_gpu_share": round(delta.get("higgs_rt_codec_gpu_seconds_total", 0.0) / wall, 3),
            "codec_calls_per_s": round(calls / wall, 1),
            "codec_call_ms_mean": round(1e3 * delta.get("higgs_rt_codec_call_seconds_total", 0.0) / calls, 2)
            if calls else None,
            **{f"codec_{what}_per_call": round(delta.get(f"higgs_rt_codec_call_{what}_total", 0.0) / calls, 2)
               if calls else None for what in ("lanes", "frames")},
            **{f"prefill_{what}": int(delta.get(f"higgs_rt_prefill_{what}_total", 0))
               for what in ("ticks", "prompts", "forwards")}}


def histogram(port: int, name: str) -> dict:
    """One sample of a /metrics histogram: {"buckets": {upper bound: cumulative count}, "sum", "count"}."""
    text = scrape(port)
    buckets = {float(le): float(n) for le, n in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)}
    total, count = (float(re.search(rf"^{name}_{k} (\S+)$", text, re.M).group(1)) for k in ("sum", "count"))
    return {"buckets": buckets, "sum": total, "count": count}


def lag_stats(before: dict, after: dict) -> dict:
    """The server's event-loop lag over a level: its mean, and the bucket bound under which 99% of the samples
    fell (a timer due every few ms; a loop that runs late delays every request's reads and writes)."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"loop_lag_mean_ms": None, "loop_lag_p99_below_ms": None}
    p99 = next(le for le, n in after["buckets"].items() if n - before["buckets"][le] >= 0.99 * count)
    return {"loop_lag_mean_ms": round(1e3 * (after["sum"] - before["sum"]) / count, 2),
            "loop_lag_p99_below_ms": None if p99 == float("inf") else 1e3 * p99}


CHUNK_GAP_S = 0.005  # audio pieces that arrive closer than this are one chunk of the server's, split by TCP


def speak(port: int, body: dict, timeout: float) -> tuple[float, float, int, float, float, float, float, tuple]:
    """One streamed WAV request: (seconds to the first audio byte, seconds to the last, audio bytes, the largest
    gap between chunks over the audio duration of the chunk before it, the most a real-time client playing
    from the first byte, without pre-roll, would have waited for audio: max over chunks of its arrival minus the
    playback time of the audio before it, in ms (<= 0: it never underran), seconds to the response's headers,
    which the server sends as soon as the job is queued, seconds to the connection's handshake, which the
    kernel completes before the server's event loop accepts it, and where the player waited most: (the index of
    that chunk, the first chunk's audio in ms, that chunk's arrival in ms after the first's))."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.connect()
        connected = time.perf_counter() - start
        conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        headers = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        received, chunks = 0, []  # chunks: [arrival of the first piece, of the last piece, audio bytes]
        while piece := response.read1(65536):
            now = time.perf_counter()
            audio = min(len(piece), received + len(piece) - HEADER)
            received += len(piece)
            if audio <= 0:
                continue
            if chunks and now - chunks[-1][1] < CHUNK_GAP_S:
                chunks[-1][1] = now
                chunks[-1][2] += audio
            else:
                chunks.append([now, now, audio])
        seconds = lambda n: n / 2 / 24000  # noqa: E731 - 16-bit mono at 24 kHz
        gap_ratio = max((b[0] - a[1]) / seconds(a[2]) for a, b in zip(chunks, chunks[1:])) if len(chunks) > 1 else 0.0
        late, late_at, played = float("-inf"), -1, 0
        for i, (arrival, _, size) in enumerate(chunks):
            if arrival - chunks[0][0] - seconds(played) > late:
                late, late_at = arrival - chunks[0][0] - seconds(played), i
            played += size
        where = (late_at, 1e3 * seconds(chunks[0][2]) if chunks else float("nan"),
                 1e3 * (chunks[late_at][0] - chunks[0][0]) if chunks else float("nan"))
        return (chunks[0][0] - start if chunks else float("nan"), time.perf_counter() - start, received - HEADER,
                gap_ratio, 1e3 * late if chunks else float("nan"), headers, connected, where)
    finally:
        conn.close()


PROBE_SEED = 4242
SAME_CODES_LSB = 8  # same codes: the audio differs by the codec's rounding only (a few LSB); another code: far more


def pcm(port: int, body: dict, timeout: float) -> np.ndarray:
    """One request's whole audio as 16-bit samples (response_format pcm, not streamed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/audio/speech", json.dumps({**body, "response_format": "pcm"}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
        return np.frombuffer(data, "<i2")
    finally:
        conn.close()


def loaded_vs_alone(port: int, others: int, max_new_tokens: int, timeout: float, ignore_eos: bool,
                    processes: bool) -> dict:
    """One request (seed PROBE_SEED) alone, then again once `others` clients run a request each: whether its
    codes depend on the server's load. Compared as audio: the same length and samples within SAME_CODES_LSB (the
    same codes, decoded by codec calls of other widths); the SNR is reported beside."""
    body = {"input": TEXT.split(". ")[0] + ".", "seed": PROBE_SEED, "max_new_tokens": max_new_tokens,
            **({"ignore_eos": True} if ignore_eos else {})}
    alone = pcm(port, body, timeout)
    load = threading.Thread(target=run_clients, args=(others, (port, 1, max_new_tokens, timeout, ignore_eos),
                                                      processes))
    load.start()
    deadline = time.monotonic() + timeout
    while gauge(port, "higgs_rt_active_slots") < others and time.monotonic() < deadline:
        time.sleep(0.02)  # the others are admitted and generating first
    loaded = pcm(port, body, timeout)
    load.join()
    n = min(alone.size, loaded.size)
    a, b = alone[:n].astype(np.float64), loaded[:n].astype(np.float64)
    noise = float(((a - b) ** 2).sum())
    snr = None if noise == 0 else round(10 * np.log10(max(float((a ** 2).sum()), 1e-12) / noise), 1)
    worst = int(np.abs(a - b).max()) if n else None
    return {"others": others, "samples": [int(alone.size), int(loaded.size)], "max_abs_diff": worst,
            "snr_db": snr,  # None: bit-identical
            "same_codes": alone.size == loaded.size and worst is not None and worst <= SAME_CODES_LSB}


def client(c: int, port: int, requests: int, max_new_tokens: int, timeout: float, ignore_eos: bool) -> list:
    """One client's requests, one after another: [(speak's tuple) or the error's text]."""
    results = []
    for r in range(requests):
        body = {"input": TEXT.split(". ")[0] + "." if ignore_eos else TEXT, "stream": True, "seed": 1000 * c + r,
                "max_new_tokens": max_new_tokens}
        if ignore_eos:
            body["ignore_eos"] = True
        try:
            results.append(speak(port, body, timeout))
        except Exception as e:  # counted and shown; the level goes on
            results.append(str(e))
    return results


def _client_process(start, out, c: int, args: tuple) -> None:
    start.wait()
    out.send(client(c, *args))
    out.close()


def run_clients(concurrency: int, args: tuple, processes: bool) -> tuple[list, float]:
    """(every client's results, the seconds from their start to the last one's end); client c runs
    `client(c, *args)`. processes: each client a process of its own (forked, then started together), as independent
    clients are; else threads of this process, whose GIL then delays each client's reading of its socket."""
    if not processes:
        start = time.perf_counter()
        results = [None] * concurrency

        def run(c: int) -> None:
            results[c] = client(c, *args)

        threads = [threading.Thread(target=run, args=(c,)) for c in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, time.perf_counter() - start
    ctx = multiprocessing.get_context("fork")
    start, pipes, procs = ctx.Event(), [], []
    for c in range(concurrency):
        receive, send = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_client_process, args=(start, send, c, args), daemon=True))
        procs[-1].start()
        send.close()
        pipes.append(receive)
    started = time.perf_counter()
    start.set()
    results = [pipe.recv() for pipe in pipes]
    wall = time.perf_counter() - started
    for p in procs:
        p.join()
    return results, wall


def level(port: int, concurrency: int, requests: int, max_new_tokens: int, timeout: float,
          frames_counted: bool = True, ignore_eos: bool = False, processes: bool = True) -> dict:
    ttfb, whole, audio_bytes, gaps, lateness, to_headers, connects, errors = [], [], [], [], [], [], [], []
    first_headers = []  # each client's first request: all sent at once as the level starts
    first_audio = "higgs_rt_time_to_first_audio_seconds"
    server_before = (gauge(port, f"{first_audio}_sum"), gauge(port, f"{first_audio}_count")) if frames_counted \
        else None
    lag_before = histogram(port, LOOP_LAG) if frames_counted else None
    before = frames_total(port) if frames_counted else 0
    steps_before = gauge(port, "higgs_rt_steps_total") if frames_counted else None
    threads_before = thread_counters(port) if frames_counted else {}
    underrun_where, first_chunk_ms = [], []  # (chunk index, first chunk's audio ms, that chunk's arrival ms)
    results, wall = run_clients(concurrency, (port, requests, max_new_tokens, timeout, ignore_eos), processes)
    for i, result in ((i, r) for each in results for i, r in enumerate(each)):
        if isinstance(result, str):
            errors.append(result)
            continue
        first, done, size, gap, late, headers, connected, where = result
        if late > 0:
            underrun_where.append(where)
        first_chunk_ms.append(where[1])
        to_headers.append(headers)
        connects.append(connected)
        if i == 0:
            first_headers.append(headers)
        ttfb.append(first)
        whole.append(done)
        audio_bytes.append(size)
        gaps.append(gap)
        lateness.append(late)
    frames = frames_total(port) - before if frames_counted else float("nan")
    steps = gauge(port, "higgs_rt_steps_total") - steps_before if steps_before is not None else None
    threads = thread_stats(threads_before, thread_counters(port), wall) if frames_counted else {}
    server_mean = None
    if server_before is not None:  # the server's own request -> first audio encoded, over this level's requests
        total, count = gauge(port, f"{first_audio}_sum") - server_before[0], \
            gauge(port, f"{first_audio}_count") - server_before[1]
        server_mean = round(1e3 * total / count, 1) if count else None
    lag = lag_stats(lag_before, histogram(port, LOOP_LAG)) if lag_before is not None else {}
    ms = sorted(1e3 * t for t in ttfb)
    request_ms = sorted(1e3 * t for t in whole)
    return {"concurrency": concurrency, "requests": len(ttfb), "errors": len(errors),
            "ttfb_p50_ms": round(statistics.median(ms), 1) if ms else None,
            "ttfb_p90_ms": round(p90(ms), 1) if ms else None,
            "ttfb_mean_ms": round(statistics.fmean(ms), 1) if ms else None, "server_ttfb_mean_ms": server_mean,
            "headers_mean_ms": round(1e3 * statistics.fmean(to_headers), 1) if to_headers else None,
            "headers_first_mean_ms": round(1e3 * statistics.fmean(first_headers), 1) if first_headers else None,
            "connect_mean_ms": round(1e3 * statistics.fmean(connects), 2) if connects else None, **lag,
            "request_ms_p50": round(statistics.median(request_ms), 1) if request_ms else None,
            "frames_per_s": round(frames / wall, 1) if frames_counted else None,
            "audio_s_per_s": round(sum(audio_bytes) / 2 / 24000 / wall, 2), "wall_s": round(wall, 2),
            "max_chunk_gap_ratio": round(max(gaps), 3) if gaps else None,
            "max_underrun_ms": round(max(lateness), 1) if lateness else None,
            "underrun_requests": sum(late > 0 for late in lateness),
            "underrun_at_chunk": dict(sorted(Counter(str(w[0]) for w in underrun_where).items())),
            "underrun_at_ms_median": round(statistics.median(w[2] for w in underrun_where), 1) if underrun_where
            else None,
            "first_chunk_audio_ms_p50": round(statistics.median(first_chunk_ms), 1) if first_chunk_ms else None,
            "frames": int(frames) if frames_counted else None, "steps": int(steps) if steps is not None else None,
            # frames/s = frames_per_step / step time: how full the slots ran, and how long a step took on average
            # over the level's wall (prefills, idle gaps and the codec's share included)
            "frames_per_step": round(frames / steps, 2) if steps else None,
            "wall_ms_per_step": round(1e3 * wall / steps, 3) if steps else None, **threads,
            **({"first_error": errors[0]} if errors else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--codec")
    ap.add_argument("--compute", default="auto")
    ap.add_argument("--dtype")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=4, help="per client and level")
    ap.add_argument("--min-requests", type=int, default=0, help="per level at least (so p90 means something)")
    ap.add_argument("--max-new-tokens", type=int, default=300)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    ap.add_argument("--ray-replicas", type=int, default=0, help="N > 0: `higgs-rt ray-serve --replicas N`")
    ap.add_argument("--threads", type=int, default=1, help="with --ray-replicas: CPU threads per replica")
    ap.add_argument("--ignore-eos", action="store_true", help="serve --benchmark; every request runs its frames")
    ap.add_argument("--step-json", type=Path, help="bench_frame_latency's JSON (the same machine's): its b64_ms and "
                    "b8_ms go in as step_b64_ms and step_b8_ms, with c8_fraction_of_step")
    ap.add_argument("--probes", type=int, default=1, help="times the loaded-vs-alone probe runs (a race shows in "
                    "some runs only)")
    ap.add_argument("--serve-args", default="", help="more arguments for `higgs-rt serve` (e.g. '--prefill-tokens "
                    "1024')")
    ap.add_argument("--client-threads", action="store_true",
                    help="the clients as threads of one process (the default: a process each)")
    args = ap.parse_args()
    ray = args.ray_replicas > 0

    port = free_port()
    cmd = [sys.executable, "-m", "higgs_rt.cli", "ray-serve" if ray else "serve", "--model", args.model, "--port",
           str(port), "--slots", str(args.slots), "--queue", str(max(args.concurrency)), "--compute", args.compute]
    cmd += ["--replicas", str(args.ray_replicas), "--threads", str(args.threads)] if ray else ["--log-level", "warning"]
    cmd += ["--codec", args.codec] if args.codec else []
    cmd += ["--dtype", args.dtype] if args.dtype else []
    cmd += ["--benchmark"] if args.ignore_eos else []
    cmd += shlex.split(args.serve_args)
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                frames_total(port)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start (exit code {server.poll()})")
                time.sleep(0.5)
        processes = not args.client_threads
        level(port, min(args.concurrency), 1, args.max_new_tokens, args.timeout_s, not ray, args.ignore_eos,
              processes)  # warm-up
        results = []
        for c in args.concurrency:
            results.append(level(port, c, max(args.requests, args.min_requests // c), args.max_new_tokens,
                                 args.timeout_s, not ray, args.ignore_eos, processes))
        probes = [] if ray or max(args.concurrency) < 2 else [loaded_vs_alone(
            port, max(args.concurrency) - 1, args.max_new_tokens, args.timeout_s, args.ignore_eos, processes)
            for _ in range(args.probes)]
        probe = None if not probes else {  # the first run's figures; same_codes only if every run had them
            **probes[0], "same_codes": all(p["same_codes"] for p in probes), "runs": len(probes),
            "same_runs": sum(p["same_codes"] for p in probes),
            "max_abs_diff_by_run": [p["max_abs_diff"] for p in probes]}
        gib = lambda v: None if v is None else round(v / 2**30, 2)  # noqa: E731
        memory = {"serve_peak_rss_GiB": gib(gauge(port, "higgs_rt_process_peak_rss_bytes")),
                  "serve_gpu_memory_peak_GiB": gib(gauge(port, "higgs_rt_gpu_memory_peak_bytes")),
                  "serve_codec_warm_s": gauge(port, "higgs_rt_codec_warm_seconds")}
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"{'conc':>4} {'reqs':>5} {'TTFB p50 ms':>12} {'p90 ms':>8} {'request p50 ms':>14} {'frames/s':>9} "
          f"{'audio s/s':>9} {'wall s':>7} {'gap ratio':>9} {'underrun ms':>11}")
    for r in results:
        print(f"{r['concurrency']:>4} {r['requests']:>5} {r['ttfb_p50_ms']!s:>12} {r['ttfb_p90_ms']!s:>8} "
              f"{r['request_ms_p50']!s:>14} {r['frames_per_s']!s:>9} {r['audio_s_per_s']:>9} {r['wall_s']:>7} "
              f"{r['max_chunk_gap_ratio']!s:>9} {r['max_underrun_ms']!s:>11}"
              + (f"  TTFB mean {r['ttfb_mean_ms']} ms, server's own {r['server_ttfb_mean_ms']} ms, headers "
                 f"{r['headers_mean_ms']} ms (first requests {r['headers_first_mean_ms']}, connect "
                 f"{r['connect_mean_ms']}); event loop lag mean {r['loop_lag_mean_ms']} ms, p99 < "
                 f"{r['loop_lag_p99_below_ms']} ms" if r.get("server_ttfb_mean_ms") is not None else "")
              + ("; by stage " + ", ".join(f"{k} {v}" for k, v in r["first_audio_stage_ms"].items()) + " ms"
                 if r.get("first_audio_stage_ms") else "")
              + (f"  {r['errors']} errors: {r['first_error']}" if r["errors"] else ""))
    if probe is not None:
        print(f"seed {PROBE_SEED} with {probe['others']} others running vs alone: {probe['samples']} samples, max "
              f"difference {probe['max_abs_diff']}, {'inf (identical)' if probe['snr_db'] is None else probe['snr_db']} dB: "
              f"{'the same codes' if probe['same_codes'] else 'OTHER CODES'}"
              + (f" (all {probe['runs']} runs: {probe['same_runs']} the same, max differences "
                 f"{probe['max_abs_diff_by_run']})" if probe["runs"] > 1 else ""))
    print(f"server peak memory: {memory['serve_peak_rss_GiB']} GiB resident"
          + (f", {memory['serve_gpu_memory_peak_GiB']} GiB on the GPU" if memory["serve_gpu_memory_peak_GiB"] else "")
          + (f"; the codec's CUDA graphs took {memory['serve_codec_warm_s']:.2f} s at its start"
             if memory["serve_codec_warm_s"] else ""))
    if args.out:
        import torch


        device = torch.device("cuda" if args.compute != "cpu" and torch.cuda.is_available() else "cpu")
        out = run_info(device) | {"model": args.model, "slots": args.slots, "ray_replicas": args.ray_replicas,
                                  "ignore_eos": args.ignore_eos, "max_new_tokens": args.max_new_tokens,
                                  "clients": "threads" if args.client_threads else "processes",
                                  "serve_args": args.serve_args}
        out |= {f"c{r['concurrency']}": r for r in results} | memory | {"loaded_vs_alone": probe}
        if args.step_json and args.step_json.is_file():
            step = json.loads(args.step_json.read_text())
            out["step_b64_ms"], out["step_b8_ms"] = step.get("b64_ms"), step.get("b8_ms")
            out["step_json"] = str(args.step_json)
            if out["step_b8_ms"] and "c8" in out:  # the target: >= 0.9 of what the batch-8 step alone makes
                out["c8_fraction_of_step"] = round(out["c8"]["frames_per_s"] * out["step_b8_ms"] / 8e3, 3)
        elif args.step_json:
            print(f"no {args.step_json}: step_b64_ms left out", file=sys.stderr)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
