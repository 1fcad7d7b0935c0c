"""Methodology guards and circuit defaults (#45), on real models.

A study traces every fact at one noise scale (the embedded model: two known facts whose own
``scale="auto"`` differ), an answer missing its leading space is warned about when a trace is
planned (a tiny model's tokenizer) and when its ids are read (the embedded model's tokenizer,
no forward: the tokenizer comes from the converted cache, so not a unit test), and a circuit on a CPU takes the CPU's defaults, says its
estimate first and measures exactly ``curve`` points (a tiny model). Kept cheap: one seed, the
residual kind, short prompts, tiny circuits.
"""

from __future__ import annotations

import warnings

import pytest

import pipatch
from pipatch._base.errors import PipatchWarning
from pipatch._experiments._api import plan
from pipatch._experiments._circuit_budget import DEVICE_DEFAULTS
from pipatch._experiments._inputs import answer_ids
from tests._tiny import tiny_model
from tests.unit.test_facts import records

#: Two facts the embedded model knows, whose own auto scales differ (1σ, then 2σ with one seed).
ONE_SIGMA, TWO_SIGMA = 101, 81
CHEAP = {"sites": "resid", "seeds": 1}
PAIR = dict(clean="When Mary and John went to the store, John gave a book to",
            corrupt="When Mary and John went to the store, Mary gave a book to", answer=" Mary", foil=" John")


def _alone_scale(model, fact) -> float:
    """The scale auto picks for ``fact`` traced on its own (its baselines only: no sweep)."""
    return plan("trace", model, fact["prompt"], subject=fact["subject"], answer=" " + fact["attribute"],
                **CHEAP).result.meta["scale"]


def test_a_study_traces_every_fact_at_the_scale_auto_picked_first_and_a_resume_keeps_it(model, tmp_path):
    facts = records([ONE_SIGMA, TWO_SIGMA])
    assert [_alone_scale(model, fact) for fact in facts] == [1.0, 2.0]
    store = tmp_path / "one-scale.sqlite"
    first = pipatch.study(model, facts, store=store, limit=1, **CHEAP)
    assert first.counts()["done"] == 1 and first.noise_scale == 1.0 and first[0].meta["scale"] == 1.0
    assert " at noise 1σ: " in first.summary()
    resumed = pipatch.study(model, facts, store=store, **CHEAP)  # a new run: the recorded scale holds
    assert resumed.counts()["done"] == 2 and resumed.noise_scale == 1.0
    assert resumed[1].meta["scale"] == 1.0 and resumed[1].meta["scale_requested"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipatchWarning)  # one scale: the averages say nothing
        assert resumed.grid().shape[0] == 18
    given = pipatch.study(model, facts, store=tmp_path / "given.sqlite", scale=3.0, **CHEAP)
    assert given.noise_scale == 3.0 and [given[i].meta["scale"] for i in range(2)] == [3.0, 3.0]


def test_an_answer_without_its_leading_space_is_warned_about_when_planned():
    tiny = tiny_model("llama")
    with pytest.warns(PipatchWarning, match=r"pass answer=' Paris'"):
        plan("trace", tiny, "The Eiffel Tower is in the city of", subject="Eiffel Tower", answer="Paris", **CHEAP)


def test_a_circuit_on_a_cpu_takes_the_cpu_defaults_says_its_estimate_first_and_measures_curve_points(capfd):
    tiny = tiny_model("llama")
    capfd.readouterr()
    result = pipatch.circuit(tiny, **PAIR)
    said = capfd.readouterr().err.splitlines()
    cpu = DEVICE_DEFAULTS["cpu"]
    assert said[0].startswith("circuit: ") and " on this CPU (" in said[0]
    assert f"eap-ig with {cpu['steps']} steps" in said[0]
    assert sum(line.startswith("circuit: ") for line in said) == 1
    assert result.meta["method"] == "eap-ig" and result.meta["steps"] == cpu["steps"]
    assert len(result.meta["checked"]) == cpu["verify"]
    assert len(result.meta["faithfulness"]["sizes"]) == cpu["curve"]
    # The GPU's defaults, given: as many points as asked, the bisection among them; no
    # progress shown, no estimate said.
    gpu = DEVICE_DEFAULTS["cuda"]
    full = pipatch.circuit(tiny, **PAIR, **gpu, progress=False)
    assert capfd.readouterr().err == ""
    assert full.meta["steps"] == gpu["steps"] and len(full.meta["checked"]) == gpu["verify"]
    curve = full.meta["faithfulness"]
    assert len(curve["sizes"]) == gpu["curve"] and curve["size"] in curve["sizes"]


def _warned(model, answer: str, prompt: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer_ids(model, answer, "answer", prompt)
    return [str(w.message) for w in caught if issubclass(w.category, PipatchWarning)]


def test_an_answer_without_its_leading_space_is_warned_about_with_the_fix(model):
    prompt = "The Eiffel Tower is in the city of"
    [line] = _warned(model, "Paris", prompt)
    assert "answer=' Paris'" in line and "\n" not in line
    [line] = _warned(model, "New York", prompt)  # several tokens: the spaced ones are no more
    assert "answer=' New York'" in line
    assert _warned(model, " Paris", prompt) == []
    assert _warned(model, "Paris", prompt + " ") == []  # the prompt gives the space
    assert _warned(model, "1945", "The war ended in") == []  # " 1945" is more pieces: no usual word
    assert _warned(model, ",", prompt) == []
