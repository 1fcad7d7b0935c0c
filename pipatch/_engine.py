"""The engine: run any experiment's cells as batched invokes on a backend, streaming rows.

Data flows one way: a protocol (:mod:`pipatch._protocols`) checks the researcher's question,
runs the baselines and builds a :class:`Plan` — the :class:`~pipatch._result.Result` to fill
and the :class:`Sweep`\\ s that fill it. A sweep is a grid of cells (:mod:`pipatch._cells`):
``sweep.cell(row, col, seed)`` is one patched run. The engine

* asks each sweep for one row's cells at a time (a head sweep over a long prompt never
  holds every cell at once), in the order the plan gives (:meth:`Plan.tasks`: from the last
  layer down where higher rows cost less, :attr:`Plan.row_order`);
* fills a cell whose writes put back the base run's own values (or write only where the run
  they come from agrees with the base run: :attr:`Sweep.agrees_before`), or that the metric
  cannot see (:func:`_is_unread`), with the base metric, without running the model (``fast``
  only);
* lets consecutive rows share their traces (:func:`_joins`): where the backend packs cells
  (each from its own layer and position: the transformers backend) while the rows hold at
  most ``batch_size`` cells, else for rows of few cells, each cell then starting at the
  lowest layer among them; and rows whose metric reads the whole unembedding finish
  together, one pass over it for all (:func:`_shares`); the first row always runs alone, to
  show soonest;
* cuts the rest into batches of at most ``batch_size`` invokes (:func:`batches`): packed,
  traces of about the backend's ``pack_tokens`` positions; otherwise batches that share
  their ``start`` layer (and, where the backend reuses prefixes, about the same first
  written position). Each batch is one nnsight trace (the transformers backend: one invoke
  holding every cell's rows; vLLM: one invoke per cell), and the backend gets a row's
  consecutive batches of at most ``batch_size`` cells in all at once (the hints' ``run_many``:
  the transformers backend then computes all their metrics in one product with the
  unembedding);
* stores each value where the sweep says (:meth:`Sweep.store`), calls ``on_row`` after each
  row so a front end can draw it live, and checks ``stop`` between batches;
* runs a :class:`Chain` (several plans in turn, each into its own result: a study's facts,
  never drawn row by row) with their metrics pooled (:class:`_Pool`): each batch runs up to
  its metric's states (the hints' ``states_many``), and the pool finishes a thousand read
  positions of them at once (``metrics_many``: one pass over the unembedding for all).

**The backend seam.** The engine and the protocols never touch a model: every call into it
goes through the backend object (:mod:`pipatch._backends`; its core members typed by
:class:`~pipatch._backends._contract.Backend`), which turns cells into invokes. What the
engine schedules by (layer order, prefix reuse, packing, pooled unembedding, the device's
sizes) it reads only from the backend's hints (:attr:`Plan.hints`, the defaults where a
backend gives none). A new way of running models is one new module there; nothing here
changes.

Stopping and failures: ``stop`` (an Event or a function) ends the run ``"stopped"``, Ctrl-C /
a kernel interrupt ends it ``"interrupted"`` (both between batches), with every finished row kept. A batch that
runs out of memory is halved and retried; any other failing batch raises :class:`EngineError`
naming it, with the partial result attached.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ._backends._contract import Hints, hints_of
from ._cells import Base, Cell, Metric, Op
from ._checks import whole_number
from ._models import Adapter, PipatchError
from ._sites import Site

__all__ = ["Sweep", "SiteSweep", "Plan", "Chain", "Predictor", "execute", "stop_check", "batches", "EngineError", "auto_batch_size",
           "batch_size_for_memory", "check_batch_size"]


class EngineError(RuntimeError):
    """A batch failed. ``partial`` holds the result with every finished row kept."""

    def __init__(self, message: str, partial: Any = None):
        super().__init__(message)
        self.partial = partial


# --------------------------------------------------------------------------------------------
# Sweeps: grids of cells
# --------------------------------------------------------------------------------------------


@dataclass
class Sweep:
    """A grid of cells over one base run: ``n_rows × n_cols`` per seed of the base.

    Subclasses define :meth:`cell`. ``prune=False`` runs every cell even where its writes put
    back the base run's own values (causal tracing's control, whose point is to run them).
    ``only`` restricts the sweep to a set of ``(row, col)`` cells (attribution's verification).
    ``agrees_before`` is the number of leading positions where the run the writes come from
    had the base run's inputs (causal tracing: the positions before the first noised one;
    patching: before the first token where the prompts differ). The model being causal, its
    states there are the base run's too — equal in exact arithmetic, though not to the last
    bit when the two runs were batched differently (a clean run alone, ten noised runs
    together) — so a cell that writes only there is a no-op (:func:`_is_noop`).
    A sweep holds its baselines and donors but never the result, so keeping it alive to answer
    clicks does not keep the result alive.
    """

    view: str
    base: Base
    metric: Metric
    n_rows: int
    n_cols: int
    prune: bool = True
    only: set[tuple[int, int]] | None = None
    agrees_before: int = 0

    @property
    def n_seeds(self) -> int:
        return self.base.n_seeds

    def cell(self, row: int, col: int, seed: int) -> Cell:
        raise NotImplementedError

    def cells(self, row: int) -> Iterator[Cell]:
        """The cells of one row, column-major then seed."""
        for col in range(self.n_cols):
            if self.only is not None and (row, col) not in self.only:
                continue
            for seed in range(self.n_seeds):
                yield self.cell(row, col, seed)

    def store(self, result: Any, cell: Cell, value: float) -> None:
        """Put one cell's value into ``result`` (default: ``raw[view][seed, row, col]``)."""
        result.raw[self.view][cell.seed, cell.row, cell.col] = value

    @property
    def tracks_rows(self) -> bool:
        """Whether finishing a row advances ``result.rows_done[view]``."""
        return True


