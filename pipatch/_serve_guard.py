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

Both gates are plain ASGI middleware (no web framework needed to run or test them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._errors import PipatchError

__all__ = ["INFO_PATH", "GENERATE_PATH", "SKIP_HEADER", "KEY_HEADER", "KEY_ENV", "OPEN_PATHS", "read_keys", "server_keys", "Keys", "KeyGate", "Limits",
           "BodyLimit", "MAX_REQUEST_BYTES", "MAX_INVOKES"]

#: Where a client asks the server what it serves (``pipatch serve``'s info).
INFO_PATH = "/v1/pipatch/info"
#: Where a client sends a program by name and its jobs' data; each invoke's saves come back
#: apart.
GENERATE_PATH = "/v1/pipatch/generate"
#: The header a request names, by their count, the blocks its invokes skip with (0: none;
#: ``pipatch serve``'s rooms).
SKIP_HEADER = "X-Pipatch-Skip"
#: The header a client's key travels in (nnsight's ``nnsight-serve`` client's name for it).
KEY_HEADER = "ndif-api-key"
#: The environment variable a server (and a client) reads its key from.
KEY_ENV = "PIPATCH_API_KEY"
#: Paths that answer without a key: a liveness probe needs no secret.
OPEN_PATHS = frozenset({"/health"})
#: Default largest request body: a batch of 64 cells of a 640-wide model over 9 tokens is
#: 0.3 MB; a client splits a batch whose request would be larger (the server's info says).
MAX_REQUEST_BYTES = 32 * 2**20
#: Default most invokes in one request: the served client's batch (``INVOKES_PER_REQUEST``).
MAX_INVOKES = 64


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


@dataclasses.dataclass(frozen=True)
class Limits:
    """How large one request may be; each bound has a ``pipatch serve`` flag (:data:`FLAGS`).

    Attributes
    ----------
    request_bytes
        The request body (``--max-request-bytes``; default :data:`MAX_REQUEST_BYTES`).
    invokes
        Invokes in one request (``--max-invokes``; default :data:`MAX_INVOKES`).
    prompt_tokens
        Tokens in one invoke's prompt (``--max-prompt-tokens``; default: the engine's
        ``max_model_len``, over which the engine cannot run a prompt anyway).
    """

    request_bytes: int = MAX_REQUEST_BYTES
    invokes: int = MAX_INVOKES
    prompt_tokens: int = 2048

    FLAGS = {"request_bytes": "--max-request-bytes", "invokes": "--max-invokes", "prompt_tokens": "--max-prompt-tokens"}

    def over(self, name: str, what: str) -> str:
        """The refusal line for limit ``name``: ``what`` the request had, the limit, the flag."""
        return (f"{what}, over this server's limit of {getattr(self, name):,} "
                f"(pipatch serve {self.FLAGS[name]}): send smaller requests, or raise the limit")

    def refusal(self, prompts: list, tokenizer: Any) -> str | None:
        """A built request's invokes (``prompts``, one each) checked against :attr:`invokes`
        and :attr:`prompt_tokens`: the refusal line, or ``None`` when it fits."""
        if len(prompts) > self.invokes:
            return self.over("invokes", f"the request has {len(prompts):,} invokes")
        for i, prompt in enumerate(prompts):
            tokens = _prompt_tokens(prompt, tokenizer)
            if tokens > self.prompt_tokens:
                return self.over("prompt_tokens", f"invoke {i}'s prompt has {tokens:,} tokens")
        return None


def _prompt_tokens(prompt: Any, tokenizer: Any) -> int:
    """Tokens in one of vLLM's prompts: its token ids, or its text tokenized; another form
    (embeddings, multimodal) counts 0 (the engine bounds it by ``max_model_len``)."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return len(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return 0


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
