"""A feature circuit's gradient passes: the metric's gradient at every SAE, and edge pull-backs.

A feature circuit (:mod:`pipatch._experiments.feature_circuit`) scores nodes (an SAE's latent,
or its error, at one position) and edges between the nodes of consecutive SAEs from two kinds
of backward pass over the corrupt prompt, both written here against the torch model under the
nnsight wrapper (forward hooks, removed on the way out; no parameter gradient is taken):

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._model.cells import Metric
from .._model.features.site import InOut
from .._model.models import _get, first
from ._program import Program, register_program

__all__ = ["NODE_GRADIENTS", "EDGE_PULLBACKS", "EMBEDDINGS", "NodeGradientsRequest", "EdgePullbacksRequest", "node_gradients",
           "edge_pullbacks"]


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


def _module(hf: Any, adapter: Any, hook: Any) -> Any:
    if isinstance(hook, _EmbeddingOutput):
        return adapter.embedding(hf)
    block = adapter.block(hf, hook.layer)
    return _get(block, hook.path) if hook.path else block


def _tap(hf: Any, adapter: Any, hook: Any, seen: Callable[[torch.Tensor], torch.Tensor | None]) -> Any:
    """A hook on the module holding ``hook``'s value: ``seen(value)`` reads it and may return
    a replacement. Returns the handle."""
    module = _module(hf, adapter, hook)
    if hook.reads_in:
        def before(mod, args):
            new = seen(args[0])
            return None if new is None else (new, *args[1:])
        return module.register_forward_pre_hook(before)

    def after(mod, args, output):
        new = seen(first(output))
        if new is None:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new
    return module.register_forward_hook(after)


def _run(hf: Any, ids: torch.Tensor, taps: Sequence[tuple[Any, Callable]], adapter: Any, **kwargs: Any) -> Any:
    """The model's output on ``ids`` with ``taps`` ((hook, seen) pairs) in place, or ``None``
    where a tap ended the forward early."""
    handles = [_tap(hf, adapter, hook, seen) for hook, seen in taps]
    try:
        return hf(ids, **kwargs)
    except _Reached:
        return None
    finally:
        for handle in handles:
            handle.remove()


def _score(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """The metric of each row of ``logits`` ([rows, T, vocab]), [rows]."""
    m = metric.n_read
    return metric.score(logits[:, -m:].unsqueeze(1))


@dataclass
class NodeGradientsRequest:
    """The node gradients of the corrupt prompt ([1, T]) at ``sites`` (forward order), by
    integrated gradients over ``steps`` points along ``deltas`` (1: at the corrupt run;
    :func:`node_gradients`)."""

    corrupt_ids: torch.Tensor
    metric: Metric
    sites: list[Any]
    steps: int
    deltas: dict[str, torch.Tensor]


@dataclass
class EdgePullbacksRequest:
    """One chunk of downstream nodes (``(position, latent or None for the error)``) of
    ``downstream`` with their weights, pulled back to ``upstream``'s written value."""

    corrupt_ids: torch.Tensor
    upstream: Any
    downstream: Any
    nodes: list[tuple[int, int | None]]
    weights: list[torch.Tensor]


def node_gradients(hf: Any, adapter: Any, metric: Metric, corrupt_ids: torch.Tensor, sites: Sequence[Any],
                   steps: int, deltas: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """``dM/dx`` at each site's written value, ``{name: [T, d]}`` (float32), and the corrupt
    run's metric (module docstring). ``deltas[name]`` ([1, T, d]) is how far the site's
    clean value moves what it writes: ``decode(f_clean) − decode(f_corrupt) + e_clean −
    e_corrupt`` (a transcoder's skip stays live, as in an exact patch of its latents)."""
    T, last = corrupt_ids.shape[1], adapter.trace_kwargs(metric.n_read)
    if steps == 1:
        held: dict[str, torch.Tensor] = {}

        def hold(site):
            def seen(value):
                held[site.name] = value
            return seen
        with torch.enable_grad():
            out = _run(hf, corrupt_ids, [(site.writes, hold(site)) for site in sites], adapter, **last)
            score = _score(metric, out.logits)[0]
            grads = torch.autograd.grad(score, [held[s.name] for s in sites])
        return {s.name: g[0, :T].float() for s, g in zip(sites, grads)}, float(score.detach())
    alphas = torch.arange(steps, dtype=torch.float32).view(-1, 1, 1) / steps
    out_grads, value = {}, float("nan")
    for site in sites:
        points: list[torch.Tensor] = []

        def step(live, delta=deltas[site.name]):
            shift = torch.zeros_like(live)
            shift[:, :T] = alphas.to(live.device, live.dtype) * delta.to(live.device, live.dtype)
            points.append((live.detach() + shift).requires_grad_(True))
            return points[0]
        with torch.enable_grad():
            out = _run(hf, corrupt_ids.expand(steps, -1), [(site.writes, step)], adapter, **last)
            scores = _score(metric, out.logits)
            (grad,) = torch.autograd.grad(scores.sum(), points)
        out_grads[site.name] = grad[:, :T].float().mean(0)
        value = float(scores[0].detach())
    return out_grads, value


def edge_pullbacks(hf: Any, adapter: Any, corrupt_ids: torch.Tensor, upstream: Any, downstream: Any,
                   nodes: Sequence[tuple[int, int | None]], weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row ``r``: ``d (weights[r] · node_r) / dx`` at ``upstream``'s written value on the corrupt
    run, ``[len(nodes), T, d]`` (float32), where ``node_r`` is ``downstream``'s latent
    ``nodes[r][1]`` at position ``nodes[r][0]`` (its error there where the latent is ``None``)."""
    B, T = len(nodes), corrupt_ids.shape[1]
    held: dict[str, Any] = {}
    same = downstream.reads == downstream.writes

    def at_upstream(value):
        held["up"] = value

    def at_read(value):
        held["read"] = value
        if same:
            raise _Reached

    def at_write(value):
        held["write"] = value
        raise _Reached

    taps = [(upstream.writes, at_upstream), (downstream.reads, at_read)]
    if not same:
        taps.append((downstream.writes, at_write))
    rows = torch.arange(B)
    with torch.enable_grad():
        _run(hf, corrupt_ids.expand(B, -1), taps, adapter)
        read = held["read"]
        raw = read if same else InOut(read, held["write"])
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
        (grad,) = torch.autograd.grad(total, [held["up"]])
    return grad[:, :T].float()


def node_gradients_body(view: Any, request: NodeGradientsRequest) -> tuple[dict[str, torch.Tensor], float]:
    """:func:`node_gradients` on the view's torch model."""
    return node_gradients(view.torch_model, view.adapter, request.metric, request.corrupt_ids.to(view.device),
                          request.sites, request.steps, request.deltas)


def edge_pullbacks_body(view: Any, request: EdgePullbacksRequest) -> torch.Tensor:
    """:func:`edge_pullbacks` on the view's torch model."""
    return edge_pullbacks(view.torch_model, view.adapter, request.corrupt_ids.to(view.device), request.upstream,
                          request.downstream, request.nodes, request.weights)


NODE_GRADIENTS = register_program(Program("node_gradients", 1, "gradients", node_gradients_body,
                                          "d metric / d x at each SAE's written value (a feature circuit's nodes)"))
EDGE_PULLBACKS = register_program(Program("edge_pullbacks", 1, "gradients", edge_pullbacks_body,
                                          "one backward per downstream SAE node, batched (a feature circuit's edges)"))
