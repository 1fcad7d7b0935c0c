"""Execution: run a plan's row groups on its backend, store values, stop, fail, retry.

:func:`execute` walks the row groups :mod:`._schedule` makes, hands each group's batches to
the backend, stores each value where its sweep says, calls ``on_row`` after each finished
row and checks ``stop`` between batches. A :class:`_Pool` holds batches that ran only up to
their metric's states, to finish many at once (a :class:`~._plans.Chain`'s).

A :class:`~._sweeps.Work` row (program requests, not cells) runs its items a batch at a time
(:func:`_run_work`).

Stopping and failures: ``stop`` (an Event or a function) ends the run ``"stopped"``, Ctrl-C /
a kernel interrupt ends it ``"interrupted"`` (both between batches, :func:`_interrupt_flag`),
with every finished row kept. A batch that runs out of memory is halved and retried; any
other failing batch raises :class:`EngineError` naming it, with the partial result attached.

``plan`` arguments are :class:`~._plans.Plan`\\ s, read by duck typing (this module does not
import the plans, which import it).
"""

from __future__ import annotations

import collections
import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._base.threads import warn_if_oversubscribed
from .._model.cells import Cell
from .._model.models import PipatchError
from .._programs.patch import PatchRequest, metrics, patch
from ._cost import sweep_flops, warn_if_long
from ._schedule import _pack_tokens, _packed_traces, _row_groups, _RowGroup, _two_stage, _WorkRow, batches
from ._sweeps import Sweep, Work

__all__ = ["execute", "stop_check", "EngineError"]


class EngineError(RuntimeError):
    """A batch failed. ``partial`` holds the result with every finished row kept."""

    def __init__(self, message: str, partial: Any = None):
        super().__init__(message)
        self.partial = partial


# --------------------------------------------------------------------------------------------
# Sweeps: grids of cells
# --------------------------------------------------------------------------------------------


def _run_batch(backend: Any, sweep: Sweep, cells: list[Cell], fast: bool, out: str = "metric") -> torch.Tensor:
    """One batch on the backend (the ``patch`` program); a two-stage batch (cells with ``then``)
    runs twice."""
    if _two_stage(cells):
        _, (reads,) = patch(backend, PatchRequest.of(sweep.base, [cells], sweep.metric, fast))
        cells = [cell.then(values) if cell.then is not None else cell for cell, values in zip(cells, reads)]
    (values,), _ = patch(backend, PatchRequest.of(sweep.base, [cells], sweep.metric, fast, out))
    return values


