"""The magics in-process: IPython's test shell, real models, real nnsight, no mocks.

One magic per experiment of the registry (``%%trace``, ``%%patch``, ``%%attribute``,
``%%path_patch``); each must give the Python API's numbers. The widget a magic creates is
watched through ipywidgets' own construction hook (``Widget.on_widget_constructed``) and
``observe`` on its traits.
"""

from __future__ import annotations

import ipywidgets
import pytest
from IPython.core.error import UsageError

from pipatch._experiments._registry import EXPERIMENTS
from pipatch._notebook.live import PatchGrid
from pipatch._notebook.widget import GridWidget
from pipatch._results.result import Result
from tests._experiments import BIG_BEN, EMBEDDED, TINY, assert_same_result, python_result
from tests.conftest import COLOSSEUM, EIFFEL

PATCH_BODY = f"clean: {EIFFEL}\ncorrupt: {COLOSSEUM}\n"


class Grids(list):
    """Every PatchGrid created, as ``(widget, [rows_done values it received])``.

    ``hooks`` are called with each new grid (before it gets any state).
    """

    def __init__(self) -> None:
        super().__init__()
        self.hooks: list = []

    def constructed(self, widget) -> None:
        if isinstance(widget, GridWidget):
            seen: list[dict] = []
            widget.observe(lambda change: seen.append(dict(change["new"])), names="rows_done")
            self.append((widget, seen))
            for hook in self.hooks:
                hook(widget)


@pytest.fixture(scope="module")
def grids():
    made = Grids()
    ipywidgets.Widget.on_widget_constructed(made.constructed)
    yield made
    ipywidgets.Widget.on_widget_constructed(lambda widget: None)


@pytest.fixture(scope="module")
def tiny():
    from tests._tiny import tiny_model

    return tiny_model("gpt2")


@pytest.mark.parametrize("name", list(EMBEDDED))
def test_every_magic_equals_the_python_api(ip, model, name):
    case = EMBEDDED[name]
    ip.user_ns["embedded"] = model
    ip.user_ns.pop(f"_{name}", None)
    ip.run_cell_magic(name, f"--model embedded {case['line']}", case["body"])
    result = ip.user_ns[f"_{name}"]  # the default name
    assert isinstance(result, Result)
    assert_same_result(result, python_result(model, name, case["kwargs"]))


def test_a_dataset_of_pairs_through_the_magic(ip, tiny):
    ip.user_ns["small"] = tiny
    body = f"clean: {EIFFEL}\ncorrupt: {BIG_BEN}\n\n# swapped\nclean: {BIG_BEN}\ncorrupt: {EIFFEL}\n"
    line = '--model small --answer " Paris" --answer " London" --foil " London" --foil " Paris" -o pairs'
    ip.run_cell_magic("patch", line, body)
    want = python_result(tiny, "patch", {"clean": [EIFFEL, BIG_BEN], "corrupt": [BIG_BEN, EIFFEL],
                                         "answer": [" Paris", " London"], "foil": [" London", " Paris"]})
    got = ip.user_ns["pairs"]
    assert got.n_seeds == 2  # one row of the seed axis per pair
    assert_same_result(got, want)


def test_a_dataset_of_prompts_through_the_magic(ip, tiny):
    ip.user_ns["small"] = tiny
    body = f"prompt: {EIFFEL}\nprompt: {BIG_BEN}\n"
    line = ('--model small --subject "Eiffel Tower" --subject "Big Ben" --answer " Paris" --answer " London" '
            "--seeds 2 --scale 3 -o facts")
    ip.run_cell_magic("trace", line, body)
    want = python_result(tiny, "trace", {"prompt": [EIFFEL, BIG_BEN], "subject": ["Eiffel Tower", "Big Ben"],
                                         "answer": [" Paris", " London"], "seeds": 2, "scale": 3.0})
    assert_same_result(ip.user_ns["facts"], want)


