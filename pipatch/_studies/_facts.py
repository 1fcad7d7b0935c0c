"""Reading a study's facts as they come: ROME's JSON, JSONL, CSV, Parquet, pandas, ``datasets``.

A **fact** is one record of the input (a dict), read into the inputs of one experiment run.
The field names are ROME's (``known_1000.json``):

==================  ===========================================================================
``prompt``          the text the model continues (trace, lens)
``subject``         the subject's text inside it (trace: what is noised; every experiment: the
                    named positions a study averages over)
``attribute``       the fact's object; the answer is ``" " + attribute`` unless ``answer`` is given
``answer``          the continuation to score, as is (mind the leading space)
``clean``,          the two prompts of a pair experiment (patch, attribute, path_patch), with
``corrupt``         ``answer`` and ``foil``
``relation_id``     the relation (``P30``), for ``Study.aggregate(by="relation_id")``
``known_id``/``id`` the record's own id, for messages
==================  ===========================================================================

``columns={"prompt": "text"}`` reads another name for a field. A record that lacks a field,
or holds something other than text in it, becomes a :class:`Fact` with ``error`` set (one line
naming the record and the field); the others still run.

Containers read: a path (``.json`` list of dicts, ``.jsonl`` / ``.ndjson`` one dict per
line, ``.csv``, ``.parquet`` where pyarrow is installed), a pandas ``DataFrame``, a Hugging
Face ``datasets.Dataset`` (anything with ``column_names`` that iterates dicts or has
``to_list()``), or any list of dicts. Nothing here imports pandas or ``datasets``: they are
recognised by what they offer.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._model.declare import Experiment
from .._model.models import PipatchError
from .._results.views import json_safe

__all__ = ["Fact", "read_facts", "read_records", "records_from_text", "FIELDS", "known_facts"]

#: ROME's known-facts set, shipped with pipatch (MIT, its licence beside it in ``pipatch/data``).
KNOWN_FACTS = Path(__file__).resolve().parent.parent / "data" / "known_1000.json"


def known_facts() -> Path:
    """The path of ROME's ``known_1000.json`` as pipatch ships it: 1,209 records with
    ``known_id``, ``subject``, ``attribute``, ``prompt``, ``relation_id`` (Meng et al., 2022;
    taken unchanged from kmeng01/rome, MIT licence in ``known_1000.LICENSE`` beside it).

    A path, so it goes wherever a file of facts does: ``pipatch.study(model,
    pipatch.known_facts(), store=...)``, ``pipatch study "$(python -c ...)"``, or
    ``json.loads(pipatch.known_facts().read_text())`` for the records themselves. Its
    ``prediction`` field is GPT-2 XL's continuation, not your model's: which facts a model knows
    is what the study's known-fact check measures."""
    if not KNOWN_FACTS.exists():
        raise PipatchError(f"ROME's known facts are missing from this install ({KNOWN_FACTS}): reinstall pipatch")
    return KNOWN_FACTS

#: Every field name a study reads (before ``columns`` maps them).
FIELDS = ("prompt", "subject", "attribute", "answer", "clean", "corrupt", "foil", "relation_id", "known_id", "id")


