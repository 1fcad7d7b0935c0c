"""Files and tables (#45) on real runs: every experiment's result saves to either format by
its suffix, reads back, tabulates with ``frame()``, has float baselines and a repr that names
only what it has; a study's ``limit`` counts facts with a result, and a fact the model does not
know says so. Tiny random models (:mod:`tests._tiny`) and, for the known-fact rule, the
embedded model with facts of ROME's ``known_1000.json`` it knows and does not know."""

from __future__ import annotations

import pytest
import torch

import pipatch
from tests._tiny import tiny_model
from tests.integration.test_study import CHEAP, tiny_facts
from tests.unit.test_facts import KNOWN, UNKNOWN, records

PROMPT, OTHER = "The Eiffel Tower is in the city of", "The Big Ben is in the city of"


@pytest.fixture(scope="module")
def results():
    tiny = tiny_model("gemma3")
    pair = {"clean": PROMPT, "corrupt": OTHER, "answer": " Paris", "foil": " Rome"}
    return {
        "trace": pipatch.trace(tiny, PROMPT, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0, sites="resid"),
        "patch": pipatch.patch(tiny, **pair),
        "attribute": pipatch.attribute(tiny, **pair),
        "path_patch": pipatch.path_patch(tiny, **pair),
        "lens": pipatch.lens(tiny, PROMPT, answer=" Paris"),
    }


@pytest.mark.parametrize("name", ["trace", "patch", "attribute", "path_patch", "lens"])
def test_every_experiments_result_saves_by_suffix_reads_back_and_tabulates(results, name, tmp_path):
    result = results[name]
    for suffix in (".json", ".safetensors"):
        back = pipatch.load_result(result.save(tmp_path / f"{name}{suffix}"))
        assert back.kind == result.kind and back.to_json() == result.to_json(), suffix
        assert all(torch.equal(back.raw[v].nan_to_num(-9), result.raw[v].nan_to_num(-9)) for v in result.views)
    with pytest.raises(pipatch.PipatchError, match="end the name in .safetensors"):
        result.save(tmp_path / f"{name}.pt")
    table = result.frame()
    assert len(table) == sum(result.grids[v].numel() for v in result.views)
    assert type(result.clean) is float and type(result.corrupt) is float
    assert type(result.clean_value) is float and type(result.corrupt_value) is float
    assert result.corrupt_seeds.shape == (result.n_seeds,) and back.corrupt == result.corrupt


def test_each_experiments_repr_names_only_what_it_has(results):
    lens = repr(results["lens"])
    assert f"output {results['lens'].clean_value:.4g}" in lens
    assert "clean" not in lens and "corrupt" not in lens and "seed" not in lens  # a lens reads one run
    trace = repr(results["trace"])
    assert "clean " in trace and "corrupt " in trace and trace.endswith("2 seeds>")
    for name in ("patch", "attribute", "path_patch"):  # one clean and one corrupt run, no noise
        text = repr(results[name])
        assert "clean " in text and "corrupt " in text and "seed" not in text, name


def test_limit_counts_the_facts_the_model_knows(model, tmp_path):
    """Three facts the model gets wrong, then three it knows: ``limit=2`` reads on past the
    unknown ones until two known facts have run, and no further."""
    facts = records(UNKNOWN + KNOWN[:3])
    found = pipatch.study(model, facts, store=tmp_path / "limit.sqlite", limit=2, **CHEAP)
    assert found.counts() == {"total": 5, "done": 2, "unknown": 3, "error": 0, "pending": 0, "checked": 5}
    table = found.facts()
    assert table.status.tolist() == ["unknown"] * 3 + ["done"] * 2 and table.known.tolist() == [False] * 3 + [True] * 2
    assert "2 of 5 known; 2 done" in found.summary()
    # The same limit again runs nothing; a larger one resumes and runs the third known fact.
    ran = []
    again = pipatch.study(model, facts, store=tmp_path / "limit.sqlite", limit=3, **CHEAP,
                          progress=lambda i, r, result: ran.append((i, result is not None)))
    assert ran[-1] == (5, True) and sum(done for _, done in ran) == 1 and again.counts()["done"] == 3
    # A fact the model does not know says so, with what it predicts and the answer.
    top1 = table.top1.iloc[0]
    with pytest.raises(pipatch.PipatchError) as error:
        found[0]
    assert str(error.value).startswith(f"fact 0 has no result: the model does not know it (it predicts {top1!r}, "
                                       f"the answer is {' ' + facts[0]['attribute']!r})")


def test_limit_without_the_known_filter_counts_every_fact_that_ran(tmp_path):
    tiny = tiny_model("gemma3")
    found = pipatch.study(tiny, tiny_facts(), store=tmp_path / "tiny.sqlite", known_only=False, limit=3, in_flight=2,
                          **CHEAP)
    assert found.counts() == {"total": 3, "done": 3, "unknown": 0, "error": 0, "pending": 0, "checked": 3}
    assert found.facts().fact.tolist() == [0, 1, 2]
