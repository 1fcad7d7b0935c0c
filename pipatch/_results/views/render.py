"""The one static renderer: a state drawn with matplotlib, as a figure or PNG bytes.

``Result.plot()``, the CLI's ``--png``, ``Result._repr_mimebundle_`` and the widget's saved
bundle all draw through :func:`draw`. Layer 0 is the top row (as in the live grid and the
text grid), columns run left to right, the colour scale is :mod:`.colors` (diverging, centred
at 0, symmetric ±max|v| over the finished rows, for signed values; sequential for a probability
or a rank drawn as itself; NaN grey), rows not computed yet are hatched, the subject's columns
are marked (bold tick labels and ▲ under the axis), cells checked by an exact patch are
outlined, and every label goes through the one escaper (then ``$`` is escaped for mathtext).
Plots made together can share one colour scale (``scale=``: :func:`shared_scale`).

A circuit's state (:func:`~pipatch._results.views.circuit.is_circuit`) is drawn as its graph instead
(:func:`draw_circuit`, plus :func:`draw_faithfulness` beside it): the nodes where the state's
``circuit`` part puts them, the ``top`` edges of :func:`~pipatch._results.views.circuit.circuit_edges`
as curves from the sender's top to the receiver's port (a cubic whose control points lie 45 %
of the rise above the start and below the end, as ``edgePath`` in ``js/circuit.ts``), on the
diverging map; unless told, as many edges as the faithful circuit has (:func:`default_top`).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..._base.errors import PipatchError
from ..._model.graph import EMB_DRAWN, HEAD_DRAWN, LOGITS_DRAWN, MLP_DRAWN
from .circuit import circuit_edges, is_circuit
from .colors import DIVERGING, PENDING_RGB, RANK, colormap, scale_kind, scale_norm, value_range
from .schema import decode_array, done_span, select_matrix
from .strings import escape_label
from .text import values_label

__all__ = [
    "TOP_EDGES", "check_scale", "color_scale", "default_top", "draw", "draw_circuit", "draw_faithfulness",
    "figure_size", "new_figure", "png", "scale_range", "shared_scale", "tick_text",
]  # fmt: skip

#: How many edges a circuit's figure draws unless told, when it has no faithful circuit (the
#: browser's slider starts there too).
TOP_EDGES = 50
#: The subject's marks: tick labels and the ▲ under the axis.
SUBJECT_RGB = "#b2182b"
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


def _drawn(state: Mapping[str, Any], view: str, mode: str, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """The [rows, cols] values drawn (float64, at least 1 × 1) and the finished rows' span."""
    grid = select_matrix(state, view, seed, mode)
    if grid is None:
        grid = np.full((len(state.get("row_labels") or []) or 1, len(state.get("col_labels") or []) or 1), np.nan)
    grid = np.array(grid, dtype=np.float64)
    if grid.size == 0:
        grid = np.full((1, 1), np.nan)
    return grid, done_span(state, view, grid.shape[0])


def draw(state: Mapping[str, Any], ax, view: str | None = None, *, mode: str = "recovery", seed: int = -1,
         scale: tuple[float, float] | None = None):
    """Draw ``state``'s ``view`` into the matplotlib axes ``ax`` (plus its colour bar); returns
    the image. ``scale``: the colour scale's ``(vmin, vmax)`` (``None``: this view's own,
    :func:`scale_range`)."""
    from matplotlib.transforms import blended_transform_factory

    view = _view(state, view)
    row_labels = [str(x) for x in state.get("row_labels") or []]
    col_labels = [str(x) for x in state.get("col_labels") or []]
    grid, (lo, hi) = _drawn(state, view, mode, seed)
    n_rows, n_cols = grid.shape
    kind = scale_kind(state, mode)
    vmin, vmax = scale if scale is not None else scale_range(state, view, mode, grid, (lo, hi))
    grid[:lo], grid[hi:] = np.nan, np.nan
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=colormap(kind=kind), norm=scale_norm(kind, vmin, vmax),
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
    subject = [c for c in state.get("subject") or [] if 0 <= c < n_cols]
    for tick, c in zip(ax.get_xticklabels(), range(0, n_cols, col_step)):
        if c in subject:
            tick.set_fontweight("bold")
            tick.set_color(SUBJECT_RGB)
    if subject:  # ▲ under each subject column, also where its tick label is thinned out
        ax.scatter(subject, [0.0] * len(subject), marker="^", s=22, color=SUBJECT_RGB, clip_on=False, zorder=5,
                   transform=blended_transform_factory(ax.transData, ax.transAxes), gid="subject")
    verified = _verified_cells(state, view, (n_rows, n_cols))
    if verified:
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle
        from matplotlib.patheffects import withStroke

        # Black on a white halo: seen on the palest and the darkest cells alike.
        ax.add_collection(PatchCollection([Rectangle((c - 0.4, r - 0.4), 0.8, 0.8) for r, c in verified],
                                          facecolor="none", edgecolor="#000000", linewidth=1.1, gid="verified",
                                          path_effects=[withStroke(linewidth=3.0, foreground="#ffffff")]))
    ax.set_yticks(range(0, n_rows, row_step))
    ax.set_yticklabels([tick_text(row_labels[i]) if i < len(row_labels) else str(i) for i in range(0, n_rows, row_step)],
                       fontsize=8)
    marks = ("  ▲ subject" if subject else "") + ("  □ checked by an exact patch" if verified else "")
    ax.set_xlabel(escape_label(state.get("col_axis") or "token", 24) + marks)
    ax.set_ylabel("layer")
    labels = state.get("seed_labels") or []
    seed_text = "" if seed < 0 else f", {labels[seed] if seed < len(labels) else f'seed {seed}'}"
    sides = "".join(f"\n{tick_text(side, 85)}" for side in state.get("sides") or [])
    ax.set_title(f"{tick_text(state.get('title') or 'pipatch', 110)}{sides}\n{tick_text(view, 40)}: "
                 f"{tick_text(values_label(state, mode), 60)}{seed_text}", fontsize=9)
    bar = ax.figure.colorbar(image, ax=ax, label=values_label(state, mode, short=True), fraction=0.05, pad=0.02)
    if kind == RANK:  # a log scale: ticks at 0, 1, 10, 100, … and the worst rank drawn
        ticks = sorted({vmin, *(10.0 ** k for k in range(0, 10) if vmin < 10.0 ** k < 0.8 * vmax), vmax})
        bar.set_ticks(ticks, labels=[f"{t:.0f}" for t in ticks])
        bar.set_label("rank (0: the top token)")
    return image


