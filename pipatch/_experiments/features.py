"""Which features fire where: each SAE's top latents at each position of a prompt.

An SAE (or transcoder) rewrites a layer's value as a sparse sum of latents, each (hopefully)
one human-readable feature. Reading a prompt through it answers the first question of a
feature-level study: *what does the model represent here?* Run the prompt once, read the
value each SAE was trained on (the capture program's read, on every backend: one forward per
prompt, whatever the number of SAEs), encode it with the SAE's own math, and keep at each
position the ``k`` largest latents — with their labels (:mod:`pipatch._model.features.labels`)
and, where the SAE's folder holds them, their top contexts over a corpus
(:func:`pipatch.feature_contexts`).

The result (:class:`~pipatch._results.features.LatentsResult`) is a grid per SAE, ranks ×
positions of activations, and a table with one row per (SAE, position, latent):
``result.frame()``. Only latents that fire (activation > 0) are shown; a rank no latent fills
is NaN in the grid and absent from the table. A click on a cell shows the top next tokens of
the run with that latent set to 0 there (:class:`LatentSweep`): what the model says without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._base.checks import whole_number
from .._base.errors import PipatchError
from .._engine import Plan, Sweep
from .._model.cells import Base, Cell, Op
from .._model.declare import PROMPT, Experiment, Param, positive_int
from .._model.features import LatentSite, distinct, load_sae
from .._model.features.labels import labels_next_to, load_labels
from .._results.features import LatentsResult, top_latents
from ._feature_code import features_code, features_inputs
from ._feature_contexts import NO_METRIC, load_contexts, read_latents
from ._inputs import POSITIONS, encode, model_meta, sweep_positions

__all__ = ["plan_features", "LatentSweep", "DECLARATION"]


@dataclass
class LatentSweep(Sweep):
    """A feature grid's cells as patched runs, for clicks only (the grid is read in one
    forward): cell ``(rank, col)`` is the prompt's run with that latent set to 0 at that
    position (the SAE's error kept, so the rest of the run is the plain one): what the model
    says without it. A cell where no latent fires is the plain run."""

    site: LatentSite | None = None
    ids: list[list[int | None]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def cell(self, row: int, col: int, seed: int) -> Cell:
        site, latent = self.site, self.ids[row][col]
        assert site is not None, "a LatentSweep needs its site"
        ops = [] if latent is None else [Op(site, site.layer, site.cell(self.positions[col], latent), torch.zeros(1, 1, 1))]
        return Cell(row, col, seed, start=0, ops=ops)

    @property
    def tracks_rows(self) -> bool:
        return False  # every row is read before the plan runs


def _sites(backend: Any, saes: Any) -> list[LatentSite]:
    """The latent sites ``saes`` names: sites as they are, SAE folders loaded onto the model."""
    given = list(saes) if isinstance(saes, (list, tuple)) else [saes]
    if not given:
        raise PipatchError("features() needs saes=: a latent site (pipatch.load_sae(source, model)), an SAE folder, "
                           "or a list of them")
    return distinct([s if isinstance(s, LatentSite) else load_sae(s, backend.model) for s in given])


def _labels_of(sites: Sequence[LatentSite], labels: Any) -> dict[str, dict[int, str]]:
    """Each site's labels: ``labels`` for the one SAE, ``{site name: source}`` for several,
    or (``None``) the labels file next to each SAE."""
    if labels is None:
        return {s.name: labels_next_to(s.sae.folder) for s in sites}
    names = {s.name for s in sites}
    if isinstance(labels, Mapping) and labels and set(labels) <= names:
        return {s.name: load_labels(labels[s.name]) if s.name in labels else labels_next_to(s.sae.folder)
                for s in sites}
    if len(sites) > 1:
        raise PipatchError(f"labels= for {len(sites)} SAEs must name each one's labels: "
                           f"{{{', '.join(repr(n) for n in sorted(names))}: path or dict, ...}}")
    return {sites[0].name: load_labels(labels)}


def latent_notes(site: LatentSite, labels: Mapping[int, str], shown: Any) -> tuple[dict[str, str], dict[str, list]]:
    """What a view shows beside latents ``shown`` of ``site``: ``({id: label}, {id: [[window,
    activation], ...]})``, the labels from ``labels`` (:func:`_labels_of`) and the top contexts
    stored next to the SAE (:func:`~._feature_contexts.load_contexts`; none where it has
    none), keyed by the id as text (JSON's keys)."""
    named = {str(i): labels[i] for i in shown if i in labels}
    contexts = load_contexts(site.sae.folder)
    if contexts is None:
        return named, {}
    return named, {str(i): [list(c) for c in contexts.top(i)] for i in shown
                   if i < contexts.activation.shape[0] and contexts.top(i)}


def plan_features(backend: Any, prompt: str, *, saes: Any, k: int, positions: Sequence[int] | None,
                  labels: Any) -> Plan:
    """Check the inputs and read the prompt's latents (one forward); return its :class:`Plan`,
    whose result is filled already.

    ``backend`` runs the model; the other parameters are :func:`pipatch.features`'s.
    """
    if not isinstance(prompt, str):
        raise PipatchError("features() reads one prompt at a time: pass a string (call it once per prompt)")
    k = whole_number(k, "k (latents shown per position)", 1)
    sites = _sites(backend, saes)
    named = _labels_of(sites, labels)
    input_ids, tokens, _ = encode(backend, prompt)
    cols = sweep_positions(positions, input_ids.shape[1])
    read, run = read_latents(backend, input_ids, sites)
    raw: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {**model_meta(backend), "prompt": prompt, "positions": cols, "k": k, "site": "latent",
                            "col_axis": "token", "normalize": False, "latents": {}, "labels": {}, "contexts": {},
                            "saes": [s.describe() for s in sites]}
    for site in sites:
        values, ids = top_latents(read[site.name][cols], k)
        raw[site.name] = values[None]
        shown = sorted({i for row in ids for i in row if i is not None})
        meta["latents"][site.name] = ids
        meta["labels"][site.name], found = latent_notes(site, named[site.name], shown)
        if found:
            meta["contexts"][site.name] = found
    result = LatentsResult(kind="features", tokens=tokens, columns=[tokens[p] for p in cols],
                           layers=[f"top {r + 1}" for r in range(k)], metric="activation", raw=raw,
                           clean=math.nan, corrupt=torch.tensor([math.nan]), meta=meta,
                           rows_done={s.name: k for s in sites})
    base = Base(input_ids, run)
    sweeps = [LatentSweep(view=s.name, base=base, metric=NO_METRIC, n_rows=k, n_cols=len(cols), prune=False,
                          only=set(), site=s, ids=meta["latents"][s.name], positions=cols) for s in sites]
    return Plan(backend, result, sweeps, 1, fast=False)


def _path_or_site(value: str) -> str:
    """An SAE folder, as a flag gives it (loaded onto the model by the planner)."""
    if not Path(value).expanduser().is_dir():
        raise PipatchError(f"no SAE folder at {value!r}: pass a folder in SAELens's or Gemma Scope 2's format")
    return value


def _title(meta: dict) -> str:
    names = ", ".join(s["name"] for s in meta.get("saes", []))
    return f"Features · {meta.get('model', '?')} · {names}"


#: ``labels=``, as every experiment that shows latents takes it.
LABELS = Param("labels", None, "latent labels: a Neuronpedia export or {id: label} JSON file, or a dict; for several "
               "SAEs {sae name: labels}", "Any", shown="the labels.json next to each SAE")


DECLARATION = Experiment(
    name="features", kind="features", noun="feature read",
    summary="Which SAE latents fire where: each SAE's top-k latents at every position of a prompt, with labels.",
    planner=plan_features, prompts=PROMPT, title=_title, whole_dataset=True,
    params=(
        Param("saes", help="the SAEs to read: a latent site (pipatch.load_sae(source, model)) or an SAE folder, or a "
              "list of them", annotation="Any", parse=_path_or_site, many=True),
        Param("k", 10, "latents shown per position (those that fire, largest first)", "int", parse=positive_int),
        POSITIONS,
        LABELS,
    ),
    example="%%features --saes saes/L6 --k 5 -o read\nThe Eiffel Tower is in the city of",
    doc="""
    See :mod:`pipatch._experiments.features`.

    Returns
    -------
    LatentsResult
        ``kind="features"``; one view per SAE (its site's name), ranks × positions of
        activations (``result.grid``: the first SAE's); ``result.frame()`` has one row per
        (SAE, position, latent shown) with ``latent``, ``position``, ``token``, ``value`` and
        ``label``; ``result.latents(sae)``, ``result.label(id, sae)`` and
        ``result.contexts(id, sae)`` read one SAE's. One forward of the prompt.

    Raises
    ------
    PipatchError
        One line: no SAE given, a folder that holds none, an SAE of another model, a list of
        prompts, a bad ``k`` or position, or labels that cannot be read.

    Examples
    --------
    >>> site = pipatch.load_sae("saes/L6", model)
    >>> r = pipatch.features(model, "The Eiffel Tower is in the city of", saes=site, k=5)
    >>> r.frame().query("position == 4")
    """,
    code=features_code, code_inputs=features_inputs,
)
