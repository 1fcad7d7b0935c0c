"""Plans: a protocol's output, the result to fill and the sweeps that fill it, not yet run.

:class:`Plan` orders a sweep's rows (from the last layer down where the backend starts a run
at its first patched layer), :class:`Chain` runs several plans as one (a study's facts, their
metrics pooled), and :class:`Predictor` answers a click on a cell (its run repeated with full
logits). Running is :mod:`._execute`'s; the order of the work, :mod:`._schedule`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._model.cells import Cell
from .._model.models import PipatchError
from ._execute import _run_batch, execute
from ._schedule import RUN_FLOPS
from ._sweeps import Sweep

__all__ = ["Plan", "Chain", "Predictor", "POOL_POSITIONS"]


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
        #: What the backend can do and the engine may schedule by (:class:`~pipatch._backends._contract.Capabilities`).
        self.capabilities = backend.capabilities
        #: How many FLOPs rows sharing traces may hold, about (:data:`RUN_FLOPS`).
        self.run_flops = RUN_FLOPS.get(self.capabilities.device_kind, RUN_FLOPS["cpu"])
        #: Read positions whose metrics wait to finish together (:class:`_Pool`); 0: each
        #: row group finishes as it runs, so its rows show at once (every plan but a :class:`Chain`).
        self.pool_positions = 0
        #: Seconds it took to make this plan (its baselines run), which ``meta["elapsed"]``
        #: includes: :func:`pipatch._experiments._api.plan` sets it.
        self.planning = 0.0
        #: How a caller narrows this plan's run, for the line that announces a long one
        #: (:func:`~._cost.warn_if_long`); ``""``: no line.
        self.narrow = "positions="
        #: One line that says, before the run, about how long it takes (a circuit's, timed on its
        #: own captures: :func:`~pipatch._experiments._circuit_budget.estimate_line`); whoever shows
        #: the run's progress prints it first. ``""``: none.
        self.estimate = ""

    @property
    def row_order(self) -> int:
        """The order every sweep's rows run in: ``-1``, from the last layer down, where the
        backend starts a cell's run at its first patched layer (``fast``): a higher row then
        costs less, so the first finished row shows soonest (the last layer's row costs a
        fraction of the first's); else ``1``, from layer 0."""
        return -1 if self.fast and self.capabilities.skips_blocks else 1

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

    def stages(self) -> dict[str, int]:
        """The run's named stages in order, each with the rows it holds (:attr:`Sweep.stage`):
        ``{"run": rows}`` for most plans. Asked again as the run goes on: a plan that makes
        its work from what ran before may know a stage's rows only once it begins."""
        stages: dict[str, int] = {}
        for sweep in self.sweeps:
            stages[sweep.stage] = stages.get(sweep.stage, 0) + sweep.n_rows
        return stages

    def run(self, *, on_row: Callable[[Any, str, int], None] | None = None, stop: Any = None,
            on_progress: Callable[[str, int, int], None] | None = None) -> Any:
        """Run every task; see :func:`execute`."""
        return execute(self, on_row=on_row, stop=stop, on_progress=on_progress)

    def predictor(self) -> Predictor:
        """What answers a click on a cell of this plan's grid (holds no reference to the result)."""
        return Predictor(self.backend, {s.view: dataclasses.replace(s, only=None) for s in self.sweeps})


#: Read positions a :class:`Chain` pools before finishing their metrics (:class:`_Pool`): a
#: pass over the unembedding (Gemma's 262k rows) costs less per position the more positions
#: share it, flattening out near a thousand (``bench/study.py``).
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
        self.narrow = ""  # a study's facts: the study says what it costs

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

    def run(self, *, on_row: Callable[[Any, str, int], None] | None = None, stop: Any = None,
            on_progress: Callable[[str, int, int], None] | None = None) -> Any:
        """Run every plan (``on_row`` gets the chain's status, not a plan's result); their results."""
        status = execute(self, on_row=on_row, stop=stop, on_progress=on_progress)
        for plan in self.plans:
            result = plan.result
            result.status, result.message = status.status, status.message
            result.meta["engine"] = {**status.meta.get("engine", {}), "chained": len(self.plans)}
            run = status.meta.get("elapsed", 0.0) / len(self.plans)  # each plan's share of the chain's run
            result.meta["elapsed"] = plan.planning + run
            result.meta["elapsed_stages"] = {"plan": plan.planning, "run": run}
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
        logits = _run_batch(self.backend, sweep, [cell], fast=False, out="next_logits")
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
