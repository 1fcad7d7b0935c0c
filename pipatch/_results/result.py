"""The one result type every protocol returns, and its files.

A :class:`Result` holds the *raw* metric of every patched run — ``raw[view]`` is
[seeds, layers, columns] — and the two baselines it is read against: the clean run's metric and
the corrupt (base) runs' mean (``corrupt_seeds``: one per seed). Everything else is derived:

* normalized recovery ``(patched − corrupt) / (clean − corrupt)`` per seed: 0 is the corrupt
  run, 1 the clean one. Where ``clean − corrupt`` is too small to divide by, recovery is NaN and
  a warning says so (never ±1e7);
* the mean over seeds (``grid``) and the spread (``std``).

Files are safetensors with the metadata as JSON inside the header, or plain JSON, never an
executable object dump: ``result.save("eiffel.safetensors")`` (or ``"eiffel.json"``: the suffix
picks the format) and ``pipatch.load_result(path)``.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, overload

import numpy as np
import torch

from .._base.tables import table
from .._model.declare import declared
from .._model.models import PipatchError
from .._model.sites import axis_of
from .views import (
    MIME_TYPE,
    SCHEMA_VERSION,
    clean_text,
    conform_state,
    done_span,
    json_safe,
    mime_bundle,
    mime_document,
)

__all__ = ["Result", "load_result", "result_file", "recovery_undefined", "SCHEMA_VERSION", "MIME_TYPE",
           "FILE_SUFFIXES"]

#: The files a result is saved as, by suffix: safetensors (tensors + a JSON header) or JSON.
FILE_SUFFIXES = (".safetensors", ".json")


def recovery_undefined(clean: float, corrupt: float) -> bool:
    """Whether clean − corrupt is too close to zero for recovery to mean anything."""
    return abs(clean - corrupt) <= 1e-6 + 1e-3 * max(abs(clean), abs(corrupt))


@dataclass
class Result:
    """A finished (or partial) sweep: grids with labelled axes, baselines and metadata.

    Attributes
    ----------
    kind
        ``"trace"`` (causal tracing), ``"patch"`` (activation patching) or ``"attribution"``
        (attribution patching's first-order estimate of ``patch``).
    tokens
        The prompt's tokens as text (the base prompt's; both prompts for patching are in
        ``meta``).
    columns
        Column labels: tokens for position sweeps, ``"H0"``, ``"H1"``, ... for ``site="head"``.
    layers
        Row labels, one per layer.
    metric
        ``"prob"``, ``"logprob"`` or ``"logit_diff"``.
    raw
        ``{view: tensor[seeds, layers, columns]}``, the metric of every patched run (NaN where
        not computed).
    clean, corrupt
        The baselines, each one Python float: the clean and the corrupt runs' metric, the mean
        over the runs (seeds; a dataset's prompts × seeds). Given as one float or one value per
        run (a tensor); the runs stay in :attr:`clean_seeds` / :attr:`corrupt_seeds`, tensor[runs].
    rows_done, row_order
        ``{view: n}``: ``n`` rows of that view are finished: rows ``0 .. n-1``, or the last ``n``
        where ``row_order[view]`` is ``-1`` (the engine runs rows from the last layer down when
        the higher rows cost less: :meth:`finished_rows`).
    status
        ``"done"``, ``"running"``, ``"stopped"``, ``"interrupted"`` or ``"failed"``.
    """

    kind: str
    tokens: list[str]
    columns: list[str]
    layers: list[str]
    metric: str
    raw: dict[str, torch.Tensor]
    clean: float
    corrupt: float
    meta: dict[str, Any] = field(default_factory=dict)
    rows_done: dict[str, int] = field(default_factory=dict)
    row_order: dict[str, int] = field(default_factory=dict)
    status: str = "done"
    message: str = ""
    warnings: list[str] = field(default_factory=list)

    #: Subclasses of their own, by the ``kind`` their files hold (``class Comparison(Result,
    #: file_kind="compare")``): :func:`load_result` hands such a file to the subclass's
    #: ``parts_from_json`` / ``from_parts`` (those of :class:`Result`, unless it has its own).
    FILE_KINDS: ClassVar[dict[str, type[Result]]] = {}

    def __init_subclass__(cls, file_kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if file_kind is not None:
            Result.FILE_KINDS[file_kind] = cls

    def __post_init__(self) -> None:
        # Recovery is per run: the runs stay; the clean run is one value unless a dataset's rows differ.
        self.corrupt_seeds = torch.as_tensor(self.corrupt, dtype=torch.float32, device="cpu").reshape(-1)
        self._clean_runs = torch.as_tensor(self.clean, dtype=torch.float32, device="cpu").reshape(-1)
        self.corrupt = float(self.corrupt_seeds.mean())
        self.clean = float(self.clean if self._clean_runs.numel() == 1 else self._clean_runs.mean())

    # -- derived values -------------------------------------------------------------------
    @property
    def views(self) -> list[str]:
        """The grids this result holds, e.g. ``["resid", "mlp", "attn"]``."""
        return list(self.raw)

    def _view(self, view: str | None) -> str:
        if view is None:
            return self.views[0]
        if view not in self.raw:
            raise PipatchError(f"this result has no view {view!r}: it has {', '.join(self.views)}")
        return view

    def recovery(self, view: str | None = None) -> torch.Tensor:
        """Normalized recovery per seed, tensor[seeds, layers, columns]; for a result that is
        not normalized (:attr:`normalized`: the logit lens), the metric itself."""
        raw = self.raw[self._view(view)]
        if not self.normalized:
            return raw.clone()
        clean, corrupt = self.clean_seeds, self.corrupt_seeds
        out = (raw - corrupt.reshape(-1, 1, 1)) / (clean - corrupt).reshape(-1, 1, 1)
        bad = torch.tensor([recovery_undefined(float(a), float(c)) for a, c in zip(clean, corrupt)])
        out[bad] = float("nan")
        return out

    @property
    def normalized(self) -> bool:
        """Whether the grid is normalized recovery (``False``: the grid is the metric itself, as
        for the logit lens, which has no clean and corrupt runs: ``meta["normalize"]``)."""
        return self.meta.get("normalize", True) is not False

    @property
    def clean_seeds(self) -> torch.Tensor:
        """The clean baseline per run, tensor[runs] beside :attr:`corrupt_seeds` (a dataset: its prompt's)."""
        runs = self._clean_runs
        return runs.expand(self.corrupt_seeds.numel()) if runs.numel() == 1 else runs

    @property
    def clean_value(self) -> float:
        """:attr:`clean` as the float32 mean of :attr:`clean_seeds` (recovery's arithmetic)."""
        return float(self.clean_seeds.mean())

    @property
    def corrupt_value(self) -> float:
        """:attr:`corrupt`: the mean of the corrupt runs (seeds, prompts)."""
        return self.corrupt

    @property
    def per_seed(self) -> torch.Tensor:
        """Recovery per seed of the first view, tensor[seeds, layers, columns]."""
        return self.recovery()

    @property
    def grid(self) -> torch.Tensor:
        """Normalized recovery of the first view, mean over seeds: tensor[layers, columns]."""
        return self.mean()

    @property
    def grids(self) -> dict[str, torch.Tensor]:
        """``{view: mean recovery}`` for every view."""
        return {view: self.mean(view) for view in self.views}

    def mean(self, view: str | None = None) -> torch.Tensor:
        """Mean recovery over the seeds that could be normalized, tensor[layers, columns]."""
        return _nanmean(self.recovery(view))

    def std(self, view: str | None = None) -> torch.Tensor:
        """Spread of recovery over seeds (population std; 0 with one seed)."""
        rec = self.recovery(view)
        mean = _nanmean(rec)
        return _nanmean((rec - mean) ** 2).sqrt()

    def raw_mean(self, view: str | None = None) -> torch.Tensor:
        """The raw metric averaged over seeds, tensor[layers, columns]."""
        return _nanmean(self.raw[self._view(view)])

    @property
    def n_seeds(self) -> int:
        return int(self.corrupt_seeds.numel())

    def finished_rows(self, view: str | None = None) -> range:
        """The finished rows (layers) of ``view``: all of them unless the result is partial."""
        view, n = self._view(view), len(self.layers)
        state = {"rows_done": self.rows_done, "row_order": self.row_order, "status": self.status}
        return range(*done_span(state, view, n))

    def time_left(self, elapsed: float) -> float:
        """Seconds a running result still needs after ``elapsed`` seconds (−1: unknown yet).

        ``elapsed`` scaled by the work left over the work done: a row counts 1, or, in a view
        whose rows run from the last layer down (``row_order`` −1: each cell computes only the
        layers from its own up), the layers it computes, so the cheap rows first do not promise
        an early end.
        """
        n, spent, total = len(self.layers), 0, 0
        for view in self.rows_done:
            cost = [n - r if self.row_order.get(view) == -1 else 1 for r in range(n)]
            spent += sum(cost[r] for r in self.finished_rows(view))
            total += sum(cost)
        return elapsed * (total - spent) / spent if spent else -1.0

    def top_cells(self, k: int = 5, view: str | None = None) -> list[tuple[int, int, float]]:
        """The ``k`` cells with the highest mean recovery as ``(layer, column, value)``."""
        grid = self.mean(view).clone()
        grid[torch.isnan(grid)] = -math.inf
        flat = grid.flatten()
        k = min(k, flat.numel())
        values, index = flat.topk(k)
        cols = grid.shape[1]
        return [(int(i) // cols, int(i) % cols, float(v)) for v, i in zip(values, index) if v > -math.inf]

    # -- presentation ---------------------------------------------------------------------
    @property
    def col_axis(self) -> str:
        """What a column is: ``"token"`` (a position, or a named group of them), ``"head"``, or
        ``"component"`` (an MLP sender)."""
        # Files saved before ``col_axis`` was recorded name only the site: its axis says.
        return str(self.meta.get("col_axis") or axis_of(self.meta.get("site")))

    @property
    def title(self) -> str:
        """One line naming the experiment, the model and the question, from the experiment's
        declaration (:mod:`pipatch._model.declare`) and this result's metadata."""
        declaration = declared(self.kind)
        if declaration is None:
            return f"{self.kind} · {self.meta.get('model', '?')}"
        return declaration.title(self.meta)

    def __repr__(self) -> str:
        shape = "×".join(str(n) for n in self.raw[self.views[0]].shape[1:])
        parts = [f"views {', '.join(self.views)} [{shape}]", f"metric {self.metric}", *self._repr_has()]
        return f"<pipatch.{type(self).__name__} {self.kind} {self.status}: {', '.join(parts)}>"

    def _repr_has(self) -> list[str]:
        """What the repr names besides the grid, as far as the result has it: the baselines
        (normalized: clean and corrupt; the lens: the output it reads against; else none),
        then the runs averaged (a dataset's prompts, or the noise seeds of an experiment that
        draws them)."""
        if self.normalized:
            has = [f"clean {self.clean_value:.4g}", f"corrupt {self.corrupt_value:.4g}"]
        else:
            has = [f"output {self.clean_value:.4g}"] if "output" in self.meta else []
        if self.meta.get("prompts"):
            has.append(f"{self.n_seeds} {self._seed_axis()['seed_noun']}")
        elif "seeds" in self.meta:
            has.append(f"{self.n_seeds} seed{'s' if self.n_seeds != 1 else ''}")
        return has

    def text(self, view: str | None = None, width: int = 7) -> str:
        """A text heatmap: layers as rows (layer 0 first), columns as columns, block characters
        ``░▒▓█``; then the top cells. Made from :meth:`to_state` like every other view."""
        from .views import text_grid

        return text_grid(self.to_state(live=True), self._view(view), width=width)

    def plot(self, view: str | None = None, ax=None, *, mode: str = "recovery", seed: int = -1,
             top: int | None = None, scale: str | tuple[float, float] = "auto"):
        """A matplotlib heatmap of one view: layers × columns with layer 0 at the top (as in the
        live grid), NaN grey. Signed values (normalized recovery, a logit difference) are on the
        diverging map centred at 0; a probability or a rank drawn as itself (the logit lens,
        ``mode="raw"`` of ``prob``) on a sequential map, rank 0 the darkest. The subject's
        columns are marked (▲, bold labels) and cells checked by an exact patch outlined.

        ``mode="raw"`` colours by the raw metric (a comparison's ``mode="a"`` / ``"b"`` shows one
        side), ``seed`` (≥ 0) shows one seed instead of the mean. Drawn into ``ax`` when given,
        else into a new pyplot figure. Returns the figure. :func:`pipatch.plot` draws several
        results side by side on one colour scale.

        A circuit (``kind="circuit"``) is drawn as its graph instead: nodes by layer (the
        embeddings at the bottom, the logits at the top), its ``top`` edges by ``|score|`` coloured
        by their score on the same diverging map, and, beside it (not when drawn into ``ax``),
        the faithfulness curve where the result has one. Saving the figure as SVG (or
        ``.png``) exports it; :meth:`graph` is the same graph as JSON.

        Parameters
        ----------
        top
            A circuit's edges drawn (``None``: as many as the faithful circuit has, the smallest
            reaching the share; 50 where the curve found none).
        scale
            The colour range: ``"auto"`` this plot's own values, or ``(vmin, vmax)`` (to match
            another plot; a diverging map keeps 0 at its centre, with half-range
            ``max(|vmin|, |vmax|)``). A range that is not two finite numbers with
            ``vmin < vmax`` raises :class:`PipatchError`.
        """
        from .views import figure
        from .views.render import check_scale

        return figure(self.to_state(live=seed < 0), self._view(view), mode=mode, seed=seed, ax=ax, pyplot=True,
                      top=top, scale=check_scale(scale))

    def graph(self, top: int | None = None) -> dict[str, Any]:
        """A circuit's graph as JSON (:meth:`pipatch._results.circuit.CircuitResult.graph`);
        any other result refuses it in one line."""
        raise PipatchError(f"graph() is a circuit's; this is a {self.kind} result: run pipatch.circuit")

    def frame(self):
        """A long pandas DataFrame: one row per (view, layer, column) with its ``label``, the
        mean ``recovery`` (the metric itself where the result is not normalized), its ``std``
        over seeds and the ``raw`` metric's mean, each a float (NaN where not computed)."""
        rows = []
        for view in self.views:
            mean, std, raw = self.mean(view), self.std(view), self.raw_mean(view)
            for layer in range(mean.shape[0]):
                for col in range(mean.shape[1]):
                    rows.append({
                        "view": view, "layer": layer, "column": col, "label": self.columns[col],
                        "recovery": float(mean[layer, col]), "std": float(std[layer, col]),
                        "raw": float(raw[layer, col]),
                    })
        return table(rows)

    def to_dataframe(self):
        """Deprecated: :meth:`frame` (the same table; every result and a study have ``frame()``)."""
        warnings.warn("Result.to_dataframe() is deprecated: use Result.frame() (the same table)",
                      DeprecationWarning, stacklevel=2)
        return Result.frame(self)

    def edges(self):
        """A circuit's table of edges (:meth:`pipatch._results.circuit.CircuitResult.edges`);
        any other result refuses it in one line."""
        raise PipatchError(f"edges() is a circuit's table; this is a {self.kind} result: run pipatch.circuit")

    def code(self) -> str:
        """A short Python script, using nnsight and transformers only (no pipatch), that recomputes
        this result's grid the straightforward way: same model, prompts, answer / foil, site,
        direction, metric, seeds and noise. ``python script.py OUT.json`` writes
        ``{"grid": [[...], ...], "grids": {view: ...}}``, equal to :attr:`grid` / :attr:`grids`.

        Works for a result read back with :func:`load_result` too (it reads ``meta`` only).
        Raises :class:`PipatchError` for a result it cannot express (see :mod:`pipatch._results.code`).
        """
        from .code import script

        return script(self)

    def _code_or_empty(self) -> str:
        """:meth:`code`, or ``""`` where there is none (the views then show no Code button).

        Made once per result: the script reads ``meta``'s inputs, which are set when the sweep is
        planned, and a live grid asks for the state after every row."""
        if "_code_text" not in self.__dict__:
            try:
                self.__dict__["_code_text"] = self.code()
            except PipatchError:
                self.__dict__["_code_text"] = ""
        return self.__dict__["_code_text"]

    # -- serialization --------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION, "kind": self.kind, "tokens": self.tokens, "columns": self.columns,
            "layers": self.layers, "metric": self.metric, "views": self.views,
            "clean": self.clean if self._clean_runs.numel() == 1 else None,
            "rows_done": self.rows_done, "row_order": self.row_order, "status": self.status,
            "message": self.message, "warnings": self.warnings, "meta": self.meta,
        }

    @overload
    def to_json(self, path: None = None) -> dict[str, Any]: ...

    @overload
    def to_json(self, path: str | Path) -> Path: ...

    def to_json(self, path: str | Path | None = None) -> dict[str, Any] | Path:
        """A plain-JSON copy: the first view's mean grid as a list of rows, plus every view.

        Keys: ``kind, model, tokens, columns, layers, grid, metric, clean, corrupt, corrupt_seeds,
        views, ...`` (the baselines one number each, ``corrupt_seeds`` one per run, ``clean_seeds``
        too where rows differ: a dataset); ``views[view]`` holds ``mean``, ``std``, ``raw`` (means
        over seeds) and ``raw_seeds`` (the raw metric per seed, ``[seeds][layers][columns]``), so
        :func:`load_result` reads the file back whole. NaN becomes ``null``.

        Parameters
        ----------
        path
            Where to write it as a UTF-8 JSON file (any name); ``None`` (default): write
            nothing and return the document.

        Returns
        -------
        dict or Path
            The document (a dict of plain JSON values), or the path written.
        """
        document = self._json_document()
        if path is None:
            return document
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(document, ensure_ascii=False, allow_nan=False, indent=1), encoding="utf-8")
        tmp.replace(path)
        return path

    def _json_document(self) -> dict[str, Any]:
        """The :meth:`to_json` document."""
        out = {
            "schema": SCHEMA_VERSION, "kind": self.kind, "model": self.meta.get("model"), "tokens": self.tokens,
            "columns": self.columns, "layers": self.layers, "grid": _rows(self.grid), "metric": self.metric,
            "clean": self.clean, "corrupt": self.corrupt, "corrupt_seeds": self.corrupt_seeds.tolist(),
            **({"clean_seeds": self.clean_seeds.tolist()} if self._clean_runs.numel() > 1 else {}),
            "rows_done": self.rows_done, "row_order": self.row_order,
            "status": self.status, "message": self.message, "warnings": self.warnings, "meta": self.meta,
            "views": {v: {"mean": _rows(self.mean(v)), "std": _rows(self.std(v)), "raw": _rows(self.raw_mean(v)),
                          "raw_seeds": [_rows(seed) for seed in self.raw[v]]}
                      for v in self.views},
        }
        return json_safe(out)

    def _file_parts(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The JSON header and the tensors of the result's file (read back by :func:`load_result`)."""
        header = self._header()
        tensors = {f"raw/{clean_text(view)}": t.contiguous().float() for view, t in self.raw.items()}
        tensors["corrupt"] = self.corrupt_seeds.contiguous()
        if self._clean_runs.numel() > 1 or not math.isfinite(self.clean):
            tensors["clean"] = self.clean_seeds.contiguous()
            if self._clean_runs.numel() == 1:
                header["clean_scalar"] = True
        return header, tensors

    @staticmethod
    def parts_from_json(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The file parts (header, tensors) of a :meth:`to_json` document (older ones too: runs as lists)."""
        views = doc["views"]
        header = {key: doc.get(key) for key in ("schema", "kind", "tokens", "columns", "layers", "metric", "rows_done",
                                                "row_order", "status", "message", "warnings", "meta")}
        header["views"] = list(views)
        tensors = {"corrupt": _tensor(doc["corrupt_seeds"] if "corrupt_seeds" in doc else doc["corrupt"])}
        for view, grids in views.items():
            if "raw_seeds" not in grids:
                raise ValueError(f"view {view!r} holds only means (no raw_seeds): write it again with this pipatch")
            tensors[f"raw/{view}"] = _tensor(grids["raw_seeds"])
        clean = doc["clean_seeds"] if "clean_seeds" in doc else doc.get("clean")
        if isinstance(clean, (int, float)):
            header["clean"] = float(clean)
        else:  # per-row baselines (a dataset), or a non-finite one written as null
            tensors["clean"] = _tensor(clean if isinstance(clean, list) else [float("nan")])
            header["clean_scalar"] = not isinstance(clean, list)
        return header, tensors

    @classmethod
    def from_parts(cls, header: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> Result:
        """The result a file's header and tensors describe, checked whole (``where`` names the file)."""
        views = header.get("views") or []
        raw = {}
        corrupt = tensors.get("corrupt")
        for view in views:
            t = tensors.get(f"raw/{view}")
            expected = (corrupt.numel() if corrupt is not None else -1, len(header["layers"]), len(header["columns"]))
            if t is None or tuple(t.shape) != expected:
                raise PipatchError(
                    f"{where} is inconsistent: view {view!r} has shape "
                    f"{None if t is None else tuple(t.shape)}, labels say {expected}; re-save the result"
                )
            raw[view] = t
        if header.get("clean") is None and tensors.get("clean") is None:
            raise PipatchError(f"{where} has no clean baseline: re-save the result")
        if not raw or corrupt is None:
            raise PipatchError(f"{where} holds no grid: re-save the result")
        return cls(
            kind=header["kind"], tokens=header["tokens"], columns=header["columns"], layers=header["layers"],
            metric=header["metric"], raw=raw, corrupt=corrupt,
            clean=(float(header["clean"]) if header.get("clean") is not None
                   else float(tensors["clean"].reshape(-1)[0]) if header.get("clean_scalar") else tensors["clean"]),
            meta=header.get("meta") or {}, rows_done=header.get("rows_done") or {},
            row_order=header.get("row_order") or {}, status=header.get("status") or "done",
            message=header.get("message") or "", warnings=header.get("warnings") or [],
        )

    def save(self, path: str | Path) -> Path:
        """Write the result whole to one file, its format picked by the suffix of ``path``.

        ``.safetensors``: the tensors, with the metadata as JSON in the file's header (strict,
        UTF-8-safe JSON: the one sanitiser turns lone surrogates into U+FFFD and non-finite
        numbers into ``null``; a non-finite clean baseline is kept as a tensor). ``.json``: the
        :meth:`to_json` document (every seed's raw values included). :func:`load_result` reads
        both back.

        Returns the path written. Raises :class:`PipatchError` for any other suffix (one line
        naming the two accepted), before anything is written.
        """
        path = result_file(path)
        if path.suffix.lower() == ".json":
            return self.to_json(path)
        from safetensors.torch import save_file

        header, tensors = self._file_parts()
        text = json.dumps(json_safe(header), ensure_ascii=False, allow_nan=False)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"pipatch": text})
        tmp.replace(path)
        return path

    def arrays(self, views: list[str] | None = None, *, live: bool = False) -> dict[str, np.ndarray]:
        """The float32 arrays a front end draws, by name ``"<view>/<what>"``.

        ``live=True`` keeps just the means (what a running grid shows) to keep updates small.
        """
        out: dict[str, np.ndarray] = {}
        for view in views or self.views:
            out[f"{view}/mean"] = self.mean(view).numpy().astype("<f4")
            out[f"{view}/raw_mean"] = self.raw_mean(view).numpy().astype("<f4")
            # Small, and it changes while attribution's verification runs: live updates carry it.
            verified = self.meta.get("verified", {}).get(view) if isinstance(self.meta.get("verified"), dict) else None
            if verified is not None:
                out[f"{view}/verified"] = np.asarray(verified, dtype="<f4")
            if live:
                continue
            out[f"{view}/std"] = self.std(view).numpy().astype("<f4")
            out[f"{view}/seeds"] = self.recovery(view).numpy().astype("<f4")
            out[f"{view}/raw_seeds"] = self.raw[view].numpy().astype("<f4")
        return out

    def to_state(self, *, live: bool = False) -> dict[str, Any]:
        """The one view state every view is made from (see :mod:`pipatch._results.views`): labels, status,
        baselines and binary float32 arrays, in the schema of ``pipatch._results.views.STATE_SCHEMA``
        (less ``detail``, a click's answer), text UTF-8 safe. ``live=True`` sends only the means.
        """
        meta = self.meta
        return conform_state({
            "title": self.title, "kind": self.kind, "model_name": str(meta.get("model", "")),
            "metric": self.metric, "row_labels": list(self.layers), "col_labels": list(self.columns),
            "row_axis": "", "row_notes": [], "cell_notes": {},  # rows are layers, with nothing more to say (features: latents)
            "col_axis": self.col_axis, "views": self.views,
            "n_seeds": self.n_seeds, **self._seed_axis(), "arrays": self.arrays(live=live), "rows_done": dict(self.rows_done),
            "row_order": dict(self.row_order),
            "total_rows": len(self.layers) * len(self.views), "status": self.status,
            "message": self.message, "warnings": list(self.warnings),
            "elapsed": float(meta.get("elapsed", 0.0) or 0.0), "eta": -1.0,
            "baselines": ({"clean": self.clean_value, "corrupt": float(np.nanmean(self.corrupt_seeds.numpy()))}
                          if self.normalized else {"output": self.clean_value} if "output" in meta else {}),
            "stoppable": False, "live_id": "",  # a result is no widget: its copy pairs with none
            "code": self._code_or_empty(),
            "sides": [], "compared": "",  # one result, not a comparison (pipatch._results.compare)
            "values": "" if self.normalized else "metric",
            "circuit": {},  # a circuit's graph: pipatch._results.circuit
            "subject": self._subject_columns(),
            "feature_graph": {},  # a feature circuit's graph: pipatch._results.feature_circuit
        })

    def _subject_columns(self) -> list[int]:
        """The columns holding the subject's tokens: its positions among those swept, or (a
        dataset, whose columns are named positions) its first, middle and last."""
        if self.col_axis != "token":
            return []
        if self.meta.get("dataset"):
            return [i for i, name in enumerate(self.columns) if name.endswith(" subject")]
        swept = self.meta.get("positions") or range(len(self.tokens))
        column = {int(position): i for i, position in enumerate(swept)}
        return [column[p] for p in self.meta.get("subject_positions") or [] if p in column]

    def _seed_axis(self) -> dict[str, Any]:
        """What the seed axis holds: noise draws, or (a dataset) one entry per prompt and seed,
        prompt-major, each named by its prompt."""
        prompts = self.meta.get("prompts") or []
        if not prompts:
            return {"seed_noun": "seeds", "seed_labels": []}
        per = self.meta.get("rows_per_prompt") or [max(1, self.n_seeds // len(prompts))] * len(prompts)
        labels = [f"prompt {p}" + (f" · seed {s}" if n > 1 else "") + f": {text or ''}"
                  for p, (text, n) in enumerate(zip(prompts, per)) for s in range(n)]
        return {"seed_noun": "prompts" if max(per) == 1 else "prompt × seed runs", "seed_labels": labels}

    def to_mime(self) -> dict[str, Any]:
        """The ``application/vnd.pipatch.grid+json`` document: the state with base64 arrays."""
        return mime_document(self.to_state())

    def _repr_mimebundle_(self, include=None, exclude=None):
        return mime_bundle(self.to_state())


def _nanmean(t: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 ignoring NaN; all-NaN stays NaN, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nanmean(t, dim=0)


def _rows(t: torch.Tensor) -> list[list[float | None]]:
    """A [rows, columns] tensor as JSON rows, NaN as ``None``."""
    return [[None if math.isnan(v) else v for v in row] for row in t.tolist()]


def load_result(path: str | Path) -> Result:
    """Read a file written by :meth:`Result.save` or :meth:`Result.to_json` (what the ``pipatch``
    command writes too), its format by its suffix: ``.json`` is JSON, any other
    (``.safetensors``; an older pipatch saved safetensors under any name) safetensors.

    Refuses, with one clear line, anything that is not a complete pipatch result of a known
    schema: a file that is not what its suffix says (JSON named ``.safetensors``, safetensors
    named ``.json``: the line names the suffix to rename it to), a truncated file, another
    format (a renamed Python object dump, say), a newer schema, JSON without the per-seed
    values, or tensors whose shapes disagree with the labels. Nothing is half-loaded.
    """
    path = Path(path)
    where = repr(str(path))
    if not path.exists():
        raise PipatchError(f"no result file at {where}: check the path")
    is_json = path.suffix.lower() == ".json"
    holds = _format_of(path)
    if holds is not None and holds != ("json" if is_json else "safetensors"):
        rename = path.with_suffix(".safetensors" if is_json else ".json").name
        raise PipatchError(f"{where} holds {'a safetensors result' if is_json else 'JSON'}, not what its suffix "
                           f"{path.suffix or '(none)'!r} says: rename it to {rename!r} and load that")
    header, tensors = _read_json(path) if is_json else _read_safetensors(path)
    if header.get("schema") != SCHEMA_VERSION:
        raise PipatchError(
            f"{where} has result schema {header.get('schema')!r}, this pipatch reads {SCHEMA_VERSION}: "
            "upgrade pipatch or re-save the result"
        )
    return result_from_parts(header, tensors, where)


def result_file(path: str | Path) -> Path:
    """``path`` as the name of a result's file: its suffix is one of :data:`FILE_SUFFIXES`
    (any case), or one :class:`PipatchError` line naming it and the two accepted."""
    path = Path(path)
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise PipatchError(f"cannot save to {str(path)!r}: its suffix {path.suffix or '(none)'!r} names no format "
                           "pipatch writes; end the name in .safetensors (the tensors, exact) or .json (plain JSON)")
    return path


def _format_of(path: Path) -> str | None:
    """What the file's first bytes say it holds: ``"safetensors"`` (an 8-byte header length,
    then the JSON header), ``"json"`` (an object), or ``None`` (neither: the readers say why)."""
    with open(path, "rb") as handle:
        start = handle.read(9)
    if len(start) == 9 and start[8:9] == b"{" and int.from_bytes(start[:8], "little") <= path.stat().st_size - 8:
        return "safetensors"
    if start.lstrip()[:1] == b"{":
        return "json"
    return None


def _read_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # noqa: BLE001 - any parse failure means "not ours / damaged"
        raise PipatchError(
            f"{str(path)!r} is not a readable pipatch result ({type(error).__name__}): it is truncated "
            "or another format; re-save it with Result.save()"
        ) from None
    if "pipatch" not in metadata:
        raise PipatchError(f"{str(path)!r} is a safetensors file but not a pipatch result: no pipatch header")
    try:
        return json.loads(metadata["pipatch"]), tensors
    except json.JSONDecodeError:
        raise PipatchError(f"{str(path)!r} has a damaged pipatch header: re-save the result") from None


def _read_json(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return parts_from_json(doc)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise PipatchError(
            f"{str(path)!r} is not a pipatch result's JSON ({type(error).__name__}: {error}): write it with "
            "Result.to_json() or the CLI's --json"
        ) from None


def parts_from_json(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The file parts (header, tensors) of a :meth:`Result.to_json` document, as its kind reads them."""
    return Result.FILE_KINDS.get(doc.get("kind") or "", Result).parts_from_json(doc)


def _tensor(values: Any) -> torch.Tensor:
    """A float32 tensor from JSON numbers (``null`` → NaN)."""
    def nan(x):
        return [nan(v) for v in x] if isinstance(x, list) else float("nan") if x is None else float(x)

    return torch.tensor(nan(values), dtype=torch.float32)


def result_from_parts(header: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> Result:
    """The result a file's header and tensors describe, checked whole (``where`` names the
    file), as its kind reads them."""
    return Result.FILE_KINDS.get(header.get("kind") or "", Result).from_parts(header, tensors, where)
