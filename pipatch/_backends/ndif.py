"""The NDIF backend: every run a request through nnsight's own remote path.

``pipatch.load_model(name, remote=True)`` runs each experiment on NDIF, nnsight's remote
service (the largest open models, hosted); ``remote="local"`` runs the same requests through
nnsight's offline simulation of it (``model.trace(..., remote="local")``:
``nnsight/intervention/backends/local.py``), which serialises each request exactly as for
NDIF, rebuilds it with every module but torch, numpy, transformers, accelerate, diffusers,
einops, peft and nnsight hidden, and runs it on the weights in this process. A run that passes
there is what NDIF would be sent, and what it could rebuild.

What is shipped. A request is one trace. For every program that declares its inputs (the
lens, attribution's gradients, a circuit's edge terms and runs, a feature circuit's node
gradients and edge pull-backs, a program of your own) it is the transformers backend's one
trace for programs, sent as it is (:meth:`~.transformers.TransformersBackend._run_program`):
the program's body on the model and the request's data, the program's module shipped by value
too. The capture and the patched runs are pipatch functions of this module
(:func:`_capture_remote`, :func:`_patch_remote`) called on the model and a cell batch's small
data: its ops (a position's donor slice, a seed's noise draw), the family's adapter and the
metric. NDIF has no pipatch installed, so pipatch registers itself with ``nnsight.register``:
the functions and classes a body reaches travel by value (cloudpickle), with the request. What
comes back is what the body returns: the metric per cell (computed on the server from the
logits, so no 262k-wide logits travel), the values recording ops read, a circuit's gradients.

How a sweep runs. One :meth:`NDIFBackend.run` is one request of one batched invoke, the
transformers backend's ``fast=False`` forward (every block, every position): the shortcuts of
the local backend read the base run's cached states and key/value cache *between* traces, which a
remote service does not keep, so the engine gets no hints (:class:`~._contract.Hints`'
defaults). The live grid fills per request, and Stop and Kernel ▸ Interrupt land between
requests. A program's backward pass runs in its request (remote gradients, with the
embedding's leaf set to ``requires_grad`` explicitly, as NDIF asks): attribution's is one
request, a circuit's scores one per interpolation point, a feature circuit's one per pass.

The checks before any request (:func:`check_service`), one line each: no API key
(``NDIF_API_KEY`` or nnsight's config), the service unreachable, a model it does not host,
and version drift that matters (another nnsight, or another Python: the shipped code is
bytecode of this one).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

from .._compat import nnsight as nnsight_compat
from .._model.cells import Base, Capture, Cell, Metric, Op
from .._model.models import Adapter, PipatchError, adapter_for, first
from .._model.sites import RESID, Site
from .._programs.capture import CAPTURE, capture_body
from .._programs.patch import PATCH, PatchRequest, patch_body
from ._contract import Capabilities
from ._hf_views import RowsView
from ._unembedding import Unembedding, unembedding_input
from .transformers import TransformersBackend

__all__ = ["NDIFBackend", "check_service", "REMOTES"]

#: What ``remote=`` takes: NDIF itself, or nnsight's offline simulation of it.
REMOTES = (True, "local")


class NDIFBackend(TransformersBackend):
    """Runs cells as requests through nnsight's remote backend (see the module docstring)."""

    backend_name = "ndif"

    def __init__(self, model: Any, remote: bool | str):  # no dispatch: remote=True holds no weights
        if remote not in REMOTES:
            raise PipatchError(f"remote={remote!r} is not a remote: pass remote=True (NDIF) or "
                               "remote='local' (nnsight's offline simulation of it)")
        self.model = model
        self.adapter = adapter_for(model)
        self.remote = remote
        self.reuse_prefix, self.pack = False, False
        #: Requests sent, and (with :attr:`count_bytes`) their serialised bytes: what the bench prints.
        self.requests, self.bytes_sent, self.count_bytes = 0, 0, False
        _ship_pipatch()

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """Gradients and a circuit's runs (their bodies run in the request, the model's modules
        called through its envoys there), and the work of a position through a block, so the
        engine sizes batches as for the same model in this process: a sweep is as many
        requests as the transformers backend's ``fast=False`` has traces, each the same batch."""
        return Capabilities(gradients=True, circuit_runs=True, position_flops=self.position_flops)

    def _routines(self) -> dict[str, Any]:
        return {CAPTURE.name: self._capture, PATCH.name: self._patch}

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # inputs, noise and donors travel from here

    @property
    def runs_on(self) -> str:
        return "ndif" if self.remote is True else "ndif-local"

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "remote": "ndif" if self.remote is True else "local"}

    # -- runs -------------------------------------------------------------------------------
    def _captured(self, prompts: list[torch.Tensor], metric: Metric, keep: list[Site],
                  runs: list[list[Op]]) -> Capture:
        """One request: run ``i`` is ``prompts[i]`` under ``runs[i]`` (as the transformers
        backend's capture), its block outputs, kept sites, metric and P(answer) sent back."""
        k, T = metric.n_inputs, prompts[0].shape[1]
        batch = torch.cat([metric.inputs(prompt) for prompt in prompts]).cpu()
        blocks, values, score, prob, embedded = self._request(
            batch, _capture_remote, (self.adapter, metric, keep, [[op.compact() for op in run] for run in runs],
                                     len(prompts), T), metric.n_read)
        values[RESID.name] = blocks
        return Capture(blocks=blocks, sites=values, metric=score, embedded=embedded, prob=prob, inputs=k)

    def _patch(self, request: PatchRequest) -> tuple[list[torch.Tensor], list[list[list[torch.Tensor]]]]:
        """Each batch as one request of one batched invoke: every block at every position; with
        ``fast``, only the unembedding rows the metric reads. Returns what the transformers
        backend's patch returns (no ``"states"``: the metric is computed on the service)."""
        return request.each_batch(self._remote_patch, "a remote model computes each batch's metric in its request: "
                                                      "it returns no states")

    def _remote_patch(self, base: Base, cells: list[Cell], metric: Metric, fast: bool,
                      next_logits: bool) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """One batch as one request (:func:`_patch_remote`)."""
        jobs = [[op.compact() for op in base.ops_of(cell.seed) + cell.sorted_ops()] for cell in cells]
        ids = metric.inputs(base.input_ids).repeat(len(cells), 1).cpu()
        out, read = self._request(ids, _patch_remote, (self.adapter, metric, jobs, next_logits, fast), metric.n_read,
                                  keyword=True)
        return out.float(), read

    # -- the requests -------------------------------------------------------------------------
    def _request(self, ids: torch.Tensor, body: Any, args: tuple, n_read: int, *, keyword: bool = False) -> Any:
        """``body(model, *args)`` in one request on the batch ``ids``; what it returned.
        The one place this backend opens a trace but for :meth:`gradients`. The call is the
        transformers backend's, for the same bits: ``keyword``, as its patched runs (``input_ids=``,
        logits at every position), else as its captures (a prompt batch, the last ``n_read``
        positions' logits only)."""
        import nnsight

        model = self.model
        inputs: tuple = () if keyword else (ids,)
        extra = {"input_ids": ids} if keyword else self.adapter.trace_kwargs(n_read)
        with _remote_errors(), torch.no_grad(), model.trace(*inputs, **extra, **self._sent()):
            out = nnsight.save(body(model, *args))
        return out

    def _ship(self, program: Any) -> None:
        """NDIF has only what a request carries: the modules of the program's body and inputs
        travel by value (``nnsight.register``; pipatch's own always do)."""
        import nnsight

        for module in {program.body.__module__, getattr(program.inputs, "__module__", "pipatch")}:
            nnsight.register(module.split(".")[0])

    def _transport_errors(self) -> Any:
        return _remote_errors()

    def _sent(self) -> dict[str, Any]:
        """``model.trace``'s arguments that send the trace as a request (counted; with
        :attr:`count_bytes`, its bytes too, through nnsight's own remote backend)."""
        self.requests += 1
        if not self.count_bytes:
            return {"remote": self.remote}
        return {"backend": _Counted(nnsight_compat.remote_backend(self.model, self.remote), self)}

    def abort_unfinished(self) -> int:
        return 0  # a request in flight finishes on the service; its answer is discarded




