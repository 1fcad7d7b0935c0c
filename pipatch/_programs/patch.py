"""The patched run: a batch of cells, each its ops applied in forward order.

Every sweep of every experiment ends here: a cell (:class:`~pipatch._model.cells.Cell`) is one run of
its base prompt with its ops — write a donor's value at a site, add noise, record what is
there — and its value is the metric read at the end. :func:`patch_body` is the code that
runs inside the trace, on every backend; :class:`PatchRequest` is what the engine asks for
(batches of cells, each batch one trace), and :func:`patch` runs it.

A backend may take shortcuts that change no number (skipping the blocks below a cell's
``start`` with its base run's states, starting at its first written position, packing cells
of several bases into one trace): they are the backend's layout of the trace, which its
:class:`~._program.View` hides from the body.

What a batch gives back (``out``):

* ``"metric"``: the metric per cell, ``[cells]`` float32;
* ``"states"``: per cell the unembedding's input at the read positions,
  ``[cells, inputs, n_read, d]``, for a backend that pools the unembedding (its capability
  ``pools_unembedding``): the metric of many batches is then one pass over it
  (:func:`metrics`);
* ``"next_logits"``: the logits of the next token after the prompt per cell, ``[cells, vocab]`` (a click's top
  tokens).

and, per cell, what its recording ops read (in op order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._model.cells import Base, Cell, Metric, Op
from .._model.models import PipatchError
from ._program import Needs, Program, View, in_forward_order, register_program

__all__ = ["PATCH", "METRICS", "PatchRequest", "patch", "metrics", "patch_body", "OUTS"]

#: What a batch of patched runs can give back (the module docstring).
OUTS = ("metric", "states", "next_logits")


def patch_body(view: View, jobs: Sequence[Sequence[Op]]) -> list[list[torch.Tensor]]:
    """Apply each job's ops (``jobs[j]``: the ops of job ``j``, base ops first) in forward
    order through ``view``; per job, what its recording ops read, in op order.

    The embedding's ops come first (before block 0), then each block's: the view is told
    when a block begins and ends (it may skip it, or narrow a packed trace's rows there).
    """
    reads: list[list[torch.Tensor]] = [[] for _ in jobs]
    ordered = in_forward_order(jobs)
    by_layer: dict[int, list[tuple[Op, int]]] = {}
    for op, j in ordered:
        if op.site.is_embedding:
            _apply(view, op, j, 0, reads)
        else:
            by_layer.setdefault(op.layer, []).append((op, j))
    for layer in range(view.adapter.n_layers):
        view.enter(layer)
        for op, j in by_layer.get(layer, ()):
            _apply(view, op, j, layer, reads)
        view.leave(layer)
    return reads


def _apply(view: View, op: Op, job: int, layer: int, reads: list[list[torch.Tensor]]) -> None:
    got = op.site.apply(op, view.place(op.site, layer), view.rows(job, op.site), view.index(job, op))
    if got is not None:
        reads[job].append(got)


PATCH = register_program(Program("patch", 1, Needs(writes=True), patch_body, "a batch of cells: each run's ops in forward order, "
                                 "then the metric (or the states it is read from, or the logits)"))


@dataclass
class PatchRequest:
    """Batches of patched runs, each batch one trace (or, packed, one trace of several bases).

    ``batches[b]`` lists ``(base, cell, metric)`` entries: the cells of one base and metric,
    or of several (a study's facts packed together, their metrics reading as many positions;
    only with ``out="states"``). ``fast``: the backend may take its exact shortcuts. ``out``:
    what each batch gives back (:data:`OUTS`).
    """

    batches: Sequence[Sequence[tuple[Base, Cell, Metric]]]
    fast: bool = True
    out: str = "metric"

    def __post_init__(self) -> None:
        if self.out not in OUTS:
            raise ValueError(f"out={self.out!r}: use one of {OUTS}")

    @classmethod
    def of(cls, base: Base, batches: Sequence[Sequence[Cell]], metric: Metric, fast: bool = True,
           out: str = "metric") -> PatchRequest:
        """Batches of cells of one base run, all reading ``metric``."""
        return cls([[(base, cell, metric) for cell in cells] for cells in batches], fast, out)

    @property
    def metric(self) -> Metric:
        """The metric every cell reads (a request of one metric: ``out`` is not ``"states"``)."""
        return self.batches[0][0][2]

    def each_batch(self, run: Any, no_states: str) -> tuple[list[torch.Tensor], list[list[list[torch.Tensor]]]]:
        """The request as a transport runs it that reads each batch's metric in the batch's own
        trace (no pooled states: ``out="states"`` is refused with ``no_states``, one line):
        ``run(base, cells, metric, fast, next_logits) -> (values, reads)`` per batch."""
        if self.out == "states":
            raise PipatchError(no_states)
        outs: list[torch.Tensor] = []
        reads: list[list[list[torch.Tensor]]] = []
        for batch in self.batches:
            value, read = (torch.zeros(0), []) if not batch else run(
                batch[0][0], [cell for _, cell, _ in batch], batch[0][2], self.fast, self.out == "next_logits")
            outs.append(value)
            reads.append(read)
        return outs, reads


def patch(backend: Any, request: PatchRequest) -> tuple[list[torch.Tensor], list[list[list[torch.Tensor]]]]:
    """Run ``request`` on ``backend``: per batch, its cells' values (``request.out``) and,
    per cell, what its recording ops read."""
    return backend.run(PATCH, request)


def metrics_body(view: View, items: Sequence[tuple[Metric, torch.Tensor]]) -> list[torch.Tensor]:
    """The metric per cell of each ``(metric, states)`` item, from the unembedding's input at
    the read positions: one pass over the unembedding for all items (the view's)."""
    return view.unembedding.metrics(items)


METRICS = register_program(Program("metrics", 1, Needs(shortcut="pools_unembedding"), metrics_body,
                                   "metrics of many batches' states in one pass over the unembedding"))


def metrics(backend: Any, items: Sequence[tuple[Metric, torch.Tensor]]) -> list[torch.Tensor]:
    """The metric per cell of each ``(metric, states)`` item (states from ``out="states"``)."""
    return backend.run(METRICS, items)
