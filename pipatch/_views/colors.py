"""The one colour map: diverging, centred at 0, symmetric around it, NaN in grey.

The stops are ColorBrewer's 11-class RdBu, reversed (negative = blue, 0 = near white,
positive = red): the map researchers know from causal-tracing and patching figures
(matplotlib's ``RdBu_r`` is the same eleven colours). Values are scaled by ``vmax`` = the
largest ``|v|`` over the finished rows' finite values (1 when there is none), so 0 is always
the white centre; the colour between two stops is linear interpolation in sRGB, rounded.

``js/format.ts`` (``DIVERGING_STOPS``, ``divergingColor``) draws the live grid and the saved
renderer with the same stops and the same arithmetic; ``js/__tests__/parity.test.ts`` checks
that both give the same colour for the same value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["DIVERGING_STOPS", "NAN_RGB", "PENDING_RGB", "colormap", "diverging_rgb", "symmetric_max"]

#: Low (−vmax) to high (+vmax).
DIVERGING_STOPS: tuple[str, ...] = (
    "#053061", "#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7",
    "#fddbc7", "#f4a582", "#d6604d", "#b2182b", "#67001f",
)  # fmt: skip
#: NaN (recovery undefined): a grey that is on no point of the scale.
NAN_RGB: tuple[int, int, int] = (128, 128, 128)
#: Rows not computed yet (drawn hatched over this).
PENDING_RGB: tuple[int, int, int] = (238, 238, 238)


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16)


_STOPS = [_rgb(c) for c in DIVERGING_STOPS]


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
    pos = (t + 1) / 2 * (len(_STOPS) - 1)
    i = min(int(math.floor(pos)), len(_STOPS) - 2)
    f = pos - i
    a, b = _STOPS[i], _STOPS[i + 1]
    return tuple(int(math.floor(a[k] + (b[k] - a[k]) * f + 0.5)) for k in range(3))  # type: ignore[return-value]


def symmetric_max(values: Sequence[float] | np.ndarray) -> float:
    """Largest ``|v|`` over the finite values; 1 when there is none (or all are 0)."""
    arr = np.asarray(values, dtype=np.float64)
    finite = np.abs(arr[np.isfinite(arr)])
    m = float(finite.max()) if finite.size else 0.0
    return m if m > 0 else 1.0


def colormap(n: int = 1024):
    """The map as a matplotlib colormap on [−1, 1] (``n`` samples of :func:`diverging_rgb`),
    NaN grey; use it with ``Normalize(-vmax, vmax)``."""
    from matplotlib.colors import ListedColormap

    ts = (np.arange(n) + 0.5) / n * 2 - 1
    colours = np.array([diverging_rgb(float(t), 1.0) for t in ts], dtype=np.float64) / 255
    nan = np.array(NAN_RGB, dtype=np.float64) / 255
    return ListedColormap(colours, name="pipatch").with_extremes(
        bad=nan, under=colours[0], over=colours[-1]
    )