def _run_batches(backend: Any, sweep: Sweep, group: list[list[Cell]], fast: bool) -> list[torch.Tensor]:
    """Batches of one row → the metric per cell of each: one ``patch`` request (each batch one
    trace, their metrics computed together where the backend pools them), or a two-stage
    batch alone (:func:`_run_batch`)."""
    if len(group) == 1:
        return [_run_batch(backend, sweep, group[0], fast)]
    return patch(backend, PatchRequest.of(sweep.base, group, sweep.metric, fast))[0]


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _run_cells(plan: Any, rowgroup: _RowGroup, should_stop: Callable[[], bool] | None, stats: dict,
               pool: _Pool | None = None) -> bool:
    """Fill ``rowgroup``'s rows: its ``filled`` cells with the base metric, its pending cells run
    (each part's batches, :func:`batches`); False when stopped before they finished. With a
    ``pool``, batches whose metric it can finish later run only up to their states, which it
    keeps (their values are stored when it is flushed)."""
    fast, sweep, rows = plan.fast, rowgroup.sweep, rowgroup.rows
    if pool is not None and pool.defers(sweep, rowgroup):
        if should_stop is not None and should_stop():
            return False
        pool.defer(sweep, [cell for part in rowgroup.parts for cell in part])
        for cell in rowgroup.filled:
            plan.store(sweep, cell, float(sweep.base.capture.metric[cell.seed]))
        return True
    reuse = fast and plan.capabilities.prefix(sweep.base)
    pack = _pack_tokens(plan, sweep)
    n_positions = sweep.base.input_ids.shape[1]
    queue = collections.deque(batch for part in rowgroup.parts
                              for batch in batches(part, plan.owner(sweep).batch_size, reuse, pack, n_positions))
    # Batches of at most ``size`` cells (one trace each), handed to the backend ``together``
    # cells at a time: all of a group's (:func:`_shares`), else up to ``size``.
    size, batch_no = plan.owner(sweep).batch_size, 0
    together = max(size, rowgroup.n_pending)
    where = f"layer {rows[0]}" if len(rows) == 1 else f"layers {rows[0]}–{rows[-1]}"
    while queue:
        if should_stop is not None and should_stop():
            return False
        # The next batches, up to ``together`` cells in all: one backend call (run_many), so a
        # backend can finish them together (one product with the unembedding for all).
        group = [queue.popleft()]
        if len(group[0]) > size:
            queue.appendleft(group[0][size:])
            group[0] = group[0][:size]
        total, alone = len(group[0]), _two_stage(group[0])
        while queue and not alone and total + len(queue[0]) <= together and not _two_stage(queue[0]):
            total += len(queue[0])
            group.append(queue.popleft())
        try:
            states = pool.states(sweep, group) if pool is not None and not alone else None
            values = _run_batches(plan.backend, sweep, group, fast) if states is None else []
        except Exception as error:  # noqa: BLE001 - re-raised with the batch named
            if _is_oom(error) and total > 1:
                size = together = max(1, min(total, size) // 2)  # and every later batch of the rowgroup
                queue.extendleft(reversed(group))
                continue
            raise EngineError(
                f"{sweep.view}: batch {batch_no + 1} of {where} ({total} cells) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        for batch in group:
            stats["traces"] += 1
            stats["max_invokes"] = max(stats["max_invokes"], len(batch))
            batch_no += 1
        if states is not None and pool is not None:
            pool.add(sweep, group, states)
        else:
            _store_values(plan, sweep, group, values, stats)
    for cell in rowgroup.filled:  # last, so a stopped or failed group leaves its rows unfilled
        plan.store(sweep, cell, float(sweep.base.capture.metric[cell.seed]))
    return True


def _run_work(plan: Any, work: Work, row: int, should_stop: Callable[[], bool] | None) -> bool:
    """Run row ``row`` of ``work``: its items, ``size`` a request (the plan's batch size at first,
    halved while a request runs out of memory), each answer stored at once; False when stopped
    before it finished. Any other failure raises :class:`EngineError` naming the row."""
    n, lo = work.items(row), 0
    size = max(1, min(n, plan.owner(work).batch_size))
    while lo < n:
        if should_stop is not None and should_stop():
            return False
        items = range(lo, min(n, lo + size))
        try:
            value = work.run(plan.backend, row, items)
        except Exception as error:  # noqa: BLE001 - re-raised with the row named
            if _is_oom(error) and len(items) > 1:
                size = max(1, len(items) // 2)
                continue
            raise EngineError(f"{work.view}: {work.describe(row)} failed: {type(error).__name__}: {error}") from error
        work.store(plan.owner(work).result, row, items, value)
        lo = items.stop
    return True


def _store_values(plan: Any, sweep: Sweep, group: list[list[Cell]], values: list[torch.Tensor], stats: dict) -> None:
    """Store each batch's values in ``sweep``; NaN/Inf from the model itself stored as NaN and
    its row flagged once, in the run's ``nonfinite_rows`` and as a warning of the result the
    row belongs to (a :class:`Chain`'s: its fact's alone)."""
    for batch, batch_values in zip(group, values):
        for cell, value in zip(batch, batch_values.tolist()):
            if not math.isfinite(value):
                value = float("nan")
                flagged = stats.setdefault("nonfinite_rows", [])
                if [sweep.view, cell.row] not in flagged:
                    flagged.append([sweep.view, cell.row])
                warning = f"{sweep.view} row {cell.row}: the model produced NaN/Inf in some cells (stored as NaN)"
                warnings = plan.owner(sweep).result.warnings
                if warning not in warnings:
                    warnings.append(warning)
            plan.store(sweep, cell, value)


class _Pool:
    """Batches that ran up to their metric's states, waiting to finish together: one
    ``metrics_many`` call for all (the transformers backend: one pass over the unembedding for
    every probability among them), then their values stored and their row groups' rows done.

    A plan pools where it asks to (:attr:`Plan.pool_positions`, a :class:`Chain` of a study's
    facts: no row of it is drawn live) and the backend can (its hints' ``states_many``);
    execute flushes the pool once it holds that many read positions, at the end, and before
    a stop or an interrupt ends the run (what finished is kept).

    Where the backend packs cells of several prompts into one trace (its hints'
    ``packs_plans``), a packed row group does not run when it joins: its cells wait here
    (:meth:`defer`), and the flush cuts every plan's waiting cells together into packed traces
    (``states_packed``): cells of several facts share each forward, and no fact's last trace
    runs half full."""

    def __init__(self, plan: Any, stats: dict):
        self.plan, self.stats = plan, stats
        self.items: list[tuple[Sweep, list[list[Cell]], list[torch.Tensor]]] = []
        self.deferred: list[tuple[Sweep, list[Cell]]] = []
        self.waiting: list[_RowGroup] = []
        self.positions = 0

    @property
    def held(self) -> int:
        """How many entries wait (ran or not): a row group that adds one waits for the flush."""
        return len(self.items) + len(self.deferred)

    def defers(self, sweep: Sweep, rowgroup: _RowGroup) -> bool:
        """Whether ``rowgroup``'s cells wait to run packed with other plans' (:meth:`defer`)."""
        capabilities = self.plan.capabilities
        return (capabilities.packs_prompts and bool(_pack_tokens(self.plan, sweep)) and capabilities.pooled(sweep.metric)
                and not any(_two_stage(part) for part in rowgroup.parts))

    def defer(self, sweep: Sweep, cells: list[Cell]) -> None:
        if cells:
            self.deferred.append((sweep, cells))
            self.positions += len(cells) * sweep.metric.n_inputs * sweep.metric.n_read

    def _run_deferred(self) -> None:
        """Run the waiting cells, every plan's together, as packed traces (cells of one number
        of read positions a trace); their states join :attr:`items`."""
        capabilities, stats = self.plan.capabilities, self.stats
        entries = [(sweep, cell) for sweep, cells in self.deferred for cell in cells]
        traces: list[list[int]] = []
        for n_read in sorted({sweep.metric.n_read for sweep, _ in entries}):
            mine = [i for i, (sweep, _) in enumerate(entries) if sweep.metric.n_read == n_read]
            first = entries[mine[0]][0]
            lengths = [max(1, entries[i][0].base.input_ids.shape[1] - entries[i][1].first_position) for i in mine]
            size = min(self.plan.owner(entries[i][0]).batch_size for i in mine)
            cut = _packed_traces([entries[i][1].start for i in mine], lengths, size,
                                 capabilities.packed(first.base, first.metric))
            traces += [[mine[j] for j in trace] for trace in cut]
        try:
            request = PatchRequest([[(entries[i][0].base, entries[i][1], entries[i][0].metric) for i in trace]
                                    for trace in traces], out="states")
            states, _ = patch(self.plan.backend, request)
        except Exception as error:  # noqa: BLE001 - re-raised with the traces named
            views = sorted({sweep.view for sweep, _ in self.deferred})
            raise EngineError(f"{', '.join(views)}: {len(traces)} packed traces of {len(self.deferred)} row groups "
                              f"failed: {type(error).__name__}: {error}") from error
        state_of: dict[int, torch.Tensor] = {}
        for trace, values in zip(traces, states):
            state_of.update((i, values[j : j + 1]) for j, i in enumerate(trace))
            stats["traces"] += 1
            stats["max_invokes"] = max(stats["max_invokes"], len(trace))
        at = 0
        for sweep, cells in self.deferred:
            self.items.append((sweep, [cells], [torch.cat([state_of[i] for i in range(at, at + len(cells))])]))
            at += len(cells)
        self.deferred = []

    def states(self, sweep: Sweep, group: list[list[Cell]]) -> list[torch.Tensor] | None:
        """The batches' states, or ``None`` where they run as usual (a metric that gains nothing)."""
        if not self.plan.capabilities.pooled(sweep.metric):
            return None
        return patch(self.plan.backend, PatchRequest.of(sweep.base, group, sweep.metric, out="states"))[0]

    def add(self, sweep: Sweep, group: list[list[Cell]], states: list[torch.Tensor]) -> None:
        self.items.append((sweep, group, states))
        self.positions += sum(s.shape[0] * s.shape[1] * s.shape[2] for s in states)

    def flush(self) -> list[_RowGroup]:
        """Finish every batch held, store their values; the row groups that waited on them."""
        if self.deferred:
            self._run_deferred()
        if self.items:
            pieces = [(sweep.metric, s) for sweep, _, states in self.items for s in states]
            values = iter(metrics(self.plan.backend, pieces))
            for sweep, group, states in self.items:
                _store_values(self.plan, sweep, group, [next(values) for _ in states], self.stats)
        done, self.items, self.waiting, self.positions = self.waiting, [], [], 0
        return done


def stop_check(stop: Any) -> Callable[[], bool] | None:
    if stop is None:
        return None
    if hasattr(stop, "is_set"):
        return stop.is_set
    if callable(stop):
        return stop
    raise PipatchError("stop must be a threading.Event or a function returning True to stop")


@contextlib.contextmanager
def _interrupt_flag() -> Iterator[threading.Event]:
    """Ctrl-C / Kernel ▸ Interrupt during a run, as a flag the engine reads between batches.

    Python raises ``KeyboardInterrupt`` wherever the main thread happens to be, and inside a
    trace that is nnsight's interleaving machinery, which can swallow it: the run then went on to
    the end. While the engine runs on the main thread, SIGINT only sets this flag; the engine
    ends the run ``"interrupted"`` at the next batch boundary, so the interrupt never lands inside
    a trace. A second interrupt (a batch that does not end: a stuck server) raises at once, as
    Python would. Off the main thread the flag is never set and interrupts behave as usual.
    """
    flag = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield flag  # (``None``: a handler not set from Python, which could not be put back)
        return

    def on_interrupt(signum: int, frame: Any) -> None:
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class _Stages:
    """The run's named stages (:meth:`~._plans.Plan.stages`) as it goes: the rows finished and
    the seconds spent in each, told to ``on_progress(stage, done, total)`` as a stage begins
    and after each of its rows. The time between two rows counts to the stage of the second
    (what ran in it); what follows the last row (the plan's summary at the end), to the last."""

    def __init__(self, plan: Any, on_progress: Callable[[str, int, int], None] | None, started: float):
        self.plan, self.on_progress, self.mark = plan, on_progress, started
        self.stage: str | None = None
        self.rows: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def begin(self, stage: str) -> None:
        if stage != self.stage:
            self.stage = stage
            self.rows.setdefault(stage, 0)
            self.seconds.setdefault(stage, 0.0)
            self._tell(stage)

    def row_done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] += now - self.mark
        self.mark = now
        self.rows[stage] += 1
        self._tell(stage)

    def end(self) -> dict[str, float]:
        """Seconds per stage, in the order they ran, the time since the last row counted to the last."""
        now = time.perf_counter()
        last = self.stage or "run"
        self.seconds[last] = self.seconds.get(last, 0.0) + now - self.mark
        self.mark = now
        return dict(self.seconds)

    def _tell(self, stage: str) -> None:
        if self.on_progress is not None:
            done = self.rows[stage]
            self.on_progress(stage, done, max(self.plan.stages().get(stage, done), done))


def execute(plan: Any, *, on_row: Callable[[Any, str, int], None] | None = None, stop: Any = None,
            on_progress: Callable[[str, int, int], None] | None = None) -> Any:
    """Run every task of ``plan`` into ``plan.result`` and return it.

    ``on_row(result, view, row)`` is called after each finished row. ``on_progress(stage,
    done, total)`` as each named stage of the plan begins (``done`` 0) and after each of its
    rows (:meth:`~._plans.Plan.stages`; a progress bar, :mod:`pipatch._base.progress`). ``stop``
    (an Event or a function) is checked between batches: the run ends ``"stopped"``. Ctrl-C /
    a kernel interrupt ends it ``"interrupted"`` at the next batch boundary
    (:func:`_interrupt_flag`). Either way the finished rows are kept; a failing batch raises
    :class:`EngineError` with the partial result attached. ``result.meta["engine"]`` counts
    ``cells``, ``noop_cells`` (filled without a forward), ``traces`` and ``max_invokes``
    (cells in the largest batch). ``result.meta["elapsed"]`` is the seconds since planning
    began (:attr:`~._plans.Plan.planning` and this run), ``meta["elapsed_stages"]`` the same
    split by stage: ``{"plan": ..., "run": ...}``, a circuit's ``{"plan", "scoring",
    "checks", "curve"}``.

    Before the first row, where the backend computes on this process's CPU threads, a
    machine whose free cores are fewer than torch's threads is named in one warning, once
    per process (:func:`pipatch._base.threads.warn_if_oversubscribed`).
    """
    should_stop = stop_check(stop)
    result = plan.result
    flops, cells = sweep_flops(plan) if plan.narrow else (0.0, 0)
    if flops:
        warn_if_long(plan.backend, flops, f"this {result.kind}", f"{cells:,} patched runs", plan.narrow)
    started = time.perf_counter()
    if plan.capabilities.torch_threads:
        warn_if_oversubscribed()
    stages = _Stages(plan, on_progress, started)
    stats = result.meta.setdefault("engine", {})
    stats.update({"batch_size": plan.batch_size, "fast": plan.fast})
    for key in ("cells", "noop_cells", "traces", "max_invokes"):
        stats.setdefault(key, 0)
    result.status = "running"
    plan.begin()
    finished_rows = 0
    pool = _Pool(plan, stats) if plan.pool_positions and plan.fast else None

    def rows_done(groups: list[_RowGroup] | list[_WorkRow]) -> None:
        nonlocal finished_rows
        for rowgroup in groups:
            for row in rowgroup.rows:
                plan.row_done(rowgroup.sweep, row)
                finished_rows += 1
                result.meta["elapsed"] = plan.planning + time.perf_counter() - started
                if on_row is not None:
                    on_row(plan.result, rowgroup.sweep.view, row)
                stages.row_done(rowgroup.sweep.stage)

    try:
        with _interrupt_flag() as interrupted:
            def halt() -> bool:
                return interrupted.is_set() or (should_stop is not None and should_stop())

            for rowgroup in _row_groups(plan, stats):
                stages.begin(rowgroup.sweep.stage)
                held = pool.held if pool is not None else 0
                if isinstance(rowgroup, _WorkRow):
                    finished = _run_work(plan, rowgroup.sweep, rowgroup.rows[0], halt)
                    if finished:
                        rows_done([rowgroup])
                else:
                    finished = _run_cells(plan, rowgroup, halt, stats, pool)
                    if pool is not None and finished and pool.held > held:
                        pool.waiting.append(rowgroup)  # its rows are done when the pool is flushed
                    elif finished:
                        rows_done([rowgroup])
                if pool is not None and (not finished or interrupted.is_set()
                                         or pool.positions >= plan.pool_positions):
                    rows_done(pool.flush())
                if interrupted.is_set():
                    raise KeyboardInterrupt
                if not finished:
                    result.status = "stopped"
                    result.message = f"stopped by request after {finished_rows} row(s)"
                    if isinstance(rowgroup, _WorkRow):
                        result.message += f", before {rowgroup.sweep.describe(rowgroup.rows[0])}"
                    break
            else:
                if pool is not None:
                    rows_done(pool.flush())
                result.status = "done"
    except KeyboardInterrupt:
        result.status = "interrupted"
        result.message = f"interrupted after {finished_rows} row(s); finished rows are kept"
    except EngineError as error:
        result.status = "failed"
        result.message = str(error)
        error.partial = result
        plan.finish()
        _timed(plan, stages)
        raise
    plan.finish()
    _timed(plan, stages)
    return result


def _timed(plan: Any, stages: _Stages) -> None:
    """The run's seconds into its result: ``meta["elapsed"]`` in all, ``meta["elapsed_stages"]`` by stage."""
    seconds = {"plan": plan.planning, **stages.end()}
    plan.result.meta["elapsed_stages"] = seconds
    plan.result.meta["elapsed"] = sum(seconds.values())
