"""The NDIF backend: every run a request through nnsight's own remote path.

``pipatch.load_model(name, remote=True)`` runs each experiment on NDIF, nnsight's remote
service (the largest open models, hosted); ``remote="local"`` runs the same requests through
nnsight's offline simulation of it (``model.trace(..., remote="local")``:
``nnsight/intervention/backends/local.py``), which serialises each request exactly as for
NDIF, rebuilds it with every module but torch, numpy, transformers, accelerate, diffusers,
einops, peft and nnsight hidden, and runs it on the weights in this process. A run that passes
there is what NDIF would be sent, and what it could rebuild.

What is shipped. A request is one trace whose body is a pipatch function of this module
(:func:`_capture_body`, :func:`_run_body`) called on the model and a cell batch's small data:
its ops (a position's donor slice, a seed's noise draw), the family's adapter and the metric.
NDIF has no pipatch installed, so pipatch registers itself with ``nnsight.register``: the
functions and classes a body reaches travel by value (cloudpickle), with the request. What
comes back is what the body returns: the metric per cell (computed on the server from the
logits, so no 262k-wide logits travel), and the values recording ops read.

How a sweep runs. One :meth:`NDIFBackend.run` is one request of one batched invoke, the
transformers backend's ``fast=False`` forward (every block, every position): the shortcuts of
the local backend read the base run's cached states and key/value cache *between* traces, which a
remote service does not keep, so the engine gets no hints (:class:`~._contract.Hints`'
defaults). The live grid fills per request, and Stop and Kernel ▸ Interrupt land between
requests. Attribution's forward and backward are one request too (remote gradients, with the
embedding's leaf set to ``requires_grad`` explicitly, as NDIF asks).

The checks before any request (:func:`check_service`), one line each: no API key
(``NDIF_API_KEY`` or nnsight's config), the service unreachable, a model it does not host,
and version drift that matters (another nnsight, or another Python: the shipped code is
bytecode of this one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric, Op
from .._compat import nnsight as nnsight_compat
from .._models import Adapter, PipatchError, adapter_for, first
from .._sites import EMBED, RESID, Site
from ._contract import Hints
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
    def hints(self) -> NDIFHints:  # type: ignore[override]  # no shortcut: see the module docstring
        return NDIFHints(self)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # inputs, noise and donors travel from here

    @property
    def runs_on(self) -> str:
        return "ndif" if self.remote is True else "ndif-local"

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "remote": "ndif" if self.remote is True else "local"}

    # -- runs -------------------------------------------------------------------------------
    def _capture(self, prompts: list[torch.Tensor], metric: Metric, sites: Sequence[Site] = (), *,
                 ops: list[list[Op]] | None = None) -> Capture:
        """One request: run ``i`` is ``prompts[i]`` under ``ops[i]`` (as the transformers
        backend's capture), its block outputs, kept sites, metric and P(answer) sent back."""
        k, T = metric.n_inputs, prompts[0].shape[1]
        keep = sorted({s for s in sites if not s.is_block_output}, key=lambda s: s.order)
        writes: dict[tuple[str, int], list[tuple[Op, int]]] = {}
        for i, run in enumerate(ops or []):
            for op in sorted(run, key=lambda op: op.key):
                writes.setdefault((op.site.name, op.layer), []).append((_compact(op), i))
        batch = torch.cat([metric.inputs(prompt) for prompt in prompts]).cpu()
        blocks, values, score, prob, embedded = self._request(
            batch, _capture_body, (self.adapter, metric, keep, writes, len(prompts), T), metric.n_read)
        values[RESID.name] = blocks
        return Capture(blocks=blocks, sites=values, metric=score, embedded=embedded, prob=prob, inputs=k)

    def run(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool = True,
            full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """``cells`` as one request of one batched invoke: every block at every position; with
        ``fast``, only the unembedding rows the metric reads. Returns what
        :meth:`TransformersBackend.run` does."""
        if not cells:
            return torch.zeros(0), []
        ops = sorted(((_compact(op), i) for i, cell in enumerate(cells)
                      for op in base.ops_of(cell.seed) + cell.sorted_ops()), key=lambda item: item[0].key)
        batch = metric.inputs(base.input_ids).repeat(len(cells), 1).cpu()
        out, reads = self._request(batch, _run_body, (self.adapter, metric, ops, len(cells), full_logits, fast),
                                   metric.n_read, keyword=True)
        return out.float(), reads

    def run_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric, *,
                 fast: bool = True) -> list[torch.Tensor]:
        return [self.run(base, cells, metric, fast=fast)[0] for cells in batches]

    def gradients(self, input_ids: torch.Tensor, metric: Metric, site: Site):
        """:meth:`TransformersBackend.gradients` as one request: the forward and the backward
        run on the service (the embedding's leaf ``requires_grad`` set explicitly)."""
        import nnsight

        model, adapter = self.model, self.adapter
        T, m = input_ids.shape[1], metric.n_read
        ids = metric.inputs(input_ids).cpu()
        with _remote_errors(), torch.enable_grad(), model.trace(ids, **self._sent(), **adapter.trace_kwargs(m)):
            embedding = adapter.embedding(model)
            leaf = embedding.output.detach().requires_grad_(True)
            embedding.output = leaf
            acts = [site.value(adapter, model, layer) for layer in range(adapter.n_layers)]
            values = nnsight.save([act[:1, :T].detach().clone() for act in acts])
            score = metric.score(model.output.logits[:, -m:].unsqueeze(0))[0]
            value = nnsight.save(score.detach())
            grads = nnsight.save([])
            with score.backward(inputs=[leaf]):
                for act in reversed(acts):
                    grads.append(act.grad[:, :T].sum(0, keepdim=True).detach().clone())
        return list(values), list(reversed(list(grads))), float(value)

    def edge_terms(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric, clean: Capture,
                   corrupt: Capture, steps: int) -> tuple[Any, Any]:
        raise PipatchError("a circuit's edge scores need local backward passes through each receiver, which a remote "
                           "model does not offer: score it on a local model (pipatch.load_model(name)) and check those "
                           "here, pipatch.circuit(..., scores=result)")

    def circuit_metrics(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric,
                        keep: torch.Tensor, mean_of: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        raise PipatchError("a circuit's runs feed each receiver its own input through local hooks, which a remote model "
                           "does not offer: measure the curve on a local model (pipatch.load_model(name)), or pass curve=0")

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

    def _sent(self) -> dict[str, Any]:
        """``model.trace``'s arguments that send the trace as a request (counted; with
        :attr:`count_bytes`, its bytes too, through nnsight's own remote backend)."""
        self.requests += 1
        if not self.count_bytes:
            return {"remote": self.remote}
        return {"backend": _Counted(nnsight_compat.remote_backend(self.model, self.remote), self)}

    def abort_unfinished(self) -> int:
        return 0  # a request in flight finishes on the service; its answer is discarded


class NDIFHints(Hints):
    """No shortcut (each request is a whole forward), but the work of a position through a
    block, so the engine sizes batches as for the same model in this process: a sweep is as
    many requests as the transformers backend's ``fast=False`` has traces, each the same batch."""

    backend: NDIFBackend

    @property
    def position_flops(self) -> int:
        return self.backend.position_flops


class _Counted:
    """An nnsight backend that adds the request's serialised size to the backend's count, then
    hands the trace to nnsight's own backend (the bench's bytes per request)."""

    def __init__(self, inner: Any, backend: NDIFBackend):
        self.inner, self.backend = inner, backend

    def __call__(self, tracer: Any) -> Any:
        from nnsight.ndif import pull_env
        from nnsight.schema.request import RequestModel

        pull_env()
        self.backend.bytes_sent += len(RequestModel.serialize(tracer, compress=False))
        return self.inner(tracer)


@contextlib.contextmanager
def _remote_errors() -> Iterator[None]:
    """Failures of a request as one :class:`PipatchError` line: the service's own error, an
    unreachable service, a request the simulation could not rebuild without this machine's
    modules (what NDIF would fail)."""
    from nnsight.intervention.backends.remote import RemoteError

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


def _compact(op: Op) -> Op:
    """``op`` with its value in storage of its own: a donor slice is a view of its whole run's
    states, and a view pickles with all of its storage."""
    if op.value is None:
        return op
    return dataclasses.replace(op, value=op.value.detach().cpu().clone())


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


def _capture_body(model: Any, adapter: Adapter, metric: Metric, keep: list[Site],
                  writes: dict[tuple[str, int], list[tuple[Op, int]]], n_runs: int, T: int) -> tuple:
    """The transformers backend's capture, as a request's body: run ``i`` is rows ``i·k …``
    (``k = metric.n_inputs``) under its writes; returns the block outputs and kept sites at
    the prompt's positions ([runs, T, width] per layer), the metric and P(answer) per run, and
    the embedding output."""
    k, m = metric.n_inputs, metric.n_read

    def apply(site: Site, layer: int, value: Any) -> None:
        for op, i in writes.get((site.name, layer), ()):
            op.apply(value[i * k : (i + 1) * k])

    written = {op.site for pairs in writes.values() for op, _ in pairs}
    inside = sorted(set(keep) | {s for s in written if not (s.is_embedding or s.is_block_output)},
                    key=lambda s: s.order)
    embedded = EMBED.value(adapter, model, 0)
    apply(EMBED, 0, embedded)
    embedded_copy = embedded[::k, :T].clone()
    blocks: list[torch.Tensor] = []
    values: dict[str, list[torch.Tensor]] = {s.name: [] for s in keep}
    for layer in range(adapter.n_layers):
        for s in inside:
            value = s.value(adapter, model, layer)
            apply(s, layer, value)
            if s in keep:
                values[s.name].append(value[::k, :T].clone())
        out = first(adapter.block(model, layer).output)
        apply(RESID, layer, out)
        blocks.append(out[::k, :T].clone())
    if metric.token_ids is not None:  # a logit difference: two rows of the unembedding
        return blocks, values, _from_states(model, adapter, metric, n_runs), None, embedded_copy
    logits = model.output.logits[:, -m:].float().reshape(n_runs, k, m, -1)
    return blocks, values, metric.score(logits), metric.answer_prob(logits), embedded_copy


def _run_body(model: Any, adapter: Adapter, metric: Metric, ops: list[tuple[Op, int]], n_cells: int,
              full_logits: bool, fast: bool) -> tuple:
    """The transformers backend's forward of a batch of cells, as a request's body: cell ``i``
    is rows ``i·n …``; ``ops`` are ``(op, cell)`` in forward order. Returns the metric per cell
    (or, ``full_logits``, the logits after the prompt per cell) and each cell's reads. With
    ``fast``, the metric comes from the read positions' states and just the unembedding rows
    it needs (:class:`~._unembedding.Unembedding`), as the transformers backend's fast path."""
    n, m = metric.n_inputs, metric.n_read
    values: dict[tuple[str, int], Any] = {}
    reads: list[list[Any]] = [[] for _ in range(n_cells)]
    for op, i in ops:
        key = (op.site.name, op.layer)
        if key not in values:
            values[key] = op.site.value(adapter, model, op.layer)
        read = op.apply(values[key][i * n : (i + 1) * n])
        if read is not None:
            reads[i].append(read)
    if full_logits:
        return model.output.logits[::n, -m].clone(), reads
    if fast:
        return _from_states(model, adapter, metric, n_cells), reads
    return metric.score(model.output.logits[:, -m:].reshape(n_cells, n, m, -1)), reads


def _from_states(model: Any, adapter: Adapter, metric: Metric, runs: int) -> torch.Tensor:
    """Inside a body: the metric of ``runs`` runs from the unembedding's input at the read
    positions, the module itself skipped (:func:`~._unembedding.unembedding_input`)."""
    unembed = adapter.unembedding(model)
    hidden = unembedding_input(unembed, (slice(None), slice(-metric.n_read, None)))
    return Unembedding(unembed, adapter.softcap).metric(metric, hidden.reshape(runs, metric.n_inputs, metric.n_read, -1))
