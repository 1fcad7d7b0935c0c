"""Plots made together: several results side by side in one figure, on one colour scale.

Each :meth:`pipatch.Result.plot` scales its colours to its own values, so two figures side by
side can show the same colour for different numbers. :func:`plot` draws several results into
one figure with one scale for all of them (``scale="shared"``: the union of their own ranges;
:func:`pipatch._results.views.render.shared_scale`), each panel with its colour bar.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._base.errors import PipatchError
from .result import Result

__all__ = ["plot"]


def plot(results: Result | Sequence[Result], view: str | None = None, *, mode: str = "recovery",
         scale: str | tuple[float, float] = "shared", columns: int | None = None, pyplot: bool = True):
    """Draw several results side by side in one matplotlib figure, on one colour scale.

    Parameters
    ----------
    results
        The results to draw (one or a list), one panel each, in order.
    view
        The view each panel shows (``None``: each result's first).
    mode
        What the cells show, as in :meth:`pipatch.Result.plot` (``"recovery"`` or ``"raw"``).
    scale
        ``"shared"`` (default): one colour range covering every panel, so one colour is one
        number everywhere; ``"auto"``: each panel its own range; ``(vmin, vmax)``: this range
        for all (a diverging map keeps 0 at its centre, with half-range ``max(|vmin|, |vmax|)``).
    columns
        Panels per row (``None``: all in one row, up to 3).
    pyplot
        ``True``: a pyplot figure (shown by ``plt.show()``); ``False``: an off-screen figure.

    Returns
    -------
    matplotlib.figure.Figure
        The figure, one axes (plus its colour bar) per result.

    Raises
    ------
    PipatchError
        No result, something that is not a result, ``scale="shared"`` over results that colour
        different kinds of values (a probability and a normalized recovery, say), or a
        ``scale`` that is no range: one line naming the fix.

    Examples
    --------
    >>> fig = pipatch.plot([trace_paris, trace_rome], scale="shared")
    """
    from .views import figure
    from .views.render import check_scale, color_scale, figure_size, new_figure, shared_scale

    items = [results] if isinstance(results, Result) else list(results)
    if not items or not all(isinstance(r, Result) for r in items):
        raise PipatchError("plot() draws pipatch results: pass a Result or a list of them")
    states = [r.to_state() for r in items]
    views = [r._view(view) for r in items]
    if isinstance(scale, str) and scale == "shared":
        shared: tuple[float, float] | None = shared_scale(
            [color_scale(state, v, mode=mode) for state, v in zip(states, views)])
    else:
        shared = check_scale(scale)
    per_row = max(1, columns or min(len(items), 3))
    n_rows = math.ceil(len(items) / per_row)
    width, height = max((figure_size(s) for s in states), key=lambda size: size[0] * size[1])
    fig = new_figure((width * per_row, height * n_rows), pyplot=pyplot)
    axes = fig.subplots(n_rows, per_row, squeeze=False).ravel()
    for ax, state, v in zip(axes, states, views):
        figure(state, v, mode=mode, ax=ax, scale=shared)
    for ax in axes[len(items):]:
        ax.set_visible(False)
    return fig

