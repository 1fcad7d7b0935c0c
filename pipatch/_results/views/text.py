"""The text views of a state: the terminal grid (``Result.text()``, the CLI) and the one-line
summary (``text/plain`` of the MIME bundle).

Rows are layers with layer 0 first (the top line, as in every other view), columns are the
grid's columns; each cell is a block character for its mean recovery (``░▒▓█``, ``?`` for
NaN, ``·`` for a row not computed yet); a metric drawn as itself on a sequential scale (the
lens's probability or rank) is shaded by where it falls on that scale, as the figure colours it
(:func:`~pipatch._results.views.colors.strength`: rank 0 is ``█``); a comparison's cells are signed (``+▓``, ``-░``: the
size of a − b against the largest |a − b|), preceded by its two sides' labels. Labels go
through the one escaper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .colors import DIVERGING, RANK, scale_kind, strength, symmetric_max, value_range
from .schema import done_span, select_matrix
from .strings import clean_text, escape_label

__all__ = ["shade", "signed_shade", "summary", "text_grid", "top_cells", "values_label"]

_SHADES = " ░▒▓█"


def shade(value: float | None) -> str:
    """``░▒▓█`` for recovery in [0, 1]; ``?`` for NaN; values outside are clipped."""
    if value is None or math.isnan(value):
        return "?"
    return _SHADES[int(min(max(value, 0.0), 0.999) * len(_SHADES))]


def top_cells(grid: np.ndarray, k: int, *, by_size: bool = False) -> list[tuple[int, int, float]]:
    """The ``k`` finite cells with the highest value (``by_size``: the highest ``|value|``) as
    ``(row, col, value)``, highest first (ties: the first in row-major order)."""
    grid = np.asarray(grid, dtype=np.float64)
    flat = grid.ravel()
    key = np.abs(flat) if by_size else flat
    order = [int(i) for i in np.argsort(-np.where(np.isfinite(flat), key, -np.inf), kind="stable")[:k]]
    cols = grid.shape[1] if grid.ndim == 2 else 1
    return [(i // cols, i % cols, float(flat[i])) for i in order if np.isfinite(flat[i])]


def signed_shade(value: float | None, vmax: float) -> str:
    """A difference as sign + block for ``|value| / vmax``: ``+▓``, ``-░``; ``?`` for NaN."""
    if value is None or math.isnan(value):
        return "?"
    return ("+" if value > 0 else "-" if value < 0 else " ") + shade(abs(value) / vmax)


def values_label(state: Mapping[str, Any], mode: str = "recovery", *, short: bool = False) -> str:
    """What the drawn cells are, in words (``short``: for a colour bar). One result:
    normalized recovery or the raw metric; a comparison (``sides`` set): a − b of the compared
    values, or one side of them (``mode`` ``"a"`` / ``"b"``)."""
    metric = str(state.get("metric") or "metric")
    if state.get("sides"):
        what = f"raw {metric}" if state.get("compared") == "raw" else "normalized recovery"
        which = mode if mode in ("a", "b") else "a − b"
        return which if short else f"{which}: {what}" if mode in ("a", "b") else f"a − b of {what}"
    if mode == "raw":
        return "raw metric" if short else f"raw {metric}"
    if state.get("values") == "metric":
        return metric
    return "recovery" if short else f"normalized recovery ({metric})"


def _label(text: str, width: int) -> str:
    return escape_label(text, width - 1).rjust(width)


def text_grid(state: Mapping[str, Any], view: str | None = None, width: int = 7, top: int = 5) -> str:
    """Rows = layers (layer 0 first), columns = tokens (or heads); then the top cells."""
    views = list(state.get("views") or [])
    view = view if view in views else (views[0] if views else "")
    rows = [str(x) for x in state.get("row_labels") or []]
    cols = [str(x) for x in state.get("col_labels") or []]
    grid = select_matrix(state, view)
    if grid is None:
        grid = np.full((len(rows), len(cols)), np.nan, dtype=np.float32)
    lo, hi = done_span(state, view, grid.shape[0])
    grid = np.array(grid, dtype=np.float64)
    grid[:lo], grid[hi:] = np.nan, np.nan  # pending rows
    # One escape (⟨U+000A⟩) must fit in a column.
    escaped = max((len(escape_label(c)) for c in cols if escape_label(c) != c), default=0)
    width = max(width, min(escaped + 1, 10))
    base = state.get("baselines") or {}
    numbers = ", ".join(f"{escape_label(k, 20)} {'nan' if v is None else format(v, '.4g')}" for k, v in base.items())
    compared = bool(state.get("sides"))
    vmax = symmetric_max(grid)
    kind = scale_kind(state)
    lo_v, hi_v = value_range(kind, grid)

    def cell(value: float) -> str:
        if compared:
            return signed_shade(value, vmax)
        return shade(value) if kind == DIVERGING else shade(strength(value, kind, lo_v, hi_v))

    lines = [f"{escape_label(state.get('title') or 'pipatch')}  [{view}, {state.get('metric', '')}; {numbers}]"]
    lines += [escape_label(side) for side in state.get("sides") or []]
    lines.append(" " * 5 + "".join(_label(c, width) for c in cols))
    for r in range(grid.shape[0]):
        label = rows[r] if r < len(rows) else str(r)
        if lo <= r < hi:
            cells = "".join(cell(float(v)).rjust(width) for v in grid[r].tolist())
        else:
            cells = "".join("·".rjust(width) for _ in range(grid.shape[1]))
        lines.append(f"L{escape_label(label):<4}"[:5] + cells)
    what = {"head": "head", "token": "token"}.get(str(state.get("col_axis")), "column")
    word = "a − b" if compared else values_label(state, short=True)
    # Row and column *labels*: a one-sender path grid's only row is its sender's layer, not 0.
    lowest = kind == RANK  # the best ranks are the smallest
    for row, col, value in top_cells(-grid if lowest else grid, top, by_size=compared):
        value = -value if lowest else value
        lines.append(f"layer {escape_label(rows[row]):>3}  {what} '{escape_label(cols[col], 40)}'  {word} {value:.3f}")
    for warning in state.get("warnings") or []:
        lines.append(f"warning: {escape_label(warning)}")
    status = str(state.get("status") or "done")
    if status != "done":
        message = state.get("message")
        lines.append(f"status: {status}" + (f" — {escape_label(message)}" if message else ""))
    return "\n".join(lines)


def summary(state: Mapping[str, Any]) -> str:
    """One line for ``text/plain``: title, what the grid is, its status."""
    views = [str(v) for v in state.get("views") or []]
    n_rows = len(state.get("row_labels") or [])
    n_cols = len(state.get("col_labels") or [])
    axis = {"head": "heads", "token": "tokens"}.get(str(state.get("col_axis") or "token"), "columns")
    head = " ".join(escape_label(b, 80) for b in (state.get("kind"), state.get("model_name")) if b)
    base = state.get("baselines") or {}
    numbers = ", ".join(f"{escape_label(k, 20)} {'nan' if v is None else format(v, '.4g')}" for k, v in base.items())
    status = str(state.get("status") or "done")
    message = state.get("message")
    shape = f"{n_rows} receivers × {n_cols} senders" if state.get("circuit") else f"{n_rows} layers × {n_cols} {axis}"
    parts = [head, shape, f"views {escape_label(', '.join(views) or '-', 120)}"]
    if state.get("metric"):
        parts.append(f"metric {escape_label(state['metric'], 80)}")
    if numbers:
        parts.append(numbers)
    if int(state.get("n_seeds") or 0) > 1:
        parts.append(f"{int(state['n_seeds'])} {escape_label(state.get('seed_noun') or 'seeds', 40)}")
    parts.append(f"{escape_label(status, 40)}: {escape_label(message, 400)}" if message else escape_label(status, 40))
    title = escape_label(state.get("title") or "pipatch", 120)
    return clean_text(f"PatchGrid: {title} ({'; '.join(p for p in parts if p)})")
