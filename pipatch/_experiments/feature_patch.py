"""Feature patching: activation patching whose rows are an SAE's latents, not layers.

``pipatch.patch`` asks which *layer* (at which position) carries the clean prompt's answer.
With an SAE loaded at a layer (:func:`pipatch.load_sae`), the question becomes which
*latents*: denoise the corrupt run by writing one clean latent value at one position, through
the SAE (decode the edited latents, keep the SAE's error), and read the metric. A cell is one
(latent, position) pair, and there are ``n_latents × positions`` of them (16k × a dozen for a
Gemma Scope 2 SAE): too many forward passes. So the sweep

1. **screens** every cell by attribution patching (one clean run, one corrupt run, one backward
   pass: :mod:`pipatch._experiments._feature_screen` for the formula, the gradient pass of
   :mod:`pipatch._experiments.attribution`), which fills the whole grid with estimates;
2. **patches exactly** the ``top_k`` cells with the largest estimated effect, and keeps both
   numbers with their rank correlation (``meta["agreement"]``), as ``attribute(verify=)`` does.

``latents=[...]`` patches those latents' rows exactly at every position instead, and
``exhaustive=True`` every latent's (a small SAE, or a check of the screening itself).

The grid's rows are the latents chosen (in order of their largest estimated effect), then one
row for the SAE's **error** (``"L12 error"``: the part of the value the SAE does not explain,
patched clean-into-corrupt like a latent, exactly at every position), so a large error row
says the SAE misses what carries the answer. The grid reads as normalized recovery, like a
patching grid; :meth:`~pipatch._experiments._feature_screen.FeaturePatchResult.frame` lists every cell with its
latent id, position, estimate and exact value.

**Directions**, as :func:`pipatch.patch` names them (``direction=``): ``"denoise"`` (the
default) writes the clean latent into the corrupt run; ``"noise"`` the corrupt latent into the
clean run (is the latent *necessary*?); ``"zero"`` and ``"mean"`` ablate it in the clean run
(zero, or its mean at that position over ``mean_prompts``, the pair's two by default). The
screening is the same first-order estimate, ``(written − base) · dM/d latent`` at the run
written into; the grid stays normalized recovery, 1 the clean run's metric, 0 the corrupt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .._base.checks import flag, whole_number
from .._base.errors import PipatchError
from .._engine import Sweep, check_batch_size
from .._model.cells import Base, Cell, Metric, Op
from .._model.declare import PAIR, Experiment, Param, positive_int
from .._model.declare import positions as id_list
from .._model.features import LatentSite, load_sae
from .._model.features.labels import labels_next_to, load_labels
from .._model.features.site import ErrorSite
from .._programs.capture import captures
from .._programs.gradients import GRADIENTS, gradients
from .._results import code as _code
from ._feature_code import feature_patch_code
from ._feature_contexts import load_contexts
from ._feature_screen import (
    ERROR,
    FeaturePatchResult,
    FeatureTraceResult,
    cell_scores,
    check_latents,
    rows_of,
    top_cells,
)
from ._inputs import (
    BATCH_SIZE,
    METRIC,
    PAIR_PARAMS,
    POSITIONS,
    check_choice,
    model_meta,
    pair_title,
    scored_elsewhere,
    sweep_positions,
    undefined_recovery_warning,
)
from .attribution import Checks, VerifiedPlan
from .patching import (
    DIRECTION,
    DIRECTIONS,
    MEAN_PROMPTS,
    direction_base,
    direction_donor,
    mean_prompt_ids,
    pair_inputs,
)

__all__ = ["plan_feature_patch", "screen", "latent_plan", "check_rows", "latent_site_of", "LatentSweep", "DECLARATION"]


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
    direction: str,
    top_k: int,
    latents: Sequence[int] | None,
    exhaustive: bool,
    positions: Sequence[int] | None,
    mean_prompts: Sequence[str] | None,
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
    check_choice(direction, DIRECTIONS, "direction")
    top_k, chosen, exhaustive = check_rows(target, top_k, latents, exhaustive)
    pair = pair_inputs(backend, clean, corrupt, answer, foil, metric)
    T = pair.clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T, backend)
    scorer = pair.metric

    if scores is None:  # one line, from what the program needs
        GRADIENTS.check(backend, "screen on backend='transformers' (the default) and patch here, "
                                 "pipatch.feature_patch(..., scores=result)")
    means = mean_prompt_ids(backend, direction, mean_prompts, pair)
    clean_run, corrupt_run, *mean_runs = captures(backend, [pair.clean_ids, pair.corrupt_ids, *means], scorer,
                                                  [target, error])
    base_run, base_ids = direction_base(direction, pair, clean_run, corrupt_run)
    donors = {s.name: direction_donor(direction, clean_run, corrupt_run, mean_runs, s.name)[target.layer]
              for s in (target, error)}
    base = Base(base_ids, base_run)
    if scores is not None:
        rows, estimate, only = _given_scores(scores, target, cols, direction)
    else:
        rows, estimate, only = screen(backend, base, scorer, target, cols, donors, top_k, chosen, exhaustive)
    differ = (pair.clean_ids[0] != pair.corrupt_ids[0]).nonzero()
    agrees = (int(differ[0]) if len(differ) else T) if direction in ("denoise", "noise") else 0
    meta = {**pair.meta(backend), "direction": direction, "mean_prompts": list(mean_prompts) if mean_prompts else None}
    clean_value, corrupt_value = float(clean_run.metric[0]), float(corrupt_run.metric[0])
    return latent_plan(backend, "feature_patch", meta, target, rows, estimate, only, base, scorer, donors, cols,
                       pair.clean_tokens, clean_value, torch.tensor([corrupt_value]), labels, batch, agrees,
                       top_k=top_k, exhaustive=exhaustive,
                       warnings=undefined_recovery_warning(scorer.label, clean_value, corrupt_value))


def check_rows(target: LatentSite, top_k: Any, latents: Any, exhaustive: Any) -> tuple[int, list[int] | None, bool]:
    """A feature sweep's choice of rows, checked: ``(top_k, the latents chosen or None, exhaustive)``."""
    top_k = whole_number(top_k, "top_k (the screened cells to patch exactly)", minimum=1)
    exhaustive = flag(exhaustive, "exhaustive")
    if exhaustive and latents is not None:
        raise PipatchError("exhaustive=True patches every latent and latents= only those given: pass one of them")
    chosen = None if latents is None else check_latents(latents, target.n_latents, target.name)
    return top_k, chosen, exhaustive


