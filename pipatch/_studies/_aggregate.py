"""Averages over a study's facts, by named position group × layer, with 95 % intervals.

Each fact's result is first reduced the way a list-form dataset is
(:mod:`pipatch._experiments.dataset`): its columns are grouped into ROME's named positions
(``first subject`` ... ``last``: the same function, :func:`~pipatch._experiments.dataset.group_means`,
over the group columns recorded when the fact ran), then for every seed

* **recovery** (the mean indirect effect, normalized): ``(patched − corrupt) / (clean − corrupt)``,
  NaN where the baselines are too close (:meth:`pipatch.Result.recovery`);
* **raw_effect** (ROME's indirect effect in the metric's own units, P(answer) for a trace):
  ``patched − corrupt``, the restored run's probability minus the corrupted run's;

averaged over the fact's seeds. A study's value is then the mean over facts of those per-fact
values (facts without the group, a one-token subject's ``middle subject``, are skipped), and
its 95 % confidence interval is Student's *t* interval over facts,
``mean ± t(0.975, n − 1) · sd / √n`` (``sd`` with n − 1; no interval for one fact). With every
fact run with the same seeds this mean equals the list-form dataset's grid, which averages
over (fact, seed) rows.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from .._experiments.dataset import group_means
from .._results.result import Result

__all__ = ["METRICS", "fact_values", "summarise", "t_quantile"]

#: The values a study reports, per fact and averaged.
METRICS = ("recovery", "raw_effect")


def fact_values(result: Result, group_columns: list[list[int]] | None) -> dict[str, dict[str, np.ndarray]]:
    """``{metric: {view: array[layers, groups]}}``: one fact's seed-averaged values by named
    group (``group_columns=None``: the result's own columns, a head grid's)."""
    grouped = {view: group_means(raw, group_columns) for view, raw in result.raw.items()}
    reduced = Result(kind=result.kind, tokens=result.tokens, columns=result.columns, layers=result.layers,
                     metric=result.metric, raw=grouped, clean=result.clean_seeds, corrupt=result.corrupt_seeds, meta=result.meta)
    corrupt = result.corrupt_seeds.reshape(-1, 1, 1)
    out: dict[str, dict[str, np.ndarray]] = {m: {} for m in METRICS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for view, raw in grouped.items():
            out["recovery"][view] = torch.nanmean(reduced.recovery(view), dim=0).numpy().astype(np.float64)
            out["raw_effect"][view] = torch.nanmean(raw - corrupt, dim=0).numpy().astype(np.float64)
    return out


def summarise(values: np.ndarray) -> dict[str, np.ndarray]:
    """``values`` [facts, ...] → ``mean``, ``low``, ``high`` (95 % t interval), ``n``, ``sd`` over facts,
    NaN skipped."""
    finite = np.isfinite(values)
    n = finite.sum(0)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore")
        mean = np.nanmean(values, axis=0)
        sd = np.nanstd(values, axis=0, ddof=1)
    t = np.vectorize(lambda k: t_quantile(0.975, int(k) - 1) if k >= 2 else math.nan, otypes=[float])(n)
    half = t * sd / np.sqrt(np.maximum(n, 1))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "sd": sd}


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (``t_quantile(0.975, 9)`` = 2.262), by bisection on its CDF (Simpson's
    rule on the density). scipy would do it; pipatch does not depend on it."""
    if df <= 0:
        return math.nan
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))

    def cdf_above_zero(x: float, steps: int = 2000) -> float:  # P(0 < T < x)
        h = x / steps
        total = density(0.0) + density(x)
        for i in range(1, steps):
            total += (4 if i % 2 else 2) * density(i * h)
        return total * h / 3

    target, lo, hi = p - 0.5, 0.0, 1.0
    while cdf_above_zero(hi) < target:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_above_zero(mid) < target else (lo, mid)
    return (lo + hi) / 2


def stack(per_fact: Sequence[dict[str, dict[str, np.ndarray]]], metric: str, view: str) -> np.ndarray:
    """The facts' arrays of one metric and view, [facts, layers, groups]."""
    return np.stack([values[metric][view] for values in per_fact])

