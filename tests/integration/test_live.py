"""run_live: a real plan on the embedded model feeding a real PatchGrid (no kernel, no mocks).

The front end's Stop and clicks arrive, in JupyterLab, on a kernel subshell thread while the
sweep runs on the main thread; here a plain thread sets the same traits.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import types
import weakref

import pytest
import torch

from pipatch._experiments._api import plan_patch, plan_trace
from pipatch._notebook.live import PatchGrid, _predictor, run_live
from tests.conftest import COLOSSEUM, EIFFEL


def _in_thread(fn) -> None:
    """Run ``fn`` in another thread (as a kernel subshell would) and wait for it."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def _rows(widget: PatchGrid) -> int:
    return sum(widget.rows_done.values())


def test_stop_event_ends_the_run_stopped_with_the_partial_grid(model):
    plan = plan_trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0)
    widget = PatchGrid()
    statuses = []

    def on_rows(change):
        statuses.append((widget.status, widget.stoppable))
        if sum(change["new"].values()) >= 1 and not widget.stop_requested:
            _in_thread(lambda: setattr(widget, "stop_requested", True))  # the Stop button

    widget.observe(on_rows, names="rows_done")
    result = run_live(plan, widget=widget, show=False)

    assert result.status == "stopped"
    done = result.rows_done["resid"]
    assert 1 <= done < len(result.layers)
    raw = result.raw["resid"]
    # Finished rows (from the last layer down) are complete; rows after the stop were never run,
    # not even the cells that need no forward pass (filled when their run finishes).
    first = len(result.layers) - done
    assert list(result.finished_rows()) == list(range(first, len(result.layers)))
    assert torch.isfinite(raw[:, first:]).all()
    assert torch.isnan(raw[:, :first]).all()
    # The widget streamed running rows with a Stop button, and ends equal to the result.
    assert ("running", True) in statuses
    assert widget.status == "stopped" and not widget.stoppable
    assert widget.rows_done == {"resid": done}
    assert widget.eta == -1.0 and widget.elapsed > 0


#: The clicked cell: the last position at layer 17, the first row a fast sweep finishes.
CLICK = {"view": "resid", "seed": -1, "row": 17, "col": 1}


@pytest.fixture(scope="module")
def live_patch(model):
    """A patch swept live, with a click (from another thread) on layer 17 once that row is done."""
    plan = plan_patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", positions=[2, -1])
    widget = PatchGrid()
    selection = dict(CLICK)
    answered = []

    def on_rows(change):
        if sum(change["new"].values()) >= 1 and not widget.selected:
            _in_thread(lambda: setattr(widget, "selected", selection))

    def on_detail(change):
        if change["new"].get("top"):
            answered.append({"rows": _rows(widget), "thread": threading.current_thread(),
                             "status": plan.result.status})

    widget.observe(on_rows, names="rows_done")
    widget.observe(on_detail, names="detail")
    result = run_live(plan, widget=widget, show=False)
    return {"plan": plan, "result": result, "widget": widget, "selection": selection, "answered": answered}


def _independent_top1(model, layer: int, position: int) -> tuple[str, float]:
    """The patched cell by hand with nnsight: clean block output pasted into the corrupt run."""
    clean_ids = model.tokenizer(EIFFEL, return_tensors="pt").input_ids
    corrupt_ids = model.tokenizer(COLOSSEUM, return_tensors="pt").input_ids
    assert clean_ids.shape == corrupt_ids.shape
    block = model.model.layers[layer]
    with torch.no_grad():
        with model.trace(clean_ids):
            out = block.output
            hidden = (out[0] if isinstance(out, tuple) else out)[:, position].clone().save()
        with model.trace(corrupt_ids):
            out = block.output
            (out[0] if isinstance(out, tuple) else out)[:, position] = hidden
            logits = model.output.logits[:, -1].save()
    probs = logits.float().softmax(-1)[0]
    best = int(probs.argmax())
    return model.tokenizer.decode([best]), float(probs[best])


