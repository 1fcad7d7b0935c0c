"""``pipatch serve``: nnsight's own server (``nnsight-serve``) for pipatch's notebooks.

A team runs one server on the machine with the GPUs; every notebook points at it with
``pipatch.load_model(MODEL, serve="http://host:6677")`` (the served backend,
:mod:`pipatch._backends.served`) and keeps its live grid while the sweeps run there. The
server is nnsight 0.8.1's FastAPI app around an async ``VLLM`` model, started the way
``nnsight-serve`` starts it, plus what pipatch needs of it:

* **The right worker.** On a machine without CUDA the engine's worker is pipatch's CPU
  adapter (:mod:`pipatch._backends._vllm_cpu_worker`), named before the model is built (the worker
  processes import it by name).
* **Fresh sources per request** (nnsight's route, with ``--allow-client-code``). nnsight
  memoizes each traced file's source and ``with`` blocks by file name, and the server
  registers each request's shipped source under the *client's* file name: the second,
  different trace sent from one client file would be parsed against the first one's source
  (``WithBlockNotFoundError``). Those memos are
  dropped before each request is built (builds run one at a time, with no ``await``:
  :func:`pipatch._compat.nnsight.fresh_sources_per_request`).
* **Clean shutdown.** On SIGINT/SIGTERM the web server stops, and then so does the vLLM
  engine and its worker processes (the stock server leaves them running, with the engine's
  memory).
* **Programs by name, no client code.** ``POST /v1/pipatch/generate`` takes a program's
  name and its jobs' data, never code (:mod:`pipatch._backends._served_programs`): every
  field is checked before anything runs (a malformed request is HTTP 400 with one line),
  and the server builds the nnsight trace from its own copy of the program. Each invoke's
  saves come back under their own keys (``name@request-id``, in invoke order), where
  nnsight's route merges them by name; and the invokes are collected from the workers in one
  call, not one each (:func:`_programs_by_name`). nnsight's own routes, which run the code
  a client sends, answer 403 unless the server is started with ``--allow-client-code``
  (:func:`_no_client_code`).
* **One skip at a time, in turns.** A client's batch skips the blocks below its patches, and
  nnsight's batched skip has to cover every request of an engine step: requests enter the
  engine together only where they skip as many blocks (each says so in :data:`SKIP_HEADER`;
  pipatch's route checks it against its program and waits once the program is built), and in turns
  by client, so a long sweep does not hold a short one behind it
  (:class:`~pipatch._serving.guard.Rooms`).
* **The tree by name.** On pipatch's CPU workers, an invoke names the model's envoy tree
  (:data:`~pipatch._model.models.TREE_ID`) on its way to the engine (and in nnsight clients'
  requests) instead of pickling its 264 envoys
  (:func:`pipatch._compat.nnsight.serve_tree_by_reference`).
* **Who may send requests, and how much.** The server listens on the loopback only, unless
  ``--host`` comes with keys (``--api-key-file`` or ``PIPATCH_API_KEY``, compared in constant
  time; only ``/health`` answers without one), and each request is bounded in body bytes,
  invokes and prompt tokens, each by a flag (:mod:`pipatch._serving.guard`; over one: HTTP 413,
  one line naming the flag), and in wall time (``--max-request-seconds``: cancelled, 504); a
  client has at most ``--max-requests-in-flight`` requests in flight (429). A request whose
  client goes away (closed, killed) is cancelled: its turn and its engine requests are freed.
  ``GET /v1/pipatch/load`` says what is in flight and waiting. ``--ssl-certfile/--ssl-keyfile`` serve HTTPS (uvicorn's own
  TLS), so keys and results do not cross a network in clear text.
* **What it serves.** ``GET /v1/pipatch/info`` says which model, dtype, device and
  versions, and the program format; a client checks it when it connects (a wrong key, or
  another pipatch version, fails there, at once, in one line).

The ready line (``pipatch serve: ready at http://...``) is printed on stdout once the port
accepts requests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from .guard import (
    GENERATE_PATH,
    INFO_PATH,
    LOAD_PATH,
    MAX_INVOKES,
    MAX_REQUEST_BYTES,
    REQUEST_SECONDS,
    REQUESTS_IN_FLIGHT,
    SKIP_HEADER,
    BodyLimit,
    KeyGate,
    Keys,
    Limits,
    Load,
    RequestGuard,
    RoomGate,
    Rooms,
    client_of,
    server_keys,
)

__all__ = ["main", "Spawned", "INFO_PATH", "GENERATE_PATH", "LOAD_PATH", "SKIP_HEADER", "LOOPBACK", "CLIENT_CODE_PREFIX"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: nnsight's own routes, which run the code a client sends: closed unless --allow-client-code.
CLIENT_CODE_PREFIX = "/v1/nnsight/"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipatch serve",
        description="Serve a model to pipatch notebooks (nnsight's server on a vLLM engine). "
                    "Options it does not know go to the vLLM engine: --tensor-parallel-size 2, "
                    "--max-model-len 4096, --kv-cache-memory-bytes 2000000000, ...")
    parser.add_argument("model", nargs="?", default=None,
                        help="HF id or local folder (default: the embedded Gemma 3 270M)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default 127.0.0.1; any other needs a key)")
    parser.add_argument("--port", default=6677, help="port (default 6677)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="require one of the keys in PATH (one per line, # comments); "
                             "also accepted: the key in $PIPATCH_API_KEY")
    parser.add_argument("--api-key", default=None,
                        help="require this key (every local user can read it in the process list: "
                             "prefer --api-key-file or $PIPATCH_API_KEY)")
    parser.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this certificate")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the certificate's private key")
    parser.add_argument("--max-request-bytes", default=None, metavar="N",
                        help=f"largest request body (default {MAX_REQUEST_BYTES})")
    parser.add_argument("--max-invokes", default=None, metavar="N",
                        help=f"most invokes in one request (default {MAX_INVOKES})")
    parser.add_argument("--max-prompt-tokens", default=None, metavar="N",
                        help="most tokens in one invoke's prompt (default: the engine's max_model_len)")
    parser.add_argument("--max-request-seconds", default=None, metavar="S",
                        help=f"longest a request may take, its wait for a turn included (default {REQUEST_SECONDS})")
    parser.add_argument("--max-requests-in-flight", default=None, metavar="N",
                        help=f"most requests one key may have in flight (default {REQUESTS_IN_FLIGHT})")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when torch sees a GPU)")
    parser.add_argument("--programs", action="append", default=[], metavar="MODULE",
                        help="also run the programs this module registers (repeatable; importable here, "
                             "e.g. on PYTHONPATH); installed packages' pipatch.programs entry points load too")
    parser.add_argument("--allow-client-code", action="store_true",
                        help="also run nnsight traces (Python code) that clients send, on nnsight's own routes "
                             "(default: off; pipatch clients send programs by name)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status (2: bad options)."""
    from .._base.checks import whole_number
    from .._compat.anyio import import_before_nnsight
    from .._model.models import PipatchError

    parser = build_parser()
    words, engine_words = _split_engine_words(parser, list(sys.argv[1:] if argv is None else argv))
    args, stray = parser.parse_known_args(words)
    engine_words += stray
    try:
        import_before_nnsight()
        # Checked here, not by argparse's int: its error would not name the range.
        args.port = whole_number(args.port, "--port", minimum=1, maximum=65535)
        args.keys, warnings = server_keys(args.api_key_file, args.api_key)
        for name in ("max_request_bytes", "max_invokes", "max_prompt_tokens", "max_request_seconds",
                     "max_requests_in_flight"):
            value = getattr(args, name)
            if value is not None:
                setattr(args, name, whole_number(value, "--" + name.replace("_", "-"), minimum=1))
        _check_tls(args)
        engine_args = _engine_args(engine_words)
        if args.host not in LOOPBACK and not args.keys:
            raise PipatchError(f"--host {args.host} lets other machines send requests: "
                               "add --api-key-file PATH (or set $PIPATCH_API_KEY; clients pass api_key=), "
                               "or keep the default 127.0.0.1")
        if args.host not in LOOPBACK and not args.ssl_certfile:
            warnings.append(f"--host {args.host} without --ssl-certfile: keys and results cross the network in "
                            "clear text (add --ssl-certfile/--ssl-keyfile, or keep 127.0.0.1 and use ssh -L)")
        for warning in warnings:
            sys.stderr.write(f"pipatch serve: warning: {warning}\n")
        return _serve(args, engine_args)
    except PipatchError as error:
        sys.stderr.write(f"pipatch serve: error: {error}\n")
        return 2


