"""The served backend: the vLLM backend's invokes, run on a ``pipatch serve`` server.

``pipatch.load_model(name, serve="http://host:6677", api_key=...)`` connects here. This
process holds nnsight's ``VLLM`` *without* an engine (the module tree on the meta device, no
weights, no GPU) and the server (:mod:`pipatch._serving.serve`: nnsight's own ``nnsight-serve`` app)
holds the engine. Everything an experiment does is what the vLLM backend does — the same
invoke bodies (:func:`~pipatch._backends.vllm._capture_run`,
:func:`~pipatch._backends.vllm._patched_run`), so the same numbers — and only the transport
differs, in :meth:`ServedBackend._invokes`:

* **Many invokes per request.** A batch of cells goes as requests of up to
  :data:`INVOKES_PER_REQUEST` invokes each (a cell's invokes, as in process: as a rule one
  request a batch), sent together on a pool of connections; the server adds a request's
  invokes to its engine with the scheduler held, so they start in one step, as an in-process
  trace's do, and keeps each invoke's saves apart (:data:`~pipatch._serving.serve.GENERATE_PATH`).
  A batch of cells returns when its last request does, so the live grid fills in batch by
  batch.
* **Blocks below a patch are skipped**, as in process: each request says how many blocks its
  invokes skip (:data:`~pipatch._serving.serve.SKIP_HEADER`), and the server lets requests into its
  engine together only where they skip as many (nnsight's batched skip has to cover every
  request of a step; ``pipatch serve``'s rooms, first come first served).
* **What travels: programs by name, no code.** A request names a program and carries its
  jobs' data: a program with declared inputs (the lens, a circuit's runs, a program of your
  own whose module the server's operator named with ``--programs``) as its name, its version
  and each row's fields encoded by their declared types; the vLLM backend's own capture and
  patched-run bodies by name with their arguments (the metric, the ops — sites by name,
  indices, values: a cell's donor slices and noise draw, a few KB — the skipped blocks'
  states); the pipatch version and program format (:mod:`._served_programs`; data only,
  ``torch.save`` of plain containers and tensors). An SAE's latent site travels as data too: its
  description and tensors, which the server checks against its model and rebuilds with
  pipatch's own classes. The server checks every field and builds the trace from its own copy
  of the program, so a site it cannot name (a site of your own) is refused here, in one line,
  and so is a program it does not run (its info lists those it does). The answer is nnsight's ``torch.save``
  of the saved values, read with ``weights_only=True``: connect only to servers you trust
  (the ``api_key`` says who may send requests; over ``https://`` the server's certificate is
  checked, against ``verify=``'s CA file where given).
* **The server's limits.** Its info names how many invokes and body bytes one request may
  carry (``pipatch serve --max-invokes/--max-request-bytes``): a batch goes as requests that
  fit, halved until each does; one invoke (an SAE's site with it) over the byte limit is one
  line naming ``--max-request-bytes``. A client keeps no more requests in flight than the server lets one
  key have (``--max-requests-in-flight``), and names itself in each (a random id: its turns on
  a server without keys).
* **Errors.** Unreachable server, refused key, another model or pipatch version (checked at
  connect), a request the server refuses, a failure inside the trace, a timeout: each is one
  :class:`~pipatch.PipatchError` line; the engine wraps it with the batch
  and keeps the finished rows. Kernel ▸ Interrupt and Stop land between requests: requests
  not yet sent are dropped, those in flight finish on the server and are discarded here.

NDIF (``remote=True``) takes nnsight's code format and runs only code from its allowed
modules, and pipatch's invoke bodies are pipatch functions: it is not this backend with
another transport, so it is not offered.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .._base.known import known, remember
from .._model.models import EMBEDDED_NAME, PipatchError, _resolve_dtype
from .._programs import PROGRAMS
from ._contract import Capabilities
from ._served_programs import check_versions, encode
from ._vllm_engine import INVOKES_PER_REQUEST, vllm_adapter
from ._vllm_load import build_vllm
from ._vllm_worker import ANSWERS
from ._wire import CLIENT_HEADER, GENERATE_PATH, INFO_PATH, KEY_ENV, SKIP_HEADER
from .vllm import VLLMBackend

__all__ = ["ServedBackend", "connect", "Server"]

#: Requests in flight at once per client: enough for the server to fill an engine step.
CONCURRENCY = 32

#: A study's facts in flight at once: while one fact's request runs on the server, the next
#: ones' are built and sent, and requests of one skip depth share the engine's steps.
FACTS_IN_FLIGHT = 4

#: An answer's load allows pipatch's named tuples (ANSWERS) one load at a time (Server.generate).
_ALLOWING = threading.Lock()


class Server:
    """The HTTP side: one connection pool to one ``pipatch serve`` server."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0,
                 verify: bool | str | os.PathLike = True):
        import httpx

        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise PipatchError(f"serve={url!r} is not a server URL: pass 'http://host:port' (pipatch serve prints it)")
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, float(timeout)
        self._http = httpx.Client(limits=httpx.Limits(max_connections=CONCURRENCY), verify=_tls(verify))
        self._pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="pipatch-serve")
        self._slots = threading.BoundedSemaphore(CONCURRENCY)  # the server's --max-requests-in-flight, once read
        self._id = uuid.uuid4().hex  # who this client is, on a server without keys (its turns)
        self.info: dict[str, Any] = {}

    def _headers(self) -> dict[str, str]:
        from .._compat.nnsight import client_headers

        return {**client_headers(self.api_key), CLIENT_HEADER: self._id}

    def _call(self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        """One HTTP call; every transport failure becomes one line naming the fix."""
        import httpx

        try:
            response = self._http.request(method, self.url + path, headers={**self._headers(), **(headers or {})},
                                          timeout=httpx.Timeout(10.0, read=self.timeout), **kwargs)
        except httpx.TimeoutException:
            raise PipatchError(f"the server at {self.url} did not answer within {self.timeout:g} s: it may be "
                               "busy or stuck; load the model with a larger timeout=, or check the server") from None
        except httpx.TransportError as error:
            if "CERTIFICATE_VERIFY_FAILED" in str(error):
                raise PipatchError(f"the server at {self.url} sent a certificate this client does not trust "
                                   f"({_reason(error)}): pass verify='cert.pem' (the server's certificate or its CA), "
                                   "or verify=False for a test server") from None
            raise PipatchError(f"cannot reach a pipatch server at {self.url} ({type(error).__name__}: {error}): "
                               "start one with `pipatch serve`, or check the URL") from None
        if response.status_code == 401:
            raise PipatchError(f"the server at {self.url} refused the API key: pass api_key= (or set $PIPATCH_API_KEY) "
                               "with a key the server accepts (its --api-key-file)")
        if response.status_code == 404 and path.endswith("/info"):
            raise PipatchError(f"{self.url} is not a pipatch server (no {path}): start it with `pipatch serve`")
        if response.status_code != 200:
            raise PipatchError(f"the server at {self.url} answered {response.status_code}: {_detail(response)}")
        return response

    def describe(self) -> dict[str, Any]:
        """What the server serves (``GET /v1/pipatch/info``)."""
        self.info = self._call("GET", INFO_PATH).json()
        in_flight = int((self.info.get("limits") or {}).get("in_flight") or CONCURRENCY)
        self._slots = threading.BoundedSemaphore(min(CONCURRENCY, in_flight))
        return self.info

    def generate(self, blob: bytes, skip: int = 0) -> dict[str, Any]:
        """Send one program request (:func:`~._served_programs.encode`) whose invokes skip
        ``skip`` blocks; its saved values, each
        invoke's apart (``name@request``, in invoke order: :data:`~pipatch._serving.serve.GENERATE_PATH`);
        a failure in it: one line."""
        from .._compat.nnsight import raise_deferred

        with self._slots:  # no more in flight than the server lets one key have
            response = self._call("POST", GENERATE_PATH, content=blob, headers={SKIP_HEADER: str(skip)})
        # weights_only: tensors, numbers, strings and containers only (what pipatch's invoke
        # bodies save, and nnsight's error dict), and the named tuples pipatch's request bodies
        # answer with (ANSWERS); no other object the server names is ever built.
        # torch's safe_globals adds to one process-wide list and removes on exit: two threads'
        # loads (generate_all) would each remove the other's, so they take turns.
        allowed: list[Any] = [*ANSWERS, *(kind for program in PROGRAMS.values() for kind in program.answers)]
        with _ALLOWING, torch.serialization.safe_globals(allowed):  # for this load only
            answer = torch.load(io.BytesIO(response.content), map_location="cpu", weights_only=True)
        try:
            raise_deferred(answer.get("error"))
        except Exception as error:  # noqa: BLE001 - the server's exception, named in one line
            raise PipatchError(f"the server failed the request: {_reason(error)}") from None
        return answer.get("saves", {})

    def generate_all(self, blobs: list[bytes], skip: int = 0) -> list[dict[str, Any]]:
        """Send ``blobs`` concurrently (each skipping ``skip`` blocks); their saves in order.
        Raises the first failure; an interrupt drops the requests not yet sent."""
        futures = [self._pool.submit(self.generate, blob, skip) for blob in blobs]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def connect(name: Any, url: str, *, api_key: str | None = None, dtype: Any = None, timeout: float = 600.0,
            verify: bool | str | os.PathLike = True) -> Any:
    """A weightless ``VLLM`` client for ``name`` whose experiments run on the server at ``url``.

    Checks first (one line each, before the module tree, which takes a while, is built): the server answers
    (over ``https://``, with a certificate ``verify`` trusts), takes the key (``api_key``, else
    ``$PIPATCH_API_KEY``), runs this pipatch version and program format, serves ``name`` (``None``: the
    embedded model) in ``dtype`` (if given).
    """
    if api_key is None:
        api_key = os.environ.get(KEY_ENV) or None
    server = Server(url, api_key, timeout, verify)
    info = server.describe()
    check_versions(info, server.url)
    want = EMBEDDED_NAME if name is None else str(name)
    if info.get("model") != want:
        hint = "omit the name" if info.get("model") == EMBEDDED_NAME else f"pass {info.get('model')!r}"
        raise PipatchError(f"the server at {server.url} serves {info.get('model')!r}, not {want!r}: {hint}, "
                           "or point serve= at a server for that model")
    served_dtype = _resolve_dtype(info.get("dtype"))
    if dtype is not None and _resolve_dtype(dtype) != served_dtype:
        raise PipatchError(f"the server at {server.url} runs {info.get('dtype')}, not {dtype}: drop dtype= "
                           "(results use the server's), or start a server with --dtype")
    length = {"max_model_len": int(info["max_model_len"])} if info.get("max_model_len") else {}
    model = build_vllm(name, dtype=served_dtype, engine_args=length, dispatch=False)  # the server's config
    # The connection is kept beside the model, as long as the model lives, and closed when it goes.
    remember(model, server=server)
    weakref.finalize(model, server.close)
    ServedBackend(model, server)  # its adapter found (and kept) now: a family pipatch cannot map fails at load
    return model


class ServedBackend(VLLMBackend):
    """The vLLM backend with its invokes sent to a server (see the module docstring)."""

    backend_name = "served"

    def __init__(self, model: Any, server: Server):  # no engine here: not VLLMBackend.__init__
        self.model = model
        self.server = server
        self.adapter = vllm_adapter(model, int(server.info.get("tensor_parallel_size") or 1))

    @property
    def skips_blocks(self) -> bool:  # type: ignore[override]  # the server's to say
        """The server's engine puts several clients' requests into one step, where a skip has
        to cover every one of them: a server that admits one skip at a time says so."""
        return bool(self.server.info.get("skip_rooms"))

    @property
    def capabilities(self) -> Capabilities:
        """The vLLM backend's, and a study's facts in flight (:data:`FACTS_IN_FLIGHT`): while
        one fact's request runs on the server, the next ones' are built and sent."""
        return dataclasses.replace(super().capabilities, plans_in_flight=FACTS_IN_FLIGHT)

    @property
    def dtype(self) -> torch.dtype:
        return _resolve_dtype(self.server.info.get("dtype"))

    @property
    def runs_on(self) -> str:
        return str(self.server.info.get("device") or "cpu")

    @property
    def name(self) -> str:
        return known(self.model).name or str(self.server.info.get("model"))

    @property
    def context_length(self) -> int | None:
        return int(self.server.info.get("max_model_len") or 0) or None

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "server": self.server.url}

    def _run_program(self, program: Any, request: Any) -> Any:
        """The vLLM backend's one path for any program (:meth:`VLLMBackend._run_program`), its
        requests naming the program and carrying its declared inputs: first, one line where the
        server does not run it (a program of your own runs on a server whose operator named
        its module)."""
        theirs = (self.server.info.get("programs") or {}).get(program.name)
        if theirs != program.version:
            runs = f"runs version {theirs} of" if theirs is not None else "does not run"
            raise PipatchError(f"the server at {self.server.url} {runs} the {program.name} program (this client: version "
                               f"{program.version}): start it with `pipatch serve --programs {program.body.__module__}` "
                               "(the module on its PYTHONPATH), or run it on a model in this process")
        return super()._run_program(program, request)

    def _invokes(self, body: Any, jobs: list[tuple[list[int], tuple]], skip: int = 0) -> list:
        """The jobs as program requests of up to :data:`INVOKES_PER_REQUEST` invokes, all sent
        at once (module docstring), each saying how many blocks its invokes skip (the server
        runs it only beside requests that skip as many); what each job's invoke returned, in
        order."""
        self.log.add("requests", invokes=len(jobs), skip=skip)
        limits = self.server.info.get("limits") or {}
        per_request = min(INVOKES_PER_REQUEST, int(limits.get("invokes") or INVOKES_PER_REQUEST))
        parts = [jobs[i : i + per_request] for i in range(0, len(jobs), per_request)]
        fitted = [piece for part in parts for piece in self._fitted(body, part, skip, limits.get("request_bytes"))]
        parts, blobs = [part for part, _ in fitted], [blob for _, blob in fitted]
        outs: list[Any] = []
        for part, saves in zip(parts, self.server.generate_all(blobs, skip)):
            if len(saves) != len(part):
                raise PipatchError(f"the server sent back {len(saves)} values for {len(part)} invokes: it is not "
                                   "a pipatch server of this version; restart it with this pipatch's `pipatch serve`")
            outs += saves.values()
        return outs

    def _fitted(self, body: Any, jobs: list[tuple[list[int], tuple]], skip: int,
                max_bytes: int | None) -> list[tuple[list, bytes]]:
        """``jobs`` (skipping ``skip`` blocks) as ``(jobs, request)`` pairs, each request
        (:func:`~._served_programs.encode`) at most ``max_bytes`` (the server's
        ``--max-request-bytes``): halved until each fits; one invoke over it fails in one line."""
        blob = encode(body, jobs, skip, self.adapter)
        if not max_bytes or len(blob) <= max_bytes:
            return [(jobs, blob)]
        if len(jobs) == 1:
            raise PipatchError(f"one invoke's request is {len(blob):,} bytes, over the server's limit of {max_bytes:,}: "
                               "start the server with a larger --max-request-bytes (a request carries the weights of "
                               "any SAE whose latents it reads or patches)")
        half = len(jobs) // 2
        return self._fitted(body, jobs[:half], skip, max_bytes) + self._fitted(body, jobs[half:], skip, max_bytes)

    def logits(self, hidden: torch.Tensor, token_ids: Sequence[int] | None = None) -> torch.Tensor:
        raise PipatchError("logits of given states need the engine in this process: load the model without serve=")

    def rank_memory(self) -> list[dict[str, Any]]:
        raise PipatchError("the ranks run on the server: read their memory there (pipatch serve's processes)")

    def abort_unfinished(self) -> int:
        return 0  # requests in flight finish on the server; their answers are discarded


