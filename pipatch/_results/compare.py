"""Comparing two grids: ``pipatch.compare(a, b)`` is a result whose grid is ``a − b``.

One grid answers *where* a fact is carried; two grids side by side rarely say *how much the
answer moved*. A comparison subtracts them cell by cell, so the question "does bfloat16 move
the trace?", "does the Louvre prompt use the same layers as the Eiffel one?" or "do ten more
seeds change the picture?" is one heatmap, drawn with the diverging map centred at 0
(red: a higher, blue: b higher)::

    >>> f32 = pipatch.trace(pipatch.load_model(), EIFFEL, subject="Eiffel Tower", answer=" Paris")
    >>> bf16 = pipatch.trace(pipatch.load_model(dtype="bfloat16"), EIFFEL, subject="Eiffel Tower", answer=" Paris")
    >>> d = pipatch.compare(f32, bf16)
    >>> d.grid          # tensor[layers, columns] = f32.grid − bf16.grid
    >>> d.a, d.b        # the two results, whole

What is subtracted
------------------
* ``values="recovery"`` (the default): each side's normalized recovery, mean over its seeds.
  Each side is normalized by its *own* clean and corrupt baselines, so two models whose clean
  probabilities differ are still compared on one scale (0 = corrupt, 1 = clean).
* ``values="raw"``: each side's raw metric (probability, log-probability or logit
  difference), mean over its seeds. Both sides must use the same metric.

Seeds: a comparison subtracts the *means* over seeds, ``mean_s a_s − mean_t b_t``, and so has
one entry on its seed axis. Seeds are not paired: two seed sets may differ in size, and where
both sides do have the same seeds (float32 vs bfloat16 draw the same noise per seed) the mean
of the paired differences is this same number, NaN cells aside. The sides' own spreads stay
available as ``d.a.std()`` and ``d.b.std()``.

Which grids compare
-------------------
The same rows and columns: the same number of layers (one model family and size), the same
column axis (token positions, heads, components) and count (prompts of the same token
length), the same site and the same views. Anything else is refused with one
:class:`PipatchError` line naming the axis that differs and what to change. Where the two
prompts' tokens differ, a column is labelled ``"a token / b token"``; each side is labelled
with its model, prompt and the settings in which the two differ (``d.meta["sides"]``), and
``d.meta["a"]`` / ``d.meta["b"]`` hold the sides' own metadata.

Files: a comparison saves (safetensors or :meth:`~pipatch.Result.to_json`) as its two sides
plus what was subtracted, and :func:`pipatch.load_result` rebuilds it; ``a − b`` is always
derived, never stored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._base.errors import warn
from .._base.scales import mixed_scales
from .._model.declare import declared
from .._model.models import PipatchError
from .._model.sites import TOKEN_AXIS
from .result import Result, _rows, load_result, parts_from_json, result_from_parts
from .views import SCHEMA_VERSION, conform_state, json_safe

__all__ = ["VALUES", "Comparison", "compare"]

#: What a comparison subtracts: normalized recovery, or the raw metric.
VALUES = ("recovery", "raw")
SIDES = ("a", "b")

#: Settings named in a side's label when the two sides differ in them.
_SETTINGS = ("backend", "device", "subject", "answer", "foil", "seeds", "scale", "window", "direction", "positions")


def _noun(kind: str) -> str:
    """What a result of ``kind`` is called in a title: its experiment's noun."""
    if kind == "compare":
        return "comparison"
    declaration = declared(kind)
    return declaration.noun if declaration is not None and declaration.noun else kind


def compare(a: Result | str | os.PathLike, b: Result | str | os.PathLike, *, values: str = "recovery",
            view: str | None = None) -> Comparison:
    """The cell-by-cell difference ``a − b`` of two results, as a result.

    Parameters
    ----------
    a, b
        Two results (from :func:`pipatch.trace`, :func:`pipatch.patch`, ... or
        :func:`pipatch.load_result`), or paths of result files (safetensors or ``.json``).
    values
        ``"recovery"`` (default): subtract normalized recovery, each side against its own
        baselines. ``"raw"``: subtract the raw metric (both sides must use the same one).
    view
        Compare only this view (``"resid"``, ``"mlp"``, ...) when the two results hold
        different sets of views; by default every view, and both must hold the same ones.

    Returns
    -------
    Comparison
        A :class:`~pipatch.Result`: ``grid`` is ``a − b`` of the means over seeds,
        tensor[layers, columns]; ``.a`` / ``.b`` are the two sides. It renders, saves and
        loads like any result; its grid view toggles between a, b and a − b.

    Raises
    ------
    PipatchError
        When the grids do not line up (layers, column axis, column count, site, views) or
        ``values="raw"`` meets two metrics: one line naming the axis and the fix.

    Warns
    -----
    PipatchWarning
        Two traces of different noise scales (``scale="auto"`` picks one per prompt): one
        line naming each side's scale and the fix, ``scale=`` the larger for both; the
        comparison's ``warnings`` keep it.
    """
    sides = [load_result(side) if isinstance(side, (str, os.PathLike)) else side for side in (a, b)]
    comparison = Comparison(*sides, values=values, views=None if view is None else [view])
    line = _mixed_scales(*sides)
    if line is not None:
        warn(line)
    return comparison


