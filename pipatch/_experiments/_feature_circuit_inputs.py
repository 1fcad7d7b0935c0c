"""A feature circuit's inputs: a clean/corrupt pair or one prompt and its target, the
embedding nodes, and datasets of pairs averaged over named positions.

:func:`pipatch.feature_circuit` (:mod:`pipatch._experiments.feature_circuit`) takes

* **a pair** (``clean=``, ``corrupt=``, ``answer=``, ``foil=``): scores are changes from the
  corrupt run (Sparse Feature Circuits' attribution patching);
* **one prompt** (``prompt=``, ``target=``), as attribution graphs do (Ameisen et al. 2025):
  the metric is the target token's **logit** by default (``metric='logprob'`` its
  log-probability). The logit is what attribution graphs explain: what the last layer writes
  reaches it through the final norm and one unembedding row only, where a log-probability's
  gradient also pushes down every other token of the vocabulary. Every node is scored
  relative to **zero**: its direct attribution ``f · dM/df`` at the prompt's run (an error
  node's, and an embedding's, summed over the width), edges likewise
  (``f_up · (d f_down / d f_up) · dM/df_down``); the exact checks **ablate to zero** (that
  latent, error or embedding at that position set to 0, everything else free) and report
  ``M(prompt) − M(ablated)``, so estimate and check read alike (positive: the node pushes
  the target up). The result's corrupt baseline is 0, so its grid reads as the fraction of
  the metric each (SAE, position) carries;
* **a dataset of pairs** (``clean`` and ``corrupt`` lists): see :func:`plan_pairs_dataset`.

**Embedding nodes**: one per position, ``"embed @p"`` (``site`` ``"embed"``, ``layer`` −1,
``latent`` ``"embed"``), scored through the gradient at the token embedding module's output
(what block 0 reads in most families; GPT-2 adds its position embeddings after it): ``(e_clean − e_corrupt) · dM/de`` for a pair, ``e · dM/de`` for a prompt, with
edges into the lowest SAE's nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base.checks import whole_number
from .._base.errors import PipatchError
from .._engine import Plan, Sweep
from .._model.cells import Capture, Cell, Metric, Op
from .._model.declare import PAIR, PromptForm
from .._programs.capture import capture, captures
from .._results.feature_circuit import EMBED_NODE, METRIC_NODE, VIEW_NODES, FeatureCircuitResult
from ._feature_checks import curve_entry, curve_sizes, finish_checks
from ._inputs import answer_ids, answer_meta, check_choice, check_run_length, encode
from .dataset import group_means, named_groups
from .patching import pair_inputs

__all__ = ["PAIR_OR_PROMPT", "EMBED_NODE", "CircuitInputs", "circuit_inputs", "embedding_nodes",
           "plan_pairs_dataset"]

#: A pair (``clean`` / ``corrupt``), or one ``prompt`` with its target.
PAIR_OR_PROMPT = dataclasses.replace(
    PAIR,
    doc=PAIR.doc + " Or give prompt= instead: one prompt, its target token's logit explained.",
    body_help=PAIR.body_help + " A body without clean/corrupt lines is one prompt (with --target).",
    alternative=PromptForm(
        "prompt", ("prompt",),
        "One prompt instead of a pair (attribution-graph form): nodes are scored relative to zero on it, "
        "the metric is target's logit (or logprob)",
        "The cell body is the prompt.",
    ),
)


@dataclass
class CircuitInputs:
    """A checked pair or prompt: where the gradients are taken (``base_ids``: the corrupt
    prompt, or the prompt), the clean prompt's ids (the prompt's for a prompt), its tokens,
    the metric, what the result records, and whether nodes are scored relative to zero."""

    clean_ids: torch.Tensor
    base_ids: torch.Tensor
    tokens: list[str]
    metric: Metric
    meta: dict[str, Any]
    zero: bool

    def runs(self, backend: Any, sites: Sequence[Any]) -> tuple[Capture, Capture, Capture]:
        """``(clean, reference, base)`` runs: the values nodes move from (``reference``: the
        corrupt run, or zeros for a prompt) and to, and the run checks write into."""
        if not self.zero:
            clean, corrupt = captures(backend, [self.clean_ids, self.base_ids], self.metric, sites)
            return clean, corrupt, corrupt
        run = capture(backend, self.base_ids, self.metric, sites)
        zeros = dataclasses.replace(
            run, metric=torch.zeros_like(run.metric), embedded=torch.zeros_like(run.embedded),
            sites={name: [torch.zeros_like(v) for v in values] for name, values in run.sites.items()})
        return run, zeros, run


def circuit_inputs(backend: Any, *, clean: str | None, corrupt: str | None, prompt: str | None, answer: Any,
                   foil: Any, target: Any, metric: str | None, steps: int) -> CircuitInputs:
    """Check the pair (``clean``, ``corrupt``, ``answer``, ``foil``) or the prompt (``prompt``,
    ``target``, default the model's top next token) and the metric; one line for each problem."""
    if prompt is None:
        if target is not None:
            raise PipatchError("target= goes with prompt=: a clean/corrupt pair takes answer= (and foil=)")
        if answer is None:
            raise PipatchError("feature_circuit() on a pair needs answer=, e.g. ' Paris' (one prompt takes target=)")
        pair = pair_inputs(backend, clean, corrupt, answer, foil, metric or "logit_diff")
        direction = {"direction": "denoise", "form": "pair"}
        return CircuitInputs(pair.clean_ids, pair.corrupt_ids, pair.clean_tokens, pair.metric,
                             {**pair.meta(backend), **direction}, zero=False)
    if answer is not None or foil is not None:
        raise PipatchError("one prompt takes target= (the token whose logit is explained), not answer= / foil=")
    if steps != 1:
        raise PipatchError("steps= integrates from the corrupt run to the clean one: one prompt is scored relative "
                           "to zero by one gradient, as attribution graphs do; leave steps=1")
    name = check_choice(metric or "logit", ("logit", "logprob"), "metric for one prompt")
    ids, tokens, _ = encode(backend, prompt)
    if target is None:
        top = capture(backend, ids, Metric("logprob", (0,))).top1
        target_ids: tuple[int, ...] = (int(top[0]),)
        target = backend.decode(list(target_ids))[0]
    else:
        target_ids = answer_ids(backend, target, "target", prompt)
        if len(target_ids) != 1:
            raise PipatchError(f"the target {target!r} is {len(target_ids)} tokens: one prompt's circuit explains one "
                               "token's logit; pass its first token")
    scorer = Metric(name, target_ids)
    check_run_length(backend, ids, scorer)
    meta = {"prompt": prompt, "prompt_tokens": tokens, "target": target, "answer": target, "foil": None,
            **answer_meta(backend, "answer", target_ids), "direction": "zero", "form": "prompt"}
    return CircuitInputs(ids, ids, tokens, scorer, meta, zero=True)


def embedding_nodes(clean: torch.Tensor, reference: torch.Tensor, grad: torch.Tensor,
                    cols: Sequence[int]) -> list[dict[str, Any]]:
    """One node per position of ``cols``: ``(e_clean − e_reference) · dM/de`` summed over the
    width (``[1, T, d]`` each)."""
    scores = ((clean.float() - reference.float()) * grad.float())[0].sum(-1)
    return [{"node": f"{EMBED_NODE} @{p}", "site": EMBED_NODE, "layer": -1, "position": p, "latent": EMBED_NODE,
             "score": float(scores[p]), "exact": None, "circuit": False} for p in cols]


# --------------------------------------------------------------------------------------------
# Datasets of pairs
# --------------------------------------------------------------------------------------------


def _each(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise PipatchError(f"{len(value)} {what}s for {n} pairs: pass one {what} per pair, or one for all")
        return list(value)
    return [value] * n


def plan_pairs_dataset(backend: Any, planner: Callable[..., Plan], keywords: dict[str, Any]) -> Plan:
    """A feature circuit over a dataset of clean/corrupt pairs, averaged over named positions.

    Each pair is scored as one pair is (``planner`` with ``verify=0``: its nodes). Its
    positions fall into :func:`pipatch._experiments.dataset.named_groups` around the span where
    clean and corrupt differ (``before``, ``first changed``, ..., ``last``), as every other
    experiment's dataset of pairs; a node becomes ``(site, named position, latent)`` (or
    ``error`` / ``embed``), its score the mean over that group's positions (a latent inactive
    at a position scores 0 there), then the mean over the pairs that have that group at all
    (as a dataset's grid skips a pair without it). The metric node is the mean of ``clean −
    corrupt``. Pruning keeps ``top_nodes`` of these averaged nodes.

    **Edges** join kept averaged nodes: in each pair, the edges between its nodes that fall in
    kept ones (scored as one pair's are), an edge from named position ``G`` to ``H`` being
    the mean over ``H``'s positions ``q`` of the sum over ``G``'s positions ``p`` of the
    edge ``p → q`` (so the edges into a node average as the node does), then the mean over
    the pairs that have both groups; ``top_edges`` / ``edge_threshold`` prune them.

    **Checks**: each of the ``verify`` averaged nodes of largest ``|score|`` is patched exactly
    in each pair that has its named position: its latent (or error, or embedding) at every
    token of that named position set to its clean value at once in the pair's corrupt run, the
    change of the metric divided by the number of those tokens (the score is their mean; to
    first order the two agree); its ``exact`` is the mean over those pairs (a pair where it is
    off at all those tokens adds 0). **The faithfulness curve** (``curve`` sizes, ``ablation``
    ``corrupt`` or ``zero``: a dataset's pairs share no positions to take a mean over) ranks
    the averaged nodes; in each pair the circuit of size ``n`` keeps every node that falls in
    one of the ``n`` first (at any of its named positions), and its points are the means over
    the pairs of ``m(C)``, ``m(M∖C)`` and ``m(∅)``, ``full`` the mean clean metric. Edges are
    not checked on a dataset (a warning says so where ``verify_edges`` asks).
    ``raw["nodes"]`` holds one row per pair ([pairs, SAEs, named positions]), each pair's grid
    averaged the same way.

    Raises :class:`PipatchError` (one line) for lists of different lengths, ``prompt=`` with
    lists, and ``ablation='mean'`` with a curve.
    """
    clean, corrupt = keywords["clean"], keywords["corrupt"]
    if keywords.get("prompt") is not None:
        raise PipatchError("a dataset of feature circuits is of clean/corrupt pairs (named positions come from where "
                           "they differ): pass clean= and corrupt= lists, or one prompt=")
    if not isinstance(corrupt, (list, tuple)) or len(corrupt) != len(clean) or not clean:
        raise PipatchError("for many pairs pass clean and corrupt as lists of the same length (pairs in order)")
    n = len(clean)
    verify = whole_number(keywords["verify"], "verify (nodes patched exactly)", minimum=0)
    points = whole_number(keywords["curve"], "curve (circuit sizes the faithfulness curve measures; 0: none)",
                          minimum=0)
    if keywords["ablation"] == "mean" and points:
        raise PipatchError("ablation='mean' averages each node over the corrupt prompts at its position, which a "
                           "dataset's pairs do not share: use ablation='corrupt' (each pair's own) or 'zero'")
    answers, foils = _each(keywords["answer"], n, "answer"), _each(keywords["foil"], n, "foil")
    one = {**keywords, "verify": 0, "top_nodes": 1, "top_edges": 0, "verify_edges": 0, "curve": 0}
    plans = [planner(backend, **{**one, "clean": c, "corrupt": x, "answer": a, "foil": f})
             for c, x, a, f in zip(clean, corrupt, answers, foils)]
    results = [p.result for p in plans]
    names: list[str] = []
    pair_groups: list[list[list[int]]] = []
    totals: dict[tuple[str, str, Any], list[float]] = {}
    grids, layer_of, empty = [], {}, []
    for i, result in enumerate(results):
        tokens = result.meta["clean_tokens"]
        changed = [k for k, (a, b) in enumerate(zip(tokens, result.meta["corrupt_tokens"])) if a != b]
        names, groups = named_groups(changed or [len(tokens) - 1], len(tokens), "changed")
        pair_groups.append(groups)
        groups_of: dict[int, list[int]] = {}  # a one-token span is both its first and its last position
        for g, group in enumerate(groups):
            for p in group:
                groups_of.setdefault(p, []).append(g)
        grids.append(group_means(result.raw[VIEW_NODES], groups))
        for node in result.meta["nodes"]:
            if node["latent"] == METRIC_NODE:
                continue
            layer_of[node["site"]] = node["layer"]
            for g in groups_of[node["position"]]:
                sums = totals.setdefault((node["site"], names[g], node["latent"]), [0.0] * len(groups) * n)
                sums[i * len(groups) + g] += node["score"] / len(groups[g])
        empty.append([g for g, group in enumerate(groups) if not group])
    for sums in totals.values():  # a pair without a group has no say in it
        for i, gone in enumerate(empty):
            for g in gone:
                sums[i * len(names) + g] = float("nan")
    nodes = []
    for (site, name, latent), sums in totals.items():
        g = names.index(name)
        per_pair = torch.tensor(sums[g::len(names)], dtype=torch.float64)
        per_pair = per_pair[~per_pair.isnan()]
        label = {"error": f"{site} error", EMBED_NODE: EMBED_NODE}.get(latent, f"{site} #{latent}")
        nodes.append({"node": f"{label} @{name}", "site": site, "layer": layer_of[site], "position": name,
                      "latent": latent, "score": float(per_pair.mean()), "exact": None, "circuit": False,
                      "pairs": int(len(per_pair))})
    nodes.sort(key=lambda node: -abs(node["score"]))
    threshold, top = keywords["node_threshold"], keywords["top_nodes"]
    for node in [node for node in nodes if abs(node["score"]) >= threshold][:top]:
        node["circuit"] = True
    edges = (_dataset_edges(plans, pair_groups, names, nodes, keywords["top_edges"], keywords["edge_threshold"])
             if keywords["top_edges"] else [])  # no edges kept: none scored
    cleans = torch.tensor([float(r.clean) for r in results])
    corrupts = torch.cat([r.corrupt_seeds for r in results])
    nodes.insert(0, {"node": METRIC_NODE, "site": METRIC_NODE, "layer": results[0].meta["nodes"][0]["layer"],
                     "position": "last", "latent": METRIC_NODE, "score": float((cleans - corrupts).mean()),
                     "exact": float((cleans - corrupts).mean()), "circuit": True, "pairs": n})
    meta = dict(results[0].meta)
    meta.update({"dataset": True, "positions": list(names), "verify": verify, "nodes": nodes, "edges": edges,
                 "prompts": [r.meta["clean_prompt"] for r in results], "per_prompt_clean": cleans.tolist(),
                 "per_prompt_corrupt": corrupts.tolist(), "top_nodes": top, "node_threshold": threshold,
                 "top_edges": keywords["top_edges"], "edge_threshold": keywords["edge_threshold"]})
    meta.pop("agreement", None)
    result = FeatureCircuitResult(
        kind="feature_circuit", tokens=list(names), columns=list(names), layers=results[0].layers,
        metric=results[0].metric, raw={VIEW_NODES: torch.cat(grids)}, clean=cleans, corrupt=corrupts, meta=meta,
        rows_done={VIEW_NODES: len(results[0].layers)},
        warnings=[f"pair {i}: {w}" for i, r in enumerate(results) for w in r.warnings]
        + (["a dataset's feature circuit checks no edges exactly: run one pair for them"]
           if keywords["verify_edges"] else []),
    )
    checks = _node_checks(plans, pair_groups, names, nodes, verify)
    graph = [node for node in nodes if node["latent"] not in (METRIC_NODE, EMBED_NODE)]  # the embeddings stay free
    sizes = curve_sizes(points, len(graph), sum(1 for node in graph if node["circuit"]))
    meta["curve"] = curve_entry(keywords["ablation"], float(cleans.mean()), sizes)
    curves = [plan.curve_for(_ranked(plan, groups, names, graph), sizes) for plan, groups in zip(plans, pair_groups)]
    return _DatasetChecks(backend, result, [*checks, *(c for c in curves if c.n_rows)], plans[0].batch_size, True,
                          curves=curves)



def _dataset_edges(plans: list[Plan], pair_groups: list[list[list[int]]], names: list[str],
                   nodes: list[dict[str, Any]], top: int, threshold: float) -> list[dict[str, Any]]:
    """The averaged edges between the kept averaged ``nodes`` (:func:`plan_pairs_dataset`)."""
    kept = {(n["site"], n["position"], n["latent"]): n["node"] for n in nodes if n["circuit"]}
    n = len(plans)
    sums: dict[tuple[str, str], list[float]] = {}
    for i, (plan, groups) in enumerate(zip(plans, pair_groups)):
        def keys(node: dict[str, Any], groups: list[list[int]] = groups) -> list[tuple[str, int]]:
            """The kept averaged nodes ``node`` falls in, with the named position's number."""
            return [(kept[k], g) for g, group in enumerate(groups) if node["position"] in group
                    for k in [(node["site"], names[g], node["latent"])] if k in kept]
        pair_nodes = [dict(node) for node in plan.result.meta["nodes"] if node["latent"] != METRIC_NODE]
        for node in pair_nodes:
            node["circuit"] = bool(keys(node))
        by_name = {node["node"]: node for node in pair_nodes}
        for edge in plan.edges_between(pair_nodes):
            for up, _ in keys(by_name[edge["upstream"]]):
                for down, h in keys(by_name[edge["downstream"]]):
                    sums.setdefault((up, down), [0.0] * n)[i] += edge["score"] / len(groups[h])
    named = {node["node"]: node["position"] for node in nodes}
    edges = []
    for (up, down), per_pair in sums.items():
        have = [v for v, groups in zip(per_pair, pair_groups)  # the pairs with both named positions
                if groups[names.index(named[up])] and groups[names.index(named[down])]]
        edges.append({"upstream": up, "downstream": down, "score": sum(have) / len(have)})
    edges.sort(key=lambda e: -abs(e["score"]))
    return [e for e in edges if abs(e["score"]) >= threshold][:top]


def _node_checks(plans: list[Plan], pair_groups: list[list[list[int]]], names: list[str], nodes: list[dict[str, Any]],
                 verify: int) -> list[_PairNodeChecks]:
    """The exact checks of the ``verify`` averaged nodes of largest ``|score|``, one sweep a
    pair (:func:`plan_pairs_dataset`). A pair with the node's named position but none of its
    nodes there adds 0 (its patch would write back the corrupt run's values)."""
    checked = [i for i, node in enumerate(nodes) if node["latent"] != METRIC_NODE][:verify]
    tally: dict[int, list[float]] = {i: [] for i in checked}  # each checked node's values so far, one a pair
    sweeps = []
    for plan, groups in zip(plans, pair_groups):
        own = {(node["site"], node["position"], node["latent"]): node for node in plan.result.meta["nodes"]}
        rows, ops, shares = [], [], []
        for i in checked:
            node = nodes[i]
            group = groups[names.index(node["position"])]
            if not group:
                continue  # a pair without the named position has no say
            there = [own[key] for q in group for key in [(node["site"], q, node["latent"])] if key in own]
            if not there:
                tally[i].append(0.0)
                continue
            rows.append(i)
            ops.append([plan.node_op(n) for n in there])
            shares.append(1 / len(group))
        first = plan.sweeps[0]  # the pair's own node checks: its corrupt run
        sweeps.append(_PairNodeChecks(view=VIEW_NODES, base=first.base, metric=first.metric, n_rows=len(rows),
                                      n_cols=1, agrees_before=first.agrees_before, checked=rows, ops=ops,
                                      shares=shares, corrupt_value=first.corrupt_value, tally=tally))
    for i in checked:
        nodes[i]["exact"] = _settled(nodes[i], tally[i])
    return [s for s in sweeps if s.n_rows]


def _settled(node: dict[str, Any], values: list[float]) -> float | None:
    """A checked averaged node's ``exact``: the mean of its pairs' ``values`` once every pair
    that has its named position is in; ``None`` until then."""
    return sum(values) / len(values) if len(values) == node["pairs"] else None


def _ranked(plan: Plan, groups: list[list[int]], names: list[str],
            graph: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """One pair's latent and error nodes, each with the rank of an averaged node of ``graph``
    (largest ``|score|`` first) it falls in: one ``(node, rank)`` per named position it is in."""
    rank = {(node["site"], node["position"], node["latent"]): i for i, node in enumerate(graph)}
    return [(node, rank[key]) for node in plan.result.meta["nodes"] if node["latent"] not in (METRIC_NODE, EMBED_NODE)
            for g, group in enumerate(groups) if node["position"] in group
            for key in [(node["site"], names[g], node["latent"])]]


@dataclass
class _PairNodeChecks(Sweep):
    """One pair's part of a dataset's node checks. Row ``r``: averaged node ``checked[r]``'s
    nodes at every token of its named position in this pair patched together (``ops[r]``);
    the change of the metric from the corrupt run, times ``shares[r]`` (one over the named
    position's tokens, as the node's score is their mean), is this pair's value of it."""

    stage = "checks"
    checked: list[int] = field(default_factory=list)
    ops: list[list[Op]] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    corrupt_value: float = 0.0
    tally: dict[int, list[float]] = field(default_factory=dict)  # shared by every pair's sweep

    @property
    def tracks_rows(self) -> bool:
        return False

    def cell(self, row: int, col: int, seed: int) -> Cell:
        ops = self.ops[row]
        return Cell(row, col, seed, start=min(op.site.start_layer(op.layer) for op in ops), ops=ops)

    def store(self, result: Any, cell: Cell, value: float) -> None:
        i = self.checked[cell.row]
        self.tally[i].append(self.shares[cell.row] * (value - self.corrupt_value))
        result.meta["nodes"][i]["exact"] = _settled(result.meta["nodes"][i], self.tally[i])


class _DatasetChecks(Plan):
    """A dataset's node checks and faithfulness curve, each pair's sweeps in turn: the curve's
    points are the means over the pairs of ``m(C)``, ``m(M∖C)`` and ``m(∅)`` (``full`` the mean
    clean metric), as Marks et al. average theirs; the rank correlations and ``nodes_for_80``
    at the end (:func:`~._feature_checks.finish_checks`)."""

    def __init__(self, *args: Any, curves: list[Sweep]):
        super().__init__(*args)
        self.curves = curves
        self.curve_sums: dict[tuple[int, int], list[float]] = {}

    def store(self, sweep: Sweep, cell: Cell, value: float) -> None:
        if not any(sweep is curve for curve in self.curves):
            sweep.store(self.result, cell, value)
            return
        values = self.curve_sums.setdefault((cell.row, cell.col), [])
        values.append(value)
        if len(values) == len(self.curves):
            sweep.store(self.result, cell, sum(values) / len(values))

    def finish(self) -> None:
        finish_checks(self.result.meta)
