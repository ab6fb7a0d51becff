"""The HTTP layer alone: what one speech request costs the server's event loop before its response headers.

The server's own app (`higgs_rt.server`, every middleware) runs on uvicorn in a process of its own, over a
`BatchEngine` whose `submit` is stubbed: each job sends one chunk of silence after --hold seconds, so no model
work runs and the decode loop stays idle. One asyncio client process opens --burst connections, then sends a
request on each at once (a burst, as the server benchmark's clients start a level); each request's time to its
response headers is recorded. The last headers over the burst size is the loop's cost per request, the figure
`bench_server.py`'s headers_mean_ms (63 ms at 64 streams on the H200, 2026-12-05: ~2 ms a request) is judged
against. Three server set-ups run in turn: `idle` (nothing else holds the GIL); `gil` (a thread holds the GIL in
pure Python for 4 ms, letting go for a moment every 0.5 ms as the decode and codec threads' torch calls do, then
sleeps 3 ms: how much a loaded decode thread's host work could slow the loop); `gil_switch` (the same with
`sys.setswitchinterval(0.0005)`).

    higgs-rt make-random-checkpoint /tmp/tiny
    PYTHONPATH=. python benchmarks/bench_http.py --model /tmp/tiny [--burst 64] [--rounds 6]
        [--out benchmarks/results/http_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import free_port  # noqa: E402
from meta import commit  # noqa: E402

BODY = json.dumps({"model": "higgs-audio-v2", "input": "Hello there, how are you today?", "voice": "default",
                   "response_format": "wav", "stream": True}).encode()
REQUEST = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
GIL_SLICE_S = 5e-4  # the load thread lets the GIL go this often, as a torch call does
SETUPS = {"idle": (None, None), "gil": ((4.0, 3.0), None), "gil_switch": ((4.0, 3.0), 5e-4)}  # (GIL load ms, switch s)


def hold_gil(busy_s: float, idle_s: float) -> None:
    while True:
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            lap = time.perf_counter() + GIL_SLICE_S
            while time.perf_counter() < lap:
                pass
            time.sleep(0)
        time.sleep(idle_s)


def serve(model: str, port: int, hold_s: float, gil_load: tuple[float, float] | None, switch: float | None) -> None:
    import numpy as np
    import uvicorn

    from higgs_rt.batch import BatchEngine
    from higgs_rt.engine import TTS
    from higgs_rt.server import create_app

    class Stats:
        audio_s = rtf = frames = 0

    class StubJob:  # what the server reads of a `Job`
        prompt_tokens, cancelled, stats = 1, False, Stats()

        def cancel(self) -> None:
            pass

        async def chunks(self):
            await asyncio.sleep(hold_s)
            yield np.zeros(960, np.float32)

    tts = TTS(model, device="cpu")
    engine = BatchEngine(tts, slots=1)
    engine.submit = lambda *args, **kwargs: StubJob()
    app = create_app(tts, engine, "higgs-audio-v2")
    if switch:
        sys.setswitchinterval(switch)
    if gil_load:
        threading.Thread(target=hold_gil, args=(gil_load[0] / 1e3, gil_load[1] / 1e3), daemon=True).start()
    uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off")).run()


async def one(port: int, go: asyncio.Event) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await go.wait()
        start = time.perf_counter()
        writer.write(REQUEST)
        status = await reader.readline()
        headers = time.perf_counter() - start
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the server answered {status!r}")
        while await reader.readline() not in (b"\r\n", b""):
            pass
        while size := int((await reader.readline()).strip() or b"0", 16):  # the chunked body to its last chunk
            await reader.readexactly(size + 2)
        return headers
    finally:
        writer.close()


async def burst(port: int, n: int) -> list[float]:
    go = asyncio.Event()
    tasks = [asyncio.create_task(one(port, go)) for _ in range(n)]
    await asyncio.sleep(0.3)  # every connection open
    go.set()
    return sorted(await asyncio.gather(*tasks))


def wait_ready(port: int, server, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start" + (f" (exit code {server.returncode})" if server.poll() else ""))


def run_setup(args, gil_load, switch) -> dict:
    port = free_port()
    extra = (["--gil-load", *map(str, gil_load)] if gil_load else []) + (["--switch", str(switch)] if switch else [])
    server = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--hold", str(args.hold),
                               "--serve", str(port), *extra])
    try:
        wait_ready(port, server)
        asyncio.run(burst(port, 4))  # warm-up
        per_request, means = [], []
        for _ in range(args.rounds):
            headers = asyncio.run(burst(port, args.burst))
            per_request.append(1e3 * headers[-1] / args.burst)
            means.append(1e3 * statistics.fmean(headers))
    finally:
        server.terminate()  # uvicorn's graceful exit
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {"gil_load_ms": gil_load, "switch_interval_s": switch,
            "headers_mean_ms": round(statistics.median(means), 2),
            "loop_ms_per_request": round(statistics.median(per_request), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6, help="bursts per set-up (the median is reported)")
    ap.add_argument("--hold", type=float, default=0.3, help="seconds from a request to its one chunk")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server process itself
    ap.add_argument("--gil-load", type=float, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--switch", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.model, args.serve, args.hold, args.gil_load, args.switch)
        return 0

    result = {"device": "cpu", "cpus": os.cpu_count(), "commit": commit(), "python": sys.version.split()[0],
              "burst": args.burst, "rounds": args.rounds}
    for name, (gil_load, switch) in SETUPS.items():
        result[name] = r = run_setup(args, gil_load, switch)
        print(f"{name:>10}: headers mean {r['headers_mean_ms']} ms, {r['loop_ms_per_request']} ms a request")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
