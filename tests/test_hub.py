"""Model resolution (higgs_rt.hub): local places first, and a Hub that cannot be reached is found out with one
request, not after huggingface_hub's retries. No test here needs a network: the "Hub" is a local socket."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from higgs_rt import hub
from higgs_rt.hub import ModelNotFoundError, download_blocker, hub_unreachable, resolve_model_dir


@pytest.fixture
def endpoint(monkeypatch):
    """Point huggingface_hub at a local address; returns a function that sets it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the socket is: connections are refused


def test_probe_of_a_refusing_endpoint_names_it(endpoint):
    url = f"http://127.0.0.1:{closed_port()}"
    endpoint(url)
    reason = hub_unreachable()
    assert reason.startswith(f"{url} is unreachable (") and "ConnectError" in reason
    assert download_blocker() == f"skipped, {reason}"


def test_probe_of_an_answering_endpoint_is_none(endpoint):
    class Any404(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802
            self.send_response(404)  # any answer means the Hub is there
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Any404)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint(f"http://127.0.0.1:{server.server_address[1]}")
        assert hub_unreachable() is None and download_blocker() is None
    finally:
        server.shutdown()
        server.server_close()


def test_offline_blocks_without_a_probe(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout=None: pytest.fail("probed while offline"))
    assert download_blocker() == "skipped, HF_HUB_OFFLINE is set"


def test_uncached_repo_and_unreachable_hub_is_one_error_without_a_download(tmp_path, monkeypatch, endpoint):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    endpoint(f"http://127.0.0.1:{closed_port()}")
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        raise OSError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ModelNotFoundError) as failed:
        resolve_model_dir("nobody/no-such-model")
    assert calls == [True]  # the cache was looked at; no download was tried
    message = str(failed.value)
    assert f"Hugging Face cache {tmp_path / 'hub'}: nobody/no-such-model not cached" in message
    assert "download of nobody/no-such-model: skipped, http://127.0.0.1:" in message and "is unreachable" in message


def test_a_local_directory_is_used_without_looking_further(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "download_blocker", lambda: pytest.fail("looked beyond the directory"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="is not a Higgs-Audio v2 model directory: no tokenizer.json"):
        resolve_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_model_dir(tmp_path) == tmp_path
