"""Files and tables (#45): one way to save (the suffix picks the format), ``to_json(path)``,
``frame()`` on every result, a study's facts as a table, floats for scalars, reprs that name
only what a result has. Results built small by hand; no model."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch

import pipatch
from pipatch import PipatchError
from pipatch._results.result import Result, load_result
from tests._contract import example_circuit, example_result
from tests.unit.test_feature_views import feature_result


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(-9), b.nan_to_num(-9))


# --------------------------------------------------------------------------------------------
# save(path): the suffix picks the format; load_result reads both, and refuses a misnamed file
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["r.json", "r.JSON", "r.safetensors", "r.SafeTensors"])
def test_save_writes_the_format_its_suffix_names_and_load_result_reads_it_back_whole(tmp_path, name):
    r = example_result()
    path = r.save(tmp_path / name)
    assert path == tmp_path / name and path.exists()
    data = path.read_bytes()
    if name.lower().endswith(".json"):
        assert json.loads(data.decode("utf-8")) == r.to_json()  # the to_json document, as text
    else:
        assert data[8:9] == b"{" and b'"pipatch"' in data  # a safetensors header holding pipatch's
    back = load_result(path)
    assert back.to_json() == r.to_json() and all(_same(back.raw[v], r.raw[v]) for v in r.views)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("name", ["r.pt", "r", "r.safetensor", "r.json.gz", "r.pkl"])
def test_save_refuses_an_unknown_suffix_in_one_line_before_writing_anything(tmp_path, name):
    path = tmp_path / name
    path.write_text("kept")  # a file already there is not touched
    with pytest.raises(PipatchError) as error:
        example_result().save(path)
    message = str(error.value)
    assert "\n" not in message and ".safetensors" in message and ".json" in message
    assert repr(path.suffix or "(none)") in message
    assert path.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_load_result_refuses_a_file_that_is_not_what_its_suffix_says_and_names_the_rename(tmp_path):
    r = example_result()
    # What ``save("x.json")`` wrote before #45: safetensors bytes under a .json name.
    misnamed = tmp_path / "x.json"
    misnamed.write_bytes(r.save(tmp_path / "x.safetensors").read_bytes())
    (tmp_path / "x.safetensors").unlink()
    with pytest.raises(PipatchError) as error:
        load_result(misnamed)
    assert "\n" not in str(error.value) and "holds a safetensors result" in str(error.value)
    assert "rename it to 'x.safetensors'" in str(error.value)
    assert load_result(misnamed.rename(tmp_path / "x.safetensors")).to_json() == r.to_json()  # nothing lost
    text = tmp_path / "y.safetensors"
    text.write_text(json.dumps(r.to_json()), encoding="utf-8")
    with pytest.raises(PipatchError, match=r"holds JSON, not what its suffix '\.safetensors' says: rename it "
                                           r"to 'y\.json'"):
        load_result(text)
    assert load_result(text.rename(tmp_path / "y.json")).to_json() == r.to_json()


def test_to_json_returns_the_document_or_writes_it_to_a_path(tmp_path):
    r = example_result()
    document = r.to_json()
    assert isinstance(document, dict) and not (tmp_path / "r.json").exists()
    written = r.to_json(tmp_path / "r.json")
    assert written == tmp_path / "r.json"
    assert json.loads(written.read_text(encoding="utf-8")) == document
    # The file is strict JSON: NaN is null (example_result has a NaN cell).
    assert "NaN" not in written.read_text(encoding="utf-8")
    assert load_result(written).to_json() == document


def test_a_comparison_and_a_circuit_save_to_either_format_and_load_as_themselves(tmp_path):
    from pipatch._results.circuit import CircuitResult
    from pipatch._results.compare import Comparison

    compared = pipatch.compare(example_result(), example_result(flip=True))
    circuit = example_circuit()
    for result, kind in ((compared, Comparison), (circuit, CircuitResult)):
        for suffix in (".json", ".safetensors"):
            back = load_result(result.save(tmp_path / f"{result.kind}{suffix}"))
            assert type(back) is kind and back.to_json() == result.to_json(), (kind, suffix)
        assert json.loads(result.to_json(tmp_path / "doc.json").read_text()) == result.to_json()


# --------------------------------------------------------------------------------------------
# frame() on every result; the old name warns and still works
# --------------------------------------------------------------------------------------------


def test_frame_is_the_table_of_every_result_and_to_dataframe_warns_naming_it():
    r = example_result()
    table = r.frame()
    assert list(table.columns) == ["view", "layer", "column", "label", "recovery", "std", "raw"]
    assert len(table) == 2 * 3 * 4
    assert all(table[column].dtype == "float64" for column in ("recovery", "std", "raw"))
    with pytest.warns(DeprecationWarning, match=r"frame\(\)"):
        old = r.to_dataframe()
    assert old.equals(table)


def test_a_comparisons_frame_adds_both_sides_and_a_circuits_frame_is_its_edges():
    a, b = example_result(), example_result(flip=True)
    compared = pipatch.compare(a, b)
    table = compared.frame()
    assert list(table.columns) == ["view", "layer", "column", "label", "recovery", "std", "raw", "a", "b"]
    want_a = torch.cat([a.mean(v).flatten() for v in a.views]).double()
    assert torch.equal(torch.tensor(table["a"].to_numpy()).nan_to_num(-9), want_a.nan_to_num(-9))
    difference = torch.tensor((table["a"] - table["b"]).to_numpy())
    # The same recoveries subtracted in float64 (the frame) and float32 (the comparison's grid):
    # allclose's default 1e-5 relative covers float32's rounding.
    assert torch.allclose(difference, torch.tensor(table["recovery"].to_numpy()), equal_nan=True)
    circuit = example_circuit()
    assert circuit.frame().equals(circuit.edges())
    with pytest.warns(DeprecationWarning):
        assert len(circuit.to_dataframe()) == len(circuit.layers) * len(circuit.columns)  # the old table, kept


# --------------------------------------------------------------------------------------------
# Scalars are floats; the repr names only what a result has
# --------------------------------------------------------------------------------------------

#: Public attributes that hold one value per run by design (documented tensors), not scalars.
PER_RUN = {"raw", "clean_seeds", "corrupt_seeds", "per_seed", "grid", "grids", "nodes"}


def _dataset_result() -> Result:
    """A dataset's shape: two prompts of two seeds, each prompt with its own clean run."""
    return Result(kind="trace", tokens=["a", "b"], columns=["a", "b"], layers=["0"], metric="prob",
                  raw={"resid": torch.rand(4, 1, 2)}, clean=torch.tensor([0.9, 0.9, 0.7, 0.7]),
                  corrupt=torch.tensor([0.1, 0.2, 0.3, 0.4]), meta={"dataset": True, "prompts": ["p", "q"]})


