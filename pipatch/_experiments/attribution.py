"""Attribution patching: a first-order estimate of a whole patching grid from one backward pass.

Activation patching (:func:`pipatch.patch`) runs the model once per cell. Attribution patching
(Nanda 2023; Syed, Rager & Conmy 2023) replaces every one of those runs by a Taylor
expansion around the corrupt run. Write the metric as a function of one site's activation,
``M(a)``. Patching the clean activation into the corrupt run moves the metric by

.. math::

    M(a_{clean}) - M(a_{corrupt}) \\approx \\nabla_a M \\big|_{a_{corrupt}} \\cdot (a_{clean} - a_{corrupt})

and the gradient at the corrupt run is the same for every cell. So one clean forward (for
``a_clean`` at every site), one corrupt forward and one backward pass (for ``a_corrupt`` and the
gradient at every site) give the estimate for every cell at once:

* ``site="resid" | "attn" | "mlp"``: cell ``(layer, position)`` is
  ``sum_d grad[layer, position, d] * (clean − corrupt)[layer, position, d]`` — the dot product
  over the hidden dimension at that position;
* ``site="head"``: cell ``(layer, head)`` is the same product summed over that head's slice of
  ``z`` (the attention output projection's input) and over ``positions`` (all by default).

The estimate is linear in a non-linear model. It is good where a patch moves the model a
little (most cells) and unreliable where it moves it a lot — exactly the cells one cares
about — and it misses saturation (a LayerNorm or softmax that flattens a large change).
The standard use is as a filter: screen every cell cheaply, then verify the top candidates
with real patches. ``verify=k`` does that for the ``k`` cells with the largest estimated
effect and keeps both numbers, so the result says how far the estimate can be trusted.

The result is the same :class:`~pipatch.Result` as :func:`pipatch.patch` returns
(``kind="attribution"``), with ``raw = corrupt metric + estimated change``: normalized recovery
``(estimate − corrupt) / (clean − corrupt)`` reads on the same scale as a patching grid
(denoising: 0 is the corrupt run, 1 the clean run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from string import Template
from typing import Any

import torch

from .._base.checks import whole_number
from .._engine import Plan, SiteSweep, check_batch_size
from .._model.cells import Base, Cell
from .._model.declare import PAIR, Experiment, Param, count
from .._model.models import Adapter
from .._model.sites import Site
from .._model.sites import site as site_named
from .._programs.capture import capture
from .._programs.gradients import gradients
from .._results import code as _code
from .._results.result import Result
from ._inputs import (
    BATCH_SIZE,
    METRIC,
    PAIR_PARAMS,
    POSITIONS,
    SITE,
    layer_labels,
    model_meta,
    pair_title,
    sweep_positions,
    undefined_recovery_warning,
)
from .patching import pair_inputs

__all__ = ["plan_attribute", "spearman", "Checks", "VerifiedPlan", "DECLARATION"]


def plan_attribute(
    backend,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None,
    site: str,
    metric: str,
    verify: int,
    positions: Sequence[int] | None,
    batch_size: int | None,
) -> Plan:
    """Estimate every cell from two forwards and one backward; plan the verification patches.

    ``backend`` runs the model; the other parameters are :func:`pipatch.attribute`'s. The
    estimate is computed here (the result's grid is complete when the plan is returned); running
    the plan patches the ``verify`` cells with the largest estimated effect for real.
    """
    verify = whole_number(verify, "verify (the cells to check with real patches)", minimum=0)
    adapter = backend.adapter
    target = site_named(site, adapter)
    pair = pair_inputs(backend, clean, corrupt, answer, foil, metric)
    T = pair.clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T, backend)
    scorer = pair.metric

    clean_run = capture(backend, pair.clean_ids, scorer, [target])
    corrupt_acts, grads, corrupt_value = gradients(backend, pair.corrupt_ids, scorer, target)
    clean_value = float(clean_run.metric[0])

    columns = target.columns(adapter, pair.clean_tokens, cols)
    delta = torch.zeros(adapter.n_layers, len(columns))
    for layer in range(adapter.n_layers):
        diff = clean_run.sites[target.name][layer][0].float() - corrupt_acts[layer][0].float()  # [T, width]
        product = (grads[layer][0].float() * diff)[cols]
        if target.per_head:
            delta[layer] = product.reshape(len(cols), adapter.n_heads, adapter.head_dim).sum(dim=(0, 2))
        else:
            delta[layer] = product.sum(-1)

    meta = model_meta(backend)
    meta.update({
        **pair.meta(backend), "site": target.name, "col_axis": target.axis, "direction": "denoise", "positions": cols,
        "estimate": "attribution patching: grad(metric) at the corrupt run · (clean − corrupt) activation",
    })
    result = Result(
        kind="attribution", tokens=pair.clean_tokens, columns=columns, layers=layer_labels(backend), metric=scorer.label,
        raw={target.name: (corrupt_value + delta).unsqueeze(0)}, clean=clean_value,
        corrupt=torch.tensor([corrupt_value]), meta=meta,
        warnings=undefined_recovery_warning(scorer.label, clean_value, corrupt_value),
        rows_done={target.name: adapter.n_layers},
    )
    k = min(verify, delta.numel())
    order = delta.abs().flatten().argsort(descending=True, stable=True)[:k].tolist()
    chosen = [(i // len(columns), i % len(columns)) for i in order]
    # The corrupt run's cached blocks (reused below each patch, by verification and by clicks on
    # any cell) come from a plain capture: the gradient run keeps only the site values.
    base = capture(backend, pair.corrupt_ids, scorer, [target])
    sweep = _VerifySweep(view=target.name, base=Base(pair.corrupt_ids, base), metric=scorer,
                         n_rows=adapter.n_layers, n_cols=len(columns), only=set(chosen), site=target, adapter=adapter,
                         donor=clean_run.sites[target.name], columns=cols, positions=cols)
    if k:
        meta["verified"] = {target.name: [[0.0] * len(columns) for _ in range(adapter.n_layers)]}
        meta["verified_values"] = [{"layer": row, "col": col, "estimate": corrupt_value + float(delta[row, col]),
                                    "actual": None} for row, col in chosen]
    return VerifiedPlan(backend, result, [sweep], batch, True)


class Checks:
    """A sweep of exact checks (a mixin before a :class:`~pipatch._engine.Sweep`): its cells'
    values go to ``meta["verified_values"]`` beside their estimates, and ``meta["verified"]``
    marks them, not into the estimate grid. Attribution's and a feature patch's checks."""

    stage = "checks"
    view: str

    @property
    def tracks_rows(self) -> bool:
        return False

    def store(self, result: Any, cell: Cell, value: float) -> None:
        for entry in result.meta["verified_values"]:  # a feature trace's checks run once per noise seed
            if (entry["layer"], entry["col"], entry.get("seed", 0)) == (cell.row, cell.col, cell.seed):
                entry["actual"] = value
        result.meta["verified"][self.view][cell.row][cell.col] = 1.0


@dataclass
class _VerifySweep(Checks, SiteSweep):
    """Real denoising patches of the chosen cells; values go to ``meta``, not the estimate grid."""


class VerifiedPlan(Plan):
    """A plan whose checks (real patches of screened cells) run like any sweep's rows and
    whose agreement with the screening is summarised at the end: ``meta["agreement"]`` from
    ``meta["verified_values"]`` (attribution's ``verify=``, a feature sweep's exact cells)."""

    def finish(self) -> None:
        result = self.result
        rows = [r for r in result.meta.get("verified_values", []) if r["actual"] is not None]
        if not rows:
            return
        estimates = torch.tensor([r["estimate"] for r in rows], dtype=torch.float64)
        actuals = torch.tensor([r["actual"] for r in rows], dtype=torch.float64)
        error = float((estimates - actuals).abs().max())
        span = result.clean - result.corrupt
        result.meta["agreement"] = {
            "spearman": spearman(estimates, actuals),
            "max_abs_error": error,
            "max_abs_error_recovery": error / abs(span) if span else float("nan"),
            "n": len(rows),
        }


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1, ties sharing their mean rank (so exact zeros do not get arbitrary order)."""
    order = torch.argsort(x, stable=True)
    ordered = x[order]
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    start = 0
    n = x.numel()
    while start < n:
        end = start
        while end + 1 < n and ordered[end + 1] == ordered[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2
        start = end + 1
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two equal-length vectors (NaN if fewer than 2 or constant)."""
    a, b = a.flatten().double(), b.flatten().double()
    keep = ~(torch.isnan(a) | torch.isnan(b))
    a, b = a[keep], b[keep]
    if a.numel() < 2:
        return float("nan")
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return float((ra * rb).sum()) / denom if denom else float("nan")


# --------------------------------------------------------------------------------------------
# The declaration, and its part of ``Result.code()``'s script
# --------------------------------------------------------------------------------------------

_ATTRIBUTE = Template('''

SITE = $site


def attribution(clean_prompt, corrupt_prompt, answer, foil, positions):
    """Attribution patching: every cell of a denoising grid estimated to first order,
    metric(clean act) − metric(corrupt act) ≈ grad · (clean − corrupt), the gradient taken once
    at the corrupt run. Two forwards and one backward. Returns ({SITE: corrupt metric +
    estimate [1, layers, columns]}, clean metric, corrupt metric [1])."""
$baselines\
    # The corrupt run with gradients. The embedding output becomes a leaf that needs a gradient
    # and the backward stops there: activations get gradients, the weights none.
    with torch.enable_grad(), model.trace(corrupt_ids, **LAST_ONLY):
        embed = model.$embed
        leaf = embed.output.detach().requires_grad_(True)
        embed.output = leaf
        acts = [site(SITE, layer) for layer in range(n_layers)]
        corrupt_acts = nnsight.save([act.detach().clone() for act in acts])
        value = metric(model.output.logits[0, -1], answer, foil)
        corrupt = value.detach().save()
        grads = nnsight.save([])
        with value.backward(inputs=[leaf]):
            for act in reversed(acts):  # nnsight serves gradients in reverse forward order
                grads.append(act.grad.detach().clone())
    grads = list(grads)[::-1]

    raw = torch.zeros(1, n_layers, $n_columns)
    for layer in range(n_layers):
        product = (grads[layer][0].float() * (clean_acts[layer][0].float() - corrupt_acts[layer][0].float()))[positions]
$estimate
    return {SITE: raw}, clean, corrupt.reshape(1)
''')


def _code_part(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Attribution patching's part of ``Result.code()``'s script (assembled by
    :func:`pipatch._results.code.script`): the name of the script's function, its code, the site it
    reads and a summary for the script's docstring.

    ``attribution`` runs the clean prompt, then the corrupt one with gradients (the embedding
    output made a leaf, so the backward reaches activations, never weights), and writes every
    cell as gradient × (clean − corrupt) summed over the width (a head: over its slice of ``z``
    and the positions).
    """
    target, heads, n_columns, _ = _code.pair_site(result)
    estimate = ("        raw[0, layer] = corrupt + product.reshape(len(positions), N_HEADS, HEAD_DIM).sum(dim=(0, 2))"
                if heads else "        raw[0, layer] = corrupt + product.sum(-1)")
    code = _ATTRIBUTE.substitute(site=repr(target.name), baselines=_code.PAIR_BASELINES, n_columns=n_columns,
                                 embed=_code.dotted_path(adapter.embed, "embedding"), estimate=estimate)
    summary = ("attribution patching, gradient × (clean − corrupt) activation at every cell from two\n"
               "forwards and one backward, as normalized recovery.")
    return "attribution", code, [target], summary


def _title(meta: dict) -> str:
    how = f"{meta.get('direction', 'denoise')}, {meta.get('site', 'resid')}"
    return pair_title("Attribution patching (estimate)", meta, how)


DECLARATION = Experiment(
    name="attribute", kind="attribution", noun="attribution patching",
    summary="Attribution patching: a first-order estimate of every patch from 2 forwards and 1 backward.",
    planner=plan_attribute, prompts=PAIR, title=_title,
    params=(
        *PAIR_PARAMS,
        replace(SITE, help="resid, attn, mlp or head; the gradient is taken at this site"),
        METRIC,
        Param("verify", 0, "how many cells to check with real patches, largest |estimated change| first, keeping "
              "both numbers (0: estimate only)", "int", parse=count,
              single="verify checks cells of one clean/corrupt pair: pass one pair, or verify=0 for a list"),
        replace(POSITIONS, help="the positions (columns) to estimate (for site head: the positions summed over "
                "for each head)"),
        BATCH_SIZE,
    ),
    example='%%attribute --answer " Paris" --foil " Rome" --site head --verify 5 -o attr\n'
            "clean: The Eiffel Tower is in the city of\n"
            "corrupt: The Colosseum is in the city of",
    doc="""
    See :mod:`pipatch._experiments.attribution` for the method and its limits.

    Returns
    -------
    Result
        ``kind="attribution"``; ``raw[site]`` is tensor[1, layers, columns] of
        ``corrupt metric + estimated change`` and ``result.grid`` its normalized recovery,
        comparable cell by cell with ``pipatch.patch(..., site=site).grid``. With
        ``verify=k``: ``meta["verified"][site]`` (a [layers, columns] 0/1 mask),
        ``meta["verified_values"]`` (``{"layer", "col", "estimate", "actual"}`` in raw metric
        units, largest estimated effect first) and ``meta["agreement"]`` (``spearman``,
        ``max_abs_error``, ``max_abs_error_recovery``, ``n``).

    Examples
    --------
    >>> r = pipatch.attribute(model, clean="The Eiffel Tower is in the city of",
    ...                       corrupt="The Colosseum is in the city of",
    ...                       answer=" Paris", foil=" Rome", site="head", verify=5)
    >>> r.meta["agreement"]
    """,
    code=_code_part, code_inputs=_code.pair_inputs,
)
