"""Time to first audio over the server's WebSocket against the plain HTTP request, on one `higgs-rt serve`.

For each round, one at a time (nothing else running): the HTTP API's streamed pcm request for a clause (request
sent -> first audio byte); then a WebSocket session opened for the round: the same clause as a text piece (the
piece that ends the clause sent -> its first binary frame; the piece carries the space after the punctuation,
so the clause is complete when it arrives), and once it has been spoken a second clause the same way, whose
prompt carries the first as its voice reference (as every later clause of a reply does). Medians over --rounds
after --warmup rounds.

    higgs-rt make-random-checkpoint /tmp/tiny                    # or --size full for the released shapes (GPU)
    PYTHONPATH=. python benchmarks/bench_ws.py --model /tmp/tiny [--compute cuda --dtype bf16] [--rounds 20]
        [--out benchmarks/results/ws_cpu.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from websockets.sync.client import connect

from benchmarks.meta import add_model_args, run_info

CLAUSES = ["The sun rises in the east and sets in the west.", "Birds sing in the trees at dawn.",
           "A gentle breeze moves across the quiet lake.", "The old clock in the hall strikes noon."]
SETTINGS = {"seed": 1, "max_new_tokens": 250}
TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_first_audio(port: int, text: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        body = json.dumps({"input": text, "response_format": "pcm", "stream": True, **SETTINGS})
        start = time.perf_counter()
        conn.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        assert response.read1(65536), "no audio"
        first = time.perf_counter() - start
        response.read()
        return first
    finally:
        conn.close()


def ws_first_audio(ws, text: str) -> float:
    start = time.perf_counter()
    ws.send(json.dumps({"type": "text", "text": text + " "}))
    first = None
    while True:
        message = ws.recv(timeout=TIMEOUT)
        if isinstance(message, bytes):
            first = first or time.perf_counter() - start
            continue
        event = json.loads(message)
        assert event["type"] in ("start", "end"), event
        if event["type"] == "end":
            return first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, compute="auto")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "higgs_rt.cli", "serve", "--model", args.model, "--port", str(port),
           "--compute", args.compute, "--log-level", "warning"]
    cmd += ["--codec", args.codec] if args.codec else []
    cmd += ["--dtype", args.dtype] if args.dtype else []
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        plain, first, second = [], [], []
        for i in range(args.warmup + args.rounds):
            text, then = CLAUSES[i % len(CLAUSES)], CLAUSES[(i + 1) % len(CLAUSES)]
            h = http_first_audio(port, text)
            with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=TIMEOUT) as ws:
                ws.send(json.dumps({"type": "open", **SETTINGS}))
                assert json.loads(ws.recv(timeout=TIMEOUT))["type"] == "opened"
                w1, w2 = ws_first_audio(ws, text), ws_first_audio(ws, then)
            if i >= args.warmup:
                plain.append(h)
                first.append(w1)
                second.append(w2)
        ms = lambda xs: round(1e3 * statistics.median(xs), 2)  # noqa: E731
        result = {"http_first_audio_ms": ms(plain), "ws_first_clause_ms": ms(first),
                  "ws_next_clause_ms": ms(second), "rounds": args.rounds, "model": args.model,
                  "dtype": args.dtype,
                  **run_info(torch.device("cuda" if args.compute == "cuda" or (args.compute == "auto" and
                                                                              torch.cuda.is_available()) else "cpu"))}
        result["ws_first_clause_minus_http_ms"] = round(result["ws_first_clause_ms"] - result["http_first_audio_ms"], 2)
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
