"""The one static renderer: a state drawn with matplotlib, as a figure or PNG bytes.

``Result.plot()``, the CLI's ``--png``, ``Result._repr_mimebundle_`` and the widget's saved
bundle all draw through :func:`draw`. Layer 0 is the top row (as in the live grid and the
text grid), columns run left to right, the colour map is :mod:`.colors` (diverging, centred
at 0, symmetric ±max|v| over the finished rows, NaN grey), rows not computed yet are hatched,
and every label goes through the one escaper (then ``$`` is escaped for mathtext).

A circuit's state (:func:`~pipatch._views.circuit.is_circuit`) is drawn as its graph instead
(:func:`draw_circuit`, plus :func:`draw_faithfulness` beside it): the nodes where the state's
``circuit`` part puts them, the ``top`` edges of :func:`~pipatch._views.circuit.circuit_edges`
as curves from the sender's top to the receiver's port (a cubic whose control points lie 45 %
of the rise above the start and below the end, as ``edgePath`` in ``js/circuit.ts``), on the
same colour map.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._graph import EMB_DRAWN, HEAD_DRAWN, LOGITS_DRAWN, MLP_DRAWN
from .circuit import circuit_edges, is_circuit
from .colors import PENDING_RGB, colormap, symmetric_max
from .schema import done_span, select_matrix
from .strings import escape_label
from .text import values_label

__all__ = ["TOP_EDGES", "draw", "draw_circuit", "draw_faithfulness", "figure_size", "png", "scale_max", "tick_text"]

#: How many edges a circuit's figure draws unless told (the browser's slider starts there too).
TOP_EDGES = 50
#: Half the height of a node in a circuit's figure (rows).
_NODE_R = 0.11
_MARKERS = {EMB_DRAWN: "s", HEAD_DRAWN: "o", MLP_DRAWN: "s", LOGITS_DRAWN: "s"}
_ROW_NAMES = {EMB_DRAWN: "embeddings", LOGITS_DRAWN: "logits"}


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


def _circuit_size(state: Mapping[str, Any]) -> tuple[float, float]:
    nodes = (state.get("circuit") or {}).get("nodes") or []
    rows = max((float(n["y"]) for n in nodes), default=1.0) + 1
    wide = 3.2 if (state.get("circuit") or {}).get("faithfulness") else 0.0
    return 9.0 + wide, min(max(4.5, 0.75 * rows + 1.8), 18.0)


def figure(state: Mapping[str, Any], view: str | None = None, *, mode: str = "recovery", seed: int = -1,
           ax=None, dpi: float = 100, pyplot: bool = False, top: int = TOP_EDGES):
    """A figure of ``state`` (drawn into ``ax`` when given). ``pyplot=True`` makes it a pyplot
    figure (shown by ``plt.show()``); otherwise an off-screen Agg figure that touches no
    pyplot state. A circuit's state is its graph (``top`` edges) with, in a new figure, its
    faithfulness curve beside it."""
    circuit = is_circuit(state)
    if ax is None:
        size = _circuit_size(state) if circuit else figure_size(state)
        if pyplot:
            import matplotlib.pyplot as plt

            fig = plt.figure(figsize=size, dpi=dpi)
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=size, dpi=dpi)
            FigureCanvasAgg(fig)
        if circuit and (state.get("circuit") or {}).get("faithfulness"):
            grid = fig.add_gridspec(2, 2, width_ratios=[4, 1.35], height_ratios=[1, 1.5])
            ax = fig.add_subplot(grid[:, 0])
            draw_faithfulness(state, fig.add_subplot(grid[0, 1]), top=top)
        else:
            ax = fig.add_subplot()
    else:
        fig = ax.figure
    if circuit:
        draw_circuit(state, ax, top=top)
    else:
        draw(state, ax, view, mode=mode, seed=seed)
    _layout(fig)
    return fig


def _node_xy(part: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    nodes = part.get("nodes") or []
    return (np.array([float(n["x"]) for n in nodes], dtype=np.float64),
            np.array([float(n["y"]) for n in nodes], dtype=np.float64))


def draw_circuit(state: Mapping[str, Any], ax, *, top: int = TOP_EDGES) -> None:
    """Draw a circuit state's graph into ``ax``: every node by layer (the ones the drawn edges
    touch larger and named), its ``top`` edges by ``|score|`` coloured by their score on the
    diverging map (±max |score| over every edge), the largest on top, and a colour bar."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path

    part = state.get("circuit") or {}
    nodes = part.get("nodes") or []
    xs, ys = _node_xy(part)
    senders, receivers, ports = part.get("senders") or [], part.get("receivers") or [], part.get("ports") or []
    edges = circuit_edges(state)
    vmax = symmetric_max([e["score"] for e in edges])
    shown = edges[: max(0, int(top))]
    cmap, norm = colormap(), Normalize(-vmax, vmax)
    used: set[int] = set()
    for e in reversed(shown):  # the smallest first: the largest is drawn on top
        s, t = senders[e["col"]], receivers[e["row"]]
        used.update((s, t))
        x0, y0 = xs[s], ys[s] + _NODE_R
        x1, y1 = xs[t] + (ports[e["row"]] if e["row"] < len(ports) else 0.0), ys[t] - _NODE_R
        rise = max(y1 - y0, 0.3) * 0.45
        path = Path([(x0, y0), (x0, y0 + rise), (x1, y1 - rise), (x1, y1)],
                    [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4])
        size = abs(e["score"]) / vmax
        ax.add_patch(PathPatch(path, fill=False, edgecolor=cmap(norm(e["score"])), linewidth=0.6 + 2.6 * size,
                               alpha=0.9, zorder=1 + size))
    named = len(nodes) <= 48
    for kind, marker in _MARKERS.items():
        idle = [i for i, n in enumerate(nodes) if n["kind"] == kind and i not in used]
        busy = [i for i, n in enumerate(nodes) if n["kind"] == kind and i in used]
        ax.scatter(xs[idle], ys[idle], s=14, marker=marker, color="#d9d9d9", edgecolors="#9e9e9e", linewidths=0.5,
                   zorder=3)
        ax.scatter(xs[busy], ys[busy], s=70, marker=marker, color="#ffffff", edgecolors="#212121", linewidths=1.0,
                   zorder=4)
    for i, node in enumerate(nodes):
        if i in used or named:
            # Beside the node: edges leave a node from its top and arrive at its lower side.
            ax.annotate(tick_text(node["name"], 12), (xs[i], ys[i]), xytext=(6, 0), textcoords="offset points",
                        ha="left", va="center", fontsize=6.5, color="#212121" if i in used else "#9e9e9e", zorder=5)
    levels: dict[int, str] = {}
    for node in nodes:
        layer = int(node["layer"])
        levels.setdefault(layer, _ROW_NAMES.get(node["kind"], f"layer {layer}"))
    ax.set_yticks([layer + 1 for layer in sorted(levels)])
    ax.set_yticklabels([levels[layer] for layer in sorted(levels)], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.6, (max(ys) if len(ys) else 1) + 0.6)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    metric = str(state.get("metric") or "metric")
    agreement = part.get("agreement") or {}
    checks = ""
    if agreement.get("spearman") is not None and agreement.get("n"):
        checks = f" · exact patches of {int(agreement['n'])}: Spearman {agreement['spearman']:.2f}"
    sides = f"top {len(shown)} of {len(edges)} edges by |score|{checks}"
    ax.set_title(f"{tick_text(state.get('title') or 'pipatch', 110)}\n{tick_text(sides, 120)}", fontsize=9)
    ax.figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.03, pad=0.01, shrink=0.7,
                       label=f"estimated change of {tick_text(metric, 40)}")


