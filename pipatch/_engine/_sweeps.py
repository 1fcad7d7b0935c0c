"""Sweeps: grids of cells over one base run, the two tests that fill a cell without a run,
and work whose rows are program requests.

A :class:`Sweep` is what a protocol hands the engine: ``sweep.cell(row, col, seed)`` is one
patched run (:class:`~pipatch._model.cells.Cell`), and ``sweep.store`` puts its value into the
result. :class:`SiteSweep` is the common one: write a donor's value of one site at each
(layer, column). :func:`_is_noop` and :func:`_is_unread` say when a cell's value is the base
run's own metric, so the engine fills it without a forward pass. A :class:`Work`'s rows are
requests of a program (:mod:`pipatch._programs`) rather than cells: a circuit's gradient
passes and its faithfulness curve's points.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._model.cells import Base, Cell, Metric, Op
from .._model.models import Adapter
from .._model.sites import Site

__all__ = ["Sweep", "SiteSweep", "Work"]


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
    clicks does not keep the result alive. :attr:`stage` names the part of the run its rows
    are (a progress bar's name): ``"run"``, or a subclass's own (attribution's ``"checks"``).
    """

    stage: ClassVar[str] = "run"
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


@dataclass(eq=False)  # told apart by identity, as the engine holds them
class Work:
    """Rows that are program requests, not cells: run like a sweep's (``on_row`` after each,
    Stop and an interrupt between them, a failure an :class:`~._execute.EngineError` naming
    the row), each as soon as the plan makes it, so a row may be made from the results of
    the rows before it (:meth:`~._plans.Plan.tasks` is a generator).

    Row ``row`` holds :meth:`items` items (a curve point's masks; one gradient pass), run
    ``size`` at a time (:meth:`run`, one request each; the plan's batch size at first, halved
    while a request runs out of memory), each request's answer handed to :meth:`store`.
    Subclasses define :meth:`run` and :meth:`store`.

    Attributes
    ----------
    view
        The view ``on_row`` is told.
    n_rows
        How many rows there are, or may be (rows made later may be fewer).
    stage
        The part of the run its rows are, named (a circuit's ``"scoring"``, ``"curve"``).
    """

    stage: ClassVar[str] = "run"
    view: str
    n_rows: int

    def items(self, row: int) -> int:
        """How many items row ``row`` holds."""
        return 1

    def describe(self, row: int) -> str:
        """Row ``row`` in a message: what failed, or what a stop came before."""
        return f"row {row}"

    def run(self, backend: Any, row: int, items: range) -> Any:
        """Run ``items`` of row ``row`` on ``backend`` (one request); its answer."""
        raise NotImplementedError

    def store(self, result: Any, row: int, items: range, value: Any) -> None:
        """Put ``value``, the answer for ``items`` of row ``row``, into ``result``."""
        raise NotImplementedError

    @property
    def tracks_rows(self) -> bool:
        return False


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