@dataclass
class SiteSweep(Sweep):
    """Write a donor's value of one site into the base run: patching and restoration.

    Cell ``(row, col)`` for seed ``s`` writes ``donor[layer]`` (``[n_donor, T, width]``, with
    ``n_donor`` 1 — shared by every seed — or one per seed) at layers ``row .. row + window − 1``
    (clipped to the model) at the positions of column ``col`` (``columns[col]``: a position or a
    list of them); for a head site, head ``col``'s slice of ``z`` at ``positions``.
    """

    site: Site | None = None
    adapter: Adapter | None = None
    donor: list[torch.Tensor] = field(default_factory=list)
    columns: list[Any] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    window: int = 1

    def cell(self, row: int, col: int, seed: int) -> Cell:
        donor_seed = seed if self.donor[0].shape[0] > 1 else 0
        site, adapter = self.site, self.adapter
        assert site is not None and adapter is not None, "a SiteSweep needs its site and adapter"
        index = site.column_index(adapter, col, self.columns, self.positions)
        layers = site.window_layers(row, self.window, adapter.n_layers)
        ops = [Op(site, layer, index, self.donor[layer][donor_seed : donor_seed + 1][index]) for layer in layers]
        # The run starts at the lowest block the writes can change (a block output's write
        # leaves that block's own computation the base run's: the run starts above it).
        return Cell(row, col, seed, start=site.start_layer(row), ops=ops)


def _is_noop(base: Base, cell: Cell, agrees_before: int = 0) -> bool:
    """True when every op of ``cell`` writes back the value the base run already has there:
    every op writes before position ``agrees_before`` (:attr:`Sweep.agrees_before`), or its
    value equals the base run's."""
    if not cell.ops:
        return False
    if all(op.value is not None and op.last_position is not None and op.last_position < agrees_before
           for op in cell.ops):
        return True
    for op in cell.ops:
        current = base.capture.site(op.site.name, op.layer, cell.seed) if op.value is not None else None
        if current is None or op.value is None or not torch.allclose(current[op.index], op.value, rtol=1e-6, atol=1e-7):
            return False
    return True