class _Counted:
    """An nnsight backend that adds the request's serialised size to the backend's count, then
    hands the trace to nnsight's own backend (the bench's bytes per request)."""

    def __init__(self, inner: Any, backend: NDIFBackend):
        self.inner, self.backend = inner, backend

    def __call__(self, tracer: Any) -> Any:
        from .._compat.nnsight import pull_ndif_env, request_bytes

        pull_ndif_env()
        self.backend.bytes_sent += request_bytes(tracer)
        return self.inner(tracer)


@contextlib.contextmanager
def _remote_errors() -> Iterator[None]:
    """Failures of a request as one :class:`PipatchError` line: the service's own error, an
    unreachable service, a request the simulation could not rebuild without this machine's
    modules (what NDIF would fail)."""
    from .._compat.nnsight import remote_error

    RemoteError = remote_error()

    try:
        yield
    except PipatchError:
        raise
    except RemoteError as error:
        raise PipatchError(f"NDIF failed the request: {_first_line(error)}") from None
    except ModuleNotFoundError as error:
        raise PipatchError(f"the request could not be rebuilt without this machine's modules ({error}): "
                           "code a request runs must come from pipatch, torch or nnsight") from None
    except Exception as error:
        if not (type(error).__module__.startswith("httpx") or isinstance(error, ConnectionError)):
            raise
        raise PipatchError(f"cannot reach NDIF at {_host()} ({type(error).__name__}: {_first_line(error)}): "
                           "check the connection, or NDIF_HOST") from None


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:200]


