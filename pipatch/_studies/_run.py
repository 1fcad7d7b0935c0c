"""Running a study: each fact checked, planned, run and committed, so that a rerun resumes.

ROME's ``causal_trace.py`` loops over ``known_1000.json``, skips the facts the model gets
wrong, writes one result file per fact so a rerun resumes, and plots averages by token group.
:func:`study` does the same with pipatch's experiments:

1. the options are checked by the experiment's declaration, and the study's configuration
   (model and its fingerprint, backend, dtype, experiment, each option in one spelling,
   ``known_only``, pipatch's version) is compared with the store's: a new store records
   it, a store of this study resumes, a store of any other is refused;
2. the facts are read as they come (:mod:`._facts`): ROME's JSON, JSONL, CSV, a DataFrame,
   a ``datasets.Dataset``, a list of dicts. Those an earlier run finished (``done`` or
   ``unknown``) are skipped; one that failed is tried again;
3. each fact is checked against ROME's **known-fact rule** (:mod:`._known`): the model's
   top-1 next token after the prompt must be the first token of the answer. The check rides
   on the clean run each planner starts with, so an unknown fact costs that one forward and
   nothing more. Facts that fail are kept in the store with the model's actual top-1, and
   (``known_only=True``, the default) not run;
4. each known fact is planned by the experiment's own planner, exactly as
   ``pipatch.trace(model, prompt, ...)`` would plan it alone, runs through the engine, and is
   committed to the store (:mod:`._store`, SQLite WAL, one transaction) before the next
   starts. :class:`~pipatch.Study` (:mod:`._read`) reads the store back.

**One noise scale.** A trace's recovery is measured against its corrupted run, so averaging
facts corrupted at 1σ with facts at 2σ mixes two quantities. As in ROME (one fixed multiple of
σ for every fact), a study traces every fact at one scale: the ``scale=`` given, or, with
``scale="auto"`` (the default), the scale auto picks on the first fact that runs (the first
known one), recorded in the store (:attr:`Study.noise_scale <pipatch.Study.noise_scale>`) and
given to every later fact, in this run and in a resumed one.

**Facts in flight.** With ``in_flight=1`` the facts run one by one, each its single trace,
bit for bit, fast paths and all. By default several are in flight at once, as the backend
gains by it (its hints, :func:`_in_flight`):

* in this process (``plans_together``; the transformers backend: 4) they run as one
  :class:`~pipatch._engine.Chain`, their cells in packed traces together and their metrics
  in one pass over the unembedding, committed together. Their values are their single
  traces' up to float32 rounding (≤ 1e-5 in probability on Gemma); fact ``i`` always runs
  with the others of ``i // in_flight``, so a resumed run gives each fact the same company,
  so the same bits;
* on a served model (``plans_in_flight``: 4) each runs from a thread of its own and commits
  as it ends, so the server batches their requests; a fact's result is the same whichever
  facts run beside it.

A study costs no more than its facts one by one, and less where they run together: facts in
flight share packed traces and the unembedding pass, or the server's steps, and a commit is
one small transaction. ``bench/study.py`` measures the ratio (the README's benchmark table).

**How it fails.** Before any fact runs, in one :class:`~pipatch.PipatchError` line: an
option the experiment's declaration refuses, or a per-fact field given as an option;
``in_flight`` outside what the backend runs at once; facts that cannot be read; a store of
another configuration, or made from other facts (another fact at an index it holds). Once
facts run, one fact's failure does not stop the study: a malformed record, a fact its
planner refuses, or a failed batch is stored as ``error`` with one line naming the fact
(facts run as one chain fail together: all or none is stored) and is tried again next
time. A stop (``stop=``, the live view's Stop) ends the study after the facts in flight
finish their batch; those are not stored and run next time. A killed process loses at most
the facts in flight (the store survives a SIGKILL). An interrupt or error in the calling
thread while facts run on threads stops them after their batch, then propagates.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._base.checks import whole_number
from .._base.progress import bar
from .._engine import Chain, EngineError, Plan
from .._experiments._inputs import answer_ids, encode, library_versions, subject_positions
from .._experiments._registry import experiment as experiment_named
from .._experiments.dataset import named_groups, position_axis, prompt_groups
from .._model.declare import Experiment, text
from .._model.models import PipatchError
from .._results.result import Result
from ._facts import Fact, read_facts
from ._known import KnownCheck, UnknownFact, known_fact
from ._read import Study
from ._store import SCHEMA, Store

__all__ = ["study", "model_fingerprint"]

#: ``progress(index, record, result)``: called after each fact (``result`` ``None`` when it did
#: not run: filtered, malformed, failed, or finished in an earlier run).
Progress = Callable[[int, dict, Result | None], None]


def study(model: Any, facts: Any, experiment: str | Experiment = "trace", *, store: str | os.PathLike,
          known_only: bool = True, columns: Mapping[str, str] | None = None, progress: bool | Progress = True,
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
        Show a progress bar of the facts on stderr (a widget in a notebook; none with ``show``,
        whose view is the progress); ``False``: none. A function instead is called as
        ``progress(index, record, result_or_None)`` after each fact (a widget's hook), and no
        bar is drawn.
    limit
        Stop once ``limit`` facts have a result: with ``known_only``, ``limit`` facts the model
        knows (those it does not know, and facts that fail, do not count). The facts are read
        in order until then, or until they end; facts finished by an earlier run count. The
        store's total is then the records read. ``None`` (default): every fact.
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
        declaration; a per-prompt one (``foil=" Rome"``) given here holds for every fact. A
        trace's ``scale="auto"`` (its default) is picked once, on the first fact that runs, and
        every fact is traced at it (:attr:`Study.noise_scale <pipatch.Study.noise_scale>`).

    Raises
    ------
    PipatchError
        Before any fact runs, in one line: an option the experiment refuses, ``in_flight``
        out of range, facts that cannot be read, a store of another study. One fact's own
        failure is stored as its ``error`` and the study goes on (see the module docstring).

    Examples
    --------
    >>> s = pipatch.study(model, "known_1000.json", store="known.sqlite", sites="resid,mlp,attn")
    >>> s                      # <pipatch.Study trace: 412 of 1,209 known, 412 done ...>
    >>> s.aggregate()          # mean recovery and raw effect by kind × layer × named group, 95 % CI
    >>> s.plot(); s[3].plot()  # ROME's line plots; one fact's own grid
    """
    from .._experiments._api import backend_of, plan

    entry = experiment_named(experiment) if isinstance(experiment, str) else experiment
    bound, given = _options(entry, options)
    limit = None if limit is None else whole_number(limit, "limit (facts with a result)", minimum=1)
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
    target, view, counter = Store(store), None, None
    hook = progress if callable(progress) else None
    try:
        target.check_config(config)
        records = read_facts(facts, entry, columns=columns, given=given)
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
            hook, stop = _both(view.progress, hook), _either(stop, view.stop)
        elif progress and hook is None:
            counter, hook = _bar(entry.name, len(records), limit, stored)
        noise = _NoiseScale(target) if bound.get("scale") == "auto" else None
        read = _each_fact(records, stored, lambda facts, halt, room=None: _run_facts(
            target, entry, backend, plan, facts, bound, known_only, halt, room, noise), hook, stop, width, together,
            limit)
        if read < len(records):
            target.set_info("n_facts", max([read, *(index + 1 for index in target.keys())]))
    finally:
        if counter is not None:
            counter.close()
        target.close()
        if view is not None:
            view.finish(show=True)
    return Study(store)