def _is_unread(base: Base, cell: Cell) -> bool:
    """True when the metric cannot see ``cell``'s writes, so its value is the base run's.

    Each op writes the last block's output, or a site of the last block after its attention
    (not q/k/v), at prompt positions before the last: past the last block, the final norm
    and the unembedding work position by position, and the metric reads the last prompt
    position on. (The top row of a sweep over positions: in a 10-seed causal trace, every
    cell of layer 17 but the last position's.)
    """
    if not cell.ops or cell.then is not None:
        return False
    last_layer, last_position = len(base.capture.blocks) - 1, base.input_ids.shape[1] - 1
    for op in cell.ops:
        end = op.last_position
        if (op.value is None or op.layer != last_layer or op.site.feeds_its_own_attention
                or end is None or end >= last_position):
            return False
    return True


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------


class Plan:
    """A protocol's output: the result to fill and the sweeps that fill it, not yet run.

    ``plan.run()`` fills ``plan.result`` and returns it; ``plan.predictor()`` answers clicks
    on its cells. Subclasses change the order of the work (:meth:`tasks`) or what happens at
    the end (:meth:`finish`).
    """

    def __init__(self, backend: Any, result: Any, sweeps: list[Sweep], batch_size: int, fast: bool = True):
        self.backend = backend
        self.result = result
        self.sweeps = sweeps
        self.batch_size = batch_size
        self.fast = fast
        #: What the backend says the engine may schedule by (:class:`~pipatch._backends._contract.Hints`).
        self.hints = hints_of(backend)
        #: How many FLOPs rows sharing traces may hold, about (:data:`RUN_FLOPS`).
        self.run_flops = RUN_FLOPS.get(self.hints.device_kind, RUN_FLOPS["cpu"])
        #: Read positions whose metrics wait to finish together (:class:`_Pool`); 0: each
        #: row group finishes as it runs, so its rows show at once (every plan but a :class:`Chain`).
        self.pool_positions = 0

    @property
    def row_order(self) -> int:
        """The order every sweep's rows run in: ``-1``, from the last layer down, where the
        backend starts a cell's run at its first patched layer (``fast``): a higher row then
        costs less, so the first finished row shows soonest (layer 17 of a 10-seed trace in
        0.2 s, where layer 0 takes 2 s); else ``1``, from layer 0."""
        return -1 if self.fast and self.hints.starts_at_layer else 1

    def owner(self, sweep: Sweep) -> Plan:
        """The plan whose result ``sweep`` fills: this one (a :class:`Chain`: one of its plans)."""
        return self

    def rows(self, sweep: Sweep) -> range:
        """``sweep``'s rows in the order they run."""
        return range(sweep.n_rows - 1, -1, -1) if self.row_order == -1 else range(sweep.n_rows)

    def tasks(self) -> Iterator[tuple[Sweep, int]]:
        """``(sweep, row)`` pairs in the order they run: each sweep's rows, in :meth:`rows` order."""
        for sweep in self.sweeps:
            for row in self.rows(sweep):
                yield sweep, row

    def begin(self) -> None:
        for sweep in self.sweeps:
            if sweep.tracks_rows:
                self.result.rows_done[sweep.view] = 0
                self.result.row_order[sweep.view] = self.row_order

    def store(self, sweep: Sweep, cell: Cell, value: float) -> None:
        sweep.store(self.result, cell, value)

    def row_done(self, sweep: Sweep, row: int) -> None:
        if sweep.tracks_rows:
            self.result.rows_done[sweep.view] += 1

    def finish(self) -> None:
        """Called once the tasks end (also when stopped or interrupted)."""

    @property
    def total_rows(self) -> int:
        return sum(s.n_rows for s in self.sweeps)

    def run(self, *, on_row: Callable[[Any, str, int], None] | None = None, stop: Any = None) -> Any:
        """Run every task; see :func:`execute`."""
        return execute(self, on_row=on_row, stop=stop)

    def predictor(self) -> Predictor:
        """What answers a click on a cell of this plan's grid (holds no reference to the result)."""
        return Predictor(self.backend, {s.view: dataclasses.replace(s, only=None) for s in self.sweeps})


