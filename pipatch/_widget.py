"""The grid widget (anywidget): a view of a result's state, and its saved-notebook bundle.

This module draws and nothing else: it imports no pipatch module that imports it. Running a
plan live and answering clicks live in :mod:`pipatch._live`, whose ``PatchGrid`` (the public
``pipatch.PatchGrid``) is :class:`GridWidget` plus both.

The kernel owns the state; the browser only draws it (``js/grid.ts``). Arrays travel as
binary buffers (``{"data": bytes, "dtype": "float32", "shape": [...]}``), never JSON lists.
Updates are coalesced to at most ~20 per second (the server drops iopub messages above its
rate limit) and :meth:`GridWidget.flush` ends with a full sync so the browser ends equal to
the kernel.

Stop while a cell runs
----------------------
JupyterLab >= 4.4 sends comm messages on a kernel *subshell* when the kernel advertises
``"kernel subshells"`` in ``kernel_info.supported_features`` (ipykernel >= 7 does; setting
*Kernel → Comms over subshells*, default ``perCommTarget``). ipykernel runs each subshell in
its own thread, so the ``comm_msg`` carrying ``stop_requested = True`` is handled, and the
trait observers run, in that thread while the main thread is still executing the cell.
Nothing else is needed: the engine keeps running the sweep on the main thread and checks a
flag (set by :meth:`GridWidget.on_stop`) between chunks; ``KeyboardInterrupt`` (the
Interrupt button) still lands in the main thread as usual. The observer must only set a
flag / enqueue work: it runs concurrently with the sweep, so it must never touch the model.
Front ends without subshells (classic Notebook, VS Code, Lab with the setting
``disabled``) queue the comm message until the cell ends; there the Interrupt button is the
way to stop, and the engine must keep its partial grid on ``KeyboardInterrupt``.

Saved notebooks
---------------
A widget output is ``application/vnd.jupyter.widget-view+json`` and the widget renderer
(rank -10) always wins; once the kernel is gone it prints "Error displaying widget: model
not found" and never falls back to other MIME types. So the live widget is shown with a
``display_id`` and, when the run ends, :meth:`GridWidget.display_final` replaces that display
with a bundle without the widget view: ``application/vnd.pipatch.grid+json`` (drawn by the
pipatch lab extension with the same grid code, no kernel), ``image/png`` (nbconvert, GitHub,
other front ends) and ``text/plain``.
"""

from __future__ import annotations

import base64
import io
import os
import pathlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anywidget
import numpy as np
import traitlets as t

from ._text import clean_text, json_safe

MIME_TYPE = "application/vnd.pipatch.grid+json"
MIME_VERSION = 1

_STATIC_ESM = pathlib.Path(__file__).parent / "static" / "widget.js"
_MISSING_ESM = """
export default {
  render({ el }) {
    el.textContent = "pipatch: the front end is not built (run `npm run build` in the pipatch checkout).";
  },
};
"""

#: Kernel → browser traits, in the order of the state dict produced by ``Result.to_state()``.
STATE_KEYS: tuple[str, ...] = (
    "title",
    "kind",
    "model_name",
    "metric",
    "row_labels",
    "col_labels",
    "col_axis",
    "views",
    "n_seeds",
    "arrays",
    "rows_done",
    "total_rows",
    "status",
    "message",
    "warnings",
    "elapsed",
    "eta",
    "baselines",
    "detail",
    "stoppable",
)

# --------------------------------------------------------------------------- arrays


def _array_from_spec(spec: Any) -> np.ndarray:
    """A float32 ndarray from an ndarray / tensor / ``{data, dtype, shape}`` (bytes or base64)."""
    if isinstance(spec, Mapping):
        data = spec.get("data")
        dtype = np.dtype(spec.get("dtype", "float32")).newbyteorder("<")
        shape = tuple(int(s) for s in spec.get("shape", ()))
        if isinstance(data, str):
            raw = base64.b64decode(data)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            return _array_from_spec(data)
        arr = np.frombuffer(raw, dtype=dtype)
        return arr.reshape(shape) if shape else arr
    if hasattr(spec, "detach"):  # torch.Tensor without importing torch
        spec = spec.detach().float().cpu().numpy()
    return np.asarray(spec, dtype=np.float32)