def _check_tls(args: argparse.Namespace) -> None:
    """``--ssl-certfile`` and ``--ssl-keyfile`` come together and name a certificate and its
    key (loaded here once, so that a wrong file is one line before the engine starts)."""
    import ssl

    from .._model.models import PipatchError

    given = {flag: path for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile))
             if path is not None}
    if len(given) == 1:
        raise PipatchError(f"{next(iter(given))} needs its pair: pass both --ssl-certfile CERT and --ssl-keyfile KEY")
    for flag, path in given.items():
        if not os.access(path, os.R_OK) or not os.path.isfile(path):
            raise PipatchError(f"{flag} {path}: no readable file there: pass the PEM file's path")
    if given:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except ssl.SSLError as error:
            raise PipatchError(f"--ssl-certfile {args.ssl_certfile} --ssl-keyfile {args.ssl_keyfile}: not a certificate "
                               f"and its private key in PEM ({error.reason or error}): pass the files your CA "
                               "or `openssl req -x509` made") from None


def _split_engine_words(parser: argparse.ArgumentParser, words: list[str]) -> tuple[list[str], list[str]]:
    """``words`` → (pipatch's, the engine's): a ``--flag`` pipatch does not know goes to the
    engine with the value after it, so that ``pipatch serve --tensor-parallel-size 2`` does not
    read ``2`` as the model (argparse alone would)."""
    ours, engine, i = [], [], 0
    while i < len(words):
        word = words[i]
        name = word.split("=", 1)[0]
        if word.startswith("--") and name not in parser._option_string_actions:
            takes = "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("-")
            engine += words[i : i + 1 + takes]
            i += 1 + takes
            continue
        ours.append(word)
        i += 1
    return ours, engine


