"""The lens read: one run of a prompt that reads every block's output and unembeds it.

The logit lens asks what the model would say if it stopped at layer ``l``: each block's
output at a position goes through the model's own head — its final norm, then the
unembedding (and the soft-cap where the family caps its logits) — as if it were the last
block's. That needs no patched run: one forward of the prompt holds every block's output at
every position. :func:`lens_body` reads them at the positions asked for, in that one run,
and reads them through the head there (on a vLLM engine and on NDIF the weights are there,
not here), so a lens costs one forward per prompt and one pass over the unembedding per
(layer, position) read, whatever the backend.

A multi-token answer (" New York") is read teacher-forced, as everywhere in pipatch: its
first token through the lens at ``(l, p)``, its later tokens at the model's own output after
the prompt and the answer's earlier tokens (the unembedding's input there,
:meth:`~._program.View.read_out`). The run's input is then the prompt and those tokens
(:meth:`~pipatch._model.cells.Metric.inputs`).

:class:`LensRequest` is what a protocol asks for, :func:`lens` runs it, :class:`LensOut` is
what comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._model.cells import Metric
from .._model.sites import RESID
from ._inputs import Position, TokenIds
from ._program import Needs, Program, View, register_program

__all__ = ["LENS", "LensRequest", "LensOut", "lens", "lens_body", "lens_program", "head_values", "CHUNK"]

#: Lens readings unembedded at once: what one pass over the unembedding holds. A rank needs
#: every logit of each reading (64 of Gemma 3's 262,144-token vocabulary: 64 MiB in float32),
#: a probability only their log-sum-exp, taken in slices of the vocabulary.
CHUNK = {"rank": 64, "other": 1024}


class LensOut(NamedTuple):
    """What a lens read gives back, on the CPU."""

    values: torch.Tensor  # the metric through the head at every (layer, position read), [layers, P]
    states: torch.Tensor  # the blocks' outputs there, [layers, P, d]
    output: torch.Tensor  # the model's own metric, [1]
    top1: torch.Tensor  # the model's top next token after the prompt, [1]


def head_values(view: View, metric: Metric, states: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``states`` ([N, d], block outputs) through the model's final norm and unembedding, each
    read as the last prompt position's output: the metric of each, [N]. ``own`` ([n_read, d])
    is the unembedding's input at the run's read positions, the model's own: a multi-token
    answer's later tokens are read there (teacher-forced)."""
    values = []
    for chunk in states.split(CHUNK["rank" if metric.needs_vocab else "other"]):
        hidden = view.final_norm(chunk)[:, None, None, :]  # [N, inputs, n_read, d]
        if metric.n_read > 1:
            later = own[1:].to(hidden.dtype).expand(hidden.shape[0], 1, metric.n_read - 1, hidden.shape[-1])
            hidden = torch.cat([hidden, later], dim=2)
        values.append(view.unembedding.metric(metric, hidden).float().cpu())
    return torch.cat(values) if values else torch.zeros(0)


def lens_body(view: View, metric: Metric, positions: Sequence[int]) -> LensOut:
    """In the run of one prompt (one job, its only input): every block's output at
    ``positions``, each read through the head (:func:`head_values`); and the model's own
    metric and top next token, read off the unembedding's input at the read positions."""
    rows = view.rows(0, RESID)
    states = []
    for layer in range(view.adapter.n_layers):
        view.enter(layer)
        states.append(view.place(RESID, layer).read(rows)[0, list(positions)].clone())
        view.leave(layer)
    own = view.read_out(metric)  # [n_read, d]
    stacked = torch.stack(states)  # [layers, P, d]
    values = head_values(view, metric, stacked.reshape(-1, stacked.shape[-1]), own)
    output = view.unembedding.metric(metric, own[None, None].to(stacked.dtype)).float().cpu()
    top1 = view.unembedding.logits(own[:1]).argmax(-1).cpu()
    return LensOut(values.reshape(stacked.shape[:2]), stacked.cpu(), output, top1)


@dataclass
class LensRequest:
    """A lens read: the run's input ``ids`` (the prompt and a multi-token answer's earlier
    tokens, :meth:`~pipatch._model.cells.Metric.inputs`, ``[1, T']``) run once, its blocks' outputs
    read at ``positions`` (prompt positions) and scored by ``metric``."""

    ids: TokenIds
    metric: Metric
    positions: list[Position]


def lens_program(view: View, request: LensRequest) -> LensOut:
    """:data:`LENS`' body: :func:`lens_body` of the request."""
    return lens_body(view, request.metric, request.positions)


LENS = register_program(Program("lens", 2, Needs(each_row=False), lens_program,
                                "one run of a prompt: every block's output at given positions, read through the head",
                                inputs=LensRequest, answers=(LensOut,)))


def lens(backend: Any, input_ids: torch.Tensor, metric: Metric, positions: Sequence[int]) -> LensOut:
    """Run the lens read of ``input_ids`` ([1, T]) at ``positions`` on ``backend``: one
    forward (:class:`LensOut`), through the backend's one path for programs."""
    return backend.run(LENS, LensRequest(metric.inputs(input_ids), metric, [int(p) for p in positions]))
