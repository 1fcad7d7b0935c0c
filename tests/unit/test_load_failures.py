"""Loading the embedded default and failing clearly where a model cannot be had."""

from __future__ import annotations

import time

import pytest

import pipatch


def test_hub_id_offline_fails_fast_in_one_line():
    started = time.perf_counter()
    with pytest.raises(pipatch.PipatchError) as info:
        pipatch.load_model("openai-community/gpt2")
    assert time.perf_counter() - started < 20  # no minute of retries
    message = str(info.value)
    assert "\n" not in message and "unreachable" in message and "gpt2" in message


def test_missing_local_folder_is_named():
    with pytest.raises(pipatch.PipatchError, match="does not exist"):
        pipatch.load_model("./no-such-model-folder")


def test_hub_check_honours_offline_mode_and_proxies(tmp_path):
    """The hub is asked through huggingface_hub: HF_HUB_OFFLINE means no request at all, and a
    configured proxy is where the request goes (a local socket records what reaches it)."""
    import socket
    import subprocess
    import sys
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(20)
    seen: list[bytes] = []

    def accept() -> None:
        try:
            while True:
                conn, _ = server.accept()
                seen.append(conn.recv(256))
                conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    proxy = f"http://127.0.0.1:{server.getsockname()[1]}"
    script = ("import pipatch\ntry:\n    pipatch.load_model('some-org/some-model')\n"
              "except pipatch.PipatchError as e:\n    print('ERR', e)\n")
    base = {k: v for k, v in __import__("os").environ.items() if "proxy" not in k.lower()}
    try:
        proxied = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                 env={**base, "HTTPS_PROXY": proxy, "HF_HUB_OFFLINE": "0"})
        assert "ERR" in proxied.stdout and "unreachable" in proxied.stdout, proxied.stdout + proxied.stderr
        assert any(b"CONNECT huggingface.co:443" in line for line in seen), seen
        before = len(seen)
        offline = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                 env={**base, "HTTPS_PROXY": proxy, "HF_HUB_OFFLINE": "1"})
        assert "ERR" in offline.stdout and "unreachable (offline)" in offline.stdout, offline.stdout + offline.stderr
        assert len(seen) == before  # offline: nothing was sent
    finally:
        server.close()
