"""A feature circuit's result: its nodes and edges as tables, its file, its repr and its plot.

:func:`pipatch.feature_circuit` (:mod:`pipatch._protocols.feature_circuit`) returns a
:class:`FeatureCircuitResult`. Its one grid ``raw["nodes"]`` ([1, SAEs, positions]) holds, per
SAE and position, ``corrupt metric +`` the sum of that place's node scores (its latents' and
its error's): attribution patching's estimate for the whole value the SAE reads there, so the
grid reads as normalized recovery like a patching grid. The graph itself is in ``meta``:
``meta["nodes"]`` (one dict per node: ``node``, ``site``, ``layer``, ``position``, ``latent``
(an id, ``"error"``, ``"embed"`` or ``"metric"``), ``score``, ``exact`` (``None`` where not checked),
``circuit`` (kept by the pruning)) and ``meta["edges"]`` (``upstream``, ``downstream``,
``score``), so the result saves and loads as any result does (safetensors + JSON, no pickle).
"""

from __future__ import annotations

import math
from typing import Any

from .._result import Result
from .._tables import table

__all__ = ["FeatureCircuitResult", "VIEW_NODES", "METRIC_NODE", "EMBED_NODE"]

#: A feature circuit's one grid: SAEs × positions.
VIEW_NODES = "nodes"
#: The name of the metric's node.
METRIC_NODE = "metric"
#: The ``site`` and ``latent`` of an embedding node (one per position).
EMBED_NODE = "embed"

_NODE_COLUMNS = ["node", "site", "layer", "position", "latent", "score", "exact", "circuit"]


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


class FeatureCircuitResult(Result, file_kind="feature_circuit"):
    """A feature circuit (``kind="feature_circuit"``; module docstring)."""

    def nodes(self):
        """One row per node, largest ``|score|`` first (the metric's node first): ``node``
        (its name, ``"L1 resid_post #12 @3"``), ``site``, ``layer``, ``position``, ``latent`` (the
        latent's id, ``"error"``, ``"embed"`` (the token embedding at that position: ``site``
        ``"embed"``, ``layer`` −1) or ``"metric"``), ``score`` (the estimated change of the metric
        when that node alone takes its clean value in the corrupt run; on one prompt, its direct
        attribution relative to zero), ``exact`` (the exact patch's change, on one prompt
        ``M(prompt) − M(node zeroed)``; NaN where not checked) and ``circuit`` (kept by the
        pruning). A dataset's ``position`` is a named position and each row has ``pairs``
        (how many pairs have it). A pandas DataFrame."""
        rows = [{**node, "score": _number(node["score"]), "exact": _number(node["exact"])}
                for node in self.meta.get("nodes", [])]
        return table(rows, _NODE_COLUMNS + ["pairs"] * bool(self.meta.get("dataset")))

    def edges(self):
        """One row per edge kept, largest ``|score|`` first: ``upstream``, ``downstream`` (node
        names) and ``score`` (the estimated change of the metric carried from the upstream
        node's clean value through the downstream node). A pandas DataFrame."""
        return table([dict(edge) for edge in self.meta.get("edges", [])], ["upstream", "downstream", "score"])

    def frame(self):
        """A feature circuit's table is its nodes: :meth:`nodes`."""
        return self.nodes()

    def __repr__(self) -> str:
        nodes = [n for n in self.meta.get("nodes", []) if n["latent"] != METRIC_NODE]
        kept = sum(1 for n in nodes if n["circuit"])
        checked = sum(1 for n in nodes if n["exact"] is not None)
        rho = (self.meta.get("agreement") or {}).get("spearman")
        agree = "" if rho is None or math.isnan(rho) else f", rank correlation {rho:.2f}"
        return (f"<pipatch.FeatureCircuitResult {self.status}: {len(nodes)} nodes ({kept} kept, {checked} checked"
                f"{agree}), {len(self.meta.get('edges', []))} edges, {len(self.layers)} SAEs, metric {self.metric}, "
                f"clean {self.clean_value:.4g}, corrupt {self.corrupt_value:.4g}>")

    def plot(self, view: str | None = None, ax=None, **kwargs: Any):  # noqa: ARG002 - one grid
        """The graph drawn statically: one row per SAE (bottom up; the embeddings below them
        where one is kept), one column per position;
        each kept node a dot at its place (sized by ``|score|``, red for a positive score, blue
        for a negative one; errors as squares), each kept edge a line between its nodes (its
        width by ``|score|``). Returns the matplotlib figure."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(self.columns)), max(3.0, 0.9 * len(self.layers))))
        embedded = any(n["circuit"] and n["latent"] == EMBED_NODE for n in self.meta.get("nodes", []))
        sites = [EMBED_NODE] * embedded + list(self.layers)
        positions = list(self.meta.get("positions", range(len(self.columns))))
        kept = [n for n in self.meta.get("nodes", []) if n["circuit"] and n["site"] in sites]
        largest = max([abs(n["score"]) for n in kept] or [1.0]) or 1.0
        spread: dict[tuple[str, int], int] = {}
        where: dict[str, tuple[float, float]] = {}
        for node in sorted(kept, key=lambda n: -abs(n["score"])):
            slot = (node["site"], node["position"])
            k = spread.get(slot, 0)
            spread[slot] = k + 1
            x = positions.index(node["position"]) + 0.12 * (k % 5) - 0.24
            y = sites.index(node["site"]) + 0.12 * (k // 5)
            where[node["node"]] = (x, y)
            ax.scatter([x], [y], s=30 + 300 * abs(node["score"]) / largest, marker="s" if node["latent"] == "error" else "o",
                       color="tab:red" if node["score"] > 0 else "tab:blue", alpha=0.8, zorder=3)
        edges = [e for e in self.meta.get("edges", []) if e["upstream"] in where and e["downstream"] in where]
        widest = max([abs(e["score"]) for e in edges] or [1.0]) or 1.0
        for edge in edges:
            (x0, y0), (x1, y1) = where[edge["upstream"]], where[edge["downstream"]]
            ax.plot([x0, x1], [y0, y1], color="tab:red" if edge["score"] > 0 else "tab:blue",
                    linewidth=0.5 + 3 * abs(edge["score"]) / widest, alpha=0.5, zorder=2)
        ax.set_xticks(range(len(self.columns)), self.columns, rotation=45, ha="right")
        ax.set_yticks(range(len(sites)), sites)
        ax.set_xlim(-0.6, len(self.columns) - 0.4)
        ax.set_ylim(-0.6, len(sites) - 0.2)
        ax.set_title(self.title)
        return ax.figure
