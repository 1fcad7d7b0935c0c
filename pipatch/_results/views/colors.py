"""The colour scales: diverging for signed values, sequential for values with no sign to show.

What the cells hold picks the scale (:func:`scale_kind`, ``scaleKind`` in ``js/format.ts``):

* ``"diverging"``: normalized recovery, a difference, a logit difference, an edge's score:
  signed, 0 white in the middle.
* ``"sequential"``: a probability or log-probability drawn as itself (the logit lens, a raw
  ``prob`` metric): pale at the lowest, darkest at the highest.
* ``"rank"``: the lens's rank of the answer: rank 0 (the model's top token, the interesting
  cell) the darkest colour, paling on a log scale (``log1p``) towards the worst rank drawn.

The diverging stops are ColorBrewer's 11-class RdBu, reversed (negative = blue, 0 = near white,
positive = red): the map researchers know from causal-tracing and patching figures
(matplotlib's ``RdBu_r`` is the same eleven colours). Values are scaled by ``vmax`` = the
largest ``|v|`` over the finished rows' finite values (1 when there is none), so 0 is always
the white centre; the colour between two stops is linear interpolation in sRGB, rounded.
The sequential stops are ColorBrewer's 9-class YlOrRd (matplotlib's ``YlOrRd``), over
``[lo, hi]`` = [min(0, min v), max(0, max v)] (a probability from 0 up, a log-probability up to
0); the rank map runs from rank 0 to the worst rank drawn (:func:`value_range`). A range given
by the caller (``scale=(vmin, vmax)``, or one shared by plots made together) replaces it; a
diverging map keeps 0 at its centre and uses ``max(|vmin|, |vmax|)``.

``js/format.ts`` (``DIVERGING_STOPS``, ``SEQUENTIAL_STOPS``, ``scaleKind``, ``valueRange``,
``scaleColor``) draws the live grid and the saved renderer with the same stops and the same
arithmetic; ``js/__tests__/parity.test.ts`` checks that both give the same colour for the same
value on every scale, and pick the same scale for the same state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DIVERGING", "DIVERGING_STOPS", "NAN_RGB", "PENDING_RGB", "RANK", "SEQUENTIAL", "SEQUENTIAL_METRICS",
    "SEQUENTIAL_STOPS", "colormap", "diverging_rgb", "scale_kind", "scale_norm", "scale_rgb", "strength",
    "symmetric_max", "value_range",
]  # fmt: skip

#: Low (−vmax) to high (+vmax).
DIVERGING_STOPS: tuple[str, ...] = (
    "#053061", "#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7",
    "#fddbc7", "#f4a582", "#d6604d", "#b2182b", "#67001f",
)  # fmt: skip
#: Low to high (ColorBrewer's 9-class YlOrRd).
SEQUENTIAL_STOPS: tuple[str, ...] = (
    "#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#800026",
)  # fmt: skip
#: The scales (:func:`scale_kind`).
DIVERGING, SEQUENTIAL, RANK = "diverging", "sequential", "rank"
#: Metrics drawn on the sequential map when the cells hold the metric itself (higher = more).
SEQUENTIAL_METRICS: tuple[str, ...] = ("prob", "logprob")
#: NaN (recovery undefined): a grey that is on no point of the scale.
NAN_RGB: tuple[int, int, int] = (128, 128, 128)
#: Rows not computed yet (drawn hatched over this).
PENDING_RGB: tuple[int, int, int] = (238, 238, 238)


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16)


_STOPS = [_rgb(c) for c in DIVERGING_STOPS]
_SEQUENTIAL = [_rgb(c) for c in SEQUENTIAL_STOPS]


def _between(stops: list[tuple[int, int, int]], pos: float) -> tuple[int, int, int]:
    """The colour at ``pos`` (0 … len(stops) − 1): linear between the two nearest stops, rounded."""
    i = min(int(math.floor(pos)), len(stops) - 2)
    f = pos - i
    a, b = stops[i], stops[i + 1]
    return tuple(int(math.floor(a[k] + (b[k] - a[k]) * f + 0.5)) for k in range(3))  # type: ignore[return-value]


def diverging_rgb(value: float, vmax: float) -> tuple[int, int, int]:
    """The colour of ``value`` on a scale from ``-vmax`` to ``vmax`` (clipped), as 0–255 RGB.

    The arithmetic is ``divergingColor`` of ``js/format.ts``, operation for operation (JS
    ``Math.round`` is ``floor(x + 0.5)``), so both sides give the same bytes.
    """
    if math.isnan(value):
        return NAN_RGB
    if math.isinf(value):
        return _STOPS[-1] if value > 0 else _STOPS[0]
    t = value / vmax if vmax > 0 else 0.0
    t = min(1.0, max(-1.0, t))
    return _between(_STOPS, (t + 1) / 2 * (len(_STOPS) - 1))


def scale_kind(state: Mapping[str, Any], mode: str = "recovery") -> str:
    """The scale of a state's cells drawn in ``mode``: :data:`RANK` for the metric ``rank``
    drawn as itself, :data:`SEQUENTIAL` for ``prob`` / ``logprob`` drawn as themselves (the
    logit lens; ``mode="raw"``), :data:`DIVERGING` for everything else (normalized recovery, a
    comparison, a circuit's scores, a logit difference). As ``scaleKind`` in ``js/format.ts``."""
    if state.get("sides") or (state.get("circuit") or {}).get("nodes"):
        return DIVERGING
    metric = str(state.get("metric") or "")
    if state.get("values") == "metric" or mode == "raw":
        if metric == "rank":
            return RANK
        if metric in SEQUENTIAL_METRICS:
            return SEQUENTIAL
    return DIVERGING


def value_range(kind: str, values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The range a scale of ``kind`` spans for ``values`` (their finite ones): diverging
    ``(−m, m)`` with ``m`` = :func:`symmetric_max`; rank ``(0, worst rank)``; sequential
    ``(min(0, min), max(0, max))``. An empty range becomes one unit wide. As ``valueRange``."""
    if kind == DIVERGING:
        m = symmetric_max(values)
        return -m, m
    arr = np.asarray(values, dtype=np.float64)
    finite = arr[np.isfinite(arr)]
    lo = 0.0 if kind == RANK or not finite.size else min(0.0, float(finite.min()))
    hi = max(0.0, float(finite.max())) if finite.size else 0.0
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def strength(value: float, kind: str, lo: float, hi: float) -> float:
    """Where ``value`` falls on a sequential or rank scale over ``[lo, hi]``: 0 the palest
    colour, 1 the darkest (rank 0 is 1: ``1 − log1p(v − lo) / log1p(hi − lo)``); clipped; NaN
    for NaN. The text grid shades by it. As ``strength`` in ``js/format.ts``."""
    if math.isnan(value):
        return math.nan
    if kind == RANK:
        span = math.log1p(hi - lo) if hi > lo else 0.0
        t = 1.0 - math.log1p(max(value - lo, 0.0)) / span if span > 0 else 1.0
    else:
        t = (value - lo) / (hi - lo) if hi > lo else 0.0
    return min(1.0, max(0.0, t))


def scale_rgb(value: float, kind: str, lo: float, hi: float) -> tuple[int, int, int]:
    """The colour of ``value`` on the scale ``kind`` over ``[lo, hi]`` (:func:`value_range`),
    as 0–255 RGB; NaN grey. A diverging scale is :func:`diverging_rgb` with half-range
    ``max(|lo|, |hi|)``. As ``scaleColor`` in ``js/format.ts``, operation for operation."""
    if kind == DIVERGING:
        return diverging_rgb(value, max(abs(lo), abs(hi)))
    t = strength(value, kind, lo, hi)
    return NAN_RGB if math.isnan(t) else _between(_SEQUENTIAL, t * (len(_SEQUENTIAL) - 1))


def symmetric_max(values: Sequence[float] | np.ndarray) -> float:
    """Largest ``|v|`` over the finite values; 1 when there is none (or all are 0)."""
    arr = np.asarray(values, dtype=np.float64)
    finite = np.abs(arr[np.isfinite(arr)])
    m = float(finite.max()) if finite.size else 0.0
    return m if m > 0 else 1.0


def colormap(n: int = 1024, kind: str = DIVERGING):
    """The scale ``kind`` as a matplotlib colormap (``n`` samples of :func:`scale_rgb`), NaN
    grey; use it with :func:`scale_norm`."""
    from matplotlib.colors import ListedColormap

    u = (np.arange(n) + 0.5) / n  # 0 … 1 along the norm
    if kind == DIVERGING:
        colours = np.array([diverging_rgb(float(t), 1.0) for t in u * 2 - 1], dtype=np.float64) / 255
    else:  # the rank norm runs over log1p(rank): rank 0 at the left is the darkest
        shade = 1 - u if kind == RANK else u
        colours = np.array([_between(_SEQUENTIAL, float(t) * (len(_SEQUENTIAL) - 1)) for t in shade],
                           dtype=np.float64) / 255
    nan = np.array(NAN_RGB, dtype=np.float64) / 255
    return ListedColormap(colours, name="pipatch").with_extremes(
        bad=nan, under=colours[0], over=colours[-1]
    )


def scale_norm(kind: str, lo: float, hi: float):
    """The matplotlib norm of the scale ``kind`` over ``[lo, hi]`` for :func:`colormap`:
    ``(−m, m)`` with ``m = max(|lo|, |hi|)`` for diverging, ``log1p`` of ``v − lo`` for rank."""
    from matplotlib.colors import FuncNorm, Normalize

    if kind == DIVERGING:
        m = max(abs(lo), abs(hi)) or 1.0
        return Normalize(-m, m)
    if kind == RANK:
        return FuncNorm((lambda v: np.log1p(np.maximum(v - lo, 0)), lambda u: np.expm1(u) + lo), vmin=lo, vmax=hi)
    return Normalize(lo, hi)
