"""A study: one experiment over many facts, into a durable store, then averaged (ROME's ``main()``).

ROME's ``causal_trace.py`` loops over ``known_1000.json``, skips the facts the model gets
wrong, writes one result file per fact so a rerun resumes, and plots averages by token group.
:func:`study` does the same with pipatch's experiments:

1. the facts are read as they come (:mod:`._facts`): ROME's JSON, JSONL, CSV, a DataFrame,
   a ``datasets.Dataset``, a list of dicts;
2. each fact is checked against the **known-fact rule** (ROME's): the model's top-1 next
   token after the prompt must be the first token of the answer. Facts that fail are kept
   in the store with the model's actual top-1, and (``known_only=True``, the default) not run;
3. each known fact is planned by the experiment's own planner, exactly as
   ``pipatch.trace(model, prompt, ...)`` would plan it alone, runs through the engine, and is
   committed to the store (:mod:`._store`, SQLite WAL, one transaction) before the next
   starts. A fact run alone (``in_flight=1``) is that single trace, bit for bit, fast paths
   and all. By default several facts are in flight at once, as the backend gains by it:
   in this process (the transformers backend) four run as one :class:`~pipatch._engine.Chain`,
   their cells in packed traces together and their metrics in one pass over the unembedding, committed
   together (their single traces' values up to float32 rounding, ≤ 1e-5 in probability on
   Gemma; a resumed run gives each fact the same company, so the same bits); on a served model four run at once from threads of their own,
   each committed as it ends, so the server batches their requests. Running again on the
   same store resumes; a different configuration is refused in one line;
4. :class:`Study` reads the store back (finished or not, without a model): each fact's
   :class:`~pipatch.Result`, averages by named position group × layer with 95 % intervals
   (:mod:`._aggregate`), a tidy table, ROME-style line plots and a heatmap.

A study costs no more than its facts one by one, and less where they run together: the
known-fact check is read off the clean run each planner starts with (an unknown fact costs
that one forward and nothing more), a commit costs milliseconds, and facts in flight share
packed traces and the unembedding pass, or the server's steps (``bench/study.py`` measures the ratio).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._backends._contract import hints_of
from .._cells import Base, Cell, Metric
from .._checks import whole_number
from .._declare import Experiment, text
from .._engine import Chain, EngineError, Plan
from .._models import PipatchError
from .._protocols._inputs import answer_ids, encode, library_versions, subject_positions
from .._protocols.dataset import named_groups, position_axis, prompt_groups
from .._registry import experiment as experiment_named
from .._result import Result
from ._aggregate import METRICS, fact_values, summarise
from ._facts import Fact, read_facts
from ._store import SCHEMA, Store, StoredFact

__all__ = ["study", "load_study", "Study", "known_fact", "model_fingerprint"]

#: ``progress(index, record, result)``: called after each fact (``result`` ``None`` when it did
#: not run: filtered, malformed, failed, or finished in an earlier run).
Progress = Callable[[int, dict, Result | None], None]


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def study(model: Any, facts: Any, experiment: str | Experiment = "trace", *, store: str | os.PathLike,
          known_only: bool = True, columns: Mapping[str, str] | None = None, progress: Progress | None = None,
          limit: int | None = None, stop: Any = None, show: bool = False, in_flight: int | None = None,
          **options: Any) -> Study:
    """Run ``experiment`` on every fact of ``facts`` into the SQLite file ``store``; return the :class:`Study`.

    Parameters
    ----------
    model
        A loaded model (:func:`pipatch.load_model`), or anything ``load_model`` takes.
    facts
        A path (ROME's ``known_1000.json``, ``.jsonl``, ``.csv``, ``.parquet``), a list of
        dicts, a pandas DataFrame or a ``datasets.Dataset``. Fields: ``prompt``, ``subject``,
        ``attribute`` (answer ``" " + attribute``) or ``answer``; ``clean``, ``corrupt``,
        ``answer``, ``foil`` for pair experiments; ``relation_id`` and ``known_id`` if any.
    experiment
        ``"trace"`` (default), ``"patch"``, ``"attribute"``, ``"path_patch"``, ``"lens"``, or
        any registered experiment.
    store
        The study's SQLite file; created if missing, resumed if it holds this study.
    known_only
        Run only the facts the model knows (its top-1 next token is the answer's first token).
    columns
        Other names for the fields: ``{"prompt": "text", "attribute": "target"}``.
    progress
        ``progress(index, record, result_or_None)`` after each fact (a widget's hook).
    limit
        Read only the first ``limit`` records.
    stop
        A ``threading.Event`` or function: when set, the study stops (the facts in flight
        stop after their batch and are not stored).
    show
        Show the live view in the notebook (:mod:`._view`): the aggregate grid re-drawn as
        facts finish, done / known / total, facts per minute, time left, Stop, and a fact
        list that draws one fact's own grid; its saved copy renders without a kernel.
    in_flight
        How many facts run at once (a kill loses at most these). ``None``: the backend's
        choice. In this process (transformers: 4) they run as one, their metrics in one pass
        over the unembedding, and commit together; fact ``i`` always runs with the others of
        ``i // in_flight``, so a resumed run repeats its bits. On a served model (4) each
        runs from a thread of its own and commits as it ends, its result the same whichever
        facts run beside it. ``1``: one by one, each its single trace bit for bit. vLLM in
        process: 1.
    **options
        The experiment's own options (``seeds=``, ``sites=``, ``site=``, ...), checked by its
        declaration; a per-prompt one (``foil=" Rome"``) given here holds for every fact.

    Examples
    --------
    >>> s = pipatch.study(model, "known_1000.json", store="known.sqlite", sites="resid,mlp,attn")
    >>> s                      # <pipatch.Study trace: 412 of 1,209 known, 412 done ...>
    >>> s.aggregate()          # mean recovery and raw effect by kind × layer × named group, 95 % CI
    >>> s.plot(); s[3].plot()  # ROME's line plots; one fact's own grid
    """
    from .._api import backend_of, plan

    entry = experiment_named(experiment) if isinstance(experiment, str) else experiment
    bound, given = _options(entry, options)
    backend = backend_of(model)
    meta = backend.meta()
    config = {
        "schema": SCHEMA, "experiment": entry.name, "model": meta.get("model"), "model_path": meta.get("model_path"),
        "model_fingerprint": model_fingerprint(meta.get("model_path")), "family": meta.get("family"),
        "backend": meta.get("backend"), "dtype": meta.get("dtype"), "known_only": bool(known_only),
        "pipatch_version": library_versions().get("pipatch"),
        **{f"options.{k}": _canonical(v) for k, v in sorted(bound.items())},
    }
    width, together = _in_flight(backend, in_flight)
    target, view = Store(store), None
    try:
        target.check_config(config)
        records = read_facts(facts, entry, columns=columns, given=given)
        if limit is not None:
            records = records[: int(limit)]
        stored = target.keys()
        for fact in records:
            if fact.index in stored and stored[fact.index][0] != fact.key:
                raise PipatchError(f"the store {str(target.path)!r} holds another {fact.name} than the one given "
                                   "(the facts changed): give a new store path, or the facts it was made from")
        target.set_info("n_facts", len(records))
        if show:
            from ._view import StudyView

            view = StudyView(lambda: Study(target.path), len(records))
            view.display()
            progress, stop = _both(view.progress, progress), _either(stop, view.stop)
        _each_fact(records, stored, lambda facts, halt: _run_facts(target, entry, backend, plan, facts, bound,
                                                                   known_only, halt), progress, stop, width, together)
    finally:
        target.close()
        if view is not None:
            view.finish(show=True)
    return Study(store)


def _in_flight(backend: Any, asked: int | None) -> tuple[int, int]:
    """How many facts run at once, as ``(threads, facts run as one by each)``: the backend's
    hint, or ``asked`` up to it. A served model batches what several threads send it
    (``plans_in_flight``); a model in this process runs one trace at a time (threads would
    only queue, or collide), but several facts may run as one :class:`~pipatch._engine.Chain`
    (``plans_together``)."""
    hints = hints_of(backend)
    threads = hints.plans_in_flight > 1
    most = hints.plans_in_flight if threads else hints.plans_together
    if asked is not None:
        asked = whole_number(asked, "in_flight (facts run at once)", minimum=1)
        if asked > most:
            raise PipatchError(f"in_flight={asked}: the {backend.backend_name} backend runs {most} fact"
                               f"{'s' if most > 1 else ''} at a time at most: leave in_flight out, or give "
                               f"{'1' if most == 1 else f'1 to {most}'}")
    n = most if asked is None else asked
    return (n, 1) if threads else (1, n)


def _each_fact(records: list[Fact], stored: dict[int, tuple[str, str]],
               run: Callable[[list[Fact], Any], list[Result | None]], progress: Progress | None, stop: Any,
               width: int, together: int = 1) -> None:
    """``run(facts, stop)`` for the records not finished in an earlier run (an error is tried
    again), telling ``progress`` of each in this thread as it finishes.

    ``together`` above 1: the facts run in runs of that many, by their place in the records
    (fact ``i`` with the others of ``i // together``, whatever finished before: a resumed run
    gives each the same company, so the same bits), one after another. Else one by one:
    ``width`` 1, in order; above it, on threads of their own (each commits its own
    transaction as it ends), where an interrupt or failure here stops those in flight after
    their current batch (they are not stored) before it propagates."""
    todo = []
    for fact in records:
        if stored.get(fact.index, (None, None))[1] in ("done", "unknown"):
            _tell(progress, fact, None)
        else:
            todo.append(fact)
    if width == 1:
        runs: dict[int, list[Fact]] = {}
        for fact in todo:
            runs.setdefault(fact.index // together, []).append(fact)
        for facts in runs.values():
            if _stopped(stop):
                break
            for fact, result in zip(facts, run(facts, stop)):
                _tell(progress, fact, result)
        return
    halt = threading.Event()
    halted = _either(stop, halt)
    running: dict[concurrent.futures.Future, Fact] = {}

    def finish_one() -> None:
        done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            _tell(progress, running.pop(future), future.result())

    with concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="pipatch-fact") as pool:
        try:
            for fact in todo:
                while len(running) >= width:
                    finish_one()
                if _stopped(stop):
                    break
                running[pool.submit(lambda fact: run([fact], halted)[0], fact)] = fact
            while running:
                finish_one()
        except BaseException:
            halt.set()  # the pool's exit waits for the facts in flight, which stop after their batch
            raise


def _run_facts(target: Store, entry: Experiment, backend: Any, plan: Callable, facts: list[Fact],
               bound: dict[str, Any], known_only: bool, stop: Any) -> list[Result | None]:
    """Check, run and commit ``facts``; per fact its result, ``None`` unless it ran to the end.

    Each fact is planned exactly as ``pipatch.<experiment>(model, **its inputs)`` would plan
    it alone (same planner, same engine, the fast paths as the options say). The known-fact
    check rides on the planner's own clean run (:class:`_KnownCheck`): no extra forward for a
    known fact, and an unknown one stops at that run (and is committed as such at once). A
    known fact alone runs as that single run, so its stored result equals it bit for bit.
    Several run as one :class:`~pipatch._engine.Chain` where the backend gains by it (the
    transformers backend: their cells in packed traces together, their metrics in one pass over
    the unembedding), their single
    runs' values up to float32 rounding, and committed in one transaction, all or none.
    """
    ready: list[tuple[Fact, Any, bool | None, str, float]] = []
    for fact in facts:
        started = time.perf_counter()
        planned = _plan_fact(target, entry, backend, plan, fact, bound, known_only)
        if planned is not None:
            ready.append((fact, *planned, time.perf_counter() - started))
    out: dict[int, Result | None] = {}  # by the fact's index
    chained = len(ready) > 1 and all(type(p).run is Plan.run for _, p, _, _, _ in ready)
    groups = [ready] if chained else [[one] for one in ready]
    for group in groups:
        started = time.perf_counter()
        try:
            results = (Chain([p for _, p, _, _, _ in group]).run(stop=stop) if chained
                       else [group[0][1].run(stop=stop)])
            if any(result.status != "done" for result in results):  # stopped: not stored, run again next time
                continue
            rows = [(fact, "done", {"result": result, "known": known, "top1": top1,
                                    "groups": _groups(backend, fact_plan, result, fact),
                                    "seconds": planning + (time.perf_counter() - started) / len(group)})
                    for (fact, fact_plan, known, top1, planning), result in zip(group, results)]
        except (PipatchError, EngineError) as error:
            target.put_many([(fact, "error", {"message": _failure(fact, error)}) for fact, *_ in group])
            continue
        target.put_many(rows)
        out.update({fact.index: result for (fact, *_), result in zip(group, results)})
    return [out.get(fact.index) for fact in facts]


def _plan_fact(target: Store, entry: Experiment, backend: Any, plan: Callable, fact: Fact, bound: dict[str, Any],
               known_only: bool) -> tuple[Any, bool | None, str] | None:
    """One fact's plan, whether the model knows it and its top-1 token; ``None`` where it does
    not run (malformed, unknown with ``known_only``, refused by its planner), committed so."""
    if fact.error is not None:
        target.put(fact, "error", message=fact.error)
        return None
    inputs = {**bound, **fact.inputs}
    prompt, answer = inputs[entry.prompts.fields[0]], inputs.get("answer")
    try:
        first = None if answer is None else answer_ids(backend, answer, "answer")[0]
        checked = _KnownCheck(backend, first, stop_unknown=known_only)
        try:
            fact_plan = plan(entry, checked, **inputs)
        except _Unknown as unknown:
            target.put(fact, "unknown", known=False, top1=backend.decode([unknown.top1])[0])
            return None
        if checked.top1 is None:  # the planner read no logits (a logit difference): one forward more
            known, top1 = known_fact(backend, prompt, answer)
        else:
            known, top1 = (None if first is None else checked.top1 == first), backend.decode([checked.top1])[0]
    except (PipatchError, EngineError) as error:
        target.put(fact, "error", message=_failure(fact, error))
        return None
    if known_only and known is False:
        target.put(fact, "unknown", known=False, top1=top1)
        return None
    return fact_plan, known, top1


def _failure(fact: Fact, error: Exception) -> str:
    """The one line a fact that failed is stored with: its name, and what its planner refused
    or which batch failed."""
    return f"{fact.name}: " + (f"the run failed: {error}" if isinstance(error, EngineError) else str(error))


class _Unknown(Exception):
    """Raised out of a planner by :class:`_KnownCheck`: the clean run's top-1 is not the answer."""

    def __init__(self, top1: int):
        super().__init__(top1)
        self.top1 = top1


class _KnownCheck:
    """The backend as one fact's planner sees it: its first capture, the clean run every
    planner starts with, is also ROME's known-fact check.

    Everything is the backend's own (attributes are looked up on it), so the plan and its
    result are what the planner makes on the backend itself. The first capture's ``top1``
    (the model's top next token after the clean prompt, where the backend read the logits) is
    kept in :attr:`top1`; with ``stop_unknown`` a top-1 other than ``first`` (the answer's
    first token) raises :class:`_Unknown` there, before the corrupted runs.
    """

    def __init__(self, backend: Any, first: int | None, *, stop_unknown: bool):
        self._backend, self._first, self._stop_unknown = backend, first, stop_unknown
        self._seen = False
        self.top1: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def capture(self, input_ids: torch.Tensor, metric: Metric, sites: Sequence[Any] = (), *, ops: Any = None) -> Any:
        run = self._backend.capture(input_ids, metric, sites, ops=ops)
        self._check(run if ops is None else None)
        return run

    def captures(self, prompts: Sequence[torch.Tensor], metric: Metric, sites: Sequence[Any] = ()) -> Any:
        runs = self._backend.captures(prompts, metric, sites)
        self._check(runs[0])  # the clean prompt comes first
        return runs

    def _check(self, run: Any) -> None:
        if self._seen:
            return
        self._seen = True
        if run is None or getattr(run, "top1", None) is None:
            return
        self.top1 = int(run.top1[0])
        if self._stop_unknown and self._first is not None and self.top1 != self._first:
            raise _Unknown(self.top1)


def known_fact(backend: Any, prompt: str, answer: str | None) -> tuple[bool | None, str]:
    """ROME's rule: whether the model's top-1 next token after ``prompt`` is the first token of
    ``answer``, and that top-1 token's text (``None``, unknown, without an answer).

    One forward, which reads the top-1 off the logits where the backend reports it
    (``Capture.top1``); elsewhere it reads the answer's rank (0: no token above it), and a
    fact it fails costs a second, which reads every logit for the top-1's text. A study calls
    this only when the experiment's own clean run read no logits (:class:`_KnownCheck`).
    """
    ids, _, _ = encode(backend, prompt)
    first = 0 if answer is None else answer_ids(backend, answer, "answer")[0]
    capture = backend.capture(ids, Metric("prob", (first,)))
    if getattr(capture, "top1", None) is not None:
        top = int(capture.top1[0])
        return (None if answer is None else top == first), backend.decode([top])[0]
    metric = Metric("rank", (first,))
    capture = backend.capture(ids, metric)
    if answer is not None and float(capture.metric[0]) == 0:
        return True, backend.decode([first])[0]
    logits, _ = backend.run(Base(ids, capture), [Cell(0, 0, 0, start=0)], metric, fast=False, full_logits=True)
    top = int(logits.float().reshape(-1, logits.shape[-1])[0].argmax())
    return (None if answer is None else top == first), backend.decode([top])[0]


def _groups(backend: Any, fact_plan: Any, result: Result, fact: Fact) -> dict[str, Any] | None:
    """The fact's named position groups (names and the result columns in each), or ``None``
    for a grid whose columns are not positions (heads, senders). An experiment that takes no
    subject (the lens) is grouped around the record's subject."""
    if not position_axis(fact_plan):
        return None
    if "subject_positions" not in result.meta and "clean_tokens" not in result.meta:
        if fact.subject is None:
            return {"names": ["last"], "columns": [[len(result.columns) - 1]]}
        prompt = result.meta.get("prompt") or ""
        ids, tokens, offsets = encode(backend, prompt)
        span = subject_positions(fact.subject, prompt, tokens, offsets)
        names, positions = named_groups(span, len(tokens))
        return {"names": names, "columns": [[p for p in group if p < len(result.columns)] for group in positions]}
    names, _, columns = prompt_groups(result)
    return {"names": names, "columns": columns}


def _options(entry: Experiment, options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The experiment's options, checked by its declaration and with its defaults filled in
    (the per-fact fields left out), and the per-prompt ones given for every fact."""
    fields = set(entry.prompts.fields)
    clash = sorted(fields & set(options))
    if clash:
        raise PipatchError(f"{', '.join(clash)} come from the facts, one per record: drop {clash[0]}= (columns= "
                           "maps a field of another name)")
    per_fact = [p.keyword for p in entry.params if p.per_prompt]
    placeholders = {**{f: "" for f in fields}, **{k: None for k in per_fact if k not in options}}
    bound = entry.bind({**placeholders, **options})
    for param in entry.params:  # a number given in Python is checked as its flag's text would be
        value = bound[param.keyword]
        if param.keyword in options and param.parse is not text and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            try:
                param.parse(str(value))
            except PipatchError as error:
                raise PipatchError(f"{param.keyword}={value!r}: {error}") from None
    given = [k for k in per_fact if k in options]
    return {k: v for k, v in bound.items() if k not in placeholders}, given


def model_fingerprint(path: Any) -> str | None:
    """A digest of a local model folder (or file): each weight and config file's name and size,
    and its first and last MiB. Cheap (no full read of the weights) yet changed by any rebuild
    of the checkpoint; ``None`` for a hub id without a local folder."""
    if not path:
        return None
    root = Path(str(path))
    if not root.exists():
        return None
    files = [root] if root.is_file() else sorted(
        p for p in root.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin", ".gguf", ".model"))
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(1 << 20))
            if size > 2 << 20:
                handle.seek(-(1 << 20), os.SEEK_END)
                digest.update(handle.read())
    return digest.hexdigest()[:16]


def _canonical(value: Any) -> Any:
    """An option as the stored configuration records it: one spelling per meaning, so a resume
    is not refused for spelling. A list of names and its comma-separated text are one value
    (``["resid", "mlp"]``, ``"resid, mlp"`` → ``"resid,mlp"``: what the flag would say); any
    other tuple is a list (JSON's)."""
    if isinstance(value, str) and "," in value:
        return ",".join(part.strip() for part in value.split(","))
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return ",".join(v.strip() for v in value)
    return list(value) if isinstance(value, tuple) else value


def _stopped(stop: Any) -> bool:
    if stop is None:
        return False
    return bool(stop.is_set() if hasattr(stop, "is_set") else stop())


def _both(first: Progress, second: Progress | None) -> Progress:
    def both(index: int, record: dict, result: Result | None) -> None:
        first(index, record, result)
        if second is not None:
            second(index, record, result)
    return both


def _either(first: Any, second: Any) -> Callable[[], bool]:
    return lambda: _stopped(first) or _stopped(second)


def _tell(progress: Progress | None, fact: Fact, result: Result | None) -> None:
    if progress is not None:
        progress(fact.index, fact.record, result)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def load_study(path: str | os.PathLike) -> Study:
    """The study in the store at ``path``, finished or not; no model needed."""
    return Study(path)


class Study:
    """A study's store, read: its facts, their results, and averages over them.

    ``study[i]`` (or ``study.result(i)``) is fact ``i``'s own :class:`~pipatch.Result` (``i``
    its index in the input). Each call reads the store afresh, so a study another process is
    still running shows its progress.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        Store(self.path, create=False).close()  # one line now for a path that is not a store
        self._cache: tuple[Any, list[tuple[StoredFact, dict]]] | None = None

    # -- the store ---------------------------------------------------------------------------
    def _store(self) -> Store:
        return Store(self.path, create=False)

    @property
    def config(self) -> dict[str, Any]:
        """The configuration the study was made with (model, experiment, options, ...)."""
        store = self._store()
        try:
            return store.config()
        finally:
            store.close()

    @property
    def options(self) -> dict[str, Any]:
        return {k[len("options."):]: v for k, v in self.config.items() if k.startswith("options.")}

    @property
    def experiment(self) -> str:
        return str(self.config.get("experiment", "?"))

    def facts(self) -> list[StoredFact]:
        """Every stored fact's row: ``idx``, ``fact_id``, ``relation``, ``status`` (``done``,
        ``unknown``, ``error``), ``known``, ``top1``, ``message``, ``record``, ``seconds``."""
        store = self._store()
        try:
            return list(store.facts())
        finally:
            store.close()

    def counts(self) -> dict[str, int]:
        """How many facts were read (``total``) and how many are ``done``, ``unknown``,
        ``error`` and ``pending``."""
        store = self._store()
        try:
            counts = {"done": 0, "unknown": 0, "error": 0}
            for _, status in store.keys().values():
                counts[status] += 1
            total = int(store.info().get("n_facts", sum(counts.values())))
        finally:
            store.close()
        checked = counts["done"] + counts["unknown"]
        return {"total": total, **counts, "pending": max(total - sum(counts.values()), 0), "checked": checked}

    def summary(self) -> str:
        """One line: ``trace study on gemma-3-270m: 412 of 1,209 known; 412 done, 0 errors, 0 pending``."""
        c, config, rows = self.counts(), self.config, self.facts()
        known = sum(1 for row in rows if row["known"] == 1)
        unchecked = c["total"] - sum(1 for row in rows if row["known"] is not None)
        checked = f"{known:,} of {c['total']:,} known" + (f" ({unchecked:,} not checked)" if unchecked else "")
        return (f"{config.get('experiment')} study on {config.get('model')}: {checked}; {c['done']:,} done, "
                f"{c['error']:,} error{'s' if c['error'] != 1 else ''}, {c['pending']:,} pending")

    def __repr__(self) -> str:
        return f"<pipatch.Study {self.path.name}: {self.summary()}>"

    def __len__(self) -> int:
        return self.counts()["done"]

    def result(self, index: int) -> Result:
        """Fact ``index``'s own Result (drawn, saved, compared like any other)."""
        store = self._store()
        try:
            row = store.fact(index)
        finally:
            store.close()
        if row is None:
            raise PipatchError(f"fact {index} is not in the store (yet): the study has not run it")
        return row.result()

    def __getitem__(self, index: int) -> Result:
        return self.result(index)

    def results(self) -> list[tuple[StoredFact, Result]]:
        """Every finished fact's row and Result, in order."""
        return [(row, row.result()) for row in self.facts() if row["status"] == "done"]

    # -- values ------------------------------------------------------------------------------
    def _values(self) -> list[tuple[StoredFact, dict]]:
        """Each finished fact with its values by metric and view ([layers, groups]); cached
        while the store holds the same finished facts."""
        import json

        rows = [row for row in self.facts() if row["status"] == "done"]
        stamp = tuple((row["idx"], row["finished"]) for row in rows)
        if self._cache is None or self._cache[0] != stamp:
            out = []
            for row in rows:
                groups = json.loads(row["groups"]) if row["groups"] else None
                values = fact_values(row.result(), groups["columns"] if groups else None)
                out.append((row, {"values": values, "groups": groups}))
            self._cache = (stamp, out)
        return self._cache[1]

    def _axes(self, values: list[tuple[StoredFact, dict]]) -> tuple[list[str], list[str], list[str]]:
        """The views, layers and group names the finished facts share."""
        if not values:
            raise PipatchError(f"the study in {str(self.path)!r} has no finished fact yet: run pipatch.study(...) first")
        row, first = values[0]
        result = row.result()
        names = first["groups"]["names"] if first["groups"] else list(result.columns)
        for other, item in values[1:]:
            theirs = item["groups"]["names"] if item["groups"] else None
            if theirs is not None and theirs != names or theirs is None and np.shape(
                    item["values"]["recovery"][result.views[0]])[-1] != len(names):
                raise PipatchError(f"fact {other['idx']}'s columns differ from fact {row['idx']}'s: a study averages "
                                   "grids of one shape (named positions, or the same heads)")
        return list(result.views), list(result.layers), names

    def grid(self, view: str | None = None, metric: str = "recovery", relation: str | None = None) -> torch.Tensor:
        """The mean over facts, tensor[layers, groups], of ``metric`` (``recovery`` or
        ``raw_effect``) in ``view`` (default the first kind); ``relation`` keeps one relation's facts."""
        values = self._select(relation)
        views, _, _ = self._axes(values)
        view = views[0] if view is None else _check(view, views, "kind")
        _check(metric, METRICS, "metric")
        stacked = np.stack([item["values"][metric][view] for _, item in values])
        return torch.from_numpy(summarise(stacked)["mean"]).float()

    def _select(self, relation: str | None) -> list[tuple[StoredFact, dict]]:
        values = self._values()
        if relation is None:
            return values
        chosen = [v for v in values if v[0]["relation"] == relation]
        if not chosen:
            raise PipatchError(f"no finished fact has relation {relation!r}: see study.aggregate(by='relation_id')")
        return chosen

    def aggregate(self, by: str | None = None) -> Any:
        """A pandas DataFrame of the averages: one row per ([relation,] kind, layer, group,
        metric) with ``mean``, ``low`` and ``high`` (the 95 % Student-t interval over facts),
        ``sd`` and ``n`` (facts). ``by="relation_id"`` breaks it down by relation."""
        import pandas as pd

        if by not in (None, "relation_id", "relation"):
            raise PipatchError(f"aggregate(by={by!r}): only by='relation_id' is recorded")
        values = self._values()
        views, layers, names = self._axes(values)
        parts = [(None, values)] if by is None else [
            (relation, [v for v in values if v[0]["relation"] == relation])
            for relation in dict.fromkeys(v[0]["relation"] for v in values)]
        rows = []
        for relation, chosen in parts:
            for metric in METRICS:
                for view in views:
                    stats = summarise(np.stack([item["values"][metric][view] for _, item in chosen]))
                    for layer in range(len(layers)):
                        for g, name in enumerate(names):
                            row = {"kind": view, "layer": int(layers[layer]) if layers[layer].isdigit() else layers[layer],
                                   "group": name, "metric": metric, "mean": float(stats["mean"][layer, g]),
                                   "low": float(stats["low"][layer, g]), "high": float(stats["high"][layer, g]),
                                   "sd": float(stats["sd"][layer, g]), "n": int(stats["n"][layer, g])}
                            rows.append(row if by is None else {"relation_id": relation, **row})
        return pd.DataFrame(rows)

    def frame(self) -> Any:
        """The tidy table: one row per (fact, relation, kind, layer, group, metric) with its
        ``value`` (the fact's mean over seeds), plus ``fact_id`` and ``subject``."""
        import pandas as pd

        values = self._values()
        views, layers, names = self._axes(values)
        rows = []
        for row, item in values:
            record = _record(row)
            for metric in METRICS:
                for view in views:
                    array = item["values"][metric][view]
                    for layer in range(len(layers)):
                        for g, name in enumerate(names):
                            rows.append({"fact": row["idx"], "fact_id": row["fact_id"], "relation": row["relation"],
                                         "subject": record.get("subject"), "kind": view, "layer": layer,
                                         "group": name, "metric": metric, "value": float(array[layer, g])})
        return pd.DataFrame(rows, columns=["fact", "fact_id", "relation", "subject", "kind", "layer", "group",
                                           "metric", "value"])

    def to_csv(self, path: str | os.PathLike) -> Path:
        """:meth:`frame` as CSV."""
        self.frame().to_csv(path, index=False)
        return Path(path)

    def to_parquet(self, path: str | os.PathLike) -> Path:
        """:meth:`frame` as Parquet (needs pyarrow)."""
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise PipatchError("to_parquet needs pyarrow: pip install pyarrow (or use study.to_csv)") from None
        self.frame().to_parquet(path, index=False)
        return Path(path)

    # -- pictures ----------------------------------------------------------------------------
    def as_result(self, metric: str = "recovery", relation: str | None = None) -> Result:
        """The average as a :class:`~pipatch.Result` whose seed axis is the facts: its grid is
        :meth:`grid`, each fact one row of ``per_seed``. What :meth:`heatmap` draws, and what a
        ``PatchGrid`` can show."""
        values = self._select(relation)
        views, layers, names = self._axes(values)
        _check(metric, METRICS, "metric")
        raw = {view: torch.from_numpy(np.stack([item["values"][metric][view] for _, item in values])).float()
               for view in views}
        config = self.config
        labels = [f"fact {row['idx']}" + (f" ({row['fact_id']})" if row["fact_id"] is not None else "")
                  for row, _ in values]
        meta = {"model": config.get("model"), "normalize": False, "study": str(self.path), "prompts": labels,
                "rows_per_prompt": [1] * len(labels), "col_axis": "token" if values[0][1]["groups"] else "column",
                "experiment": config.get("experiment")}
        return Result(kind="study", tokens=list(names), columns=list(names), layers=list(layers),
                      metric=f"mean {metric.replace('_', ' ')}", raw=raw, clean=0.0, corrupt=torch.zeros(len(labels)),
                      meta=meta)

    def heatmap(self, view: str | None = None, metric: str = "recovery", relation: str | None = None, *,
                ax=None, pyplot: bool = False):
        """The average as pipatch's heatmap (layers × named groups; its colour map), a matplotlib figure."""
        from .._views import figure

        result = self.as_result(metric, relation)
        state = result.to_state()
        state["title"] = f"{self.summary()}"
        return figure(state, view, ax=ax, pyplot=pyplot)

    def plot(self, groups: Sequence[str] = ("last subject", "last"), metric: str = "recovery",
             relation: str | None = None, *, pyplot: bool = False):
        """ROME's line plots: the effect per layer at each of ``groups`` (default the last
        subject token and the last token), one line per kind with its 95 % interval as a band."""
        from .._views import DIVERGING_STOPS
        from .._views.render import tick_text

        values = self._select(relation)
        views, layers, names = self._axes(values)
        _check(metric, METRICS, "metric")
        for group in groups:
            _check(group, names, "group")
        if pyplot:
            import matplotlib.pyplot as plt

            fig = plt.figure(figsize=(4.2 * len(groups), 3.4))
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=(4.2 * len(groups), 3.4))
            FigureCanvasAgg(fig)
        colours = [DIVERGING_STOPS[i] for i in (9, 1, 7, 3, 10, 0)]
        x = np.arange(len(layers))
        axes = fig.subplots(1, len(groups), squeeze=False)[0]
        for ax, group in zip(axes, groups):
            g = names.index(group)
            for k, view in enumerate(views):
                stats = summarise(np.stack([item["values"][metric][view] for _, item in values]))
                colour = colours[k % len(colours)]
                ax.plot(x, stats["mean"][:, g], color=colour, label=tick_text(view, 20))
                ax.fill_between(x, stats["low"][:, g], stats["high"][:, g], color=colour, alpha=0.2, linewidth=0)
            ax.axhline(0, color="#bdbdbd", linewidth=0.8)
            ax.set_title(tick_text(group, 30), fontsize=9)
            ax.set_xlabel("layer")
            ax.set_ylabel(tick_text(metric.replace("_", " "), 30))
            ax.legend(fontsize=8)
        fig.suptitle(tick_text(self.summary(), 110) + " · 95 % t interval over facts", fontsize=8)
        fig.tight_layout()
        return fig

    def _repr_mimebundle_(self, include=None, exclude=None):  # a hook for the live view to come
        return {"text/plain": repr(self)}


def _record(row: StoredFact) -> dict[str, Any]:
    import json

    try:
        return json.loads(row["record"])
    except (TypeError, ValueError):
        return {}


def _check(value: str, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise PipatchError(f"unknown {what} {value!r}: this study has {', '.join(map(str, choices))}")
    return value

