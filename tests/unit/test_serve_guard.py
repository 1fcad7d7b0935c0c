"""``pipatch serve``'s gates without a server: key files, the key comparison, the key,
body-size, time and in-flight middleware called as ASGI apps, the rooms' turns, the request
limits, and the options' checks.

The served suite (``tests/integration/test_served_guard.py``) runs the same gates in a real
server, over HTTPS.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json

import pytest

from pipatch._base.errors import PipatchError
from pipatch._serving.guard import (
    KEY_ENV,
    MAX_INVOKES,
    MAX_REQUEST_BYTES,
    REQUEST_SECONDS,
    REQUESTS_IN_FLIGHT,
    BodyLimit,
    KeyGate,
    Keys,
    Limits,
    Load,
    RequestGuard,
    RoomGate,
    Rooms,
    client_of,
    read_keys,
    server_keys,
)
from pipatch._serving.serve import main as serve_main

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
# Time, requests in flight, a client gone: RequestGuard; turns: Rooms
# --------------------------------------------------------------------------------------------


def _scope(key="alice", method="POST", path="/v1/pipatch/generate", skip=None):
    headers = [(b"ndif-api-key", key.encode())] if key else []
    if skip is not None:
        headers.append((b"x-pipatch-skip", str(skip).encode()))
    return {"type": "http", "method": method, "path": path, "headers": headers, "client": ("127.0.0.1", 5000)}


class _Client:
    """One HTTP request's ASGI side: its body, then (when :meth:`leave` is called) a disconnect;
    what the app sent back."""

    def __init__(self, body=b"data"):
        self.messages = [{"type": "http.request", "body": body, "more_body": False}]
        self.left = asyncio.Event()
        self.sent = []

    async def receive(self):
        if self.messages:
            return self.messages.pop(0)
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)

    def leave(self):
        self.left.set()

    @property
    def status(self):
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    @property
    def detail(self):
        return json.loads(b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"))["detail"]


class _Held:
    """An app that reads the body and holds each request until released (or cancelled: it
    says which requests were)."""

    def __init__(self):
        self.release, self.entered, self.cancelled = asyncio.Event(), [], []

    async def __call__(self, scope, receive, send):
        await receive()
        self.entered.append(scope)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(scope)
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _settle():
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_request_over_its_time_is_cancelled_and_answered_504_in_one_line():
    async def run():
        app, load = _Held(), Load()
        guard = RequestGuard(app, Limits(seconds=0.05), load)
        slow, other = _Client(), _Client()
        waiting = asyncio.ensure_future(guard(_scope(), slow.receive, slow.send))
        await asyncio.sleep(0.2)
        assert waiting.done() and app.cancelled and slow.status == 504
        assert slow.detail == ("the request ran for 0.05 s and was stopped, over this server's limit of 0.05 s (pipatch "
                               "serve --max-request-seconds): send smaller requests or fewer at once, or raise the limit")
        app.release.set()
        await guard(_scope(), other.receive, other.send)  # the next one is served
        assert other.status == 200 and load.of(client_of(_scope())) == {
            "in_flight": 0, "yours": 0, "timed_out": 1, "client_gone": 0}

    asyncio.run(run())


def test_a_key_over_its_requests_in_flight_is_429_and_other_keys_go_on():
    async def run():
        app, load = _Held(), Load()
        guard = RequestGuard(app, Limits(in_flight=2), load)
        alice = [_Client() for _ in range(3)]
        held = [asyncio.ensure_future(guard(_scope("alice"), c.receive, c.send)) for c in alice[:2]]
        await _settle()
        await guard(_scope("alice"), alice[2].receive, alice[2].send)
        assert alice[2].status == 429 and alice[2].detail == (
            "this client (its key) has 2 requests in flight, over this server's limit of 2 "
            "(pipatch serve --max-requests-in-flight): send fewer at once, or raise the limit")
        bob, info = _Client(), _Client()
        bobs = asyncio.ensure_future(guard(_scope("bob"), bob.receive, bob.send))
        await _settle()
        assert load.of(client_of(_scope("alice")))["yours"] == 2 and load.of(b"")["in_flight"] == 3
        app.release.set()
        await asyncio.gather(*held, bobs)
        assert [c.status for c in alice[:2]] == [200, 200] and bob.status == 200 and load.in_flight == {}
        assert len(app.entered) == 3  # the refused one never reached the app
        counts = []  # a request's count is gone before its last bytes are sent (a client's next one fits)

        async def counting(message):
            if message["type"] == "http.response.body":
                counts.append(dict(load.in_flight))
        last = _Client()
        last.send = counting
        await guard(_scope("alice"), last.receive, last.send)
        assert counts == [{}]

        async def reads(scope, receive, send):  # a GET is not counted
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        limited = RequestGuard(reads, Limits(in_flight=1), Load({client_of(_scope("alice")): 1}))
        await limited(_scope("alice", method="GET", path="/v1/pipatch/load"), info.receive, info.send)
        assert info.status == 200

    asyncio.run(run())


def test_a_request_whose_client_went_away_is_cancelled_and_frees_its_place():
    async def run():
        app, load = _Held(), Load()
        guard = RequestGuard(app, Limits(in_flight=1), load)
        gone = _Client()
        running = asyncio.ensure_future(guard(_scope(), gone.receive, gone.send))
        await _settle()
        assert len(app.entered) == 1 and load.in_flight
        gone.leave()
        await asyncio.wait_for(running, 1)
        assert app.cancelled and gone.sent == [] and load.in_flight == {} and load.client_gone == 1
        again = _Client()  # the key's place is free
        app.release.set()
        await guard(_scope(), again.receive, again.send)
        assert again.status == 200

    asyncio.run(run())


def test_who_a_request_is_from_its_key_else_its_client_id_else_its_address():
    alice = client_of(_scope("alice"))
    assert alice.startswith(b"key:") and b"alice" not in alice and alice == client_of(_scope("alice"))
    assert alice != client_of(_scope("bob"))
    named = {**_scope(None), "headers": [(b"x-pipatch-client", b"1f2e")]}
    assert client_of(named) == b"client:1f2e" and client_of(_scope(None)) == b"address:127.0.0.1"


def test_rooms_take_clients_in_turns_and_one_depth_at_a_time():
    """A holds the room at depth 1 with three more requests waiting at depth 2; B's request
    (depth 3) comes after them and goes first (A has had a turn); A's three share depth 2."""
    async def run():
        rooms, order, leave = Rooms(), [], {}

        async def visit(name, client, depth):
            async with rooms.room(depth, client):
                order.append(name)
                leave[name] = asyncio.Event()
                await leave[name].wait()

        first = asyncio.ensure_future(visit("a0", b"A", 1))
        await _settle()
        rest = [asyncio.ensure_future(visit(f"a{i}", b"A", 2)) for i in (1, 2, 3)]
        await _settle()
        b = asyncio.ensure_future(visit("b", b"B", 3))
        await _settle()
        assert order == ["a0"] and rooms.waiting() == 4
        leave["a0"].set()
        await _settle()
        assert order == ["a0", "b"]  # B's turn before A's second
        leave["b"].set()
        await _settle()
        assert order == ["a0", "b", "a1", "a2", "a3"]  # one depth: together
        for name in ("a1", "a2", "a3"):
            leave[name].set()
        await asyncio.gather(first, b, *rest)
        assert rooms.waiting() == 0 and rooms._held == {} and rooms._turn == {}

    asyncio.run(run())


