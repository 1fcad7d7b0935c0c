"""What every backend says the same way about its model: the result's metadata, token text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Described"]


class Described:
    """Mixin for a backend with ``name``, ``adapter``, ``kind``, ``dtype``, ``tokenizer`` and
    ``runs_on`` (where the forward passes run: ``"cpu"``, ``"cuda:0"``, ...)."""

    #: Whether ``run(..., fast=True)`` starts each cell at its ``start`` layer from the base
    #: run's states, so a sweep's higher rows cost less (the engine then runs them first).
    starts_at_layer = False
    #: The FLOPs of one position through one block, about (the engine bounds how much work
    #: rows that share their traces may hold by it); 0 where the backend does not say.
    position_flops = 0

    def meta(self) -> dict[str, Any]:
        """What a result records about the model."""
        return {"model": self.name, "family": self.adapter.family, "backend": self.kind,
                "dtype": str(self.dtype).replace("torch.", ""), "device": self.runs_on}

    def prefix_reuse(self, base: Any) -> bool:
        """Whether ``run`` starts a batch of cells of ``base`` at their first written position
        (the engine then groups cells by it). No, unless a backend says so."""
        return False

    def pack_tokens(self, base: Any, metric: Any) -> int:
        """How many positions one trace holds where ``run`` packs each cell of ``base`` from its
        own first written position (the engine then cuts a row's cells into traces of about
        that many), or 0: it does not. Not, unless a backend says so."""
        return 0

    def captures(self, prompts: Sequence[Any], metric: Any, sites: Sequence[Any] = ()) -> list[Any]:
        """Each prompt's :meth:`capture` ([1, T] ids each, one length). A backend may run them
        together: the transformers backend runs them in one trace."""
        return [self.capture(ids, metric, sites) for ids in prompts]

    def shares_unembedding(self, metric: Any) -> bool:
        """Whether the metric of many cells costs less computed in one ``run_many`` call than
        in several (the engine then lets rows finish together). No, unless a backend says so."""
        return False

    def run_many(self, base: Any, batches: Sequence[list[Any]], metric: Any, *, fast: bool = True) -> list[Any]:
        """Several batches of cells, each run as ``run`` runs it (one trace each) → the metric
        per cell of each batch. A backend may finish them together: the transformers backend
        computes every batch's metric in one product with the unembedding."""
        return [self.run(base, cells, metric, fast=fast)[0] for cells in batches]

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Each token id's text, alone."""
        return [self.tokenizer.decode([int(i)]) for i in ids]