#: Read positions a :class:`Chain` pools before finishing their metrics (:class:`_Pool`): a
#: pass over Gemma's 262k-row unembedding costs, per position, 3.1 ms for 35 positions, 2.3
#: for 70, 1.2 for 448 and 1.18 for 896 on this CPU.
POOL_POSITIONS = 1024


@dataclass
class _Status:
    """What :func:`execute` records of a :class:`Chain`'s run, copied to each plan's result."""

    meta: dict = field(default_factory=dict)
    status: str = "running"
    message: str = ""
    warnings: list = field(default_factory=list)


class Chain(Plan):
    """Several plans run as one, each's tasks in turn and into its own result, their cells'
    metrics finished together where the backend can (:class:`_Pool`; its hints'
    ``states_many``): a study's facts (:func:`pipatch.study`), whose rows are never drawn one
    by one.

    The pass from their states to the metric is shared (the transformers backend's
    log-sum-exp over the unembedding), and where the backend packs several prompts' cells
    into one trace (its hints' ``packs_plans``) so are the forwards: the plans' packed rows
    run together, cut into traces of the backend's size. A value may then differ from the
    plan's own run in its last bits, and equals the same chain's run again to the last bit.
    :meth:`run` returns the plans' results, all ``"done"``, or all ended alike
    (``"stopped"``, ``"interrupted"``: the rows that finished are kept).
    """

    def __init__(self, plans: list[Plan]):
        first = plans[0]
        super().__init__(first.backend, _Status(), [s for p in plans for s in p.sweeps], first.batch_size, first.fast)
        self.plans = plans
        self._owner = [(sweep, plan) for plan in plans for sweep in plan.sweeps]  # sweeps compare by value
        self.pool_positions = POOL_POSITIONS

    def tasks(self) -> Iterator[tuple[Sweep, int]]:
        for plan in self.plans:
            yield from plan.tasks()

    def begin(self) -> None:
        for plan in self.plans:
            plan.begin()

    def owner(self, sweep: Sweep) -> Plan:
        return next(plan for each, plan in self._owner if each is sweep)

    def store(self, sweep: Sweep, cell: Cell, value: float) -> None:
        self.owner(sweep).store(sweep, cell, value)

    def row_done(self, sweep: Sweep, row: int) -> None:
        self.owner(sweep).row_done(sweep, row)

    def finish(self) -> None:
        for plan in self.plans:
            plan.finish()

    @property
    def total_rows(self) -> int:
        return sum(plan.total_rows for plan in self.plans)

    def run(self, *, on_row: Callable[[Any, str, int], None] | None = None, stop: Any = None) -> Any:
        """Run every plan (``on_row`` gets the chain's status, not a plan's result); their results."""
        status = execute(self, on_row=on_row, stop=stop)
        for plan in self.plans:
            result = plan.result
            result.status, result.message = status.status, status.message
            result.meta["engine"] = {**status.meta.get("engine", {}), "chained": len(self.plans)}
            result.meta["elapsed"] = status.meta.get("elapsed", 0.0) / len(self.plans)
            result.warnings.extend(status.warnings)
        return [plan.result for plan in self.plans]


