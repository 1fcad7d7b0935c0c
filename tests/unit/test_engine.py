"""The engine's row stream: rows in order (from the last layer down where that is cheapest), stop between
batches, partial results kept."""

from __future__ import annotations

import threading

import torch


def test_work_rows_run_as_they_are_made_halved_on_out_of_memory_and_stopped_between():
    """Rows that are program requests (:class:`~pipatch._engine.Work`; a circuit's gradient
    passes and curve), no model: each runs before the plan makes the next (which may read it),
    a request that runs out of memory is split in halves, ``on_row`` follows each row, and a
    Stop lands between rows, naming the row it came before."""
    from types import SimpleNamespace

    from pipatch._backends._contract import Capabilities
    from pipatch._engine import Plan, Work

    class Sums(Work):
        def __init__(self):
            super().__init__("work", 3)
            self.stored, self.requests = [], []

        def items(self, row):
            return 4

        def describe(self, row):
            return f"the sums of row {row}"

        def run(self, backend, row, items):
            self.requests.append(len(items))
            if len(items) > backend.fits:
                raise torch.OutOfMemoryError("out of memory (injected)")
            return [10 * row + i for i in items]

        def store(self, result, row, items, value):
            self.stored.extend(value)

    class Made(Plan):
        def tasks(self):
            for row in range(self.work.n_rows):
                yield self.work, row
                assert len(self.work.stored) == 4 * (row + 1)  # it ran before the next task is made

    def planned(work):
        result = SimpleNamespace(meta={}, status="", message="", rows_done={}, row_order={}, warnings=[])
        plan = Made(SimpleNamespace(capabilities=Capabilities(), fits=2), result, [], batch_size=8)
        plan.work = work
        return plan

    seen, work = [], Sums()
    result = planned(work).run(on_row=lambda r, view, row: seen.append((view, row, len(work.stored))))
    assert result.status == "done" and seen == [("work", 0, 4), ("work", 1, 8), ("work", 2, 12)]
    assert work.stored == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23] and work.requests == [4, 2, 2] * 3
    stop, work = threading.Event(), Sums()
    result = planned(work).run(on_row=lambda r, view, row: stop.set(), stop=stop)
    assert result.status == "stopped" and result.message == "stopped by request after 1 row(s), before the sums of row 1"
    assert work.stored == [0, 1, 2, 3]
