"""A circuit's result: one grid of edges, read as the graph it is.

:func:`pipatch.circuit` (:mod:`pipatch._experiments.circuits`) returns a :class:`CircuitResult`:
a :class:`~pipatch.Result` whose one grid ``raw["edges"]`` is receivers × senders, whose rows
and columns are the graph's node names (:mod:`pipatch._model.graph`), and which adds what only a
circuit has: its table of edges (:meth:`CircuitResult.edges`), its graph as JSON
(:meth:`CircuitResult.graph`) and the view state's ``circuit`` part, from which every view draws
the graph instead of a heatmap.

Its file is any result's (:meth:`~pipatch.Result.save`), ``kind`` ``"circuit"``:
:func:`~pipatch.load_result` reads a circuit's file, written by this pipatch or an earlier one,
back as a :class:`CircuitResult` (the ``file_kind`` hook of :class:`~pipatch.Result`).
"""

from __future__ import annotations

import math
from typing import Any

from .._base.tables import table
from .._model.graph import Node, named
from .result import Result
from .views import circuit_part, conform_state, graph_document

__all__ = ["CircuitResult", "LOW_AGREEMENT", "VIEW_EDGES", "low_agreement_advice"]

#: A circuit's one grid: receivers × senders.
VIEW_EDGES = "edges"


class CircuitResult(Result, file_kind="circuit"):
    """A circuit (``kind="circuit"``): ``raw["edges"]`` [1, receivers, senders] holds
    ``corrupt metric + estimated change`` of every edge (NaN where no edge exists), ``layers``
    the receivers' names and ``columns`` the senders'. See :mod:`pipatch._experiments.circuits`
    for the scores, ``meta["checked"]`` (the exact edge patches) and ``meta["faithfulness"]``.
    """

    @property
    def nodes(self) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
        """``(senders, receivers)``: the graph's nodes (:class:`pipatch._model.graph.Node`) of the
        columns and rows. Raises :class:`~pipatch.PipatchError` where they are no graph's."""
        return named(self.columns, self.layers)

    def edges(self):
        """The edges, one row each, largest ``|score|`` first: ``sender``, ``receiver``,
        ``score`` (the estimated change of the metric when that edge alone carries the clean
        value, in the metric's units; a dataset's mean over pairs) and ``exact`` (the exact edge
        patch's change; NaN where not checked). A pandas DataFrame."""
        change = (self.raw[VIEW_EDGES][0] - self.corrupt).double()
        exact = {(c["sender"], c["receiver"]): c["exact"] for c in self.meta.get("checked", [])}
        rows = [{"sender": sender, "receiver": receiver, "score": float(change[r, s]),
                 "exact": float("nan") if exact.get((sender, receiver)) is None else float(exact[(sender, receiver)])}
                for r, receiver in enumerate(self.layers) for s, sender in enumerate(self.columns)
                if not math.isnan(float(change[r, s]))]
        edges = table(rows, columns=["sender", "receiver", "score", "exact"])
        return edges.reindex(edges["score"].abs().sort_values(ascending=False, kind="stable").index).reset_index(drop=True)

    def frame(self):
        """A circuit's table is its edges: :meth:`edges`."""
        return self.edges()

    def __repr__(self) -> str:
        edges = int((~self.raw[VIEW_EDGES][0].isnan()).sum())
        pairs = int(self.meta.get("n_pairs") or 1)
        return (f"<pipatch.CircuitResult {self.status}: {edges} edges, {len(self.columns)} senders × "
                f"{len(self.layers)} receivers, metric {self.metric}, clean {self.clean_value:.4g}, "
                f"corrupt {self.corrupt_value:.4g}" + (f", {pairs} pairs" if pairs > 1 else "") + ">")

    def graph(self, top: int | None = None) -> dict[str, Any]:
        """The graph as plain JSON (``json.dumps`` writes it as it is): ``nodes`` (``name``,
        ``kind``: emb / head / mlp / logits, ``layer``, drawing position ``x``, ``y``) and ``edges``,
        largest ``|score|`` first, at most ``top`` (``None``: every edge), each ``sender``,
        ``receiver``, ``score`` (estimated change of the metric, as in :meth:`edges`),
        ``recovery`` (the same, normalized) and ``exact`` (the exact edge patch's change, ``None``
        where not checked); plus ``title``, ``model``, ``metric``, ``baselines``, ``agreement``
        and ``faithfulness`` (where the result has a curve)."""
        return graph_document(self.to_state(live=True), top)

    def to_state(self, *, live: bool = False) -> dict[str, Any]:
        """Any result's view state (:meth:`pipatch.Result.to_state`), its ``circuit`` part the
        graph: the nodes and where they sit, each column's and row's node, the checked edges,
        their agreement and the faithfulness curve (:func:`pipatch._results.views.circuit_part`)."""
        state = super().to_state(live=live)
        senders, receivers = self.nodes
        state["circuit"] = conform_state({"circuit": circuit_part(senders, receivers, self.meta)})["circuit"]
        return state


#: Below this rank correlation between the checked edges' estimates and their exact patches, a
#: circuit says what to try. The estimate ranks every edge and the circuit keeps the top ones by
#: it, so a correlation this low means the ranking, hence the circuit, is partly wrong (EAP on
#: IOI pairs: 0.67, an edge's sign flipped); above it the order of the top edges mostly holds.
LOW_AGREEMENT = 0.8


def low_agreement_advice(meta: dict[str, Any]) -> str | None:
    """The one line a circuit whose estimates agree poorly with their exact patches
    (``meta["agreement"]``'s Spearman below :data:`LOW_AGREEMENT`) carries: what to try, by
    the method it was scored with; ``None`` where they agree."""
    agreement = meta.get("agreement") or {}
    rho = agreement.get("spearman")
    if rho is None or not rho < LOW_AGREEMENT:
        return None
    n, steps = int(agreement.get("n", 0)), int(meta.get("steps", 1))
    flipped = sum(1 for e in meta.get("checked", []) if e["exact"] is not None and e["estimate"] * e["exact"] < 0)
    said = f"; {flipped} with the wrong sign" if flipped else ""
    better = ("method='eap-ig' (gradients averaged between corrupt and clean)" if meta.get("method") == "eap"
              else f"more steps (steps={2 * steps})")
    return (f"the edge estimates agree poorly with the {n} exact patches (rank correlation {rho:.2f} < "
            f"{LOW_AGREEMENT}{said}), so the circuit's ranking is unreliable: try {better}, or verify={2 * n} "
            "to check more edges")
