"""Matplotlib rendering of a result: a static heatmap (figures, PNG export, notebook fallback)."""

from __future__ import annotations

import io
import math
import warnings


def plot_result(result, view: str, ax=None):
    """Heatmap of mean recovery: tokens on x, layers on y (layer 0 at the bottom).

    A diverging colour map centred at 0 (``RdBu_r``), a colour bar, NaN shown in grey.
    Returns the figure.
    """
    import matplotlib

    if ax is None:
        import matplotlib.pyplot as plt

        n_cols, n_rows = len(result.columns), len(result.layers)
        fig, ax = plt.subplots(figsize=(min(2 + 0.6 * n_cols, 24), min(1.5 + 0.25 * n_rows, 16)))
    else:
        fig = ax.figure
    from matplotlib.colors import TwoSlopeNorm

    grid = result.mean(view).numpy()
    finite = grid[~(grid != grid)]
    bound = max(1e-6, float(abs(finite).max())) if finite.size else 1.0
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#b0b0b0")
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap=cmap,
                      norm=TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound), interpolation="nearest")
    ax.set_xticks(range(len(result.columns)))
    ax.set_xticklabels([_printable(c) for c in result.columns], rotation=60, ha="right", fontsize=8)
    step = max(1, math.ceil(len(result.layers) / 24))
    ax.set_yticks(range(0, len(result.layers), step))
    ax.set_yticklabels(result.layers[::step], fontsize=8)
    ax.set_xlabel(result.col_axis)
    ax.set_ylabel("layer")
    ax.set_title(f"{_printable(result.title, 110)}\n{view}: normalized recovery ({result.metric})", fontsize=9)
    fig.colorbar(image, ax=ax, label="recovery")
    with warnings.catch_warnings():
        # A figure too small for its labels keeps matplotlib's default margins: fine for a plot.
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        fig.tight_layout()
    return fig


def _printable(text: str, limit: int = 16) -> str:
    """A label as matplotlib should draw it: control characters spelled out (they would
    vanish), ``$`` escaped (mathtext would interpret it), at most ``limit`` characters."""
    shown = "".join(ch if ch.isprintable() else f"\\u{ord(ch):04x}" for ch in text)
    if len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return shown.replace("$", r"\$")


def png_bytes(result, view: str | None = None, dpi: int = 80) -> bytes:
    """The plot as PNG bytes, drawn off-screen (no pyplot state is touched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n_cols, n_rows = len(result.columns), len(result.layers)
    fig = Figure(figsize=(min(2 + 0.6 * n_cols, 24), min(1.5 + 0.25 * n_rows, 16)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    plot_result(result, view or result.views[0], ax=ax)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
