"""Feature patching: activation patching whose rows are an SAE's latents, not layers.

``pipatch.patch`` asks which *layer* (at which position) carries the clean prompt's answer.
With an SAE loaded at a layer (:func:`pipatch.load_sae`), the question becomes which
*latents*: denoise the corrupt run by writing one clean latent value at one position, through
the SAE (decode the edited latents, keep the SAE's error), and read the metric. A cell is one
(latent, position) pair, and there are ``n_latents × positions`` of them (16k × a dozen for a
Gemma Scope 2 SAE): too many forward passes. So the sweep

1. **screens** every cell by attribution patching (one clean run, one corrupt run, one backward
   pass: :mod:`pipatch._features._screen` for the formula, the gradient pass of
   :mod:`pipatch._protocols.attribution`), which fills the whole grid with estimates;
2. **patches exactly** the ``top_k`` cells with the largest estimated effect, and keeps both
   numbers with their rank correlation (``meta["agreement"]``), as ``attribute(verify=)`` does.

``latents=[...]`` patches those latents' rows exactly at every position instead, and
``exhaustive=True`` every latent's (a small SAE, or a check of the screening itself).

The grid's rows are the latents chosen (in order of their largest estimated effect), then one
row for the SAE's **error** (``"L12 error"``: the part of the value the SAE does not explain,
patched clean-into-corrupt like a latent, exactly at every position), so a large error row
says the SAE misses what carries the answer. The grid reads as normalized recovery, like a
patching grid; :meth:`~pipatch._features._screen.FeaturePatchResult.frame` lists every cell with its
latent id, position, estimate and exact value.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .. import _code
from .._cells import Base, Cell, Op
from .._checks import flag, whole_number
from .._declare import PAIR, Experiment, Param, positive_int
from .._declare import positions as id_list
from .._engine import Sweep, check_batch_size
from .._errors import PipatchError
from .._features import LatentSite, load_sae
from .._features._contexts import load_contexts
from .._features._labels import labels_next_to, load_labels
from .._features._screen import ERROR, FeaturePatchResult, cell_scores, check_latents, rows_of, top_cells
from .._features._site import ErrorSite
from .._programs.capture import captures
from .._programs.gradients import gradients
from .._result import load_result
from ._feature_code import feature_patch_code
from ._inputs import (
    BATCH_SIZE,
    METRIC,
    PAIR_PARAMS,
    POSITIONS,
    model_meta,
    pair_title,
    sweep_positions,
    undefined_recovery_warning,
)
from .attribution import Checks, VerifiedPlan
from .patching import pair_inputs

__all__ = ["plan_feature_patch", "LatentSweep", "DECLARATION"]


def latent_site_of(site: Any, backend: Any) -> LatentSite:
    """The latent site ``site`` names: a :class:`LatentSite` as it is, or an SAE folder
    loaded onto the backend's model (how the CLI and the magics name one)."""
    if isinstance(site, LatentSite) and not isinstance(site, ErrorSite):
        return site
    if isinstance(site, (str, Path)) and Path(site).expanduser().is_dir():
        return load_sae(site, backend.model)
    raise PipatchError(f"site {site!r} is no latent site: pass site=pipatch.load_sae(..., model), or an SAE "
                       "folder (SAELens's or Gemma Scope 2's format)")