def _verified_cells(state: Mapping[str, Any], view: str, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """The (row, col) cells of ``view`` checked by an exact patch (its ``verified`` array)."""
    spec = (state.get("arrays") or {}).get(f"{view}/verified")
    if spec is None:
        return []
    mask = decode_array(spec)
    if mask.size != shape[0] * shape[1]:
        return []
    rows, cols = np.nonzero(np.nan_to_num(mask.reshape(shape)) > 0)
    return list(zip(rows.tolist(), cols.tolist()))


def scale_range(state: Mapping[str, Any], view: str, mode: str, grid: np.ndarray, span: tuple[int, int]
                ) -> tuple[float, float]:
    """The colour scale's ``(vmin, vmax)`` (:func:`~pipatch._results.views.colors.value_range` of its
    kind) over the finished rows drawn (``range(*span)``: :func:`~pipatch._results.views.schema.done_span`);
    for one side of a comparison over both sides, so switching a ↔ b keeps the colours
    comparable. As ``scaleRange`` in ``js/format.ts``."""
    done = slice(*span)
    kind = scale_kind(state, mode)
    if mode in ("a", "b") and state.get("sides"):
        sides = [select_matrix(state, view, -1, side) for side in ("a", "b")]
        return value_range(kind, np.concatenate([np.ravel(m[done]) for m in sides if m is not None]
                                                or [grid[done].ravel()]))
    return value_range(kind, grid[done])


def color_scale(state: Mapping[str, Any], view: str | None = None, *, mode: str = "recovery", seed: int = -1
                ) -> tuple[str, float, float]:
    """The colour scale a figure of ``state`` draws by itself: ``(kind, vmin, vmax)``; a
    circuit's is diverging over its edges' scores."""
    if is_circuit(state):
        return (DIVERGING, *value_range(DIVERGING, [e["score"] for e in circuit_edges(state)]))
    view = _view(state, view)
    grid, span = _drawn(state, view, mode, seed)
    return (scale_kind(state, mode), *scale_range(state, view, mode, grid, span))


def check_scale(scale: Any) -> tuple[float, float] | None:
    """``scale=`` as a range: ``"auto"`` / ``None`` → ``None`` (each plot its own), a pair of
    finite numbers with ``vmin < vmax`` → itself; anything else (``"shared"`` too: that is
    :func:`pipatch.plot`'s) refused in one line."""
    if scale is None or (isinstance(scale, str) and scale == "auto"):
        return None
    if isinstance(scale, str) and scale == "shared":
        raise PipatchError("scale='shared' is for plots made together: pipatch.plot([a, b], scale='shared'); "
                           "one plot takes 'auto' or (vmin, vmax)")
    try:
        vmin, vmax = (float(v) for v in scale)
    except (TypeError, ValueError):
        raise PipatchError(f"scale={scale!r} is not a colour range: pass 'auto' or (vmin, vmax)") from None
    if not (math.isfinite(vmin) and math.isfinite(vmax) and vmin < vmax):
        raise PipatchError(f"scale=({vmin}, {vmax}) is no range: pass two finite numbers with vmin < vmax")
    return vmin, vmax


def shared_scale(scales: list[tuple[str, float, float]]) -> tuple[float, float]:
    """One ``(vmin, vmax)`` covering every :func:`color_scale` in ``scales``; refused in one line
    when they colour different kinds of values (a probability and a recovery, say)."""
    kinds = sorted({kind for kind, _, _ in scales})
    if len(kinds) > 1:
        raise PipatchError(f"these plots colour different kinds of values ({', '.join(kinds)}), so one colour "
                           "scale would mislead: plot them with scale='auto' or pass scale=(vmin, vmax)")
    return min(lo for _, lo, _ in scales), max(hi for _, _, hi in scales)


def default_top(state: Mapping[str, Any]) -> int:
    """How many edges a circuit's figure draws unless told: the faithful circuit's size (the
    smallest that reaches the share) where the curve found one, else :data:`TOP_EDGES`. As
    ``defaultTop`` in ``js/circuit.ts``."""
    size = ((state.get("circuit") or {}).get("faithfulness") or {}).get("size")
    return int(size) if size is not None and int(size) > 0 else TOP_EDGES


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


def new_figure(size: tuple[float, float], *, dpi: float = 100, pyplot: bool = False):
    """An empty figure of ``size`` inches: a pyplot one (``pyplot=True``, shown by
    ``plt.show()``) or an off-screen Agg one that touches no pyplot state."""
    if pyplot:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=size, dpi=dpi)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def figure(state: Mapping[str, Any], view: str | None = None, *, mode: str = "recovery", seed: int = -1,
           ax=None, dpi: float = 100, pyplot: bool = False, top: int | None = None,
           scale: tuple[float, float] | None = None):
    """A figure of ``state`` (drawn into ``ax`` when given). ``pyplot=True`` makes it a pyplot
    figure (shown by ``plt.show()``); otherwise an off-screen Agg figure that touches no
    pyplot state. A circuit's state is its graph (``top`` edges, ``None``: :func:`default_top`)
    with, in a new figure, its faithfulness curve beside it. ``scale``: the colour scale's
    ``(vmin, vmax)`` (``None``: the state's own)."""
    circuit = is_circuit(state)
    top = default_top(state) if top is None else top
    if ax is None:
        fig = new_figure(_circuit_size(state) if circuit else figure_size(state), dpi=dpi, pyplot=pyplot)
        if circuit and (state.get("circuit") or {}).get("faithfulness"):
            grid = fig.add_gridspec(2, 2, width_ratios=[4, 1.35], height_ratios=[1, 1.5])
            ax = fig.add_subplot(grid[:, 0])
            draw_faithfulness(state, fig.add_subplot(grid[0, 1]), top=top)
        else:
            ax = fig.add_subplot()
    else:
        fig = ax.figure
    if circuit:
        draw_circuit(state, ax, top=top, scale=scale)
    else:
        draw(state, ax, view, mode=mode, seed=seed, scale=scale)
    _layout(fig)
    return fig