def screen(backend: Any, base: Base, metric: Metric, target: LatentSite, cols: list[int],
           donors: dict[str, torch.Tensor], top_k: int, chosen: list[int] | None,
           exhaustive: bool) -> tuple[list[int], torch.Tensor, set[tuple[int, int]]]:
    """The screening: every (latent, position) cell's attribution estimate, ``(donor − base)
    · dM/d value`` from one gradient pass of each base run (each noise seed's for a trace);
    ``(rows, estimate [seeds, rows + error, C], cells to patch)``: the latents shown (every
    one, ``chosen``, or those of the ``top_k`` cells by their estimate averaged over the
    seeds), their estimates and the error row's, and the cells patched exactly (the error
    row's always)."""
    error, layer = target.error_site, target.layer
    latent_scores, error_scores = [], []
    for seed in range(base.n_seeds):
        values, grads, _ = gradients(backend, base.input_ids, metric, target, base.ops_of(seed))
        latent_scores.append(cell_scores(target, donors[target.name], values[layer], grads[layer])[cols].T)
        own_error = base.capture.sites[error.name][layer][seed : seed + 1]
        error_scores.append(cell_scores(error, donors[error.name], own_error, grads[layer])[cols].sum(-1))
    every, error_rows = torch.stack(latent_scores), torch.stack(error_scores)  # [seeds, n_latents, C], [seeds, C]
    if exhaustive:
        rows, checked = list(range(target.n_latents)), None
    elif chosen is not None:
        rows, checked = chosen, None
    else:
        cells = top_cells(every.mean(0), top_k)
        rows = rows_of(cells)
        checked = {(rows.index(latent), col) for latent, col in cells}
    n_cols = len(cols)
    estimate = torch.cat([every[:, rows], error_rows[:, None]], dim=1)
    only = ({(r, c) for r in range(len(rows) + 1) for c in range(n_cols)} if checked is None
            else checked | {(len(rows), c) for c in range(n_cols)})
    return rows, estimate, only


