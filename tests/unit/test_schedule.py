"""The engine's pure scheduling (:mod:`pipatch._engine._schedule`), without a model: a grid's
layout pads little, a write where two runs agree is a no-op, a row's first written position and
the shifted index, and how batches are cut with prefix reuse on and off.

Prefix reuse on real models (numbers equal with reuse off): ``tests/integration/test_prefix.py``.
"""

from __future__ import annotations

import torch

from pipatch._backends.transformers import ROW_TOKENS, _layout
from pipatch._engine import TRACE_COST, batches
from pipatch._model.cells import Base, Cell, Op
from pipatch._model.sites import SITES


def padding(starts, lengths):
    """The rows :func:`_layout` makes, and the share of their slots that is padding."""
    rows = _layout(starts, lengths)
    assert sorted(i for row in rows for i in row) == list(range(len(starts)))
    assert all(len({starts[i] for i in row}) == 1 for row in rows)  # one start a row
    assert [starts[row[0]] for row in rows] == sorted((starts[row[0]] for row in rows), reverse=True)
    fills = [sum(lengths[i] for i in row) for row in rows]
    return rows, 1 - sum(fills) / (max(fills) * len(rows))


def test_the_layout_of_a_grid_pads_little():
    """Rows of about ROW_TOKENS positions, one start each, of about equal length: the grids of
    the benchmark pad nothing, a sweep over every position of a 128-token prompt under 1 %."""
    # A 10-seed trace's rows from the subject on (positions 2-8 of 9), three layers a trace.
    cells = [(layer, 9 - p) for layer in (16, 15, 14) for _ in range(10) for p in range(2, 9)]
    rows, pad = padding(*zip(*cells))
    assert pad == 0 and all(sum(9 - p for p in range(2, 9)) * 10 // 5 <= ROW_TOKENS for _ in rows)
    # The resid patching grid: 17 rows of 7 cells (positions 2-8).
    assert padding(*zip(*[(layer, 9 - p) for layer in range(1, 18) for p in range(2, 9)]))[1] == 0
    # Every position of a 128-token prompt: cells of 128 down to 1 position.
    rows, pad = padding([5] * 128, [128 - p for p in range(128)])
    assert pad < 0.01 and len(rows) == 65
    # A cell longer than ROW_TOKENS gets a row of its own.
    assert padding([3, 3], [ROW_TOKENS + 10, 2])[0] == [[0], [1]]


# --------------------------------------------------------------------------------------------
# The pieces: an op's first position, and how the engine groups cells
# --------------------------------------------------------------------------------------------


def test_a_write_where_the_two_runs_agree_is_a_noop_to_the_last_bit_or_not():
    """``Sweep.agrees_before``: before that position the donor run had the base run's inputs,
    so its states there are the base run's (to rounding: runs batched differently differ in
    the last bits, which the exact check would call a change); a write only there is a no-op.
    A write reaching that position or past it is checked against the base run's value."""
    from pipatch._engine._sweeps import _is_noop
    from pipatch._model.cells import Capture

    state = torch.zeros(1, 6, 4)
    capture = Capture(blocks=[state], sites={"resid": [state]}, metric=torch.zeros(1), embedded=state,
                      prob=torch.zeros(1))
    base = Base(torch.zeros(1, 6, dtype=torch.long), capture)

    def cell(where, value):
        index = (slice(None), where)
        return Cell(0, 0, 0, start=1, ops=[Op(SITES["resid"], 0, index, torch.full_like(state[index], value))])

    assert _is_noop(base, cell([1], 1e-6), agrees_before=2)
    assert not _is_noop(base, cell([1], 1e-6))  # rounding is a change to the exact check
    assert _is_noop(base, cell([0, 1], 5.0), agrees_before=2)
    assert not _is_noop(base, cell([1, 2], 1e-6), agrees_before=2)
    assert _is_noop(base, cell([1, 2], 0.0), agrees_before=2)  # the exact check still applies
    assert not _is_noop(base, cell(slice(0, None), 1e-6), agrees_before=2)  # open-ended: not known


def op_at(where, *rest):
    return Op(SITES["resid"], 0, (slice(None), where, *rest), None)


def test_first_position_and_shifted_index():
    assert op_at(5).first_position == 5 and op_at(5).index_from(3) == (slice(None), 2)
    assert op_at([7, 4, 9]).first_position == 4 and op_at([7, 4, 9]).index_from(4) == (slice(None), [3, 0, 5])
    head = op_at([6, 8], slice(64, 128))
    assert head.index_from(6) == (slice(None), [0, 2], slice(64, 128))
    assert op_at(slice(3, 9)).first_position == 3 and op_at(slice(3, 9)).index_from(2)[1] == slice(1, 7)
    # What cannot be read as positions starts at 0: a full slice, a negative index, a mask.
    assert op_at(slice(None)).first_position == 0
    assert op_at(-1).first_position == 0
    assert op_at(torch.tensor([True, False])).first_position == 0
    assert Cell(0, 0, 0, start=0, ops=[op_at(6), op_at(3)]).first_position == 3
    assert Cell(0, 0, 0, start=0).first_position == 0


def test_last_position():
    assert op_at(5).last_position == 5 and op_at([7, 4, 9]).last_position == 9
    assert op_at(slice(3, 9)).last_position == 8 and op_at([6, 8], slice(64, 128)).last_position == 8
    # What cannot be read as positions says so: an open slice, a negative index, a mask.
    for where in (slice(3, None), slice(None), -1, [2, -1], torch.tensor([True, False])):
        assert op_at(where).last_position is None, where


def cells_at(*positions, start=0):
    return [Cell(0, i, 0, start=start, ops=[op_at(p)]) for i, p in enumerate(positions)]


def test_batches_without_reuse_cut_each_start_into_batch_size_pieces():
    cells = cells_at(9, 1, 5, 3, 7) + cells_at(2, 4, start=1)
    got = batches(cells, 2, prefix_reuse=False)
    assert [[c.col for c in b] for b in got] == [[0, 1], [2, 3], [4], [0, 1]]


def test_batches_with_reuse_group_late_positions_and_keep_starts_apart():
    # One cell per position 12..19: starting a batch one position earlier costs its rows one
    # position each, far less than a trace, so they share one batch (run from 12).
    got = batches(cells_at(*range(12, 20)), 256, prefix_reuse=True)
    assert len(got) == 1 and min(c.first_position for c in got[0]) == 12
    # 40 cells at 19 and 40 at 2: running the late ones from 2 would cost 40 × 17 positions.
    late, early = cells_at(*[19] * 40), cells_at(*[2] * 40)
    got = batches(early + late, 256, prefix_reuse=True)
    assert [{c.first_position for c in b} for b in got] == [{19}, {2}]
    # Just within the cost: TRACE_COST cells one position apart still share.
    got = batches(cells_at(*[10] * TRACE_COST, *[9] * 3), 256, prefix_reuse=True)
    assert len(got) == 1
    got = batches(cells_at(*[10] * (TRACE_COST + 1), 9), 256, prefix_reuse=True)
    assert len(got) == 2
    # Never more than the batch size, and never two start layers in one batch.
    got = batches(cells_at(*range(10)) + cells_at(*range(10), start=3), 4, prefix_reuse=True)
    assert all(len(b) <= 4 and len({c.start for c in b}) == 1 for b in got)
    assert sorted((c.start, c.col) for b in got for c in b) == sorted(
        [(0, i) for i in range(10)] + [(3, i) for i in range(10)])