def _host() -> str:
    from nnsight import CONFIG

    return str(CONFIG.API.HOST)


@functools.cache
def _ship_pipatch() -> None:
    """Have nnsight ship pipatch by value (NDIF has no pipatch installed)."""
    import nnsight

    nnsight.register(__name__.split(".")[0])  # by name: this package and its modules


# --------------------------------------------------------------------------------------------
# The service side
# --------------------------------------------------------------------------------------------


def check_service(name: str) -> None:
    """Before any second is spent on a model: the key, the service, the model, the versions.

    Each failure is one :class:`PipatchError` line naming the fix. The key comes from
    ``NDIF_API_KEY`` or nnsight's config (``nnsight.login``); the host from nnsight's config
    (``NDIF_HOST`` overrides it)."""
    from nnsight import CONFIG, ndif

    key = os.environ.get("NDIF_API_KEY") or CONFIG.API.APIKEY
    if not key:
        raise PipatchError("remote=True needs an NDIF API key: set NDIF_API_KEY (from https://login.ndif.us) or "
                           "run nnsight.login(); or use remote='local' to check the requests offline")
    CONFIG.API.APIKEY = key
    host = os.environ.get("NDIF_HOST")
    if host:
        CONFIG.API.HOST = host
    try:
        status = nnsight_compat.ndif_status()
        remote_env = ndif.get_remote_env(force_refresh=True)
    except PipatchError:
        raise
    except Exception as error:  # noqa: BLE001 - any transport failure is "unreachable", one line
        raise PipatchError(f"cannot reach NDIF at {CONFIG.API.HOST} ({type(error).__name__}): check the "
                           "connection or NDIF_HOST, or use remote='local' to check the requests offline") from None
    hosted = {value.get("repo_id", key) for key, value in (status.get("deployments") or {}).items()
              if value.get("application_state", "RUNNING") == "RUNNING"}
    if name not in hosted:
        raise PipatchError(f"NDIF does not host {name!r} now ({len(hosted)} models are running; print(nnsight."
                           "status()) lists them): pick one of those, or use remote='local' for this model")
    drift = version_drift(ndif.get_local_env(), remote_env)
    if drift:
        raise PipatchError(drift)


