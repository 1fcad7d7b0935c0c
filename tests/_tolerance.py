"""Tolerances derived from what is compared: a ratio's from its parts', a rank's from its logits'.

The hook references pin absolute values (a metric, a probability, a logit) within a small
``ε`` (1e-5 on the CPU). A number made *from* such values inherits their error, amplified:

* a **ratio** ``a / b`` whose parts are each known within ``e`` is known within
  :func:`ratio_tolerance` — ``e (1 + |a/b|) / (|b| − e)``, large where ``b`` is small (a
  normalized recovery ``(x − lo) / (hi − lo)``, a faithfulness ``(m(C) − m(∅)) / (m(M) −
  m(∅))``: each difference is of two values within ``ε``, so ``e = 2ε``);
* a **rank** (how many logits exceed the answer's) is a count, exact only away from ties: a
  logit within ``atol + rtol·|logit|`` of its reference may cross the answer's when the two are
  that close, so the rank is known to lie in :func:`rank_band`'s ``[low, high]``.

Derivation of the ratio bound: with ``a' = a + da``, ``b' = b + db``, ``|da|, |db| ≤ e``,
``a'/b' − a/b = (da − (a/b)·db) / b'``, so ``|a'/b' − a/b| ≤ e (1 + |a/b|) / (|b| − e)``
(for ``|b| > e``; otherwise the ratio is not determined by its parts and the bound is ∞).
"""

from __future__ import annotations

import math

import torch


def ratio_tolerance(a: float, b: float, e: float) -> float:
    """How far ``a / b`` may move when ``a`` and ``b`` each move by at most ``e``: ``e (1 +
    |a/b|) / (|b| − e)`` (module docstring); ``inf`` where ``|b| ≤ e``. ``a`` and ``b`` are
    the reference's (hand-computed) parts."""
    if abs(b) <= e:
        return math.inf
    return e * (1 + abs(a / b)) / (abs(b) - e)


def normalized_tolerance(x: float, lo: float, hi: float, eps: float) -> float:
    """How far ``(x − lo) / (hi − lo)`` (a normalized recovery, faithfulness, completeness)
    may move when each of ``x``, ``lo`` and ``hi`` moves by at most ``eps``: each difference by
    ``2 eps``, so :func:`ratio_tolerance` of ``(x − lo, hi − lo, 2 eps)``."""
    return ratio_tolerance(x - lo, hi - lo, 2 * eps)


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