def test_patch_on_the_embedded_model_binds_and_streams_rows(ip, grids):
    ip.user_ns.pop("_patch", None)
    before = len(grids)
    returned = ip.run_cell_magic("patch", '--answer " Paris" --foil " Rome" --positions 2,-1', PATCH_BODY)
    assert returned is None  # the final grid is displayed already
    result = ip.user_ns["_patch"]  # the default name
    assert isinstance(result, Result) and result.status == "done"
    assert result.columns == [" Eiffel", " of"] and result.meta["positions"][0] == 2
    assert result.meta["answer"] == " Paris"  # the quotes are gone, the leading space kept
    widget, seen = grids[before]
    n_layers = len(result.layers)
    # The widget received rows while the run went on: the last layer's row first and alone (it
    # shows soonest), then the rows below it as their shared traces finish (2 cells a row here,
    # so many rows share one trace: the engine's _joins).
    counts = [row["resid"] for row in seen if "resid" in row]
    assert counts[-1] == n_layers
    assert [c for c in counts if c > 0][0] == 1, counts
    assert counts == sorted(counts)
    assert result.row_order == {"resid": -1} and result.meta["engine"]["traces"] < n_layers
    assert widget.status == "done" and not widget.stoppable
    assert widget.comm is None  # replaced by the static bundle and closed: nothing keeps it alive


def test_trace_with_a_model_variable(ip, grids, tiny):
    ip.user_ns["small"] = tiny
    before = len(grids)
    ip.run_cell_magic("trace", '--model small --subject "Eiffel Tower" --answer " Paris" --seeds 2 --scale 3 '
                               "--kind resid,mlp -o small_trace", "\n  The Eiffel Tower is in the city of  \n")
    result = ip.user_ns["small_trace"]
    assert result.status == "done" and result.views == ["resid", "mlp"]
    assert result.meta["prompt"] == EIFFEL
    assert len(result.layers) == 3  # the tiny model, not the embedded one
    widget, seen = grids[before]
    assert widget.total_rows == 6 and sum(widget.rows_done.values()) == 6
    # Updates are coalesced (≤ 20/s), so a fast tiny model may send just one partial grid
    # before the final one; what matters is that a partial grid reached the widget.
    assert len(seen) >= 2 and sum(seen[0].values()) < 6


@pytest.mark.parametrize(
    ("magic", "line", "body", "expected"),
    [
        ("trace", '--subject "Eiffel Tower"', EIFFEL, "--answer"),
        ("trace", '--subject "Colosseum" --answer " Paris"', EIFFEL, "Colosseum"),
        ("trace", '--subject "Eiffel Tower" --answer " Paris"', "   \n", "prompt"),
        ("trace", '--subject "Eiffel Tower" --answer " Paris" --scale loud', EIFFEL, "--scale"),
        ("trace", '--subject "Eiffel Tower" --answer " Paris" --kind resid,ffn', EIFFEL, "ffn"),
        ("trace", '--subject "Eiffel Tower" --answer ""', EIFFEL, "answer is empty"),
        ("trace", '--subject "Eiffel Tower --answer " Paris"', EIFFEL, "quot"),
        ("trace", '--subject "Eiffel Tower" --answer " Paris" -o 2bad', EIFFEL, "-o"),
        ("trace", '--subject "Eiffel Tower" --answer " Paris" --model not_a_model', EIFFEL, "not a loaded model"),
        ("patch", '--answer " Paris" --foil " Rome"', f"clean: {EIFFEL}\n", "corrupt:"),
        ("patch", '--answer " Paris" --foil " Rome"', f"clean: {EIFFEL}\nnoise: x\n", "line 2"),
        ("patch", '--answer " Paris" --foil " Rome"', f"clean: {EIFFEL}\ncorrupt: The big city of\n", "same length"),
        ("patch", '--answer " Paris" --foil " Rome" --site neuron', PATCH_BODY, "neuron"),
        ("patch", '--answer " Paris"', PATCH_BODY.replace("corrupt", "clean"), "'corrupt: <prompt>'"),
        ("patch", '--answer " Paris" --foil " Rome" --positions 2,x', PATCH_BODY, "--positions"),
        ("patch", '--answer " Paris" --foil " Rome"', PATCH_BODY + f"clean: {EIFFEL}\n", "2 clean, 1 corrupt"),
        ("patch", '--answer " Paris" --answer " Rome" --answer " London"', PATCH_BODY * 2, "--answer is given 3"),
        ("trace", '--subject "Eiffel Tower" --subject "Tower" --answer " Paris"', EIFFEL, "--subject is given 2"),
        ("attribute", '--answer " Paris" --foil " Rome" --verify -1', PATCH_BODY, "--verify"),
        ("path_patch", '--answer " Paris" --foil " Rome" --sender 12', PATCH_BODY, "--sender"),
        ("path_patch", '--answer " Paris" --foil " Rome" --receivers 13.4.x', PATCH_BODY, "--receivers"),
        ("path_patch", '--answer " Paris" --foil " Rome" --site head', PATCH_BODY, "--site"),
    ],
)
def test_bad_cells_fail_in_one_line_and_bind_nothing(ip, magic, line, body, expected):
    ip.user_ns["not_a_model"] = "gpt2"
    ip.user_ns["kept"] = sentinel = object()
    with pytest.raises(UsageError) as caught:
        ip.run_cell_magic(magic, f"{line} -o kept" if " -o " not in line else line, body)
    message = str(caught.value)
    assert "\n" not in message.strip() and expected in message, message
    assert message.count(f"%%{magic}") <= 1, message
    assert ip.user_ns["kept"] is sentinel


