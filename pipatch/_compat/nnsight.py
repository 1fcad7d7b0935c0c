"""nnsight's internals that pipatch uses, each behind one function.

Checked on nnsight 0.8.1 (the version ``pyproject.toml`` pins; :data:`pipatch._compat.TESTED`).
What pipatch needs of nnsight beyond its public API, and why:

* the torch module behind an envoy (:func:`torch_module`): weights, devices, configs and
  the engine's own heads are the module's, not the envoy's;
* naming a model's envoy tree by a persistent id instead of pickling it into every invoke
  (:func:`persistent_id`, :func:`name_worker_tree`, :func:`serve_tree_by_reference`);
* the server of ``nnsight-serve``, which ``pipatch serve`` extends (:func:`fresh_sources_per_request`,
  :func:`served_model`, :func:`prepare_request`, :func:`clear_invoke_scope`, :func:`answer`,
  :func:`vllm_engine_args`);
* the worker class a ``VLLM`` model's engine runs (:func:`worker_class`);
* NDIF's status and nnsight's remote backend itself (:func:`ndif_status`, :func:`remote_backend`);
* nnsight's internal modules (no private name, but no public path either): NDIF's environment
  and a request's size (:func:`pull_ndif_env`, :func:`request_bytes`, :func:`remote_error`),
  a served answer's error (:func:`raise_deferred`, :func:`capture_exception`), the
  ``nnsight-serve`` server and client (:func:`serve_server`, :func:`client_headers`,
  :func:`merge_collected`), and the vLLM worker classes (:func:`vllm_worker_classes`).

Every function raises :class:`~pipatch._base.errors.PipatchError` in one line where its name is
missing (:func:`pipatch._compat.missing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import missing

__all__ = ["PRIVATE_NAMES", "torch_module", "persistent_id", "name_worker_tree", "serve_tree_by_reference",
           "fresh_sources_per_request", "check_server", "served_model", "prepare_request", "clear_invoke_scope", "answer",
           "vllm_engine_args", "worker_class", "ndif_status", "remote_backend", "PUBLIC_MODULES", "pull_ndif_env",
           "request_bytes", "remote_error", "raise_deferred", "capture_exception", "merge_collected", "serve_server",
           "client_headers", "vllm_worker_classes"]

#: nnsight's private names used here and nowhere else in pipatch (``tests/unit/test_compat.py``).
PRIVATE_NAMES = (
    "_module", "_persistent_id", "nnsight_persistent_objects", "_persistent_objects", "_build_tracer",
    "SOURCES", "BLOCKS", "clear_shared_locals", "_ready", "_attach_mediators", "_payload",
    "_parse_vllm_args", "_WORKER_CLS", "_remote_backend", "_get",
)

#: The modules of nnsight pipatch imports outside this file; any other (an internal module
#: such as ``nnsight.schema.request``) is reached through a function here
#: (``tests/unit/test_compat.py``).
PUBLIC_MODULES = ("nnsight", "nnsight.modeling.vllm")


def _need(owner: Any, name: str, where: str) -> Any:
    """``owner.name``, or the one-line error naming ``where.name`` and the versions."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing("nnsight", f"{where}.{name}") from None


# --------------------------------------------------------------------------------------------
# Envoys
# --------------------------------------------------------------------------------------------


def torch_module(envoy: Any) -> Any:
    """The torch module an nnsight envoy wraps (a model's or any of its modules'); a plain
    torch module, or anything that is no envoy, as is.

    Private name: ``Envoy._module`` (the attribute the envoy keeps its module in). pipatch
    reads through it what the envoy does not pass on while no trace runs: parameters (device,
    dtype, counts), the transformers config and forward signature, vLLM's ``compute_logits``
    and ``quant_method`` inside a worker's invoke. Read from the instance's ``__dict__`` (as
    nnsight's own ``Envoy.__getattr__`` does), so it never falls through to the module.
    """
    import torch

    if isinstance(envoy, torch.nn.Module):
        return envoy
    module = getattr(envoy, "__dict__", {}).get("_module")
    if module is not None:
        return module
    from nnsight.intervention.envoy import Envoy

    if isinstance(envoy, Envoy):
        raise missing("nnsight", "Envoy._module")
    return envoy