def latent_plan(backend: Any, kind: str, meta: dict, target: LatentSite, rows: list[int], estimate: torch.Tensor,
                only: set[tuple[int, int]], base: Base, metric: Metric, donors: dict[str, torch.Tensor],
                cols: list[int], tokens: list[str], clean: float, corrupt: torch.Tensor, labels: Any, batch: int,
                agrees_before: int, *, top_k: int, exhaustive: bool, warnings: list[str]) -> VerifiedPlan:
    """The plan of a feature sweep's exact patches and its result, screened: rows ``rows``
    (then the error), ``estimate`` [seeds, rows + 1, C] of the change from each seed's base
    run, ``only`` the cells to patch (each seed's), written from ``donors`` into ``base``.
    ``meta`` holds the experiment's own inputs; the rows' ids, labels and contexts are added."""
    base_values = base.capture.metric.detach().float().cpu()  # [seeds]
    named = labels_next_to(target.sae.folder) if labels is None else load_labels(labels)
    contexts = load_contexts(target.sae.folder)
    n_cols, layer = len(cols), target.layer
    full = model_meta(backend)
    full.update({
        **meta, "site": target.name, "sae": target.sae.name, "layer": layer, "col_axis": "token", "positions": cols,
        "latents": [*rows, ERROR], "n_latents": target.n_latents, "top_k": top_k, "exhaustive": bool(exhaustive),
        "base": base_values.tolist(), "saes": [target.describe()],
        "estimate": "attribution patching: grad(metric) at the base run through decode · (donor − base) latents",
        "verified": {target.name: [[0.0] * n_cols for _ in range(len(rows) + 1)]},
    })
    full["labels"] = {target.name: {str(i): named[i] for i in rows if i in named}}
    full["contexts"] = {target.name: {} if contexts is None else {
        str(i): [list(c) for c in contexts.top(i)] for i in rows if i < contexts.activation.shape[0] and contexts.top(i)}}
    mean = estimate.mean(0)
    ordered = sorted(only, key=lambda cell: (-abs(float(mean[cell])), cell))
    full["verified_values"] = [{"layer": r, "col": c, "seed": s, "estimate": float(base_values[s] + estimate[s, r, c]),
                                "actual": None} for s in range(len(base_values)) for r, c in ordered]
    result_type = FeatureTraceResult if kind == "feature_trace" else FeaturePatchResult
    result = result_type(
        kind=kind, tokens=tokens, columns=[tokens[p] for p in cols],
        layers=[f"L{layer} #{i}" for i in rows] + [f"L{layer} error"], metric=metric.label,
        raw={target.name: base_values.reshape(-1, 1, 1) + estimate}, clean=clean, corrupt=corrupt, meta=full,
        warnings=warnings, rows_done={target.name: len(rows) + 1},
    )
    sweep = LatentSweep(view=target.name, base=base, metric=metric, n_rows=len(rows) + 1, n_cols=n_cols, only=only,
                        agrees_before=agrees_before, site=target, latents=[*rows, None], positions=cols, donors=donors)
    return VerifiedPlan(backend, result, [sweep], batch, True)


