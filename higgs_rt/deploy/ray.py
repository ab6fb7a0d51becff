"""`higgs-rt ray-serve` and deploy/ray/serve.yaml: the speech server as a Ray Serve deployment.

Each replica loads the model, starts one `BatchEngine` and serves `create_app`'s Starlette app through Serve's
ASGI ingress: the API, its validation, its errors and its streaming are `higgs-rt serve`'s own. Serve's HTTP
proxy routes each request to a replica and passes the response on as the replica sends it, so streamed audio
and SSE events arrive as they are decoded. With `--compute cuda` each replica asks Ray for one GPU.

Admission: a replica takes at most `--slots` requests (max_ongoing_requests), so every request it holds is
generating; up to `--queue` more wait in Serve's queue at the proxy (max_queued_requests) and beyond that the
proxy answers 429 with Retry-After, as `serve` does when its queue is full. Waiting in Serve rather than in a
replica's engine means a replica that dies loses only the streams it was generating (a streamed audio body is
cut, an SSE stream ends with an error event from `ray_proxy`, an unstreamed request gets a 500); the waiting
requests go to the other replicas. The engine keeps a small queue of its own (`slots`) for the moment between
a response ending and its slot being freed.

Every response carries `X-Higgs-Rt-Replica`, the Serve replica that made it. The connections are Serve's proxy's:
serve's bounds on them (--head-timeout, --max-connections) are refused by the parser (`cli_options.SERVE_ONLY`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import BackpressureConfig

from ..server import RETRY_AFTER_S, create_app
from ..server_process import EXIT_START, EXIT_USAGE, ServeError, check_access, check_args, hosts_for, listen, resolve
from .ray_proxy import IMPORT_PATH as PROXY_MIDDLEWARES

APP_NAME = "higgs-rt"
REPLICA_HEADER = b"x-higgs-rt-replica"
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


@serve.deployment(name="higgs-rt")
@serve.ingress()  # the app is made per replica, after its engine: __serve_build_asgi_app__
class SpeechReplica:
    """One replica: a loaded model, its batch engine and the server's app over them."""

    def __init__(self, args: argparse.Namespace, model_id: str, hosts: tuple[str, ...]):
        import torch

        from ..batch import BatchEngine
        from ..cli_options import load_tts

        torch.set_num_threads(args.threads)
        self.tts = load_tts(args, slot=False)  # the batch engine has the decoder: none for TTS's own slot
        self.engine = BatchEngine(self.tts, slots=args.slots, queue=args.slots, prefill_tokens=args.prefill_tokens,
                                  max_buffered_s=args.max_buffered_s, benchmark=args.benchmark)
        self.speech_app = create_app(
            self.tts, self.engine, model_id, max_input_chars=args.max_input_chars, body_timeout_s=args.body_timeout,
            ref_cache_bytes=int(args.ref_cache_mb * (1 << 20)), allowed_hosts=hosts,
            allow_origins=tuple(args.allow_origin), api_key=args.api_key,
            max_ws_connections=args.max_ws_connections, ws_idle_timeout_s=args.ws_idle_timeout,
            max_voices=args.max_voices)
        self.replica = serve.get_replica_context().replica_id.unique_id.encode()

    def __serve_build_asgi_app__(self):
        return _Tagged(self.speech_app, self.replica)

    def check_health(self) -> None:
        self.engine.metrics()  # blocks, and so fails Serve's health check, if the decode loop holds its lock

    async def __del__(self):
        await asyncio.to_thread(self.engine.close)


class _Tagged:
    """The app with the replica's id on every response (X-Higgs-Rt-Replica)."""

    def __init__(self, app, replica: bytes):
        self.app, self.replica = app, replica

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, tagged)


def check_ray_args(args) -> tuple:
    """Usage errors, as `serve` checks them plus --replicas and --threads; the listening address."""
    check_args(args)
    if args.replicas < 1 or args.threads < 1:
        raise ServeError("--replicas and --threads must be >= 1", EXIT_USAGE)
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise ServeError("--max-replicas must be >= --replicas", EXIT_USAGE)
    family, address = resolve(args.host, args.port)
    check_access(args, address)
    return family, address


