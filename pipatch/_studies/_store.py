"""A study's durable store: one SQLite file that a killed run leaves whole.

Layout (stdlib :mod:`sqlite3`, no server, one file plus SQLite's ``-wal`` / ``-shm`` while open):

* ``config(key, value)``: the study's configuration, one JSON value per key (model, its
  fingerprint, backend, dtype, experiment, each option, ``known_only``, pipatch's version).
  A later run compares key by key and refuses any difference (:meth:`Store.check_config`);
* ``facts(idx, ...)``: one row per fact that finished, whatever the outcome: ``done`` (its
  full result: the Result's own file parts, a JSON header and the tensors as safetensors
  bytes, every seed's raw values and baselines bit for bit), ``unknown`` (filtered by the
  known-fact rule, with the model's top-1 token) or ``error`` (one line). Never pickle.

**Why it survives a SIGKILL.** The database is in WAL mode and each fact is one transaction
(``with connection:``; facts that ran as one, a :class:`~pipatch._engine.Chain`, are one
transaction together): its row is appended to the write-ahead log and the commit record is
written last, so a process killed at any instant leaves either the whole fact or none of it;
SQLite rolls an unfinished tail of the log back on the next open. ``synchronous=FULL`` also
syncs the log at every commit, so a committed fact survives a power cut too, not only a
killed process (with ``NORMAL`` in WAL mode a crash of the machine could lose the last
commits, never corrupt the file). One fsync per fact is small beside the fact's own
compute, so FULL is the choice.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .._model.models import PipatchError
from .._results.result import Result, result_from_parts
from .._results.views import json_safe

__all__ = ["Store", "StoredFact", "config_differences"]

SCHEMA = 1

_TABLES = """
CREATE TABLE IF NOT EXISTS config (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS facts (
    idx INTEGER PRIMARY KEY,
    fact_key TEXT NOT NULL,
    fact_id TEXT,
    relation TEXT,
    status TEXT NOT NULL CHECK (status IN ('done', 'unknown', 'error')),
    record TEXT NOT NULL,
    inputs TEXT NOT NULL,
    known INTEGER,
    top1 TEXT,
    message TEXT,
    groups TEXT,
    header TEXT,
    tensors BLOB,
    seconds REAL,
    finished REAL NOT NULL
);
"""


class StoredFact(dict):
    """One row of ``facts`` as a dict (``status``, ``fact_id``, ``top1``, ...), with its result."""

    def result(self) -> Result:
        """The fact's own :class:`~pipatch.Result`, read back bit for bit."""
        if self["status"] == "unknown":
            raise PipatchError(f"fact {self['idx']} has no result: the model does not know it (it predicts "
                               f"{self.get('top1')!r}, the answer is {self.inputs().get('answer')!r}); "
                               "study(..., known_only=False) runs such facts too")
        if self["status"] != "done":
            raise PipatchError(f"fact {self['idx']} has no result: it failed ({self.get('message')}); "
                               "run the study again to retry it")
        from safetensors.torch import load as load_tensors

        header = json.loads(self["header"])
        tensors: dict[str, torch.Tensor] = load_tensors(bytes(self["tensors"]))
        return result_from_parts(header, tensors, f"fact {self['idx']} of the store")

    def inputs(self) -> dict[str, Any]:
        """The fact's inputs as its experiment took them (``prompt``, ``subject``, ``answer``, ...)."""
        try:
            inputs = json.loads(self["inputs"])
        except (TypeError, ValueError):
            return {}
        return inputs if isinstance(inputs, dict) else {}


class Store:
    """The SQLite file of one study (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise PipatchError(f"no study store at {str(self.path)!r}: check the path (pipatch.study(..., store=PATH) "
                               "makes one)")
        try:
            # One connection, used by a study's threads in turn (facts in flight: the lock).
            self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None, check_same_thread=False)
            self._lock = threading.Lock()
            self.db.row_factory = sqlite3.Row
            mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self.db.execute("PRAGMA synchronous=FULL")
            if create:
                self.db.executescript(_TABLES)
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as error:
            raise PipatchError(f"{str(self.path)!r} is not a readable study store ({error}): give another path") from None
        if not {"config", "facts"} <= tables:
            raise PipatchError(f"{str(self.path)!r} is an SQLite file but not a pipatch study store: give another path")
        self.journal_mode = str(mode)
        self.db.isolation_level = "DEFERRED"  # ``with self.db:`` is then one transaction

    def close(self) -> None:
        self.db.close()

    # -- configuration ----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {row["key"]: json.loads(row["value"]) for row in self.db.execute("SELECT key, value FROM config")}

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Write ``config`` into a new store; in one that has one, refuse any difference in one
        line naming the keys."""
        config = json_safe(dict(config))
        old = self.config()
        if not old:
            with self.db:
                self.db.executemany("INSERT INTO config (key, value) VALUES (?, ?)",
                                    [(k, json.dumps(v, sort_keys=True)) for k, v in config.items()])
            return
        differing = config_differences(old, config)
        if differing:
            said = "; ".join(f"{key}: stored {_short(old.get(key))}, now {_short(config.get(key))}"
                             for key in differing[:4])
            more = f" (and {len(differing) - 4} more)" if len(differing) > 4 else ""
            raise PipatchError(f"the store {str(self.path)!r} holds a study of another configuration ({said}{more}): "
                               "give a new store path for this one, or run with the stored configuration")

    def info(self) -> dict[str, Any]:
        """What the last run recorded that is no configuration (``n_facts``: how many it read)."""
        return {row["key"]: json.loads(row["value"]) for row in self.db.execute("SELECT key, value FROM info")}

    def set_info(self, key: str, value: Any) -> None:
        with self._lock, self.db:
            self.db.execute("INSERT OR REPLACE INTO info (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    # -- facts --------------------------------------------------------------------------------
    def facts(self) -> Iterator[StoredFact]:
        for row in self.db.execute("SELECT * FROM facts ORDER BY idx"):
            yield StoredFact(dict(row))

    def fact(self, index: int) -> StoredFact | None:
        row = self.db.execute("SELECT * FROM facts WHERE idx = ?", (int(index),)).fetchone()
        return None if row is None else StoredFact(dict(row))

    def keys(self) -> dict[int, tuple[str, str]]:
        """``{index: (fact key, status)}`` of every stored fact."""
        return {row[0]: (row[1], row[2]) for row in self.db.execute("SELECT idx, fact_key, status FROM facts")}

    def put(self, fact: Any, status: str, **fields: Any) -> None:
        """Commit one fact, whole (one transaction): a rerun after a kill finds it or not at all.
        ``fields``: ``result``, ``known``, ``top1``, ``message``, ``groups``, ``seconds``."""
        self.put_many([(fact, status, fields)])

    def put_many(self, facts: Sequence[tuple[Any, str, dict[str, Any]]]) -> None:
        """Commit several facts (``(fact, status, fields)`` each, as :meth:`put`) in one
        transaction: a rerun finds them all or none (facts that ran as one, whose values
        depend on each other in their last bits)."""
        rows = [self._row(fact, status, **fields) for fact, status, fields in facts]
        with self._lock, self.db:
            self.db.executemany("INSERT OR REPLACE INTO facts (idx, fact_key, fact_id, relation, status, record, "
                                "inputs, known, top1, message, groups, header, tensors, seconds, finished) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    @staticmethod
    def _row(fact: Any, status: str, *, result: Result | None = None, known: bool | None = None,
             top1: str | None = None, message: str | None = None, groups: Any = None,
             seconds: float | None = None) -> tuple:
        header = tensors = None
        if result is not None:
            from safetensors.torch import save as save_tensors

            parts, arrays = result._file_parts()
            header = json.dumps(json_safe(parts), ensure_ascii=False, allow_nan=False)
            tensors = save_tensors({k: v.contiguous() for k, v in arrays.items()})
        row = (int(fact.index), fact.key, fact.id, fact.relation, status, json.dumps(fact.record, ensure_ascii=False),
               json.dumps(fact.inputs, ensure_ascii=False), None if known is None else int(known), top1, message,
               None if groups is None else json.dumps(groups), header, tensors, seconds, time.time())
        return row

    def integrity(self) -> str:
        """SQLite's ``PRAGMA integrity_check``: ``"ok"`` for a whole file."""
        return str(self.db.execute("PRAGMA integrity_check").fetchone()[0])


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ (or that one side lacks), in order."""
    keys = list(dict.fromkeys([*old, *new]))
    return [k for k in keys if json.dumps(old.get(k), sort_keys=True) != json.dumps(new.get(k), sort_keys=True)]


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."
