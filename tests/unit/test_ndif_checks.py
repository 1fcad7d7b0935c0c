"""NDIF's checks before anything is sent, without a model: no key, an unreachable service, a
model NDIF does not host and version drift that matters are each one line.

Every experiment through the NDIF backend (simulated locally): ``tests/integration/test_ndif.py``.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import pipatch
from pipatch._backends.ndif import version_drift
from pipatch._model.models import PipatchError


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and text, text
    return text


# --------------------------------------------------------------------------------------------
# The checks before any request: one line each
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StandIn:
    """A loopback stand-in for NDIF's ``GET /status`` and ``GET /env`` (their JSON shapes)."""

    def __init__(self, hosted: list[str], env: dict):
        answers = {"/status": {"deployments": {name: {"repo_id": name, "deployment_level": "HOT",
                                                      "application_state": "RUNNING"} for name in hosted}},
                   "/env": env}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = json.dumps(answers.get(self.path, {})).encode()
                self.send_response(200 if self.path in answers else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def ndif_config(monkeypatch):
    """nnsight's config as a fresh kernel reads it: no key, NDIF's host; restored after."""
    from nnsight import CONFIG

    monkeypatch.setattr(CONFIG.API, "APIKEY", None)
    monkeypatch.setattr(CONFIG.API, "HOST", CONFIG.API.HOST)
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.delenv("NDIF_HOST", raising=False)
    return monkeypatch


def local_env() -> dict:
    from nnsight import ndif

    return ndif.get_local_env()


def test_no_key_is_one_line(ndif_config):
    with pytest.raises(PipatchError) as error:
        pipatch.load_model("openai-community/gpt2", remote=True)
    assert "NDIF_API_KEY" in one_line(error)


def test_an_unreachable_service_is_one_line(ndif_config):
    ndif_config.setenv("NDIF_API_KEY", "a-key")
    ndif_config.setenv("NDIF_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(PipatchError) as error:
        pipatch.load_model("openai-community/gpt2", remote=True)
    assert "cannot reach NDIF at http://127.0.0.1:" in one_line(error)


def load_against(ndif_config, hosted: list[str], env: dict) -> pytest.ExceptionInfo:
    """``load_model("openai-community/gpt2", remote=True)`` against a stand-in; its error."""
    stand_in = StandIn(hosted, env)
    try:
        ndif_config.setenv("NDIF_API_KEY", "a-key")
        ndif_config.setenv("NDIF_HOST", stand_in.url)
        with pytest.raises(PipatchError) as error:
            pipatch.load_model("openai-community/gpt2", remote=True)
    finally:
        stand_in.close()
    return error


def test_a_model_ndif_does_not_host_is_one_line(ndif_config):
    error = load_against(ndif_config, ["meta-llama/Llama-3.1-8B"], local_env())
    assert "does not host 'openai-community/gpt2'" in one_line(error)


def test_version_drift_that_matters_is_one_line(ndif_config):
    here = local_env()
    other_nnsight = {**here, "packages": {**here["packages"], "nnsight": "0.7.0"}}
    error = load_against(ndif_config, ["openai-community/gpt2"], other_nnsight)
    assert "NDIF runs nnsight 0.7.0" in one_line(error) and "pip install nnsight==0.7.0" in str(error.value)
    other_python = {**here, "python_version": "3.12.1 (main)"}
    assert "Python 3.12" in version_drift(here, other_python)
    torch_only = {**here, "packages": {**here["packages"], "torch": "0.0.1"}}
    assert version_drift(here, torch_only) is None  # nnsight.compare() shows it; requests still run
    assert version_drift(here, here) is None
