"""A study, live in the notebook: the aggregate grid fills in as facts finish.

The view is pipatch's own grid (:class:`pipatch.PatchGrid`, drawn by ``js/grid.ts``) showing
:meth:`Study.as_result` (the average over the finished facts, one fact a "seed" row), re-sent
after each fact, with

* a status line (the grid's ``message``, drawn as text): facts done / known / total, facts per
  minute, and the time left (the grid's ``eta``);
* the grid's **Stop** button: the study stops after the facts in flight, every finished fact
  stays in the store (run again to resume);
* a **fact list** (an ``ipywidgets.Select``, its options plain text, never HTML): the first
  entry is the aggregate, then each finished fact by its index, id and subject; choosing one
  draws that fact's own stored grid in the same view (read from the store: no model needed,
  so it is answered at once, in whichever thread the front end's message arrives).

When the study ends, the grid's saved copy, the aggregate, is shown after the view
(:meth:`~pipatch._notebook.widget.GridWidget.display_final`): a saved notebook renders it without a
kernel, as it renders any grid. With no browser watching (nbclient) the copy replaces the
view. There is one place that draws and escapes, the grid's; this module only chooses states.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .._model.models import PipatchError

__all__ = ["StudyView", "AGGREGATE"]

#: The fact list's first entry: the average over the finished facts.
AGGREGATE = -1


class StudyView:
    """The live view of one study run: a :class:`pipatch.PatchGrid` and a fact list.

    ``read()`` returns the :class:`~pipatch.Study` of the store being filled (read afresh).

    ``progress(index, record, result)`` (hand it to :func:`pipatch.study`) re-sends the
    aggregate after each fact; :attr:`stop` is set by the grid's Stop button; :meth:`finish`
    shows the saved copy. :meth:`show_fact` (what a click on the list calls) draws one
    fact's grid, ``AGGREGATE`` the average again.
    """

    def __init__(self, read: Callable[[], Any], total: int) -> None:
        import ipywidgets

        from .._compat.ipykernel import answer_on_the_front_ends_subshell
        from .._notebook.live import PatchGrid

        self.read, self.total = read, int(total)  # read(): the Study, as the store holds it now
        self.stop = threading.Event()
        self.grid = PatchGrid({"title": "study: waiting for the first fact", "status": "running",
                               "stoppable": True, "message": self._line(0, 0, 0, 0.0)})
        self._unsubscribe = self.grid.on_stop(self.stop.set)
        self.facts = ipywidgets.Select(options=[("average over the finished facts", AGGREGATE)], value=AGGREGATE,
                                       rows=8, description="facts", layout=ipywidgets.Layout(width="auto"))
        self.facts.observe(lambda change: self.show_fact(change["new"]), names="value")
        # A click is heard while the study runs (the list's comm is pipatch's own).
        answer_on_the_front_ends_subshell(getattr(self.facts, "comm", None))
        self.box = ipywidgets.VBox([self.grid, self.facts])
        self._lock = threading.RLock()
        self._started, self._since = time.perf_counter(), time.time()  # the rate counts this run's facts only
        self._handle: Any = None

    # -- what the study calls ------------------------------------------------------------------
    def display(self) -> None:
        from IPython.display import display

        self._handle = display(self.box, display_id=True)

    def progress(self, index: int, record: dict, result: Any) -> None:
        """After each fact: the fact list, the status line and (if shown) the aggregate."""
        study = self.read()
        counts, every = study.counts(), study._rows()
        rows = [row for row in every if row["status"] == "done"]
        options = [("average over the finished facts", AGGREGATE)] + [(_label(row), int(row["idx"])) for row in rows]
        elapsed = time.perf_counter() - self._started
        ran = sum(1 for row in every if row["finished"] >= self._since)  # not the facts resumed
        rate = 60.0 * ran / elapsed if elapsed > 0 and ran else 0.0
        pending = max(self.total - counts["done"] - counts["unknown"] - counts["error"], 0)
        eta = 60.0 * pending / rate if rate > 0 else -1.0
        known = sum(1 for row in every if row["known"] == 1)
        with self._lock:
            self.facts.options = options  # keeps the chosen value while it is still an option
            state: dict[str, Any] = {"message": self._line(counts["done"], known, counts["error"], rate),
                                     "eta": eta, "elapsed": elapsed, "status": "running", "stoppable": True}
            if self.facts.value == AGGREGATE and rows:
                state = {**self._aggregate_state(study), **state}
            self.grid.push(state)

    def finish(self, show: bool) -> None:
        """End the live run: the aggregate, not stoppable, and its saved copy after the view."""
        self._unsubscribe()
        study = self.read()
        counts = study.counts()
        stopped = self.stop.is_set() and counts["pending"] > 0
        with self._lock:
            final = {**(self._aggregate_state(study) if counts["done"] else {}),
                     "status": "stopped" if stopped else "done", "stoppable": False, "eta": -1.0,
                     "message": study.summary() + (" (stopped: run again to resume)" if stopped else "")}
            if self.facts.value != AGGREGATE:
                self.facts.value = AGGREGATE
            if not show:
                self.grid.flush(final)
                return
            keep = self.grid.has_frontend()
            self.grid.display_final(self._handle, final, keep=keep)
            if not keep:
                self.facts.close()
                self.box.close()

    # -- what a click calls --------------------------------------------------------------------
    def show_fact(self, index: int) -> None:
        """Draw fact ``index``'s own grid (``AGGREGATE``: the average)."""
        study = self.read()
        with self._lock:
            if index == AGGREGATE:
                if study.counts()["done"]:
                    self.grid.push(self._aggregate_state(study), force=True)
                return
            try:
                result = study[int(index)]
            except PipatchError as error:
                self.grid.push({"message": str(error)}, force=True)
                return
            state = result.to_state()
            state.pop("status", None)
            self.grid.push({**state, "status": self.grid.status, "stoppable": self.grid.stoppable,
                            "eta": self.grid.eta, "message": self.grid.message}, force=True)

    # -- helpers ---------------------------------------------------------------------------------
    def _aggregate_state(self, study: Any) -> dict[str, Any]:
        result = study.as_result()
        state = result.to_state()
        state["title"] = f"{study.experiment} study · mean over {study.counts()['done']} facts"
        state["rows_done"] = {view: len(result.layers) for view in result.views}  # every row drawn, running or not
        for key in ("status", "message", "eta", "elapsed", "stoppable"):
            state.pop(key, None)
        return state

    def _line(self, done: int, known: int, errors: int, rate: float) -> str:
        speed = f"{rate:.1f} facts/min" if rate > 0 else "– facts/min"
        failed = f" · {errors} error{'s' if errors != 1 else ''}" if errors else ""
        return f"{done} done · {known} known · {self.total} total · {speed}{failed}"


def _label(row: Any) -> str:
    """One fact in the list: its index, id and subject (plain text)."""
    import json

    try:
        record = json.loads(row["record"])
    except (TypeError, ValueError):
        record = {}
    subject = record.get("subject") if isinstance(record, dict) else None
    ident = f" ({row['fact_id']})" if row["fact_id"] is not None else ""
    return f"fact {row['idx']}{ident}" + (f": {subject}" if isinstance(subject, str) else "")