def wants_gpu(args) -> bool:
    """--compute cuda, or auto on a Ray cluster that has GPUs: one GPU per replica."""
    if args.compute == "auto":
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    return args.compute == "cuda"


def application(args, **options):
    """The Serve application of checked ray-serve arguments; options override the deployment's (tests)."""
    from ..batch import DEFAULT_SLOTS_CPU, DEFAULT_SLOTS_CUDA
    from ..cli_options import model_id

    _, address = check_ray_args(args)
    gpu = wants_gpu(args)
    if gpu or args.slots is None:  # the deployment needs the slot count before a replica has a device
        args = argparse.Namespace(**{**vars(args), "compute": "cuda" if gpu else args.compute,
                                     "slots": args.slots or (DEFAULT_SLOTS_CUDA if gpu else DEFAULT_SLOTS_CPU)})
    if args.max_replicas is None:
        replicas = {"num_replicas": args.replicas}
    else:  # Serve adds a replica when the ongoing requests per replica pass --slots
        replicas = {"autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.max_replicas,
                                           "target_ongoing_requests": args.slots}}
    deployment = SpeechReplica.options(**{
        **replicas,
        "ray_actor_options": {"num_cpus": args.threads, "num_gpus": 1 if gpu else 0},
        "max_ongoing_requests": args.slots,
        "max_queued_requests": args.queue,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        **options})
    return deployment.bind(args, model_id(args), hosts_for(address, args.allowed_hosts))


def build(options: dict):
    """The application builder of `serve run` configs (deploy/ray/serve.yaml): `args` holds ray-serve's
    options by their long names (model, replicas, slots, ...; a list for an option of several values, true for
    a flag)."""
    from ..cli_options import ray_serve_args

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # why, in the error Serve reports (argparse would print it and exit)
            raise ValueError(f"bad higgs-rt ray-serve arguments: {' '.join(argv)}: {message}")

    parser = Parser(prog="higgs-rt ray-serve")
    ray_serve_args(parser)
    parser.set_defaults(command="ray-serve")
    argv = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return application(parser.parse_args(argv))


def _check_fits(args) -> None:
    """On the Ray started here, the (first) replicas must fit now: Serve would wait for them for ever."""
    have = ray.cluster_resources()
    for kind, each in (("CPU", args.threads), ("GPU", 1 if wants_gpu(args) else 0)):
        if args.replicas * each > have.get(kind, 0):
            raise ServeError(f"{args.replicas} replica(s) need {args.replicas * each} {kind}s (--replicas, "
                             f"--threads, --compute) but this machine's Ray has {have.get(kind, 0):g}", EXIT_START)


def run_command(args) -> int:
    """`higgs-rt ray-serve`: check, start (or join) Ray, deploy, serve until SIGTERM/SIGINT, then drain."""
    from ..hub import resolve_model_dir

    family, address = check_ray_args(args)
    listen(family, address).close()  # the port is free: said before Ray starts and the model loads
    if args.model and (args.model.startswith(("/", ".", "~")) or Path(args.model).expanduser().is_dir()):
        resolve_model_dir(args.model)  # a local path must hold a model (a repo id is fetched by the replicas)
    # a Ray started here gives its proxy the SSE error event (ray_proxy); a cluster's own needs it at `ray start`
    os.environ.setdefault(PROXY_CALLBACK, PROXY_MIDDLEWARES)
    ray.init(address=args.address, logging_level="warning")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        app = application(args)
        if args.address is None:
            _check_fits(args)
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            message = " ".join(str(e).split())
            raise ServeError(f"the deployment did not start: {message}", EXIT_START) from None
        print(f"higgs-rt: serving {args.replicas} replica(s) at http://{args.host}:{args.port}/v1 "
              "(Ctrl-C stops)", flush=True)
        stop.wait()
        serve.delete(APP_NAME)  # replicas drain for up to --shutdown-timeout
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
