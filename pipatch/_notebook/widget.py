"""The grid widget (anywidget): a view of a result's state, and its saved-notebook bundle.

This module draws and nothing else: it imports no pipatch module that imports it. Running a
plan live and answering clicks live in :mod:`pipatch._notebook.live`, whose ``PatchGrid`` (the public
``pipatch.PatchGrid``) is :class:`GridWidget` plus both.

The kernel owns the state; the browser only draws it (``js/grid.ts``; a circuit's, whose
``circuit`` part is set, ``js/circuit.ts``). The traits are the state of
:mod:`pipatch._results.views.schema` (``STATE_SCHEMA``, the same in ``js/schema.ts``), set through
``conform_state``; the saved bundle is :func:`pipatch._results.views.mime_bundle` of them. Arrays travel as
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

Saved notebooks: a live grid and its saved copy
-----------------------------------------------
A widget output is ``application/vnd.jupyter.widget-view+json`` and the widget renderer
(rank -10) always wins; once the kernel is gone it prints "Error displaying widget: model
not found" and never falls back to other MIME types. So when a run ends the live widget
*stays* (clicks, view / seed switches and exports keep working in this kernel) and
:meth:`GridWidget.display_final` adds, as the next output, the saved copy: a bundle without
the widget view, ``application/vnd.pipatch.grid+json`` (drawn by the pipatch lab extension
with the same grid code, no kernel), ``image/png`` (nbconvert, GitHub, other front ends) and
``text/plain``. A run that no browser view is watching (:meth:`GridWidget.has_frontend`:
nbclient, ``nbconvert --execute``) replaces the widget output by the copy and closes the
widget instead, so an executed notebook holds no dead widget and no copy of the JS module.

The two outputs know each other by ``live_id`` (the widget's model id, a state key): in the
browser (``js/liveness.ts``) a widget view that has heard back from its kernel marks its id
live, and the saved copy with that id hides while it is; when the live view goes (kernel
gone, widget closed, notebook reopened) the copy shows, says in one line how to get a
clickable grid back, and hides the dead widget output's "model not found" line above it.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anywidget
import traitlets as t

from .._compat.ipykernel import answer_on_the_front_ends_subshell
from .._results.views import MIME_TYPE, STATE_KEYS, conform_state, mime_bundle, mime_document

__all__ = ["MIME_TYPE", "STATE_KEYS", "GridWidget"]

_STATIC_ESM = pathlib.Path(__file__).parent.parent / "static" / "widget.js"
_MISSING_ESM = """
export default {
  render({ el }) {
    el.textContent = "pipatch: the front end is not built (run `npm run build` in the pipatch checkout).";
  },
};
"""


#: Set once any grid's browser view has pinged this kernel: a front end draws widgets here.
_FRONTEND_SEEN = threading.Event()


# --------------------------------------------------------------------------- widget


class GridWidget(anywidget.AnyWidget):
    """The recovery heatmap as a widget: rows are layers, columns are tokens or heads.

    A view and nothing else: it draws a state, coalesces updates and sends Stop and clicks
    back through :meth:`on_stop` / :meth:`on_select`. Running a plan and answering clicks is
    :mod:`pipatch._notebook.live`'s job (its ``PatchGrid`` is this class plus both).

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
    row_axis = t.Unicode("").tag(sync=True)  # what a row is: "" a layer, "latent" an SAE latent
    row_notes = t.List(t.Unicode()).tag(sync=True)  # per row, its hover text ([]: none)
    cell_notes = t.Dict().tag(sync=True)  # per view, each cell's hover text, row-major ({}: none)
    col_labels = t.List(t.Unicode()).tag(sync=True)
    col_axis = t.Unicode("token").tag(sync=True)
    views = t.List(t.Unicode()).tag(sync=True)
    n_seeds = t.Int(1).tag(sync=True)
    seed_noun = t.Unicode("seeds").tag(sync=True)
    seed_labels = t.List(t.Unicode()).tag(sync=True)
    arrays = t.Dict().tag(sync=True)
    rows_done = t.Dict().tag(sync=True)
    row_order = t.Dict().tag(sync=True)
    total_rows = t.Int(0).tag(sync=True)
    status = t.Unicode("running").tag(sync=True)
    message = t.Unicode("").tag(sync=True)
    warnings = t.List(t.Unicode()).tag(sync=True)
    elapsed = t.Float(0.0).tag(sync=True)
    eta = t.Float(-1.0).tag(sync=True)
    baselines = t.Dict().tag(sync=True)
    detail = t.Dict().tag(sync=True)
    stoppable = t.Bool(False).tag(sync=True)
    live_id = t.Unicode("").tag(sync=True)
    code = t.Unicode("").tag(sync=True)
    sides = t.List(t.Unicode()).tag(sync=True)
    compared = t.Unicode("").tag(sync=True)
    values = t.Unicode("").tag(sync=True)
    circuit = t.Dict().tag(sync=True)  # a circuit's graph: the browser draws it instead of the heatmap
    subject = t.List(t.Int()).tag(sync=True)  # the subject's columns, drawn marked
    feature_graph = t.Dict().tag(sync=True)  # a feature circuit's graph: drawn instead of the heatmap

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
            # A pipatch Result: draw it (answering its clicks is ``pipatch._notebook.live``'s job).
            state = state.to_state()
        if state:
            self.update_state(state)
        self.live_id = self.model_id  # names this widget's saved copy (see the module docstring)
        self._pinged = False
        self._message_handlers: list[Callable[[dict[str, Any]], None]] = []
        self.on_msg(self._on_custom_msg)

    def _on_custom_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """A view asks whether its kernel is there (``ping``): answer, so it can say it is live.
        Any other message (a feature circuit's ``ablate`` or ``group``) goes to the handlers of
        :meth:`on_message`."""
        if not isinstance(content, Mapping):
            return
        if content.get("type") == "ping":
            self._pinged = True
            _FRONTEND_SEEN.set()
            self.send({"type": "pong"})
            return
        for handler in list(self._message_handlers):
            handler(dict(content))

    @t.observe("comm")
    def _observe_comm(self, change: dict[str, Any]) -> None:
        # Clicks are answered on the subshell JupyterLab sends them on, not after the running cell.
        answer_on_the_front_ends_subshell(change["new"])

    # ---- state in

    @classmethod
    def from_state(cls, state: Mapping[str, Any], **kwargs: Any) -> GridWidget:
        """A new widget showing ``state`` (a full ``Result.to_state()`` or MIME document)."""
        return cls(state, **kwargs)

    def update_state(self, partial: Mapping[str, Any]) -> None:
        """Set many traits at once: one comm message for the whole update. ``live_id`` is the
        widget's own (its model id) and is never taken from a state."""
        clean = conform_state(partial)
        clean.pop("live_id", None)
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
        return mime_document(self.get_state_dict(), self.ui_state())

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

    def on_message(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``callback(content)`` for each message a view sends besides ``ping`` (as
        :meth:`on_select`'s, it may run in the comm's subshell thread); returns an unsubscribe
        function."""
        self._message_handlers.append(callback)
        return lambda: self._message_handlers.remove(callback)

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
        return mime_bundle(self.get_state_dict(), self.ui_state(), png=png)

    def has_frontend(self) -> bool:
        """Whether a browser view can use this widget: one of its views (or any grid's view in
        this kernel) has pinged it. Not so when nbclient / ``nbconvert --execute`` runs the
        notebook headless, nor, in a front end without comm subshells, before the first cell
        that showed a grid has ended."""
        return self._pinged or _FRONTEND_SEEN.is_set()

    def display_final(
        self,
        handle: Any = None,
        state: Mapping[str, Any] | None = None,
        png: bytes | None = None,
        *,
        keep: bool = False,
    ) -> dict[str, Any]:
        """Show the saved copy (the bundle) of this grid; returns the bundle.

        ``keep=True``: the widget stays live and the copy is a new output after it (in the
        browser the copy hides while the widget's view is connected; see the module
        docstring). Otherwise the copy *replaces* the widget's output (``handle``, a
        ``DisplayHandle`` or display id; without one the copy is a new output) and the widget
        closes: what a headless run (no one to click) should leave in the file.
        """
        from IPython.display import display, update_display

        bundle = self.final_bundle(state, png)
        if keep or handle is None:
            display(bundle, raw=True)
        elif isinstance(handle, str):
            update_display(bundle, raw=True, display_id=handle)
        else:
            handle.update(bundle, raw=True)
        if not keep and handle is not None:
            # The view is gone. Blank the JS module and the arrays before closing: tools that
            # record widget state (nbclient / nbconvert --execute keeps the last state of every
            # widget, closed or not) would otherwise store a copy of the bundle per grid.
            with self.hold_sync():
                self._esm = ""
                self.arrays = {}
            self.close()
        return bundle