def test_selection_during_run_is_answered_between_rows_with_a_real_top5(model, live_patch):
    result, widget, answered = live_patch["result"], live_patch["widget"], live_patch["answered"]
    assert result.status == "done"
    # Answered by the sweep's own (main) thread while rows were still running.
    assert answered, "the selection was never answered"
    first = answered[0]
    assert first["thread"] is threading.main_thread()
    assert first["status"] == "running" and 1 <= first["rows"] < len(result.layers)
    detail = widget.detail
    assert {k: detail[k] for k in ("view", "seed", "row", "col")} == live_patch["selection"]
    top = detail["top"]
    assert len(top) == 5
    probs = [t["prob"] for t in top]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    # The grid's own cell and raw value, read back through the view's state: a float32 value
    # sent as a float, 1e-6 (1e-5 for the raw logit difference) no more than its rounding.
    assert detail["value"] == pytest.approx(float(result.grid[17, 1]), abs=1e-6)
    assert detail["raw"] == pytest.approx(float(result.raw["resid"][0, 17, 1]), abs=1e-5)
    token, prob = _independent_top1(model, layer=17, position=-1)
    assert top[0]["token"] == token
    assert top[0]["prob"] == pytest.approx(prob, abs=1e-4)


def test_patchgrid_of_a_finished_result_answers_clicks_from_another_thread(model, live_patch):
    result = live_patch["result"]
    grid = PatchGrid(result)
    assert grid.status == "done" and not grid.stoppable
    assert grid.rows_done == result.rows_done
    selection = dict(CLICK)
    _in_thread(lambda: setattr(grid, "selected", selection))  # answered at once, in that thread
    assert grid.detail["top"] == live_patch["widget"].detail["top"]
    # A result without its model and plan (loaded from a file) says why there is no top-5.
    other = PatchGrid(result.__class__(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)}))
    other.selected = selection
    assert other.detail["top"] == [] and "top-5 needs the model" in other.detail["error"]
    assert other.detail["value"] == pytest.approx(float(result.grid[17, 1]), abs=1e-6)  # as above
    other.close()
    grid.close()


def test_a_click_while_a_cell_runs_waits_for_the_cell_to_end(model, live_patch):
    """A cell may be using the model (a magic's baselines, the user's own sweep): nnsight
    refuses a second trace of a running model, so a click is answered when the cell ends."""
    from IPython.testing.globalipapp import get_ipython  # the one test shell of this process

    from pipatch._notebook.live import _DISPATCHER

    shell = get_ipython()
    grid = PatchGrid(live_patch["result"])  # hooks the shell's cell events
    assert _DISPATCHER.hooked
    selection = dict(CLICK)
    shell.events.trigger("pre_run_cell", None)
    try:
        _in_thread(lambda: setattr(grid, "selected", selection))
        assert grid.detail == {}  # queued: the cell might be tracing this model right now
        with model.trace(EIFFEL):  # ... as it may: the model is free for the cell
            model.output.save()
    finally:
        shell.events.trigger("post_run_cell", None)
    assert grid.detail["top"] == live_patch["widget"].detail["top"]  # answered at the cell's end
    # A selection made by the cell's own code (main thread) is answered at once.
    shell.events.trigger("pre_run_cell", None)
    try:
        grid.selected = {"view": "resid", "seed": -1, "row": 1, "col": 0}
        assert grid.detail["row"] == 1 and len(grid.detail["top"]) == 5
    finally:
        shell.events.trigger("post_run_cell", None)
    grid.close()


def test_registry_entry_goes_with_its_result(model):
    plan = plan_patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", positions=[-1])
    widget = PatchGrid()
    result = run_live(plan, widget=widget, show=False)
    predictor = _predictor(result)
    assert predictor is not None
    # The model is not searched: it is big (its tokenizer alone) and never holds a result.
    assert not _reaches(predictor, result, skip=model), "the stored predictor keeps the result alive"
    entry = weakref.ref(predictor)
    widget.close()
    del plan, widget, result, predictor
    time.sleep(0.3)  # a cancelled coalescing timer's thread holds the widget until it exits
    gc.collect()
    assert entry() is None


def _reaches(root, target, skip=None, limit: int = 500_000) -> bool:
    """Whether ``target`` is reachable from ``root`` through references.

    ``skip``, tensors, types and modules are not entered; a function is entered through its closure and
    defaults only (its globals lead to every module).
    """
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if obj is target:
            return True
        if obj is skip or id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        assert len(seen) < limit, "reference graph too large to search"
        if isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
        else:
            stack.extend(gc.get_referents(obj))
    return False


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
