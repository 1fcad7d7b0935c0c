"""A feature circuit's exact checks of its edges, and its faithfulness and completeness curve.

Both run as sweeps through the engine (:class:`_EdgeChecks`, :class:`_Curve`), batched and
live, on any backend that runs patches: they need the nodes' and edges' scores, not gradients.

**Exact edge checks.** An edge's score (:mod:`pipatch._experiments.feature_circuit`) is the
linear estimate ``Δf_up · (d f_down / d f_up) · dM/df_down``: the change of the downstream
node that the upstream node's clean value causes, times the metric's gradient at that node.
Its exact counterpart, measured here, takes both factors exactly:

1. in the corrupt run, the upstream node (a latent, or the error, at its position) takes its
   clean value, written through its SAE, everything else free; the downstream node's value
   ``f_down'`` in that run is recorded (one latent at one position, or the error vector
   there);
2. in the corrupt run again, only the downstream node is set to ``f_down'``, everything else
   (the upstream node included) free; the change of the metric from the corrupt run is the
   edge's ``exact``.

So ``exact = M(corrupt; f_down ← f_down') − M(corrupt)``: what the upstream node's clean
value passes to the metric through that one downstream node, the paths around it cut. Two
patched runs per edge (a two-stage cell, :attr:`~pipatch._model.cells.Cell.then`).

**Faithfulness and completeness**, as Marks et al. (2024) define them (their
``ablation.py``): the circuit ``C`` of the ``n`` nodes of largest ``|score|`` runs on the
**clean** prompt with every other node **ablated**, each node's value then fixed (latents,
and error vectors, at the scored SAEs and positions, inactive latents included), its own
nodes computed freely from what the ablation leaves; ``m(C)`` is that run's metric.
``m(M)`` is the clean run's metric (nothing ablated), ``m(∅)`` the clean run with every node
ablated. Then

* ``faithfulness(n) = (m(C) − m(∅)) / (m(M) − m(∅))`` (1: the circuit alone does what the
  model does; it is 1 when ``C`` holds every node, as nothing is then ablated but latents
  inactive on both prompts, written back at 0);
* ``completeness(n) = (m(M∖C) − m(∅)) / (m(M) − m(∅))``, ``m(M∖C)`` the clean run with the
  circuit's nodes ablated and the rest free (0: nothing outside the circuit matters; Marks
  et al. report this, the faithfulness of the complement, lower being better).

An ablated node's value (``ablation``): ``"corrupt"``, its value in the corrupt run (Marks
et al.'s patch ablation); ``"mean"``, its mean over the corrupt prompts at that position
(their default: on one pair, the corrupt run's value again); ``"zero"``, 0 (a latent off, an
error removed). A whole SAE at a position is written at once: its latents and error side by
side are one site value (:class:`~pipatch._model.features.site.NodeValues`), so the SAE's output there is
``decode(f') + e'`` exactly as Marks et al. rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._engine import Sweep
from .._model.cells import Base, Cell, Metric, Op
from .._model.features import LatentSite
from .._model.features.site import NodeValues
from .._results.feature_circuit import EMBED_NODE, METRIC_NODE, VIEW_NODES, faithfulness_rows
from .attribution import spearman

__all__ = ["ABLATIONS", "edge_checks", "faithfulness_curve", "curve_entry", "curve_sweep", "curve_sizes",
           "finish_checks"]

#: What an ablated node's value is in the faithfulness curve (module docstring).
ABLATIONS = ("corrupt", "mean", "zero")


# --------------------------------------------------------------------------------------------
# Exact edge checks
# --------------------------------------------------------------------------------------------


def _node_index(site: LatentSite, node: dict[str, Any]) -> tuple[LatentSite, tuple]:
    """The site and op index of ``node`` (a latent, or the error, at its position)."""
    if node["latent"] == "error":
        return site.error_site, site.error_site.cell(node["position"])
    return site, site.cell(node["position"], int(node["latent"]))


@dataclass
class _EdgeChecks(Sweep):
    """Row ``i``: edge ``checked[i]``'s exact patch (module docstring), ``ups[i]`` the upstream
    node's clean-value write, ``downs[i]`` the downstream node's ``(site, index)``; its change
    of the metric goes to that edge's ``exact``."""

    stage = "checks"
    checked: list[int] = field(default_factory=list)
    ups: list[Op] = field(default_factory=list)
    downs: list[tuple[LatentSite, tuple]] = field(default_factory=list)
    corrupt_value: float = 0.0
    sign: float = 1.0

    @property
    def tracks_rows(self) -> bool:
        return False

    def cell(self, row: int, col: int, seed: int) -> Cell:
        up, (site, index) = self.ups[row], self.downs[row]
        layer = site.layer

        def then(values: list[torch.Tensor]) -> Cell:
            return Cell(row, col, seed, start=site.start_layer(layer), ops=[Op(site, layer, index, values[0])])
        return Cell(row, col, seed, start=up.site.start_layer(up.layer), ops=[up, Op(site, layer, index)], then=then)

    def store(self, result: Any, cell: Cell, value: float) -> None:
        result.meta["edges"][self.checked[cell.row]]["exact"] = self.sign * (value - self.corrupt_value)