@pytest.mark.parametrize("make", [example_result, example_circuit, _dataset_result, feature_result,
                                  lambda: pipatch.compare(example_result(), example_result(flip=True))])
def test_every_public_scalar_of_a_result_is_a_python_number(make):
    result = make()
    scalars = {}
    for name in dir(result):
        if name.startswith("_") or name in PER_RUN:
            continue
        value = getattr(result, name)
        if callable(value):
            continue
        assert not (isinstance(value, torch.Tensor) and value.numel() == 1), name
        if isinstance(value, (int, float)):
            scalars[name] = value
    assert type(result.clean_value) is float and type(result.corrupt_value) is float
    assert {"clean_value", "corrupt_value", "n_seeds"} <= set(scalars)
    assert type(result.clean) is float and type(result.corrupt) is float
    assert result.corrupt == pytest.approx(float(result.corrupt_seeds.mean()))
    assert result.clean_value == pytest.approx(result.clean) and result.corrupt_value == result.corrupt
    assert result.clean_seeds.shape == result.corrupt_seeds.shape == (result.n_seeds,)


def test_the_runs_behind_the_float_baselines_survive_both_files(tmp_path):
    dataset = _dataset_result()
    assert (dataset.clean, dataset.corrupt) == (pytest.approx(0.8), pytest.approx(0.25))
    for suffix in (".json", ".safetensors"):
        back = load_result(dataset.save(tmp_path / f"dataset{suffix}"))
        assert type(back.clean) is float and type(back.corrupt) is float, suffix
        assert _same(back.clean_seeds, dataset.clean_seeds) and _same(back.corrupt_seeds, dataset.corrupt_seeds)
        assert _same(back.grid, dataset.grid), suffix


