"""``pipatch serve``'s gates without a server: key files, the key comparison, the key and
body-size middleware called as ASGI apps, the request limits, and the options' checks.

The served suite (``tests/integration/test_served_guard.py``) runs the same gates in a real
server, over HTTPS.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json

import pytest

from pipatch._errors import PipatchError
from pipatch._serve import main as serve_main
from pipatch._serve_guard import (
    KEY_ENV,
    MAX_INVOKES,
    MAX_REQUEST_BYTES,
    BodyLimit,
    KeyGate,
    Keys,
    Limits,
    read_keys,
    server_keys,
)

# --------------------------------------------------------------------------------------------
# Key files and where keys come from
# --------------------------------------------------------------------------------------------


def test_a_key_file_holds_one_key_a_line_with_comments(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team's keys\n\nalice-5f0c   # Alice\n  bob-91aa\n#carol-0000 (removed)\ndan-77e1#Dan\n")
    assert read_keys(path) == ["alice-5f0c", "bob-91aa", "dan-77e1"]


@pytest.mark.parametrize("text, expected", [
    ("", "holds no key"),
    ("# only a comment\n\n", "holds no key"),
    ("alice bob\n", "line 1: a key is one word"),
    ("ok\nkëy\n", "line 2: a key is one word of printable ASCII"),
    ("ok\nta\tb\n", "line 2: a key is one word"),
])
def test_a_bad_key_file_is_one_line_naming_the_line(tmp_path, text, expected):
    path = tmp_path / "keys"
    path.write_text(text, "utf-8")
    with pytest.raises(PipatchError) as error:
        read_keys(path)
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_missing_key_file_is_one_line(tmp_path):
    with pytest.raises(PipatchError) as error:
        read_keys(tmp_path / "nowhere")
    assert "cannot read it (FileNotFoundError)" in str(error.value) and "\n" not in str(error.value)


def test_keys_come_from_the_file_the_environment_and_the_flag(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice-5f0c\nbob-91aa\n")
    assert server_keys(str(path), None, {}) == (["alice-5f0c", "bob-91aa"], [])
    assert server_keys(None, None, {KEY_ENV: "env-key"}) == (["env-key"], [])
    assert server_keys(str(path), None, {KEY_ENV: "alice-5f0c"}) == (["alice-5f0c", "bob-91aa"], [])  # once each
    assert server_keys(None, None, {KEY_ENV: ""}) == ([], [])
    keys, warnings = server_keys(None, "flag-key", {})
    assert keys == ["flag-key"] and len(warnings) == 1
    assert "process list" in warnings[0] and "--api-key-file" in warnings[0] and "\n" not in warnings[0]
    with pytest.raises(PipatchError, match=r"\$PIPATCH_API_KEY: a key is one word"):
        server_keys(None, None, {KEY_ENV: "two words"})


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def test_keys_accept_each_key_and_nothing_else():
    keys = Keys(["alice-5f0c", "bob-91aa"])
    assert len(keys) == 2
    assert keys.accepts("alice-5f0c") and keys.accepts(b"bob-91aa")
    for wrong in ("", "alice", "alice-5f0c ", "alice-5f0", "alice-5f0cX", "ALICE-5F0C", "bob-91aa\x00", "ключ"):
        assert not keys.accepts(wrong), wrong
    with pytest.raises(PipatchError, match="no key to accept"):
        Keys([])


def test_the_comparison_is_constant_time(monkeypatch):
    """The comparison is :func:`hmac.compare_digest` over fixed-length digests, made for every
    key whatever matched (a timing test on a shared 2-core machine could not fail reliably)."""
    source = inspect.getsource(Keys.accepts)
    assert "hmac.compare_digest" in source and "==" not in source and "break" not in source and "return True" not in source
    called = []
    real = hmac.compare_digest

    def counting(a, b):
        called.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = Keys(["short", "a-much-longer-key-than-the-first"])
    assert keys.accepts("short") and not keys.accepts("x" * 1000)
    assert called == [(32, 32)] * 4  # every key compared each time, one length for all


# --------------------------------------------------------------------------------------------
# The middleware, called as ASGI apps
# --------------------------------------------------------------------------------------------


async def _inner(scope, receive, send):
    """The app behind the gates: reads the whole body, answers 200 with its length."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def _call(app, path="/v1/pipatch/generate", headers=(), chunks=(b"",)):
    """One HTTP request through ``app``: (status, body)."""
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(k.encode(), v.encode()) for k, v in headers]}
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1} for i, chunk in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_key_gate_opens_health_only_and_names_what_was_wrong():
    gate = KeyGate(_inner, Keys(["alice-5f0c", "bob-91aa"]))
    assert _call(gate, headers=[("ndif-api-key", "bob-91aa")], chunks=[b"abc"]) == (200, b"3")
    assert _call(gate, path="/health")[0] == 200
    for headers, said in (([], "no API key"), ([("ndif-api-key", "carol")], "an invalid API key"),
                          ([("x-api-key", "alice-5f0c")], "no API key")):
        status, body = _call(gate, path="/v1/pipatch/info", headers=headers)
        detail = json.loads(body)["detail"]
        assert status == 401 and detail.startswith(said) and "\n" not in detail and "ndif-api-key" in detail
    passed = []

    async def lifespan_app(scope, receive, send):
        passed.append(scope["type"])

    asyncio.run(KeyGate(lifespan_app, Keys(["k"]))({"type": "lifespan"}, None, None))
    assert passed == ["lifespan"]


