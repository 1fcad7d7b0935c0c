"""Progress without a model: the bars one module draws for every front end, the engine's named
stages and their time, and the warning about torch's threads against the free cores."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch

from pipatch._base import threads as _threads
from pipatch._base.errors import PipatchWarning
from pipatch._base.progress import StageBars


def _lines(err: str) -> list[str]:
    """Each bar as a terminal shows it at the end: the last redraw of each line."""
    return [line.rsplit("\r", 1)[-1] for line in err.split("\n") if line.strip()]


def test_one_bar_per_stage_in_order_each_at_its_own_count(capsys):
    bars = StageBars("circuit")
    for stage, total, rows in [("scoring", 2, 2), ("checks", 6, 6), ("curve", 9, 5)]:  # the curve ended sooner
        for done in range(rows + 1):
            bars(stage, done, total)
    bars.close(finished=True)
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 3, lines
    for line, (stage, n) in zip(lines, [("scoring", 2), ("checks", 6), ("curve", 5)]):
        assert line.startswith(f"circuit · {stage}: 100%") and f"| {n}/{n} rows" in line, line


def test_a_one_stage_run_is_named_after_the_experiment_and_a_stopped_one_stays_where_it_stopped(capsys):
    bars = StageBars("trace")
    for done in range(3):
        bars("run", done, 18)
    bars.close(finished=False)
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("trace:  11%") and "| 2/18 rows" in line, line


def _staged_plan(stages: dict[str, int], planning: float = 0.0):
    """A plan of :class:`~pipatch._engine.Work` rows in named stages, each row a short sleep."""
    from types import SimpleNamespace

    from pipatch._backends._contract import Capabilities
    from pipatch._engine import Plan, Work

    class Rows(Work):
        def __init__(self, stage: str, n: int):
            super().__init__("work", n)
            self.stage = stage

        def run(self, backend, row, items):
            time.sleep(0.01)

        def store(self, result, row, items, value):
            pass

    class Staged(Plan):
        def tasks(self):
            for work in self.works:
                for row in range(work.n_rows):
                    yield work, row

        def stages(self):
            return {work.stage: work.n_rows for work in self.works}

    result = SimpleNamespace(meta={}, status="", message="", rows_done={}, row_order={}, warnings=[])
    plan = Staged(SimpleNamespace(capabilities=Capabilities()), result, [], batch_size=1)
    plan.works = [Rows(stage, n) for stage, n in stages.items()]
    plan.planning = planning
    return plan


def test_the_engine_tells_each_stage_as_it_begins_and_after_each_row_and_times_the_whole_call():
    plan = _staged_plan({"scoring": 2, "checks": 3}, planning=0.25)
    told, rows = [], []
    started = time.perf_counter()
    result = plan.run(on_row=lambda r, view, row: rows.append(row), on_progress=lambda *event: told.append(event))
    wall = time.perf_counter() - started
    assert told == [("scoring", 0, 2), ("scoring", 1, 2), ("scoring", 2, 2),
                    ("checks", 0, 3), ("checks", 1, 3), ("checks", 2, 3), ("checks", 3, 3)]
    assert rows == [0, 1, 0, 1, 2]  # on_row's rows are each stage's own
    stages = result.meta["elapsed_stages"]
    assert list(stages) == ["plan", "scoring", "checks"] and stages["plan"] == 0.25
    assert stages["scoring"] >= 0.02 and stages["checks"] >= 0.03
    assert result.meta["elapsed"] == pytest.approx(sum(stages.values()), abs=1e-9)
    assert 0.25 + wall >= result.meta["elapsed"] >= 0.25 + 0.95 * wall  # the planning, then this run


def test_a_stop_keeps_the_time_of_the_stages_that_ran():
    plan, stop = _staged_plan({"scoring": 2, "checks": 3}), threading.Event()
    told = []

    def on_progress(stage, done, total):
        told.append((stage, done))
        if stage == "checks" and done == 1:
            stop.set()

    result = plan.run(stop=stop, on_progress=on_progress)
    assert result.status == "stopped" and told[-1] == ("checks", 1)
    assert list(result.meta["elapsed_stages"]) == ["plan", "scoring", "checks"]


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------


def test_the_advice_names_the_threads_the_free_cores_and_the_fix_in_one_line():
    cores = os.cpu_count() or 1
    assert _threads.free_cores(load=0.0) == cores
    assert _threads.free_cores(load=cores + 3.0) == 0.0  # busier than the machine: none free
    line = _threads.thread_advice(8, 1.2)
    assert line is not None and "\n" not in line
    assert "8 threads" in line and "1.2" in line and "torch.set_num_threads(1)" in line and "OMP_NUM_THREADS=1" in line
    assert _threads.thread_advice(2, 1.6) is None  # about two cores free: two threads fit
    assert _threads.thread_advice(1, 0.0) is None  # one thread is never too many
    assert "torch.set_num_threads(3)" in _threads.thread_advice(8, 3.4)


def test_oversubscribed_threads_are_named_once_per_process_with_a_simulated_load(monkeypatch):
    """The load passed in, as busy processes elsewhere would make it: every core busy."""
    monkeypatch.setattr(_threads, "_warned", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.warns(PipatchWarning) as caught:
            assert _threads.warn_if_oversubscribed(load=float(os.cpu_count() or 1))
            assert not _threads.warn_if_oversubscribed(load=float(os.cpu_count() or 1))  # once per process
        said = [w for w in caught if issubclass(w.category, PipatchWarning)]
        assert len(said) == 1 and "torch computes on 2 threads" in str(said[0].message)
        assert "set_num_threads(1)" in str(said[0].message) and said[0].filename == __file__  # the caller's line
        monkeypatch.setattr(_threads, "_warned", False)
        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not _threads.warn_if_oversubscribed(load=float(os.cpu_count() or 1))  # one thread: nothing to say
            torch.set_num_threads(min(2, os.cpu_count() or 1))
            assert not _threads.warn_if_oversubscribed(load=0.0)  # every core free
    finally:
        torch.set_num_threads(threads)
