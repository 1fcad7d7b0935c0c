"""A feature circuit's result: its nodes and edges as tables, its file, its repr and its plot.

:func:`pipatch.feature_circuit` (:mod:`pipatch._experiments.feature_circuit`) returns a
:class:`FeatureCircuitResult`. Its one grid ``raw["nodes"]`` ([1, SAEs, positions]) holds, per
SAE and position, ``corrupt metric +`` the sum of that place's node scores (its latents' and
its error's): attribution patching's estimate for the whole value the SAE reads there, so the
grid reads as normalized recovery like a patching grid. The graph itself is in ``meta``:
``meta["nodes"]`` (one dict per node: ``node``, ``site``, ``layer``, ``position``, ``latent``
(an id, ``"error"``, ``"embed"`` or ``"metric"``), ``score``, ``exact`` (``None`` where not
checked), ``circuit`` (kept by the pruning)), ``meta["edges"]`` (``upstream``,
``downstream``, ``score``, ``exact``) and ``meta["curve"]`` (the faithfulness curve's
measured metrics: :func:`faithfulness_rows`), so the result saves and loads as any result
does (safetensors + JSON, no pickle).

Its view (:meth:`FeatureCircuitResult.to_state`, drawn by ``js/features.ts``) is the graph:
the state's ``feature_graph`` part holds the circuit's nodes and the :data:`VIEW_NODES_MAX`
largest others, the edges kept and the supernodes, ``meta["supernodes"]`` (named groups of
nodes, :meth:`FeatureCircuitResult.group`), which the result saves with itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .._base.errors import PipatchError
from .._base.tables import table
from .features import latent_note
from .result import Result
from .views import conform_state
from .views.strings import json_safe

__all__ = ["FeatureCircuitResult", "VIEW_NODES", "VIEW_NODES_MAX", "METRIC_NODE", "EMBED_NODE", "faithfulness_rows"]

#: A feature circuit's one grid: SAEs × positions.
VIEW_NODES = "nodes"
#: The name of the metric's node.
METRIC_NODE = "metric"
#: The ``site`` and ``latent`` of an embedding node (one per position).
EMBED_NODE = "embed"

#: At most this many nodes are drawn (the circuit's, then the largest ``|score|`` others): a
#: graph of every active latent at every position can hold tens of thousands.
VIEW_NODES_MAX = 400

_NODE_COLUMNS = ["node", "site", "layer", "position", "latent", "score", "exact", "circuit"]


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


def faithfulness_rows(curve: dict[str, Any]) -> list[dict[str, Any]]:
    """The faithfulness curve's rows from its entry ``meta["curve"]`` (``full``: ``m(M)``,
    ``empty``: ``m(∅)``, ``points``: each size's ``with``, ``m(C)``, and ``without``,
    ``m(M∖C)``; :mod:`pipatch._experiments._feature_checks`): ``n_nodes``, ``faithfulness``
    ``(m(C) − m(∅)) / (m(M) − m(∅))``, ``completeness`` ``(m(M∖C) − m(∅)) / (m(M) − m(∅))``,
    ``with`` and ``without``; NaN where a value has not come yet, or where ``m(M) = m(∅)``."""
    empty = _number(curve.get("empty"))
    span = curve["full"] - empty
    span = span if span != 0 else float("nan")
    rows = []
    for point in curve["points"]:
        kept, dropped = _number(point["with"]), _number(point["without"])
        rows.append({"n_nodes": point["n_nodes"], "faithfulness": (kept - empty) / span,
                     "completeness": (dropped - empty) / span, "with": kept, "without": dropped})
    return rows


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
        names), ``score`` (the estimated change of the metric carried from the upstream
        node's clean value through the downstream node) and ``exact`` (the exact edge patch's
        change: the downstream node alone set to the value the upstream node's clean value
        gives it; NaN where not checked). A pandas DataFrame."""
        rows = [{**edge, "exact": _number(edge.get("exact"))} for edge in self.meta.get("edges", [])]
        return table(rows, ["upstream", "downstream", "score", "exact"])

    def faithfulness(self):
        """The faithfulness and completeness curve (Marks et al. 2024): one row per circuit
        size measured, ``n_nodes`` (the nodes of largest ``|score|``), ``faithfulness``,
        ``completeness``, ``with`` (the metric with the rest ablated) and ``without`` (with
        the circuit ablated); NaN where not measured yet. Empty where the curve was not asked
        for (``curve=0``). ``meta["curve"]["nodes_for_80"]``: the least size measured whose
        faithfulness reaches 0.8. A pandas DataFrame."""
        curve = self.meta.get("curve")
        return table(faithfulness_rows(curve) if curve else [],
                     ["n_nodes", "faithfulness", "completeness", "with", "without"])

    def supernodes(self) -> dict[str, list[str]]:
        """The named groups of nodes (supernodes), ``{name: [node, ...]}``."""
        return {g["name"]: list(g["nodes"]) for g in self.meta.get("supernodes", [])}

    def group(self, name: str, nodes: list[str]) -> None:
        """Name a group of nodes (a supernode; an empty ``nodes`` removes the group ``name``).
        Saved with the result (``meta["supernodes"]``). Raises :class:`PipatchError` for a name
        that is empty or a node this graph does not have."""
        name = str(name).strip()
        if not name:
            raise PipatchError("a supernode needs a name: group('a name', [node, ...])")
        known = {n["node"] for n in self.meta.get("nodes", [])}
        unknown = [str(n) for n in nodes if n not in known]
        if unknown:
            raise PipatchError(f"no node {unknown[0]!r} in this graph: name nodes as nodes()['node'] does")
        groups = [g for g in self.meta.get("supernodes", []) if g["name"] != name]
        if nodes:
            groups.append({"name": name, "nodes": [str(n) for n in nodes]})
        self.meta["supernodes"] = groups

    def ablate(self, node: str, predictor: Any) -> float:
        """Patch ``node`` exactly (its clean value written through its SAE at its position in
        the corrupt run, everything else free: the checks' patch), store the change of the
        metric as its ``exact`` and return it. ``predictor`` is the plan's (what a click in
        the view runs with); a loaded result has none and raises :class:`PipatchError`."""
        found = [n for n in self.meta.get("nodes", []) if n["node"] == node]
        if not found or found[0]["latent"] == METRIC_NODE:
            raise PipatchError(f"no node {node!r} to ablate in this graph: name one of nodes()['node'] (not the metric)")
        if predictor is None or not hasattr(predictor, "ablate"):
            raise PipatchError("an exact ablation needs the model and plan this result was computed with (not "
                               "available for a loaded result): run feature_circuit again in this kernel")
        found[0]["exact"] = value = float(predictor.ablate(found[0]))
        return value

    def answer_message(self, predictor: Any, message: dict[str, Any]) -> dict[str, Any]:
        """The view's state update for a message from it: ``{"type": "ablate", "node": name}``
        (a click: :meth:`ablate`) or ``{"type": "group", "name": ..., "nodes": [...]}``
        (:meth:`group`). A failure is the ``detail``'s ``error``, one line."""
        try:
            if message.get("type") == "ablate":
                self.ablate(str(message.get("node")), predictor)
            elif message.get("type") == "group":
                self.group(str(message.get("name", "")), [str(n) for n in message.get("nodes") or []])
            else:
                raise PipatchError(f"a feature circuit's view sends 'ablate' or 'group', not {message.get('type')!r}")
        except PipatchError as error:
            return {"detail": {"error": str(error)}}
        except Exception as error:  # noqa: BLE001 - a failed click must not end the kernel's thread
            return {"detail": {"error": f"{type(error).__name__}: {error}"}}
        return {"feature_graph": self.to_state()["feature_graph"], "detail": {}}

    def to_circuit_tracer(self, path: str | Path) -> Path:
        """Write the graph as circuit-tracer's graph JSON (the file its local viewer reads;
        ``metadata``, ``qParams``, ``nodes``, ``links``) where the fields map: a latent is a
        ``"cross layer transcoder"`` node ``"{layer}_{latent}_{position}"`` (its ``influence``
        the score, its ``clerp`` the label), an error node ``"0_{layer}_{position}"``, the
        metric the target ``"logit"`` node; edges are ``links`` (``weight`` the score) and
        supernodes ``qParams["supernodes"]`` (``[name, node ids...]``). What has no field there
        (the exact values, the grid) stays in the result's own JSON (:meth:`save`). Returns
        the path written."""
        top = 1 + next((int(n["layer"]) for n in self.meta.get("nodes", []) if n["latent"] == METRIC_NODE),
                       len(self.layers))  # circuit-tracer's logits sit one above the last layer
        ids: dict[str, str] = {}
        nodes = []
        for n in self.meta.get("nodes", []):
            layer, position, latent = int(n["layer"]), int(n["position"]), n["latent"]
            if latent == METRIC_NODE:
                ids[n["node"]] = node_id = f"{top}_0_{position}"
                nodes.append({"node_id": node_id, "feature": 0, "layer": str(top), "ctx_idx": position,
                              "feature_type": "logit", "is_target_logit": True, "jsNodeId": f"L_0-{position}",
                              "clerp": f"{self.metric}", "influence": n["score"]})
                continue
            if latent == "error":
                ids[n["node"]] = node_id = f"0_{layer}_{position}"
                nodes.append({"node_id": node_id, "feature": -1, "layer": str(layer), "ctx_idx": position,
                              "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_{position}-0",
                              "influence": n["score"]})
                continue
            ids[n["node"]] = node_id = f"{layer}_{latent}_{position}"
            label = str(self.meta.get("labels", {}).get(n["site"], {}).get(str(latent), ""))
            nodes.append({"node_id": node_id, "feature": (layer + latent) * (layer + latent + 1) // 2 + latent,
                          "layer": str(layer), "ctx_idx": position, "feature_type": "cross layer transcoder",
                          "jsNodeId": f"{layer}_{latent}-0", "clerp": label, "influence": n["score"]})
        links = [{"source": ids[e["upstream"]], "target": ids[e["downstream"]], "weight": e["score"]}
                 for e in self.meta.get("edges", []) if e["upstream"] in ids and e["downstream"] in ids]
        graph = {
            "metadata": {"slug": self.kind, "scan": str(self.meta.get("model", "")),
                         "transcoder_list": [s.get("sae", s["name"]) for s in self.meta.get("saes", [])],
                         "prompt_tokens": list(self.tokens), "prompt": "".join(self.tokens),
                         "node_threshold": self.meta.get("node_threshold"), "schema_version": 1},
            "qParams": {"pinnedIds": [], "linkType": "both", "clickedId": "", "sg_pos": "",
                        "supernodes": [[g["name"], *(ids[n] for n in g["nodes"] if n in ids)]
                                       for g in self.meta.get("supernodes", [])]},
            "nodes": nodes, "links": links,
        }
        out = Path(path)
        out.write_text(json.dumps(json_safe(graph), indent=1), encoding="utf-8")
        return out

    def to_state(self, *, live: bool = False) -> dict[str, Any]:
        """Any result's view state (:meth:`pipatch.Result.to_state`) and the graph, its
        ``feature_graph`` part: the sites (rows), positions (columns), the nodes drawn (the
        circuit's and the largest others, at most :data:`VIEW_NODES_MAX`; each with its
        label and top contexts where ``meta`` has them), the edges between them (each with its
        ``exact`` patch, ``null`` where not checked) and the supernodes."""
        everything = self.meta.get("nodes", [])
        # The embeddings' row below the SAEs, where the graph has embedding nodes.
        sites = [EMBED_NODE] * any(n["latent"] == EMBED_NODE for n in everything) + list(self.layers)
        grouped = {name for g in self.meta.get("supernodes", []) for name in g["nodes"]}
        ranked = sorted(everything, key=lambda n: (n["latent"] != METRIC_NODE, not n["circuit"],
                                                   n["node"] not in grouped, -abs(n["score"])))
        drawn = ranked[:VIEW_NODES_MAX]
        index = {n["node"]: i for i, n in enumerate(drawn)}
        nodes = [self._view_node(n, sites) for n in drawn]
        edges = [{"up": index[e["upstream"]], "down": index[e["downstream"]], "score": e["score"], "exact": e.get("exact")}
                 for e in self.meta.get("edges", []) if e["upstream"] in index and e["downstream"] in index]
        part = {"sites": sites, "positions": self._view_positions(),
                "nodes": nodes, "edges": edges, "groups": list(self.meta.get("supernodes", [])),
                "total": len(everything)}
        return {**super().to_state(live=live), **conform_state({"feature_graph": part})}

    def _view_node(self, node: dict[str, Any], sites: list[str]) -> dict[str, Any]:
        latent = node["latent"]
        kind = latent if latent in ("error", METRIC_NODE, EMBED_NODE) else "latent"
        note = ""
        if kind == "latent":
            site = node["site"]
            label = str(self.meta.get("labels", {}).get(site, {}).get(str(latent), ""))
            contexts = [(str(w), float(v)) for w, v in self.meta.get("contexts", {}).get(site, {}).get(str(latent), [])]
            note = latent_note(label, contexts)
        return {"name": node["node"], "row": sites.index(node["site"]) if node["site"] in sites else len(sites),
                "position": self._view_position(node["position"]), "latent": latent if kind == "latent" else None,
                "kind": kind,
                "score": node["score"], "exact": node["exact"], "circuit": bool(node["circuit"]), "note": note}

    def _view_positions(self) -> list[int]:
        """The view's columns: the token positions, or a dataset's named positions by index."""
        if self.meta.get("dataset"):
            return list(range(len(self.columns)))
        return list(self.meta.get("positions", range(len(self.columns))))

    def _view_position(self, position: int | str) -> int:
        """A node's column in the view: its position, or its named position's index."""
        return self.columns.index(position) if isinstance(position, str) else int(position)

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