def edge_checks(edges: list[dict[str, Any]], nodes: list[dict[str, Any]], sites: dict[str, LatentSite],
                writes: dict[str, Op], verify_edges: int, base: Base, metric: Metric,
                corrupt_value: float, sign: float = 1.0) -> _EdgeChecks:
    """The exact checks of the ``verify_edges`` first of ``edges`` (largest ``|score|`` first);
    ``writes[name]`` is node ``name``'s exact node patch (a pair: its clean value; one prompt:
    zero), ``corrupt_value`` the metric of ``base``, ``sign`` −1 where an edge's exact is
    ``M(base) − M(patched)`` (one prompt's zero ablations, as its estimate). Sets every edge's
    ``exact`` to ``None``: not checked, or not yet."""
    by_name = {n["node"]: n for n in nodes}
    for edge in edges:
        edge["exact"] = None
    checked = list(range(min(verify_edges, len(edges))))
    downs = [_node_index(sites[by_name[edges[i]["downstream"]]["site"]], by_name[edges[i]["downstream"]])
             for i in checked]
    return _EdgeChecks(view=VIEW_NODES, base=base, metric=metric, n_rows=len(checked), n_cols=1, checked=checked,
                       ups=[writes[edges[i]["upstream"]] for i in checked], downs=downs, corrupt_value=corrupt_value,
                       sign=sign)


# --------------------------------------------------------------------------------------------
# Faithfulness and completeness
# --------------------------------------------------------------------------------------------


def curve_sizes(points: int, n_nodes: int, kept: int) -> list[int]:
    """``points`` circuit sizes from 1 to ``n_nodes``, spaced evenly on a log scale, with the
    circuit's own size ``kept`` among them (ascending, distinct; none for ``points=0``)."""
    if points == 0 or n_nodes == 0:
        return []
    spaced = torch.logspace(0, torch.log10(torch.tensor(float(n_nodes))), points).round().long().tolist()
    return sorted({min(max(int(n), 1), n_nodes) for n in spaced} | {min(kept, n_nodes)})


def _ablated(ablation: str, corrupt: torch.Tensor) -> torch.Tensor:
    """The values ablated nodes take, ``[1, T, width]``, from the corrupt runs' ``[rows, T, width]``."""
    if ablation == "zero":
        return torch.zeros_like(corrupt[:1])
    return corrupt.float().mean(0, keepdim=True).to(corrupt.dtype) if ablation == "mean" else corrupt[:1]


@dataclass
class _Curve(Sweep):
    """Row 0, column 0: ``m(∅)``, every node ablated. Row ``i ≥ 1`` (circuit size
    ``sizes[i − 1]``): column 0 keeps the circuit and ablates the rest (``m(C)``), column 1
    ablates the circuit and keeps the rest (``m(M∖C)``). ``rank[name]`` ([T, width] of site
    ``name``'s :class:`NodeValues`): the rank by ``|score|`` of the node each entry belongs to
    (0: the largest), :data:`_NO_NODE` where none is (an inactive latent, a position not
    scored); ``scored[name]`` ([T, 1]) marks the positions scored. One op a site: every entry
    ablated, by position and index."""

    stage = "curve"
    sites: list[NodeValues] = field(default_factory=list)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    rank: dict[str, torch.Tensor] = field(default_factory=dict)
    scored: dict[str, torch.Tensor] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)

    @property
    def tracks_rows(self) -> bool:
        return False

    def cell(self, row: int, col: int, seed: int) -> Cell:
        size = self.sizes[row - 1] if row else 0
        ops = []
        for site in self.sites:
            kept = self.rank[site.name] < size
            ablate = kept if col == 1 else self.scored[site.name] & ~kept
            positions, index = ablate.nonzero(as_tuple=True)
            if len(positions):
                ops.append(Op(site, site.layer, (slice(None), positions, index),
                              self.values[site.name][:, positions, index]))
        return Cell(row, col, seed, start=min((op.site.start_layer(op.layer) for op in ops), default=0), ops=ops)

    def store(self, result: Any, cell: Cell, value: float) -> None:
        curve_meta = result.meta["curve"]
        if cell.row == 0:
            curve_meta["empty"] = value
        else:
            curve_meta["points"][cell.row - 1]["with" if cell.col == 0 else "without"] = value