class Predictor:
    """Top next tokens of one cell's patched run: ``predict(view, row, col, seed, k)``.

    This is what a click on a grid cell shows: the cell's run repeated with full logits.
    """

    def __init__(self, backend: Any, sweeps: dict[str, Sweep], locate: Callable | None = None,
                 measure: Callable | None = None):
        self.backend = backend
        self.sweeps = sweeps
        self._locate = locate
        self._measure = measure  # (predictor, view, row, col) -> more of the click's answer

    def __call__(self, view: str, row: int, col: int, seed: int = 0, k: int = 5) -> list[tuple[str, float]]:
        sweep, cell = self.locate(view, row, col, seed)
        logits = _run_batch(self.backend, sweep, [cell], fast=False, full_logits=True)
        probs = logits.float().softmax(-1)[0]
        best = probs.topk(k)
        return list(zip(self.backend.decode(best.indices.tolist()), best.values.tolist()))

    def measured(self, view: str, row: int, col: int) -> dict[str, Any]:
        """What a plan adds to a click's answer beyond the top tokens (a circuit: the clicked
        edge's exact patch over every pair), ``{}`` for most."""
        return self._measure(self, view, row, col) if self._measure is not None else {}

    def values(self, runs: list[tuple[Sweep, Cell]]) -> list[float]:
        """The metric of each ``(sweep, cell)``'s patched run, one run (two for a two-stage cell) each."""
        return [float(_run_batch(self.backend, sweep, [cell], fast=False)[0]) for sweep, cell in runs]

    def locate(self, view: str, row: int, col: int, seed: int) -> tuple[Sweep, Cell]:
        """The sweep and cell behind grid cell ``(view, row, col, seed)``."""
        if self._locate is not None:
            return self._locate(view, row, col, seed)
        if view not in self.sweeps:
            raise PipatchError(f"no view {view!r} to run: this plan has {', '.join(self.sweeps)}")
        sweep = self.sweeps[view]
        return sweep, sweep.cell(row, col, min(max(seed, 0), sweep.n_seeds - 1))


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _two_stage(cells: list[Cell]) -> bool:
    return any(cell.then is not None for cell in cells)


def _run_batch(backend: Any, sweep: Sweep, cells: list[Cell], fast: bool, full_logits: bool = False) -> torch.Tensor:
    """One batch on the backend; a two-stage batch (cells with ``then``) runs twice."""
    if _two_stage(cells):
        _, reads = backend.run(sweep.base, cells, sweep.metric, fast=fast)
        cells = [cell.then(values) if cell.then is not None else cell for cell, values in zip(cells, reads)]
    values, _ = backend.run(sweep.base, cells, sweep.metric, fast=fast, full_logits=full_logits)
    return values


def _run_batches(backend: Any, hints: Hints, sweep: Sweep, group: list[list[Cell]], fast: bool) -> list[torch.Tensor]:
    """Batches of one row → the metric per cell of each: one ``run_many`` call (each batch one
    trace), or a two-stage batch alone (:func:`_run_batch`)."""
    if len(group) == 1:
        return [_run_batch(backend, sweep, group[0], fast)]
    return hints.run_many(sweep.base, group, sweep.metric, fast=fast)


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


# What one more trace costs, counted in positions one more batch row would cost instead: a
# trace's fixed part (nnsight's set-up, and reading every weight once however few rows run)
# is worth about 32 more positions in a batch. Measured on Gemma 3 270M on this CPU: a
# one-position cell alone 78 ms at layer 0, eight in one trace 182 ms; a GPU's fixed part
# weighs more still.
TRACE_COST = 32
# What one more trace costs when a row could join the traces of the rows above it instead
# (:func:`_joins`), counted in positions through one more block per block the trace runs.
# Measured on Gemma 3 270M on this CPU, the benchmark's resid patching grid (7 cells a row),
# its rows' time after the baselines: each row alone 3.7 s; joined at 4: 2.9 s, 8: 2.45 s,
# 12 to 24: 2.3 s, 32: 2.6 s. Rows that share traces run each block's matrix products on
# more rows at once, nearer the machine's peak (28 rows: 35 GFLOP/s; 476: 62).
JOIN_COST = 16
# How much arithmetic a group of rows that share their traces may hold (:func:`_joins`), by the
# device the model runs on (:attr:`Hints.device_kind`): a group's rows show when it ends, and a
# click is answered between groups, so a slow model's grid still fills a row or two at a time. About a second's work (this
# CPU runs a block's matrix products at 100-200 GFLOP/s), counted rather than timed, so the same
# sweep always runs in the same traces and gives the same numbers to the last bit.
RUN_FLOPS = {"cpu": 1e11, "cuda": 1e13}
# How many read positions consecutive rows may pool for one pass over the unembedding
# (:func:`_shares`). A probability reads all of it (Gemma: 262k rows); measured on this CPU,
# a pass costs per position 3.2 ms for 70 positions, 2.1 for 210, 1.8 for 420, 2.0 for 630.
SHARE_POSITIONS = 448
# ... and at most this many rows: the grid still fills a few rows at a time (a 2-seed trace's
# rows hold 14 read positions), and a Stop, checked between backend calls, answers soon.
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