def _node_xy(part: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    nodes = part.get("nodes") or []
    return (np.array([float(n["x"]) for n in nodes], dtype=np.float64),
            np.array([float(n["y"]) for n in nodes], dtype=np.float64))


def draw_circuit(state: Mapping[str, Any], ax, *, top: int | None = None,
                 scale: tuple[float, float] | None = None) -> None:
    """Draw a circuit state's graph into ``ax``: every node by layer (the ones the drawn edges
    touch larger and named), its ``top`` edges by ``|score|`` (``None``: :func:`default_top`)
    coloured by their score on the diverging map (±max |score| over every edge, or ``scale``),
    the largest on top, and a colour bar."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path

    part = state.get("circuit") or {}
    nodes = part.get("nodes") or []
    xs, ys = _node_xy(part)
    senders, receivers, ports = part.get("senders") or [], part.get("receivers") or [], part.get("ports") or []
    edges = circuit_edges(state)
    vmin, vmax = scale if scale is not None else value_range(DIVERGING, [e["score"] for e in edges])
    vmax = max(abs(vmin), abs(vmax))
    shown = edges[: max(0, int(default_top(state) if top is None else top))]
    cmap, norm = colormap(), scale_norm(DIVERGING, -vmax, vmax)
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
    size = (part.get("faithfulness") or {}).get("size")
    faithful = " (the faithful circuit)" if size is not None and len(shown) == int(size) else ""
    sides = f"top {len(shown)} of {len(edges)} edges by |score|{faithful}{checks}"
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
        dpi: float = 80, top: int | None = None) -> bytes:
    """:func:`figure` as PNG bytes."""
    fig = figure(state, view, mode=mode, seed=seed, dpi=dpi, top=top)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
