"""The gradient pass: one forward with gradient tracking and one backward, on one prompt.

Attribution patching (:mod:`pipatch._experiments.attribution`) estimates a whole patching grid
from ``d metric / d site`` at every layer of the corrupt run. :func:`gradients_body` runs
inside the backend's trace (an nnsight model in this process, or a request to NDIF): the
embedding output is swapped for a detached leaf and the backward is restricted to it
(``inputs=[leaf]``), so autograd walks every activation between the embedding and the metric
but never computes a parameter gradient: no ``.grad`` is left on the model, and a frozen model
(``requires_grad=False``) works too. A base run's ops at the embedding (causal tracing's noise,
:func:`pipatch._experiments.tracing.noise_ops`) are added to the leaf first, so the gradient is
the noised run's. A backend without the capability ``gradients`` (vLLM
runs inference only) refuses it in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._model.cells import Metric, Op
from .._model.sites import Site
from ._inputs import TokenIds
from ._program import Needs, Program, View, register_program

__all__ = ["GRADIENTS", "GradientRequest", "gradients", "gradients_body", "gradients_program"]


def gradients_body(view: View, site: Site, metric: Metric, prompt: int,
                   ops: Sequence[Op] = ()) -> tuple[list[Any], list[Any], Any]:
    """Inside a trace of the run's input: ``(values, grads, metric)``: ``site``'s value per
    layer at the first ``prompt`` positions ([1, T, width], the first input's), ``d metric /
    d holder value`` per layer (a prompt position's gradients from every input of the run added up)
    and the metric, of the run under ``ops`` (writes at the embedding output only: a noised
    run's). nnsight serves ``.grad`` in the reverse of the forward order.

    For a plain site the holder's value is the site's. An encoding site's value is
    ``encode`` of its holder's (an SAE's latents) and its gradient is still the holder's,
    where its writes land: the chain rule through ``decode`` is the caller's
    (:func:`pipatch._experiments._feature_screen.latent_gradient`)."""
    model, adapter, m = view.model, view.adapter, metric.n_read
    embedding = adapter.embedding(model)
    leaf = embedding.output.detach().clone()
    for op in ops:
        op.apply(leaf)
    leaf.requires_grad_(True)
    embedding.output = leaf
    acts = [site.value(adapter, model, layer) for layer in range(adapter.n_layers)]
    values = [site.encode(act[:1, :prompt]).detach().clone() for act in acts]
    score = metric.score(model.output.logits[:, -m:].unsqueeze(0))[0]
    grads = []
    with score.backward(inputs=[leaf]):
        for act in reversed(acts):
            grads.append(act.grad[:, :prompt].sum(0, keepdim=True).detach().clone())
    return values, grads[::-1], score.detach()


@dataclass
class GradientRequest:
    """The gradient pass of the run inputs ``ids`` (the prompt, ``prompt`` positions long, and a
    multi-token answer's continuations, :meth:`~pipatch._model.cells.Metric.inputs`) for ``metric``
    at ``site``, under ``ops`` (writes at the embedding output: a noised run's)."""

    ids: TokenIds
    metric: Metric
    site: Site
    prompt: int
    ops: list[Op] = field(default_factory=list)


def gradients_program(view: View, request: GradientRequest) -> tuple[list[Any], list[Any], Any]:
    """:data:`GRADIENTS`' body: :func:`gradients_body` of the request."""
    return gradients_body(view, request.site, request.metric, request.prompt, request.ops)


GRADIENTS = register_program(Program("gradients", 2, Needs(writes=True, backward=True, each_row=False),
                                     gradients_program, "d metric / d site at every layer: one forward, one backward",
                                     inputs=GradientRequest))


def gradients(backend: Any, input_ids: torch.Tensor, metric: Metric, site: Site,
              ops: Sequence[Op] = ()) -> tuple[list[Any], list[Any], float]:
    """``(values, grads, metric)`` of ``site`` at every layer (:func:`gradients_body`), of the
    run under ``ops`` (none: the plain run), through the backend's one path for programs."""
    request = GradientRequest(metric.inputs(input_ids), metric, site, int(input_ids.shape[1]),
                              [op.compact() for op in ops])
    values, grads, value = backend.run(GRADIENTS, request)
    return list(values), list(grads), float(value)