class Comparison(Result, file_kind="compare"):
    """``a − b`` of two results, cell by cell, with both sides kept (see :mod:`pipatch._results.compare`).

    A :class:`~pipatch.Result` whose ``raw[view]`` is the difference of the compared values,
    tensor[1, layers, columns] (one entry: the difference of the means over seeds), so
    ``grid``, ``mean()``, ``raw_mean()``, ``top_cells()`` and every view read it as they read
    any result. ``clean`` and ``corrupt`` are a − b of the sides' baselines (the views show
    both sides' own); ``meta["sides"]`` labels the sides, ``meta["a"]`` / ``meta["b"]`` are
    their metadata.

    Attributes
    ----------
    a, b
        The two results.
    values
        ``"recovery"`` or ``"raw"``: what was subtracted.
    """

    def __init__(self, a: Result, b: Result, *, values: str = "recovery", views: Sequence[str] | None = None):
        views = _check_comparable(a, b, values, views)
        self.a, self.b, self.values = a, b, values
        differing = [key for key in _SETTINGS if a.meta.get(key) != b.meta.get(key)]
        labels = [f"{name}: {_side_label(side, differing, a.metric != b.metric)}"
                  for name, side in zip(SIDES, (a, b))]
        models = [_model_text(side) for side in (a, b)]
        finished = {view: _both_finished(a, b, view) for view in views}
        unfinished = [(name, side) for name, side in zip(SIDES, (a, b)) if side.status != "done"]
        super().__init__(
            kind="compare", tokens=_merged(a.tokens, b.tokens), columns=_merged(a.columns, b.columns),
            layers=list(a.layers), metric=a.metric,
            raw={view: (self._side(a, view) - self._side(b, view))[None] for view in views},
            clean=a.clean_value - b.clean_value,
            corrupt=a.corrupt - b.corrupt,
            meta={"model": models[0] if models[0] == models[1] else f"{models[0]} vs {models[1]}",
                  "values": values, "sides": labels, "site": a.meta.get("site"), "col_axis": a.col_axis,
                  "a": a.meta, "b": b.meta},
            rows_done={view: done for view, (done, _) in finished.items()},
            row_order={view: order for view, (_, order) in finished.items()},
            status=unfinished[0][1].status if unfinished else "done",
            message="; ".join(f"{name} is {side.status}" + (f": {side.message}" if side.message else "")
                              for name, side in unfinished),
            warnings=[f"{name}: {w}" for name, side in zip(SIDES, (a, b)) for w in side.warnings]
            + [line for line in [_mixed_scales(a, b)] if line is not None],
        )

    def _side(self, side: Result, view: str) -> torch.Tensor:
        """One side's compared values: mean recovery or mean raw metric, tensor[layers, columns]."""
        return side.mean(view) if self.values == "recovery" else side.raw_mean(view)

    def side_values(self, view: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The compared values of a and of b for ``view``: two tensors [layers, columns]."""
        view = self._view(view)
        return self._side(self.a, view), self._side(self.b, view)

    def recovery(self, view: str | None = None) -> torch.Tensor:
        """``a − b`` of the compared values as one seed entry, tensor[1, layers, columns] (for
        ``values="raw"`` the raw metric's difference: a comparison holds one kind of value)."""
        return self.raw[self._view(view)]

    @property
    def title(self) -> str:
        kinds = [_noun(side.kind) for side in (self.a, self.b)]
        return f"Comparison a − b of {self._what()} · {kinds[0] if kinds[0] == kinds[1] else ' vs '.join(kinds)}"

    def _what(self) -> str:
        return "normalized recovery" if self.values == "recovery" else f"raw {self.metric}"

    def __repr__(self) -> str:
        shape = "×".join(str(n) for n in self.raw[self.views[0]].shape[1:])
        return (f"<pipatch.Comparison a − b of {self._what()}: views {', '.join(self.views)} [{shape}]; "
                f"{'; '.join(self.meta['sides'])}>")

    # -- views ------------------------------------------------------------------------------
    def arrays(self, views: list[str] | None = None, *, live: bool = False) -> dict[str, np.ndarray]:
        """``<view>/mean`` (a − b), ``<view>/a`` and ``<view>/b`` (the compared values)."""
        out: dict[str, np.ndarray] = {}
        for view in views or self.views:
            out[f"{view}/mean"] = self.mean(view).numpy().astype("<f4")
            for name, values in zip(SIDES, self.side_values(view)):
                out[f"{view}/{name}"] = values.numpy().astype("<f4")
        return out

    def frame(self):
        """Any result's table (:meth:`pipatch.Result.frame`: ``recovery`` is a − b, the
        difference of the compared values) with the compared values of each side, ``a`` and
        ``b``, as floats."""
        table = super().frame()
        sides = [self.side_values(view) for view in self.views]  # rows: view, then layer, then column
        for k, name in enumerate(SIDES):
            table[name] = torch.cat([values[k].flatten() for values in sides]).double().tolist()
        return table

    def code(self) -> str:
        """A comparison is no sweep of its own: each side has its script."""
        raise PipatchError("a comparison has no script of its own: use result.a.code() and result.b.code()")

    def to_state(self, *, live: bool = False) -> dict[str, Any]:
        """The view state of any result, plus the sides' labels, what was subtracted, and both
        sides' baselines (not their difference)."""
        baselines = {f"{name} {what}": value for name, side in zip(SIDES, (self.a, self.b))
                     for what, value in (("clean", side.clean_value), ("corrupt", float(np.nanmean(side.corrupt_seeds.numpy()))))}
        return {**super().to_state(live=live),
                **conform_state({"sides": self.meta["sides"], "compared": self.values, "baselines": baselines})}

    # -- files ------------------------------------------------------------------------------
    def _file_parts(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Both sides' headers and tensors (names prefixed ``a/`` and ``b/``) and what was
        subtracted; ``a − b`` is derived again on loading."""
        header: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": "compare", "values": self.values, "views": self.views}
        tensors: dict[str, torch.Tensor] = {}
        for name, side in zip(SIDES, (self.a, self.b)):
            header[name], side_tensors = side._file_parts()
            # A copy each: safetensors refuses two names for one memory (``compare(r, r)``).
            tensors.update({f"{name}/{key}": t.clone() for key, t in side_tensors.items()})
        return header, tensors

    def _json_document(self) -> dict[str, Any]:
        """The :meth:`~pipatch.Result.to_json` document of a comparison: ``grid`` (a − b of the
        first view), ``views[view]`` with ``mean`` (a − b), ``a`` and ``b``; then both sides
        whole (``"a"``, ``"b"``: their own documents), from which :func:`pipatch.load_result`
        rebuilds it."""
        meta = {key: value for key, value in self.meta.items() if key not in SIDES}
        out = {
            "schema": SCHEMA_VERSION, "kind": self.kind, "values": self.values, "model": self.meta["model"],
            "title": self.title, "tokens": self.tokens, "columns": self.columns, "layers": self.layers,
            "grid": _rows(self.grid), "metric": self.metric, "status": self.status, "message": self.message,
            "warnings": self.warnings, "meta": meta,
            "views": {view: {"mean": _rows(self.mean(view)), **{name: _rows(t) for name, t in zip(SIDES, self.side_values(view))}}
                      for view in self.views},
            "a": self.a.to_json(), "b": self.b.to_json(),
        }
        return json_safe(out)

    @staticmethod
    def parts_from_json(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The file parts of a comparison's :meth:`to_json` document."""
        header: dict[str, Any] = {"schema": doc.get("schema"), "kind": "compare", "values": doc.get("values"),
                                  "views": list(doc["views"])}
        tensors: dict[str, torch.Tensor] = {}
        for name in SIDES:
            header[name], side_tensors = parts_from_json(doc[name])
            tensors.update({f"{name}/{key}": t for key, t in side_tensors.items()})
        return header, tensors

    @classmethod
    def from_parts(cls, header: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> Comparison:
        """The comparison a file describes: both sides read and checked whole, then compared."""
        sides = []
        for name in SIDES:
            if not isinstance(header.get(name), dict):
                raise PipatchError(f"{where} is a comparison without its side {name}: re-save it")
            prefix = f"{name}/"
            sides.append(result_from_parts(header[name], {key[len(prefix):]: t for key, t in tensors.items()
                                                          if key.startswith(prefix)}, f"{where} (side {name})"))
        return cls(*sides, values=header.get("values") or "recovery", views=header.get("views"))


# --------------------------------------------------------------------------------------------
# Checks and labels
# --------------------------------------------------------------------------------------------


def _check_comparable(a: Result, b: Result, values: str, views: Sequence[str] | None) -> list[str]:
    """The views to compare, or one :class:`PipatchError` line naming the axis that differs."""
    for name, side in zip(SIDES, (a, b)):
        if not isinstance(side, Result):
            raise PipatchError(f"compare takes two pipatch Results (or result files); {name} is of type {type(side).__name__}")
    if values not in VALUES:
        raise PipatchError(f"unknown values {values!r}: use 'recovery' (normalized, the default) or 'raw' (the metric)")
    if len(a.layers) != len(b.layers):
        raise PipatchError(f"layers differ: a has {len(a.layers)} layers, b has {len(b.layers)}; compare results of "
                           "models with the same depth (one family and size)")
    if a.col_axis != b.col_axis:
        raise PipatchError(f"column axes differ: a's columns are {a.col_axis}s, b's are {b.col_axis}s; compare "
                           "results swept over the same axis (both positions, or both heads)")
    if len(a.columns) != len(b.columns):
        fix = ("use two prompts of the same token length" if a.col_axis == TOKEN_AXIS
               else "compare results of models with the same number of them")
        raise PipatchError(f"columns differ: a has {len(a.columns)} {a.col_axis} columns, b has {len(b.columns)}; {fix}"
                           + (f" (a: {a.columns}, b: {b.columns})" if a.col_axis == TOKEN_AXIS else ""))
    if a.meta.get("site") != b.meta.get("site"):
        raise PipatchError(f"sites differ: a patches {a.meta.get('site')!r}, b patches {b.meta.get('site')!r}; "
                           "run both with the same site=")
    if views is None and a.views != b.views:
        common = [view for view in a.views if view in b.views]
        raise PipatchError(f"views differ: a holds {', '.join(a.views)}, b holds {', '.join(b.views)}; run both with "
                           "the same kind= / site=" + (f", or pass view={common[0]!r} to compare one view" if common else ""))
    for view in views or ():
        for name, side in zip(SIDES, (a, b)):
            if view not in side.views:
                raise PipatchError(f"view {view!r} is not in {name}, which holds {', '.join(side.views)}: "
                                   "pass a view both hold")
    if values == "raw" and a.metric != b.metric:
        raise PipatchError(f"metrics differ: a measures {a.metric}, b {b.metric}; raw values compare only in one "
                           "metric: use values='recovery' (normalized) or run both with the same metric=")
    return list(views) if views is not None else list(a.views)


def _mixed_scales(a: Result, b: Result) -> str | None:
    """The line saying that the two sides were corrupted at different noise scales, if so."""
    return mixed_scales([(name, side.meta.get("scale")) for name, side in zip(SIDES, (a, b))], "a and b")


def _merged(a: Sequence[str], b: Sequence[str]) -> list[str]:
    """Labels of both sides: ``"x"`` where they agree, ``"x / y"`` where they differ."""
    if len(a) != len(b):
        return list(a)
    return [x if x == y else f"{x} / {y}" for x, y in zip(a, b)]


def _model_text(result: Result) -> str:
    return " ".join(str(part) for part in (result.meta.get("model", "?"), result.meta.get("dtype")) if part)


def _prompt_text(result: Result) -> str:
    meta = result.meta
    if meta.get("prompts"):
        return f"{len(meta['prompts'])} prompts"
    if meta.get("prompt"):
        return repr(meta["prompt"])
    if meta.get("clean_prompt"):
        return f"{meta['clean_prompt']!r} vs {meta.get('corrupt_prompt')!r}"
    return ""


def _both_finished(a: Result, b: Result, view: str) -> tuple[int, int]:
    """``(rows_done, row_order)`` of ``view`` for the comparison: the larger band of rows, from
    the top or from the bottom, that both sides have finished."""
    common = set(a.finished_rows(view)) & set(b.finished_rows(view))
    n = len(a.layers)
    top = next((i for i in range(n) if i not in common), n)
    bottom = next((i for i in range(n) if n - 1 - i not in common), n)
    return (bottom, -1) if bottom > top else (top, 1)


def _side_label(result: Result, differing: Sequence[str], metrics_differ: bool) -> str:
    """``model dtype · prompt · the settings in which the two sides differ``."""
    parts = [_model_text(result), _prompt_text(result)]
    parts += [f"{key} {result.meta.get(key)!r}" if isinstance(result.meta.get(key), str) else f"{key} {result.meta.get(key)}" for key in differing]
    if metrics_differ:
        parts.append(f"metric {result.metric}")
    return " · ".join(part for part in parts if part)