def _engine_args(words: list[str]) -> dict[str, Any]:
    """``--flag value`` words → vLLM engine keywords, as ``nnsight-serve`` reads them; a word
    that is no ``--flag`` (``-tp 2``) is refused rather than dropped."""
    from .._compat.nnsight import vllm_engine_args
    from .._model.models import PipatchError

    stray = [w for i, w in enumerate(words) if not w.startswith("--") and (i == 0 or not words[i - 1].startswith("--"))]
    if stray:
        raise PipatchError(f"unrecognized argument {stray[0]!r}: engine options are --long-flags with a value "
                           "(--tensor-parallel-size 2, not -tp 2)")
    return vllm_engine_args(words)


def _serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    import uvicorn

    from .._backends._served_programs import PROGRAM_FORMAT, Bounds, served_programs
    from .._backends._vllm_engine import vllm_adapter
    from .._backends._vllm_load import build_vllm
    from .._compat import nnsight as nnsight_compat
    from .._compat import vllm as vllm_compat
    from .._model.models import EMBEDDED_NAME, TREE_ID
    from .._programs._program import load_programs

    server = nnsight_compat.serve_server()
    label = args.model or EMBEDDED_NAME
    nnsight_compat.check_server(server)  # before the engine's minute: one line if this nnsight differs
    added = load_programs(args.programs)  # the operator's modules: a client never sends code
    if added:
        print(f"pipatch serve: programs of the modules named: {', '.join(added)}", flush=True)
    print(f"pipatch serve: starting {label} (the engine takes about a minute) ...", flush=True)
    model = build_vllm(args.model, dtype=args.dtype, device=args.device, engine_args=engine_args, mode="async")
    try:
        vllm_compat.check_async_engine(model.vllm_entrypoint)
    except BaseException:
        model.vllm_entrypoint.shutdown()
        raise
    server.set_model(model)
    # nnsight's server, changed while this one runs and put back when it stops.
    changed = contextlib.ExitStack()
    changed.enter_context(nnsight_compat.fresh_sources_per_request(server))
    config = model.vllm_entrypoint.vllm_config
    info = {
        "model": label, "dtype": str(config.model_config.dtype).replace("torch.", ""),
        "device": str(getattr(config.device_config, "device_type", "") or "cpu"),
        "max_model_len": int(config.model_config.max_model_len),
        "tensor_parallel_size": int(config.parallel_config.tensor_parallel_size),
        "pipatch": _version("pipatch"), "nnsight": _version("nnsight"), "vllm": _version("vllm"),
        "program_format": PROGRAM_FORMAT, "programs": served_programs(), "client_code": bool(args.allow_client_code),
    }
    # pipatch's CPU workers name their tree (pipatch._backends._vllm_cpu_worker); nnsight's CUDA worker
    # does not, and an engine in another process takes no function to run on its workers.
    info["tree_by_reference"] = info["device"] == "cpu"
    if info["tree_by_reference"]:
        changed.enter_context(nnsight_compat.serve_tree_by_reference(server, model, TREE_ID))

    async def describe() -> dict[str, Any]:
        return info

    limits = Limits(request_bytes=args.max_request_bytes or MAX_REQUEST_BYTES, invokes=args.max_invokes or MAX_INVOKES,
                    prompt_tokens=args.max_prompt_tokens or info["max_model_len"],
                    seconds=args.max_request_seconds or REQUEST_SECONDS,
                    in_flight=args.max_requests_in_flight or REQUESTS_IN_FLIGHT)
    info["limits"] = dataclasses.asdict(limits)
    server.app.add_api_route(INFO_PATH, describe, methods=["GET"])
    adapter = vllm_adapter(model, info["tensor_parallel_size"])
    rooms, load = Rooms(), Load()
    _programs_by_name(server, adapter,
                      Bounds.of(adapter, config.model_config.get_vocab_size(), info["max_model_len"], limits), rooms)
    if args.allow_client_code:
        print("pipatch serve: --allow-client-code: nnsight's routes run the Python code clients send, as this "
              "server's user, with its files and the engine's memory; give keys only to people you would give "
              "a shell here", flush=True)
    else:
        _no_client_code(server)
    _load_route(server, rooms, load)
    info["skip_rooms"] = True
    # Added last, so run first (Starlette's order): the key, then the time and the requests in
    # flight, then the body's size, then the rooms for nnsight's generate (pipatch's route
    # enters them itself, once its request is checked and built).
    server.app.add_middleware(RoomGate, rooms=rooms, paths=(CLIENT_CODE_PREFIX + "generate",))
    server.app.add_middleware(BodyLimit, limits=limits)
    server.app.add_middleware(RequestGuard, limits=limits, load=load)
    if args.keys:
        server.app.add_middleware(KeyGate, keys=Keys(args.keys))
    scheme = "https" if args.ssl_certfile else "http"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"pipatch serve: ready at {scheme}://{args.host}:{args.port} ({label}, {info['dtype']}, "
                      f"{info['device']}; pid {os.getpid()})", flush=True)

    # uvicorn handles SIGINT/SIGTERM itself and, once stopped, re-raises the signal with the
    # handler it found: SystemExit (not the default, which kills at once) lets the engine
    # shut down below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        Server(uvicorn.Config(server.app, host=args.host, port=args.port, log_level="warning",
                              ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)).run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        changed.close()
        model.vllm_entrypoint.shutdown()  # the engine core and its workers: no orphans
        print("pipatch serve: stopped", flush=True)
    return 0


