"""A circuit's graph, as every view draws it: the state's ``circuit`` part, and its edges.

A circuit result (:mod:`pipatch._experiments.circuits`) is one grid, receivers × senders. Its
view is a graph instead of a heatmap:

* **nodes by layer**: the embeddings at the bottom, each layer's heads and its MLP in a row
  (the MLP at the row's end, a little higher, so a head's edge into its own layer's MLP is
  seen), the logits at the top. A receiver's query, key and value inputs belong to its head's
  node, drawn as three ports on the node's lower side; an MLP's input is its MLP node.
* **edges** from a sender's node to a receiver's port, coloured by their score, the
  estimated change of the metric (``raw_mean`` minus the corrupt baseline: what
  :meth:`~pipatch._results.circuit.CircuitResult.edges` calls ``score``), on the diverging map
  of every grid (:mod:`.colors`), scaled by the largest ``|score|``; the ``top`` edges by
  ``|score|`` are drawn.

:func:`circuit_part` makes the state's ``circuit`` object (``CIRCUIT_SCHEMA`` in
:mod:`.schema`) from the graph's nodes (:mod:`pipatch._model.graph`): the nodes with where they sit
(graph units: ``x`` in [0, 1] across a row, ``y`` the row, 0 = the embeddings), each column's
and row's node, each row's port, the checked edges, the agreement and the faithfulness curve. The browser (``js/circuit.ts``) and the
matplotlib figure (:mod:`.render`) draw from it and from the state's arrays;
:func:`circuit_edges` is the ranking both use (``circuitEdges`` in ``js/circuit.ts``, checked
against this by ``js/__tests__/parity.test.ts``), :func:`graph_document` the JSON export
(:meth:`~pipatch._results.circuit.CircuitResult.graph`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..._model.graph import MLP_DRAWN, Node
from .schema import select_matrix
from .strings import json_safe

__all__ = ["MLP_RAISE", "PORT_SPREAD", "circuit_edges", "circuit_part", "graph_document", "is_circuit"]

#: How much higher than its layer's heads an MLP node sits (rows).
MLP_RAISE = 0.4
#: A head node's ports (q, k, v) spread over this share of its slot's width.
PORT_SPREAD = 0.5

#: How much higher than their row a node kind is drawn.
_RAISED = {MLP_DRAWN: MLP_RAISE}


def is_circuit(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is a circuit's (drawn as a graph, not a heatmap)."""
    return bool((state.get("circuit") or {}).get("nodes"))


