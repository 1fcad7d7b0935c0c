"""The one static renderer: a state drawn with matplotlib, as a figure or PNG bytes.

``Result.plot()``, the CLI's ``--png``, ``Result._repr_mimebundle_`` and the widget's saved
bundle all draw through :func:`draw`. Layer 0 is the top row (as in the live grid and the
text grid), columns run left to right, the colour map is :mod:`.colors` (diverging, centred
at 0, symmetric ±max|v| over the finished rows, NaN grey), rows not computed yet are hatched,
and every label goes through the one escaper (then ``$`` is escaped for mathtext).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .colors import PENDING_RGB, colormap, symmetric_max
from .schema import done_span, select_matrix
from .strings import escape_label
from .text import values_label

__all__ = ["draw", "figure_size", "png", "scale_max", "tick_text"]


def tick_text(text: Any, limit: int = 16) -> str:
    """A label as matplotlib should draw it: escaped, at most ``limit`` characters, ``$``
    escaped (mathtext would read ``$…$``; an unbalanced ``$`` is an error)."""
    return escape_label(text, limit).replace("$", r"\$")


def figure_size(state: Mapping[str, Any]) -> tuple[float, float]:
    """Inches for a grid of this many rows and columns (bounded both ways)."""
    n_rows = len(state.get("row_labels") or []) or 1
    n_cols = len(state.get("col_labels") or []) or 1
    return min(max(5.0, 2.6 + 0.45 * n_cols), 40.0), min(max(3.0, 1.9 + 0.24 * n_rows), 30.0)


def _view(state: Mapping[str, Any], view: str | None) -> str:
    views = list(state.get("views") or [])
    return view if view in views else (views[0] if views else "")


def draw(state: Mapping[str, Any], ax, view: str | None = None, *, mode: str = "recovery", seed: int = -1):
    """Draw ``state``'s ``view`` into the matplotlib axes ``ax`` (plus its colour bar); returns
    the image."""
    from matplotlib.colors import Normalize

    view = _view(state, view)
    row_labels = [str(x) for x in state.get("row_labels") or []]
    col_labels = [str(x) for x in state.get("col_labels") or []]
    grid = select_matrix(state, view, seed, mode)
    if grid is None:
        grid = np.full((len(row_labels) or 1, len(col_labels) or 1), np.nan, dtype=np.float32)
    grid = np.array(grid, dtype=np.float64)
    if grid.size == 0:
        grid = np.full((1, 1), np.nan)
    n_rows, n_cols = grid.shape
    lo, hi = done_span(state, view, n_rows)
    vmax = scale_max(state, view, mode, grid, (lo, hi))
    grid[:lo], grid[hi:] = np.nan, np.nan
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=colormap(), norm=Normalize(-vmax, vmax),
                      aspect="auto", interpolation="nearest", origin="upper")
    for start, end in ((0, lo), (hi, n_rows)):  # pending rows: above or below the finished band
        if start < end:
            ax.axhspan(start - 0.5, end - 0.5, facecolor=np.array(PENDING_RGB) / 255, edgecolor="#bdbdbd",
                       hatch="//", linewidth=0)
    col_step = max(1, math.ceil(n_cols / 80))
    row_step = max(1, math.ceil(n_rows / 48))
    ax.set_xticks(range(0, n_cols, col_step))
    ax.set_xticklabels([tick_text(col_labels[i]) if i < len(col_labels) else str(i) for i in range(0, n_cols, col_step)],
                       rotation=60 if n_cols <= 40 else 90, ha="right" if n_cols <= 40 else "center",
                       rotation_mode="anchor" if n_cols <= 40 else "default", fontsize=8)
    ax.set_yticks(range(0, n_rows, row_step))
    ax.set_yticklabels([tick_text(row_labels[i]) if i < len(row_labels) else str(i) for i in range(0, n_rows, row_step)],
                       fontsize=8)
    ax.set_xlabel(escape_label(state.get("col_axis") or "token", 24))
    ax.set_ylabel("layer")
    labels = state.get("seed_labels") or []
    seed_text = "" if seed < 0 else f", {labels[seed] if seed < len(labels) else f'seed {seed}'}"
    sides = "".join(f"\n{tick_text(side, 85)}" for side in state.get("sides") or [])
    ax.set_title(f"{tick_text(state.get('title') or 'pipatch', 110)}{sides}\n{tick_text(view, 40)}: "
                 f"{tick_text(values_label(state, mode), 60)}{seed_text}", fontsize=9)
    ax.figure.colorbar(image, ax=ax, label=values_label(state, mode, short=True), fraction=0.05, pad=0.02)
    return image


def scale_max(state: Mapping[str, Any], view: str, mode: str, grid: np.ndarray, span: tuple[int, int]) -> float:
    """The colour scale's half-range: max |v| over the finished rows drawn (``range(*span)``:
    :func:`~pipatch._views.schema.done_span`); for one side of a comparison over both sides, so
    switching a ↔ b keeps the colours comparable. As ``scaleMax`` in ``js/format.ts``."""
    done = slice(*span)
    if mode in ("a", "b") and state.get("sides"):
        sides = [select_matrix(state, view, -1, side) for side in ("a", "b")]
        return symmetric_max(np.concatenate([np.ravel(m[done]) for m in sides if m is not None] or [grid[done].ravel()]))
    return symmetric_max(grid[done])


def _layout(fig) -> None:
    with warnings.catch_warnings():
        # A figure too small for its labels keeps matplotlib's default margins: fine for a plot.
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        fig.tight_layout()


def figure(state: Mapping[str, Any], view: str | None = None, *, mode: str = "recovery", seed: int = -1,
           ax=None, dpi: float = 100, pyplot: bool = False):
    """A figure of ``state`` (drawn into ``ax`` when given). ``pyplot=True`` makes it a pyplot
    figure (shown by ``plt.show()``); otherwise an off-screen Agg figure that touches no
    pyplot state."""
    if ax is None:
        if pyplot:
            import matplotlib.pyplot as plt

            fig = plt.figure(figsize=figure_size(state), dpi=dpi)
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=figure_size(state), dpi=dpi)
            FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    draw(state, ax, view, mode=mode, seed=seed)
    _layout(fig)
    return fig


def png(state: Mapping[str, Any], view: str | None = None, *, mode: str = "recovery", seed: int = -1,
        dpi: float = 80) -> bytes:
    """:func:`figure` as PNG bytes."""
    fig = figure(state, view, mode=mode, seed=seed, dpi=dpi)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