def _programs_by_name(server: Any, adapter: Any, bounds: Any, rooms: Rooms) -> None:
    """Add :data:`GENERATE_PATH`: a program by name, checked, built here and run.

    * The request names one of pipatch's programs and carries its jobs' data
      (:mod:`pipatch._backends._served_programs`); it is checked against ``bounds`` (the
      model's vocabulary, layers, width, context and sites) before anything runs, and a
      malformed one is answered 400 with one line; one over the server's limits (invokes,
      prompt tokens: ``bounds.limits``), 413 naming the limit's flag. Its skip must be the one its
      :data:`SKIP_HEADER` says.
    * The trace is built here from the server's own copy of the program, with the server's
      ``adapter``; a failure while it runs comes back in nnsight's answer, as the error of
      that request only.
    * Checked and built, it waits for its turn in ``rooms`` (by its skip and its client:
      :class:`~pipatch._serving.guard.Rooms`) and leaves them once its engine requests are
      collected: the next request is checked and built while the engine runs this one, and
      its answer is written while the engine runs the next.
    * Each invoke's saves come back under their own keys (``name@request-id``, in invoke
      order), where nnsight's route merges them by name (the last invoke's value only).
    * A request's invokes are collected in one call to the workers, where nnsight's route
      makes one per invoke (each a round trip through the engine core: 16 a request).
    * A request's invokes start in one engine step (:func:`_together`), where nnsight's route
      adds them one by one and the engine starts stepping on the first.
    """
    import asyncio
    import uuid

    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    from .._backends._served_programs import BadRequest, OverLimit, build, decode
    from .._compat.nnsight import answer, capture_exception, merge_collected, served_model

    async def generate(request: Request) -> Any:
        model = served_model(server)
        try:
            program = decode(await request.body(), bounds)
            if request.headers.get(SKIP_HEADER, "0") != str(program.skip):
                raise BadRequest(f"the request skips {program.skip} blocks, its {SKIP_HEADER} header says "
                                 f"{request.headers.get(SKIP_HEADER, '0')[:20]!r}: send both alike")
        except BadRequest as refused:
            return PlainTextResponse(str(refused), status_code=413 if isinstance(refused, OverLimit) else 400)
        try:
            prompts, params, loras = build(model, adapter, program)
        except Exception as exception:  # noqa: BLE001 - the client re-raises it, in one line
            return answer(server, {}, capture_exception(exception))
        engine = model.vllm_entrypoint
        ids = [str(uuid.uuid4()) for _ in prompts]

        collected: dict | None = None
        async with rooms.room(program.skip, client_of(request.scope)):
            try:
                outputs = await _together(engine, ids, prompts, params, loras)
                # Without the engine's RequestOutputs (nnsight would pickle them across to serve
                # ``tracer.result``, which pipatch's invoke bodies never read: they save their values).
                collected = merge_collected(await engine.collective_rpc("collect_nnsight", args=(ids, ids)))
            finally:
                if collected is None:  # cancelled (a shutdown, a client gone): free what the workers hold
                    await asyncio.shield(engine.collective_rpc("collect_nnsight", args=(ids, ids)))
        saves: dict[str, Any] = {}
        error = None
        for rid, out in zip(ids, outputs):
            if isinstance(out, BaseException):
                error = error or capture_exception(out)
                continue
            entry = collected.get(rid) or {}
            saves.update({f"{name}@{rid}": value for name, value in (entry.get("saves") or {}).items()})
            error = error or entry.get("error")
        return answer(server, saves, error)

    generate.__annotations__["request"] = Request  # FastAPI reads the type, not its name (a local import)
    server.app.add_api_route(GENERATE_PATH, generate, methods=["POST"])