def circuit_part(senders: Sequence[Node], receivers: Sequence[Node], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The state's ``circuit`` object for a grid of ``receivers`` (rows) × ``senders`` (columns),
    the graph's nodes (:func:`pipatch._model.graph.named`), and the result's ``meta`` (``checked``,
    ``agreement``, ``faithfulness``)."""
    drawn: dict[str, Node] = {}  # each drawn node by name, with one graph node drawn in it
    for member in [*senders, *receivers]:
        drawn.setdefault(member.drawn_name, member)

    def head(name: str) -> int:
        number = drawn[name].head
        return -1 if number is None else number

    # Rows of the drawing: the embeddings, each layer (heads by number, then the MLP), the logits.
    order = sorted(drawn, key=lambda n: (drawn[n].layer, head(n) < 0, head(n), n))
    rows: dict[int, list[str]] = {}
    for name in order:
        rows.setdefault(drawn[name].layer, []).append(name)
    place: dict[str, tuple[float, float]] = {}
    slot: dict[str, float] = {}
    for layer, in_row in rows.items():
        for i, name in enumerate(in_row):
            place[name] = ((i + 0.5) / len(in_row), layer + 1 + _RAISED.get(drawn[name].drawn, 0.0))
            slot[name] = 1.0 / len(in_row)
    index = {name: i for i, name in enumerate(order)}
    row_nodes = [index[r.drawn_name] for r in receivers]
    inputs: dict[int, list[int]] = {}
    for r, node in enumerate(row_nodes):
        inputs.setdefault(node, []).append(r)
    ports = [0.0] * len(row_nodes)
    for node, members in inputs.items():  # a node's inputs, in row order, spread across its lower side
        for k, r in enumerate(members):
            ports[r] = 0.0 if len(members) == 1 else (k / (len(members) - 1) - 0.5) * PORT_SPREAD * slot[order[node]]
    row_of = {node.name: i for i, node in enumerate(receivers)}
    col_of = {node.name: i for i, node in enumerate(senders)}
    checked = [
        {"row": row_of[c["receiver"]], "col": col_of[c["sender"]], "estimate": c.get("estimate"), "exact": c.get("exact")}
        for c in meta.get("checked") or [] if c.get("receiver") in row_of and c.get("sender") in col_of
    ]
    part: dict[str, Any] = {
        "nodes": [{"name": name, "kind": drawn[name].drawn, "layer": drawn[name].layer,
                   "x": place[name][0], "y": place[name][1]} for name in order],
        "senders": [index[s.drawn_name] for s in senders],
        "receivers": row_nodes,
        "ports": ports,
        "checked": checked,
        "agreement": {k: v for k, v in dict(meta.get("agreement") or {}).items() if isinstance(v, (int, float))},
    }
    faithful = meta.get("faithfulness")
    if isinstance(faithful, Mapping) and faithful.get("sizes") is not None:
        part["faithfulness"] = {k: faithful[k] for k in ("sizes", "recovery", "share", "size", "edges") if k in faithful}
    return part


def circuit_edges(state: Mapping[str, Any], top: int | None = None) -> list[dict[str, Any]]:
    """The edges of a circuit state, largest ``|score|`` first (ties: row-major order), at most
    ``top`` of them: ``row``, ``col`` (the grid cell), ``score`` (estimated change of the metric),
    ``recovery`` (the same as normalized recovery) and ``exact`` (the exact edge patch's change,
    ``None`` where not checked). As ``circuitEdges`` in ``js/circuit.ts``."""
    view = (list(state.get("views") or []) or [""])[0]
    raw = select_matrix(state, view, -1, "raw")
    if raw is None:
        return []
    rec = select_matrix(state, view, -1, "recovery")
    corrupt = (state.get("baselines") or {}).get("corrupt")
    score = raw.astype(np.float64) - (float(corrupt) if corrupt is not None else 0.0)
    flat = score.ravel()
    finite = np.flatnonzero(np.isfinite(flat))
    order = finite[np.argsort(-np.abs(flat[finite]), kind="stable")]
    if top is not None:
        order = order[: max(0, int(top))]
    exact = {(c["row"], c["col"]): c.get("exact") for c in (state.get("circuit") or {}).get("checked") or []}
    cols = score.shape[1]
    out = []
    for i in order.tolist():
        row, col = divmod(i, cols)
        value = float(rec.ravel()[i]) if rec is not None else math.nan
        out.append({"row": row, "col": col, "score": float(flat[i]), "recovery": value if math.isfinite(value) else None,
                    "exact": exact.get((row, col))})
    return out


def graph_document(state: Mapping[str, Any], top: int | None = None) -> dict[str, Any]:
    """The graph as plain JSON (:meth:`~pipatch._results.circuit.CircuitResult.graph`): the
    nodes (``name``, ``kind``, ``layer``, drawing position ``x``, ``y``) and the ``top`` edges by
    ``|score|`` (all with ``None``), each ``sender``, ``receiver``, ``score``, ``recovery``,
    ``exact``; plus the title, model, metric, the checks' agreement and the faithfulness curve
    where there is one."""
    part = state.get("circuit") or {}
    rows = [str(x) for x in state.get("row_labels") or []]
    cols = [str(x) for x in state.get("col_labels") or []]
    edges = [{"sender": cols[e["col"]], "receiver": rows[e["row"]],
              **{k: e[k] for k in ("score", "recovery", "exact")}} for e in circuit_edges(state, top)]
    doc = {
        "title": state.get("title", ""), "model": state.get("model_name", ""), "metric": state.get("metric", ""),
        "baselines": dict(state.get("baselines") or {}),
        "nodes": [dict(node) for node in part.get("nodes") or []],
        "edges": edges,
        "agreement": dict(part.get("agreement") or {}),
    }
    if part.get("faithfulness"):
        doc["faithfulness"] = dict(part["faithfulness"])
    return json_safe(doc)
