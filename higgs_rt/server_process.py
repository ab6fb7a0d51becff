"""`higgs-rt serve` as a process: checks, the listening socket, uvicorn, and a bounded shutdown.

Order: the arguments, then whether the address needs an API key, then the socket is bound (a port in use fails here,
before the model loads), then the model loads and uvicorn serves on that socket, with a deadline for each request
head and a cap on open connections (`higgs_rt.connections`: --head-timeout, --max-connections, whose default follows
the slots, the queue and --max-ws-connections). The first SIGTERM or SIGINT stops accepting connections and lets
running requests finish for up to --shutdown-timeout seconds, then cancels what is left; a second signal cancels at
once. WebSocket sessions are closed at the first signal (uvicorn sends close code 1012, service restart) and what
they were speaking is cancelled. The batch engine is closed while the event loop still runs, so its decode thread
never hands audio to a closed loop.

Exit codes: 0 stopped by a signal after every request ended; 1 could not start (address in use or not
available, no model, no CUDA); 2 bad arguments, among them a --host beyond loopback without --api-key or
--no-auth; 3 stopped, but requests still running at --shutdown-timeout were cancelled (or WebSocket sessions
were cut while speaking); 130 a second signal forced the exit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
from typing import Callable

import uvicorn

from . import timing
from .batch import BatchEngine
from .connections import FD_RESERVE, connection_cap, default_connections, protocol
from .http_guards import LOOPBACK_HOSTS, QuietCuts, error_response
from .params import MAX_CHUNK, check_context
from .server import MAX_BODY_BYTES, SpeechServer
from .speech_api import ApiError

log = logging.getLogger("uvicorn.error")

EXIT_OK, EXIT_START, EXIT_USAGE, EXIT_CUT, EXIT_FORCED = 0, 1, 2, 3, 130
# uvicorn's WebSocket settings: a message as large as a request body (an open message may carry a reference
# recording); no compression (PCM barely compresses, and deflating it costs the event loop)
WS_OPTIONS = dict(ws_max_size=MAX_BODY_BYTES, ws_per_message_deflate=False)


class ServeError(Exception):
    """Why the server cannot start, in one line, with the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def check_args(args) -> None:
    """Usage errors (exit 2) before anything is bound or loaded."""
    problems = []
    if not 0 < args.port < 65536:
        problems.append("--port must be in 1..65535")
    if (args.slots is not None and args.slots < 1) or args.queue < 0:
        problems.append("--slots must be >= 1 and --queue >= 0")
    if args.prefill_tokens < 1:
        problems.append("--prefill-tokens must be >= 1")
    if args.chunk is not None and not 1 <= args.chunk <= MAX_CHUNK:
        problems.append(f"--chunk must be in 1..{MAX_CHUNK} frames")
    if args.max_input_chars < 1 or not (math.isfinite(args.ref_cache_mb) and args.ref_cache_mb >= 0):
        problems.append("--max-input-chars must be >= 1 and --ref-cache-mb a finite number >= 0")
    try:
        check_context(args.context, "--context")
    except ValueError as e:
        problems.append(str(e))
    if args.max_ws_connections < 1:
        problems.append("--max-ws-connections must be >= 1")
    if getattr(args, "max_connections", None) is not None and args.max_connections < 1:
        problems.append("--max-connections must be >= 1")
    if args.max_voices < 0:
        problems.append("--max-voices must be >= 0")
    for flag in ("shutdown_timeout", "body_timeout", "ws_idle_timeout", "max_buffered_s", "head_timeout"):
        if not hasattr(args, flag):  # --head-timeout is serve's: ray-serve's connections are Serve's proxy's
            continue
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            problems.append(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    if args.api_key is not None and args.no_auth:
        problems.append("--api-key and --no-auth are alternatives: give one")
    if args.api_key is not None and (not args.api_key.strip() or any(c.isspace() for c in args.api_key)):
        problems.append("--api-key must be a non-empty key without spaces")
    for host in args.allowed_hosts:
        if host != "*" and ("*" in host[1:] or (host.startswith("*") and not host.startswith("*."))):
            problems.append(f"--allowed-hosts {host!r}: a wildcard must look like '*.example.com'")
    if problems:
        raise ServeError("; ".join(problems), EXIT_USAGE)


def resolve(host: str, port: int) -> tuple:
    """(family, socket address) to listen on."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}", EXIT_START) from None
    return family, address


def _ip(address: tuple) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(address[0].split("%")[0])


def check_access(args, address: tuple) -> None:
    """A server reachable from other machines needs a key, or the user's explicit --no-auth."""
    if not _ip(address).is_loopback and args.api_key is None and not args.no_auth:
        raise ServeError(f"--host {args.host} listens beyond this machine: give --api-key KEY (clients send it as "
                         "their API key) or --no-auth to serve without one", EXIT_USAGE)


def listen(family: int, address: tuple) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {address[0]} port {address[1]}: {e.strerror or e}", EXIT_START) from None
    return sock


def allowed_hosts(sock: socket.socket, extra: list[str]) -> tuple[str, ...]:
    return hosts_for(sock.getsockname(), extra)


def hosts_for(address: tuple, extra: list[str]) -> tuple[str, ...]:
    """Host header values accepted at a listening address: the address, loopback names for loopback and wildcard
    binds, this machine's names for wildcard binds, and --allowed-hosts."""
    ip = _ip(address)
    hosts = list(LOOPBACK_HOSTS) if ip.is_loopback or ip.is_unspecified else []
    if ip.is_unspecified:
        hosts += [socket.gethostname(), socket.getfqdn()]
    else:
        hosts.append(f"[{ip}]" if ip.version == 6 else str(ip))
    return tuple(dict.fromkeys(h.lower() for h in [*hosts, *extra] if h))


class InFlight:
    """Counts the HTTP requests being answered, and those the shutdown cancelled. A cancelled request ends
    quietly: a 503 if its answer had not started, else its connection is closed mid-answer (so the client sees
    the stream cut, never a complete-looking one); uvicorn would log each one with a traceback."""

    def __init__(self, app):
        self.app, self.active, self.cancelled = app, 0, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.active += 1
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            self.cancelled += 1
            if not started:
                error = ApiError("the server is shutting down", status=503, code="shutting_down", kind="server_error",
                                 headers={"Connection": "close"})
                await error_response(error)(scope, receive, send)
        finally:
            self.active -= 1


class Server(uvicorn.Server):
    """uvicorn with a second SIGTERM or SIGINT forcing the exit (uvicorn forces only on a second SIGINT), no
    signal raised again after serving (the exit code says what happened), and the engine closed before the
    event loop."""

    def __init__(self, config: uvicorn.Config, engine: BatchEngine, requests: InFlight, speech: SpeechServer):
        super().__init__(config)
        self.engine, self.requests, self.speech, self.cut = engine, requests, speech, False

    def handle_exit(self, sig, frame) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        cancelled, sessions_cut = self.requests.cancelled, self.speech.ws_cut
        await super().shutdown(sockets)  # closes WebSockets (1012), waits up to timeout_graceful_shutdown, cancels
        self.cut = (self.requests.cancelled > cancelled or self.requests.active > 0
                    or self.speech.ws_cut > sessions_cut)

    async def serve(self, sockets=None) -> None:
        try:
            await super().serve(sockets)
        finally:
            left = [t for t in self.server_state.tasks if not t.done()]  # a forced exit leaves them running
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=5)
            await asyncio.to_thread(self.engine.close)

    @property
    def exit_code(self) -> int:
        return EXIT_FORCED if self.force_exit else EXIT_CUT if self.cut else EXIT_OK


