"""The command line's shared options and loaders: which model and how (`model_args`), the server options
`serve` and `ray-serve` share (`server_args`), ray-serve's own (`ray_serve_args`, which refuses serve's connection
bounds), and the model a command loads from them (`load_tts`, `model_id`). Apart from cli.py so that
higgs_rt.deploy.ray, which the CLI starts, can parse and load the same way without importing the CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .params import (CONTEXT, DEFAULT_CHUNK, DEFAULT_MAX_BUFFERED_S, DEFAULT_PREFILL_TOKENS, MAX_CHUNK, MAX_CONTEXT,
                     MIN_CONTEXT, check_context)


def nonempty(value: str) -> str:
    """argparse type of a name or path option: an empty value (an unset shell variable) is a usage error, not
    the default (a false --model) nor the current directory (Path(''))."""
    import argparse

    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value")
    return value


def linked(value: str) -> str:
    """A path option's value, unless it is a symbolic link leading nowhere (`audio_file.broken_link`): a usage
    error naming the link, not a missing file's error (or a repo id's) once something opens it."""
    import argparse

    from .audio_file import broken_link  # here: the CLI's start imports no more than it needs

    if (why := broken_link(value)) is not None:
        raise argparse.ArgumentTypeError(f"{value}: {why}")
    return value


def location_arg(value: str) -> str:
    """argparse type of --model and --codec, a directory or a Hugging Face repo id: `nonempty`, `linked`."""
    return linked(nonempty(value))


def path_arg(value: str) -> Path:
    """argparse type of a path option, read or written: `nonempty`, `linked`, as a Path."""
    return Path(linked(nonempty(value)))


def _slashless(value: str) -> str:
    import argparse

    from .audio_file import slash_ended

    if (why := slash_ended(value)) is not None:
        raise argparse.ArgumentTypeError(why)
    return value


def file_arg(value: str) -> Path:
    """argparse type of a file option: `path_arg`, and no trailing slash (`audio_file.slash_ended`)."""
    return path_arg(_slashless(value))


def out_file_arg(value: str) -> Path:
    """argparse type of speak's --out: `file_arg` but for links, which `audio_file.check_output` checks (a link
    to a file is written through; one leading nowhere is refused, saying where it leads)."""
    return Path(nonempty(_slashless(value)))


def model_args(p, compiled: bool = True, verbose: bool = True) -> None:
    """Which model, codec and compute: shared by the commands that load a model; verbose: --verbose (where the
    cold start's time goes, `higgs_rt.timing`) for the commands that load in this process."""
    p.add_argument("--model", type=location_arg, help="model directory or Hugging Face repo id "
                                                      "(default: bosonai/higgs-audio-v2-generation-3B-base)")
    p.add_argument("--codec", type=location_arg, help="codec directory (default: MODEL/audio_tokenizer, "
                                                      "$HIGGS_AUDIO_TOKENIZER_PATH, the HF cache, then "
                                                      "bosonai/higgs-audio-v2-tokenizer)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compute", choices=("auto", "cpu", "cuda"), default="auto", help="where the model runs")
    p.add_argument("--context", type=int, default=CONTEXT, help=f"KV cache positions per slot (prompt + frames; "
                                                                f"default {CONTEXT}, {MIN_CONTEXT} to {MAX_CONTEXT})")
    if compiled:
        p.add_argument("--compiled", type=path_arg, help="artifacts of `higgs-rt export` (default: MODEL/compiled if "
                                                     "present; ones that do not fit warn and run eager)")
    if verbose:
        p.add_argument("--verbose", action="store_true",
                       help="print to stderr where the cold start's time goes, one line per stage (import torch, "
                            "weights, codec, tokenizer, graph capture, prefill, first audio)")


def server_args(p, port: int, verbose: bool = True) -> None:
    """The options `serve` and `ray-serve` share: address, model, batching, limits and access (verbose: --verbose,
    which ray-serve, whose replicas load elsewhere, lacks)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; any other "
                                                       "needs --api-key or --no-auth)")
    p.add_argument("--port", type=int, default=port)
    model_args(p, verbose=verbose)
    p.add_argument("--slots", type=int, default=None,
                   help="requests generated at once (default: 64 on CUDA, 4 on the CPU)")
    p.add_argument("--benchmark", action="store_true",
                   help="benchmarks only: accept the request field ignore_eos (utterances of known length)")
    p.add_argument("--queue", type=int, default=32, help="requests waiting for a slot before 429s")
    p.add_argument("--prefill-tokens", type=int, default=DEFAULT_PREFILL_TOKENS,
                   help=f"prompt positions prefilled per decode step (default {DEFAULT_PREFILL_TOKENS}): more admits "
                        "arrivals sooner, fewer stalls running streams less")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"frames (40 ms each) of a stream's steady audio chunks, after the first ones ramp up "
                        f"(default {DEFAULT_CHUNK}, at most {MAX_CHUNK}): longer chunks take fewer codec calls "
                        "and send fewer, larger pieces")
    p.add_argument("--max-buffered-s", type=float, default=DEFAULT_MAX_BUFFERED_S,
                   help=f"seconds of audio a request may leave unread before it is cancelled (default "
                        f"{DEFAULT_MAX_BUFFERED_S:g})")
    p.add_argument("--api-key", default=os.environ.get("HIGGS_RT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (OpenAI clients send their api_key so; default "
                        "$HIGGS_RT_API_KEY)")
    p.add_argument("--no-auth", action="store_true", help="serve beyond loopback without an API key")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST",
                   help="Host header values to accept besides the bound address (and loopback names); '*' any")
    p.add_argument("--allow-origin", action="extend", nargs="+", default=[], metavar="ORIGIN",
                   help="a web origin (https://app.example) whose pages may call the server; repeatable, '*' any")
    p.add_argument("--max-input-chars", type=int, default=4096, help="longest 'input' text (default 4096)")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a request body (default 30)")
    p.add_argument("--ref-cache-mb", type=float, default=1024, help="cap of the one-off reference cache refs/, "
                                                                    "least recently used first out (default 1024)")
    p.add_argument("--max-voices", type=int, default=100,
                   help="voices POST /v1/audio/voices may fill the store up to; more are refused with 409 "
                        "(default 100; `higgs-rt voice add` is not bounded)")
    p.add_argument("--max-ws-connections", type=int, default=32,
                   help="WebSocket sessions (/v1/audio/speech/stream) open at once; more are refused with 429 "
                        "(default 32)")
    p.add_argument("--ws-idle-timeout", type=float, default=300.0,
                   help="seconds a WebSocket session may send nothing while nothing is spoken before it is closed "
                        "(default 300)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds running requests may finish before they are cancelled "
                        "(default 10; a second signal cancels at once)")


# serve's connection bounds (higgs_rt.connections), which ray-serve refuses: its connections are held by Ray Serve's
# HTTP proxy, a uvicorn that Ray configures, and higgs-rt's middleware there (deploy/ray_proxy.py) sees only the
# requests, never a connection before its head arrives.
SERVE_ONLY = {"--head-timeout": "no request-head deadline", "--max-connections": "no cap on open connections"}


def ray_serve_args(p) -> None:
    """ray-serve's options: serve's, on port 8000, and the replicas'; serve's connection bounds (SERVE_ONLY) are
    a usage error, not ignored."""
    import argparse

    class ServeOnly(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            raise argparse.ArgumentError(self, f"a `serve` option that ray-serve cannot apply: its connections are "
                                               f"held by Ray Serve's HTTP proxy, which has "
                                               f"{SERVE_ONLY[self.option_strings[0]]} higgs-rt can set (bound them "
                                               "in front of the proxy, e.g. in a load balancer)")

    server_args(p, port=8000, verbose=False)
    for flag in SERVE_ONLY:
        p.add_argument(flag, action=ServeOnly, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=1, help="replicas, one batch engine each (default 1)")
    p.add_argument("--max-replicas", type=int, help="autoscale between --replicas and this many, aiming at --slots "
                                                    "requests per replica")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica (torch's intra-op threads; "
                                                          "Ray reserves as many CPUs; default 1)")
    p.add_argument("--address", help="an existing Ray cluster (ray://... or auto); default: start Ray here")


def load_tts(args, warmup: bool | None = None, slot: bool = True):
    """The command's TTS. slot: the command speaks through TTS's own slot, which is made now (with exported
    artifacts, their step binds or warns why not with the load rather than at the first audio); False for the
    servers, whose batch engines have decoders of their own (and no warm-up: it would step the slot)."""
    from . import timing

    with timing.stage("import higgs_rt.engine"):
        from .engine import TTS

    check_context(args.context, "--context")  # a usage error before anything loads
    tts = TTS(args.model, codec=args.codec, device=None if args.compute == "auto" else args.compute,
              dtype=args.dtype, context=args.context, progress=sys.stderr.isatty(), compiled=args.compiled,
              warmup=warmup if slot else False, chunk=getattr(args, "chunk", None))
    if slot and tts.compiled is not None:
        tts.decoder
    return tts


def model_id(args) -> str:
    """The name the server's /v1/models gives the model: a directory's name, or the repo id."""
    from .hub import DEFAULT_MODEL

    return Path(args.model).name if args.model and Path(args.model).is_dir() else args.model or DEFAULT_MODEL
