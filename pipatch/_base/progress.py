"""Progress bars: the one place that draws them, for the Python functions, the CLI and a study.

``pipatch.trace(...)`` and every other experiment function, the ``pipatch`` command and
:func:`pipatch.study` show their progress through this module: ``tqdm.auto``, so a terminal
gets a text bar on stderr and a notebook kernel a tqdm widget. A run shows one bar per named
stage of its plan (:meth:`pipatch._engine.Plan.stages`): most plans have one, ``"run"``,
whose bar is named after the experiment (``trace``); a circuit has three, ``circuit ·
scoring`` (a gradient pass per pair), ``circuit · checks`` (an exact edge patch per edge
and pair) and ``circuit · curve`` (the faithfulness curve's runs). A bar counts rows as the
engine finishes them and appears when its stage begins. A live :class:`~pipatch.PatchGrid`
(``PatchGrid.run``, the magics, ``study(show=True)``) is its own progress: those draw no bar.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

__all__ = ["bar", "StageBars", "run_with_progress"]

#: ``trace: 40%|████      | 8/18 rows [00:03<00:04]``: a unit named, not tqdm's ``it``.
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]"


def bar(total: int, desc: str, unit: str = "rows", enabled: bool = True) -> tqdm:
    """A progress bar of ``total`` steps named ``desc``, on stderr (a widget in a notebook);
    drawn nothing where ``enabled`` is false or there is no step."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, bar_format=_FORMAT, dynamic_ncols=True,
                disable=not enabled or total <= 0)


class StageBars:
    """A run's ``on_progress(stage, done, total)`` (:func:`pipatch._engine.execute`): one bar
    per stage, opened when the stage begins and closed when the next one does.

    A stage that ends with fewer rows than it said (a circuit's curve narrows its bisection
    in fewer rows than it may take) shows them as its total; a stopped or interrupted run
    leaves its last bar where it stopped.
    """

    def __init__(self, title: str, enabled: bool = True):
        self.title, self.enabled = title, enabled
        self.stage: str | None = None
        self.current: tqdm | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            self._end(finished=True)
            self.stage = stage
            self.current = bar(total, self.title if stage == "run" else f"{self.title} · {stage}")
        current = self.current
        assert current is not None
        if current.disable:
            return
        if total != current.total:
            current.total = total
        current.update(min(done, total) - current.n)

    def close(self, finished: bool) -> None:
        """End the last bar: at its rows done as its total when the run ``finished``."""
        self._end(finished)
        self.stage = None

    def _end(self, finished: bool) -> None:
        current, self.current = self.current, None
        if current is None or current.disable:
            return
        if finished and current.n != current.total:
            current.total = current.n
            current.refresh()
        current.close()


def run_with_progress(plan: Any, title: str, *, on_row: Callable[[Any, str, int], None] | None = None,
                      stop: Any = None, progress: bool = True) -> Any:
    """``plan.run(on_row=..., stop=...)`` with its estimate (``plan.estimate``) first and a bar
    per stage (:class:`StageBars`), unless ``progress`` is false; the result."""
    bars = StageBars(title, enabled=bool(progress))
    if progress and plan.estimate:
        print(plan.estimate, file=sys.stderr)
    finished = False
    try:
        result = plan.run(on_row=on_row, stop=stop, on_progress=bars)
        finished = result.status == "done"
    finally:
        bars.close(finished)
    return result