def test_the_body_limit_refuses_declared_and_streamed_bodies_over_it():
    limit = BodyLimit(_inner, Limits(request_bytes=10))
    assert _call(limit, headers=[("content-length", "10")], chunks=[b"x" * 10]) == (200, b"10")
    status, body = _call(limit, headers=[("content-length", "50000000")], chunks=[b"x" * 11])
    detail = json.loads(body)["detail"]
    assert status == 413 and "50,000,000 bytes" in detail and "--max-request-bytes" in detail and "limit of 10" in detail
    status, body = _call(limit, chunks=[b"x" * 6, b"x" * 6])  # chunked: no Content-Length
    assert status == 413 and "(sent in chunks) has more than 10 bytes" in json.loads(body)["detail"]
    assert _call(limit, chunks=[b"x" * 5, b"x" * 5]) == (200, b"10")


# --------------------------------------------------------------------------------------------
# The limits a built request is checked against
# --------------------------------------------------------------------------------------------


class _Words:
    """A tokenizer of words (the limits count what a real tokenizer returns: ``input_ids``)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_limits_name_the_limit_and_its_flag():
    assert Limits() == Limits(request_bytes=MAX_REQUEST_BYTES, invokes=MAX_INVOKES, prompt_tokens=2048)
    limits = Limits(invokes=2, prompt_tokens=3)
    ok = [{"prompt_token_ids": [1, 2, 3]}, "a b c"]
    assert limits.refusal(ok, _Words()) is None
    many = limits.refusal(ok + ok, _Words())
    assert many.startswith("the request has 4 invokes, over this server's limit of 2 (pipatch serve --max-invokes)")
    long = limits.refusal([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(100_000))}], _Words())
    assert long.startswith("invoke 1's prompt has 100,000 tokens, over this server's limit of 3 "
                           "(pipatch serve --max-prompt-tokens)")
    assert "--max-prompt-tokens" in limits.refusal([{"prompt": "a b c d"}], _Words())
    assert limits.refusal([{"prompt_embeds": object()}], _Words()) is None  # the engine's max_model_len bounds it


# --------------------------------------------------------------------------------------------
# The options, checked before any engine starts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys: cannot read it"),
    (["--ssl-certfile", "cert.pem"], "--ssl-certfile needs its pair"),
    (["--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"], "no readable file there"),
    (["--ssl-certfile", __file__, "--ssl-keyfile", __file__], "not a certificate and its private key in PEM"),
    (["--max-invokes", "0"], "--max-invokes"),
    (["--max-request-bytes", "lots"], "--max-request-bytes"),
    (["--host", "0.0.0.0"], "add --api-key-file PATH"),
])
def test_bad_server_options_are_one_line_before_the_engine(argv, expected, capsys, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipatch serve: error: ") and expected in err[0], err
