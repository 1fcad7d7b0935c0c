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

import torch

from .._engine import METRICS, Metric, Sweep, _Cell, _run_trace, capture
from .._models import PipatchError, adapter_for, first
from .._result import Result
from ._inputs import SITES, check_choice, layer_labels, model_meta, sweep_positions
from .patching import pair_inputs

__all__ = ["attribute", "spearman"]


def attribute(
    model,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None = None,
    site: str = "resid",
    metric: str = "logit_diff",
    verify: int = 0,
    positions: Sequence[int] | None = None,
) -> Result:
    """Estimate every cell of a denoising patching grid from two forwards and one backward.

    Parameters
    ----------
    clean, corrupt
        Prompts of equal token length (as for :func:`pipatch.patch`).
    answer, foil
        Single tokens; ``foil`` is required for ``metric="logit_diff"``.
    site
        ``"resid"`` (block output), ``"attn"`` / ``"mlp"`` (sublayer output) or ``"head"``
        (one head's slice of ``z``).
    metric
        ``"logit_diff"`` (default), ``"prob"`` or ``"logprob"``; the gradient is taken of this.
    verify
        Run real patches for the ``verify`` cells with the largest ``|estimated change|`` and
        keep both numbers (see Returns). ``0``: estimate only.
    positions
        Position sweeps: the positions (columns) to estimate, default all. ``site="head"``:
        the positions summed over for each head (a head patched at these positions), default
        all.

    Returns
    -------
    Result
        ``kind="attribution"``; ``raw[site]`` is tensor[1, layers, columns] of
        ``corrupt metric + estimated change`` and ``result.grid`` its normalized recovery,
        comparable cell by cell with ``pipatch.patch(..., site=site).grid``.
        ``meta["estimate"]`` notes the method. With ``verify=k``:

        * ``meta["verified"][site]``: [layers, columns] 0/1 list, 1 where a real patch ran
          (a front end marks those cells);
        * ``meta["verified_values"]``: ``[{"layer", "col", "estimate", "actual"}, ...]`` in raw
          metric units, largest estimated effect first;
        * ``meta["agreement"]``: ``{"spearman": rank correlation of estimate and actual over
          the verified cells, "max_abs_error": max |estimate − actual| (raw units),
          "max_abs_error_recovery": the same in normalized-recovery units, "n": k}``.

    Notes
    -----
    Cost: one clean forward, one corrupt forward with gradient tracking, one backward (no
    parameter gradients are computed: the backward runs only down to the embedding output).
    Verification adds one corrupt baseline forward (the engine's cached run) and ``k`` patched
    runs, batched per layer as invokes of one trace.

    Examples
    --------
    >>> r = pipatch.attribute(model, clean="The Eiffel Tower is in the city of",
    ...                       corrupt="The Colosseum is in the city of",
    ...                       answer=" Paris", foil=" Rome", site="head", verify=5)
    >>> r.meta["agreement"]
    """
    check_choice(site, SITES, "site")
    check_choice(metric, METRICS, "metric")
    if not isinstance(verify, int) or isinstance(verify, bool) or verify < 0:
        raise PipatchError(f"verify must be a non-negative integer (cells to check with real patches), got {verify!r}")
    adapter = adapter_for(model)
    adapter.site_module(model, site, 0)  # refuses sublayer sites a family cannot patch
    pair = pair_inputs(model, clean, corrupt, answer, foil, metric)
    clean_ids, clean_tokens, corrupt_ids, corrupt_tokens = pair.clean_ids, pair.clean_tokens, pair.corrupt_ids, pair.corrupt_tokens
    answer_id, foil_id = pair.metric.answer, pair.metric.foil
    T = clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    scorer = pair.metric

    clean_run = capture(model, clean_ids, scorer, sites=(site,))
    corrupt_acts, grads, corrupt_value = _gradients(model, corrupt_ids, scorer, site)
    clean_value = float(clean_run.metric[0])

    delta = torch.zeros(adapter.n_layers, adapter.n_heads if site == "head" else len(cols))
    for layer in range(adapter.n_layers):
        diff = clean_run.sites[site][layer][0].float() - corrupt_acts[layer][0].float()  # [T, width]
        product = grads[layer][0].float() * diff
        if site == "head":
            per_head = product[cols].reshape(len(cols), adapter.n_heads, adapter.head_dim)
            delta[layer] = per_head.sum(dim=(0, 2))
        else:
            delta[layer] = product[cols].sum(-1)

    if site == "head":
        columns = [f"H{h}" for h in range(adapter.n_heads)]
    else:
        columns = [clean_tokens[p] for p in cols]
    raw = {site: (corrupt_value + delta).unsqueeze(0)}
    meta = model_meta(model)
    meta.update({
        "clean_prompt": clean, "corrupt_prompt": corrupt, "clean_tokens": clean_tokens,
        "corrupt_tokens": corrupt_tokens, "answer": answer, "foil": foil, "answer_id": answer_id,
        "foil_id": foil_id, "site": site, "direction": "denoise", "positions": cols,
        "estimate": "attribution patching: grad(metric) at the corrupt run · (clean − corrupt) activation",
    })
    warnings = []
    if abs(clean_value - corrupt_value) <= 1e-6 + 1e-3 * max(abs(clean_value), abs(corrupt_value)):
        warnings.append(
            f"clean and corrupt give (almost) the same {metric} ({clean_value:.4g} vs {corrupt_value:.4g}): "
            "normalized recovery is undefined (NaN); raw values are kept — pick prompts that change the answer"
        )
    result = Result(
        kind="attribution", tokens=clean_tokens, columns=columns, layers=layer_labels(model), metric=metric,
        raw=raw, clean=clean_value, corrupt=torch.tensor([corrupt_value]), meta=meta, warnings=warnings,
        rows_done={site: adapter.n_layers},
    )
    if verify:
        _verify(model, result, scorer, site, corrupt_ids, clean_run, cols, delta, verify)
    return result


