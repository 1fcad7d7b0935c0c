"""Studies (#32): one experiment over many facts, into a durable SQLite store, averaged.

Real nnsight, ROME's own ``known_1000.json`` as pipatch ships it (:func:`pipatch.known_facts`),
the embedded model, and a tiny random-weight model (:mod:`tests._tiny`) where a check needs
many cells. Kept cheap: short known facts, the residual kind, one or two seeds at a fixed
noise scale (no scale search), the fast paths on (a study plans each fact as the single trace
does: alone, it equals that trace bit for bit; four run as one share the metric's pass).
"""

from __future__ import annotations

import csv
import json

import pytest

import pipatch
from pipatch._experiments._registry import experiment
from pipatch._studies._facts import read_facts

KNOWN_1000 = pipatch.known_facts()

#: Short facts of known_1000.json the embedded model knows (top-1 = the answer's first token).
KNOWN = [3, 21, 25, 32, 101, 81, 34, 6, 8, 49, 86, 102, 106, 109, 112, 116, 74, 10, 28, 33]
#: Facts it gets wrong (top-1 is something else).
UNKNOWN = [0, 1, 2]


def records(indices):
    data = json.loads(KNOWN_1000.read_text())
    return [data[i] for i in indices]


# --------------------------------------------------------------------------------------------
# Inputs: every container gives the same facts
# --------------------------------------------------------------------------------------------


class DuckDataset:
    """What a ``datasets.Dataset`` offers a reader: ``column_names``, ``to_list()``, iteration."""

    def __init__(self, rows):
        self._rows = rows
        self.column_names = list(rows[0])

    def __iter__(self):
        return iter(self._rows)

    def __len__(self):
        return len(self._rows)

    def to_list(self):
        return [dict(r) for r in self._rows]


def test_every_input_format_gives_the_same_facts(tmp_path):
    import pandas as pd

    facts = records(KNOWN[:4] + UNKNOWN[:1])
    entry = experiment("trace")
    as_json = tmp_path / "facts.json"
    as_json.write_text(json.dumps(facts))
    as_jsonl = tmp_path / "facts.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(f) for f in facts) + "\n")
    as_csv = tmp_path / "facts.csv"
    with open(as_csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(facts[0]))
        writer.writeheader()
        writer.writerows(facts)
    sources = {"list": facts, "json": as_json, "jsonl": str(as_jsonl), "csv": as_csv, "dataframe": pd.DataFrame(facts),
               "dataset": DuckDataset(facts), "known_1000": KNOWN_1000}

    def read(source):
        out = read_facts(source, entry)
        if source is KNOWN_1000:  # the file itself: the same records, at their places in it
            out = [out[i] for i in KNOWN[:4] + UNKNOWN[:1]]
        return [(f.id, f.relation, f.inputs, f.subject, f.error, f.key) for f in out]

    want = read(facts)
    assert want[0][2] == {"prompt": facts[0]["prompt"], "subject": facts[0]["subject"], "answer": " " + facts[0]["attribute"]}
    assert [w[0] for w in want] == [str(i) for i in KNOWN[:4] + UNKNOWN[:1]]
    for name, source in sources.items():
        assert read(source) == want, name
    # columns= reads other names; an explicit answer wins over the attribute.
    renamed = [{"text": f["prompt"], "who": f["subject"], "answer": " X", "relation_id": "r"} for f in facts[:1]]
    (fact,) = read_facts(renamed, entry, columns={"prompt": "text", "subject": "who"})
    assert fact.inputs == {"prompt": facts[0]["prompt"], "subject": facts[0]["subject"], "answer": " X"}
    assert fact.relation == "r" and fact.error is None
    with pytest.raises(pipatch.PipatchError, match="unknown field"):
        read_facts(renamed, entry, columns={"prompt_text": "text"})
    if not _has("pyarrow"):
        (tmp_path / "f.parquet").write_bytes(b"PAR1")
        with pytest.raises(pipatch.PipatchError, match="pip install pyarrow"):
            read_facts(tmp_path / "f.parquet", entry)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_a_missing_known_1000_json_names_the_copy_pipatch_ships(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    entry = experiment("trace")
    with pytest.raises(pipatch.PipatchError, match="ships with pipatch") as error:
        read_facts("known_1000.json", entry)
    assert str(pipatch.known_facts()) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(pipatch.PipatchError, match="check the path$"):
        read_facts("facts.json", entry)
