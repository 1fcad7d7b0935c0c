"""Scheduling: which cells share a trace, in which order — pure functions, no model.

Everything here decides from the cells (their ``start`` layer, their first written
position), the plan's sizes and the backend's hints, and computes nothing on a model, so the
same sweep always runs in the same traces (and gives the same numbers to the last bit), and
the tests check it without loading one:

* :func:`_pending` splits a row into the cells that need a forward and those whose value is
  the base run's (:func:`~._sweeps._is_noop`, :func:`~._sweeps._is_unread`);
* :func:`_row_groups` lets consecutive rows share their traces (:func:`_joins`) or their pass
  over the unembedding (:func:`_shares`), the first row alone so it shows soonest; a
  :class:`~._sweeps.Work` row is a group of its own, run before the next task is made;
* :func:`batches` cuts a row group's cells into traces of at most ``batch_size`` invokes:
  packed (:func:`_packed_traces`), or grouped by ``start`` layer and first written position.

``plan`` arguments are :class:`~._plans.Plan`\\ s, read by duck typing (this module does
not import the plans, which import it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._model.cells import Cell
from ._sweeps import Sweep, Work, _is_noop, _is_unread

__all__ = ["batches", "TRACE_COST", "JOIN_COST", "RUN_FLOPS", "SHARE_POSITIONS", "SHARE_ROWS"]


def _two_stage(cells: list[Cell]) -> bool:
    return any(cell.then is not None for cell in cells)


# The sizes below are counted, not timed, so the same sweep always runs in the same traces and
# gives the same numbers to the last bit. ``bench/run.py`` measures what they trade (docs/benchmarks.md);
# each comment says what the number weighs.

#: What one more trace costs, counted in positions one more batch row would cost instead: a
#: trace's fixed part (nnsight's set-up, and reading every weight once however few rows run),
#: about 32 positions in a batch on a CPU; a GPU's fixed part weighs more still.
TRACE_COST = 32
#: What one more trace costs when a row could join the traces of the rows above it instead
#: (:func:`_joins`), counted in positions through one more block per block the trace runs:
#: rows that share their traces run each block's matrix products on more rows at once, nearer
#: the machine's peak, until the group grows so large that its rows show late.
JOIN_COST = 16
#: How much arithmetic a group of rows that share their traces may hold (:func:`_joins`), by
#: the device the model runs on (:attr:`~pipatch._backends._contract.Capabilities.device_kind`):
#: about a second's work, so a slow model's grid still fills a row or two at a time and a
#: click is answered between groups.
RUN_FLOPS = {"cpu": 1e11, "cuda": 1e13}
#: How many read positions consecutive rows may pool for one pass over the unembedding
#: (:func:`_shares`): a probability reads all of it (Gemma: 262k rows), and a pass costs about
#: as much for a few hundred positions as for a few dozen.
SHARE_POSITIONS = 448
#: ... and at most this many rows: the grid still fills a few rows at a time (a 2-seed trace's
#: rows hold 14 read positions), and a Stop, checked between backend calls, answers soon.
SHARE_ROWS = 4


def batches(cells: list[Cell], size: int, prefix_reuse: bool = False, pack: int = 0,
            n_positions: int = 0) -> list[list[Cell]]:
    """One row's cells → the batches that run them (each one trace of at most ``size`` cells).

    Cells of one batch share their ``start`` layer: the blocks below it are skipped for
    every cell. With ``prefix_reuse`` (a backend that starts a batch at its cells' smallest
    first written position, :attr:`Cell.first_position`), cells are also grouped by that
    position: taken from the latest position down, a batch takes the next position's cells
    while starting earlier costs its rows fewer extra positions than one more trace
    (:data:`TRACE_COST`); otherwise the next position opens a new batch. Cells keep their
    order within a position. With ``pack`` (a backend that packs each cell from its own first
    position and its own ``start``, up to ``pack`` positions a trace, of a run of
    ``n_positions``), nothing is computed twice: the cells, from the highest ``start`` down,
    are cut into the fewest traces of at most ``size`` cells and about ``pack`` positions:
    where the positions bind, traces of about equal length; where the cell count binds (on
    a GPU, whose packed traces have no position bound of their own, always), traces of
    equal counts.
    """
    if pack and cells:
        lengths = [max(1, n_positions - cell.first_position) for cell in cells]
        return [[cells[i] for i in trace] for trace in _packed_traces([cell.start for cell in cells], lengths, size, pack)]
    groups: dict[tuple[int, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.start, cell.first_position if prefix_reuse else 0), []).append(cell)
    out: list[list[Cell]] = []
    batch: list[Cell] = []
    first = 0
    for start, position in sorted(groups, key=lambda key: (key[0], -key[1])):
        more = groups[start, position]
        if batch and (batch[0].start != start or len(batch) * (first - position) > TRACE_COST
                      or len(batch) + len(more) > size):
            out.append(batch)
            batch = []
        batch += more
        first = position
    if batch:
        out.append(batch)
    return [batch[i : i + size] for batch in out for i in range(0, len(batch), size)]


def _packed_traces(starts: list[int], lengths: list[int], size: int, pack: int) -> list[list[int]]:
    """Cells (their ``start`` layers and lengths in positions) → packed traces (lists of cell
    indices): from the highest ``start`` down, the fewest traces of at most ``size`` cells and
    about ``pack`` positions (:func:`batches`)."""
    order = sorted(range(len(starts)), key=lambda i: -starts[i])
    by_count, n = math.ceil(len(order) / size), math.ceil(sum(lengths) / pack)
    if by_count > n:
        return [order[i * len(order) // by_count : (i + 1) * len(order) // by_count] for i in range(by_count)]
    share = sum(lengths) / n
    cut: list[list[int]] = [[] for _ in range(n)]
    before = 0
    for i in order:
        cut[min(n - 1, int((before + lengths[i] / 2) / share))].append(i)
        before += lengths[i]
    return [trace[j : j + size] for trace in cut if trace for j in range(0, len(trace), size)]


def _pending(plan: Any, sweep: Sweep, row: int, stats: dict) -> tuple[list[Cell], list[Cell]]:
    """One row's cells: ``(pending, filled)``, those that need a forward, and those (``fast``:
    writes that change nothing, or that the metric cannot see) whose value is the base
    run's metric (stored when the row runs, :func:`_run_cells`)."""
    pending: list[Cell] = []
    filled: list[Cell] = []
    for cell in sweep.cells(row):
        stats["cells"] += 1
        skip = plan.fast and sweep.prune and (_is_unread(sweep.base, cell)
                                                or _is_noop(sweep.base, cell, sweep.agrees_before))
        (filled if skip else pending).append(cell)
    stats["noop_cells"] += len(filled)
    return pending, filled