def _pending(plan: Plan, sweep: Sweep, row: int, stats: dict) -> tuple[list[Cell], list[Cell]]:
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


def _joins(plan: Plan, sweep: Sweep, held: _RowGroup, cells: list[Cell]) -> bool:
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
    if (held.work + _work(sweep, cells)) * plan.hints.position_flops > plan.run_flops:
        return False
    if plan.hints.pack_tokens(sweep.base, sweep.metric):
        return held.n_pending + len(cells) <= plan.owner(sweep).batch_size  # each cell keeps its own start
    if len(group) + len(cells) > plan.owner(sweep).batch_size:
        return False
    n_positions = sweep.base.input_ids.shape[1]
    reuse = plan.hints.prefix_reuse(sweep.base)

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


def _work(sweep: Sweep, cells: list[Cell]) -> int:
    """What running ``cells`` costs, about, in positions through one block: each cell's
    positions from its first written one through the blocks from its ``start`` up (and one
    more, for the final norm and the metric)."""
    n_positions, n_layers = sweep.base.input_ids.shape[1], len(sweep.base.capture.blocks)
    return sum((n_positions - min(cell.first_position, n_positions - 1)) * (n_layers - cell.start + 1) for cell in cells)


def _shares(plan: Plan, held: _RowGroup, cells: list[Cell]) -> bool:
    """Whether the next row's ``cells`` finish in ``held`` (a :class:`_RowGroup`) in traces of their own: where the
    backend computes a batch of cells' metrics together for less than apart (a probability
    reads the whole unembedding, 262k rows for Gemma: one pass for 210 positions costs about
    what it costs for 70 here), up to :data:`SHARE_POSITIONS` read positions and
    :data:`SHARE_ROWS` rows. The rows then show together, a few at a time."""
    metric = held.sweep.metric
    return (plan.fast and plan.hints.shares_unembedding(metric) and bool(cells) and len(held.rows) < SHARE_ROWS
            and (held.n_pending + len(cells)) * metric.n_inputs * metric.n_read <= SHARE_POSITIONS
            and not _two_stage(cells) and not any(_two_stage(part) for part in held.parts))


def _row_groups(plan: Plan, stats: dict) -> Iterator[_RowGroup]:
    """The plan's tasks as row groups (:class:`_RowGroup`): one row, or several consecutive
    rows of one sweep that share traces (rows from the last layer down, :func:`_joins`) or the
    metric's unembedding (:func:`_shares`). The first group is one row, so the first finished
    row shows soonest; so is each plan's first of a :class:`Chain` (its groups are the ones it
    makes alone)."""
    held: _RowGroup | None = None
    groups = 0
    owner = None
    for sweep, row in plan.tasks():
        first = plan.owner(sweep) is not owner  # a plan's first task: a group of its own
        owner = plan.owner(sweep)
        pending, filled = _pending(plan, sweep, row, stats)
        if held is not None and groups and held.sweep is sweep and not first:
            if plan.row_order == -1 and _joins(plan, sweep, held, pending):
                held.add(row, pending, filled, join=True,
                         lower=not plan.hints.pack_tokens(sweep.base, sweep.metric))
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