def _gradients(model, input_ids: torch.Tensor, scorer: Metric, site: str):
    """One forward with gradient tracking and one backward on ``input_ids``.

    Returns (site activation per layer [1, T, width], d metric / d activation per layer,
    metric value). The embedding output is swapped for a detached leaf and the backward is
    restricted to it (``inputs=[leaf]``), so autograd walks every activation between the
    embedding and the metric but never computes a parameter gradient: no ``.grad`` is left
    on the model, and a frozen model (``requires_grad=False``) works too.
    """
    adapter = adapter_for(model)
    n_layers = adapter.n_layers
    with torch.enable_grad(), model.trace(**adapter.trace_kwargs) as tracer:
        values = list().save()
        grads = list().save()
        with tracer.invoke(input_ids):
            embedding = adapter.embedding(model)
            leaf = embedding.output.detach().requires_grad_(True)
            embedding.output = leaf
            acts = []
            for layer in range(n_layers):
                module = adapter.site_module(model, site, layer)
                act = module.input if site == "head" else first(module.output)
                acts.append(act)
                values.append(act.detach().clone())
            score = scorer.from_logits(model.output.logits[:, -1])[0]
            value = score.detach().save()
            # nnsight serves .grad in the reverse of the forward order.
            with score.backward(inputs=[leaf]):
                for act in reversed(acts):
                    grads.append(act.grad.detach().clone())
    return list(values), list(reversed(list(grads))), float(value)


def _verify(model, result: Result, scorer: Metric, site: str, corrupt_ids: torch.Tensor, clean_run,
            cols: list[int], delta: torch.Tensor, k: int) -> None:
    """Patch the ``k`` cells with the largest |estimated change| for real; record both numbers."""
    adapter = adapter_for(model)
    n_rows, n_cols = delta.shape
    k = min(k, delta.numel())
    order = delta.abs().flatten().argsort(descending=True, stable=True)[:k].tolist()
    chosen = [(i // n_cols, i % n_cols) for i in order]
    base = capture(model, corrupt_ids, scorer, sites=(site,))
    head = site == "head"
    sweep = Sweep(view=site, site=site, input_ids=corrupt_ids,
                  columns=list(range(adapter.n_heads)) if head else cols,
                  positions=cols if head else [], window=1, base=base, donor=clean_run.sites, metric=scorer)
    actual: dict[tuple[int, int], float] = {}
    for layer in sorted({row for row, _ in chosen}):
        cells = [_Cell(row, col, 0) for row, col in chosen if row == layer]
        with torch.no_grad():
            values = _run_trace(model, adapter, sweep, layer, cells, fast=True)
        for cell, value in zip(cells, values.tolist()):
            actual[(cell.layer, cell.col)] = value
    corrupt_value = float(result.corrupt[0])
    mask = [[0.0] * n_cols for _ in range(n_rows)]
    rows = []
    for row, col in chosen:
        mask[row][col] = 1.0
        rows.append({"layer": row, "col": col, "estimate": corrupt_value + float(delta[row, col]),
                     "actual": actual[(row, col)]})
    estimates = torch.tensor([r["estimate"] for r in rows], dtype=torch.float64)
    actuals = torch.tensor([r["actual"] for r in rows], dtype=torch.float64)
    error = float((estimates - actuals).abs().max())
    span = result.clean - corrupt_value
    result.meta["verified"] = {site: mask}
    result.meta["verified_values"] = rows
    result.meta["agreement"] = {
        "spearman": spearman(estimates, actuals),
        "max_abs_error": error,
        "max_abs_error_recovery": error / abs(span) if span else float("nan"),
        "n": k,
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
