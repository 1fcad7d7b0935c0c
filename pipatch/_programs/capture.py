"""The capture: a base run that keeps what later runs patch from and skip with.

Every protocol starts with captures: the clean and corrupt runs of a pair, the noised runs of
a causal trace (one per seed, each under its own noise at the embedding), a dataset's prompts.
A capture keeps, at the prompt's positions, the embedding output, each block's state (what a
later run skips the block with, :meth:`~._program.View.block_state`) and the values of the
sites asked for, and the metric of each run (:class:`~pipatch._model.cells.Capture`).

:func:`capture_body` runs inside the trace on every backend; :class:`CaptureRequest` is what a
protocol asks for, and :func:`capture` / :func:`captures` run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._model.cells import Capture, Metric, Op
from .._model.sites import EMBED, RESID, Site
from ._program import Needs, Program, View, in_forward_order, register_program

__all__ = ["CAPTURE", "CaptureRequest", "capture", "captures", "capture_body", "kept_sites"]


def kept_sites(sites: Sequence[Site]) -> list[Site]:
    """The sites a capture keeps values of besides the blocks' states, in forward order:
    every one asked for but the residual stream itself (the blocks' states are it)."""
    return sorted({s for s in sites if s.encodes or not s.is_block_output}, key=lambda s: (s.order, s.name))


def capture_body(view: View, runs: Sequence[Sequence[Op]], keep: Sequence[Site], prompt: int,
                 recorded: Any) -> tuple[torch.Tensor, list[Any], dict[str, list[torch.Tensor]]]:
    """Run job ``j`` under ``runs[j]`` (its writes: causal tracing's noise at the embedding),
    keeping ``(embedded, blocks, values)``: the embedding output, each block's state and the
    ``keep`` sites' values (:func:`kept_sites`) per layer, at the first ``prompt`` positions of
    the ``recorded`` rows (one row per run: its first input). A value is read after the
    writes at its place (a read here is of the value as written).
    """
    writes: dict[tuple[str, int], list[tuple[Op, int]]] = {}
    for op, j in in_forward_order(runs):
        writes.setdefault((op.site.name, op.layer), []).append((op, j))

    def at(site: Site, layer: int) -> Any:
        place = view.place(site, layer)
        for op, j in writes.get((site.name, layer), ()):
            site.apply(op, place, view.rows(j, site), view.index(j, op))
        return place

    def kept(site: Site, place: Any) -> torch.Tensor:
        return site.read(place, recorded)[site.index(slice(0, prompt))]

    written = {op.site for ops in runs for op in ops}
    inside = sorted({s for s in [*keep, *written] if not (s.is_embedding or s.is_block_output)},
                    key=lambda s: (s.order, s.name))
    # Sites read from the block's output through an encoder: after the stream's own writes.
    after = sorted({s for s in [*keep, *written] if s.is_block_output and s.encodes}, key=lambda s: (s.order, s.name))
    embedded = kept(EMBED, at(EMBED, 0))
    blocks: list[Any] = []
    values: dict[str, list[torch.Tensor]] = {s.name: [] for s in keep}
    for layer in range(view.adapter.n_layers):
        view.enter(layer)
        for site in inside:
            place = at(site, layer)
            if site.name in values:
                values[site.name].append(kept(site, place))
        at(RESID, layer)
        for site in after:
            place = at(site, layer)
            if site.name in values:
                values[site.name].append(kept(site, place))
        blocks.append(view.block_state(layer))
        view.leave(layer)
    return embedded, blocks, values


CAPTURE = register_program(Program("capture", 1, Needs(writes=True), capture_body,
                                   "base runs: the embedding, every block's state and the named sites, and the metric"))


@dataclass
class CaptureRequest:
    """Base runs to capture: each prompt of ``prompts`` ([1, T] ids, one length) once, or (one
    prompt) once per list of ``ops`` (run ``i`` under ``ops[i]``); ``sites``: the values to
    keep besides the blocks' states."""

    prompts: Sequence[torch.Tensor]
    metric: Metric
    sites: Sequence[Site] = ()
    ops: Sequence[Sequence[Op]] | None = None
    keep: list[Site] = field(init=False)

    def __post_init__(self) -> None:
        if self.ops is not None and len(self.prompts) != 1:
            raise ValueError("runs under ops capture one prompt")
        self.keep = kept_sites(self.sites)

    @property
    def runs(self) -> list[list[Op]]:
        """Each run's ops (none for a plain run of each prompt)."""
        return [list(run) for run in self.ops] if self.ops is not None else [[] for _ in self.prompts]

    def prompt_of(self, run: int) -> torch.Tensor:
        return self.prompts[0] if self.ops is not None else self.prompts[run]


def capture(backend: Any, input_ids: torch.Tensor, metric: Metric, sites: Sequence[Site] = (), *,
            ops: Sequence[Sequence[Op]] | None = None) -> Capture:
    """Run ``input_ids`` ([1, T]) once per list of ``ops`` (one clean run for ``None``),
    keeping every block's state and the named sites: one :class:`~pipatch._model.cells.Capture`
    whose batch rows are the runs."""
    return backend.run(CAPTURE, CaptureRequest([input_ids], metric, sites, ops))[0]


def captures(backend: Any, prompts: Sequence[torch.Tensor], metric: Metric, sites: Sequence[Site] = ()) -> list[Capture]:
    """Each prompt's capture ([1, T] ids each, one length), in one trace where the backend can."""
    return backend.run(CAPTURE, CaptureRequest(list(prompts), metric, sites))