def _given_scores(value: Any, target: LatentSite, cols: list[int],
                  direction: str) -> tuple[list[int], torch.Tensor, set[tuple[int, int]]]:
    """``scores=``: the screening of a feature patch computed elsewhere (its result, or the
    file it was saved to), for a backend that takes no gradients (vLLM, a served model):
    its rows, estimates and checked cells, as :func:`screen` returns them. It must be of the
    same SAE at the same positions, in the same direction."""
    found = scored_elsewhere(value, "feature_patch", FeaturePatchResult)
    screened = (found.meta.get("sae"), found.meta.get("positions"), found.meta.get("direction", "denoise"))
    if screened != (target.sae.name, cols, direction):
        raise PipatchError(f"scores=: it screened SAE {screened[0]!r} at positions {screened[1]} ({screened[2]}), "
                           f"this run {target.sae.name!r} at {cols} ({direction}): screen the same SAE and positions "
                           "in the same direction and pass that result")
    rows = [latent for latent in found.meta["latents"] if latent != ERROR]
    base = torch.tensor(found.meta.get("base", found.corrupt_seeds.tolist()), dtype=torch.float32)
    estimate = found.raw[target.name].float() - base.reshape(-1, 1, 1)
    return rows, estimate, {(entry["layer"], entry["col"]) for entry in found.meta["verified_values"]}


@dataclass
class LatentSweep(Checks, Sweep):
    """Exact patches of (latent, position) cells: cell ``(row, col)`` writes the donor's value
    (the clean run's to denoise or restore, the corrupt run's to noise, zeros, a mean) of
    latent ``latents[row]`` at position ``positions[col]`` through ``site`` (the error site's
    whole value where ``latents[row]`` is ``None``) into each base run. Values go to
    ``meta["verified_values"]`` beside the screening estimate, not into the grid."""

    site: LatentSite | None = None
    latents: list[int | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    donors: dict[str, torch.Tensor] = field(default_factory=dict)  # values written, at the site's layer, [1, T, width]

    def cell(self, row: int, col: int, seed: int) -> Cell:
        site, latent, position = self.site, self.latents[row], self.positions[col]
        assert site is not None, "a LatentSweep needs its site"
        if latent is None:
            site = site.error_site
            op = Op(site, site.layer, site.cell(position), self.donors[site.name][:, [position]])
        else:
            op = Op(site, site.layer, site.cell(position, latent), self.donors[site.name][:, [position], latent:latent + 1])
        return Cell(row, col, seed, start=site.start_layer(site.layer), ops=[op])


#: The parameters every feature sweep takes (:func:`pipatch.feature_patch`, :func:`pipatch.feature_trace`).
LATENT_SITE = Param("site", help="the latent site (pipatch.load_sae(..., model)), or an SAE folder", annotation="Any")
TOP_K = Param("top_k", 20, "how many screened (latent, position) cells to patch exactly, largest |estimated effect| "
              "first", "int", parse=positive_int)
LATENTS = Param("latents", None, "latent ids whose rows to patch exactly at every position, instead of the top_k "
                "cells", "Sequence[int] | None", parse=id_list, shown="the screened top_k", flag_help="as a flag: 12,345")
EXHAUSTIVE = Param("exhaustive", False, "patch every latent at every position exactly (a small SAE)", "bool",
                   switch=True)
LABELS = Param("labels", None, "latent labels, shown on hover: a Neuronpedia export or {id: label} JSON file, or a "
               "dict", "Any", shown="the labels.json next to the SAE")


def _title(meta: dict) -> str:
    return pair_title("Feature patching", meta, f"{meta.get('direction', 'denoise')}, {meta.get('site', 'latents')}")


DECLARATION = Experiment(
    name="feature_patch", kind="feature_patch", noun="feature patching",
    summary="Feature patching: screen every SAE latent × position by attribution, patch the top ones exactly.",
    planner=plan_feature_patch, prompts=PAIR, title=_title,
    params=(*PAIR_PARAMS, LATENT_SITE, METRIC, DIRECTION, TOP_K, LATENTS, EXHAUSTIVE,
            replace(POSITIONS, help="the positions (columns) to screen and patch"), MEAN_PROMPTS, BATCH_SIZE, LABELS,
            Param("scores", None, "the screening of a feature patch computed elsewhere (its result, or the file it "
                  "was saved to): a model that takes no gradients (vLLM, served) patches its cells exactly",
                  "Result | str | None", shown="computed here")),
    example='%%feature_patch --site saes/L3 --answer " Paris" --foil " Rome" --top-k 10 -o feats\n'
            "clean: The Eiffel Tower is in the city of\n"
            "corrupt: The Colosseum is in the city of",
    doc="""
    See :mod:`pipatch._experiments.feature_patch` for the method.

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