def test_a_request_cancelled_while_it_waits_leaves_the_line():
    async def run():
        rooms, order = Rooms(), []
        release = asyncio.Event()

        async def visit(name, client, depth):
            async with rooms.room(depth, client):
                order.append(name)
                await release.wait()

        holder = asyncio.ensure_future(visit("a", b"A", 1))
        await _settle()
        cancelled = asyncio.ensure_future(visit("b", b"B", 2))
        await _settle()
        cancelled.cancel()
        await _settle()
        assert rooms.waiting() == 0
        later = asyncio.ensure_future(visit("c", b"C", 2))
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, later), 1)
        assert order == ["a", "c"] and cancelled.cancelled() and rooms._held == {}

    asyncio.run(run())


def test_the_room_gate_reads_the_skip_header_and_lets_reads_through():
    async def run():
        rooms, seen = Rooms(), []

        async def app(scope, receive, send):
            seen.append((rooms._depth, rooms._inside))

        gate = RoomGate(app, rooms, ["/v1/pipatch/generate"])
        client = _Client()
        await gate(_scope(skip=5), client.receive, client.send)
        await gate(_scope(skip="x"), client.receive, client.send)  # not a number: 0
        await gate(_scope(method="GET", path="/v1/pipatch/info"), client.receive, client.send)
        assert seen == [(5, 1), (0, 1), (0, 0)]

    asyncio.run(run())


# --------------------------------------------------------------------------------------------
# The limits a built request is checked against
# --------------------------------------------------------------------------------------------


class _Words:
    """A tokenizer of words (the limits count what a real tokenizer returns: ``input_ids``)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_limits_name_the_limit_and_its_flag():
    assert Limits() == Limits(request_bytes=MAX_REQUEST_BYTES, invokes=MAX_INVOKES, prompt_tokens=2048,
                              seconds=REQUEST_SECONDS, in_flight=REQUESTS_IN_FLIGHT)
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
    (["--max-request-seconds", "0"], "--max-request-seconds"),
    (["--max-requests-in-flight", "-3"], "--max-requests-in-flight"),
    (["--host", "0.0.0.0"], "add --api-key-file PATH"),
])
def test_bad_server_options_are_one_line_before_the_engine(argv, expected, capsys, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipatch serve: error: ") and expected in err[0], err