def draw_faithfulness(state: Mapping[str, Any], ax, *, top: int | None = None) -> None:
    """Draw a circuit state's faithfulness curve into ``ax``: normalized recovery of the circuit
    of the top-n edges against n (a log scale past 1), the share to reach (dashed), the size
    that reaches it (dotted) and, where given, the ``top`` edges the graph draws (grey)."""
    faithful = (state.get("circuit") or {}).get("faithfulness") or {}
    sizes = [int(n) for n in faithful.get("sizes") or []]
    values = [np.nan if v is None else float(v) for v in faithful.get("recovery") or []]
    ax.plot(sizes, values, marker="o", markersize=3, linewidth=1.2, color="#2166ac")
    share, size = faithful.get("share"), faithful.get("size")
    if share is not None:
        ax.axhline(float(share), linestyle="--", linewidth=0.9, color="#b2182b", label=f"share {float(share):.2g}")
    if size is not None:
        ax.axvline(int(size), linestyle=":", linewidth=1.1, color="#b2182b", label=f"reached at {int(size)} edges")
    if top is not None and sizes:
        ax.axvline(min(int(top), max(sizes)), linewidth=0.8, color="#9e9e9e", label=f"drawn: {min(int(top), max(sizes))}")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(left=0)
    ax.set_xlabel("edges kept (top n by |score|)", fontsize=8)
    ax.set_ylabel("normalized recovery", fontsize=8)
    ax.tick_params(labelsize=7)
    what = "no size reaches the share" if size is None and share is not None else ""
    ax.set_title("faithfulness" + (f"\n{what}" if what else ""), fontsize=9)
    ax.legend(fontsize=6.5, loc="best", framealpha=0.8)


def png(state: Mapping[str, Any], view: str | None = None, *, mode: str = "recovery", seed: int = -1,
        dpi: float = 80, top: int = TOP_EDGES) -> bytes:
    """:func:`figure` as PNG bytes."""
    fig = figure(state, view, mode=mode, seed=seed, dpi=dpi, top=top)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