def encode_array(spec: Any) -> dict[str, Any]:
    """Wire form of one array: raw little-endian float32 bytes plus dtype and shape."""
    if (
        isinstance(spec, Mapping)
        and isinstance(spec.get("data"), bytes)
        and spec.get("dtype", "float32") == "float32"
    ):
        return {"data": spec["data"], "dtype": "float32", "shape": [int(s) for s in spec["shape"]]}
    arr = np.ascontiguousarray(_array_from_spec(spec), dtype="<f4")
    return {"data": arr.tobytes(), "dtype": "float32", "shape": list(arr.shape)}


def encode_arrays(arrays: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {str(k): encode_array(v) for k, v in (arrays or {}).items()}


def arrays_to_base64(arrays: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """JSON form of the arrays for the MIME document: base64 of the float32 bytes."""
    out = {}
    for k, v in encode_arrays(arrays).items():
        out[k] = {
            "dtype": "float32",
            "shape": v["shape"],
            "data": base64.b64encode(v["data"]).decode("ascii"),
        }
    return out


def _clean_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Keep the known keys of a state dict, put arrays in wire form, make text UTF-8 safe."""
    out: dict[str, Any] = {}
    for k in STATE_KEYS:
        if k in state:
            v = state[k]
            if k == "arrays":
                v = {clean_text(a): b for a, b in encode_arrays(v).items()}
            elif k in ("row_labels", "col_labels", "views", "warnings"):
                v = [clean_text(x) for x in v]
            elif k in ("title", "kind", "model_name", "metric", "col_axis", "status", "message"):
                v = clean_text(v)
            elif k in ("n_seeds", "total_rows"):
                v = int(v)
            elif k in ("elapsed", "eta"):
                v = float(v)
            elif k == "rows_done":
                v = {clean_text(a): int(b) for a, b in dict(v).items()}
            elif k == "baselines":
                v = {clean_text(a): float(b) for a, b in dict(v).items()}
            elif k == "detail":
                v = json_safe(dict(v or {}))
            elif k == "stoppable":
                v = bool(v)
            out[k] = v
    return out


# --------------------------------------------------------------------------- labels

_INVISIBLE_RANGES = (
    (0x00, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x34F, 0x34F), (0x61C, 0x61C),
    (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F),
    (0x2028, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFFB), (0xD800, 0xDFFF),
    (0xE0000, 0xE0FFF),
)  # fmt: skip


def escape_label(label: str, max_chars: int | None = None) -> str:
    """Same rules as ``js/format.ts``: invisible characters become ``⟨U+XXXX⟩``."""
    out = []
    for ch in str(label):
        cp = ord(ch)
        if any(lo <= cp <= hi for lo, hi in _INVISIBLE_RANGES):
            out.append(f"⟨U+{cp:04X}⟩")
        else:
            out.append(ch)
    s = "".join(out)
    if s and s.strip(" ") == "":
        s = "␣" * min(len(s), 8)
    if max_chars is not None and len(s) > max_chars:
        s = s[: max(1, max_chars - 1)] + "…"
    return s


# --------------------------------------------------------------------------- PNG


def state_png(
    state: Mapping[str, Any], *, view: str | None = None, mode: str = "recovery"
) -> bytes:
    """A static PNG of one view (matplotlib, Agg), for the saved bundle and other front ends."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    views = list(state.get("views") or [])
    view = view if view in views else (views[0] if views else "")
    arrays = state.get("arrays") or {}
    key = f"{view}/{'raw_mean' if mode == 'raw' else 'mean'}"
    rows_labels = [str(x) for x in state.get("row_labels", [])]
    col_labels = [str(x) for x in state.get("col_labels", [])]
    if key in arrays:
        grid = np.array(_array_from_spec(arrays[key]), dtype=np.float32)
    else:
        grid = np.full((len(rows_labels), len(col_labels)), np.nan, dtype=np.float32)
    if grid.ndim != 2:
        grid = grid.reshape(len(rows_labels) or 1, -1)
    if grid.size == 0:
        grid = np.full((1, 1), np.nan, dtype=np.float32)
    n_rows, n_cols = grid.shape
    done = int((state.get("rows_done") or {}).get(view, n_rows))
    shown = np.ma.masked_invalid(grid.copy())
    finite = grid[:done][np.isfinite(grid[:done])]
    vmax = float(np.abs(finite).max()) if finite.size else 1.0
    vmax = vmax if vmax > 0 else 1.0
    cmap = LinearSegmentedColormap.from_list(
        "pipatch", ["#2166ac", "#f7f7f7", "#b2182b"]
    ).with_extremes(bad="#808080")

    width = min(max(4.0, 1.6 + 0.32 * n_cols), 40.0)
    height = min(max(2.5, 1.4 + 0.22 * n_rows), 30.0)
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(shown, cmap=cmap, vmin=-vmax, vmax=vmax, aspect="auto", interpolation="nearest")
    if done < n_rows:
        ax.axhspan(done - 0.5, n_rows - 0.5, facecolor="#eeeeee", edgecolor="#bdbdbd", hatch="//")

    def tick_text(s: str) -> str:
        # mathtext would interpret $…$ in token text.
        return escape_label(s, 16).replace("$", r"\$")

    col_step = max(1, int(np.ceil(n_cols / 80)))
    row_step = max(1, int(np.ceil(n_rows / 60)))
    ax.set_xticks(range(0, n_cols, col_step))
    ax.set_xticklabels(
        [
            tick_text(col_labels[i]) if i < len(col_labels) else str(i)
            for i in range(0, n_cols, col_step)
        ],
        rotation=90,
        fontsize=7,
    )
    ax.set_yticks(range(0, n_rows, row_step))
    ax.set_yticklabels(
        [
            tick_text(rows_labels[i]) if i < len(rows_labels) else str(i)
            for i in range(0, n_rows, row_step)
        ],
        fontsize=7,
    )
    ax.set_ylabel("layer")
    title = tick_text(str(state.get("title") or "pipatch"))
    ax.set_title(f"{title} [{view}]" if view else title, fontsize=9)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_label("raw metric" if mode == "raw" else "normalized recovery", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def state_to_mime(state: Mapping[str, Any], ui: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``application/vnd.pipatch.grid+json`` document: the state with base64 arrays."""
    clean = _clean_state(state)
    doc: dict[str, Any] = {"version": MIME_VERSION}
    for k, v in clean.items():
        doc[k] = arrays_to_base64(v) if k == "arrays" else v
    doc["stoppable"] = False
    doc.pop("detail", None)
    if ui:
        doc["ui"] = json_safe({k: ui[k] for k in ("view", "seed", "mode") if k in ui})
    return _strict_json(doc)


def _strict_json(value: Any) -> Any:
    """NaN / ±inf → None, so the document is strict JSON (the renderer reads None as NaN)."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict_json(v) for v in value]
    return value


def state_text(state: Mapping[str, Any]) -> str:
    views = list(state.get("views") or [])
    n_rows = len(state.get("row_labels") or [])
    n_cols = len(state.get("col_labels") or [])
    axis = "heads" if state.get("col_axis") == "head" else "tokens"
    title = escape_label(str(state.get("title") or "pipatch"), 120)
    bits = [str(state.get("kind") or ""), str(state.get("model_name") or "")]
    head = " ".join(b for b in bits if b)
    status = str(state.get("status") or "done")
    msg = state.get("message")
    status_txt = f"{status}: {msg}" if msg else status
    return clean_text(
        f"PatchGrid: {title} ({head}; {n_rows} layers × {n_cols} {axis}; "
        f"views {', '.join(str(v) for v in views) or '-'}; {status_txt})"
    )


def final_bundle_from_state(
    state: Mapping[str, Any], *, ui: Mapping[str, Any] | None = None, png: bytes | None = None
) -> dict[str, Any]:
    """Mime bundle for the finished grid: MIME document + PNG + text, no widget view."""
    if png is None:
        try:
            png = state_png(state, view=(ui or {}).get("view"))
        except Exception:  # noqa: BLE001 - a PNG is a convenience; never lose the grid over it
            png = None
    bundle: dict[str, Any] = {MIME_TYPE: state_to_mime(state, ui), "text/plain": state_text(state)}
    if png:
        bundle["image/png"] = base64.b64encode(png).decode("ascii")
    return bundle


# --------------------------------------------------------------------------- widget


def _prefer_frontend_subshell(comm: Any) -> None:
    """Let the front end's subshell handle this comm's messages.

    ipykernel >= 7.3 routes an incoming ``comm_msg`` to the subshell that last *published*
    on the comm (``BaseComm._reply_subshell_for``), so that request/reply widgets answer the
    loop that asked. A grid widget is created and updated from the main shell, so every click
    would be routed back to the main shell and wait for the running cell to end. The grid
    has no request/reply traffic: keep the subshell JupyterLab chose (``default``).
    """
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = lambda data, default: default




class GridWidget(anywidget.AnyWidget):
    """The recovery heatmap as a widget: rows are layers, columns are tokens or heads.

    A view and nothing else: it draws a state, coalesces updates and sends Stop and clicks
    back through :meth:`on_stop` / :meth:`on_select`. Running a plan and answering clicks is
    :mod:`pipatch._live`'s job (its ``PatchGrid`` is this class plus both).

    Parameters
    ----------
    state : dict or Result, optional
        A state dict (``Result.to_state()`` or a partial one; see ``STATE_KEYS``), or a Result
        to draw.
    min_interval : float
        Smallest time between two coalesced updates sent by :meth:`push` (seconds).
    """

    # The bundle's text, not its path: for a path anywidget connects every instance to the
    # file watcher's signal with a strong reference, so no grid (nor the Result it shows)
    # would ever be freed. ``ANYWIDGET_HMR=1`` keeps the path (hot reload while developing).
    _esm = (
        (_STATIC_ESM if os.environ.get("ANYWIDGET_HMR") == "1" else _STATIC_ESM.read_text("utf-8"))
        if _STATIC_ESM.exists()
        else _MISSING_ESM
    )

    # kernel → browser
    title = t.Unicode("").tag(sync=True)
    kind = t.Unicode("trace").tag(sync=True)
    model_name = t.Unicode("").tag(sync=True)
    metric = t.Unicode("").tag(sync=True)
    row_labels = t.List(t.Unicode()).tag(sync=True)
    col_labels = t.List(t.Unicode()).tag(sync=True)
    col_axis = t.Unicode("token").tag(sync=True)
    views = t.List(t.Unicode()).tag(sync=True)
    n_seeds = t.Int(1).tag(sync=True)
    arrays = t.Dict().tag(sync=True)
    rows_done = t.Dict().tag(sync=True)
    total_rows = t.Int(0).tag(sync=True)
    status = t.Unicode("running").tag(sync=True)
    message = t.Unicode("").tag(sync=True)
    warnings = t.List(t.Unicode()).tag(sync=True)
    elapsed = t.Float(0.0).tag(sync=True)
    eta = t.Float(-1.0).tag(sync=True)
    baselines = t.Dict().tag(sync=True)
    detail = t.Dict().tag(sync=True)
    stoppable = t.Bool(False).tag(sync=True)

    # browser → kernel
    view = t.Unicode("").tag(sync=True)
    seed = t.Int(-1).tag(sync=True)
    mode = t.Unicode("recovery").tag(sync=True)
    selected = t.Dict().tag(sync=True)
    stop_requested = t.Bool(False).tag(sync=True)

    def __init__(
        self, state: Any = None, *, min_interval: float = 0.05, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._lock = threading.RLock()
        self._min_interval = float(min_interval)
        self._pending: dict[str, Any] | None = None
        self._last_sent = 0.0
        self._timer: threading.Timer | None = None
        if state is not None and hasattr(state, "to_state") and hasattr(state, "raw"):
            # A pipatch Result: draw it (answering its clicks is ``pipatch._live``'s job).
            state = {**state.to_state(), "stoppable": False, "eta": -1.0,
                     "elapsed": float(state.meta.get("elapsed", 0.0))}
        if state:
            self.update_state(state)

    @t.observe("comm")
    def _observe_comm(self, change: dict[str, Any]) -> None:
        _prefer_frontend_subshell(change["new"])

    # ---- state in

    @classmethod
    def from_state(cls, state: Mapping[str, Any], **kwargs: Any) -> GridWidget:
        """A new widget showing ``state`` (a full ``Result.to_state()`` or MIME document)."""
        return cls(state, **kwargs)

    def update_state(self, partial: Mapping[str, Any]) -> None:
        """Set many traits at once: one comm message for the whole update."""
        clean = _clean_state(partial)
        with self._lock, self.hold_sync():
            for k, v in clean.items():
                setattr(self, k, v)
            if self.views and self.view not in self.views:
                self.view = self.views[0]

    def push(self, state: Mapping[str, Any], force: bool = False) -> None:
        """Coalescing update: at most one message per ``min_interval``; the latest state wins.

        A state held back is sent by a timer at the end of the interval, so the browser
        never waits for the next row to see the previous one. Call :meth:`flush` at the end.
        """
        with self._lock:
            self._pending = {**(self._pending or {}), **dict(state)}
            wait = self._min_interval - (time.monotonic() - self._last_sent)
            if force or wait <= 0:
                self._cancel_timer()
                self._send_pending()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._on_timer)
                self._timer.daemon = True
                self._timer.start()

    def flush(self, state: Mapping[str, Any] | None = None) -> None:
        """Send anything pending, then a full sync so the browser equals the kernel."""
        with self._lock:
            if state:
                self._pending = {**(self._pending or {}), **dict(state)}
            self._cancel_timer()
            self._send_pending()
            self.send_state()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            self._send_pending()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending:
            self.update_state(pending)
            self._last_sent = time.monotonic()

    # ---- state out

    def get_state_dict(self) -> dict[str, Any]:
        """The kernel → browser state as a plain dict (arrays in wire form)."""
        return {k: getattr(self, k) for k in STATE_KEYS}

    def ui_state(self) -> dict[str, Any]:
        return {"view": self.view, "seed": self.seed, "mode": self.mode}

    def to_mime(self) -> dict[str, Any]:
        """The ``application/vnd.pipatch.grid+json`` document for the current state."""
        return state_to_mime(self.get_state_dict(), self.ui_state())

    # ---- hooks for the engine

    def on_select(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``callback(selected)`` when a cell is clicked; returns an unsubscribe function.

        With subshells the callback runs in the comm's subshell thread, possibly while the
        sweep runs on the main thread: enqueue work there, do not run the model from it.
        """

        def handler(change: dict[str, Any]) -> None:
            if change["new"]:
                callback(dict(change["new"]))

        self.observe(handler, names="selected")
        return lambda: self.unobserve(handler, names="selected")

    def on_stop(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` when Stop is pressed; returns an unsubscribe function."""

        def handler(change: dict[str, Any]) -> None:
            if change["new"]:
                callback()

        self.observe(handler, names="stop_requested")
        return lambda: self.unobserve(handler, names="stop_requested")

    # ---- display

    def display(self) -> Any:
        """Display the live widget with a display id; returns the ``DisplayHandle``."""
        from IPython.display import display

        return display(self, display_id=True)

    def final_bundle(
        self, state: Mapping[str, Any] | None = None, png: bytes | None = None
    ) -> dict[str, Any]:
        """Bundle for the finished run (see module docstring): MIME doc + PNG + text."""
        if state:
            self.flush(state)
        return final_bundle_from_state(self.get_state_dict(), ui=self.ui_state(), png=png)

    def display_final(
        self,
        handle: Any = None,
        state: Mapping[str, Any] | None = None,
        png: bytes | None = None,
    ) -> dict[str, Any]:
        """Replace the live widget output (``handle`` or display id) by the saved bundle.

        Without a handle the bundle is displayed as a new output. Returns the bundle.
        """
        from IPython.display import display, update_display

        bundle = self.final_bundle(state, png)
        if handle is None:
            display(bundle, raw=True)
        elif isinstance(handle, str):
            update_display(bundle, raw=True, display_id=handle)
        else:
            handle.update(bundle, raw=True)
            # The view is gone. Blank the JS module and the arrays before closing: tools that
            # record widget state (nbclient / nbconvert --execute keeps the last state of every
            # widget, closed or not) would otherwise store a copy of the bundle per grid.
            with self.hold_sync():
                self._esm = ""
                self.arrays = {}
            self.close()
        return bundle


#: The view under its earlier name, for code that only draws states (saved states, tests).
#: ``pipatch.PatchGrid`` is :class:`pipatch._live.PatchGrid`, which also runs and answers clicks.
PatchGrid = GridWidget