def _tls(verify: Any) -> Any:
    """``verify=`` → httpx's: ``True`` (the system's CAs), ``False`` (no check: a test server
    only), or a CA file's path → an SSL context that trusts it."""
    import ssl

    if isinstance(verify, bool):
        return verify
    if not isinstance(verify, (str, os.PathLike)):
        raise PipatchError(f"verify={verify!r}: pass a CA certificate file's path, True (the system's CAs) or False")
    try:
        return ssl.create_default_context(cafile=os.path.expanduser(verify))
    except (OSError, ssl.SSLError) as error:
        raise PipatchError(f"verify={str(verify)!r}: no CA certificate read there ({type(error).__name__}): pass the "
                           "PEM file of the server's certificate or its CA") from None


def _detail(response: Any) -> str:
    """A refusal's one line: the server's ``detail`` (pipatch's and nnsight's JSON errors), else its text."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail or response.text.strip() or response.reason_phrase)[:300]


def _reason(error: BaseException) -> str:
    """The line of a server-side exception that says what went wrong (nnsight's message also
    carries the traceback of the shipped code, whose last lines are source and ``^^^`` marks)."""
    kind = type(error).__name__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if line[0] not in "~^" and ("Error" in line or "error" in line)]
    line = (said or lines or [""])[-1][:200]
    return line if line.startswith(kind) else f"{kind}: {line}"
