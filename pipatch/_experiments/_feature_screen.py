"""Screening latents by attribution, choosing which to patch exactly, and the feature result.

An SAE at one layer has thousands of latents; a prompt has a dozen positions. Patching every
(latent, position) cell exactly is a forward pass each, so a feature sweep
(:func:`pipatch.feature_patch`) *screens* them all first, the way attribution patching
(:mod:`pipatch._experiments.attribution`) screens components: one clean run, one corrupt run
and one backward pass give, for every cell,

.. math::

    \\Delta M \\approx (f_{clean} - f_{corrupt})[p, i] \\cdot \\frac{\\partial M}{\\partial f[p, i]}
    \\Big|_{corrupt}

where ``f`` are the SAE's latents. The backward pass stops at the value the SAE writes
(``x``, a block's output or a transcoder's MLP output): a latent reaches the metric only
through ``decode``, so ``dM/df = dM/dx · d decode/df`` (:func:`latent_gradient`: the
vector–Jacobian product of ``decode``, ``W_dec``'s rows for a linear decoder). The error node
(:class:`~.._model.features.site.ErrorSite`) decodes by the identity, so its score is ``dM/dx · (e_clean −
e_corrupt)`` summed over the width: one number per position.

The cells with the largest ``|score|`` (:func:`top_cells`) are then patched exactly, and the
result (:class:`FeaturePatchResult`) keeps both numbers, like attribution's ``verify=``. Nothing
here runs a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._base.checks import is_whole
from .._base.errors import PipatchError
from .._base.tables import table
from .._model.sites import Site
from .._results.features import latent_note
from .._results.result import Result, _nanmean, recovery_undefined
from .._results.views import conform_state

__all__ = ["latent_gradient", "cell_scores", "top_cells", "check_latents", "FeaturePatchResult", "FeatureTraceResult",
           "ERROR"]

#: A feature result's ``latent`` for its error row (:meth:`FeaturePatchResult.frame`).
ERROR = "error"


def latent_gradient(site: Site, value: torch.Tensor, holder_grad: torch.Tensor) -> torch.Tensor:
    """``dM / d site value`` from ``dM / d holder value``: the chain rule through ``decode``.

    Parameters
    ----------
    site
        An encoding site (a :class:`~.._model.features.site.LatentSite`, its :class:`~.._model.features.site.ErrorSite`): a
        write adds ``decode(edited) − decode(value)`` to its holder.
    value
        The site's value where the gradient was taken, ``[rows, T, width]``.
    holder_grad
        ``dM/dx`` at the holder the site writes, ``[rows, T, d]`` (what
        :func:`pipatch._programs.gradients.gradients` returns for it).

    Returns
    -------
    torch.Tensor
        ``[rows, T, width]`` in ``value``'s dtype: ``holder_grad @ W_dec.T`` for an SAE,
        ``holder_grad`` itself for an error site.
    """
    point = value.detach().requires_grad_(True)
    with torch.enable_grad():
        decoded = site.decode(point)
        (grad,) = torch.autograd.grad(decoded, point, grad_outputs=holder_grad.to(decoded.device, decoded.dtype))
    return grad


def cell_scores(site: Site, clean: torch.Tensor, corrupt: torch.Tensor, holder_grad: torch.Tensor) -> torch.Tensor:
    """Attribution scores of every element of ``site``'s value, ``[T, width]`` (float32):
    ``(clean − corrupt) · dM/d value`` at the corrupt run (one prompt: the first row).
    Sum over the width for a score per position (an error node's)."""
    grad = latent_gradient(site, corrupt, holder_grad)
    return ((clean.float() - corrupt.float()) * grad.float())[0]


def top_cells(scores: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """The ``k`` cells ``(row, col)`` of ``scores`` ([rows, cols]) with the largest
    ``|score|``, largest first (ties in row-major order); all of them when ``k`` is more."""
    order = scores.abs().flatten().argsort(descending=True, stable=True)[:k].tolist()
    cols = scores.shape[1]
    return [(i // cols, i % cols) for i in order]


def rows_of(cells: Sequence[tuple[int, int]]) -> list[int]:
    """The rows ``cells`` touch, each once, in the order they first appear."""
    return list(dict.fromkeys(row for row, _ in cells))


def check_latents(latents: Any, n_latents: int, what: str) -> list[int]:
    """``latents`` as a list of distinct latent ids in ``[0, n_latents)``; one
    :class:`PipatchError` line naming the bad one and the range otherwise."""
    if isinstance(latents, (int, str)) or not isinstance(latents, Sequence):
        latents = [latents]
    out = []
    for latent in latents:
        if not is_whole(latent) or not 0 <= latent < n_latents:
            raise PipatchError(f"latent {latent!r} is not a latent of {what}: pass ids from 0 to {n_latents - 1}")
        out.append(int(latent))
    if not out:
        raise PipatchError("latents is empty: pass at least one latent id, or leave it out to screen them all")
    twice = sorted({i for i in out if out.count(i) > 1})
    if twice:
        raise PipatchError(f"latent {twice[0]} is given twice in latents: pass each id once")
    return out


class FeaturePatchResult(Result, file_kind="feature_patch"):
    """A feature sweep's result: rows are latents (and the SAE's error), columns positions.

    ``raw[site]`` ([1, rows, columns]) holds every cell's screening estimate (corrupt metric
    + attribution score); ``meta["verified_values"]`` the exactly patched cells with both
    numbers, as attribution's ``verify=`` keeps them; ``meta["latents"]`` each row's latent id
    (``"error"`` for the error row); ``meta["agreement"]`` their rank correlation;
    ``meta["labels"]`` and ``meta["contexts"]`` the rows' labels and top contexts
    (``{site: {id: ...}}``), the grid's hover text.
    """

    @property
    def latents(self) -> list[int | str]:
        """Each row's latent id, ``"error"`` for the SAE's error row."""
        return list(self.meta.get("latents", []))

    def label(self, latent: int) -> str:
        """The label of row latent ``latent``, ``""`` where it has none."""
        return str(self.meta.get("labels", {}).get(self.views[0], {}).get(str(int(latent)), ""))

    def contexts(self, latent: int) -> list[tuple[str, float]]:
        """The top contexts of row latent ``latent`` as ``(window, activation)``, largest
        first; none where the SAE's folder held no contexts."""
        found = self.meta.get("contexts", {}).get(self.views[0], {}).get(str(int(latent)), [])
        return [(str(window), float(value)) for window, value in found]

    def to_state(self, *, live: bool = False) -> dict[str, Any]:
        """Any result's view state (:meth:`pipatch.Result.to_state`), its rows latents: each
        row's note is its label and its top contexts, one per line (:func:`~.._results.features.latent_note`)."""
        notes = []
        for latent in self.latents:
            if latent == ERROR:
                notes.append("the SAE's error: the part of the value it does not explain")
                continue
            notes.append(latent_note(self.label(int(latent)), self.contexts(int(latent))))
        return {**super().to_state(live=live), **conform_state({"row_axis": "latent", "row_notes": notes})}

    def exact(self) -> torch.Tensor:
        """The exact patches' normalized recovery, tensor[rows, columns] (NaN where unchecked):
        each seed's recovery against its own corrupt run, averaged over the seeds (one seed
        but for a feature trace)."""
        raw = torch.full(self.raw[self.views[0]].shape, float("nan"))
        for entry in self.meta.get("verified_values", []):
            if entry["actual"] is not None:
                raw[entry.get("seed", 0), entry["layer"], entry["col"]] = entry["actual"]
        clean, corrupt = self.clean_seeds, self.corrupt_seeds
        out = (raw - corrupt.reshape(-1, 1, 1)) / (clean - corrupt).reshape(-1, 1, 1)
        out[[recovery_undefined(float(a), float(c)) for a, c in zip(clean, corrupt)]] = float("nan")
        return _nanmean(out)

    def frame(self):
        """A long pandas DataFrame, one row per (latent, position) cell of the grid:
        ``latent`` (its id, or ``"error"``), ``position`` (the prompt position), ``value``
        (the screening estimate) and ``exact`` (the exact patch, NaN where none ran), both
        as normalized recovery, like :attr:`grid`."""
        grid, exact = self.grid, self.exact()
        positions = self.meta.get("positions", list(range(grid.shape[1])))
        rows = [{"latent": latent, "position": positions[col], "value": float(grid[row, col]),
                 "exact": float(exact[row, col])}
                for row, latent in enumerate(self.latents) for col in range(grid.shape[1])]
        return table(rows, ["latent", "position", "value", "exact"])


class FeatureTraceResult(FeaturePatchResult, file_kind="feature_trace"):
    """A feature trace's result (:func:`pipatch.feature_trace`): a :class:`FeaturePatchResult`
    with one grid per noise seed, ``raw[site]`` [seeds, rows, columns] and ``corrupt`` [seeds];
    its ``meta["verified_values"]`` name each exact patch's ``seed``, and :attr:`grid`,
    :meth:`exact` and :meth:`frame` average each seed's recovery over the seeds."""