def _run_cells(plan: Plan, rowgroup: _RowGroup, should_stop: Callable[[], bool] | None, stats: dict,
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
    reuse = fast and plan.hints.prefix_reuse(sweep.base)
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
            values = _run_batches(plan.backend, plan.hints, sweep, group, fast) if states is None else []
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


def _pack_tokens(plan: Plan, sweep: Sweep) -> int:
    """Positions per packed trace of ``sweep``'s cells, or 0 where they do not run packed (the
    fast paths off, or a backend that does not start cells at their first written position)."""
    fast = plan.fast and plan.hints.prefix_reuse(sweep.base)
    return plan.hints.pack_tokens(sweep.base, sweep.metric) if fast else 0


def _store_values(plan: Plan, sweep: Sweep, group: list[list[Cell]], values: list[torch.Tensor], stats: dict) -> None:
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

    def __init__(self, plan: Plan, stats: dict):
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
        hints = self.plan.hints
        return (hints.packs_plans and bool(_pack_tokens(self.plan, sweep)) and hints.shares_unembedding(sweep.metric)
                and not any(_two_stage(part) for part in rowgroup.parts))

    def defer(self, sweep: Sweep, cells: list[Cell]) -> None:
        if cells:
            self.deferred.append((sweep, cells))
            self.positions += len(cells) * sweep.metric.n_inputs * sweep.metric.n_read

    def _run_deferred(self) -> None:
        """Run the waiting cells, every plan's together, as packed traces (cells of one number
        of read positions a trace); their states join :attr:`items`."""
        hints, stats = self.plan.hints, self.stats
        entries = [(sweep, cell) for sweep, cells in self.deferred for cell in cells]
        traces: list[list[int]] = []
        for n_read in sorted({sweep.metric.n_read for sweep, _ in entries}):
            mine = [i for i, (sweep, _) in enumerate(entries) if sweep.metric.n_read == n_read]
            first = entries[mine[0]][0]
            lengths = [max(1, entries[i][0].base.input_ids.shape[1] - entries[i][1].first_position) for i in mine]
            size = min(self.plan.owner(entries[i][0]).batch_size for i in mine)
            cut = _packed_traces([entries[i][1].start for i in mine], lengths, size,
                                 hints.pack_tokens(first.base, first.metric))
            traces += [[mine[j] for j in trace] for trace in cut]
        try:
            states = hints.states_packed([[(entries[i][0].base, entries[i][1], entries[i][0].metric) for i in trace]
                                          for trace in traces])
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
        hints = self.plan.hints
        return hints.states_many(sweep.base, group, sweep.metric) if hints.shares_unembedding(sweep.metric) else None

    def add(self, sweep: Sweep, group: list[list[Cell]], states: list[torch.Tensor]) -> None:
        self.items.append((sweep, group, states))
        self.positions += sum(s.shape[0] * s.shape[1] * s.shape[2] for s in states)

    def flush(self) -> list[_RowGroup]:
        """Finish every batch held, store their values; the row groups that waited on them."""
        if self.deferred:
            self._run_deferred()
        if self.items:
            pieces = [(sweep.metric, s) for sweep, _, states in self.items for s in states]
            values = iter(self.plan.hints.metrics_many(pieces))
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


def execute(plan: Plan, *, on_row: Callable[[Any, str, int], None] | None = None, stop: Any = None) -> Any:
    """Run every task of ``plan`` into ``plan.result`` and return it.

    ``on_row(result, view, row)`` is called after each finished row. ``stop`` (an Event or a
    function) is checked between batches: the run ends ``"stopped"``. Ctrl-C / a kernel
    interrupt ends it ``"interrupted"`` at the next batch boundary (:func:`_interrupt_flag`).
    Either way the finished rows are kept; a failing batch raises :class:`EngineError` with the
    partial result attached. ``result.meta["engine"]`` counts ``cells``, ``noop_cells`` (filled
    without a forward), ``traces`` and ``max_invokes`` (cells in the largest batch).
    """
    should_stop = stop_check(stop)
    result = plan.result
    started = time.perf_counter()
    stats = result.meta.setdefault("engine", {})
    stats.update({"batch_size": plan.batch_size, "fast": plan.fast})
    for key in ("cells", "noop_cells", "traces", "max_invokes"):
        stats.setdefault(key, 0)
    result.status = "running"
    plan.begin()
    finished_rows = 0
    pool = _Pool(plan, stats) if plan.pool_positions and plan.fast else None

    def rows_done(groups: list[_RowGroup]) -> None:
        nonlocal finished_rows
        for rowgroup in groups:
            for row in rowgroup.rows:
                plan.row_done(rowgroup.sweep, row)
                finished_rows += 1
                result.meta["elapsed"] = time.perf_counter() - started
                if on_row is not None:
                    on_row(plan.result, rowgroup.sweep.view, row)

    try:
        with _interrupt_flag() as interrupted:
            def halt() -> bool:
                return interrupted.is_set() or (should_stop is not None and should_stop())

            for rowgroup in _row_groups(plan, stats):
                held = pool.held if pool is not None else 0
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
        result.meta["elapsed"] = time.perf_counter() - started
        plan.finish()
        raise
    result.meta["elapsed"] = time.perf_counter() - started
    plan.finish()
    return result


def batch_size_for_memory(free_bytes: int, n_tokens: int, d_model: int, n_layers: int, bytes_per_value: int, *,
                          n_heads: int = 0, vocab_rows: int = 0, cap: int = 256, fraction: float = 0.5,
                          work: int = 16) -> int:
    """Invokes per trace that fit in ``free_bytes`` of device memory (a GPU's free memory).

    Each invoke of a batch is one patched run of an ``n_tokens`` prompt, and the batch runs
    as one forward of ``batch × n_tokens`` positions. While it runs, one invoke holds about
    these many values of ``bytes_per_value`` bytes (2 for bfloat16, 4 for float32):

    * ``n_layers × n_tokens × d_model`` for the block outputs the trace keeps while it
      reads and writes sites across layers;
    * as many again for the cached base-run blocks it reuses: the fast path hands each
      invoke the base run's outputs of the blocks below its first patched layer instead of
      recomputing them, and the batch copies them into its rows;
    * ``work × n_tokens × d_model`` for the one block being computed: queries, keys and
      values, the MLP's hidden and gate (a few ``d_model`` wide each; 16 covers a 4× MLP);
    * ``n_heads × n_tokens²`` for that block's attention scores;
    * ``vocab_rows`` for the unembedding: the rows of logits the invoke reads (one
      position's full vocabulary for a probability or a click, 0 on the fast path, where
      the metric is computed outside the trace).

    Only ``fraction`` of the free memory is planned for: the rest is room for the base
    runs' captures, which a protocol makes after choosing the batch, the allocator's
    fragmentation, and what this estimate misses. A batch that still runs out of memory
    is halved and retried by the engine. The result is between 1 and ``cap``, and
    grows with ``free_bytes`` and shrinks with ``n_tokens``.
    """
    per_token = d_model * (2 * n_layers + work) + n_heads * n_tokens
    per_invoke = bytes_per_value * (n_tokens * per_token + vocab_rows)
    return max(1, min(cap, int(free_bytes * fraction) // max(1, per_invoke)))


def auto_batch_size(n_tokens: int, budget_tokens: int = 4096, cap: int = 256, *, backend: Any = None,
                    free_bytes: int | None = None) -> int:
    """Invokes per trace for an ``n_tokens`` prompt.

    On a CPU (no ``backend``, or one whose ``device`` is not CUDA, and no ``free_bytes``):
    so that one batch holds about ``budget_tokens`` token positions — the size at which a
    CPU forward stops getting faster per token. On a CUDA device: what fits in its free
    memory (``torch.cuda.mem_get_info``, or ``free_bytes`` when given) for the backend's
    model, by :func:`batch_size_for_memory`. Never more than ``cap``.
    """
    if free_bytes is None and torch.device(getattr(backend, "device", None) or "cpu").type == "cuda":
        free_bytes = torch.cuda.mem_get_info(backend.device)[0]
    if free_bytes is None:
        return max(1, min(cap, budget_tokens // max(1, n_tokens)))
    adapter = backend.adapter
    try:
        vocab = len(backend.tokenizer)
    except Exception:  # noqa: BLE001 - no tokenizer to count: leave the logits out
        vocab = 0
    return batch_size_for_memory(free_bytes, n_tokens, adapter.d_model, adapter.n_layers, backend.dtype.itemsize,
                                 n_heads=adapter.n_heads, vocab_rows=vocab, cap=cap)


def check_batch_size(batch_size: int | None, n_tokens: int, backend: Any = None) -> int:
    """``batch_size`` checked, or the automatic size for ``backend`` (:func:`auto_batch_size`)."""
    if batch_size is None:
        return auto_batch_size(n_tokens, backend=backend)
    return whole_number(batch_size, "batch_size", minimum=1)