# --------------------------------------------------------------------------------------------
# Persistent ids: the envoy tree by name
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def persistent_id(obj: Any, pid: str) -> Iterator[None]:
    """Within this block, nnsight's pickler names ``obj`` by ``pid`` instead of carrying it.

    Private name: ``_persistent_id`` in an object's ``__dict__``, which nnsight's request
    pickler (``nnsight.intervention.serialization``) writes as a reference; the unpickling
    side resolves it among its persistent objects (:func:`name_worker_tree`,
    :func:`serve_tree_by_reference`). pipatch tags the user's model for the length of its own
    trace's build only: the tag, and any tag that was there before, is as it was after.
    """
    state = obj.__dict__
    before = state.get("_persistent_id", _NONE)
    state["_persistent_id"] = pid
    try:
        yield
    finally:
        if before is _NONE:
            state.pop("_persistent_id", None)
        else:
            state["_persistent_id"] = before


_NONE = object()


def name_worker_tree(runner: Any, pid: str) -> None:
    """Name a vLLM worker's nnsight model tree ``pid`` among the objects its requests are
    unpickled with (run on the worker).

    Private names: the runner's ``nnsight_persistent_objects`` (the table) and
    ``nnsight_model`` (its envoy tree), attributes of nnsight's ``NNsightGPUModelRunner``.
    A request that names the tree (:func:`persistent_id`) then finds this worker's own, where
    carrying it costs 264 pickled envoys an invoke (Gemma 3 270M)."""
    table = _need(runner, "nnsight_persistent_objects", "NNsightGPUModelRunner")
    table[pid] = _need(runner, "nnsight_model", "NNsightGPUModelRunner")


@contextlib.contextmanager
def serve_tree_by_reference(server: Any, model: Any, pid: str) -> Iterator[None]:
    """While the server runs, ``pid`` names ``model`` (the server's own, built by ``pipatch
    serve``) in the requests it unpickles, and ``model`` goes on to the engine by that name.

    Private names: ``nnsight.modeling.vllm.serve.server._persistent_objects`` (the table
    ``set_model`` fills, which ``_build_tracer`` unpickles requests with) and the model's
    ``_persistent_id`` (:func:`persistent_id`). Both are undone when the block ends."""
    table = _need(server, "_persistent_objects", "nnsight.modeling.vllm.serve.server")
    if table is None:
        raise missing("nnsight", "serve.server._persistent_objects (set by set_model)")
    table[pid] = model
    try:
        with persistent_id(model, pid):
            yield
    finally:
        table.pop(pid, None)


# --------------------------------------------------------------------------------------------
# nnsight's server (pipatch serve)
# --------------------------------------------------------------------------------------------


def check_server(server: Any) -> None:
    """Before ``pipatch serve`` accepts a request: every private name of nnsight's server that
    it calls per request is there (else one line, at start)."""
    for name in ("_build_tracer", "_ready", "_payload", "_persistent_objects"):
        _need(server, name, "nnsight.modeling.vllm.serve.server")