def version_drift(local: dict, remote: dict) -> str | None:
    """The one line that says why requests from ``local`` would break on ``remote``, or
    ``None``: another nnsight (its request format), another Python minor version (cloudpickle
    ships bytecode). torch and transformers drift is nnsight's ``compare()`` to show, not a stop."""
    here, there = local.get("packages", {}), remote.get("packages", {})
    if "nnsight" in there and here.get("nnsight") != there["nnsight"]:
        return (f"NDIF runs nnsight {there['nnsight']}, this kernel {here.get('nnsight', '-')}: "
                f"pip install nnsight=={there['nnsight']} (requests are nnsight's own format)")
    mine = str(local.get("python_version", "")).split()[0].split(".")[:2]
    theirs = str(remote.get("python_version", "")).split()[0].split(".")[:2]
    if theirs != [""] and mine != theirs:
        return (f"NDIF runs Python {'.'.join(theirs)}, this kernel {'.'.join(mine)}: pipatch's code travels as "
                "bytecode of this Python; run the kernel on the service's Python version")
    return None


# --------------------------------------------------------------------------------------------
# What runs on the service: module-level functions, shipped by value, on the model and small
# per-batch data. Values are [batch, T, width] there, as in the transformers backend.
# --------------------------------------------------------------------------------------------


class _RemoteView(RowsView):
    """The transformers backend's view on the service, whose blocks' states travel back as
    the first input's hidden states at the prompt's positions (a remote run skips nothing)."""

    def __init__(self, adapter: Adapter, model: Any, rows_per_job: int, prompt: int):
        super().__init__(adapter, model, rows_per_job)
        self.prompt = prompt

    def block_state(self, layer: int) -> Any:
        return first(self.adapter.block(self.model, layer).output)[:: self.n, : self.prompt].clone()


def _capture_remote(model: Any, adapter: Adapter, metric: Metric, keep: list[Site], runs: list[list[Op]], n_runs: int,
                    T: int) -> tuple:
    """The capture program (:func:`~pipatch._programs.capture.capture_body`) as a request's
    body: run ``i`` is rows ``i·k …`` (``k = metric.n_inputs``) under its writes; returns the
    block outputs and kept sites at the prompt's positions ([runs, T, width] per layer), the
    metric and P(answer) per run, and the embedding output."""
    k, m = metric.n_inputs, metric.n_read
    embedded, blocks, values = capture_body(_RemoteView(adapter, model, k, T), runs, keep, T, slice(None, None, k))
    if metric.token_ids is not None:  # a logit difference: two rows of the unembedding
        return blocks, values, _from_states(model, adapter, metric, n_runs), None, embedded
    logits = model.output.logits[:, -m:].float().reshape(n_runs, k, m, -1)
    return blocks, values, metric.score(logits), metric.answer_prob(logits), embedded


def _patch_remote(model: Any, adapter: Adapter, metric: Metric, jobs: list[list[Op]], full_logits: bool,
                  fast: bool) -> tuple:
    """The patch program (:func:`~pipatch._programs.patch.patch_body`) as a request's body:
    cell ``i`` is rows ``i·n …``. Returns the metric per cell (or, ``full_logits``, the logits
    after the prompt per cell) and each cell's reads. With ``fast``, the metric comes from the
    read positions' states and just the unembedding rows it needs, as the transformers
    backend's fast path."""
    n, m = metric.n_inputs, metric.n_read
    reads = patch_body(RowsView(adapter, model, n), jobs)
    if full_logits:
        return model.output.logits[::n, -m].clone(), reads
    if fast:
        return _from_states(model, adapter, metric, len(jobs)), reads
    return metric.score(model.output.logits[:, -m:].reshape(len(jobs), n, m, -1)), reads


def _from_states(model: Any, adapter: Adapter, metric: Metric, runs: int) -> torch.Tensor:
    """Inside a body: the metric of ``runs`` runs from the unembedding's input at the read
    positions, the module itself skipped (:func:`~._unembedding.unembedding_input`)."""
    unembed = adapter.unembedding(model)
    hidden = unembedding_input(unembed, (slice(None), slice(-metric.n_read, None)))
    return Unembedding(unembed, adapter.softcap).metric(metric, hidden.reshape(runs, metric.n_inputs, metric.n_read, -1))
