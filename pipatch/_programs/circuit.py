"""A circuit's two programs: the edge scores' factors, and the circuit runs.

* **Edge terms** (:data:`EDGE_TERMS`, capability ``gradients``): each sender's write, clean
  minus corrupt, and each receiver's gradient, averaged over ``steps`` points from the
  corrupt input embeddings towards the clean ones (EAP-IG; ``steps=1``: EAP). The math is
  :mod:`._edges`'.
* **Circuit runs** (:data:`CIRCUIT_RUN`, capability ``circuit_runs``): the clean prompt run
  once per mask of edges, each receiver reading the corrupt (or mean) run's value at its place
  plus the writes of its kept senders in this run: the faithfulness curve's points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._cells import Capture, Metric
from ._edges import ReceiverGradients, SenderWrites, circuit_metrics, receiver_gradients, sender_writes
from ._program import Program, register_program

__all__ = ["EDGE_TERMS", "CIRCUIT_RUN", "EdgeTermsRequest", "CircuitRunRequest", "edge_terms", "circuit_runs"]


@dataclass
class EdgeTermsRequest:
    """The two factors of every edge score of one pair: its run inputs, its captures (sites
    ``head`` and ``mlp``) and the interpolation points of EAP-IG."""

    clean_ids: torch.Tensor
    corrupt_ids: torch.Tensor
    metric: Metric
    clean: Capture
    corrupt: Capture
    steps: int


def edge_terms_body(view: Any, request: EdgeTermsRequest) -> tuple[SenderWrites, ReceiverGradients]:
    """Sender writes from the captures, receiver gradients from ``steps`` forward and backward
    passes (:mod:`._edges`), on the view's model (an nnsight model) and its torch modules."""
    adapter, hf, device = view.adapter, view.torch_model, view.device
    embedding = adapter.embedding(hf)
    metric, steps = request.metric, request.steps
    with torch.no_grad():
        e_clean = embedding(metric.inputs(request.clean_ids).to(device))
        e_corrupt = embedding(metric.inputs(request.corrupt_ids).to(device))
    points = [e_corrupt + (k / steps) * (e_clean - e_corrupt) for k in range(steps)]
    return (sender_writes(hf, adapter, request.clean, request.corrupt),
            receiver_gradients(view.model, hf, adapter, metric, points, request.corrupt_ids.to(device)))


EDGE_TERMS = register_program(Program("edge_terms", 1, "gradients", edge_terms_body,
                                      "a circuit's sender writes and receiver gradients (EAP / EAP-IG)"))


@dataclass
class CircuitRunRequest:
    """The clean prompt run as each circuit of ``keep`` ([P, receivers, senders], bool): the
    edges not kept carry the corrupt run's values, or with ``mean_of`` (run input ids of one
    length) their mean over those prompts."""

    clean_ids: torch.Tensor
    corrupt_ids: torch.Tensor
    metric: Metric
    keep: torch.Tensor
    mean_of: Sequence[torch.Tensor] | None = None


def circuit_run_body(view: Any, request: CircuitRunRequest, ablated: dict[str, Any] | None) -> torch.Tensor:
    """The circuit runs of ``request`` on the view's torch modules (:func:`._edges.circuit_metrics`);
    ``ablated``: mean ablation's baseline values. Returns ``[P]``."""
    device = view.device
    return circuit_metrics(view.torch_model, view.adapter, request.metric, request.clean_ids.to(device),
                           request.corrupt_ids.to(device), request.keep, ablated)


CIRCUIT_RUN = register_program(Program("circuit_run", 1, "circuit_runs", circuit_run_body,
                                       "the clean prompt run as circuits: each receiver fed its kept edges"))


def edge_terms(backend: Any, request: EdgeTermsRequest) -> tuple[SenderWrites, ReceiverGradients]:
    """Every edge score's two factors for one pair (:data:`EDGE_TERMS`)."""
    return backend.run(EDGE_TERMS, request)


def circuit_runs(backend: Any, request: CircuitRunRequest) -> torch.Tensor:
    """The metric of each circuit of ``request.keep``, ``[P]`` (:data:`CIRCUIT_RUN`)."""
    return backend.run(CIRCUIT_RUN, request)
