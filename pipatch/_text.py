"""Text: strings made safe to send (UTF-8, strict JSON), and the grid rendered for terminals."""

from __future__ import annotations

import math
import re
from typing import Any

_SHADES = " ░▒▓█"
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(value: Any) -> str:
    """``str(value)`` safe for UTF-8: lone surrogates become U+FFFD.

    A lone surrogate (``"\\ud800"``, from a user string or a byte-level tokenizer) cannot be
    encoded as UTF-8: jupyter_client would fail to send the comm / display message and nbformat
    would fail to save the notebook. A valid pair written as two code points is joined.
    """
    s = str(value)
    if _SURROGATE.search(s) is None:
        return s
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def json_safe(value: Any) -> Any:
    """A JSON-like value made strict and UTF-8 safe: NaN/Inf → None, every string (keys too)
    through :func:`clean_text`. What the MIME bundle, the widget's ``detail`` and ``to_json``
    send."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def token_label(text: str, width: int) -> str:
    """A token as a fixed-width column header, with control characters made visible."""
    shown = "".join(ch if ch.isprintable() and ch != "\u202e" else f"\\x{ord(ch):02x}" if ord(ch) < 256
                    else f"\\u{ord(ch):04x}" for ch in text)
    shown = shown.replace(" ", "·") if shown.strip() == "" else shown
    return shown[: width - 1].rjust(width)


def shade(value: float) -> str:
    """``░▒▓█`` for recovery in [0, 1]; ``?`` for NaN; values outside are clipped."""
    if value is None or math.isnan(value):
        return "?"
    return _SHADES[int(min(max(value, 0.0), 0.999) * len(_SHADES))]


def text_heatmap(result, view: str, width: int = 7, top: int = 5) -> str:
    """Rows = layers, columns = tokens (or heads); then the top cells by recovery."""
    grid = result.mean(view)
    lines = [f"{result.title}  [{view}, {result.metric}; clean {result.clean_value:.4g}, "
             f"corrupt {float(result.corrupt.mean()):.4g}]"]
    lines.append(" " * 5 + "".join(token_label(c, width) for c in result.columns))
    for layer, label in enumerate(result.layers):
        cells = "".join(shade(float(v)).rjust(width) for v in grid[layer].tolist())
        lines.append(f"L{str(label):<4}"[:5] + cells)
    best = result.top_cells(top, view)
    # Row and column *labels*: a one-sender path grid's only row is its sender's layer, not 0.
    what = {"head": "head", "token": "token"}.get(result.col_axis, "column")
    for row, col, value in best:
        lines.append(f"layer {str(result.layers[row]):>3}  {what} {result.columns[col]!r}  recovery {value:.3f}")
    for warning in result.warnings:
        lines.append(f"warning: {warning}")
    if result.status != "done":
        lines.append(f"status: {result.status}" + (f" — {result.message}" if result.message else ""))
    return "\n".join(lines)