def _no_client_code(server: Any) -> None:
    """nnsight's own routes (``/v1/nnsight/...``: a trace's code to run, a block to install
    on every request) answer 403 with one line; ``/health`` and pipatch's routes are as they
    were. ``pipatch serve --allow-client-code`` leaves them open."""
    from fastapi.responses import PlainTextResponse

    async def refuse_code(request: Any, call_next: Any) -> Any:
        if request.url.path.startswith(CLIENT_CODE_PREFIX):
            return PlainTextResponse("this server runs no client code (nnsight traces): pipatch clients send programs "
                                     "by name; start the server with --allow-client-code to run nnsight clients' code",
                                     status_code=403)
        return await call_next(request)

    server.app.middleware("http")(refuse_code)


async def _together(engine: Any, ids: list[str], prompts: list, params: list, loras: list | None) -> list:
    """Run one request's invokes as engine requests that start in one step; what each ended
    with (``None``, or the exception it raised), in order.

    Each engine request is one message to the engine core, which starts a step as soon as
    it holds one: invokes sent one by one ran as a step of the first and more steps of the
    rest (``bench/served.py`` compares it with the same trace in process). The scheduler is held
    while they are added (vLLM's ``keep`` pause: requests already running wait, none is
    dropped: :func:`pipatch._compat.vllm.held_scheduler`), so the step takes them all, as an
    in-process trace's ``generate`` does."""
    import asyncio

    from .._compat.vllm import abort_requests, held_scheduler

    outcomes: list[Any] = [None] * len(ids)
    queues: dict[int, Any] = {}
    held = held_scheduler(engine) if len(ids) > 1 else contextlib.nullcontext()  # one starts its step alone anyway
    async with held:
        added = await asyncio.gather(*(engine.add_request(rid, prompts[i], params[i],
                                                          lora_request=loras[i] if loras else None)
                                       for i, rid in enumerate(ids)), return_exceptions=True)
        for i, queue in enumerate(added):
            if isinstance(queue, BaseException):  # this invoke's failure, reported with it
                outcomes[i] = queue
            else:
                queues[i] = queue

    async def finish(i: int) -> None:
        queue = queues[i]
        while not (queue.get_nowait() or await queue.get()).finished:
            pass

    try:
        done = await asyncio.gather(*(finish(i) for i in queues), return_exceptions=True)
    except BaseException:  # cancelled (a shutdown, a client gone): the engine drops them
        await asyncio.shield(abort_requests(engine, [queue.request_id for queue in queues.values()]))
        raise
    for i, out in zip(queues, done):
        outcomes[i] = out
    return outcomes