@contextlib.contextmanager
def fresh_sources_per_request(server: Any) -> Iterator[None]:
    """While the server runs, nnsight's source memos and the last request's shared invoke
    scope are dropped before each request is built; put back as they were when it ends.

    Private names: ``server._build_tracer`` (replaced for the block by one that clears
    first), ``nnsight.tracing.globals.SOURCES`` / ``BLOCKS`` (the per-file source and
    ``with``-block memos) and ``nnsight.intervention.util.clear_shared_locals``.

    Why: nnsight memoizes each traced file's source by file name, and the server registers
    each request's shipped source under the *client's* file name, so a second, different
    trace from one client file was parsed against the first one's source
    (``WithBlockNotFoundError``). And a multi-invoke trace registers its frame in the
    thread-local shared scope, which ``execute`` clears at a trace's end; the server calls
    only ``prepare``, so every request's frame (its body, its rebuilt tracer) stayed alive.
    Builds run one at a time (no ``await`` inside), so clearing before each is safe.
    """
    build = _need(server, "_build_tracer", "nnsight.modeling.vllm.serve.server")
    try:
        from nnsight.intervention.util import clear_shared_locals
        from nnsight.tracing import globals as memos
    except ImportError as error:
        raise missing("nnsight", f"{error.name}.clear_shared_locals") from None
    sources, blocks = _need(memos, "SOURCES", "nnsight.tracing.globals"), _need(memos, "BLOCKS", "nnsight.tracing.globals")

    def build_fresh(body: bytes, compress: bool) -> Any:
        sources.clear()
        blocks.clear()
        clear_shared_locals()
        return build(body, compress)

    server._build_tracer = build_fresh
    try:
        yield
    finally:
        server._build_tracer = build


def served_model(server: Any) -> Any:
    """The server's dispatched model, or the HTTP 503 nnsight's routes answer before it is
    ready. Private name: ``server._ready``."""
    return server._ready()


def prepare_request(model: Any, tracer: Any) -> tuple[list, list, list | None]:
    """The engine requests of a trace built on ``model`` (the server's own, by ``pipatch
    serve`` from a program by name), prepared without running a forward and with their
    workers attached; returns ``(prompts, params, loras)``, one per invoke. Raises what the
    build raised.

    Private name: ``VLLM._attach_mediators`` (the steps of nnsight's own async backend and
    ``/v1/nnsight/generate``); the tracer's ``prepare`` and ``info.code`` and the model's
    ``interleaver``, whose workers ride the engine requests after this (or the build failed),
    so it is cancelled either way."""
    try:
        _, (prompts, params, loras), kwargs = tracer.prepare(tracer.info.code)
        _need(model, "_attach_mediators", "VLLM")(params, **kwargs)
    finally:
        model.interleaver.cancel()
    return prompts, params, loras


def clear_invoke_scope() -> None:
    """Drop this thread's shared invoke scope before a trace is built and only prepared
    (:func:`prepare_request`): nnsight clears it when a trace *executes*, so without this every
    prepared trace's frame (its body, its arguments) stayed alive. Private name:
    ``nnsight.intervention.util.clear_shared_locals``."""
    try:
        from nnsight.intervention.util import clear_shared_locals
    except ImportError:
        raise missing("nnsight", "intervention.util.clear_shared_locals") from None
    clear_shared_locals()


def answer(server: Any, saves: dict[str, Any], error: Any) -> Any:
    """The HTTP answer nnsight's routes send: ``torch.save`` of the saves and the deferred
    error (what the client's ``raise_deferred`` reads). Private name: ``server._payload``."""
    return server._payload(saves, error)


def vllm_engine_args(words: list[str]) -> dict[str, Any]:
    """``--flag value`` words → vLLM engine keywords, parsed as ``nnsight-serve`` parses them.
    Private name: ``nnsight.modeling.vllm.serve.cli._parse_vllm_args``."""
    from nnsight.modeling.vllm.serve import cli

    return _need(cli, "_parse_vllm_args", "nnsight.modeling.vllm.serve.cli")(words)


# --------------------------------------------------------------------------------------------
# Building a VLLM model; NDIF
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def worker_class(vllm_cls: Any, name: str | None) -> Iterator[None]:
    """Within this block, ``VLLM`` models build their engine with the worker class ``name``
    (a dotted path; ``None``: nnsight's own); put back after it.

    Private name: ``VLLM._WORKER_CLS``, the class attribute nnsight hands vLLM as
    ``worker_cls``. On a machine without CUDA pipatch names its CPU worker there
    (:mod:`pipatch._backends._vllm_cpu_worker`) for the one model it builds."""
    before = _need(vllm_cls, "_WORKER_CLS", "VLLM")
    if name is not None:
        vllm_cls._WORKER_CLS = name
    try:
        yield
    finally:
        vllm_cls._WORKER_CLS = before