def test_a_json_file_written_when_the_baselines_were_lists_still_loads_with_float_baselines(tmp_path):
    """Before the baselines were floats a document's ``corrupt`` (and a dataset's ``clean``) was
    the list of runs: such files read back the same, their baselines now floats."""
    dataset = _dataset_result()
    doc = dataset.to_json()
    doc["corrupt"], doc["clean"] = doc.pop("corrupt_seeds"), doc.pop("clean_seeds")  # the old layout
    (tmp_path / "old.json").write_text(json.dumps(doc), encoding="utf-8")
    back = load_result(tmp_path / "old.json")
    assert type(back.clean) is float and type(back.corrupt) is float
    assert _same(back.corrupt_seeds, dataset.corrupt_seeds) and _same(back.clean_seeds, dataset.clean_seeds)
    assert back.to_json() == dataset.to_json()


def _result(**overrides) -> Result:
    raw = torch.zeros(2, 2, 3)
    fields = dict(kind="trace", tokens=["a", "b", "c"], columns=["a", "b", "c"], layers=["0", "1"], metric="prob",
                  raw={"resid": raw}, clean=0.5, corrupt=torch.tensor([0.1, 0.2]), meta={"model": "m", "seeds": 2})
    fields.update(overrides)
    return Result(**fields)


def test_the_repr_names_only_what_the_result_has():
    trace = repr(_result())
    assert "clean 0.5" in trace and "corrupt 0.15" in trace and trace.endswith("2 seeds>")
    patch = repr(_result(kind="patch", raw={"resid": torch.zeros(1, 2, 3)}, corrupt=torch.tensor([0.1]),
                         meta={"model": "m", "direction": "denoise"}))
    assert "clean 0.5" in patch and "corrupt 0.1" in patch and "seed" not in patch  # one corrupt run, no noise
    lens = repr(_result(kind="lens", raw={"resid": torch.zeros(1, 2, 3)}, clean=0.3952, corrupt=torch.tensor([0.3952]),
                        meta={"model": "m", "normalize": False, "output": 0.3952}))
    assert "output 0.3952" in lens and "clean" not in lens and "corrupt" not in lens and "seed" not in lens
    dataset = repr(_result(meta={"model": "m", "prompts": ["x", "y"]}))
    assert dataset.endswith("2 prompts>") and "seed" not in dataset
    average = _result(kind="study", clean=0.0, meta={"model": "m", "normalize": False})  # a study's average
    assert "clean" not in repr(average) and "output" not in repr(average) and "corrupt" not in repr(average)
    assert average.to_state()["baselines"] == {}  # nor does its grid (nor its text/plain) show a baseline
    assert "output" not in average._repr_mimebundle_()["text/plain"]
    circuit = repr(example_circuit())
    assert circuit.startswith("<pipatch.CircuitResult done: ") and " edges, " in circuit and "views" not in circuit
    assert f"{int((~example_circuit().raw['edges'][0].isnan()).sum())} edges" in circuit


# --------------------------------------------------------------------------------------------
# A study's facts: a table of decoded records; a fact without a result says why
# --------------------------------------------------------------------------------------------


def _store(tmp_path):
    from pipatch._experiments._registry import experiment
    from pipatch._studies._facts import read_facts
    from pipatch._studies._store import Store

    records = [{"prompt": "The Eiffel Tower is in", "subject": "Eiffel Tower", "attribute": "Paris",
                "relation_id": "P36", "known_id": 7},
               {"prompt": "The Colosseum is in", "subject": "Colosseum", "attribute": "Rome", "relation_id": "P36"},
               {"prompt": "No subject here"}]
    facts = read_facts(records, experiment("trace"))
    store = Store(tmp_path / "s.sqlite")
    store.put(facts[0], "done", result=example_result(), known=True, top1=" Paris", seconds=1.5)
    store.put(facts[1], "unknown", known=False, top1=" Milan")
    store.put(facts[2], "error", message=facts[2].error)
    store.close()
    return pipatch.load_study(tmp_path / "s.sqlite"), facts