def test_a_bad_cell_shows_one_line_and_no_traceback(ip, capsys):
    ip.user_ns["earlier"] = 41
    outcome = ip.run_cell(f'%%trace --subject "Colosseum" --answer " Paris" -o earlier\n{EIFFEL}')
    captured = capsys.readouterr()
    shown = (captured.out + captured.err).strip()
    assert isinstance(outcome.error_in_exec, UsageError)
    assert "Traceback" not in shown and len(shown.splitlines()) == 1, shown
    assert shown.startswith("UsageError:") and "Colosseum" in shown
    assert ip.user_ns["earlier"] == 41


def test_a_stopped_run_binds_its_partial_result(ip, grids, tiny, capsys):
    ip.user_ns["small"] = tiny

    def press_stop_after_first_row(widget):
        def on_rows(change):
            if sum(change["new"].values()) >= 1:
                widget.stop_requested = True

        widget.observe(on_rows, names="rows_done")

    grids.hooks.append(press_stop_after_first_row)
    try:
        body = f"clean: {EIFFEL}\ncorrupt: The Big Ben is in the city of\n"  # the tiny tokenizer's words
        ip.run_cell_magic("patch", '--model small --answer " Paris" --foil " London" -o partial', body)
    finally:
        grids.hooks.remove(press_stop_after_first_row)
    result = ip.user_ns["partial"]
    assert result.status == "stopped" and 1 <= result.rows_done["resid"] < 3
    err = capsys.readouterr().err
    assert "stopped" in err and "partial" in err and "partial result is bound to partial" in err


def test_an_interrupted_run_binds_its_partial_result(ip, grids, tiny, capsys):
    """Kernel ▸ Interrupt is a KeyboardInterrupt on the main thread, here raised for real."""
    import _thread

    ip.user_ns["small"] = tiny

    def interrupt_after_first_row(widget):
        def on_rows(change):
            if sum(change["new"].values()) == 1:
                _thread.interrupt_main()

        widget.observe(on_rows, names="rows_done")

    grids.hooks.append(interrupt_after_first_row)
    try:
        ip.run_cell_magic("trace", '--model small --subject "Eiffel Tower" --answer " Paris" --seeds 2 --scale 3 '
                                   "-o cut", EIFFEL)
    finally:
        grids.hooks.remove(interrupt_after_first_row)
    result = ip.user_ns["cut"]
    assert result.status == "interrupted" and 1 <= result.rows_done["resid"] < 3
    assert "interrupted" in capsys.readouterr().err
    widget = grids[-1][0]
    assert widget.status == "interrupted" and not widget.stoppable


@pytest.mark.parametrize("name", list(EXPERIMENTS))
@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_patchgrid_run_for_every_experiment(model, tiny, grids, name, which):
    """``PatchGrid.run(model, kind, **python arguments)``: a live grid, the API's numbers, clicks answered
    — on the embedded model, and on a tiny one for the forms (a head sweep, several seeds) that
    would be slow on it."""
    net, kwargs = (model, EMBEDDED[name]["kwargs"]) if which == "embedded" else (tiny, TINY[name])
    before = len(grids)
    result = PatchGrid.run(net, name, **kwargs)
    assert_same_result(result, python_result(net, name, kwargs))
    widget, seen = grids[before]
    assert widget.status == "done" and widget.rows_done == result.rows_done and seen
    grid = PatchGrid(result)  # a clickable grid again, answered through the plan's predictor
    grid.selected = {"view": result.views[0], "seed": -1, "row": 0, "col": 0}
    assert len(grid.detail["top"]) == 5 and "error" not in grid.detail, grid.detail
    grid.close()


def test_patchgrid_run_refuses_an_unknown_kind_in_one_line(tiny):
    with pytest.raises(ValueError, match="kind") as caught:
        PatchGrid.run(tiny, "ablate")
    message = str(caught.value)
    assert "\n" not in message and all(name in message for name in EXPERIMENTS)
