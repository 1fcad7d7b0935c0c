"""What a run will cost, about, before it starts: one line where it takes more than a minute.

The estimate counts FLOPs the way the scheduler bounds its work (:func:`~._schedule._work`):
each cell's positions from its first written one through the blocks from its ``start`` up,
times the backend's FLOPs of a position through a block
(:attr:`~pipatch._backends._contract.Capabilities.position_flops`), plus the rows of the
unembedding its metric reads at each read position; and divides them by what the device does
in a second (:data:`~._schedule.RUN_FLOPS`). It is a count, not a timing: it says "minutes"
when it is minutes, not to the second. A backend that does not say its FLOPs per position
gets no estimate, and no line.
"""

from __future__ import annotations

from typing import Any

from .._base.errors import warn
from ._schedule import RUN_FLOPS
from ._sweeps import Work

__all__ = ["LONG_SECONDS", "sweep_flops", "read_flops", "seconds_for", "warn_if_long", "duration", "device_name"]

#: A run the cost model says takes longer than this (seconds) is announced first (:func:`warn_if_long`).
LONG_SECONDS = 60.0


def _vocabulary(backend: Any) -> int:
    try:
        return len(backend.tokenizer)
    except TypeError:  # a tokenizer that does not count its vocabulary
        return 0


def sweep_flops(plan: Any) -> tuple[float, int]:
    """The FLOPs of every cell of ``plan``'s sweeps, about (the module docstring), and how many
    cells there are; no FLOPs where the backend does not say its FLOPs per position.
    :class:`~._sweeps.Work` rows are not counted."""
    capabilities = plan.capabilities
    if not capabilities.position_flops:
        return 0.0, 0
    head = 2 * plan.backend.adapter.d_model
    vocabulary = _vocabulary(plan.backend)
    total, cells = 0.0, 0
    for sweep in plan.sweeps:
        if isinstance(sweep, Work):
            continue
        n_positions, n_layers = sweep.base.input_ids.shape[1], plan.backend.adapter.n_layers
        reuse = plan.fast and capabilities.prefix(sweep.base)
        metric = sweep.metric
        rows = len(metric.token_ids) if metric.token_ids is not None else vocabulary
        reads = metric.n_inputs * metric.n_read
        for row in range(sweep.n_rows):
            for cell in _first_seed(sweep, row):
                cells += sweep.n_seeds
                start = cell.start if plan.fast else 0
                positions = n_positions - (min(cell.first_position, n_positions - 1) if reuse else 0)
                work = positions * max(0, n_layers - start) * capabilities.position_flops + reads * rows * head
                total += work * sweep.n_seeds
    return total, cells


def read_flops(backend: Any, n_tokens: int, readings: int) -> float:
    """What a read costs, about, in FLOPs: one forward of ``n_tokens`` positions, and
    ``readings`` states through the whole unembedding (a probability's softmax and a rank read
    every logit): the logit lens."""
    return (n_tokens * backend.adapter.n_layers * backend.capabilities.position_flops
            + readings * 2 * backend.adapter.d_model * _vocabulary(backend))


def _first_seed(sweep: Any, row: int) -> Any:
    """Row ``row``'s cells of seed 0 (every seed's cells cost alike)."""
    for col in range(sweep.n_cols):
        if sweep.only is None or (row, col) in sweep.only:
            yield sweep.cell(row, col, 0)


def device_name(backend: Any) -> str:
    """``"CPU"`` or ``"GPU"``: the device ``backend`` computes on, as a line to a researcher names it."""
    return "CPU" if backend.capabilities.device_kind == "cpu" else "GPU"


def seconds_for(backend: Any, flops: float) -> float:
    """``flops`` in seconds on ``backend``'s device, about (:data:`~._schedule.RUN_FLOPS`: a second's work)."""
    return flops / RUN_FLOPS.get(backend.capabilities.device_kind, RUN_FLOPS["cpu"])


def duration(seconds: float) -> str:
    """``"under 1 s"``, ``"about 40 s"``, ``"about 3 min"``, ``"about 2.5 h"``."""
    if seconds < 1:
        return "under 1 s"
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


def warn_if_long(backend: Any, flops: float, what: str, work: str, narrow: str,
                 threshold: float | None = None) -> float:
    """Warn in one line (a :class:`~pipatch._base.errors.PipatchWarning`) when ``flops`` take longer than
    ``threshold`` seconds (:data:`LONG_SECONDS` by default) on ``backend``: how long, what the
    work is (``work``) and how to narrow it (``narrow``). Returns the estimate in seconds."""
    seconds = seconds_for(backend, flops)
    if seconds > (LONG_SECONDS if threshold is None else threshold):
        warn(f"pipatch: {what} will take {duration(seconds)} on this {device_name(backend)} ({work}): narrow it with "
                      f"{narrow}")
    return seconds