def test_study_facts_is_a_dataframe_of_decoded_records_without_result_data(tmp_path):
    found, facts = _store(tmp_path)
    table = found.facts()
    assert isinstance(table, pd.DataFrame) and len(table) == 3
    assert table.fact.tolist() == [0, 1, 2] and table.status.tolist() == ["done", "unknown", "error"]
    assert table.known.tolist() == [True, False, None]
    assert table.top1.tolist()[:2] == [" Paris", " Milan"] and pd.isna(table.top1.iloc[2])  # missing: pandas' NA
    assert table.prompt.tolist()[:2] == ["The Eiffel Tower is in", "The Colosseum is in"]
    assert table.answer.tolist()[:2] == [" Paris", " Rome"] and table.fact_id.tolist()[0] == "7"
    assert table.record.iloc[1]["subject"] == "Colosseum" and table.message.iloc[2] == facts[2].error
    assert table.seconds.dtype == "float64" and table.seconds.iloc[0] == 1.5 and pd.isna(table.seconds.iloc[1])
    assert table.finished.dtype == "float64"
    for column in table.columns:  # no blobs, no undecoded JSON headers
        assert not any(isinstance(value, (bytes, memoryview)) for value in table[column]), column
    assert "header" not in table.columns and "tensors" not in table.columns and "groups" not in table.columns
    assert found[0].to_json() == example_result().to_json()


def test_a_fact_without_a_result_says_why_in_one_line(tmp_path):
    found, facts = _store(tmp_path)
    with pytest.raises(PipatchError) as error:
        found[1]
    assert str(error.value) == ("fact 1 has no result: the model does not know it (it predicts ' Milan', the "
                                "answer is ' Rome'); study(..., known_only=False) runs such facts too")
    with pytest.raises(PipatchError) as error:
        found[2]
    message = str(error.value)
    assert message.startswith("fact 2 has no result: it failed (") and facts[2].error in message
    assert "\n" not in message


# --------------------------------------------------------------------------------------------
# limit counts facts with a result (the scheduler, on threads and in runs of facts together)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width, together", [(1, 1), (1, 4), (3, 1)])
def test_limit_stops_once_that_many_facts_have_a_result(width, together):
    """``_each_fact`` with a run that knows every third fact: it reads facts until ``limit``
    have a result, runs no fact past that, and says how many records it read."""
    from pipatch._studies._facts import Fact
    from pipatch._studies._run import _each_fact

    records = [Fact(index=i, id=None, relation=None) for i in range(20)]
    ran: list[int] = []

    def run(facts, stop, room=None):
        out = []
        for fact in facts:
            if room is not None and sum(r is not None for r in out) >= room:
                break
            ran.append(fact.index)
            out.append("result" if fact.index % 3 == 0 else None)
        return out

    told: list[tuple[int, object]] = []
    read = _each_fact(records, {}, run, lambda i, r, res: told.append((i, res)), None, width, together, limit=3)
    assert sorted(i for i, res in told if res is not None) == [0, 3, 6]
    assert read == 7 and max(ran) == 6 and sorted(ran) == list(range(7))
    # Facts of an earlier run count; with none to add, nothing runs.
    ran.clear()
    stored = {0: ("k", "done"), 1: ("k", "unknown"), 3: ("k", "done"), 6: ("k", "done")}
    assert _each_fact(records, stored, run, None, None, width, together, limit=3) == 0 and ran == []
    # Without a limit, every record.
    assert _each_fact(records, {}, run, None, None, width, together) == 20


def test_limit_must_be_a_positive_whole_number(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for bad in (0, -1, 2.5, "x"):
            with pytest.raises(PipatchError, match="limit"):
                pipatch.study(object(), [], store=tmp_path / "s.sqlite", limit=bad)


@pytest.mark.parametrize("command", [["trace", "The Eiffel Tower is in", "--subject", "Eiffel Tower"],
                                     ["compare", "a.json", "b.json"]])
def test_the_commands_save_flag_refuses_an_unknown_suffix_before_anything_runs(command, capsys, tmp_path):
    from pipatch import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main([*command, "--save", str(tmp_path / "r.pt")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --save: cannot save to" in err and ".safetensors" in err
    assert not list(tmp_path.iterdir())