def plan_feature_patch(
    backend,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None,
    site: Any,
    metric: str,
    top_k: int,
    latents: Sequence[int] | None,
    exhaustive: bool,
    positions: Sequence[int] | None,
    batch_size: int | None,
    labels: Any = None,
    scores: Any = None,
) -> VerifiedPlan:
    """Screen every (latent, position) cell; plan the exact patches of the chosen ones.

    ``backend`` runs the model; the other parameters are :func:`pipatch.feature_patch`'s.
    The screening runs here (the returned plan's grid is complete); running the plan patches
    the chosen cells and the error row exactly. ``scores`` (a feature patch's result computed
    on a model that takes gradients, or its file) stands in for the screening: its rows and
    estimates are taken and its checked cells patched here.
    """
    target = latent_site_of(site, backend)
    error = target.error_site
    top_k = whole_number(top_k, "top_k (the screened cells to patch exactly)", minimum=1)
    exhaustive = flag(exhaustive, "exhaustive")
    if exhaustive and latents is not None:
        raise PipatchError("exhaustive=True patches every latent and latents= only those given: pass one of them")
    chosen = None if latents is None else check_latents(latents, target.n_latents, target.name)
    named = labels_next_to(target.sae.folder) if labels is None else load_labels(labels)
    contexts = load_contexts(target.sae.folder)
    pair = pair_inputs(backend, clean, corrupt, answer, foil, metric)
    T = pair.clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T, backend)
    scorer, layer = pair.metric, target.layer

    if scores is None and not backend.capabilities.gradients:
        raise PipatchError(f"feature_patch screens by gradients, which the {backend.name} backend does not compute: "
                           "screen on backend='transformers' (the default) and patch here, "
                           "pipatch.feature_patch(..., scores=result)")
    clean_run, corrupt_run = captures(backend, [pair.clean_ids, pair.corrupt_ids], scorer, [target, error])
    clean_value, corrupt_value = float(clean_run.metric[0]), float(corrupt_run.metric[0])
    clean_latents, clean_error = clean_run.sites[target.name][layer], clean_run.sites[error.name][layer]
    n_cols = len(cols)
    if scores is not None:
        rows, estimate, only = _given_scores(scores, target, cols)
    else:
        rows, estimate, only = _screen(backend, pair, target, cols, clean_latents, clean_error, corrupt_run,
                                       top_k, chosen, exhaustive)

    meta = model_meta(backend)
    meta.update({
        **pair.meta(backend), "site": target.name, "sae": target.sae.name, "layer": layer, "col_axis": "token",
        "direction": "denoise", "positions": cols, "latents": [*rows, ERROR], "n_latents": target.n_latents,
        "top_k": top_k, "exhaustive": bool(exhaustive), "saes": [target.describe()],
        "estimate": "attribution patching: grad(metric) at the corrupt run through decode · (clean − corrupt) latents",
        "verified": {target.name: [[0.0] * n_cols for _ in range(len(rows) + 1)]},
    })
    meta["labels"] = {target.name: {str(i): named[i] for i in rows if i in named}}
    meta["contexts"] = {target.name: {} if contexts is None else {
        str(i): [list(c) for c in contexts.top(i)] for i in rows if i < contexts.activation.shape[0] and contexts.top(i)}}
    ordered = sorted(only, key=lambda cell: (-abs(float(estimate[cell])), cell))
    meta["verified_values"] = [{"layer": r, "col": c, "estimate": corrupt_value + float(estimate[r, c]), "actual": None}
                               for r, c in ordered]
    result = FeaturePatchResult(
        kind="feature_patch", tokens=pair.clean_tokens, columns=[pair.clean_tokens[p] for p in cols],
        layers=[f"L{layer} #{i}" for i in rows] + [f"L{layer} error"], metric=scorer.label,
        raw={target.name: (corrupt_value + estimate).unsqueeze(0)}, clean=clean_value,
        corrupt=torch.tensor([corrupt_value]), meta=meta,
        warnings=undefined_recovery_warning(scorer.label, clean_value, corrupt_value),
        rows_done={target.name: len(rows) + 1},
    )
    differ = (pair.clean_ids[0] != pair.corrupt_ids[0]).nonzero()
    sweep = LatentSweep(view=target.name, base=Base(pair.corrupt_ids, corrupt_run), metric=scorer,
                        n_rows=len(rows) + 1, n_cols=n_cols, only=only, agrees_before=int(differ[0]) if len(differ) else T,
                        site=target, latents=[*rows, None], positions=cols,
                        donors={target.name: clean_latents, error.name: clean_error})
    return VerifiedPlan(backend, result, [sweep], batch, True)


def _screen(backend: Any, pair: Any, target: LatentSite, cols: list[int], clean_latents: torch.Tensor,
            clean_error: torch.Tensor, corrupt_run: Any, top_k: int, chosen: list[int] | None,
            exhaustive: bool) -> tuple[list[int], torch.Tensor, set[tuple[int, int]]]:
    """The screening: every (latent, position) cell's attribution estimate from one gradient
    pass of the corrupt run; ``(rows, estimate [rows + error, C], cells to patch)``: the
    latents shown (every one, ``chosen``, or those of the ``top_k`` cells), their estimates
    and the error row's, and the cells patched exactly (the error row's always)."""
    error, layer = target.error_site, target.layer
    values, grads, _ = gradients(backend, pair.corrupt_ids, pair.metric, target)
    latent_scores = cell_scores(target, clean_latents, values[layer], grads[layer])[cols].T  # [n_latents, C]
    error_scores = cell_scores(error, clean_error, corrupt_run.sites[error.name][layer], grads[layer])[cols].sum(-1)
    if exhaustive:
        rows, checked = list(range(target.n_latents)), None
    elif chosen is not None:
        rows, checked = chosen, None
    else:
        cells = top_cells(latent_scores, top_k)
        rows = rows_of(cells)
        checked = {(rows.index(latent), col) for latent, col in cells}
    n_cols = len(cols)
    estimate = torch.cat([latent_scores[rows], error_scores[None]])
    only = ({(r, c) for r in range(len(rows) + 1) for c in range(n_cols)} if checked is None
            else checked | {(len(rows), c) for c in range(n_cols)})
    return rows, estimate, only