#: A :class:`_Curve` rank where an entry is no node's: never kept.
_NO_NODE = torch.iinfo(torch.int32).max


def faithfulness_curve(sites: list[LatentSite], corrupt: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       nodes: list[dict[str, Any]], positions: list[int], points: int, ablation: str, base: Base,
                       metric: Metric, clean_value: float) -> tuple[_Curve, dict[str, Any]]:
    """The faithfulness curve's sweep over the clean run ``base`` and its ``meta["curve"]``
    entry (values to come). ``corrupt[name]``: site ``name``'s latents and error on the
    corrupt prompt(s), ``[rows, T, ...]`` each; ``nodes``: the graph's nodes, largest
    ``|score|`` first; ``positions``: the positions scored."""
    graph = [n for n in nodes if n["latent"] not in (METRIC_NODE, EMBED_NODE)]  # the embeddings stay free
    sizes = curve_sizes(points, len(graph), sum(1 for n in graph if n["circuit"]))
    sweep = curve_sweep(sites, corrupt, list(zip(graph, range(len(graph)))), positions, sizes, ablation, base, metric)
    return sweep, curve_entry(ablation, clean_value, sizes)


def curve_entry(ablation: str, full: float, sizes: list[int]) -> dict[str, Any]:
    """A curve's ``meta["curve"]`` entry, its values to come; ``full`` is ``m(M)``."""
    return {"ablation": ablation, "full": full, "empty": None, "nodes_for_80": None,
            "points": [{"n_nodes": n, "with": None, "without": None} for n in sizes]}


def curve_sweep(sites: list[LatentSite], corrupt: dict[str, tuple[torch.Tensor, torch.Tensor]],
                ranked: list[tuple[dict[str, Any], int]], positions: list[int], sizes: list[int], ablation: str,
                base: Base, metric: Metric) -> _Curve:
    """The curve's sweep over the clean run ``base`` at circuit sizes ``sizes``: ``ranked``
    holds ``(node, rank)`` for every latent and error node of this run (a circuit of size
    ``n`` keeps the nodes of rank below ``n``; several may share one rank: a dataset's node
    at a named position is each of its tokens). The other arguments are
    :func:`faithfulness_curve`'s."""
    whole = {s.name: s.nodes_site for s in sites}
    values, rank, scored = {}, {}, {}
    for site in sites:
        latents, error = corrupt[site.name]
        name = whole[site.name].name
        values[name] = _ablated(ablation, torch.cat([latents, error.to(latents.dtype)], -1))
        T, width = values[name].shape[1:]
        rank[name] = torch.full((T, width), _NO_NODE, dtype=torch.int32)
        scored[name] = torch.zeros(T, 1, dtype=torch.bool)
        scored[name][positions] = True
    for node, i in ranked:
        nv = whole[node["site"]]
        entries = slice(nv.n_latents, None) if node["latent"] == "error" else int(node["latent"])
        held = rank[nv.name][node["position"], entries]
        rank[nv.name][node["position"], entries] = torch.clamp(held, max=i)
    only = {(0, 0)} | {(row, col) for row in range(1, len(sizes) + 1) for col in (0, 1)}
    return _Curve(view=VIEW_NODES, base=base, metric=metric, n_rows=len(sizes) + 1 if sizes else 0, n_cols=2,
                  only=only, sites=list(whole.values()), values=values, rank=rank, scored=scored, sizes=sizes)


# --------------------------------------------------------------------------------------------
# At the end
# --------------------------------------------------------------------------------------------


def _agreement(done: list[dict[str, Any]]) -> dict[str, Any]:
    estimates = torch.tensor([d["score"] for d in done], dtype=torch.float64)
    exact = torch.tensor([d["exact"] for d in done], dtype=torch.float64)
    return {"spearman": spearman(estimates, exact), "max_abs_error": float((estimates - exact).abs().max()),
            "n": len(done)}


def finish_checks(meta: dict[str, Any]) -> None:
    """``meta["agreement"]`` and ``meta["edge_agreement"]`` (the checked nodes' and edges'
    rank correlation with their estimates) and ``meta["curve"]["nodes_for_80"]`` (the least
    measured size whose faithfulness reaches 0.8; ``None`` where none does), from what has run."""
    nodes = [n for n in meta.get("nodes", []) if n["latent"] != METRIC_NODE and n.get("exact") is not None]
    if nodes:
        meta["agreement"] = _agreement(nodes)
    edges = [e for e in meta.get("edges", []) if e.get("exact") is not None]
    if edges:
        meta["edge_agreement"] = _agreement(edges)
    entry = meta.get("curve")
    if entry:
        reached = [row["n_nodes"] for row in faithfulness_rows(entry) if row["faithfulness"] >= 0.8]
        entry["nodes_for_80"] = min(reached) if reached else None