def _load_route(server: Any, rooms: Rooms, load: Load) -> None:
    """Add :data:`LOAD_PATH`: the requests in flight (the caller's and all), waiting for a
    turn, in the engine, and cancelled (time up, client gone)."""
    from fastapi import Request

    from .._compat.nnsight import served_model
    from .._compat.vllm import unfinished_requests

    async def describe_load(request: Request) -> dict[str, int]:
        engine = served_model(server).vllm_entrypoint
        return {**load.of(client_of(request.scope)), "waiting": rooms.waiting(),
                "engine_requests": unfinished_requests(engine)}

    describe_load.__annotations__["request"] = Request  # FastAPI reads the type, not its name (a local import)
    server.app.add_api_route(LOAD_PATH, describe_load, methods=["GET"])


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return ""


class Spawned:
    """A ``pipatch serve`` child process, started and read until its ready line.

    For scripts, benchmarks and tests that need a server of their own::

        server = Spawned(env={"PIPATCH_API_KEY": key})  # returns once the port accepts requests
        model = pipatch.load_model(serve=server.url, api_key=key)
        ...
        server.stop()                                   # SIGTERM: the engine processes go too

    ``tree`` lists the pids it started (the web server, the engine core, its workers),
    ``rss_gb()`` their resident memory and ``alive()`` those still running. ``env`` adds to
    the child's environment (``{"PIPATCH_API_KEY": key}``); with ``--ssl-certfile`` its
    ``url`` is ``https://``.
    """

    def __init__(self, *args: str, port: int | None = None, timeout: float = 600, python: str | None = None,
                 env: dict[str, str] | None = None):
        import socket
        import subprocess
        import threading
        import time

        import psutil

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        scheme = "https" if "--ssl-certfile" in args else "http"
        self.port, self.url = port, f"{scheme}://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "pipatch.cli", "serve", "--port", str(port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.tree = [self.proc.pid]
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("pipatch serve: ready at "):
                    ready.set()
            ready.set()  # it exited

        threading.Thread(target=read, daemon=True).start()
        started = time.monotonic()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            self.kill()
            tail = "".join(self.lines[-15:])
            raise RuntimeError(f"pipatch serve did not get ready in {timeout:.0f} s:\n{tail}")
        self.start_s = time.monotonic() - started
        self.tree += [child.pid for child in psutil.Process(self.proc.pid).children(recursive=True)]

    def rss_gb(self) -> float:
        import psutil

        total = 0
        for pid in self.tree:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**30

    def alive(self) -> list[int]:
        import psutil

        running = []
        for pid in self.tree:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                pass
        return running

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, as a service manager stops it; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL whatever of it is left (cleanup after a failure)."""
        for pid in self.tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