def _given_scores(value: Any, target: LatentSite, cols: list[int]) -> tuple[list[int], torch.Tensor,
                                                                            set[tuple[int, int]]]:
    """``scores=``: the screening of a feature patch computed elsewhere (its result, or the
    file it was saved to), for a backend that takes no gradients (vLLM, a served model):
    its rows, estimates and checked cells, as :func:`_screen` returns them. It must be of the
    same SAE at the same positions."""
    found = load_result(value) if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(found, FeaturePatchResult):
        raise PipatchError(f"scores={type(value).__name__}: give the result of pipatch.feature_patch (or the file it "
                           "was saved to) computed on a model that takes gradients (backend='transformers')")
    if (found.meta.get("sae"), found.meta.get("positions")) != (target.sae.name, cols):
        raise PipatchError(f"scores=: it screened SAE {found.meta.get('sae')!r} at positions {found.meta.get('positions')}, "
                           f"this run {target.sae.name!r} at {cols}: screen the same SAE and positions and pass that result")
    rows = [latent for latent in found.meta["latents"] if latent != ERROR]
    estimate = (found.raw[target.name][0] - float(found.corrupt[0])).float()
    return rows, estimate, {(entry["layer"], entry["col"]) for entry in found.meta["verified_values"]}


@dataclass
class LatentSweep(Checks, Sweep):
    """Exact denoising patches of (latent, position) cells: cell ``(row, col)`` writes the
    clean value of latent ``latents[row]`` at position ``positions[col]`` through ``site``
    (the error site's whole value where ``latents[row]`` is ``None``). Values go to
    ``meta["verified_values"]`` beside the screening estimate, not into the grid."""

    site: LatentSite | None = None
    latents: list[int | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    donors: dict[str, torch.Tensor] = field(default_factory=dict)  # clean values at the site's layer, [1, T, width]

    def cell(self, row: int, col: int, seed: int) -> Cell:
        site, latent, position = self.site, self.latents[row], self.positions[col]
        assert site is not None, "a LatentSweep needs its site"
        if latent is None:
            site = site.error_site
            op = Op(site, site.layer, site.cell(position), self.donors[site.name][:, [position]])
        else:
            op = Op(site, site.layer, site.cell(position, latent), self.donors[site.name][:, [position], latent:latent + 1])
        return Cell(row, col, seed, start=site.start_layer(site.layer), ops=[op])


def _title(meta: dict) -> str:
    return pair_title("Feature patching", meta, f"denoise, {meta.get('site', 'latents')}")


DECLARATION = Experiment(
    name="feature_patch", kind="feature_patch", noun="feature patching",
    summary="Feature patching: screen every SAE latent × position by attribution, patch the top ones exactly.",
    planner=plan_feature_patch, prompts=PAIR, title=_title,
    params=(
        *PAIR_PARAMS,
        Param("site", help="the latent site (pipatch.load_sae(..., model)), or an SAE folder", annotation="Any"),
        METRIC,
        Param("top_k", 20, "how many screened (latent, position) cells to patch exactly, largest |estimated effect| "
              "first", "int", parse=positive_int),
        Param("latents", None, "latent ids whose rows to patch exactly at every position, instead of the top_k cells",
              "Sequence[int] | None", parse=id_list, shown="the screened top_k",
              flag_help="as a flag: 12,345"),
        Param("exhaustive", False, "patch every latent at every position exactly (a small SAE)", "bool", switch=True),
        replace(POSITIONS, help="the positions (columns) to screen and patch"),
        BATCH_SIZE,
        Param("labels", None, "latent labels, shown on hover: a Neuronpedia export or {id: label} JSON file, or a dict",
              "Any", shown="the labels.json next to the SAE"),
        Param("scores", None, "the screening of a feature patch computed elsewhere (its result, or the file it was "
              "saved to): a model that takes no gradients (vLLM, served) patches its cells exactly",
              "Result | str | None", shown="computed here"),
    ),
    example='%%feature_patch --site saes/L3 --answer " Paris" --foil " Rome" --top-k 10 -o feats\n'
            "clean: The Eiffel Tower is in the city of\n"
            "corrupt: The Colosseum is in the city of",
    doc="""
    See :mod:`pipatch._protocols.feature_patch` for the method.

    Returns
    -------
    FeaturePatchResult
        ``kind="feature_patch"``; rows are the latents chosen, then the SAE's error
        (``meta["latents"]``: their ids, ``"error"``), columns the positions. ``raw[site]``
        is tensor[1, rows, columns] of ``corrupt metric + estimated change`` and
        ``result.grid`` its normalized recovery. ``meta["verified_values"]`` holds the exact
        patches (``{"layer": row, "col", "estimate", "actual"}``, raw metric units),
        ``meta["agreement"]`` their rank correlation with the screening, and ``frame()`` one
        line per (latent, position) cell: ``latent``, ``position``, ``value``, ``exact``.
        ``meta["labels"]`` and ``meta["contexts"]`` hold the rows' labels and top contexts
        (``{site: {id: ...}}``, as :func:`pipatch.features` keeps them), shown on hover in
        the grid.

    Examples
    --------
    >>> sae = pipatch.load_sae("saes/L3", model)
    >>> r = pipatch.feature_patch(model, clean="The Eiffel Tower is in the city of",
    ...                           corrupt="The Colosseum is in the city of",
    ...                           answer=" Paris", foil=" Rome", site=sae, top_k=10)
    >>> r.frame().dropna()
    """,
    code=feature_patch_code, code_inputs=_code.pair_inputs,
)
