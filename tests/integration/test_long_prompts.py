"""Long prompts (issue 45): ``positions=`` on trace and lens, one line before a run the cost
model puts above a minute, and a subject that occurs twice refused (or picked by
``occurrence=``). Real models: the embedded default, tiny random ones."""

from __future__ import annotations

import warnings

import pytest

import pipatch
from pipatch._base.errors import PipatchWarning
from pipatch._engine import _cost
from pipatch._experiments._api import plan_lens, plan_trace
from tests._tiny import tiny_model
from tests.conftest import EIFFEL

TWICE = "The Eiffel Tower is in Paris. The Eiffel Tower is in the city of"


def test_positions_pick_the_traces_columns(eiffel_trace, model):
    r = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", positions=[3, -1])
    T = len(eiffel_trace.tokens)
    assert r.meta["positions"] == [3, T - 1] and r.columns == [r.tokens[3], r.tokens[-1]]
    assert r.grid.shape == (18, 2) and r.per_seed.shape[-1] == 2
    # Derived: the same runs batched otherwise, each metric and baseline within the metric's
    # 1e-5, so each seed's recovery within the ratio's bound (tests/_tolerance.py).
    from tests._tolerance import assert_recovery_close, recovery_tolerance

    within = recovery_tolerance(eiffel_trace, 1e-5, per_seed=True)[..., [3, T - 1]]
    assert_recovery_close(r.per_seed, eiffel_trace.per_seed[..., [3, T - 1]], within)
    with pytest.raises(pipatch.PipatchError, match="out of range"):
        pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", positions=[T])


def test_a_subject_that_occurs_twice_is_refused_in_one_line_and_occurrence_picks_one(model):
    for run in (pipatch.trace, pipatch.lens):
        with pytest.raises(pipatch.PipatchError) as refused:
            run(model, TWICE, subject="Eiffel Tower", answer=" Paris", seeds=1) if run is pipatch.trace else \
                run(model, TWICE, subject="Eiffel Tower", answer=" Paris")
        line = str(refused.value)
        assert "\n" not in line and "occurs 2 times" in line and "occurrence=0" in line and "'last'" in line
        assert line.count("Eiffel") >= 3  # the subject and both occurrences' tokens
    first = plan_trace(model, TWICE, subject="Eiffel Tower", answer=" Paris", seeds=1, occurrence="first").result
    last = plan_trace(model, TWICE, subject="Eiffel Tower", answer=" Paris", seeds=1, occurrence=1).result
    assert min(last.meta["subject_positions"]) > max(first.meta["subject_positions"])
    for picked in (first, last):
        assert "".join(picked.tokens[i] for i in picked.meta["subject_positions"]).strip() == "Eiffel Tower"
    lens = plan_lens(model, TWICE, subject="Eiffel Tower", answer=" Paris", occurrence="last").result
    assert lens.meta["subject_positions"] == last.meta["subject_positions"]


def test_a_run_the_cost_model_puts_above_the_threshold_is_announced_in_one_line(monkeypatch):
    """A real estimate (the cells' FLOPs on a tiny model) against a lowered threshold."""
    tiny = tiny_model("llama")
    prompt = " ".join(["the city of Paris is in France and"] * 12)
    plan = plan_trace(tiny, prompt, subject=[3], answer=" Paris", seeds=2)
    flops, cells = _cost.sweep_flops(plan)
    narrow = plan_trace(tiny, prompt, subject=[3], answer=" Paris", seeds=2, positions=[-1])
    narrow_flops, narrow_cells = _cost.sweep_flops(narrow)
    assert cells == 2 * 3 * len(plan.result.tokens) and narrow_cells == 2 * 3
    assert 0 < narrow_flops < flops / 10  # narrowing to one position cuts the estimate
    seconds = _cost.seconds_for(plan.backend, flops)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # below the threshold: not a word
        monkeypatch.setattr(_cost, "LONG_SECONDS", seconds * 2)
        plan_trace(tiny, prompt, subject=[3], answer=" Paris", seeds=2).run()
    monkeypatch.setattr(_cost, "LONG_SECONDS", seconds / 2)
    with pytest.warns(PipatchWarning) as caught:
        plan_trace(tiny, prompt, subject=[3], answer=" Paris", seeds=2).run()
    (line,) = [str(w.message) for w in caught]
    assert "\n" not in line and line.startswith("pipatch: this trace will take ") and " on this CPU (" in line
    assert f"{cells:,} patched runs" in line and "positions=" in line and "seeds=" in line


def test_a_long_lens_is_announced_before_its_read(monkeypatch):
    tiny = tiny_model("gpt2")
    prompt = " ".join(["the city of Paris is in France and"] * 12)
    monkeypatch.setattr(_cost, "LONG_SECONDS", 0.0)
    with pytest.warns(PipatchWarning, match=r"the logit lens will take (about|under) .* layers through the "
                                                   r"unembedding\): narrow it with positions="):
        r = pipatch.lens(tiny, prompt, answer=" Paris")
    assert r.status == "done"
