"""A feature circuit's gradient passes: the metric's gradient at every SAE, and edge pull-backs.

A feature circuit (:mod:`pipatch._experiments.feature_circuit`) scores nodes (an SAE's latent,
or its error, at one position) and edges between the nodes of consecutive SAEs from two kinds
of backward pass over the corrupt prompt, both written here as programs whose bodies run inside
one nnsight trace with gradients (the model's values read and replaced through its envoys, the
backward ``torch.autograd.grad`` on them; no hook on the torch model, no parameter gradient),
so every backend with backward passes runs them — in this process, or on NDIF:

* **node gradients** (:func:`node_gradients`): ``dM/dx`` at the value each SAE writes (a
  block's output; a transcoder's MLP output; :data:`EMBEDDINGS`: the embedding module's
  output), from one forward and one backward. With
  ``steps > 1``, integrated gradients as Marks et al. take them: for each SAE alone, the mean
  of ``dM/dx`` over ``steps`` runs whose latents and error at that SAE are
  ``corrupt + (k / steps)(clean − corrupt)``, ``k = 0 … steps − 1`` (``steps=1`` is
  attribution patching's gradient at the corrupt run), the other SAEs' values free;
* **edge pull-backs** (:func:`edge_pullbacks`): for a chunk of downstream nodes, one batch
  whose row ``r`` belongs to node ``r``: the backward of ``Σ_r w_r · node_r`` (``w_r``: the
  metric's gradient at that node, a number for a latent, a vector for an error) to the value
  the upstream SAE (or :data:`EMBEDDINGS`) writes, row by row, so row ``r`` holds
  ``d (w_r · node_r) / dx_up``. The
  forward stops once the downstream SAE has read its value.

Only metrics read at the last prompt position (a one-token answer and foil) are supported:
the protocol refuses the others in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._model.cells import Metric
from .._model.features.site import InOut
from .._model.models import _get, first
from ._inputs import TokenIds
from ._program import Needs, Program, register_program

__all__ = ["NODE_GRADIENTS", "EDGE_PULLBACKS", "EMBEDDINGS", "NodeGradientsRequest", "EdgePullbacksRequest",
           "NodeGradientsRun", "EdgePullbacksRun", "node_gradients", "edge_pullbacks"]


class _Reached(Exception):
    """Raised from a hook to end a forward once the value wanted has been computed."""


@dataclass(frozen=True)
class _EmbeddingOutput:
    """The embedding module's output as a hook (what block 0 reads)."""

    reads_in: bool = False


@dataclass(frozen=True)
class _Embeddings:
    """The token embeddings as a node gradient's or an edge pull-back's site: its ``writes``
    is the embedding module's output (a feature circuit's embedding nodes)."""

    name: str = "embed"
    writes: _EmbeddingOutput = _EmbeddingOutput()


#: The embeddings, where :func:`node_gradients` and :func:`edge_pullbacks` take a site.
EMBEDDINGS = _Embeddings()


class _Values:
    """The values of hooks (:class:`~pipatch._model.features.hooks.Hook`, or the embedding output) in
    a trace of ``model``, read through their modules' envoys in forward order, each once (two
    sites that read one value share it), and replaced there (:meth:`set`)."""

    def __init__(self, model: Any, adapter: Any):
        self.model, self.adapter, self.seen = model, adapter, {}

    def _envoy(self, hook: Any) -> Any:
        if isinstance(hook, _EmbeddingOutput):
            return self.adapter.embedding(self.model)
        block = self.adapter.block(self.model, hook.layer)
        return _get(block, hook.path) if hook.path else block

    @staticmethod
    def _key(hook: Any) -> tuple:
        return ("embed",) if isinstance(hook, _EmbeddingOutput) else (hook.layer, hook.path, hook.reads_in)

    def __getitem__(self, hook: Any) -> torch.Tensor:
        key = self._key(hook)
        if key not in self.seen:
            envoy = self._envoy(hook)
            self.seen[key] = envoy.input if hook.reads_in else first(envoy.output)
        return self.seen[key]

    def set(self, hook: Any, value: torch.Tensor) -> None:
        """Replace the hook's value with ``value`` where the forward goes on from it."""
        envoy = self._envoy(hook)
        if hook.reads_in:
            envoy.input = value
        else:
            out = envoy.output
            envoy.output = (value, *out[1:]) if isinstance(out, tuple) else value
        self.seen[self._key(hook)] = value


