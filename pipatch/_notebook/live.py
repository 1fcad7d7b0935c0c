"""Run a plan with a live :class:`PatchGrid`: rows stream in, Stop works, clicks are answered.

This module owns running and answering; :mod:`pipatch._notebook.widget` only draws. The public
``pipatch.PatchGrid`` is :class:`PatchGrid` here: the view plus :meth:`PatchGrid.run` (any
experiment of :mod:`pipatch._experiments._registry`) and click answers for ``PatchGrid(result)``.

Threads (JupyterLab >= 4.4 with ipykernel >= 7)
-----------------------------------------------
The sweep runs on the kernel's **main thread**. While a cell runs, JupyterLab sends the
widget's comm messages on a kernel *subshell*, which ipykernel handles in a thread of its
own, so the widget's trait observers (``on_stop``, ``on_select``) run there, concurrently
with the sweep. Hence:

* **Stop** sets a :class:`threading.Event`; the engine checks it between batches and ends the
  run ``"stopped"`` with every finished row kept.
* **A click** never touches the model from the subshell thread while a sweep runs: the
  selection is queued and the main thread answers it between two rows (from the engine's
  ``on_row`` callback), or right after the run. Once no sweep is running a click is answered
  at once in the thread that received it; one lock keeps two answers (or an answer and a
  new sweep) from sharing the model.
* **Kernel ▸ Interrupt** raises ``KeyboardInterrupt`` on the main thread; the engine ends the
  run ``"interrupted"`` with the partial grid.

At the end the live widget stays (clicks, switches and exports keep working) and its saved
copy is shown after it (:meth:`~pipatch._notebook.widget.GridWidget.display_final`): a saved notebook
renders the copy without a kernel. With no browser view watching (nbclient), the copy
replaces the widget instead. ipywidgets holds every open widget, and a grid holds its
result's captured activations, so only the last :data:`LIVE_GRIDS` grids a run displayed stay
open; an older one is closed and its saved copy takes its place in the browser.

Answering clicks on a finished result
-------------------------------------
``PatchGrid(result)`` answers clicks when ``result`` was computed in this process: a private
registry maps each result (by identity, dropped when the result is garbage-collected) to its
plan's predictor (``plan.predictor()``), which reruns one cell with full logits and holds
the model and the sweeps but not the result. A result loaded from a file has no such entry
and its grid says so.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections import deque
from typing import Any

from .._base.checks import whole_number
from .._engine import EngineError, Predictor
from .._experiments._api import plan
from .._experiments._registry import EXPERIMENTS
from .._model.models import PipatchError
from .widget import GridWidget

__all__ = ["TOP_K", "PatchGrid", "answer_selection", "attach_result", "run_live"]


TOP_K = 5


# --------------------------------------------------------------------------------------------
# Registry: result → predictor
# --------------------------------------------------------------------------------------------

#: The attribute a result keeps its plan's predictor in, ``(view, row, col, seed, k) -> [(token,
#: prob)]``: on the result itself (pipatch's own object), not a field of it, so it is neither
#: saved nor compared. The predictor holds the model and the sweeps, never the result, so it
#: goes when its result does.
_PREDICTOR = "_live_predictor"


def _remember(result: Any, predictor: Predictor) -> None:
    """Keep what answering a click on ``result`` needs, for as long as ``result`` lives."""
    setattr(result, _PREDICTOR, predictor)


def _predictor(result: Any) -> Predictor | None:
    return getattr(result, _PREDICTOR, None) if result is not None else None


# --------------------------------------------------------------------------------------------
# Answering selections
# --------------------------------------------------------------------------------------------


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def answer_selection(predictor: Predictor | None, result: Any, selection: dict) -> dict:
    """The ``detail`` trait for one clicked cell: its values and the patched run's top-5.

    ``selection`` is the widget's ``selected`` trait, ``{view, seed, row, col}`` (``seed`` −1
    for the mean over seeds, whose top-5 is seed 0's run). ``predictor`` is the plan's
    (``None`` for a result without one). Returns ``{view, seed, row, col, value, raw, top:
    [{token, prob}]}`` and what the plan measures besides (:meth:`Predictor.measured`: a
    circuit's ``exact`` change over ``exact_pairs`` pairs), plus ``error`` when the top-5
    cannot be computed.
    """
    view = str(selection.get("view") or result.views[0])
    try:  # the browser's numbers; a malformed click is answered with an error, never raised in its thread
        seed = whole_number(selection.get("seed", -1), "seed", minimum=None)
        row, col = whole_number(selection.get("row"), "row", None), whole_number(selection.get("col"), "col", None)
    except PipatchError as error:
        return {"view": view, "top": [], "error": f"not a cell: {error}"}
    detail: dict[str, Any] = {"view": view, "seed": seed, "row": row, "col": col, "top": []}
    if view not in result.raw:
        return {**detail, "error": f"no view {view!r} in this result"}
    n_seeds, n_rows, n_cols = result.raw[view].shape
    if not (0 <= row < n_rows and 0 <= col < n_cols and -1 <= seed < n_seeds):
        return {**detail, "error": f"no cell (row {row}, col {col}, seed {seed}) in this grid"}
    if seed < 0:
        value, raw = float(result.mean(view)[row, col]), float(result.raw_mean(view)[row, col])
    else:
        value, raw = float(result.recovery(view)[seed, row, col]), float(result.raw[view][seed, row, col])
    detail.update(value=_finite(value), raw=_finite(raw))
    if predictor is None and result.kind == "compare":
        return {**detail, "error": "a comparison has no patched run of its own: click the cell in "
                                   "PatchGrid(result.a) or PatchGrid(result.b) for its top-5"}
    if predictor is None:
        return {**detail, "error": "top-5 needs the model and plan this result was computed with "
                                   "(not available for a loaded result)"}
    try:
        top = predictor(view, row, col, max(seed, 0), TOP_K)
        measured = getattr(predictor, "measured", None)  # a plain callable answers the top-5 only
        if measured is not None:
            detail.update(measured(view, row, col))
    except Exception as error:  # noqa: BLE001 - a failed click must not end a running sweep
        return {**detail, "error": f"{type(error).__name__}: {error}"}
    detail["top"] = [{"token": token, "prob": _finite(prob)} for token, prob in top]
    return detail


def _answer(widget: Any, selection: dict) -> None:
    """Compute and send the detail for ``selection`` unless a newer click replaced it; a view's
    message (``{"type": ...}``, :meth:`~pipatch._notebook.widget.GridWidget.on_message`) goes to its
    result's ``answer_message``, whose state update is sent."""
    if "type" in selection:
        result = getattr(widget, "_pipatch_result", None)
        answer = getattr(result, "answer_message", None)
        if answer is not None:
            widget.update_state(answer(_predictor(result), selection))
        return
    if dict(widget.selected or {}) != selection:
        return
    result = getattr(widget, "_pipatch_result", None)
    if result is None:
        return
    detail = answer_selection(_predictor(result), result, selection)
    if dict(widget.selected or {}) == selection:
        widget.update_state({"detail": detail})


class _Dispatcher:
    """Decides where a click is answered: queued for a running sweep, or right away.

    ``model_lock`` is held by whoever runs the model on behalf of the front end: a sweep for
    its whole length, or one click's answer. A click arriving while it is held is queued;
    the holder drains the queue before letting go.

    A click is also queued while any cell runs (IPython's ``pre_run_cell`` / ``post_run_cell``
    events): that cell may be using the model (a magic's baselines, a user's own
    ``pipatch.trace``), and nnsight refuses a second trace of a model already running. The
    main thread answers such clicks when the cell ends. (A selection made by the cell's own
    code arrives on the main thread and is answered at once.)
    """

    def __init__(self) -> None:
        self.state_lock = threading.Lock()
        self.model_lock = threading.Lock()
        self.sweeping = False
        self.cell_running = False
        self.hooked = False
        self.queue: list[tuple[Any, dict]] = []

    def watch_cells(self) -> None:
        """Follow the kernel's cells (once per process; nothing to follow outside IPython)."""
        try:
            from IPython import get_ipython
        except ImportError:  # pragma: no cover - IPython is a dependency
            return
        shell = get_ipython()
        if shell is None or self.hooked:
            return
        self.hooked = True
        shell.events.register("pre_run_cell", self._cell_started)
        shell.events.register("post_run_cell", self._cell_ended)

    def _cell_started(self, *_: Any) -> None:
        with self.state_lock:
            self.cell_running = True

    def _cell_ended(self, *_: Any) -> None:
        with self.state_lock:
            self.cell_running = False
            items, self.queue = self.queue, []
        for widget, selection in items:
            self.submit(widget, selection)

    def submit(self, widget: Any, selection: dict) -> None:
        # A selection set by the running cell itself (``grid.selected = ...`` in code) comes on
        # the main thread: nothing else can be using the model then, so it is answered at once.
        busy_cell = self.cell_running and threading.current_thread() is not threading.main_thread()
        with self.state_lock:
            if self.sweeping or busy_cell or not self.model_lock.acquire(blocking=False):
                self.queue = [(w, s) for w, s in self.queue if w is not widget] + [(widget, selection)]
                return
        self._serve((widget, selection))

    def _serve(self, item: tuple[Any, dict] | None) -> None:
        """Answer ``item`` and then the queue; called with ``model_lock`` held, releases it."""
        while item is not None:
            try:
                _answer(*item)
            except Exception:  # noqa: BLE001, S110 - one failed answer must not strand the lock
                pass
            with self.state_lock:
                if self.queue:
                    item = self.queue.pop(0)
                else:
                    item = None
                    self.model_lock.release()

    def begin_sweep(self) -> None:
        self.model_lock.acquire()
        with self.state_lock:
            self.sweeping = True

    def answer_queued(self) -> None:
        """From the sweep's main thread, between rows."""
        with self.state_lock:
            items, self.queue = self.queue, []
        for item in items:
            _answer(*item)

    def end_sweep(self) -> None:
        with self.state_lock:
            self.sweeping = False
            items, self.queue = self.queue, []
            self.model_lock.release()
        for widget, selection in items:
            self.submit(widget, selection)


_DISPATCHER = _Dispatcher()


def attach_result(widget: Any, result: Any, predictor: Predictor | None = None) -> None:
    """Make ``widget`` answer clicks on ``result`` (registering ``predictor`` for it if given)."""
    if predictor is not None:
        _remember(result, predictor)
    widget._pipatch_result = result
    _DISPATCHER.watch_cells()
    if not getattr(widget, "_pipatch_select_hooked", False):
        widget._pipatch_select_hooked = True
        widget.on_select(lambda selection: _DISPATCHER.submit(widget, selection))
        widget.on_message(lambda message: _DISPATCHER.submit(widget, message))


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _progress(result: Any, planning: float = 0.0) -> dict[str, Any]:
    """rows_done / elapsed / eta (seconds; −1 when unknown) for a running result; the time left
    is scaled from the sweep's own time, without the ``planning`` seconds ``elapsed`` includes."""
    elapsed = float(result.meta.get("elapsed", 0.0))
    return {"rows_done": dict(result.rows_done), "elapsed": elapsed,
            "eta": result.time_left(max(0.0, elapsed - planning))}


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipywidgets
        return False
    return get_ipython() is not None


def run_live(plan: Any, *, widget: Any = None, show: bool | None = None, handle: Any = None) -> Any:
    """Run ``plan`` with a live grid; return the (possibly partial) result.

    Parameters
    ----------
    plan
        From a planner of :mod:`pipatch._experiments._api` (any experiment of :mod:`pipatch._experiments._registry`);
        it carries its model and backend.
    widget
        A grid widget to fill (a new :class:`PatchGrid` when ``None``).
    show
        Display the widget now and its saved copy at the end (``None``: when running under
        IPython); see :meth:`~pipatch._notebook.widget.GridWidget.display_final`.
    handle
        A ``DisplayHandle`` to show the widget in (e.g. a "preparing…" line shown while the
        baselines ran) instead of a new output.

    Returns
    -------
    Result
        ``status`` is ``"done"``, ``"stopped"`` (Stop button) or ``"interrupted"`` (Kernel ▸
        Interrupt), with every finished row kept. A failing batch re-raises the engine's
        :class:`~pipatch._engine.EngineError` (its ``partial`` holds the result) after the
        widget shows the failure.
    """
    result = plan.result
    show = _in_ipython() if show is None else show
    state = {**result.to_state(live=True), **_progress(result), "status": "running",
             "stoppable": True, "detail": {}}
    owned = widget is None
    if owned:
        widget = PatchGrid(state)
    else:
        widget.update_state({**state, "stop_requested": False})
        widget.stop_requested = False
    stop = threading.Event()
    attach_result(widget, result, plan.predictor())
    unsubscribe_stop = widget.on_stop(stop.set)
    if show and handle is not None:
        handle.update(widget)
    elif show:
        handle = widget.display()

    def on_row(res: Any, view: str, layer: int) -> None:
        widget.push({**res.to_state(live=True), **_progress(res, plan.planning), "status": "running",
                     "stoppable": True})
        _DISPATCHER.answer_queued()

    error: EngineError | None = None
    if plan.estimate:  # the grid shows the rows; how long they take, about, is said first
        print(plan.estimate, file=sys.stderr)
    _DISPATCHER.begin_sweep()
    try:
        try:
            plan.run(on_row=on_row, stop=stop)
        except EngineError as failure:
            error = failure
    finally:
        _DISPATCHER.end_sweep()
        unsubscribe_stop()
    final = {**result.to_state(), **_progress(result), "eta": -1.0, "stoppable": False}
    if show:
        keep = widget.has_frontend()  # someone can click: the grid stays live above its copy
        widget.display_final(handle, final, keep=keep)
        if keep and owned:
            _keep_open(widget)
    else:
        widget.flush(final)
    if error is not None:
        raise error
    return result


#: How many grids displayed by runs stay live (clickable) in one kernel; older ones close.
LIVE_GRIDS = 16
_OPEN: deque[GridWidget] = deque()


def _keep_open(widget: GridWidget) -> None:
    """Keep ``widget`` live, closing the oldest run grid beyond :data:`LIVE_GRIDS`."""
    _OPEN.append(widget)
    while len(_OPEN) > LIVE_GRIDS:
        _OPEN.popleft().close()


# --------------------------------------------------------------------------------------------
# The public widget
# --------------------------------------------------------------------------------------------


class PatchGrid(GridWidget):
    """The live recovery heatmap: rows are layers, columns are tokens or heads.

    ``PatchGrid(result)`` shows a result as an interactive grid: hovering a cell shows its
    value, clicking it shows the patched run's top-5 next tokens when ``result`` was computed
    in this process (a result loaded from a file says why it has none).
    :meth:`PatchGrid.run` plans and runs any experiment with a live grid.

    Parameters
    ----------
    state : Result or dict, optional
        A result, or a state dict (``Result.to_state()`` or part of one).
    min_interval : float
        Smallest time between two coalesced updates (seconds).
    """

    def __init__(self, state: Any = None, *, min_interval: float = 0.05, **kwargs: Any) -> None:
        super().__init__(state, min_interval=min_interval, **kwargs)
        if state is not None and hasattr(state, "to_state") and hasattr(state, "raw"):
            attach_result(self, state)

    @classmethod
    def run(cls, model: Any = None, experiment: str = "trace", **kwargs: Any) -> Any:
        """Plan and run an experiment with a live grid, without magics; returns the ``Result``.

        ``experiment`` is an experiment of :mod:`pipatch._experiments._registry` (``"trace"``, ``"patch"``,
        ``"attribute"``, ``"path_patch"``, ``"lens"``, ...) and ``kwargs`` are its Python
        function's arguments, e.g. ``PatchGrid.run(model, "patch", clean=..., corrupt=...,
        answer=" Paris")``. (``kind="patch"``, this argument's old name, still works.)
        ``model`` is a loaded model or anything :func:`pipatch.load_model` takes. The grid is
        displayed at once, fills in row by row, has a Stop button and answers clicks, and
        stays clickable after the run; its saved copy (shown once the kernel is gone) is added
        below it. Show ``PatchGrid(result)`` for a clickable grid later.
        """
        if isinstance(kwargs.get("kind"), str) and kwargs["kind"] in EXPERIMENTS:
            warnings.warn("PatchGrid.run(kind=...) is deprecated: use experiment=", DeprecationWarning, stacklevel=2)
            experiment = kwargs.pop("kind")
        return run_live(plan(experiment, model, **kwargs))
