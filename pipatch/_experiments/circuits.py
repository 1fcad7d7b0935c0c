"""Circuits: which edges between components carry a behaviour, scored by EAP or EAP-IG and
checked by exact edge patches.

A grid says *where* something is carried (a head, an MLP). A circuit says *which edges* carry
it: which sender's write reaches which receiver. The graph (as in Hanna et al.'s EAP-IG;
:mod:`pipatch._model.graph` holds its nodes, edges and indices):

* **senders**: the embeddings (``emb``), each attention head's write (``12.2``: layer 12,
  head 2) and each MLP's write (``mlp12``);
* **receivers**: each later head's query, key and value inputs, separately (``14.0.q``), each
  later MLP's input (``mlp14``) and the logits (``logits``). A layer's heads feed its own MLP
  (not where attention and MLP read the same residual: GPT-NeoX, Falcon).

**Scores.** Edge attribution patching (EAP) estimates, for every edge at once, how far the
metric moves when that edge alone carries the clean value into the corrupt run: the sender's
write difference (clean − corrupt) dotted with the gradient of the metric at the receiver's
own copy of the residual, from one clean run, one corrupt run and one backward
(:mod:`pipatch._programs._edges` computes both factors). EAP-IG averages the gradients over
``steps`` points between the corrupt and the clean input embeddings (``steps=1`` is EAP).
A grouped-query model's key and value gradients are each query head's own share.

**Checked.** The ``verify`` edges with the largest estimated effect are patched exactly: path
patching (:mod:`pipatch._experiments.paths`) of that one sender into that one receiver — run 2
swaps in the sender's clean value with every later attention and MLP output frozen to the
corrupt run's and records what the receiver reads; run 3 gives the receiver alone that input.
A grouped-query key or value receiver of query head ``h`` patches the shared key/value head
and keeps the group's other query heads at their corrupt outputs, so only ``h`` reads the
patched keys. The result keeps both numbers and their rank correlation.

**Faithfulness.** A circuit is the top-n edges by |score|; every other edge is ablated to its
corrupt value: the clean prompt runs with each receiver reading the corrupt residual plus the
writes of its kept senders in this run, less what they wrote in the corrupt run
(:func:`pipatch._programs.circuit.circuit_run_body`; a grouped-query model's attention runs
ungrouped, each query head with its own keys and values). ``curve`` sizes from none (the corrupt
run, recovery 0) to every edge (the clean run, 1, where a layer's write is its heads' sum)
give the curve, ``curve`` points in all: a grid, then the smallest circuit reaching ``share``
(80 %) narrowed by bisection among them (:mod:`._circuit_budget`).
``ablation="mean"`` ablates to the mean instead (Wang et al.'s mean ablation): every value the
corrupt run gave is the average, position by position, over the dataset's prompts, clean and
corrupt (so they must have one length in tokens); recovery is still read between the clean
and corrupt metrics, so the empty circuit's point says how much the mean alone keeps.

**Backends.** The gradients are the transformers backend's. vLLM, a served model and NDIF
refuse them in one line, and check scores computed there: ``pipatch.circuit(vllm_model, ...,
scores=result)`` (a circuit result of the same model, or its file) runs the exact edge patches
on that backend, the checks and their rank correlation kept. The curve's runs (each receiver
fed its own input) run on the transformers backend, on vLLM and on a served model (one
request per run input, every mask of a point in it); a backend that cannot run them (NDIF, a
tensor-parallel engine) makes the curve one warning (``curve=0`` asks for none).

**Defaults and cost.** ``steps``, ``verify`` and ``curve`` default by the device (a CPU's are
smaller: :data:`~._circuit_budget.DEVICE_DEFAULTS`), and before the work one line on stderr says
about how long it takes. Where the checked edges' estimates rank-correlate poorly with their
exact patches, the result's warnings say what to try
(:func:`~pipatch._results.circuit.low_agreement_advice`).

**Running.** The planner captures each pair's runs and the curve's baselines; the rest is
the engine's work, batched, live and stoppable like every sweep (:class:`_CircuitPlan`): the
gradient passes (one row a pair), then the exact patches, then the curve (:data:`SIZES_PER_RUN`
sizes a row, then the bisection's points), each made once the work it reads has run: the
stages ``scoring``, ``checks`` and ``curve`` of its progress bars and of
``meta["elapsed_stages"]``. Stop or an interrupt between rows keeps what finished: the
scores, the checks, the curve so far.

**Datasets.** Lists of pairs are averaged edge by edge, as in EAP-IG: each pair's scores and
exact changes are in its own metric units, and their means are the dataset's.

The result is a :class:`~pipatch._results.circuit.CircuitResult` (``kind="circuit"``): one grid
``raw["edges"]``, receivers × senders, of ``corrupt metric + estimated change`` (NaN where no
edge exists), so its normalized recovery reads on the patching scale; its ``edges()`` is the
table and its ``graph()`` the graph as JSON.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._base.checks import whole_number
from .._engine import Plan, Predictor, Sweep, Work, check_batch_size, device_name
from .._model.cells import Base, Capture, Cell, Op
from .._model.declare import PAIR, Experiment, Param, count, positive_int
from .._model.graph import Node, graph
from .._model.models import Adapter, PipatchError
from .._model.sites import ATTN, EMBED, HEAD, LOGITS, MLP, MLP_IN, QKV, projection
from .._programs._edges import check_circuit_family
from .._programs.capture import captures
from .._programs.circuit import (
    EDGE_TERMS,
    Baselines,
    CircuitRunRequest,
    EdgeTermsRequest,
    circuit_baselines,
    circuit_means,
    circuit_runs,
    edge_terms,
)
from .._results.circuit import VIEW_EDGES, CircuitResult, low_agreement_advice
from . import _circuit_code
from ._circuit_budget import DEVICE_DEFAULTS, curve_points, estimate_line, gap_middles, grid_sizes
from ._inputs import (
    BATCH_SIZE,
    METRIC,
    PAIR_PARAMS,
    check_choice,
    model_meta,
    pair_title,
    scored_elsewhere,
    undefined_recovery_warning,
)
from .attribution import spearman
from .patching import pair_inputs

__all__ = ["plan_circuit", "METHODS", "DECLARATION"]

METHODS = ("eap-ig", "eap")
#: What an edge outside a circuit carries: its sender's corrupt value, or its mean over the
#: dataset's prompts (clean and corrupt), position by position.
ABLATIONS = ("corrupt", "mean")
#: The one grid a circuit result holds.
VIEW = VIEW_EDGES


# --------------------------------------------------------------------------------------------
# Exact edge patches
# --------------------------------------------------------------------------------------------


@dataclass
class _EdgeSweep(Sweep):
    """Row ``i``: the exact patch of edge ``edges[i]`` (a sender, a receiver) in one pair."""

    stage = "checks"
    adapter: Adapter | None = None
    donor: Capture | None = None
    edges: list[tuple[Node, Node]] | None = None
    pair: int = 0

    @property
    def tracks_rows(self) -> bool:
        return False

    def store(self, result: Any, cell: Cell, value: float) -> None:
        result.meta["checked"][cell.row]["exact_runs"][self.pair] = value

    def cell(self, row: int, col: int, seed: int) -> Cell:
        sender, receiver = self.edges[row]
        adapter, donor, base = self.adapter, self.donor, self.base.capture
        prompt = slice(0, self.base.input_ids.shape[1])
        ops = []
        if sender.site is EMBED:
            ops.append(Op(EMBED, 0, EMBED.index(prompt), donor.embedded[:1]))
        elif sender.site is HEAD:
            index = HEAD.head_index(adapter, sender.head, prompt)
            ops.append(Op(HEAD, sender.layer, index, donor.sites[HEAD.name][sender.layer][index]))
        # Every later attention and MLP output is frozen to the base run's (the sender's own
        # layer keeps a head sender's attention output, and an MLP sender's MLP is the donor's).
        for later in range(max(sender.layer, 0), adapter.n_layers):
            if later > sender.layer:
                ops.append(Op(ATTN, later, ATTN.index(prompt), base.sites[ATTN.name][later]))
            mlp = donor if (later == sender.layer and sender.site is MLP) else base
            ops.append(Op(MLP, later, MLP.index(prompt), mlp.sites[MLP.name][later]))
        start = max(sender.layer, 0)
        if receiver.site is LOGITS:
            return Cell(row, col, seed, start=start, ops=ops)
        site, index, writes = self._receiver(receiver, prompt)
        ops.append(Op(site, receiver.layer, index))

        def then(recorded: list[torch.Tensor], row=row, col=col, seed=seed) -> Cell:
            return Cell(row, col, seed, start=receiver.layer,
                        ops=[Op(site, receiver.layer, index, recorded[0]), *writes])

        return Cell(row, col, seed, start=start, ops=ops, then=then)

    def _receiver(self, receiver: Node, prompt: slice) -> tuple[Any, tuple, list[Op]]:
        """``(site, index, other writes)`` of a receiver's exact patch: where it reads, and for a
        grouped-query key or value the group's other query heads kept at the base run's ``z``."""
        adapter, base = self.adapter, self.base.capture
        if receiver.site is MLP_IN:
            return MLP_IN, MLP_IN.index(prompt), []
        module, lo, hi = adapter.qkv_columns(receiver.which, receiver.head)
        site = projection(module, adapter.qkv.index(module))
        index = site.index(prompt, width=slice(lo, hi))
        group = adapter.n_heads // max(1, adapter.n_kv_heads)
        others = []
        if receiver.which != QKV[0] and group > 1:  # a key or a value, shared by the group
            first_head = receiver.head // group * group
            for head in range(first_head, first_head + group):
                if head != receiver.head:
                    at = HEAD.head_index(adapter, head, prompt)
                    others.append(Op(HEAD, receiver.layer, at, base.sites[HEAD.name][receiver.layer][at]))
        return site, index, others


def _mean_change(values: list[float], corrupt: list[float]) -> float:
    """An edge's exact value: each pair's patched metric minus that pair's corrupt one, averaged
    over the pairs (what a checked edge stores, and what a click shows)."""
    return sum(v - c for v, c in zip(values, corrupt)) / len(values)


class _Gradients(Work):
    """Row ``i``: the gradient pass of pair ``i`` (:data:`~pipatch._programs.circuit.EDGE_TERMS`),
    its edge terms added to :attr:`total` ([receivers, senders], float64)."""

    stage = "scoring"

    def __init__(self, runs: list[tuple[Any, Capture, Capture]], steps: int, edge_graph: Any):
        super().__init__(VIEW, len(runs))
        self.runs, self.steps, self.edge_graph = runs, steps, edge_graph
        self.total = torch.zeros(edge_graph.valid.shape, dtype=torch.float64)

    def describe(self, row: int) -> str:
        return f"the gradient pass of pair {row + 1} of {self.n_rows}"

    def run(self, backend: Any, row: int, items: range) -> Any:
        pair, clean_run, corrupt_run = self.runs[row]
        return edge_terms(backend, EdgeTermsRequest(pair.clean_ids, pair.corrupt_ids, pair.metric, clean_run,
                                                    corrupt_run, self.steps))

    def store(self, result: Any, row: int, items: range, value: Any) -> None:
        writes, grads = value
        self.total += torch.einsum("rtd,std->rs", self.edge_graph.stack_gradients(grads).double(),
                                   self.edge_graph.stack_writes(writes).double())


class _CircuitPlan(Plan):
    """A circuit's work through the engine: the gradient passes (one :class:`_Gradients` row a
    pair; none with given scores), then the exact patches of the top edges (their sweeps made
    from the scores), then the faithfulness curve (:class:`_Curve`: each point made from the
    curve so far). Each task is made when the plan's generator is resumed, after the work it
    reads has run (:meth:`~pipatch._engine.Plan.tasks`). The checks' means and agreement are
    summarised at the end. A click on grid cell (receiver, sender) runs that edge's exact patch
    on the first pair."""

    def __init__(self, *args: Any, runs: list[tuple[Any, Capture, Capture]], clicks: list[_EdgeSweep],
                 edge_graph: Any, verify: int, gradients: _Gradients | None, curve: _Curve | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._runs, self._clicks, self._graph, self._verify = runs, clicks, edge_graph, verify
        self._gradients, self._curve = gradients, curve
        self.scores = torch.full(edge_graph.valid.shape, float("nan"))  # the edge scores, once known

    def stages(self) -> dict[str, int]:
        """``scoring``: a gradient pass per pair (none with given scores); ``checks``: an exact
        patch per checked edge and pair; ``curve``: the faithfulness curve's runs, a row per
        :data:`SIZES_PER_RUN` sizes then one per bisection step (at most: it may end sooner;
        known once the curve begins)."""
        stages = {} if self._gradients is None else {"scoring": self._gradients.n_rows}
        stages["checks"] = min(self._verify, int(self._graph.valid.sum())) * len(self._runs)
        if self._curve is not None:
            stages["curve"] = self._curve.n_rows
        return stages

    def scored(self, scores: torch.Tensor) -> None:
        """The edge scores known ([receivers, senders]): the grid, the edges to check and their
        sweeps (one per pair)."""
        result, senders, receivers, valid = self.result, self._graph.senders, self._graph.receivers, self._graph.valid
        scores[~valid] = float("nan")
        self.scores = scores
        result.raw[VIEW] = (result.corrupt + scores).unsqueeze(0)
        result.rows_done[VIEW] = len(receivers)
        flat = scores.abs().nan_to_num(-1.0).flatten()
        order = flat.argsort(descending=True, stable=True)[: min(self._verify, int(valid.sum()))].tolist()
        chosen = [divmod(i, len(senders)) for i in order]  # (receiver, sender)
        result.meta["checked"] = [{"sender": senders[s].name, "receiver": receivers[r].name,
                                   "estimate": float(scores[r, s]), "exact": None, "exact_runs": [None] * len(self._runs)}
                                  for r, s in chosen]
        edges = [(senders[s], receivers[r]) for r, s in chosen]
        self.sweeps = [replace(click, edges=edges, n_rows=len(edges)) for click in self._clicks] if edges else []

    def tasks(self) -> Iterator[tuple[Any, int]]:
        gradients = self._gradients
        if gradients is not None:
            for row in range(gradients.n_rows):
                yield gradients, row
            self.scored((gradients.total / gradients.n_rows).float())
        yield from super().tasks()
        if self._curve is not None:
            curve = self._curve
            curve.rank(self.scores)
            for row in curve.rows():
                yield curve, row
            self.result.meta["faithfulness"] = curve.state(curve.size)

    def predictor(self) -> Predictor:
        """A click on (receiver, sender): that edge's exact patch, its top tokens on the first
        pair and its change of the metric over every pair (``exact``, as a checked edge's)."""
        clicks, senders, receivers, valid = self._clicks, self._graph.senders, self._graph.receivers, self._graph.valid
        corrupt = self.result.meta["corrupt_runs"]

        def one(pair: int, row: int, col: int) -> tuple[Sweep, Cell]:
            if not valid[row, col]:
                raise PipatchError(f"there is no edge from {senders[col].name} to {receivers[row].name}: a receiver "
                                   "reads only what is written before it")
            sweep = replace(clicks[pair], edges=[(senders[col], receivers[row])], n_rows=1)
            return sweep, sweep.cell(0, 0, 0)

        def measure(predictor: Predictor, view: str, row: int, col: int) -> dict[str, Any]:
            values = predictor.values([one(pair, row, col) for pair in range(len(clicks))])
            return {"exact": _mean_change(values, corrupt), "exact_pairs": len(values)}

        return Predictor(self.backend, {}, lambda view, row, col, seed: one(0, row, col), measure)

    def finish(self) -> None:
        result = self.result
        checked = result.meta.get("checked", [])
        corrupt = result.meta["corrupt_runs"]
        for entry in checked:
            runs = entry["exact_runs"]
            entry["exact"] = _mean_change(runs, corrupt) if None not in runs else None
        rows = [e for e in checked if e["exact"] is not None]
        if len(rows) >= 2:
            estimates = torch.tensor([e["estimate"] for e in rows], dtype=torch.float64)
            exact = torch.tensor([e["exact"] for e in rows], dtype=torch.float64)
            result.meta["agreement"] = {"spearman": spearman(estimates, exact),
                                        "max_abs_error": float((estimates - exact).abs().max()), "n": len(rows)}
            advice = low_agreement_advice(result.meta)
            if advice is not None:
                result.warnings.append(advice)


# --------------------------------------------------------------------------------------------
# Faithfulness
# --------------------------------------------------------------------------------------------

def _share(value: Any) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise PipatchError(f"share {value!r} is not a number: use a fraction such as 0.8") from None
    if not 0 < share <= 1:
        raise PipatchError(f"share {share} is not in (0, 1]: the share of the clean behaviour a circuit must recover, "
                           "such as 0.8")
    return share


#: Curve sizes measured per row of the curve (one request a pair: the live view's curve
#: grows by this many at a time).
SIZES_PER_RUN = 4


class _Curve(Work):
    """The faithfulness curve: the circuit of the top-n edges (by |score|), every other edge
    ablated to its corrupt value (or to the mean, ``means``), as normalized recovery for
    ``points`` sizes in all (fewer only where the graph has fewer): a grid from 0 to every edge
    (spaced geometrically, :data:`SIZES_PER_RUN` a row), then the smallest size reaching
    ``share`` narrowed by bisection between the grid's points, a row each, then, where the
    bisection closed sooner, the widest gaps of the curve filled (:meth:`rows`,
    :func:`curve_points`). ``runs`` holds each pair's inputs and the clean run's embedding
    output (its baselines, captured by the planner). :attr:`~pipatch.Result.meta`'s
    ``faithfulness`` is the curve so far after each row, ``size`` ``None`` until it is known."""

    stage = "curve"

    def __init__(self, runs: list[tuple[Any, torch.Tensor]], means: Baselines | None, valid: torch.Tensor, points: int,
                 share: float, clean_value: float, corrupt_value: float):
        super().__init__(VIEW, 0)
        self.runs, self.means, self.valid, self.points, self.share = runs, means, valid, points, share
        self.clean_value, self.corrupt_value = clean_value, corrupt_value
        self.curve: dict[int, float] = {}
        self.sizes: list[list[int]] = []  # each row's sizes
        self.size: int | None = None
        self.order = torch.zeros(0, dtype=torch.long)

    def rank(self, scores: torch.Tensor) -> None:
        """Rank the edges by ``scores`` (by |score|, the largest first): the circuits' order."""
        self.order = scores.abs().nan_to_num(-1.0).flatten().argsort(descending=True, stable=True)[: int(self.valid.sum())]
        self.n_rows = -(-len(self.grid) // SIZES_PER_RUN) + curve_points(self.points)[1]  # at most

    @property
    def grid(self) -> list[int]:
        return grid_sizes(len(self.order), curve_points(self.points)[0])

    def rows(self) -> Iterator[int]:
        """The curve's rows, each made once the rows before it have run: the grid's points
        :data:`SIZES_PER_RUN` at a time, then the bisection's points, one at a time, then the
        points the bisection left (the widest gaps' middles, :data:`SIZES_PER_RUN` a row)."""
        grid, curve, share = self.grid, self.curve, self.share
        for lo in range(0, len(grid), SIZES_PER_RUN):
            self.sizes.append(grid[lo : lo + SIZES_PER_RUN])
            yield len(self.sizes) - 1
        reached = [n for n in grid if curve[n] >= share]
        size = reached[0] if reached else None
        if size:
            below = max(n for n in grid if n < size)
            for _ in range(curve_points(self.points)[1]):
                if size - below <= 1:
                    break
                mid = (below + size) // 2
                self.sizes.append([mid])
                yield len(self.sizes) - 1
                below, size = (below, mid) if curve[mid] >= share else (mid, size)
        self.size = size
        left = gap_middles(sorted(curve), self.points - len(curve))
        for lo in range(0, len(left), SIZES_PER_RUN):
            self.sizes.append(left[lo : lo + SIZES_PER_RUN])
            yield len(self.sizes) - 1

    def items(self, row: int) -> int:
        return len(self.sizes[row])

    def describe(self, row: int) -> str:
        return f"the faithfulness curve's circuits of {', '.join(map(str, self.sizes[row]))} edges"

    def masks(self, sizes: list[int]) -> torch.Tensor:
        """The circuits of the top ``sizes`` edges, [len(sizes), receivers, senders] bool."""
        out = torch.zeros(len(sizes), self.valid.numel(), dtype=torch.bool)
        for i, n in enumerate(sizes):
            out[i, self.order[:n]] = True
        return out.reshape(len(sizes), *self.valid.shape)

    def run(self, backend: Any, row: int, items: range) -> torch.Tensor:
        """The metric of each circuit of ``items``, averaged over the pairs (one request a pair)."""
        masks = self.masks([self.sizes[row][i] for i in items])
        value = torch.zeros(len(items), dtype=torch.float64)
        for pair, embedded in self.runs:
            value += circuit_runs(backend, CircuitRunRequest(pair.clean_ids, pair.corrupt_ids, pair.metric, masks,
                                                             embedded=embedded, means=self.means)).double()
        return value / len(self.runs)

    def store(self, result: Any, row: int, items: range, value: torch.Tensor) -> None:
        span = self.clean_value - self.corrupt_value
        for i, v in zip(items, value.tolist()):
            self.curve[self.sizes[row][i]] = (v - self.corrupt_value) / span if span else float("nan")
        result.meta["faithfulness"] = self.state(None)

    def state(self, size: int | None) -> dict[str, Any]:
        sizes = sorted(self.curve)
        return {"sizes": sizes, "recovery": [self.curve[n] for n in sizes], "share": self.share, "size": size,
                "edges": len(self.order), "ablation": "mean" if self.means is not None else "corrupt"}


# --------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------


def _given_scores(value: Any, senders: Sequence[Node], receivers: Sequence[Node]) -> tuple[torch.Tensor, dict[str, Any]]:
    """``scores=``: the edge scores of a circuit computed elsewhere (a circuit's result, or the
    file it was saved to), for a backend that takes no gradients (vLLM, a served model) to
    check and measure: ([receivers, senders], its meta). Its graph must be this model's, node
    for node."""
    found = scored_elsewhere(value, "circuit", CircuitResult)
    theirs = (found.meta.get("senders"), found.meta.get("receivers"))
    if theirs != ([n.name for n in senders], [n.name for n in receivers]):
        raise PipatchError(f"scores=: its circuit has {len(theirs[0] or [])} senders and {len(theirs[1] or [])} "
                           f"receivers, this model {len(senders)} and {len(receivers)}: score the same model "
                           "(its transformers checkpoint) and pass that result")
    return (found.raw[VIEW][0] - found.corrupt).float(), dict(found.meta)


def _pairs(clean: Any, corrupt: Any, answer: Any, foil: Any) -> list[tuple[str, str, Any, Any]]:
    """One pair, or a dataset's (lists of equal length; an answer or foil given once holds for all)."""
    if not isinstance(clean, (list, tuple)):
        return [(clean, corrupt, answer, foil)]
    n = len(clean)
    if not isinstance(corrupt, (list, tuple)) or len(corrupt) != n or n == 0:
        raise PipatchError("for many pairs pass clean and corrupt as lists of the same length (pairs in order)")

    def each(value: Any, what: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise PipatchError(f"{len(value)} {what}s for {n} pairs: pass one {what} per pair, or one for all")
            return list(value)
        return [value] * n

    return list(zip(clean, corrupt, each(answer, "answer"), each(foil, "foil")))


def _mean_prompts(pairs: list[Any]) -> list[torch.Tensor]:
    """Mean ablation's prompts: every pair's clean and corrupt run inputs, which must have one
    length (the mean is taken position by position)."""
    prompts = [p.metric.inputs(ids) for p in pairs for ids in (p.clean_ids, p.corrupt_ids)]
    lengths = sorted({int(ids.shape[1]) for ids in prompts})
    if len(lengths) > 1:
        raise PipatchError(f"ablation='mean' averages each position over the dataset, but its prompts run "
                           f"{lengths[0]} to {lengths[-1]} tokens: pass prompts of one length in tokens "
                           "(pipatch.tasks.ioi(n, template=0, tokenizer=model.tokenizer)) or ablation='corrupt'")
    return prompts


def _check_scoring(backend: Any) -> None:
    """Refuse, in one line naming ``scores=``, a backend that cannot compute edge scores (from
    what :data:`~pipatch._programs.circuit.EDGE_TERMS` needs: a backward pass), or a family whose
    receivers pipatch cannot tell apart."""
    EDGE_TERMS.check(backend)
    check_circuit_family(backend.adapter)


def _curve_runs(backend: Any, pairs: list[Any], mean_of: list[torch.Tensor] | None,
                warnings: list[str]) -> tuple[list[tuple[Any, torch.Tensor]], Baselines | None] | None:
    """The curve's baselines: each pair with its clean run's embedding output, and mean
    ablation's means; ``None``, with one warning in ``warnings``, where the backend cannot run
    a circuit's runs (NDIF, a tensor-parallel engine)."""
    try:
        runs = [(pair, circuit_baselines(backend, pair.metric.inputs(pair.clean_ids)).embedded) for pair in pairs]
        return runs, (circuit_means(backend, mean_of) if mean_of is not None else None)
    except PipatchError as refused:
        warnings.append(f"no faithfulness curve: {refused}")
        return None


def plan_circuit(
    backend,
    *,
    clean: str | Sequence[str],
    corrupt: str | Sequence[str],
    answer: str | Sequence[str],
    foil: str | Sequence[str] | None,
    method: str,
    steps: int | None,
    verify: int | None,
    curve: int | None,
    share: float,
    ablation: str,
    metric: str,
    batch_size: int | None,
    scores: Any = None,
) -> Plan:
    """Capture each pair's clean and corrupt runs (and the curve's baselines); plan the
    gradient passes that score every edge (unless ``scores`` gives the scores), the exact
    patches of the top ones and the faithfulness curve (:class:`_CircuitPlan`).

    ``backend`` runs the model; the other parameters are :func:`pipatch.circuit`'s; ``None``
    for ``steps``, ``verify`` or ``curve`` is the device's default (:data:`~._circuit_budget.DEVICE_DEFAULTS`).
    Before the work, one line on stderr says about how long it takes (:func:`~._circuit_budget.estimate_line`).
    """
    check_choice(method, METHODS, "method")
    check_choice(ablation, ABLATIONS, "ablation")
    device = backend.capabilities.device_kind
    defaults = DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cpu"])
    steps = whole_number(defaults["steps"] if steps is None else steps, "steps (interpolation points of EAP-IG)",
                         minimum=1)
    verify = whole_number(defaults["verify"] if verify is None else verify,
                          "verify (the edges to check with exact patches)", minimum=0)
    curve = whole_number(defaults["curve"] if curve is None else curve,
                         "curve (circuit sizes on the faithfulness curve)", minimum=0)
    if curve == 1:
        raise PipatchError("curve=1: a faithfulness curve needs 2 points at least (no edge and every edge); "
                           "give curve=2 or more, or curve=0 for none")
    share = _share(share)
    adapter = backend.adapter
    pairs = [pair_inputs(backend, *one, metric) for one in _pairs(clean, corrupt, answer, foil)]
    mean_of = _mean_prompts(pairs) if ablation == "mean" and curve else None
    edge_graph = graph(adapter)
    senders, receivers, valid = edge_graph.senders, edge_graph.receivers, edge_graph.valid
    batch = check_batch_size(batch_size, max(p.clean_ids.shape[1] for p in pairs), backend)
    given = _given_scores(scores, senders, receivers) if scores is not None else None
    if given is None:
        _check_scoring(backend)
    else:
        method, steps = given[1].get("method", method), int(given[1].get("steps", steps))

    runs: list[tuple[Any, Capture, Capture]] = []
    started = time.perf_counter()
    for pair in pairs:
        clean_run, corrupt_run = captures(backend, [pair.clean_ids, pair.corrupt_ids], pair.metric, [HEAD, ATTN, MLP])
        runs.append((pair, clean_run, corrupt_run))
    estimate = estimate_line((time.perf_counter() - started) / (2 * len(pairs)), len(pairs), device_name(backend),
                             method, None if given is not None else (steps if method == "eap-ig" else 1),
                             min(verify, int(valid.sum())), min(curve, int(valid.sum()) + 1))
    cleans = [float(clean_run.metric[0]) for _, clean_run, _ in runs]
    corrupts = [float(corrupt_run.metric[0]) for _, _, corrupt_run in runs]
    clean_value, corrupt_value = sum(cleans) / len(cleans), sum(corrupts) / len(corrupts)

    first = pairs[0]
    meta = model_meta(backend)
    meta.update({
        **first.meta(backend), "site": VIEW, "col_axis": "sender", "direction": "denoise", "method": method,
        "steps": steps if method == "eap-ig" else 1, "n_pairs": len(pairs), "ablation": ablation,
        "senders": [s.name for s in senders], "receivers": [r.name for r in receivers],
        "corrupt_runs": corrupts, "clean_runs": cleans,
        "estimate": "EAP: (clean − corrupt) sender write · d metric / d receiver input, at the corrupt run"
                    + (f", averaged over {steps} points towards the clean input (EAP-IG)" if method == "eap-ig" else "")
                    + (f"; scored on {given[1].get('backend')} (scores=), checked here" if given is not None else ""),
    })
    if given is not None:
        meta["scores_from"] = {k: given[1].get(k) for k in ("model", "backend", "dtype", "method", "steps")}
    if len(pairs) > 1:
        meta["pairs"] = [{"clean": p.clean, "corrupt": p.corrupt, "answer": p.answer, "foil": p.foil} for p in pairs]
    meta["checked"] = []  # the top edges, once the scores are in
    warnings = undefined_recovery_warning(first.metric.label, clean_value, corrupt_value)
    faithful = None
    if curve and (baselines := _curve_runs(backend, pairs, mean_of, warnings)) is not None:
        faithful = _Curve(*baselines, valid, curve, share, clean_value, corrupt_value)
    result = CircuitResult(
        kind="circuit", tokens=first.clean_tokens, columns=[s.name for s in senders],
        layers=[r.name for r in receivers], metric=first.metric.label,
        raw={VIEW: torch.full((1, *valid.shape), float("nan"))}, clean=clean_value,
        corrupt=torch.tensor([corrupt_value]), meta=meta, warnings=warnings, rows_done={VIEW: 0},
    )
    # One sweep per pair: a click's (no rows: it patches the edge clicked); the checks' are
    # made from it once the scores are in.
    clicks = [_EdgeSweep(view=VIEW, base=Base(pair.corrupt_ids, corrupt_run), metric=pair.metric, n_rows=0, n_cols=1,
                         adapter=adapter, donor=clean_run, edges=[], pair=i)
              for i, (pair, clean_run, corrupt_run) in enumerate(runs)]
    gradients = None if given is not None else _Gradients(runs, steps if method == "eap-ig" else 1, edge_graph)
    plan = _CircuitPlan(backend, result, [], batch, True, runs=runs, clicks=clicks, edge_graph=edge_graph,
                        verify=verify, gradients=gradients, curve=faithful)
    if given is not None:
        plan.scored(given[0])
    plan.estimate = estimate
    return plan


# --------------------------------------------------------------------------------------------
# The declaration
# --------------------------------------------------------------------------------------------


def _title(meta: dict) -> str:
    how = f"{meta.get('method', 'eap-ig')}" + (f", {meta['n_pairs']} pairs" if meta.get("n_pairs", 1) > 1 else "")
    pairs = meta.get("pairs") or []
    if len(pairs) < 2:
        return pair_title("Circuit", meta, how)
    # A dataset: its answers and foils, not the first pair's alone.
    foils = _some(pairs, "foil")
    return f"Circuit ({how}) · {meta.get('model', '?')} · answers {_some(pairs, 'answer')}" + (f" vs {foils}" if foils else "")


def _some(pairs: list[dict], key: str, shown: int = 3) -> str:
    """The distinct values of ``key`` over the pairs, the first ``shown`` of them and how many more
    (``""``: none)."""
    values = list(dict.fromkeys(repr(p.get(key)) for p in pairs if p.get(key)))
    more = f" +{len(values) - shown} more" if len(values) > shown else ""
    return ", ".join(values[:shown]) + more


def _by_device(option: str) -> str:
    """``option``'s defaults in words, from :data:`~._circuit_budget.DEVICE_DEFAULTS`."""
    return f"by default {DEVICE_DEFAULTS['cuda'][option]} on a GPU, {DEVICE_DEFAULTS['cpu'][option]} on a CPU"


DECLARATION = Experiment(
    name="circuit", kind="circuit", noun="circuit",
    summary="Circuits: every edge scored by EAP / EAP-IG, the top ones checked by exact edge patches.",
    planner=plan_circuit, prompts=PAIR, title=_title, whole_dataset=True,
    params=(
        *PAIR_PARAMS,
        Param("method", "eap-ig", "eap-ig (gradients averaged over steps points between corrupt and clean) or eap "
              "(the corrupt run's gradient)", "str"),
        Param("steps", None, f"EAP-IG's interpolation points (1: EAP; {_by_device('steps')})", "int | None",
              parse=positive_int, shown="by device"),
        Param("verify", None, "check the N edges with the largest |estimate| with exact edge patches (0: none; "
              f"{_by_device('verify')})", "int | None", parse=count, shown="by device"),
        Param("curve", None, "circuit sizes on the faithfulness curve, N points in all (the smallest circuit reaching "
              "share narrowed among them): the top-n edges kept, every other edge given its corrupt value (0: no "
              f"curve; {_by_device('curve')})", "int | None", parse=count, shown="by device"),
        Param("ablation", "corrupt", "what an edge outside the circuit carries on the faithfulness curve: corrupt (its "
              "corrupt value) or mean (its mean over the dataset's prompts, position by position)", "str"),
        Param("share", 0.8, "the share of the clean behaviour (normalized recovery) the smallest circuit reported must "
              "reach", "float", parse=float),
        METRIC, BATCH_SIZE,
        Param("scores", None, "the edge scores of a circuit computed elsewhere (its result, or the file it was saved "
              "to): a model that takes no gradients (vLLM, served) checks them with exact patches", "Result | str | None",
              shown="computed here"),
    ),
    example='%%circuit --answer " Mary" --foil " John" --verify 10 -o circ\n'
            "clean: When Mary and John went to the store, John gave a drink to\n"
            "corrupt: When Mary and John went to the store, Mary gave a drink to",
    code=_circuit_code.circuit_code, code_inputs=_circuit_code.circuit_inputs,
    doc="""
    See :mod:`pipatch._experiments.circuits` for the graph, the scores and the checks.

    Returns
    -------
    CircuitResult
        ``kind="circuit"``; ``raw["edges"]`` ([1, receivers, senders]) holds
        ``corrupt metric + estimated change`` (NaN where there is no edge) and ``result.grid``
        its normalized recovery; ``result.edges()`` is the table (``sender``, ``receiver``,
        ``score``, ``exact``). ``meta["checked"]`` lists the exactly patched edges and
        ``meta["agreement"]`` their rank correlation with the estimates;
        ``meta["faithfulness"]`` the curve (``sizes``, ``recovery``, ``share``, ``size``: the
        smallest circuit reaching the share, or ``None``, ``edges``: how many there are).

    Examples
    --------
    >>> task = pipatch.tasks.ioi(8, seed=0)
    >>> r = pipatch.circuit(model, **task, verify=20)
    >>> r.edges().head()
    """,
)