def _in_flight(backend: Any, asked: int | None) -> tuple[int, int]:
    """How many facts run at once, as ``(threads, facts run as one by each)``: the backend's
    capability, or ``asked`` up to it. A served model batches what several threads send it
    (``plans_in_flight``); a model in this process runs one trace at a time (threads would
    only queue, or collide), but several facts may run as one :class:`~pipatch._engine.Chain`
    (``plans_together``)."""
    capabilities = backend.capabilities
    threads = capabilities.plans_in_flight > 1
    most = capabilities.plans_in_flight if threads else capabilities.plans_together
    if asked is not None:
        asked = whole_number(asked, "in_flight (facts run at once)", minimum=1)
        if asked > most:
            raise PipatchError(f"in_flight={asked}: the {backend.meta()['backend']} backend runs {most} fact"
                               f"{'s' if most > 1 else ''} at a time at most: leave in_flight out, or give "
                               f"{'1' if most == 1 else f'1 to {most}'}")
    n = most if asked is None else asked
    return (n, 1) if threads else (1, n)


def _each_fact(records: list[Fact], stored: dict[int, tuple[str, str]],
               run: Callable[..., list[Result | None]], progress: Progress | None, stop: Any,
               width: int, together: int = 1, limit: int | None = None) -> int:
    """``run(facts, stop, room)`` for the records not finished in an earlier run (an error is
    tried again), telling ``progress`` of each in this thread as it finishes; the number of
    records read (all of them, unless ``limit`` was met first).

    ``limit``: stop once that many facts are ``done`` (those of an earlier run included). No
    more run than that: a run of facts is given ``room``, how many more may run, and returns
    the results of the facts it reached (a prefix: the rest stay pending); one on a thread
    starts only while the facts done and in flight are fewer than ``limit``.

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
    done = sum(1 for fact in records if stored.get(fact.index, (None, None))[1] == "done")
    last = -1  # the index of the last record reached

    def room() -> int | None:
        """How many more facts may run (``None``: no limit)."""
        return None if limit is None else max(limit - done, 0)

    def read() -> int:
        return len(records) if room() != 0 else last + 1

    if width == 1:
        runs: dict[int, list[Fact]] = {}
        for fact in todo:
            runs.setdefault(fact.index // together, []).append(fact)
        for facts in runs.values():
            if _stopped(stop) or room() == 0:
                break
            results = run(facts, stop, room())
            for fact, result in zip(facts, results):
                _tell(progress, fact, result)
                last, done = fact.index, done + (result is not None)
        return read()
    halt = threading.Event()
    halted = _either(stop, halt)
    running: dict[concurrent.futures.Future, Fact] = {}

    def finish_one() -> None:
        nonlocal done
        finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in finished:
            result = future.result()
            _tell(progress, running.pop(future), result)
            done += result is not None

    with concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="pipatch-fact") as pool:
        try:
            for fact in todo:
                while len(running) >= width or running and limit is not None and done + len(running) >= limit:
                    finish_one()
                if _stopped(stop) or room() == 0:
                    break
                running[pool.submit(lambda fact: run([fact], halted)[0], fact)] = fact
                last = fact.index
            while running:
                finish_one()
        except BaseException:
            halt.set()  # the pool's exit waits for the facts in flight, which stop after their batch
            raise
    return read()


class _NoiseScale:
    """A study's one noise scale under ``scale="auto"``: ``None`` until the first fact that runs
    has had auto pick it, then recorded in the store's info (``noise_scale``), where a resumed
    study finds it. :attr:`lock` holds facts planned on other threads back while it is picked."""

    KEY = "noise_scale"

    def __init__(self, store: Store):
        self.store = store
        self.value: float | None = store.info().get(self.KEY)
        self.lock = threading.Lock()

    def record(self, value: float) -> None:
        self.value = float(value)
        self.store.set_info(self.KEY, self.value)


def _run_facts(target: Store, entry: Experiment, backend: Any, plan: Callable, facts: list[Fact],
               bound: dict[str, Any], known_only: bool, stop: Any, room: int | None = None,
               noise: _NoiseScale | None = None) -> list[Result | None]:
    """Check, run and commit ``facts``; per fact its result, ``None`` unless it ran to the end.
    With ``room``, the facts are checked in order until ``room`` of them are to run; those
    after are not reached (the list is that shorter: they stay pending).

    Each fact is planned exactly as ``pipatch.<experiment>(model, **its inputs)`` would plan
    it alone (same planner, same engine, the fast paths as the options say). The known-fact
    check rides on the planner's own clean run (:class:`KnownCheck`): no extra forward for a
    known fact, and an unknown one stops at that run (and is committed as such at once). A
    known fact alone runs as that single run, so its stored result equals it bit for bit.
    Several run as one :class:`~pipatch._engine.Chain` where the backend gains by it (the
    transformers backend: their cells in packed traces together, their metrics in one pass over
    the unembedding), their single
    runs' values up to float32 rounding, and committed in one transaction, all or none.
    ``noise``: the study's one noise scale (:class:`_NoiseScale`), given to each fact's planner.
    """
    ready: list[tuple[Fact, Any, bool | None, str, float]] = []
    reached = 0
    for fact in facts:
        if room is not None and len(ready) >= room:
            break
        reached += 1
        started = time.perf_counter()
        planned = _plan_at_scale(target, entry, backend, plan, fact, bound, known_only, noise)
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
    return [out.get(fact.index) for fact in facts[:reached]]


def _plan_at_scale(target: Store, entry: Experiment, backend: Any, plan: Callable, fact: Fact,
                   bound: dict[str, Any], known_only: bool, noise: _NoiseScale | None) -> Any:
    """:func:`_plan_fact` at the study's one noise scale: the recorded one; until there is one,
    auto's, recorded from the first fact that runs (one fact at a time picks it)."""
    if noise is None:
        return _plan_fact(target, entry, backend, plan, fact, bound, known_only)
    if noise.value is None:
        with noise.lock:
            if noise.value is None:
                planned = _plan_fact(target, entry, backend, plan, fact, bound, known_only)
                if planned is not None:
                    noise.record(planned[0].result.meta["scale"])
                return planned
    return _plan_fact(target, entry, backend, plan, fact, {**bound, "scale": noise.value}, known_only)


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
        checked = KnownCheck(backend, first, stop_unknown=known_only)
        try:
            fact_plan = plan(entry, checked, **inputs)
        except UnknownFact as unknown:
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
        column = {p: c for c, p in enumerate(result.meta.get("positions") or range(len(result.columns)))}
        return {"names": names, "columns": [[column[p] for p in group if p in column] for group in positions]}
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


def _bar(name: str, n_records: int, limit: int | None, stored: dict[int, tuple[str, str]]) -> tuple[Any, Progress]:
    """A study's progress bar and the hook that steps it: one step per fact reached, or with
    ``limit`` one per fact with a result, out of ``limit`` (those of an earlier run counted
    at once): the facts a limited study reaches are not known before it runs."""
    if limit is None:
        counter = bar(n_records, f"study {name}", unit="facts")
        return counter, lambda index, record, result: counter.update(1)
    counter = bar(limit, f"study {name}", unit="facts with a result")
    counter.update(min(limit, sum(1 for _, status in stored.values() if status == "done")))
    return counter, lambda index, record, result: counter.update(int(result is not None and counter.n < limit))


def _either(first: Any, second: Any) -> Callable[[], bool]:
    return lambda: _stopped(first) or _stopped(second)


def _tell(progress: Progress | None, fact: Fact, result: Result | None) -> None:
    if progress is not None:
        progress(fact.index, fact.record, result)
