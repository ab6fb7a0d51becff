"""`higgs-rt client`: send a file of prompts (one per line) to a speech server and write one audio file each.

Standard library only. Each line becomes a POST /v1/audio/speech; --concurrency sends that many at once (the
server batches them). One line per prompt on stdout; exit 0 if every prompt came back as audio, 1 if any
failed, 2 for bad arguments (e.g. --ref-audio without --ref-text).
"""

from __future__ import annotations

import base64
import json
import math
import mimetypes
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8094"


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="send prompts from a file to a higgs-rt (or OpenAI-compatible) speech server",
                       description="Send each line of --prompts to POST /v1/audio/speech and write the audio to "
                                   "--output-dir as 0001.wav, 0002.wav, ...")
    p.add_argument("--base-url", default=DEFAULT_URL, help=f"server URL, with or without /v1 (default {DEFAULT_URL})")
    p.add_argument("--model", default="higgs-audio-v2", help="the request's model field")
    p.add_argument("--prompts", type=Path, required=True, help="text file, one prompt per line (blank lines skipped)")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--format", choices=("wav", "pcm", "flac"), default="wav")
    p.add_argument("--voice", default="default", help="a stored voice's name (default: the model's own)")
    p.add_argument("--max-new-tokens", type=int, help="frames per utterance (25 = 1 s)")
    p.add_argument("--seed", type=int, help="seed of the first prompt; prompt i uses seed + i")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--ref-audio", type=Path, help="reference recording (WAV/FLAC) to clone; needs --ref-text")
    p.add_argument("--ref-text", help="transcript of --ref-audio")
    p.add_argument("--api-key", default=os.environ.get("HIGGS_RT_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (a server started with --api-key; default "
                        "$HIGGS_RT_API_KEY)")


def run(args) -> int:
    if (args.ref_audio is None) != (args.ref_text is None):
        raise ValueError("--ref-audio and --ref-text go together: give both or neither")
    if args.concurrency < 1 or not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise ValueError("--concurrency must be >= 1 and --timeout-s a finite number > 0")
    url = speech_url(args.base_url)
    try:
        prompts = [line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {args.prompts} is not UTF-8 text") from None
    except OSError as e:
        raise OSError(f"cannot read --prompts {args.prompts}: {e.strerror or e}") from None
    if not prompts:
        raise ValueError(f"{args.prompts} holds no prompts")
    body = {"model": args.model, "voice": args.voice, "response_format": args.format}
    if args.max_new_tokens is not None:
        body["max_new_tokens"] = args.max_new_tokens
    if args.ref_audio is not None:
        mime = mimetypes.guess_type(args.ref_audio.name)[0] or "audio/wav"
        try:
            data = base64.b64encode(args.ref_audio.read_bytes()).decode()
        except OSError as e:
            raise OSError(f"cannot read --ref-audio {args.ref_audio}: {e.strerror or e}") from None
        body.update(ref_audio=f"data:{mime};base64,{data}", ref_text=args.ref_text)
    try:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "it is not a directory" if isinstance(e, FileExistsError) else e.strerror or e
        raise OSError(f"cannot write to --output-dir {args.output_dir}: {why}") from None

    def one(i: int) -> bool:
        request = dict(body, input=prompts[i])
        if args.seed is not None:
            request["seed"] = args.seed + i
        out = args.output_dir / f"{i + 1:04d}.{args.format}"
        start = time.perf_counter()
        try:
            audio = post_speech(url, request, args.timeout_s, args.api_key)
        except RuntimeError as e:
            print(f"{out.name}: failed: {e}", flush=True)
            return False
        out.write_bytes(audio)
        print(f"{out}: {len(audio)} bytes in {time.perf_counter() - start:.2f} s", flush=True)
        return True

    with ThreadPoolExecutor(args.concurrency) as pool:
        ok = list(pool.map(one, range(len(prompts))))
    print(f"{sum(ok)} of {len(ok)} prompts written to {args.output_dir}", file=sys.stderr)
    return 0 if all(ok) else 1


def speech_url(base_url: str) -> str:
    """--base-url (with or without /v1) -> the speech endpoint; a ValueError unless it is an http(s) URL."""
    try:
        parts = urllib.parse.urlsplit(base_url)
        parts.port  # noqa: B018 - raises for a port out of range
    except ValueError as e:
        raise ValueError(f"--base-url {base_url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be an http:// or https:// URL with a host, got {base_url!r}")
    return base_url.rstrip("/").removesuffix("/v1") + "/v1/audio/speech"


def post_speech(url: str, body: dict, timeout_s: float, api_key: str | None = None) -> bytes:
    """The audio bytes of one request; RuntimeError with the server's message (or the network's) otherwise."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {_error_message(e.read())}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(str(getattr(e, "reason", e))) from None


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]
