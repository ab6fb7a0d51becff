"""higgs_rt.deploy.ray on the CPU: the tiny random model in two Ray Serve replicas (one torch thread each)
behind Serve's HTTP proxy, against `higgs-rt serve` with the same slots. The same bytes for the same seed
(streamed, not streamed, SSE), the server's validation, requests spread over both replicas, and a replica
killed mid-run: only its streams end, visibly cut; the requests waiting in Serve's queue and the next ones
succeed. One Ray instance for the module; every request has a timeout."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

if not os.environ.get("CI"):  # CI installs the ray extra (.ci/run): there a missing ray is a failure
    pytest.importorskip("ray.serve")
import ray  # noqa: E402
from ray import serve  # noqa: E402

from higgs_rt.cli import build_parser  # noqa: E402
from higgs_rt.deploy.ray import APP_NAME, PROXY_CALLBACK, PROXY_MIDDLEWARES, REPLICA_HEADER, application  # noqa: E402
from conftest import wait_for  # noqa: E402

REPLICAS, SLOTS, QUEUE = 2, 2, 8
TIMEOUT = 120  # generous: two replicas, a proxy and the test share a loaded 2-core CI machine
START_TIMEOUT = 300  # Ray, Serve and two replicas loading the tiny model: about 20 s here
REPLICA = REPLICA_HEADER.decode()
TEXT = "Replicas speak alike. Seeds repeat."
LONG = {"input": TEXT, "ignore_eos": True, "max_new_tokens": 2000}  # seconds of work, however fast the machine
# (the replicas run with --benchmark, which allows ignore_eos)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_serve_args(model, port: int, *extra: str):
    return build_parser().parse_args(["ray-serve", "--model", str(model), "--port", str(port), "--compute", "cpu",
                                      "--replicas", str(REPLICAS), "--slots", str(SLOTS), "--queue", str(QUEUE),
                                      *extra])


@pytest.fixture(scope="module")
def cluster(random_model):
    """Ray (3 CPUs: two replicas and the test's slack, no dashboard, 80 MB object store) with the app deployed."""
    started = time.perf_counter()
    saved = os.environ.get(PROXY_CALLBACK)
    os.environ[PROXY_CALLBACK] = PROXY_MIDDLEWARES  # as `higgs-rt ray-serve` does: SSE error events
    ray.init(num_cpus=REPLICAS + 1, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             logging_level="error")
    pool = ThreadPoolExecutor(1)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = application(ray_serve_args(random_model, port, "--benchmark"), health_check_period_s=1, health_check_timeout_s=30,
                          graceful_shutdown_timeout_s=5)
        # serve.run waits for the replicas with no bound of its own
        pool.submit(serve.run, app, name=APP_NAME, route_prefix="/").result(START_TIMEOUT)
        print(f"\nray + serve + {REPLICAS} replicas ready in {time.perf_counter() - started:.1f} s")
        yield SimpleNamespace(host="127.0.0.1", port=port)
    finally:
        pool.shutdown(wait=False)
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop(PROXY_CALLBACK)
        else:
            os.environ[PROXY_CALLBACK] = saved


@pytest.fixture(scope="module")
def direct(random_model):
    """`higgs-rt serve` with the same slots, one torch thread."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "higgs_rt.cli", "serve", "--model", str(random_model),
                             "--compute", "cpu", "--port", str(port), "--slots", str(SLOTS), "--queue", str(QUEUE),
                             "--log-level", "warning"], env=env)
    server = SimpleNamespace(host="127.0.0.1", port=port)
    try:
        assert wait_for(lambda: proc.poll() is None and _up(server), TIMEOUT), "higgs-rt serve did not start"
        yield server
    finally:
        proc.terminate()
        proc.wait(30)


def _up(server) -> bool:
    try:
        return request(server, "GET", "/health")[0] == 200
    except OSError:
        return False


def request(server, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    """(status, lower-cased headers, body) of one whole request."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def speech(server, body: dict):
    return request(server, "POST", "/v1/audio/speech", body)


def open_stream(server, body: dict):
    """A speech request whose response has started: (connection, response)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/audio/speech", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


# ---- the same API: bytes, validation ----------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    {"response_format": "wav"},
    {"response_format": "pcm"},
    {"response_format": "flac"},
    {"response_format": "wav", "stream": True},
    {"response_format": "pcm", "stream": True},
    {"stream_format": "sse"},
], ids=lambda b: "-".join(str(v) for v in b.values()))
def test_the_same_bytes_as_serve(cluster, direct, body):
    body = {"model": "tiny", "input": TEXT, "seed": 11, **body}
    status, headers, got = speech(cluster, body)
    assert status == 200, got[:300]
    assert headers[REPLICA]
    want_status, want_headers, want = speech(direct, body)
    assert want_status == 200 and len(want) > 1000
    assert headers["content-type"] == want_headers["content-type"]
    assert got == want


def test_the_same_validation_and_models(cluster, direct):
    for body in ({"input": ""}, {"input": "x", "speed": 9}, {"input": "x", "voice": "nobody"},
                 {"input": "x", "response_format": "flac", "stream": True}):
        got, want = speech(cluster, body), speech(direct, body)
        assert got[0] == want[0] == 400 and json.loads(got[2]) == json.loads(want[2]), body
    status, _, data = request(cluster, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(data)["data"]] == ["tiny"]
    # the Host check holds behind the proxy too: a DNS-rebinding name is refused
    status, _, data = request(cluster, "GET", "/v1/models", headers={"Host": "evil.example"})
    assert status == 400 and b"Host" in data


# ---- spread and failure -----------------------------------------------------------------------------------
def test_twice_the_slots_of_one_replica_are_spread_over_both(cluster):
    """A replica takes at most SLOTS requests (max_ongoing_requests): 2 x SLOTS long streams that are all
    running at once can only be SLOTS on each replica."""
    streams = [open_stream(cluster, {**LONG, "stream": True, "response_format": "pcm", "seed": i})
               for i in range(2 * SLOTS)]
    try:
        assert all(r.status == 200 for _, r in streams)
        replicas = Counter(r.getheader(REPLICA) for _, r in streams)
        assert sorted(replicas.values()) == [SLOTS, SLOTS], replicas
    finally:
        for conn, _ in streams:
            conn.close()


def _replica_actor(unique_id: str):
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(unique_id))
    return ray.get_actor(name, namespace="serve")


def _read_stream(response) -> tuple[bytes, bool]:
    """(what arrived, whether the response ended properly)."""
    got = b""
    try:
        while chunk := response.read1(1 << 16):
            got += chunk
    except http.client.IncompleteRead as e:
        return got + e.partial, False
    except (ConnectionError, http.client.HTTPException):
        return got, False
    return got, True


def test_a_killed_replica_ends_only_its_streams_and_serve_goes_on(cluster):
    # every stream is still running when the replica is killed (LONG), however fast or loaded the machine
    bodies = [{**LONG, "seed": i, **({"stream_format": "sse"} if i % 2 else {"stream": True})}
              for i in range(2 * SLOTS)]
    streams = [open_stream(cluster, b) for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        # both replicas are full: these wait in Serve's queue, not yet started
        waiting = [pool.submit(speech, cluster, {"input": TEXT, "seed": 20 + i}) for i in range(2)]
        time.sleep(0.5)
        assert all(r.status == 200 and r.read1(64) for _, r in streams)  # every stream has sent audio
        victim = streams[0][1].getheader(REPLICA)
        ray.kill(_replica_actor(victim), no_restart=True)
        cut = Counter()
        for (conn, r), body in zip(streams, bodies):
            data, complete = _read_stream(r)
            conn.close()
            killed = r.getheader(REPLICA) == victim
            if "stream_format" in body:  # SSE: a proper end, with the error event or speech.audio.done last
                last = json.loads(data.rstrip().rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
                assert complete and last["type"] == ("error" if killed else "speech.audio.done"), last
                if killed:
                    assert last["error"]["code"] == "replica_lost"
            else:  # audio: the chunked body ends without its last chunk
                assert complete != killed, (killed, len(data))
            cut[killed, "sse" if "stream_format" in body else "audio"] += 1
        assert sum(cut[True, kind] for kind in ("sse", "audio")) == SLOTS  # the victim held SLOTS streams
        assert [f.result(TIMEOUT)[0] for f in waiting] == [200, 200]
    # the next requests succeed (on the survivor, or on the replacement Serve starts)
    for i in range(2 * SLOTS):
        assert speech(cluster, {"input": TEXT, "seed": i})[0] == 200


# ---- the command and the `serve run` config (no Ray started) ----------------------------------------------
@pytest.mark.parametrize("argv,code,message", [
    (["--replicas", "0"], 2, "--replicas and --threads must be >= 1"),
    (["--threads", "0"], 2, "--replicas and --threads must be >= 1"),
    (["--replicas", "2", "--max-replicas", "1"], 2, "--max-replicas must be >= --replicas"),
    (["--slots", "0"], 2, "--slots must be >= 1"),
    (["--host", "0.0.0.0"], 2, "--host 0.0.0.0 listens beyond this machine: give --api-key KEY"),
    ([], 1, "no model directory at /nonexistent/model"),
])
def test_ray_serve_errors_are_one_line_before_ray_starts(capsys, argv, code, message):
    from higgs_rt.cli import main

    assert main(["ray-serve", "--model", "/nonexistent/model", "--port", str(free_port()), *argv]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("higgs-rt: error: ") and message in err, err


def test_the_serve_run_config_builds_the_documented_deployment(monkeypatch):
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    from higgs_rt.deploy.ray import build

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "deploy" / "ray" / "serve.yaml").read_text())
    app_config = config["applications"][0]
    assert app_config["import_path"] == "higgs_rt.deploy.ray:build"
    args = app_config["args"]
    assert (args["host"], args["port"]) == (config["http_options"]["host"], config["http_options"]["port"])
    monkeypatch.setenv("HIGGS_RT_API_KEY", "k")  # beyond loopback: a key, from the environment
    deployment = build(args)._bound_deployment
    assert deployment.num_replicas == args["replicas"]
    assert deployment.ray_actor_options == {"num_cpus": 1, "num_gpus": 1}  # compute: cuda
    assert (deployment.max_ongoing_requests, deployment.max_queued_requests) == (args["slots"], args["queue"])
    parsed, _, hosts = deployment.init_args
    assert parsed.api_key == "k" and "*" in hosts
    origins = ["https://a.example", "https://b.example"]
    assert build({**args, "allow_origin": origins})._bound_deployment.init_args[0].allow_origin == origins
    scaling = build({**args, "max_replicas": 4})._bound_deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 4, args["slots"])
    monkeypatch.delenv("HIGGS_RT_API_KEY")
    with pytest.raises(Exception, match="listens beyond this machine"):
        build(args)
    with pytest.raises(ValueError, match="bad higgs-rt ray-serve arguments: .*argument --slots: invalid int value"):
        build({**args, "slots": "many"})
    for option in ("head_timeout", "max_connections"):  # serve's connection bounds: the reason, not a default
        with pytest.raises(ValueError, match=f"argument --{option.replace('_', '-')}: a `serve` option that "
                                             "ray-serve cannot apply"):
            build({**args, option: 5})
