"""Tolerances derived from what is compared: a ratio's from its parts', a rank's from its logits'.

The hook references pin absolute values (a metric, a probability, a logit) within a small
``ε`` (1e-5 on the CPU). A number made *from* such values inherits their error, amplified:

* a **ratio** ``a / b`` whose parts are each known within ``e`` is known within
  :func:`ratio_tolerance` — ``e (1 + |a/b|) / (|b| − e)``, large where ``b`` is small (a
  normalized recovery ``(x − lo) / (hi − lo)``, a faithfulness ``(m(C) − m(∅)) / (m(M) −
  m(∅))``: each difference is of two values within ``ε``, so ``e = 2ε``:
  :func:`normalized_tolerance`; a Result's grid cell by cell: :func:`recovery_tolerance`);
* a **rank** (how many logits exceed the answer's) is a count, exact only away from ties: a
  logit within ``atol + rtol·|logit|`` of its reference may cross the answer's when the two are
  that close, so the rank is known to lie in :func:`rank_band`'s ``[low, high]``.

Derivation of the ratio bound: with ``a' = a + da``, ``b' = b + db``, ``|da| ≤ e_a``,
``|db| ≤ e_b``, ``a'/b' − a/b = (da − (a/b)·db) / b'``, so ``|a'/b' − a/b| ≤ (e_a + |a/b|
e_b) / (|b| − e_b)`` (for ``|b| > e_b``; otherwise the ratio is not determined by its parts
and the bound is ∞). A mean over seeds of ratios each within ``t_s`` is within the mean of
the ``t_s``.
"""

from __future__ import annotations

import math

import torch

#: The ratio's own float32 arithmetic (a subtraction or two and a division, a few ulps of the
#: ratio: 2**-24 each), allowed beside what its parts' errors move it by.
ROUNDING = 2.0**-20


Number = float | torch.Tensor


def ratio_tolerance(a: Number, b: Number, e_a: Number, e_b: Number | None = None) -> Number:
    """How far ``a / b`` may move when ``a`` moves by at most ``e_a`` and ``b`` by at most
    ``e_b`` (``e_a`` unless given; 0: ``b`` is shared, the same number on both sides):
    ``(e_a + |a/b| e_b) / (|b| − e_b)`` (module docstring), ``inf`` where ``|b| ≤ e_b``, plus
    :data:`ROUNDING` ``(1 + |a/b|)``. ``a`` and ``b`` are the reference's parts; floats or
    tensors (elementwise)."""
    e_b = e_a if e_b is None else e_b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        ratio = (a / b).abs()
        bound = (e_a + ratio * e_b) / (b.abs() - e_b)
        return torch.where(b.abs() > e_b, bound, torch.inf) + ROUNDING * (1 + ratio)
    if abs(b) <= e_b:
        return math.inf
    return (e_a + abs(a / b) * e_b) / (abs(b) - e_b) + ROUNDING * (1 + abs(a / b))


def normalized_tolerance(x: Number, lo: Number, hi: Number, eps: float, baselines_shared: bool = False) -> Number:
    """How far ``(x − lo) / (hi − lo)`` (a normalized recovery, faithfulness, completeness)
    may move when each of ``x``, ``lo`` and ``hi`` moves by at most ``eps``: each difference by
    ``2 eps`` (:func:`ratio_tolerance`). ``baselines_shared``: ``lo`` and ``hi`` are the same
    numbers on both sides (only ``x`` moves), so the bound is ``eps / |hi − lo|``."""
    if baselines_shared:
        return ratio_tolerance(x - lo, hi - lo, eps, 0.0)
    return ratio_tolerance(x - lo, hi - lo, 2 * eps)


