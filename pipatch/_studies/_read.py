"""Reading a study: its store, read back without a model, finished or still running.

:func:`load_study` (and what :func:`~pipatch.study` returns) is a :class:`Study`: a path
to the SQLite store (:mod:`._store`) and the ways to read it.

* **The facts**: :meth:`Study.facts` is a table of every stored fact (``done``, ``unknown``
  with the model's top-1, ``error`` with its one line), :meth:`Study.counts` and
  :meth:`Study.summary` count them, ``study[i]`` is fact ``i``'s own
  :class:`~pipatch.Result` (``i`` its index in the input), read back bit for bit.
* **The averages** (:mod:`._aggregate`): each finished fact's grid is reduced to ROME's
  named position groups and averaged over its seeds; :meth:`Study.grid` is the mean over
  facts, :meth:`Study.aggregate` a DataFrame with 95 % Student-t intervals (by relation if
  asked), :meth:`Study.frame` the tidy per-fact table (:meth:`Study.to_csv`,
  :meth:`Study.to_parquet`).
* **The pictures**: :meth:`Study.as_result` is the average as a Result whose seed axis is
  the facts (what the live view :mod:`._view` and :meth:`Study.heatmap` draw);
  :meth:`Study.plot` draws ROME's line plots with their intervals.

Every call opens the store afresh and closes it, so a study another process is still
running shows its progress, and a reader never holds the file. The per-fact values are
cached while the finished facts stay the same (their indices and commit times).

How it fails, each in one :class:`~pipatch.PipatchError` line: a path that is no store (at
:class:`Study` itself, before any read); a fact not in the store yet, or one that is
``unknown`` or ``error`` (it has no result); an average with no finished fact; facts whose
columns differ (a study averages grids of one shape); an unknown kind, metric, group or
relation (the message lists the study's own); ``aggregate(by=...)`` other than the
relation; ``to_parquet`` without pyarrow.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._base.errors import warn
from .._base.scales import mixed_scales
from .._base.tables import table
from .._model.models import PipatchError
from .._results.result import Result
from ._aggregate import METRICS, fact_values, summarise
from ._store import Store, StoredFact

__all__ = ["load_study", "Study"]


def load_study(path: str | os.PathLike) -> Study:
    """The study in the store at ``path``, finished or not; no model needed."""
    return Study(path)


class Study:
    """A study's store, read: its facts, their results, and averages over them.

    ``study[i]`` (or ``study.result(i)``) is fact ``i``'s own :class:`~pipatch.Result` (``i``
    its index in the input). Each call reads the store afresh, so a study another process is
    still running shows its progress.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        Store(self.path, create=False).close()  # one line now for a path that is not a store
        self._cache: tuple[Any, list[tuple[StoredFact, dict]]] | None = None

    # -- the store ---------------------------------------------------------------------------
    def _store(self) -> Store:
        return Store(self.path, create=False)

    @property
    def config(self) -> dict[str, Any]:
        """The configuration the study was made with (model, experiment, options, ...)."""
        store = self._store()
        try:
            return store.config()
        finally:
            store.close()

    @property
    def options(self) -> dict[str, Any]:
        return {k[len("options."):]: v for k, v in self.config.items() if k.startswith("options.")}

    @property
    def experiment(self) -> str:
        return str(self.config.get("experiment", "?"))

    @property
    def noise_scale(self) -> float | None:
        """The noise scale (in σ) every fact is traced at: the ``scale=`` given, or the one
        ``scale="auto"`` picked on the first fact that ran; ``None`` before that fact, and for
        an experiment without noise."""
        given = self.options.get("scale")
        if given != "auto":
            return given
        store = self._store()
        try:
            return store.info().get("noise_scale")
        finally:
            store.close()

    def facts(self) -> Any:
        """A pandas DataFrame of every stored fact, one row each, in input order.

        Columns: ``fact`` (its index in the input, as in :meth:`frame`), ``fact_id``,
        ``relation``, ``status`` (``done``, ``unknown``: the model does not know it, ``error``),
        ``known`` (``True`` / ``False``; ``None`` where not checked), ``top1`` (the model's top
        next token, as text), ``message`` (an error's one line), then the inputs the experiment
        took (``prompt``, ``subject``, ``answer``, ...; missing where a fact has none), the
        ``record`` as read (a dict), ``seconds`` (its run time) and ``finished`` (when it was
        stored, seconds since the epoch), both floats. No result data: ``study[i]`` is fact
        ``i``'s Result.
        """
        rows = self._rows()
        inputs = [row.inputs() for row in rows]
        fields = list(dict.fromkeys(key for each in inputs for key in each))
        facts = [{"fact": row["idx"], "fact_id": row["fact_id"], "relation": row["relation"], "status": row["status"],
                  "known": None if row["known"] is None else bool(row["known"]), "top1": row["top1"],
                  "message": row["message"], **{key: each.get(key) for key in fields}, "record": _record(row),
                  "seconds": float("nan") if row["seconds"] is None else float(row["seconds"]),
                  "finished": float(row["finished"])}
                 for row, each in zip(rows, inputs)]
        return table(facts, columns=["fact", "fact_id", "relation", "status", "known", "top1", "message",
                                     *fields, "record", "seconds", "finished"])

    def _rows(self) -> list[StoredFact]:
        """Every stored fact's row of the store, as it stands (result data included)."""
        store = self._store()
        try:
            return list(store.facts())
        finally:
            store.close()

    def counts(self) -> dict[str, int]:
        """How many facts were read (``total``) and how many are ``done``, ``unknown``,
        ``error`` and ``pending``."""
        store = self._store()
        try:
            counts = {"done": 0, "unknown": 0, "error": 0}
            for _, status in store.keys().values():
                counts[status] += 1
            total = int(store.info().get("n_facts", sum(counts.values())))
        finally:
            store.close()
        checked = counts["done"] + counts["unknown"]
        return {"total": total, **counts, "pending": max(total - sum(counts.values()), 0), "checked": checked}

    def summary(self) -> str:
        """One line: ``trace study on gemma-3-270m at noise 3σ: 412 of 1,209 known; 412 done, 0 errors,
        0 pending`` (the noise scale once there is one: every fact is traced at it)."""
        c, config, rows = self.counts(), self.config, self._rows()
        scale = self.noise_scale
        known = sum(1 for row in rows if row["known"] == 1)
        unchecked = c["total"] - sum(1 for row in rows if row["known"] is not None)
        checked = f"{known:,} of {c['total']:,} known" + (f" ({unchecked:,} not checked)" if unchecked else "")
        noise = f" at noise {scale:g}σ" if isinstance(scale, (int, float)) else ""
        return (f"{config.get('experiment')} study on {config.get('model')}{noise}: {checked}; {c['done']:,} done, "
                f"{c['error']:,} error{'s' if c['error'] != 1 else ''}, {c['pending']:,} pending")

    def __repr__(self) -> str:
        return f"<pipatch.Study {self.path.name}: {self.summary()}>"

    def __len__(self) -> int:
        return self.counts()["done"]

    def result(self, index: int) -> Result:
        """Fact ``index``'s own Result (drawn, saved, compared like any other)."""
        store = self._store()
        try:
            row = store.fact(index)
        finally:
            store.close()
        if row is None:
            raise PipatchError(f"fact {index} is not in the store (yet): the study has not run it")
        return row.result()

    def __getitem__(self, index: int) -> Result:
        return self.result(index)

    def results(self) -> list[tuple[StoredFact, Result]]:
        """Every finished fact's row and Result, in order."""
        return [(row, row.result()) for row in self._rows() if row["status"] == "done"]

    # -- values ------------------------------------------------------------------------------
    def _values(self) -> list[tuple[StoredFact, dict]]:
        """Each finished fact with its values by metric and view ([layers, groups]); cached
        while the store holds the same finished facts."""
        import json

        rows = [row for row in self._rows() if row["status"] == "done"]
        stamp = tuple((row["idx"], row["finished"]) for row in rows)
        if self._cache is None or self._cache[0] != stamp:
            out = []
            for row in rows:
                groups = json.loads(row["groups"]) if row["groups"] else None
                result = row.result()
                values = fact_values(result, groups["columns"] if groups else None)
                out.append((row, {"values": values, "groups": groups, "scale": result.meta.get("scale")}))
            self._cache = (stamp, out)
        return self._cache[1]

    def _axes(self, values: list[tuple[StoredFact, dict]]) -> tuple[list[str], list[str], list[str]]:
        """The views, layers and group names the finished facts share."""
        if not values:
            raise PipatchError(f"the study in {str(self.path)!r} has no finished fact yet: run pipatch.study(...) first")
        row, first = values[0]
        result = row.result()
        names = first["groups"]["names"] if first["groups"] else list(result.columns)
        for other, item in values[1:]:
            theirs = item["groups"]["names"] if item["groups"] else None
            if theirs is not None and theirs != names or theirs is None and np.shape(
                    item["values"]["recovery"][result.views[0]])[-1] != len(names):
                raise PipatchError(f"fact {other['idx']}'s columns differ from fact {row['idx']}'s: a study averages "
                                   "grids of one shape (named positions, or the same heads)")
        mixed = mixed_scales([(f"fact {other['idx']}", item.get("scale")) for other, item in values], "the facts")
        if mixed is not None:  # a store written before a study kept one scale
            warn(f"{mixed} into a new store")
        return list(result.views), list(result.layers), names

    def grid(self, view: str | None = None, metric: str = "recovery", relation: str | None = None) -> torch.Tensor:
        """The mean over facts, tensor[layers, groups], of ``metric`` (``recovery`` or
        ``raw_effect``) in ``view`` (default the first kind); ``relation`` keeps one relation's facts."""
        values = self._select(relation)
        views, _, _ = self._axes(values)
        view = views[0] if view is None else _check(view, views, "kind")
        _check(metric, METRICS, "metric")
        stacked = np.stack([item["values"][metric][view] for _, item in values])
        return torch.from_numpy(summarise(stacked)["mean"]).float()

    def _select(self, relation: str | None) -> list[tuple[StoredFact, dict]]:
        values = self._values()
        if relation is None:
            return values
        chosen = [v for v in values if v[0]["relation"] == relation]
        if not chosen:
            raise PipatchError(f"no finished fact has relation {relation!r}: see study.aggregate(by='relation_id')")
        return chosen

    def aggregate(self, by: str | None = None) -> Any:
        """A pandas DataFrame of the averages: one row per ([relation,] kind, layer, group,
        metric) with ``mean``, ``low`` and ``high`` (the 95 % Student-t interval over facts),
        ``sd`` and ``n`` (facts). ``by="relation_id"`` breaks it down by relation."""

        if by not in (None, "relation_id", "relation"):
            raise PipatchError(f"aggregate(by={by!r}): only by='relation_id' is recorded")
        values = self._values()
        views, layers, names = self._axes(values)
        parts = [(None, values)] if by is None else [
            (relation, [v for v in values if v[0]["relation"] == relation])
            for relation in dict.fromkeys(v[0]["relation"] for v in values)]
        rows = []
        for relation, chosen in parts:
            for metric in METRICS:
                for view in views:
                    stats = summarise(np.stack([item["values"][metric][view] for _, item in chosen]))
                    for layer in range(len(layers)):
                        for g, name in enumerate(names):
                            row = {"kind": view, "layer": int(layers[layer]) if layers[layer].isdigit() else layers[layer],
                                   "group": name, "metric": metric, "mean": float(stats["mean"][layer, g]),
                                   "low": float(stats["low"][layer, g]), "high": float(stats["high"][layer, g]),
                                   "sd": float(stats["sd"][layer, g]), "n": int(stats["n"][layer, g])}
                            rows.append(row if by is None else {"relation_id": relation, **row})
        return table(rows)

    def frame(self) -> Any:
        """The tidy table: one row per (fact, relation, kind, layer, group, metric) with its
        ``value`` (the fact's mean over seeds), plus ``fact_id`` and ``subject``."""

        values = self._values()
        views, layers, names = self._axes(values)
        rows = []
        for row, item in values:
            record = _record(row)
            for metric in METRICS:
                for view in views:
                    array = item["values"][metric][view]
                    for layer in range(len(layers)):
                        for g, name in enumerate(names):
                            rows.append({"fact": row["idx"], "fact_id": row["fact_id"], "relation": row["relation"],
                                         "subject": record.get("subject"), "kind": view, "layer": layer,
                                         "group": name, "metric": metric, "value": float(array[layer, g])})
        return table(rows, columns=["fact", "fact_id", "relation", "subject", "kind", "layer", "group",
                                           "metric", "value"])

    def to_csv(self, path: str | os.PathLike) -> Path:
        """:meth:`frame` as CSV."""
        self.frame().to_csv(path, index=False)
        return Path(path)

    def to_parquet(self, path: str | os.PathLike) -> Path:
        """:meth:`frame` as Parquet (needs pyarrow)."""
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise PipatchError("to_parquet needs pyarrow: pip install pyarrow (or use study.to_csv)") from None
        self.frame().to_parquet(path, index=False)
        return Path(path)

    # -- pictures ----------------------------------------------------------------------------
    def as_result(self, metric: str = "recovery", relation: str | None = None) -> Result:
        """The average as a :class:`~pipatch.Result` whose seed axis is the facts: its grid is
        :meth:`grid`, each fact one row of ``per_seed``. What :meth:`heatmap` draws, and what a
        ``PatchGrid`` can show."""
        values = self._select(relation)
        views, layers, names = self._axes(values)
        _check(metric, METRICS, "metric")
        raw = {view: torch.from_numpy(np.stack([item["values"][metric][view] for _, item in values])).float()
               for view in views}
        config = self.config
        labels = [f"fact {row['idx']}" + (f" ({row['fact_id']})" if row["fact_id"] is not None else "")
                  for row, _ in values]
        meta = {"model": config.get("model"), "normalize": False, "study": str(self.path), "prompts": labels,
                "rows_per_prompt": [1] * len(labels), "col_axis": "token" if values[0][1]["groups"] else "column",
                "experiment": config.get("experiment")}
        return Result(kind="study", tokens=list(names), columns=list(names), layers=list(layers),
                      metric=f"mean {metric.replace('_', ' ')}", raw=raw, clean=0.0, corrupt=torch.zeros(len(labels)),
                      meta=meta)

    def heatmap(self, view: str | None = None, metric: str = "recovery", relation: str | None = None, *,
                ax=None, pyplot: bool = False, scale: str | tuple[float, float] = "auto"):
        """The average as pipatch's heatmap (layers × named groups; its colour map), a matplotlib figure.

        Parameters
        ----------
        scale
            The colour range: ``"auto"`` the average's own values, or ``(vmin, vmax)`` (to
            match another heatmap; see :meth:`pipatch.Result.plot`).
        """
        from .._results.views import figure
        from .._results.views.render import check_scale

        result = self.as_result(metric, relation)
        state = result.to_state()
        state["title"] = f"{self.summary()}"
        return figure(state, view, ax=ax, pyplot=pyplot, scale=check_scale(scale))

    def plot(self, groups: Sequence[str] = ("last subject", "last"), metric: str = "recovery",
             relation: str | None = None, *, pyplot: bool = False):
        """ROME's line plots: the effect per layer at each of ``groups`` (default the last
        subject token and the last token), one line per kind with its 95 % interval as a band."""
        from matplotlib.ticker import MaxNLocator

        from .._results.views import DIVERGING_STOPS
        from .._results.views.render import tick_text

        values = self._select(relation)
        views, layers, names = self._axes(values)
        _check(metric, METRICS, "metric")
        for group in groups:
            _check(group, names, "group")
        if pyplot:
            import matplotlib.pyplot as plt

            fig = plt.figure(figsize=(4.2 * len(groups), 3.4))
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=(4.2 * len(groups), 3.4))
            FigureCanvasAgg(fig)
        colours = [DIVERGING_STOPS[i] for i in (9, 1, 7, 3, 10, 0)]
        x = np.arange(len(layers))
        axes = fig.subplots(1, len(groups), squeeze=False)[0]
        for ax, group in zip(axes, groups):
            g = names.index(group)
            for k, view in enumerate(views):
                stats = summarise(np.stack([item["values"][metric][view] for _, item in values]))
                colour = colours[k % len(colours)]
                ax.plot(x, stats["mean"][:, g], color=colour, label=tick_text(view, 20))
                ax.fill_between(x, stats["low"][:, g], stats["high"][:, g], color=colour, alpha=0.2, linewidth=0)
            ax.axhline(0, color="#bdbdbd", linewidth=0.8)
            ax.set_title(tick_text(group, 30), fontsize=9)
            ax.set_xlabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
            ax.set_ylabel(tick_text(metric.replace("_", " "), 30))
            ax.legend(fontsize=8)
        fig.suptitle(tick_text(self.summary(), 110) + " · 95 % t interval over facts", fontsize=8)
        fig.tight_layout()
        return fig

    def _repr_mimebundle_(self, include=None, exclude=None):  # a hook for the live view to come
        return {"text/plain": repr(self)}


def _record(row: StoredFact) -> dict[str, Any]:
    import json

    try:
        return json.loads(row["record"])
    except (TypeError, ValueError):
        return {}


def _check(value: str, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise PipatchError(f"unknown {what} {value!r}: this study has {', '.join(map(str, choices))}")
    return value