def serve_command(args, model_id: str, load_tts: Callable) -> int:
    """`higgs-rt serve`: check, bind, load, serve; the exit code (module docstring)."""
    check_args(args)
    family, address = resolve(args.host, args.port)
    check_access(args, address)
    sock = listen(family, address)
    try:
        tts = load_tts()
        with timing.stage("batch engine", f"{args.slots or 'default'} slots"):
            engine = BatchEngine(tts, slots=args.slots, queue=args.queue, prefill_tokens=args.prefill_tokens,
                                 max_buffered_s=args.max_buffered_s, benchmark=getattr(args, "benchmark", False))
        speech = SpeechServer(
            tts, engine, model_id, max_input_chars=args.max_input_chars, body_timeout_s=args.body_timeout,
            ref_cache_bytes=int(args.ref_cache_mb * (1 << 20)), allowed_hosts=allowed_hosts(sock, args.allowed_hosts),
            allow_origins=tuple(args.allow_origin), api_key=args.api_key,
            max_ws_connections=args.max_ws_connections, ws_idle_timeout_s=args.ws_idle_timeout,
            max_voices=args.max_voices)
        app = InFlight(speech.app())
        wanted = args.max_connections or default_connections(engine.slots, args.queue, args.max_ws_connections)
        cap, fd_limit = connection_cap(wanted)
        config = uvicorn.Config(app, http=protocol(args.head_timeout, cap), log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off",
                                **WS_OPTIONS)  # the app has no start-up or shutdown work
        logging.getLogger("uvicorn.error").addFilter(QuietCuts())  # after the Config: it sets uvicorn's logging up
        if cap < wanted:
            log.warning("at most %d connections, not %d: the process may open %d files (ulimit -n) and keeps %d for "
                        "its other files", cap, wanted, fd_limit, FD_RESERVE)
        log.info("At most %d connections, each with %g s for a request head", cap, args.head_timeout)
        server = Server(config, engine, app, speech)
        timing.mark("ready", final=True)
        timing.report()  # --verbose: where the start-up's time went
        server.run(sockets=[sock])
        return server.exit_code
    finally:
        sock.close()