def _joins(plan: Any, sweep: Sweep, held: _RowGroup, cells: list[Cell]) -> bool:
    """Whether the next row's ``cells`` run in the traces of the last part of ``held`` (the
    :class:`_RowGroup` so far: the pending cells of the rows before it), on a backend that
    starts each cell at its layer.

    Never where the group would then hold more than ``plan.run_flops`` (its :func:`_work` times
    the backend's ``position_flops``). Where the backend packs (:func:`batches`), each cell
    keeps its own ``start`` and sharing costs nothing: rows join while the group holds at most
    ``batch_size`` cells. Otherwise all of them start at the lowest ``start`` among them,
    recomputing the base run's blocks between it and their own: worth it while that extra
    work, counted in positions through one block, is at most what one more trace costs
    (:data:`JOIN_COST` positions per block the trace runs). So rows of a few cells (a
    patching grid) share their traces, and rows of many cells (a 10-seed causal trace) run
    alone.
    """
    group = held.parts[-1]
    if not group or not cells or _two_stage(group) or _two_stage(cells):
        return False
    if (held.work + _work(sweep, cells)) * plan.capabilities.position_flops > plan.run_flops:
        return False
    if plan.capabilities.packed(sweep.base, sweep.metric):
        return held.n_pending + len(cells) <= plan.owner(sweep).batch_size  # each cell keeps its own start
    if len(group) + len(cells) > plan.owner(sweep).batch_size:
        return False
    n_positions = sweep.base.input_ids.shape[1]
    reuse = plan.capabilities.prefix(sweep.base)

    def extra(part: list[Cell]) -> tuple[int, int]:
        """The part's lowest start, and its cells' blocks below their own start, times positions."""
        start = min(cell.start for cell in part)
        return start, sum((n_positions - (cell.first_position if reuse else 0)) * (cell.start - start) for cell in part)

    start, more = extra(group + cells)
    return more - extra(group)[1] <= JOIN_COST * (len(sweep.base.capture.blocks) - start)


