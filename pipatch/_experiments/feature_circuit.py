"""Feature circuits: which SAE latents, at which positions, carry a behaviour, and how they connect.

Marks et al. (2024, "Sparse Feature Circuits") build a graph over SAEs; so does this, on a
clean/corrupt pair, with SAEs at one layer or several (:func:`pipatch.load_saes`):

* **nodes**: each latent of each SAE at each position where it fires on the clean or the
  corrupt prompt, one **error** node per (SAE, position) (what the SAE misses there,
  :class:`~pipatch._model.features.site.ErrorSite`), one **embedding** node per position
  (``"embed @3"``: the embedding output block 0 reads), and the metric (``"metric"``, scored
  ``clean − corrupt``);
* **node scores**, in the denoising convention of :func:`pipatch.feature_patch`: the change of
  the metric when that node alone takes its clean value in the corrupt run, estimated by
  attribution patching, ``(f_clean − f_corrupt) · dM/df`` at the corrupt run (an error node:
  summed over the width), or with ``steps > 1`` by integrated gradients (the gradient averaged
  over ``steps`` points from the corrupt value of that SAE towards its clean value, each SAE
  on its own, as Marks et al. do; :mod:`pipatch._programs.feature_terms`);
* **edge scores** from each node of an SAE to each node of the SAEs at the next layer that
  has any (the downstream value holds everything the layers below wrote, so an edge skipping
  a layer of SAEs would count twice what passes through that layer's nodes; the embedding
  nodes feed the lowest SAE's), by the same
  linear approximation: ``Δf_up · (d f_down / d f_up) · dM/df_down``, the downstream node's
  weighted value pulled back through the model to the upstream SAE's written value and
  through the upstream node's decoder direction (an upstream error or embedding node: its
  whole value).
  The Jacobian is the corrupt run's; ``dM/df_down`` is the node scoring's gradient. One
  backward per downstream node, batched ``batch_size`` nodes a pass; error nodes are nodes
  on both ends;
* **pruning**: the circuit keeps the ``top_nodes`` nodes of largest ``|score|`` at or above
  ``node_threshold``; edges are scored between kept nodes, and the ``top_edges`` of largest
  ``|score|`` at or above ``edge_threshold`` are kept;
* **checked**: the ``verify`` nodes of largest ``|score|`` are patched exactly (that latent,
  or that error, at that position set to its clean value through its SAE in the corrupt run,
  everything else free: :func:`pipatch.feature_patch`'s patch), and the estimates'
  rank correlation with the exact changes is ``meta["agreement"]``, as component circuits
  report theirs. The ``verify_edges`` kept edges of largest ``|score|`` are patched exactly
  too, each alone: the downstream node alone set, in the corrupt run, to the value the
  upstream node's clean value gives it (what the edge score's two factors stand for, taken
  exactly); ``meta["edge_agreement"]`` their rank correlation
  (:mod:`pipatch._experiments._feature_checks`);
* **faithfulness and completeness** as Marks et al. define them: the circuit of the ``n``
  nodes of largest ``|score|`` on the clean prompt, every other latent and error (at the
  SAEs and positions scored) ablated (``ablation``: to its corrupt, mean or zero value),
  ``(m(C) − m(∅)) / (m(M) − m(∅))``; completeness the same with the circuit ablated and the
  rest kept; for ``curve`` sizes from 1 to every node, the circuit's own among them
  (:mod:`pipatch._experiments._feature_checks`; ``result.faithfulness()``).

The checks and the curve are sweeps of patched runs (live, batched): they need no gradients.
Edge checks run on a pair and one prompt; the curve on all three forms.

On **one prompt** (``prompt=``, ``target=``; attribution graphs' form) every score is
relative to zero at the prompt's run and the checks zero-ablate: a node's and an edge's
``exact`` is ``M(prompt) − M(patched)`` (an edge's upstream node zeroed, its change reaching
the downstream node alone), and the curve zero-ablates whatever ``ablation`` says (zero is
one prompt's only counterfactual); **lists of pairs** are a
dataset averaged over named positions (nodes, edges, node checks and the curve; no edge
checks). Both:
:mod:`pipatch._experiments._feature_circuit_inputs`.

The result is a :class:`~pipatch._results.feature_circuit.FeatureCircuitResult`: ``nodes()`` and
``edges()`` are pandas tables, its grid the per-(SAE, position) sums of node scores.

**Backends.** The scores need backward passes through the model's modules: the
transformers backend computes them. vLLM, a served model and NDIF run the exact checks and
the curve from scores computed there, as component circuits do: ``scores=`` takes a feature
circuit's result (or the file it was saved to) of the same model family, prompts, answer,
metric, SAEs and positions (one line names what differs), and its nodes, edges and pruning
(``top_nodes``, the thresholds, ``top_edges``, ``steps``) stand; this call's ``verify``,
``verify_edges``, ``curve`` and ``ablation`` say what is measured here, and
``meta["scores_from"]`` where the scores come from. Without ``scores=`` those backends
refuse in one line naming it; a dataset's circuit (no checks) takes no ``scores=``.
Only metrics read at the last prompt position (a one-token answer and foil, or target) are
scored; the others are refused in one line, as are a target with a pair, an answer with one
prompt, ``steps > 1`` with one prompt, and ``positions=`` with a dataset.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._base.checks import whole_number
from .._base.errors import PipatchError
from .._engine import Plan, Predictor, Sweep, check_batch_size
from .._model.cells import Base, Cell, Op
from .._model.declare import Experiment, Param, count, positive_int
from .._model.features import LatentSite, distinct, load_sae
from .._model.sites import EMBED
from .._programs.feature_terms import (
    EMBEDDINGS,
    NODE_GRADIENTS,
    EdgePullbacksRequest,
    NodeGradientsRequest,
    edge_pullbacks,
    node_gradients,
)
from .._results.feature_circuit import EMBED_NODE, METRIC_NODE, VIEW_NODES, VIEW_NODES_MAX, FeatureCircuitResult
from ._feature_checks import ABLATIONS, curve_sweep, edge_checks, faithfulness_curve, finish_checks
from ._feature_circuit_inputs import PAIR_OR_PROMPT, circuit_inputs, embedding_nodes, plan_pairs_dataset
from ._feature_screen import cell_scores, latent_gradient
from ._inputs import (
    BATCH_SIZE,
    METRIC,
    PAIR_PARAMS,
    POSITIONS,
    model_meta,
    pair_title,
    scored_elsewhere,
    sweep_positions,
    undefined_recovery_warning,
)
from .features import LABELS, _labels_of, _path_or_site, latent_notes

__all__ = ["plan_feature_circuit", "DECLARATION"]


def _sites(backend: Any, saes: Any) -> list[LatentSite]:
    """The latent sites ``saes`` names, in forward order (layer, then place in the block)."""
    given = list(saes) if isinstance(saes, (list, tuple)) else [saes]
    if not given:
        raise PipatchError("feature_circuit() needs saes=: latent sites (pipatch.load_saes(sources, model)) or SAE "
                           "folders")
    sites = distinct([s if isinstance(s, LatentSite) else load_sae(s, backend.model) for s in given])
    return sorted(sites, key=lambda s: (s.layer, s.order, s.name))


def _threshold(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PipatchError(f"{what} must be a number ≥ 0, got {value!r}") from None
    if isinstance(value, bool) or not number >= 0:
        raise PipatchError(f"{what} must be a number ≥ 0, got {value!r}")
    return number


def node_name(site: LatentSite, position: int, latent: int | None) -> str:
    """``"L1 resid_post #12 @3"``, ``"L1 resid_post error @3"``."""
    return f"{site.name} {'error' if latent is None else f'#{latent}'} @{position}"


@dataclass
class _Scored:
    """One SAE's values and gradients at the corrupt run (``[1, T, ...]`` each): ``clean`` is
    what a node moves to, ``corrupt`` what it moves from (one prompt: its values, and zeros).
    The embeddings are one too (``site`` :data:`EMBEDDINGS`, their values in both the latents'
    and the error's place: an embedding node is a whole vector, as an error node)."""

    site: Any  # a LatentSite, or EMBEDDINGS
    clean: torch.Tensor
    corrupt: torch.Tensor
    clean_error: torch.Tensor
    corrupt_error: torch.Tensor
    holder_grad: torch.Tensor | None  # dM/dx at the written value, [1, T, d]; None: scores given

    @property
    def latent_grad(self) -> torch.Tensor:
        """dM/df, [T, d_sae]."""
        return latent_gradient(self.site, self.corrupt, self.holder_grad)[0].float()


def _notes(sites: Sequence[LatentSite], labels: dict[str, dict[int, str]],
           nodes: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """The labels and top contexts (:func:`~.features.latent_notes`) of the latents the view
    can draw: the circuit's and the :data:`VIEW_NODES_MAX` of largest |score| (``nodes`` is
    sorted so), as ``({site: {id: label}}, {site: {id: contexts}})``."""
    shown: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        if (n["circuit"] or i <= VIEW_NODES_MAX) and isinstance(n["latent"], int):
            shown.setdefault(n["site"], set()).add(n["latent"])
    named, contexts = {}, {}
    for site in sites:
        named[site.name], found = latent_notes(site, labels[site.name], sorted(shown.get(site.name, ())))
        if found:
            contexts[site.name] = found
    return named, contexts


def plan_feature_circuit(backend: Any, *, clean: Any, corrupt: Any, prompt: Any, answer: Any, foil: Any,
                         target: str | None, saes: Any, metric: str | None, steps: int, verify: int, top_nodes: int,
                         node_threshold: float, top_edges: int, edge_threshold: float,
                         positions: Sequence[int] | None, batch_size: int | None, verify_edges: int, curve: int,
                         ablation: str, labels: Any = None, scores: Any = None) -> Plan:
    """Score every node and the edges between kept nodes (or take them from ``scores``, a
    feature circuit computed elsewhere: :func:`_given_scores`); plan the exact checks of the
    top ``verify`` nodes and ``verify_edges`` edges and the faithfulness curve's ``curve``
    points; label the latents the view can draw (:func:`_notes`). The parameters are
    :func:`pipatch.feature_circuit`'s; lists of pairs are a dataset
    (:func:`~._feature_circuit_inputs.plan_pairs_dataset`), whose SAEs are loaded and labels
    read once for all its pairs."""
    sites = _sites(backend, saes)
    named = _labels_of(sites, labels)
    keywords = dict(clean=clean, corrupt=corrupt, prompt=prompt, answer=answer, foil=foil, target=target, saes=sites,
                    metric=metric, steps=steps, verify=verify, top_nodes=top_nodes, node_threshold=node_threshold,
                    top_edges=top_edges, edge_threshold=edge_threshold, positions=positions, batch_size=batch_size,
                    verify_edges=verify_edges, curve=curve, ablation=ablation)
    if isinstance(clean, (list, tuple)) or isinstance(prompt, (list, tuple)):
        if scores is not None:
            raise PipatchError("scores= checks one pair's (or one prompt's) feature circuit, not a dataset's: check "
                               "each pair with that pair's scores, or run the dataset on transformers")
        plan = plan_pairs_dataset(backend, _plan_one, keywords)
    else:
        plan = _plan_one(backend, **keywords, scores=scores)
    meta = plan.result.meta
    meta["labels"], meta["contexts"] = _notes(sites, named, meta["nodes"])
    return plan


def _plan_one(backend: Any, *, clean: Any, corrupt: Any, prompt: Any, answer: Any, foil: Any, target: str | None,
              saes: list[LatentSite], metric: str | None, steps: int, verify: int, top_nodes: int,
              node_threshold: float, top_edges: int, edge_threshold: float, positions: Sequence[int] | None,
              batch_size: int | None, verify_edges: int, curve: int, ablation: str, scores: Any = None) -> Plan:
    """One pair's (or one prompt's) plan: :func:`plan_feature_circuit` without the labels."""
    steps = whole_number(steps, "steps (integrated-gradient points; 1: attribution patching)", minimum=1)
    verify = whole_number(verify, "verify (nodes patched exactly)", minimum=0)
    verify_edges = whole_number(verify_edges, "verify_edges (edges patched exactly)", minimum=0)
    curve = whole_number(curve, "curve (circuit sizes the faithfulness curve measures; 0: none)", minimum=0)
    if ablation not in ABLATIONS:
        raise PipatchError(f"ablation must be one of {', '.join(ABLATIONS)} (what the faithfulness curve sets "
                           f"the nodes it ablates to), got {ablation!r}")
    top_nodes = whole_number(top_nodes, "top_nodes (nodes the circuit keeps)", minimum=1)
    top_edges = whole_number(top_edges, "top_edges (edges the circuit keeps)", minimum=0)
    node_threshold, edge_threshold = _threshold(node_threshold, "node_threshold"), _threshold(edge_threshold,
                                                                                             "edge_threshold")
    # The scores' backward passes call the torch model's modules, as a circuit's runs do.
    if scores is None:
        NODE_GRADIENTS.check(backend)  # one line, from what the program needs
    sites = list(saes)
    inputs = circuit_inputs(backend, clean=clean, corrupt=corrupt, prompt=prompt, answer=answer, foil=foil,
                            target=target, metric=metric, steps=steps)
    scorer = inputs.metric
    if not scorer.single:
        raise PipatchError("feature_circuit scores metrics read at the last prompt position: give a one-token answer "
                           "and foil")
    T = inputs.clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T, backend)
    errors = [s.error_site for s in sites]
    # The reference is the corrupt run (a pair) or zeros (one prompt); the base is the run
    # gradients are taken on and checks write into.
    clean_run, reference, base_run = inputs.runs(backend, [*sites, *errors])
    clean_value, corrupt_value = float(clean_run.metric[0]), float(reference.metric[0])
    saes_meta = [{"name": s.name, "layer": s.layer, "sae": s.sae.name, "d_sae": s.n_latents} for s in sites]
    given = None if scores is None else _given_scores(scores, backend, inputs, saes_meta, cols)
    if given is None:
        deltas = {s.name: _written_change(s, clean_run.sites[s.name][s.layer], reference.sites[s.name][s.layer],
                                          clean_run.sites[e.name][s.layer], reference.sites[e.name][s.layer])
                  for s, e in zip(sites, errors)}
        deltas[EMBEDDINGS.name] = (clean_run.embedded - reference.embedded).float()
        grads, _ = node_gradients(backend, NodeGradientsRequest(inputs.base_ids, scorer, [EMBEDDINGS, *sites],
                                                                steps, deltas))
    scored = [_Scored(s, clean_run.sites[s.name][s.layer], reference.sites[s.name][s.layer],
                      clean_run.sites[e.name][s.layer], reference.sites[e.name][s.layer],
                      None if given is not None else grads[s.name][None])
              for s, e in zip(sites, errors)]
    embedded = _Scored(EMBEDDINGS, clean_run.embedded, reference.embedded, clean_run.embedded, reference.embedded,
                       None if given is not None else grads[EMBEDDINGS.name][None])
    metric_node = {"node": METRIC_NODE, "site": METRIC_NODE, "layer": backend.adapter.n_layers, "position": T - 1,
                   "latent": METRIC_NODE, "score": clean_value - corrupt_value, "exact": clean_value - corrupt_value,
                   "circuit": True}

    if given is None:
        nodes, grid = _nodes(scored, cols)
        nodes += embedding_nodes(clean_run.embedded, reference.embedded, embedded.holder_grad, cols)
        ranked = sorted((n for n in nodes if n["latent"] != METRIC_NODE), key=lambda n: -abs(n["score"]))
        for node in [n for n in ranked if abs(n["score"]) >= node_threshold][:top_nodes]:
            node["circuit"] = True
        edges = _edges(backend, inputs.base_ids, [embedded, *scored], nodes, batch)
        edges = [e for e in sorted(edges, key=lambda e: -abs(e["score"]))
                 if abs(e["score"]) >= edge_threshold][:top_edges]
        nodes = [metric_node, *sorted(nodes, key=lambda n: -abs(n["score"]))]
        pruning = {"steps": steps, "method": "atp" if steps == 1 else "ig", "top_nodes": top_nodes,
                   "node_threshold": node_threshold, "top_edges": top_edges, "edge_threshold": edge_threshold}
    else:  # its nodes, edges and pruning; the metric node is this run's
        nodes = [metric_node, *({**n, "exact": None} for n in given.meta["nodes"] if n["latent"] != METRIC_NODE)]
        edges = [dict(e) for e in given.meta["edges"]]
        grid = (given.raw[VIEW_NODES][0] - given.corrupt).float()
        pruning = {k: given.meta[k] for k in ("steps", "method", "top_nodes", "node_threshold", "top_edges",
                                              "edge_threshold")}

    meta = model_meta(backend)
    meta.update({
        **inputs.meta, "col_axis": "token", "positions": cols, **pruning, "saes": saes_meta, "verify": verify,
        "verify_edges": verify_edges, "nodes": nodes, "edges": edges,
    })
    if given is not None:
        meta["scores_from"] = {k: given.meta.get(k) for k in ("model", "backend", "dtype", "method", "steps")}
    result = FeatureCircuitResult(
        kind="feature_circuit", tokens=inputs.tokens, columns=[inputs.tokens[p] for p in cols],
        layers=[s.name for s in sites], metric=scorer.label, raw={VIEW_NODES: (corrupt_value + grid).unsqueeze(0)},
        clean=clean_value, corrupt=torch.tensor([corrupt_value]), meta=meta,
        warnings=undefined_recovery_warning(scorer.label, clean_value, corrupt_value),
        rows_done={VIEW_NODES: len(sites)},
    )
    checked = [i for i, n in enumerate(nodes) if n["latent"] != METRIC_NODE][:verify]
    for i in checked:
        nodes[i]["exact"] = None
    differ = (inputs.clean_ids[0] != inputs.base_ids[0]).nonzero()
    agrees = 0 if inputs.zero else int(differ[0]) if len(differ) else T  # zeros agree with no run
    by_name = {s.site.name: s for s in [embedded, *scored]}
    # One prompt: each check zero-ablates, and reports M(prompt) − M(ablated) as its estimate does.
    sweep = _NodeChecks(view=VIEW_NODES, base=Base(inputs.base_ids, base_run), metric=scorer,
                        n_rows=len(checked), n_cols=1, agrees_before=agrees,
                        checked=checked, ops=[_ablation(nodes[i], by_name, inputs.zero) for i in checked],
                        corrupt_value=float(base_run.metric[0]), sign=-1.0 if inputs.zero else 1.0, scored=by_name)
    sweeps: list[Sweep] = [sweep]
    # The edges' and the curve's counterfactual: the corrupt run (a pair), or zeros (one prompt:
    # an edge's upstream node zeroed, the curve's ablated nodes zeroed, whatever ``ablation``).
    ablation = "zero" if inputs.zero else ablation
    in_edges = {e[end] for e in edges for end in ("upstream", "downstream")}
    writes = {n["node"]: _ablation(n, by_name, inputs.zero) for n in nodes if n["node"] in in_edges}
    sweeps.append(edge_checks(edges, nodes, {s.name: s for s in sites}, writes, verify_edges,
                              Base(inputs.base_ids, base_run), scorer, float(base_run.metric[0]),
                              sign=-1.0 if inputs.zero else 1.0))
    curve_run, result.meta["curve"] = faithfulness_curve(
        sites, {s.site.name: (s.corrupt, s.corrupt_error) for s in scored}, nodes, cols, curve, ablation,
        Base(inputs.clean_ids, clean_run), scorer, clean_value)
    sweeps.append(curve_run)
    planned = _CheckedPlan(backend, result, sweeps, batch, True)
    if given is None:
        planned.edges_between = lambda marked: _edges(backend, inputs.base_ids, [embedded, *scored], marked, batch)
    planned.node_op = lambda node: _ablation(node, by_name, inputs.zero)
    planned.curve_for = lambda ranked, sizes: curve_sweep(
        sites, {s.site.name: (s.corrupt, s.corrupt_error) for s in scored}, ranked, cols, sizes, ablation,
        Base(inputs.clean_ids, clean_run), scorer)
    return planned


#: What a feature circuit given as ``scores=`` must share with the run that checks it.
_SAME = ("family", "form", "clean_tokens", "corrupt_tokens", "prompt_tokens", "answer_ids", "foil_ids", "metric",
         "saes", "positions")


def _given_scores(value: Any, backend: Any, inputs: Any, saes: list[dict[str, Any]],
                  cols: list[int]) -> FeatureCircuitResult:
    """``scores=``: a feature circuit computed elsewhere (its result, or the file it was saved
    to), for a backend that takes no gradients (vLLM, a served model, NDIF) to check and
    measure. It must be of this model family, these prompts and answer, metric, SAEs and
    positions (:data:`_SAME`); one line names what differs."""
    found = scored_elsewhere(value, "feature_circuit", FeatureCircuitResult)
    if found.meta.get("dataset"):
        raise PipatchError("scores=: it is a dataset's feature circuit; scores= takes one pair's (or one prompt's): "
                           "score one pair and pass that result")
    here = {**inputs.meta, "family": backend.adapter.family, "metric": inputs.metric.label, "saes": saes,
            "positions": cols}
    there = {**found.meta, "metric": found.metric}
    differ = [k for k in _SAME if json.dumps(here.get(k)) != json.dumps(there.get(k))]
    if differ:
        raise PipatchError(f"scores=: its feature circuit differs from this run in its {', '.join(differ)}: score "
                           "the same model, prompts, answer, SAEs and positions on backend='transformers' and pass "
                           "that result")
    return found


def _written_change(site: LatentSite, clean: torch.Tensor, corrupt: torch.Tensor, clean_error: torch.Tensor,
                    corrupt_error: torch.Tensor) -> torch.Tensor:
    """How far ``site``'s clean latents and error move what it writes: ``decode(f_clean) −
    decode(f_corrupt) + e_clean − e_corrupt`` ([1, T, d]), the line integrated gradients walk."""
    with torch.no_grad():
        return (site.decode(clean) - site.decode(corrupt)).float() + (clean_error - corrupt_error).float()


def _nodes(scored: list[_Scored], cols: list[int]) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Every node's entry (unpruned, unchecked) and the grid of summed scores [SAEs, columns]."""
    nodes: list[dict[str, Any]] = []
    grid = torch.zeros(len(scored), len(cols))
    for row, s in enumerate(scored):
        site = s.site
        latent_scores = cell_scores(site, s.clean, s.corrupt, s.holder_grad)  # [T, d_sae]
        error_scores = cell_scores(site.error_site, s.clean_error, s.corrupt_error, s.holder_grad).sum(-1)  # [T]
        active = (s.clean[0] != 0) | (s.corrupt[0] != 0)
        for col, p in enumerate(cols):
            for j in active[p].nonzero().flatten().tolist():
                nodes.append(_node(site, p, j, float(latent_scores[p, j])))
            nodes.append(_node(site, p, None, float(error_scores[p])))
            grid[row, col] = float(latent_scores[p].sum() + error_scores[p])
    return nodes, grid


def _node(site: LatentSite, position: int, latent: int | None, score: float) -> dict[str, Any]:
    return {"node": node_name(site, position, latent), "site": site.name, "layer": site.layer, "position": position,
            "latent": "error" if latent is None else latent, "score": score, "exact": None, "circuit": False}


def _edges(backend: Any, corrupt_ids: torch.Tensor, scored: list[_Scored], nodes: list[dict[str, Any]],
           batch: int) -> list[dict[str, Any]]:
    """The edges between kept nodes of each SAE and the SAEs of the next layer above it."""
    kept: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        if node["circuit"]:
            kept.setdefault(node["site"], []).append(node)
    layers = sorted({s.site.layer for s in scored if s.site is not EMBEDDINGS})
    edges: list[dict[str, Any]] = []
    for down in scored:
        if down.site is EMBEDDINGS or not kept.get(down.site.name):
            continue
        below = [layer for layer in layers if layer < down.site.layer]
        if below:
            ups = [s for s in scored if s.site is not EMBEDDINGS and s.site.layer == below[-1] and kept.get(s.site.name)]
        else:  # the lowest SAE reads what the embeddings wrote
            ups = [s for s in scored if s.site is EMBEDDINGS and kept.get(s.site.name)]
        targets = kept[down.site.name]
        grad_f = down.latent_grad
        weights = [down.holder_grad[0, n["position"]].float() if n["latent"] == "error"
                   else grad_f[n["position"], n["latent"]] for n in targets]
        for start in range(0, len(targets), batch):
            chunk, chunk_weights = targets[start:start + batch], weights[start:start + batch]
            wanted = [(n["position"], None if n["latent"] == "error" else n["latent"]) for n in chunk]
            for up in ups:
                pulled = edge_pullbacks(backend, EdgePullbacksRequest(corrupt_ids, up.site, down.site, wanted,
                                                                      chunk_weights))
                edges.extend(_edge_rows(up, kept[up.site.name], chunk, pulled))
    return edges


def _edge_rows(up: _Scored, sources: list[dict[str, Any]], targets: list[dict[str, Any]],
               pulled: torch.Tensor) -> list[dict[str, Any]]:
    """The edges from ``sources`` (kept nodes of ``up``) into each of ``targets``, from the
    pull-backs ``pulled`` ([targets, T, d]) to ``up``'s written value."""
    B = pulled.shape[0]
    through = None if up.site is EMBEDDINGS else latent_gradient(up.site, up.corrupt.expand(B, -1, -1), pulled).float()
    delta = (up.clean - up.corrupt)[0].float()
    delta_error = (up.clean_error - up.corrupt_error)[0].float()
    rows = []
    for r, target in enumerate(targets):
        for source in sources:
            p = source["position"]
            if p > target["position"]:
                continue  # attention is causal: a later position reaches no earlier one
            if source["latent"] in ("error", EMBED_NODE):  # an embedding: its whole vector, as an error
                score = float((delta_error[p] * pulled[r, p].to(delta_error.device)).sum())
            else:
                score = float(delta[p, source["latent"]] * through[r, p, source["latent"]])
            rows.append({"upstream": source["node"], "downstream": target["node"], "score": score})
    return rows


def _ablation(node: dict[str, Any], by_name: dict[str, _Scored], zero: bool) -> Op:
    """The exact patch of ``node``: its clean value (``zero``: 0) written through its SAE at
    its position (an embedding node: at the embedding output)."""
    s = by_name[node["site"]]
    p = node["position"]
    if node["latent"] == EMBED_NODE:
        return Op(EMBED, 0, EMBED.index([p]), (s.corrupt if zero else s.clean)[:, [p]])
    if node["latent"] == "error":
        error = s.site.error_site
        return Op(error, error.layer, error.cell(p), (s.corrupt_error if zero else s.clean_error)[:, [p]])
    j = int(node["latent"])
    return Op(s.site, s.site.layer, s.site.cell(p, j), (s.corrupt if zero else s.clean)[:, [p], j:j + 1])


@dataclass
class _NodeChecks(Sweep):
    """Row ``i``: the exact patch of node ``checked[i]`` (its op ``ops[i]``); its change of the
    metric (times ``sign``: −1 for one prompt's zero ablations) goes to that node's ``exact``."""

    stage = "checks"
    checked: list[int] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    corrupt_value: float = 0.0
    scored: dict[str, _Scored] = field(default_factory=dict)  # each place's values: what any node's patch writes
    sign: float = 1.0

    @property
    def tracks_rows(self) -> bool:
        return False

    def cell(self, row: int, col: int, seed: int) -> Cell:
        op = self.ops[row]
        return Cell(row, col, seed, start=op.site.start_layer(op.layer), ops=[op])

    def store(self, result: Any, cell: Cell, value: float) -> None:
        result.meta["nodes"][self.checked[cell.row]]["exact"] = self.sign * (value - self.corrupt_value)


class _NodePredictor(Predictor):
    """A plan's predictor that also patches any node exactly (a click on it in the view)."""

    def ablate(self, node: dict[str, Any]) -> float:
        """The change of the metric when ``node`` alone takes its clean value (one prompt: is
        zero-ablated, the change reported as ``M(prompt) − M(ablated)``): the checks' patch."""
        checks = self.sweeps[VIEW_NODES]
        one = dataclasses.replace(checks, n_rows=1, checked=[0], ops=[_ablation(node, checks.scored, checks.sign < 0)])
        return checks.sign * (self.values([(one, one.cell(0, 0, 0))])[0] - checks.corrupt_value)


class _CheckedPlan(Plan):
    """The checks' rank correlation with the estimates, ``meta["agreement"]`` (nodes) and
    ``meta["edge_agreement"]``, and the curve's ``nodes_for_80``, at the end; a predictor
    that ablates any node (:class:`_NodePredictor`). Its sweeps share the one view: a click on
    it is answered by the node checks' (the first). What a dataset builds from its pairs'
    plans (:func:`~._feature_circuit_inputs.plan_pairs_dataset`): ``edges_between(nodes)``,
    the edges between the nodes marked ``circuit`` in a node list of this pair;
    ``node_op(node)``, a node's exact patch; ``curve_for(ranked, sizes)``, the faithfulness
    curve's sweep over this pair with the nodes ranked as given
    (:func:`~._feature_checks.curve_sweep`)."""

    edges_between: Any = None
    node_op: Any = None
    curve_for: Any = None

    def predictor(self) -> Predictor:
        return _NodePredictor(self.backend, {VIEW_NODES: dataclasses.replace(self.sweeps[0], only=None)})

    def finish(self) -> None:
        finish_checks(self.result.meta)


def _title(meta: dict) -> str:
    names = ", ".join(s["name"] for s in meta.get("saes", []))
    return pair_title("Feature circuit", meta, f"{meta.get('method', 'atp')}, {names}")


def _number(value: str) -> float:
    return _threshold(value, "the value")


DECLARATION = Experiment(
    name="feature_circuit", kind="feature_circuit", noun="feature circuit",
    summary="Feature circuit: SAE latents, errors and embeddings at each position as nodes, scored by attribution, "
            "edges between SAEs, the top nodes and edges checked exactly, a faithfulness curve.",
    planner=plan_feature_circuit, prompts=PAIR_OR_PROMPT, title=_title, whole_dataset=True,
    params=(
        replace(PAIR_PARAMS[0], default=None, shown="none (a pair needs it)"),
        PAIR_PARAMS[1],
        Param("target", None, "with prompt=: the token whose logit is explained, e.g. ' Paris'", "str | None",
              shown="the model's top next token"),
        Param("saes", help="the SAEs: latent sites (pipatch.load_saes(sources, model)) or SAE folders",
              annotation="Any", parse=_path_or_site, many=True),
        replace(METRIC, default=None, help=METRIC.help + "; with prompt=: logit or logprob", annotation="str | None",
                shown="logit_diff for a pair, logit for a prompt"),
        Param("steps", 1, "integrated-gradient points per SAE (1: attribution patching at the corrupt run)", "int",
              parse=positive_int),
        Param("verify", 10, "nodes of largest |score| patched exactly", "int", parse=count),
        Param("verify_edges", 10, "edges of largest |score| patched exactly (that edge alone)", "int", parse=count),
        Param("curve", 8, "circuit sizes the faithfulness and completeness curve measures (0: none)", "int",
              parse=count),
        Param("ablation", "corrupt", "what the curve sets ablated nodes to: corrupt, mean (over the corrupt "
              "prompts) or zero (one prompt: always zero)", "str"),
        LABELS,
        Param("top_nodes", 30, "nodes the circuit keeps (largest |score| first); edges join kept nodes", "int",
              parse=positive_int),
        Param("node_threshold", 0.0, "the least |score| a kept node has", "float", parse=_number),
        Param("top_edges", 100, "edges the circuit keeps (largest |score| first)", "int", parse=count),
        Param("edge_threshold", 0.0, "the least |score| a kept edge has", "float", parse=_number),
        replace(POSITIONS, single="positions= picks token positions of one pair: a dataset is averaged over named "
                                  "positions; leave positions out"),
        BATCH_SIZE,
        Param("scores", None, "the nodes and edges of a feature circuit computed elsewhere (its result, or the file it "
              "was saved to): a backend that takes no gradients (vLLM, served, NDIF) checks them by exact patches and "
              "measures the curve", "Result | str | None", shown="computed here"),
    ),
    example='%%feature_circuit --saes saes/L3 --saes saes/L6 --answer " Paris" --foil " Rome" -o graph\n'
            "clean: The Eiffel Tower is in the city of\n"
            "corrupt: The Colosseum is in the city of\n\n"
            '%%feature_circuit --saes saes/L6 --target " Paris" -o graph\n'
            "The Eiffel Tower is in the city of",
    doc="""
    See :mod:`pipatch._experiments.feature_circuit` for the method.

    Returns
    -------
    FeatureCircuitResult
        ``kind="feature_circuit"``; ``nodes()`` (``node``, ``site``, ``layer``, ``position``,
        ``latent``: an id, ``"error"``, ``"embed"`` or ``"metric"``, ``score``, ``exact``: NaN
        where not checked, ``circuit``) and ``edges()`` (``upstream``, ``downstream``,
        ``score``, ``exact``: NaN where not checked) are pandas tables, scores in the metric's units (the change from the
        corrupt run; on one prompt, the direct attribution relative to zero, and ``exact``
        ``M(prompt) − M(node zeroed)``); a dataset's ``position`` is a named position and its
        ``exact`` the mean over its pairs; ``meta["agreement"]`` and ``meta["edge_agreement"]`` the checked nodes' and edges' rank
        correlation with their estimates; ``faithfulness()`` the curve (``n_nodes``,
        ``faithfulness``, ``completeness``, ``with``, ``without``; a pair or a dataset) and
        ``meta["curve"]["nodes_for_80"]`` the least size measured reaching 0.8;
        ``raw["nodes"]`` [1, SAEs, positions] ``corrupt metric +`` each place's summed scores.

    Examples
    --------
    >>> saes = pipatch.load_saes(["saes/L3", "saes/L6"], model)
    >>> r = pipatch.feature_circuit(model, saes=saes, clean="The Eiffel Tower is in the city of",
    ...                             corrupt="The Colosseum is in the city of", answer=" Paris", foil=" Rome")
    >>> r.nodes().head(), r.edges().head(), r.faithfulness()

    One prompt, as attribution graphs explain it (the target's logit):

    >>> g = pipatch.feature_circuit(model, saes=saes, prompt="The Eiffel Tower is in the city of", target=" Paris")

    Scored on transformers, checked on a backend without gradients (vLLM, served, NDIF): the
    same SAE folders loaded onto that model, the same prompts, ``scores=`` the result above
    (or its file); without ``scores=`` it is refused in one line naming it:

    >>> vl = pipatch.load_model(backend="vllm")
    >>> c = pipatch.feature_circuit(vl, saes=pipatch.load_saes(["saes/L3", "saes/L6"], vl),
    ...                             clean="The Eiffel Tower is in the city of",
    ...                             corrupt="The Colosseum is in the city of", answer=" Paris", foil=" Rome",
    ...                             scores=r)
    >>> c.nodes().dropna(subset="exact"), c.faithfulness()
    """,
)
