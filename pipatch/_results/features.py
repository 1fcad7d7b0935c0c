"""What :func:`pipatch.features` returns: which latents fire where, as a grid and a table.

A :class:`LatentsResult` is a :class:`~pipatch.Result` whose views are the SAEs read (one per
latent site, by its name), whose rows are ranks (``"top 1"`` … ``"top k"``) and whose columns
are the prompt's positions read: ``raw[sae][0, r, p]`` is the ``r``-th largest latent
activation at position ``p`` (NaN where fewer than ``r + 1`` latents fire). Which latent each
is, its label and its top contexts are kept in ``meta`` (plain JSON, so a saved result holds
them: :meth:`~pipatch.Result.save` and :func:`~pipatch.load_result` as for every result):

* ``meta["latents"][sae]``: ranks × positions of latent ids (``None``: none fires there);
* ``meta["labels"][sae]``: ``{id: label}`` of the latents shown that have one;
* ``meta["contexts"][sae]``: ``{id: [[window, activation], ...]}`` of the latents shown, where
  the SAE's folder holds contexts (:func:`pipatch.feature_contexts`).

Its table (:meth:`LatentsResult.frame`) has one row per (SAE, position, latent shown).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._base.errors import PipatchError
from .._base.tables import table
from .result import Result
from .views import conform_state

__all__ = ["LatentsResult", "latent_note", "NOTE_CONTEXTS"]

COLUMNS = ["sae", "position", "token", "rank", "latent", "value", "label"]
#: How many of a latent's top contexts its hover text shows (all are in ``meta``).
NOTE_CONTEXTS = 3


def latent_note(label: str, contexts: Sequence[tuple[str, float]], head: str = "") -> str:
    """A latent's hover text, one line each: ``head`` (which latent), its label and its top
    :data:`NOTE_CONTEXTS` contexts with their activations; lines with nothing to say left out
    at either end."""
    found = [f"{window}  ({value:.3g})" for window, value in contexts[:NOTE_CONTEXTS]]
    return "\n".join([head, label, *found]).strip("\n")


class LatentsResult(Result, file_kind="features"):
    """Latent activations, top-k per position, per SAE (see the module docstring)."""

    def latents(self, sae: str | None = None) -> torch.Tensor:
        """Latent ids of ``sae``'s view (default the first): [k, positions] int64, −1 where none fires."""
        ids = self.meta["latents"][self._view(sae)]
        return torch.tensor([[-1 if i is None else int(i) for i in row] for row in ids], dtype=torch.long)

    def label(self, latent: int, sae: str | None = None) -> str:
        """The label of ``latent`` of ``sae`` (default the first), ``""`` where it has none."""
        return str(self.meta.get("labels", {}).get(self._view(sae), {}).get(str(int(latent)), ""))

    def contexts(self, latent: int, sae: str | None = None) -> list[tuple[str, float]]:
        """The top contexts of ``latent`` of ``sae`` (default the first) as ``(window,
        activation)``, largest first; none where the SAE's folder held no contexts or the
        latent was not shown."""
        found = self.meta.get("contexts", {}).get(self._view(sae), {}).get(str(int(latent)), [])
        return [(str(window), float(value)) for window, value in found]

    def frame(self):
        """One row per (SAE, position, latent shown), largest first at each position:
        ``sae``, ``position`` (in the prompt), ``token``, ``rank`` (0: the largest there),
        ``latent`` (its id), ``value`` (its activation) and ``label`` (``""``: none). A pandas
        DataFrame."""
        rows = []
        positions = self.meta.get("positions") or list(range(len(self.columns)))
        for view in self.views:
            ids, values = self.latents(view), self.raw[view][0]
            for col, position in enumerate(positions):
                for rank in range(ids.shape[0]):
                    latent = int(ids[rank, col])
                    if latent < 0:
                        continue
                    rows.append([view, int(position), self.tokens[position], rank, latent,
                                 float(values[rank, col]), self.label(latent, view)])
        return table(rows, columns=COLUMNS)

    def edges(self):
        raise PipatchError("edges() is a circuit's table; this is a features result: use frame()")

    def to_state(self, *, live: bool = False) -> dict[str, Any]:
        """Any result's view state (:meth:`pipatch.Result.to_state`), its rows ranks: a row
        holds a different latent at each position, so each cell has the note
        (``cell_notes``, per view, row-major): which latent it is, its label and top contexts
        (:func:`latent_note`; ``""`` where none fires)."""
        notes = {view: [latent_note(self.label(i, view), self.contexts(i, view), f"latent {i}") if i is not None else ""
                        for row in self.meta.get("latents", {}).get(view, []) for i in row]
                 for view in self.views}
        return {**super().to_state(live=live), **conform_state({"row_axis": "rank", "cell_notes": notes})}

    def __repr__(self) -> str:
        k = len(self.layers)
        fired = sum(int((self.latents(view) >= 0).sum()) for view in self.views)
        return (f"<pipatch.LatentsResult {self.status}: top {k} latents at {len(self.columns)} positions of "
                f"{len(self.views)} SAE{'s' if len(self.views) != 1 else ''} ({', '.join(self.views)}), "
                f"{fired} shown>")


def top_latents(latents: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[int | None]]]:
    """The ``k`` largest of ``latents`` ([P, d_sae]) at each position: values [k, P] (NaN where
    fewer fire) and ids, ranks × positions (``None`` there). Only positive activations fire."""
    values, ids = latents.topk(min(k, latents.shape[-1]), dim=-1)  # [P, k], largest first
    short = k - values.shape[-1]  # a narrower SAE than k: its last ranks never fire
    values = torch.cat([values, values.new_zeros(values.shape[0], short)], dim=-1).T.contiguous()
    fired = values > 0
    rows = ids.T.tolist() + [[0] * ids.shape[0]] * short
    shown: list[list[Any]] = [[i if f else None for i, f in zip(row, frow)] for row, frow in zip(rows, fired.tolist())]
    return torch.where(fired, values, math.nan), shown