@dataclass
class _RowGroup:
    """Consecutive rows of one sweep that run together, and finish together: a row group (each
    of its traces is one run, a forward pass, of many cells).

    ``parts`` are the rows' pending cells: the cells of one part share their traces, each
    started at the part's lowest ``start`` unless the backend packs (:func:`_joins`); all the
    parts' batches go to the backend in one call, so it can compute their metrics in one pass
    over the unembedding (:func:`_shares`). ``filled`` are the cells that need no forward
    (:func:`_pending`), stored when the group finishes.
    """

    sweep: Sweep
    rows: list[int]
    parts: list[list[Cell]]
    filled: list[Cell]

    @property
    def n_pending(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def work(self) -> int:
        """The group's work (:func:`_work`)."""
        return sum(_work(self.sweep, part) for part in self.parts)

    def add(self, row: int, pending: list[Cell], filled: list[Cell], *, join: bool, lower: bool = True) -> None:
        """Take the next row: its cells join the last part's traces (``join``; every cell then
        starts at the part's lowest ``start``, unless the backend packs: not ``lower``) or
        form a part."""
        self.rows.append(row)
        self.filled.extend(filled)
        if not join:
            self.parts.append(pending)
            return
        part = self.parts[-1] + pending
        if lower:
            start = min((cell.start for cell in part), default=0)
            part = [cell if cell.start == start else dataclasses.replace(cell, start=start) for cell in part]
        self.parts[-1] = part


@dataclass
class _WorkRow:
    """A :class:`~._sweeps.Work` row: a group of its own (:func:`_row_groups`)."""

    sweep: Work
    rows: list[int]


def _work(sweep: Sweep, cells: list[Cell]) -> int:
    """What running ``cells`` costs, about, in positions through one block: each cell's
    positions from its first written one through the blocks from its ``start`` up (and one
    more, for the final norm and the metric)."""
    n_positions, n_layers = sweep.base.input_ids.shape[1], len(sweep.base.capture.blocks)
    return sum((n_positions - min(cell.first_position, n_positions - 1)) * (n_layers - cell.start + 1) for cell in cells)


def _shares(plan: Any, held: _RowGroup, cells: list[Cell]) -> bool:
    """Whether the next row's ``cells`` finish in ``held`` (a :class:`_RowGroup`) in traces of their own: where the
    backend computes a batch of cells' metrics together for less than apart (a probability
    reads the whole unembedding, 262k rows for Gemma: one pass for 210 positions costs about
    what it costs for 70 here), up to :data:`SHARE_POSITIONS` read positions and
    :data:`SHARE_ROWS` rows. The rows then show together, a few at a time."""
    metric = held.sweep.metric
    return (plan.fast and plan.capabilities.pooled(metric) and bool(cells) and len(held.rows) < SHARE_ROWS
            and (held.n_pending + len(cells)) * metric.n_inputs * metric.n_read <= SHARE_POSITIONS
            and not _two_stage(cells) and not any(_two_stage(part) for part in held.parts))


def _row_groups(plan: Any, stats: dict) -> Iterator[_RowGroup | _WorkRow]:
    """The plan's tasks as row groups (:class:`_RowGroup`): one row, or several consecutive
    rows of one sweep that share traces (rows from the last layer down, :func:`_joins`) or the
    metric's unembedding (:func:`_shares`). The first group is one row, so the first finished
    row shows soonest; so is each plan's first of a :class:`Chain` (its groups are the ones it
    makes alone).

    A group is held until the next task is made (that task may join it); a
    :class:`~._sweeps.Work` row never is: it and the group before it are yielded at once, so
    both have run when the plan makes its next task, which may read what they left."""
    held: _RowGroup | None = None
    groups = 0
    owner = None
    for sweep, row in plan.tasks():
        first = plan.owner(sweep) is not owner  # a plan's first task: a group of its own
        owner = plan.owner(sweep)
        if isinstance(sweep, Work):
            if held is not None:
                yield held
            held, groups = None, groups + 1
            yield _WorkRow(sweep, [row])
            continue
        pending, filled = _pending(plan, sweep, row, stats)
        if held is not None and groups and held.sweep is sweep and not first:
            if plan.row_order == -1 and _joins(plan, sweep, held, pending):
                held.add(row, pending, filled, join=True,
                         lower=not plan.capabilities.packed(sweep.base, sweep.metric))
                continue
            if _shares(plan, held, pending):
                held.add(row, pending, filled, join=False)
                continue
        if held is not None:
            yield held
            groups += 1
        if first:
            groups = 0
        held = _RowGroup(sweep, [row], [pending], filled)
    if held is not None:
        yield held


def _pack_tokens(plan: Any, sweep: Sweep) -> int:
    """Positions per packed trace of ``sweep``'s cells, or 0 where they do not run packed (the
    fast paths off, or a backend that does not start cells at their first written position)."""
    return plan.capabilities.packed(sweep.base, sweep.metric) if plan.fast else 0