def recovery_tolerance(result, atol: float, rtol: float = 0.0, view: str | None = None,
                       baselines_shared: bool = False, per_seed: bool = False) -> torch.Tensor:
    """How far ``result``'s normalized recovery may move, per cell, when its raw metric moves by
    at most ``atol + rtol·|raw|`` and each seed's clean and corrupt baselines by at most
    ``atol + rtol·|baseline|`` (``baselines_shared``: not at all): :func:`ratio_tolerance` of
    ``raw − corrupt`` over ``clean − corrupt`` seed by seed, ``[seeds, layers, columns]`` with
    ``per_seed``; otherwise the mean over the seeds (a mean of values each within ``t_s``
    is within the mean of the ``t_s``), ``[layers, columns]``. ``result`` is the reference; one
    that is not normalized (the logit lens) is its metric, within ``atol + rtol·|raw|``."""
    view = view or result.views[0]
    raw = result.raw[view].double()
    if not result.normalized:  # the logit lens: the metric itself, no baselines to divide by
        tol = (atol + rtol * raw.abs()).where(~raw.isnan(), torch.nan)
        return tol.float() if per_seed else torch.nanmean(tol, dim=0).float()
    clean = result.clean_seeds.double().reshape(-1, 1, 1)
    corrupt = result.corrupt_seeds.double().reshape(-1, 1, 1)
    e_x = atol + rtol * raw.abs()
    e_lo = 0.0 if baselines_shared else atol + rtol * corrupt.abs()
    e_hi = 0.0 if baselines_shared else atol + rtol * clean.abs()
    tol = ratio_tolerance(raw - corrupt, (clean - corrupt).expand_as(raw), e_x + e_lo, e_hi + e_lo)
    tol = tol.where(~result.recovery(view).isnan(), torch.nan)
    if per_seed:
        return tol.float()
    return torch.nanmean(tol, dim=0).float()


def assert_recovery_close(got: torch.Tensor, want: torch.Tensor, tolerance: torch.Tensor) -> None:
    """``|got − want| ≤ tolerance`` cell by cell (:func:`recovery_tolerance`), NaN where the
    other is NaN, the worst cell named."""
    assert got.shape == want.shape == tolerance.shape, (got.shape, want.shape, tolerance.shape)
    assert torch.equal(got.isnan(), want.isnan())
    excess = ((got - want).abs().double() - tolerance.double()).nan_to_num(nan=-1.0)
    worst = int(excess.argmax())
    cell = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))
    assert float(excess.flatten()[worst]) <= 0, (
        f"recovery {float(got.flatten()[worst]):.6g} vs {float(want.flatten()[worst]):.6g} at {cell}: "
        f"|Δ| above the derived {float(tolerance.flatten()[worst]):.3g}")


def rank_band(logits: torch.Tensor, chosen: torch.Tensor, atol: float, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a rank computed from logits within ``atol + rtol·|logit|`` of these may lie.

    ``logits`` ``[..., vocab]`` (the reference's), ``chosen`` ``[...]`` the token ids whose rank
    is counted (how many logits exceed the chosen one's) → ``(low, high)``, ``[...]`` each
    (int64). Another computation of the same logits, each within ``atol + rtol·|logit|`` of
    these, may order token ``i`` and the chosen token ``c`` either way when ``|l_i − l_c| ≤
    2 atol + rtol (|l_i| + |l_c|)``: ``low`` counts the tokens above ``c`` by more than that
    (above it whatever the rounding), ``high`` those not below it by more than that, ``c``
    itself left out. With ``atol = rtol = 0``, ``low`` is the rank itself.
    """
    logits = logits.float()
    mine = logits.gather(-1, chosen[..., None].to(torch.int64))
    gap = logits - mine
    margin = 2 * atol + rtol * (logits.abs() + mine.abs())
    low = (gap > margin).sum(-1)
    high = (gap >= -margin).sum(-1) - 1
    return low, high


def assert_rank_in_band(got: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> None:
    """``low ≤ got ≤ high`` in every cell (:func:`rank_band`), with the worst cell named."""
    assert got.shape == low.shape == high.shape, (got.shape, low.shape, high.shape)
    below, above = (low.to(got.dtype) - got).clamp(min=0), (got - high.to(got.dtype)).clamp(min=0)
    outside = below + above
    worst = int(outside.argmax())
    cell = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))
    assert float(outside.max()) == 0, (f"rank {float(got.flatten()[worst]):.0f} at {cell} outside "
                                       f"[{int(low.flatten()[worst])}, {int(high.flatten()[worst])}]")
