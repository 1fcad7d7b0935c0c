"""How a program's body sees a trace of an nnsight transformers model (in this process or on
NDIF): :class:`~pipatch._programs._program.View`\\ s over its batch.

* :class:`RowsView`: jobs side by side as batch rows (``rows_per_job`` rows each: a run's
  inputs), from prompt position ``start`` on; the blocks below ``below`` skipped with
  ``skipped`` states (the base runs' outputs of those blocks, for the batch's rows).
* :class:`PackedView`: jobs packed into rows, each from its own position and ``start`` layer
  (:class:`~._packing.Packed`): block ``k`` runs the rows from ``active[k]`` on, the rows
  before take the base runs' output of the block.

A site's holder value is the nnsight value :meth:`pipatch._sites.Site.value` names, as a
:class:`~pipatch._sites.TensorPlace`; a block's state is its raw output, cloned, in its own
structure (a tensor, or a tuple around one), as a later run skips the block with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._models import Adapter
from .._programs._program import View
from .._sites import Place, Site, TensorPlace
from ._packing import Packed

__all__ = ["RowsView", "PackedView"]


class RowsView(View):
    """Jobs as batch rows side by side (see the module docstring)."""

    def __init__(self, adapter: Adapter, model: Any, rows_per_job: int = 1, start: int = 0, below: int = 0,
                 skipped: Sequence[Any] = ()):
        super().__init__(adapter, model, rows_per_job, start)
        self.below, self.skipped = below, skipped

    def holder(self, site: Site, layer: int) -> Place:
        return TensorPlace(site.value(self.adapter, self.model, layer))

    def enter(self, layer: int) -> None:
        if layer < self.below:
            self.adapter.block(self.model, layer).skip(self.skipped[layer])

    def block_state(self, layer: int) -> Any:
        out = self.adapter.block(self.model, layer).output
        if isinstance(out, tuple):
            return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
        return out.clone()


class PackedView(View):
    """Jobs packed into rows (see the module docstring): job ``j`` is ``pack.spans[j]``, its
    ops' positions shifted by its own first position."""

    def __init__(self, adapter: Adapter, model: Any, pack: Packed):
        super().__init__(adapter, model)
        self.pack = pack
        self.layer = 0
        self.partly = False
        self._widened: torch.Tensor | None = None

    def holder(self, site: Site, layer: int) -> Place:
        if self.partly and site.is_block_output:  # the rows it ran, and the base runs' for the others
            if self._widened is None:
                self._widened = self.pack.widen(self.adapter.block(self.model, layer), layer)
            return TensorPlace(self._widened)
        return TensorPlace(site.value(self.adapter, self.model, layer))

    def rows(self, job: int, site: Site) -> Any:
        row, span = self.pack.spans[job]
        if not (site.is_embedding or site.is_block_output):  # a site the block computes: its rows only
            row -= self.pack.active[self.layer]
        return slice(row, row + 1), span

    def index(self, job: int, op: Any) -> tuple:
        return op.index_from(self.pack.starts[job])

    def enter(self, layer: int) -> None:
        pack, block = self.pack, self.adapter.block(self.model, layer)
        self.layer, self._widened = layer, None
        active = pack.active[layer]
        self.partly = 0 < active < pack.n_rows
        if active == pack.n_rows:
            block.skip(pack.base_output(layer))
        elif self.partly:
            args, kwargs = block.inputs
            block.inputs = pack.narrowed(args, active), pack.narrowed(kwargs, active)

    def leave(self, layer: int) -> None:
        if self.partly and self._widened is None:
            self.pack.widen(self.adapter.block(self.model, layer), layer)
