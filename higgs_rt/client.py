"""`higgs-rt client`: send a file of prompts (one per line) to a speech server and write one audio file each.

Standard library only (and `higgs_rt.params`, the parameter table, a leaf, with `cli_options`' argument types).
Each line becomes a POST /v1/audio/speech; --concurrency sends that many at once (the server batches them). One
line per prompt on stdout; exit 0 if every prompt came back as audio, 1 if any failed, 2 for bad arguments (e.g.
--ref-audio without --ref-text, a --seed or --max-new-tokens out of the server's range, an empty path, voice or
other string option).

Every resource is bounded: the prompts file (MAX_PROMPTS_BYTES) and the reference (what fits a request the
server takes, MAX_BODY_BYTES) are read up to their bound; each response streams to a hidden partial file, at most
MAX_AUDIO_BYTES, all of it within --timeout-s (give or take one read's timeout), and becomes NNNN.FORMAT only
once it is whole and looks like audio of --format (a WAV's or FLAC's signature; no text or JSON for pcm).
"""

from __future__ import annotations

import base64
import http.client
import json
import mimetypes
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cli_options import file_arg, nonempty, path_arg
from .params import BY_API_NAME, MAX_BODY_BYTES

DEFAULT_URL = "http://127.0.0.1:8094"
MAX_CONCURRENCY = 256  # requests in flight at once (a thread each); a server takes at least 256 connections
MAX_TIMEOUT_S = 86400.0  # --timeout-s: a day
MAX_PROMPTS_BYTES = 16 << 20  # the prompts file
MAX_REF_BYTES = MAX_BODY_BYTES // 4 * 3 - (64 << 10)  # --ref-audio: its base64 and the rest of a request fit the body
MAX_AUDIO_BYTES = 1 << 30  # one response
MAX_ERROR_BYTES = 64 << 10  # an error response's body, read for its message
READ_BYTES = 1 << 16  # per read of a response


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="send prompts from a file to a higgs-rt (or OpenAI-compatible) speech server",
                       description="Send each line of --prompts to POST /v1/audio/speech and write the audio to "
                                   "--output-dir as 0001.wav, 0002.wav, ...")
    p.add_argument("--base-url", default=DEFAULT_URL, help=f"server URL, with or without /v1 (default {DEFAULT_URL})")
    p.add_argument("--model", type=nonempty, default="higgs-audio-v2", help="the request's model field")
    p.add_argument("--prompts", type=file_arg, required=True,
                   help="text file, one prompt per line (blank lines skipped)")
    p.add_argument("--output-dir", type=path_arg, required=True)
    p.add_argument("--format", choices=("wav", "pcm", "flac"), default="wav")
    p.add_argument("--voice", type=nonempty, default="default",
                   help="a stored voice's name (default: the model's own)")
    p.add_argument("--max-new-tokens", type=int, help="frames per utterance (25 = 1 s)")
    p.add_argument("--seed", type=int, help="seed of the first prompt; prompt i uses seed + i")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--ref-audio", type=file_arg, help="reference recording (WAV/FLAC) to clone; needs --ref-text")
    p.add_argument("--ref-text", type=nonempty, help="transcript of --ref-audio")
    p.add_argument("--api-key", type=nonempty, default=os.environ.get("HIGGS_RT_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (a server started with --api-key; default "
                        "$HIGGS_RT_API_KEY)")


def run(args) -> int:
    if (args.ref_audio is None) != (args.ref_text is None):
        raise ValueError("--ref-audio and --ref-text go together: give both or neither")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY or not 0 < args.timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"--concurrency must be in [1, {MAX_CONCURRENCY}] and --timeout-s in (0, {MAX_TIMEOUT_S:g}]")
    if args.api_key and not all(" " < c <= "~" for c in args.api_key):  # the key itself is not shown
        raise ValueError("--api-key must be printable ASCII without spaces (it is sent in an HTTP header)")
    if args.max_new_tokens is not None:
        BY_API_NAME["max_new_tokens"].check(args.max_new_tokens, "--max-new-tokens")
    url = speech_url(args.base_url)
    data = _read_bounded(args.prompts, "--prompts", MAX_PROMPTS_BYTES)
    try:
        prompts = [line.strip() for line in data.decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {args.prompts} is not UTF-8 text") from None
    if not prompts:
        raise ValueError(f"{args.prompts} holds no prompts")
    if args.seed is not None:  # prompt i uses seed + i: the last one too must be a seed
        BY_API_NAME["seed"].check(args.seed, "--seed")
        BY_API_NAME["seed"].check(args.seed + len(prompts) - 1, f"--seed + {len(prompts) - 1} (the last prompt's)")
    body = {"model": args.model, "voice": args.voice, "response_format": args.format}
    if args.max_new_tokens is not None:
        body["max_new_tokens"] = args.max_new_tokens
    if args.ref_audio is not None:
        mime = mimetypes.guess_type(args.ref_audio.name)[0] or "audio/wav"
        data = base64.b64encode(_read_bounded(args.ref_audio, "--ref-audio", MAX_REF_BYTES)).decode()
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
        partial = out.with_name(f".{out.name}.partial")
        start = time.perf_counter()
        try:
            with open(partial, "wb") as file:
                size = post_speech(url, request, args.timeout_s, args.api_key, file, args.format)
            os.replace(partial, out)
        except RuntimeError as e:
            print(f"{out.name}: failed: {e}", flush=True)
            return False
        except OSError as e:
            raise OSError(f"cannot write {out}: {e.strerror or e}") from None
        finally:
            partial.unlink(missing_ok=True)
        print(f"{out}: {size} bytes in {time.perf_counter() - start:.2f} s", flush=True)
        return True

    with ThreadPoolExecutor(args.concurrency) as pool:
        ok = list(pool.map(one, range(len(prompts))))
    print(f"{sum(ok)} of {len(ok)} prompts written to {args.output_dir}", file=sys.stderr)
    return 0 if all(ok) else 1


def _read_bounded(path: Path, what: str, limit: int) -> bytes:
    """The file's bytes; a ValueError past `limit` (read no further: /dev/zero is refused too), an OSError if it
    cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise OSError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ValueError(f"{what} {path} is larger than {limit / 2**20:.0f} MiB")
    return data


def speech_url(base_url: str) -> str:
    """--base-url (with or without /v1) -> the speech endpoint; a ValueError unless it is an http(s) URL."""
    try:
        parts = urllib.parse.urlsplit(base_url)
        parts.port  # noqa: B018 - raises for a port out of range
    except ValueError as e:
        raise ValueError(f"--base-url {base_url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be an http:// or https:// URL with a host, got {base_url!r}")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(f"--base-url takes no query, fragment or user@ (the path is appended), got {base_url!r}")
    return base_url.rstrip("/").removesuffix("/v1") + "/v1/audio/speech"


def post_speech(url: str, body: dict, timeout_s: float, api_key: str | None, file, format: str) -> int:
    """Stream one request's audio into `file` -> its size in bytes. RuntimeError with the server's message (or
    the network's) when the request fails, the answer is cut, late, too large or not audio of `format`; an
    OSError from writing `file` passes unchanged."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    deadline = time.monotonic() + timeout_s
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        with e:
            message = _error_message(_read_some(e, deadline))
        raise RuntimeError(f"HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise RuntimeError(_network_error(e)) from None
    with response:
        kind = response.headers.get("Content-Type", "no Content-Type").split(";")[0].strip().lower()
        if format == "pcm" and (kind.startswith("text/") or kind.endswith("json")):  # pcm has no signature
            message = _error_message(_read_some(response, deadline))
            raise RuntimeError(f"the server answered {printable_line(kind)}, not audio: {message}")
        size, head = 0, b""
        while data := _read1(response, deadline):
            size += len(data)
            if size > MAX_AUDIO_BYTES:
                raise RuntimeError(f"the answer is larger than {MAX_AUDIO_BYTES >> 20} MiB")
            head = (head + data[:12])[:12]
            file.write(data)
        if response.length:  # a Content-Length not reached: read1 ends at the close without a word
            raise RuntimeError(f"the answer was cut short ({size} bytes, {response.length} more expected)")
    if format == "wav" and not (head[:4] == b"RIFF" and head[8:12] == b"WAVE") or \
            format == "flac" and head[:4] != b"fLaC" or format == "pcm" and (size == 0 or size % 2):
        raise RuntimeError(f"the server's answer ({size} bytes, {printable_line(kind)}) is not {format} audio")
    return size


def _read1(response, deadline: float) -> bytes:
    """What has arrived of the body (b"" at its end), or RuntimeError: cut, or past the deadline."""
    if time.monotonic() > deadline:
        raise RuntimeError("timed out (--timeout-s) while the answer arrived")
    try:
        return response.read1(READ_BYTES)
    except (OSError, http.client.HTTPException) as e:
        raise RuntimeError(_network_error(e)) from None


def _read_some(response, deadline: float) -> bytes:
    """At most MAX_ERROR_BYTES of an answer that is not audio, for its message."""
    data = b""
    try:
        while len(data) < MAX_ERROR_BYTES and (more := _read1(response, deadline)):
            data += more
    except RuntimeError:
        pass  # the message is what has arrived
    return data[:MAX_ERROR_BYTES]


def _network_error(e: BaseException) -> str:
    if isinstance(e, http.client.IncompleteRead):
        return f"the answer was cut short ({len(e.partial)} bytes, {e.expected} more expected)"
    if isinstance(e, http.client.HTTPException):
        return f"the server's answer is not HTTP ({type(e).__name__}: {printable_line(str(e))})"
    return printable_line(str(getattr(e, "reason", e)))


def _error_message(body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")
    return printable_line(str(message))


def printable_line(text: str, limit: int | None = 200) -> str:
    """One line of at most `limit` characters: whitespace runs as one space, control characters escaped (a
    server's text, a stored transcript, reaches the terminal)."""
    text = " ".join(text.split())[:limit]
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