def ndif_status() -> dict[str, Any]:
    """NDIF's ``/status`` (the models it hosts now), through nnsight's own HTTP call and
    config (host, key). Private name: ``nnsight.ndif._get``."""
    from nnsight import ndif

    return _need(ndif, "_get", "nnsight.ndif")("/status")


def remote_backend(model: Any, remote: bool | str) -> Any:
    """nnsight's backend for a remote trace of ``model`` (``remote``: ``True`` for NDIF,
    ``"local"`` for its offline simulation), blocking and quiet, as ``model.trace(remote=...)``
    builds it. Private name: ``RemoteableMixin._remote_backend``; pipatch wraps it to count
    a request's serialized bytes (the NDIF bench)."""
    return _need(model, "_remote_backend", "RemoteableMixin")(remote, True, None, False)


# --------------------------------------------------------------------------------------------
# nnsight's internal modules: no private name, but below its public API (``nnsight``,
# ``nnsight.modeling.vllm``), where a release may move them
# --------------------------------------------------------------------------------------------


def pull_ndif_env() -> None:
    """Register this process's local (not installed) modules for pickling by value, once, as
    a remote trace does before it sends. Internal module: ``nnsight.ndif.pull_env``."""
    from nnsight.ndif import pull_env

    pull_env()


def request_bytes(tracer: Any) -> int:
    """How many bytes nnsight's remote backend sends for ``tracer``'s request, uncompressed
    (the NDIF bench counts them). Internal module: ``nnsight.schema.request.RequestModel``."""
    from nnsight.schema.request import RequestModel

    return len(RequestModel.serialize(tracer, compress=False))


def remote_error() -> type[Exception]:
    """The exception nnsight's remote backend raises for a request the service (or its
    offline simulation) failed. Internal module: ``nnsight.intervention.backends.remote``."""
    from nnsight.intervention.backends.remote import RemoteError

    return RemoteError


def raise_deferred(error: Any) -> None:
    """Raise the error an ``nnsight-serve`` answer carries, as nnsight's own client does
    (``None``, or a stop: nothing). Internal module: ``nnsight.intervention.errors.raise_deferred``."""
    from nnsight.intervention.errors import raise_deferred as raise_it

    raise_it(error)


def capture_exception(exception: BaseException) -> Any:
    """``exception`` as an ``nnsight-serve`` answer carries it (what :func:`raise_deferred`
    raises on the client). Internal module: ``nnsight.intervention.errors.capture_exception``."""
    from nnsight.intervention.errors import capture_exception as capture

    return capture(exception)


def merge_collected(collected: Any) -> Any:
    """What each rank of an async engine returned from ``collect_nnsight``, merged into one
    mapping, as nnsight's async engine merges it. Internal module:
    ``nnsight.modeling.vllm.engines.engine.merge_collected``."""
    from nnsight.modeling.vllm.engines.engine import merge_collected as merge

    return merge(collected)


def serve_server() -> Any:
    """The module of ``nnsight-serve``'s server (its FastAPI ``app``, ``set_model``), which
    ``pipatch serve`` extends. Internal module: ``nnsight.modeling.vllm.serve.server``."""
    from nnsight.modeling.vllm.serve import server

    return server


def client_headers(api_key: str | None) -> dict[str, str]:
    """The headers an ``nnsight-serve`` client sends (its key among them). Internal module:
    ``nnsight.modeling.vllm.serve.http.headers``."""
    from nnsight.modeling.vllm.serve import http

    return dict(http.headers(api_key))


def vllm_worker_classes() -> tuple[Any, Any]:
    """nnsight's vLLM worker and model runner, ``(NNsightGPUWorker, NNsightGPUModelRunner)``,
    which pipatch's CPU worker (:mod:`pipatch._backends._vllm_cpu_worker`) mixes over vLLM's
    CPU ones. Internal modules: ``nnsight.modeling.vllm.workers.GPUWorker``,
    ``nnsight.modeling.vllm.model_runners.GPUModelRunner``."""
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
    from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

    return NNsightGPUWorker, NNsightGPUModelRunner