def _score(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """The metric of each row of ``logits`` ([rows, T, vocab]), [rows]."""
    m = metric.n_read
    return metric.score(logits[:, -m:].unsqueeze(1))


@dataclass
class NodeGradientsRequest:
    """The node gradients of the corrupt prompt ([1, T]) at ``sites`` (forward order), by
    integrated gradients over ``steps`` points along ``deltas`` (1: at the corrupt run;
    :func:`node_gradients` runs :data:`NODE_GRADIENTS` for them)."""

    corrupt_ids: torch.Tensor
    metric: Metric
    sites: list[Any]
    steps: int
    deltas: dict[str, torch.Tensor]


@dataclass
class NodeGradientsRun:
    """:data:`NODE_GRADIENTS`' request: one trace of the corrupt prompt, ``ids`` ([1, T]), for
    ``dM/dx`` at each site's written value; or (``delta`` given: ``[1, T, d]``) of ``steps``
    rows of it (``ids`` [steps, T]) for the integrated gradients at ``sites[0]`` alone, row
    ``k``'s value there moved ``k / steps`` of ``delta``."""

    ids: TokenIds
    metric: Metric
    sites: list[Any]
    delta: torch.Tensor | None = None


@dataclass
class EdgePullbacksRequest:
    """One chunk of downstream nodes (``(position, latent or None for the error)``) of
    ``downstream`` with their weights, pulled back to ``upstream``'s written value (the
    corrupt prompt ``corrupt_ids`` [1, T]; :func:`edge_pullbacks` runs :data:`EDGE_PULLBACKS`)."""

    corrupt_ids: torch.Tensor
    upstream: Any
    downstream: Any
    nodes: list[tuple[int, int | None]]
    weights: list[torch.Tensor]


@dataclass
class EdgePullbacksRun:
    """:data:`EDGE_PULLBACKS`' request: the corrupt prompt once per downstream node (``ids``
    [nodes, T]), and the rest of :class:`EdgePullbacksRequest`."""

    ids: TokenIds
    upstream: Any
    downstream: Any
    nodes: list[tuple[int, int | None]]
    weights: list[torch.Tensor]


def node_gradients_body(view: Any, request: NodeGradientsRun) -> tuple[dict[str, torch.Tensor], float]:
    """Inside a trace of the corrupt prompt with gradients: ``dM/dx`` at each site's written
    value, ``{name: [T, d]}`` (float32), and the corrupt run's metric (module docstring); with
    ``delta``, the integrated gradients at ``sites[0]``, averaged over the trace's rows (the
    other SAEs' values free). A transcoder's skip stays live, as in an exact patch of its
    latents. The backward is ``torch.autograd.grad`` on the trace's own values."""
    T, sites, metric = request.ids.shape[1], request.sites, request.metric
    values = _Values(view.model, view.adapter)
    if request.delta is None:
        held = [values[site.writes] for site in sites]
        score = _score(metric, view.model.output.logits)[0]
        grads = torch.autograd.grad(score, held)
        return {s.name: g[0, :T].float() for s, g in zip(sites, grads)}, float(score.detach())
    site, steps = sites[0], request.ids.shape[0]
    live = values[site.writes]
    alphas = torch.arange(steps, dtype=torch.float32).view(-1, 1, 1) / steps
    shift = torch.zeros_like(live)
    shift[:, :T] = alphas.to(live.device, live.dtype) * request.delta.to(live.device, live.dtype)
    point = (live.detach() + shift).requires_grad_(True)
    values.set(site.writes, point)
    scores = _score(metric, view.model.output.logits)
    (grad,) = torch.autograd.grad(scores.sum(), [point])
    return {site.name: grad[:, :T].float().mean(0)}, float(scores[0].detach())


def edge_pullbacks_body(view: Any, request: EdgePullbacksRun) -> torch.Tensor:
    """Inside a trace with gradients of the corrupt prompt once per downstream node: row ``r``,
    ``d (weights[r] · node_r) / dx`` at ``upstream``'s written value, ``[nodes, T, d]``
    (float32), where ``node_r`` is ``downstream``'s latent ``nodes[r][1]`` at position
    ``nodes[r][0]`` (its error there where the latent is ``None``). The body reads no further
    than the downstream SAE's values: the forward stops there (the backend ends a trace where its
    body returns)."""
    nodes, weights, downstream = request.nodes, request.weights, request.downstream
    B, T = len(nodes), request.ids.shape[1]
    values = _Values(view.model, view.adapter)
    up = values[request.upstream.writes]
    read = values[downstream.reads]
    raw = read if downstream.reads == downstream.writes else InOut(read, values[downstream.writes])
    rows = torch.arange(B)
    positions = torch.tensor([p for p, _ in nodes])
    total = read.new_zeros((), dtype=torch.float32)
    latent_rows = [r for r, (_, j) in enumerate(nodes) if j is not None]
    error_rows = [r for r, (_, j) in enumerate(nodes) if j is None]
    if latent_rows:
        latents = downstream.encode(raw)
        picked = latents[rows[latent_rows], positions[latent_rows], [nodes[r][1] for r in latent_rows]]
        w = torch.stack([weights[r] for r in latent_rows]).to(picked.device, picked.dtype)
        total = total + (picked * w).float().sum()
    if error_rows:
        error = downstream.error(raw)
        picked = error[rows[error_rows], positions[error_rows]]
        w = torch.stack([weights[r] for r in error_rows]).to(picked.device, picked.dtype)
        total = total + (picked * w).float().sum()
    (grad,) = torch.autograd.grad(total, [up])
    return grad[:, :T].float()


#: What to do where a backend cannot score a feature circuit: score it elsewhere, check it here.
SCORE_ELSEWHERE = ("score it on backend='transformers' (the default) and check those here, "
                   "pipatch.feature_circuit(..., scores=result)")
#: A feature circuit's gradient passes: one backward each, on the trace's own values.
_GRADIENT_PASSES = Needs(writes=True, backward=True, each_row=False, instead=SCORE_ELSEWHERE)

NODE_GRADIENTS = register_program(Program("node_gradients", 2, _GRADIENT_PASSES, node_gradients_body,
                                          "d metric / d x at each SAE's written value (a feature circuit's nodes)",
                                          inputs=NodeGradientsRun))
EDGE_PULLBACKS = register_program(Program("edge_pullbacks", 2, _GRADIENT_PASSES, edge_pullbacks_body,
                                          "one backward per downstream SAE node, batched (a feature circuit's edges)",
                                          inputs=EdgePullbacksRun))


def node_gradients(backend: Any, request: NodeGradientsRequest) -> tuple[dict[str, torch.Tensor], float]:
    """``dM/dx`` at each site's written value, ``{name: [T, d]}`` (float32, on the CPU), and the
    corrupt run's metric (module docstring): one trace (``steps=1``), else one per site of
    ``steps`` rows. ``deltas[name]`` ([1, T, d]) is how far the site's clean value moves what
    it writes: ``decode(f_clean) − decode(f_corrupt) + e_clean − e_corrupt``."""
    ids, metric, steps = request.corrupt_ids, request.metric, request.steps
    if steps == 1:
        grads, value = backend.run(NODE_GRADIENTS, NodeGradientsRun(ids, metric, list(request.sites)))
        return {name: g.cpu() for name, g in grads.items()}, value
    out, value = {}, float("nan")
    for site in request.sites:
        grads, value = backend.run(NODE_GRADIENTS, NodeGradientsRun(ids.expand(steps, -1), metric, [site],
                                                                    request.deltas[site.name]))
        out[site.name] = grads[site.name].cpu()
    return out, value


def edge_pullbacks(backend: Any, request: EdgePullbacksRequest) -> torch.Tensor:
    """Row ``r``: ``d (weights[r] · node_r) / dx`` at ``upstream``'s written value on the corrupt
    run, ``[len(nodes), T, d]`` (float32, on the CPU): :data:`EDGE_PULLBACKS` in one trace."""
    ids = request.corrupt_ids.expand(len(request.nodes), -1)
    return backend.run(EDGE_PULLBACKS, EdgePullbacksRun(ids, request.upstream, request.downstream, list(request.nodes),
                                                        list(request.weights))).cpu()
