"""Progress from plain Python on real (tiny) models: every experiment of the registry, a dataset
and a study show a bar on stderr (none with ``progress=False``); ``meta["elapsed"]`` covers the
whole call; a circuit's bars are its stages, in order, counting rows; a kernel draws the bar
as a tqdm widget and a live PatchGrid draws none; oversubscribed threads are named once."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import pipatch
from pipatch._base import threads as _threads
from pipatch._base.errors import PipatchWarning
from pipatch._experiments._registry import EXPERIMENTS
from tests._experiments import BIG_BEN, TINY
from tests._tiny import tiny_model
from tests.conftest import EIFFEL


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2")


def _bars(err: str) -> list[str]:
    """Each bar as a terminal shows it at the end: the last redraw of each line with a count."""
    return [line.rsplit("\r", 1)[-1] for line in err.split("\n") if "%|" in line]


def _call(function, model, kwargs):
    kwargs = dict(kwargs)
    if "prompt" in kwargs:
        return function(model, kwargs.pop("prompt"), **kwargs)
    return function(model, **kwargs)


CASES = {name: (name, TINY[name]) for name in EXPERIMENTS}
CASES["dataset"] = ("trace", {**TINY["trace"], "prompt": [EIFFEL, BIG_BEN], "subject": ["Eiffel Tower", "Big Ben"]})


@pytest.mark.parametrize("case", list(CASES))
def test_every_experiment_shows_a_bar_and_times_the_whole_call(gpt2, case, capsys):
    name, kwargs = CASES[case]
    function = getattr(pipatch, name)
    started = time.perf_counter()
    result = _call(function, gpt2, kwargs)
    wall = time.perf_counter() - started
    bars = _bars(capsys.readouterr().err)
    assert bars and all(bar.startswith(name) and " rows [" in bar for bar in bars), bars
    assert all(bar.split(": ", 1)[1].startswith("100%|") for bar in bars), bars
    # The whole call, planning included, and split by stage. What the timer cannot see (binding the
    # arguments, building the result after it stops) is a few milliseconds, more on a loaded machine
    # (13 ms of a 0.14 s call at a load of 14 on 2 cores): a fraction of the wall time alone would
    # fail there, so the untimed part is bounded by 5 % of the call or 50 ms, whichever is larger.
    untimed = wall - result.meta["elapsed"]
    assert result.status == "done" and untimed <= max(0.05 * wall, 0.05), (result.meta["elapsed"], wall)
    stages = result.meta["elapsed_stages"]
    assert list(stages)[0] == "plan" and stages["plan"] > 0 and len(stages) >= 2
    assert sum(stages.values()) == pytest.approx(result.meta["elapsed"], abs=1e-9)

    quiet = _call(function, gpt2, {**kwargs, "progress": False})
    assert _bars(capsys.readouterr().err) == [] and quiet.status == "done"
    torch.testing.assert_close(quiet.raw[quiet.views[0]], result.raw[result.views[0]], equal_nan=True)


def test_the_rows_of_a_trace_are_its_layers_of_each_view(gpt2, capsys):
    result = pipatch.trace(gpt2, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=1, sites="resid,mlp")
    (bar,) = _bars(capsys.readouterr().err)
    rows = len(result.layers) * len(result.views)
    assert f" {rows}/{rows} rows" in bar and list(result.meta["elapsed_stages"]) == ["plan", "run"]


def test_a_circuit_reports_its_stages_in_order_with_rows_that_mean_rows(gpt2, capsys):
    curve_sizes = []  # after each row: how many sizes the curve has measured (0 before it begins)

    def on_row(result, view, row):
        curve_sizes.append(len(result.meta.get("faithfulness", {}).get("sizes", [])))

    pairs = {"clean": [EIFFEL, EIFFEL], "corrupt": [BIG_BEN, BIG_BEN], "answer": " Paris", "foil": " London"}
    result = pipatch.circuit(gpt2, **pairs, steps=2, verify=3, curve=4, on_row=on_row)
    curve_rows = sum(1 for n in curve_sizes if n)
    want = [("scoring", 2), ("checks", 3 * 2), ("curve", curve_rows)]  # a pass per pair, a patch per edge and pair
    assert curve_rows >= 1 and len(curve_sizes) == sum(n for _, n in want)  # every row counted once
    assert curve_sizes[:8] == [0] * 8 and all(a < b for a, b in zip(curve_sizes[8:], curve_sizes[9:]))
    bars = _bars(capsys.readouterr().err)
    assert len(bars) == 3, bars
    for bar, (stage, n) in zip(bars, want):
        assert bar.startswith(f"circuit · {stage}: 100%|") and f"| {n}/{n} rows" in bar, bar
    stages = result.meta["elapsed_stages"]
    assert list(stages) == ["plan", "scoring", "checks", "curve"] and all(s > 0 for s in stages.values())


def test_a_study_shows_its_facts_as_they_finish(tmp_path, capsys):
    model = tiny_model("gemma3")
    facts = [{"prompt": EIFFEL, "subject": "Eiffel Tower", "attribute": "Paris"},
             {"prompt": BIG_BEN, "subject": "Big Ben", "attribute": "London"}]
    options = {"known_only": False, "sites": "resid", "seeds": 1, "scale": 3.0}
    study = pipatch.study(model, facts, store=tmp_path / "a.sqlite", **options)
    (bar,) = _bars(capsys.readouterr().err)
    assert bar.startswith("study trace: 100%|") and "| 2/2 facts" in bar and study.counts()["done"] == 2
    ran = []
    pipatch.study(model, facts, store=tmp_path / "b.sqlite", progress=False, **options)
    pipatch.study(model, facts, store=tmp_path / "c.sqlite", progress=lambda i, record, result: ran.append(i), **options)
    assert _bars(capsys.readouterr().err) == [] and ran == [0, 1]  # a hook instead of the bar


def test_a_limited_studys_bar_counts_facts_with_a_result_out_of_the_limit(tmp_path, capsys):
    """With ``limit``, the bar's total is the limit, not the records (which facts a limited study
    reaches is known only as it runs); a resumed study starts at the facts it already has."""
    model = tiny_model("gemma3")
    facts = [{"prompt": EIFFEL, "subject": "Eiffel Tower", "attribute": "Paris"},
             {"prompt": BIG_BEN, "subject": "Big Ben", "attribute": "London"}] * 3
    options = {"known_only": False, "sites": "resid", "seeds": 1, "scale": 3.0}
    pipatch.study(model, facts, store=tmp_path / "a.sqlite", limit=1, **options)
    (bar,) = _bars(capsys.readouterr().err)
    assert bar.startswith("study trace: 100%|") and "| 1/1 facts with a result" in bar, bar
    study = pipatch.study(model, facts, store=tmp_path / "a.sqlite", limit=2, **options)
    (bar,) = _bars(capsys.readouterr().err)
    assert "| 2/2 facts with a result" in bar and study.counts()["done"] == 2, bar


def test_a_kernel_draws_the_bar_as_a_widget_and_a_live_grid_draws_none(tmp_path):
    """tqdm.auto in a notebook kernel: a tqdm widget, no error; PatchGrid.run is its own progress."""
    import nbclient
    import nbformat

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cells = [
        f"import sys\nsys.path.insert(0, {root!r})\nimport pipatch\nfrom tests._tiny import tiny_model\n"
        "model = tiny_model('gpt2')",
        f"r = pipatch.lens(model, {EIFFEL!r}, answer=' Paris')",
        f"g = pipatch.PatchGrid.run(model, 'lens', prompt={EIFFEL!r}, answer=' Paris')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    plain, live = nb.cells[1].outputs, nb.cells[2].outputs

    def bars(outputs):
        return [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                and o["data"].get("text/plain", "").startswith("lens:")]

    assert len(bars(plain)) == 1 and bars(live) == []
    assert any("application/vnd.pipatch.grid+json" in o.get("data", {}) for o in live)


def test_oversubscribed_threads_are_named_once_before_a_sweep(gpt2, monkeypatch):
    """Every core busy elsewhere (the load as :func:`pipatch._base.threads.cpu_load` reads it,
    simulated): the first sweep says so in one line, with the fix; the next says nothing."""
    monkeypatch.setattr(_threads, "_warned", False)
    monkeypatch.setattr(_threads, "cpu_load", lambda: float(os.cpu_count() or 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.warns(PipatchWarning) as caught:
            first = pipatch.lens(gpt2, EIFFEL, answer=" Paris", progress=False)
            pipatch.lens(gpt2, EIFFEL, answer=" Paris", progress=False)
        said = [w for w in caught if "torch computes on" in str(w.message)]
        assert len(said) == 1 and "\n" not in str(said[0].message), [str(w.message) for w in said]
        assert "torch.set_num_threads(1)" in str(said[0].message) and said[0].filename == __file__  # the researcher's line
        torch.set_num_threads(1)
        again = pipatch.lens(gpt2, EIFFEL, answer=" Paris", progress=False)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(again.raw["resid"], first.raw["resid"], atol=1e-6, rtol=0)  # slower, not different
    monkeypatch.setattr(_threads, "_warned", False)
    monkeypatch.setattr(_threads, "cpu_load", lambda: 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipatchWarning)
        torch.set_num_threads(min(threads, os.cpu_count() or 1))
        try:
            pipatch.lens(gpt2, EIFFEL, answer=" Paris", progress=False)  # a free machine: nothing said
        finally:
            torch.set_num_threads(threads)
