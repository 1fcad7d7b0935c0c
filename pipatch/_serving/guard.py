"""What ``pipatch serve`` lets in: the keys that may send requests, and how large one may be.

A request spends the engine's memory and time (and, with ``--allow-client-code``, carries
code the server runs), so a server another machine can reach needs keys, and one client's
large request must not take the engine's memory from everyone:

* **Keys** (:func:`server_keys`): from ``--api-key-file PATH`` (one key per line, ``#``
  comments: one key per person, so one can be removed), from ``PIPATCH_API_KEY``, or from
  ``--api-key`` (which every local user reads in the process list: it still works, with a
  warning). A request's key (header :data:`KEY_HEADER`, where nnsight's client sends it) is
  compared with each in constant time (:class:`Keys`); only :data:`OPEN_PATHS` answer without
  one (:class:`KeyGate`).
* **Limits per request** (:class:`Limits`): body bytes (:class:`BodyLimit`, before the body
  is read), invokes and prompt tokens (:meth:`Limits.refusal`, as a program request is
  decoded, before its other checks and before the engine sees it). A request over one is answered ``413`` with one line naming the
  limit and the flag that sets it; the server goes on serving the others.
* **Time and turns** (:class:`RequestGuard`): a request still running after
  ``--max-request-seconds`` is cancelled (its engine requests aborted) and answered ``504``;
  a client (:func:`client_of`: its key) with ``--max-requests-in-flight`` POSTs in flight is
  answered ``429`` for the next one; a request whose client went away (closed, killed) is
  cancelled at once, wherever it is (waiting its turn, or in the engine).
* **Fair share** (:class:`Rooms`): requests enter the engine in turns by client, so a client
  with many requests waiting does not hold another's behind all of them.

Every gate is plain ASGI middleware (no web framework needed to run or test them). The wire's
paths, headers and :class:`Limits` are :mod:`pipatch._backends._wire`'s (a client fits its
requests to the same limits); this module names them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from .._backends._wire import (
    CLIENT_HEADER,
    GENERATE_PATH,
    INFO_PATH,
    KEY_ENV,
    KEY_HEADER,
    LOAD_PATH,
    MAX_INVOKES,
    MAX_REQUEST_BYTES,
    REQUEST_SECONDS,
    REQUESTS_IN_FLIGHT,
    SKIP_HEADER,
    Limits,
)
from .._base.errors import PipatchError

__all__ = ["INFO_PATH", "GENERATE_PATH", "LOAD_PATH", "SKIP_HEADER", "KEY_HEADER", "CLIENT_HEADER", "KEY_ENV", "OPEN_PATHS",
           "read_keys", "server_keys", "Keys", "KeyGate", "Limits", "BodyLimit", "MAX_REQUEST_BYTES", "MAX_INVOKES",
           "REQUEST_SECONDS", "REQUESTS_IN_FLIGHT", "client_of", "Load", "RequestGuard", "Rooms", "RoomGate"]

#: Paths that answer without a key: a liveness probe needs no secret.
OPEN_PATHS = frozenset({"/health"})


def read_keys(path: str | os.PathLike) -> list[str]:
    """The keys in a key file: one per line; blank lines and ``#`` comments (whole lines, or
    after a key: ``KEY  # alice``) are skipped.

    Raises
    ------
    PipatchError
        The file cannot be read, holds no key, or a line holds more than one word before its
        comment, or a character that is not printable ASCII (HTTP headers carry the key).
    """
    try:
        text = Path(path).expanduser().read_text("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PipatchError(f"--api-key-file {path}: cannot read it ({type(error).__name__}): "
                           "pass a readable text file with one key per line") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 1 or not _printable(words[0]):
            raise PipatchError(f"--api-key-file {path}, line {number}: a key is one word of printable ASCII "
                               "(comments start with #)")
        keys.append(words[0])
    if not keys:
        raise PipatchError(f"--api-key-file {path} holds no key: write one key per line (comments start with #)")
    return keys


def server_keys(key_file: str | None, flag_key: str | None,
                environ: Mapping[str, str] = os.environ) -> tuple[list[str], list[str]]:
    """Every key a server accepts: the key file's, ``PIPATCH_API_KEY``'s and ``--api-key``'s
    (together: any of them lets a request in); and the warnings to print (one line each).

    Raises
    ------
    PipatchError
        From :func:`read_keys`; or a key given by the flag or the environment is not one word
        of printable ASCII.
    """
    keys = read_keys(key_file) if key_file is not None else []
    warnings = []
    for key, where in ((environ.get(KEY_ENV), f"${KEY_ENV}"), (flag_key, "--api-key")):
        if not key:
            continue
        if not _printable(key):
            raise PipatchError(f"{where}: a key is one word of printable ASCII (no spaces)")
        keys.append(key)
    if flag_key:
        warnings.append("--api-key is visible to every local user in the process list (ps): use "
                        f"--api-key-file PATH or ${KEY_ENV} instead")
    return list(dict.fromkeys(keys)), warnings


def _printable(key: str) -> bool:
    return key.isascii() and key.isprintable() and " " not in key


class Keys:
    """The keys a server accepts, compared in constant time.

    :meth:`accepts` compares digests (SHA-256, so every comparison takes one length) with
    :func:`hmac.compare_digest`, with every key, whatever matched: how long it takes says
    nothing of how much of a key a guess got right, or which key it was.
    """

    def __init__(self, keys: Iterable[str]):
        self._digests = [_digest(key.encode("ascii")) for key in keys]
        if not self._digests:
            raise PipatchError("no key to accept: pass --api-key-file PATH or set PIPATCH_API_KEY")

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, given: str | bytes) -> bool:
        """Whether ``given`` (a header's value) is one of the keys."""
        digest = _digest(given if isinstance(given, bytes) else given.encode("utf-8", "replace"))
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(known, digest)
        return found


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


async def _refuse(send: Any, status: int, line: str) -> None:
    """Answer ``status`` with ``{"detail": line}`` (what nnsight's and pipatch's clients read)."""
    body = json.dumps({"detail": line}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class KeyGate:
    """ASGI middleware: an HTTP request to a path outside :data:`OPEN_PATHS` goes on only with
    one of ``keys`` in :data:`KEY_HEADER`; else ``401`` (a websocket is closed, ``1008``)."""

    def __init__(self, app: Any, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(KEY_HEADER.encode(), b"")
        if self.keys.accepts(given):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        what = "an invalid API key" if given else "no API key"
        await _refuse(send, 401, f"{what}: send a key this server accepts in the {KEY_HEADER} header "
                                 "(pipatch clients: api_key= or $PIPATCH_API_KEY)")


class BodyLimit:
    """ASGI middleware: an HTTP request whose body is over ``limits.request_bytes`` is answered
    ``413`` (one line naming the limit and its flag): at once where its ``Content-Length``
    says so, else once the bytes received pass it (a chunked body). The body is read here,
    up to the limit, and handed to the route whole (the routes read it whole anyway)."""

    def __init__(self, app: Any, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.request_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:  # else the HTTP server's to refuse
            return await _refuse(send, 413, self.limits.over("request_bytes", f"the request body has {int(declared):,} bytes"))
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            received += len(message.get("body", b""))
            if received > limit:
                return await _refuse(send, 413, self.limits.over("request_bytes",
                                                                 f"the request body (sent in chunks) has more than {limit:,} bytes"))
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        whole: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict:
            nonlocal whole
            if whole is None:
                return await receive()  # after the body: the disconnect, when it comes
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)


def client_of(scope: Mapping[str, Any]) -> bytes:
    """Who an HTTP request is from, for its turns and its count in flight: its key (a digest:
    the key itself is kept nowhere), else the id a pipatch client names itself by
    (:data:`CLIENT_HEADER`: a server without keys is on the loopback, among trusted users),
    else its address."""
    headers = dict(scope.get("headers") or [])
    key = headers.get(KEY_HEADER.encode())
    if key:
        return b"key:" + _digest(key)[:16]
    named = headers.get(CLIENT_HEADER.lower().encode())
    if named:
        return b"client:" + named[:64]
    return b"address:" + str((scope.get("client") or ("", 0))[0]).encode()


@dataclasses.dataclass
class Load:
    """What :class:`RequestGuard` counts: POSTs in flight by client, and the requests it
    cancelled (their time up, their client gone). ``pipatch serve`` answers it at
    :data:`LOAD_PATH`."""

    in_flight: dict[bytes, int] = dataclasses.field(default_factory=dict)
    timed_out: int = 0
    client_gone: int = 0

    def of(self, client: bytes) -> dict[str, int]:
        return {"in_flight": sum(self.in_flight.values()), "yours": self.in_flight.get(client, 0),
                "timed_out": self.timed_out, "client_gone": self.client_gone}


class RequestGuard:
    """ASGI middleware: a request's wall time, a client's POSTs in flight, and a client gone.

    * A client (:func:`client_of`) with ``limits.in_flight`` POSTs in flight is answered
      ``429`` for the next (one line naming ``--max-requests-in-flight``).
    * A request still running ``limits.seconds`` after its first byte is cancelled and, if its
      answer has not started, answered ``504`` (one line naming ``--max-request-seconds``).
    * A request whose client closes the connection (a kernel interrupt, a killed process) is
      cancelled once its body is read, wherever it is: waiting for its turn, or in the engine.

    Cancelled means the route's task is cancelled: what it waits on is dropped (its place in
    :class:`Rooms`; its engine requests, which ``pipatch serve``'s route aborts). Other
    clients' requests are not touched. ``load`` (:class:`Load`) counts what happened.
    """

    def __init__(self, app: Any, limits: Limits, load: Load | None = None):
        self.app, self.limits, self.load = app, limits, load if load is not None else Load()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if scope.get("method") != "POST":  # reads (info, load): no work queued, not counted
            return await self._timed(scope, receive, send)
        client, in_flight = client_of(scope), self.load.in_flight
        if in_flight.get(client, 0) >= self.limits.in_flight:
            return await _refuse(send, 429, self.limits.over(
                "in_flight", f"this client (its key) has {in_flight[client]:,} requests in flight", "send fewer at once"))
        in_flight[client] = in_flight.get(client, 0) + 1
        counted = True

        def done() -> None:  # once: as its answer's last bytes go, or as it ends without them
            nonlocal counted
            if counted:
                counted = False
                in_flight[client] -= 1
                if not in_flight[client]:
                    del in_flight[client]

        try:
            await self._timed(scope, receive, send, done)
        finally:
            done()

    async def _timed(self, scope: dict, receive: Any, send: Any, done: Any = None) -> None:
        body_read, gone = asyncio.Event(), asyncio.Event()
        answered = False

        async def inner_receive() -> dict:
            if body_read.is_set():  # after the body: nothing until the client goes (the watcher hears it)
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                body_read.set()
            if message["type"] == "http.disconnect":
                gone.set()
            return message

        async def inner_send(message: dict) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            if done is not None and message["type"] == "http.response.body" and not message.get("more_body"):
                done()  # before the client can read the end and send its next request (its count is exact)
            await send(message)

        async def watch() -> None:  # the ASGI server says http.disconnect when the client goes
            await body_read.wait()
            while not gone.is_set() and (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        route = asyncio.ensure_future(self.app(scope, inner_receive, inner_send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({route, watcher}, timeout=self.limits.seconds, return_when=asyncio.FIRST_COMPLETED)
            if route.done():
                return route.result()
            if answered:  # its answer is under way (a disconnect heard now is its end): let it finish
                return await route
            if gone.is_set():
                self.load.client_gone += 1
            else:
                self.load.timed_out += 1
            route.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await route  # its own cleanup (engine requests aborted) runs before the answer
            if not gone.is_set():
                await _refuse(send, 504, self.limits.over(
                    "seconds", f"the request ran for {self.limits.seconds:g} s and was stopped",
                    "send smaller requests or fewer at once"))
        finally:
            for task in (route, watcher):
                task.cancel()


class Rooms:
    """Admits requests to the engine so that those in it at once all skip the same blocks,
    and in turns by client.

    A client's batch skips the blocks below its cells (nnsight's ``.skip()``, the vLLM
    backend's shortcut), and nnsight's batched skip has to cover every request of the
    engine's step; the engine puts whatever requests it holds into a step. So a request that
    skips ``depth`` blocks waits until the engine holds none with another depth.

    Which request is next: the oldest of the client (:func:`client_of`) that entered least
    recently (a client with none inside or waiting starts afresh, first in line), so a
    client with many requests waiting (a long sweep, a study's facts) takes one turn while
    another client's request waits, not all of them. The next request enters when the room is
    empty or holds its depth, so no stream of requests keeps another out; requests of one
    depth (any number of clients) share the engine's steps. A request cancelled while it
    waits (its client gone, its time up) leaves the line.
    """

    def __init__(self) -> None:
        self._line: list[tuple[bytes, int, asyncio.Event]] = []  # (client, depth, its door) in arrival order
        self._turn: dict[bytes, int] = {}  # client → when it last entered (clients with requests here)
        self._held: dict[bytes, int] = {}  # client → its requests waiting or inside
        self._entered, self._depth, self._inside = 0, 0, 0

    def waiting(self) -> int:
        return len(self._line)

    def _admit(self) -> None:
        """Let in every request that may enter now, the next first (the first of the client
        that entered least recently). No ``await`` here or in any cleanup: a request cancelled
        by Starlette's middleware (anyio) is cancelled again at every ``await`` it makes."""
        while self._line:
            ticket = min(self._line, key=lambda waiting: self._turn.get(waiting[0], -1))
            client, depth, door = ticket
            if self._inside and self._depth != depth:
                return
            self._line.remove(ticket)
            self._entered += 1
            self._turn[client] = self._entered
            self._depth, self._inside = depth, self._inside + 1
            door.set()

    @contextlib.asynccontextmanager
    async def room(self, depth: int, client: bytes = b"") -> AsyncIterator[None]:
        ticket = (client, depth, asyncio.Event())
        self._line.append(ticket)
        self._held[client] = self._held.get(client, 0) + 1
        self._admit()
        try:
            await ticket[2].wait()
        except BaseException:
            if ticket in self._line:
                self._line.remove(ticket)
            else:  # let in as it was cancelled
                self._inside -= 1
            self._leave(client)
            raise
        try:
            yield
        finally:
            self._inside -= 1
            self._leave(client)

    def _leave(self, client: bytes) -> None:
        self._held[client] -= 1
        if not self._held[client]:
            del self._held[client]
            self._turn.pop(client, None)
        self._admit()


class RoomGate:
    """ASGI middleware: each POST to one of ``paths`` runs in ``rooms`` (:class:`Rooms`) by the
    blocks its :data:`SKIP_HEADER` says it skips (0 where it says none), until its answer is sent."""

    def __init__(self, app: Any, rooms: Rooms, paths: Iterable[str]):
        self.app, self.rooms, self.paths = app, rooms, frozenset(paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        said = dict(scope.get("headers") or []).get(SKIP_HEADER.lower().encode(), b"0")
        depth = max(int(said), 0) if said.isdigit() else 0
        async with self.rooms.room(depth, client_of(scope)):
            await self.app(scope, receive, send)