@dataclass
class Fact:
    """One record, read: what the experiment runs on, or why it cannot.

    Attributes
    ----------
    index
        Its place in the input (0-based): the store's key.
    id
        The record's ``known_id`` / ``id`` as text (``None`` without one).
    relation
        Its ``relation_id`` (``None`` without one).
    inputs
        The experiment's per-fact keywords: its prompt fields and the per-prompt parameters the
        record gives (``prompt``, ``subject``, ``answer``; ``clean``, ``corrupt``, ``answer``, ``foil``).
    subject
        The subject's text, where the record has one (the named positions of experiments that
        take no ``subject`` themselves, such as the lens).
    record
        The record as read (JSON-safe).
    error
        One line naming the record and what is wrong with it; ``None`` when it can run.
    """

    index: int
    id: str | None
    relation: str | None
    inputs: dict[str, Any] = field(default_factory=dict)
    subject: str | None = None
    record: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def name(self) -> str:
        """``record 3 (known_id 17)``: how messages name it."""
        return f"record {self.index}" + (f" (id {self.id})" if self.id is not None else "")

    @property
    def key(self) -> str:
        """A digest of what it runs on: a store refuses a rerun whose fact ``index`` differs."""
        text = json.dumps({"inputs": self.inputs, "subject": self.subject, "error": self.error},
                          sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Containers → records
# --------------------------------------------------------------------------------------------


def read_records(source: Any) -> list[Any]:
    """Every record of ``source`` (see the module docstring), in order. A record is usually a
    dict; a JSONL line that does not parse is kept as a :class:`_Unreadable` so that it fails
    alone."""
    if isinstance(source, (str, os.PathLike)):
        return _read_path(Path(source))
    if isinstance(source, Mapping):
        raise PipatchError("facts must be a list of records (dicts), a file, a DataFrame or a Dataset, not one dict: "
                           "wrap it in a list")
    if hasattr(source, "to_dict") and hasattr(source, "columns") and hasattr(source, "iterrows"):  # pandas
        return [_without_missing(r) for r in source.to_dict("records")]
    if hasattr(source, "column_names"):  # datasets.Dataset and look-alikes
        rows = source.to_list() if hasattr(source, "to_list") else list(source)
        return [dict(r) if isinstance(r, Mapping) else r for r in rows]
    if isinstance(source, Iterable) and not isinstance(source, (bytes, bytearray)):
        return list(source)
    raise PipatchError(f"cannot read facts from a {type(source).__name__}: pass a path (.json, .jsonl, .csv, "
                       ".parquet), a list of dicts, a pandas DataFrame or a datasets.Dataset")


class _Unreadable(str):
    """A line of a JSONL file that is not a JSON object: the record's error, in words."""


def records_from_text(text: str, where: str = "the text") -> list[Any]:
    """A JSON list, or JSON lines (one object per line; blank lines and ``#`` comments skipped)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise PipatchError(f"{where} is not valid JSON ({error.msg} at line {error.lineno}): fix it, or give "
                               "one JSON object per line") from None
        if not isinstance(data, list):
            raise PipatchError(f"{where} holds {type(data).__name__}, not a list of records")
        return data
    out: list[Any] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as error:
            out.append(_Unreadable(f"line {number} is not JSON ({error.msg})"))
    return out


def facts_file(path: str | Path) -> Path:
    """``path``, or one :class:`PipatchError` line where there is no such file (naming the copy
    pipatch ships where the name is ``known_1000.json``)."""
    path = Path(path)
    if not path.exists():
        shipped = f" (ROME's {path.name} ships with pipatch: pass {str(KNOWN_FACTS)!r}, pipatch.known_facts())"
        raise PipatchError(f"no facts file at {str(path)!r}: check the path"
                           + (shipped if path.name == KNOWN_FACTS.name else ""))
    return path


def _read_path(path: Path) -> list[Any]:
    where = repr(str(facts_file(path)))
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PipatchError(f"reading {where} needs pyarrow: pip install pyarrow (or convert it to .jsonl / .csv)") from None
        return pq.read_table(str(path)).to_pylist()
    text = path.read_text(encoding="utf-8")
    if suffix == ".csv":
        return [{k: v for k, v in row.items() if k is not None} for row in csv.DictReader(io.StringIO(text))]
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return records_from_text(text, where)  # JSON lines under a .json name
        if isinstance(data, dict):  # {"data": [...]} and the like: the one list it holds
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise PipatchError(f"{where} holds a JSON object, not a list of records: give the list itself")
            data = lists[0]
        if not isinstance(data, list):
            raise PipatchError(f"{where} holds {type(data).__name__}, not a list of records")
        return data
    return records_from_text(text, where)


def _without_missing(record: Mapping[str, Any]) -> dict[str, Any]:
    """A DataFrame row without its missing cells (NaN / None): a missing field is absent."""
    return {k: v for k, v in record.items() if not (v is None or (isinstance(v, float) and math.isnan(v)))}


# --------------------------------------------------------------------------------------------
# Records → facts
# --------------------------------------------------------------------------------------------


def read_facts(source: Any, entry: Experiment, *, columns: Mapping[str, str] | None = None,
               given: Sequence[str] = ()) -> list[Fact]:
    """The facts of ``source`` for experiment ``entry``: one :class:`Fact` per record.

    ``columns`` maps a field to the record's name for it (``{"prompt": "text"}``); ``given``
    are the per-prompt parameters passed as options (the same for every fact), which a record
    then need not hold.
    """
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(FIELDS))
    if unknown:
        raise PipatchError(f"columns= maps unknown field(s) {', '.join(map(repr, unknown))}: the fields are "
                           f"{', '.join(FIELDS)}")
    return [_fact(i, record, entry, columns, set(given)) for i, record in enumerate(read_records(source))]


def _fact(index: int, record: Any, entry: Experiment, columns: Mapping[str, str], given: set[str]) -> Fact:
    if isinstance(record, _Unreadable):
        return Fact(index, None, None, record={}, error=f"record {index}: {record}")
    if not isinstance(record, Mapping):
        return Fact(index, None, None, record={}, error=f"record {index} is a {type(record).__name__}, not a dict "
                                                        "of fields")
    safe = json_safe({str(k): v for k, v in record.items()})

    def get(name: str) -> Any:
        return record.get(columns.get(name, name))

    raw_id = get("known_id")
    if raw_id is None:
        raw_id = get("id")
    fact_id = None if raw_id is None else str(raw_id)
    relation = get("relation_id")
    fact = Fact(index, fact_id, None if relation is None else str(relation), record=safe)
    subject = get("subject")
    fact.subject = subject if isinstance(subject, str) and subject else None

    def need(name: str, value: Any) -> str:
        spelled = columns.get(name, name)
        if value is None:
            hint = f" (columns={{{name!r}: ...}} reads another name)" if name not in columns else ""
            raise _Bad(f"no {spelled!r} field{hint}")
        if not isinstance(value, str):
            raise _Bad(f"the {spelled!r} field is a {type(value).__name__}, not text")
        if not value.strip():
            raise _Bad(f"the {spelled!r} field is empty")
        return value

    keywords = {p.keyword: p for p in entry.params if p.per_prompt}
    try:
        for name in entry.prompts.fields:
            fact.inputs[name] = need(name, get(name))
        if "answer" in keywords and "answer" not in given:
            answer, attribute = get("answer"), get("attribute")
            if answer is None and attribute is not None:
                fact.inputs["answer"] = " " + need("attribute", attribute).strip()
            else:
                fact.inputs["answer"] = need("answer", answer)
        for name, param in keywords.items():
            if name == "answer" or name in given:
                continue
            value = get(name)
            if value is None and not param.required:
                continue
            fact.inputs[name] = need(name, value)
    except _Bad as bad:
        fact.error = f"{fact.name}: {bad}"
    return fact


class _Bad(Exception):
    """A field a record lacks or holds wrongly (becomes the fact's error line)."""
