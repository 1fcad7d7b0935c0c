"""The one view state: its schema, and the function that makes any state conform to it.

``Result.to_state()`` produces the state; every view is made from it: the widget's traits
(:mod:`pipatch._notebook.widget`), the MIME document and bundle (:mod:`.mime`), the figure and PNG
(:mod:`.render`), the text grid (:mod:`.text`). ``js/schema.ts`` holds the same schema for
the browser and ``normalizeState`` (``js/data.ts``) reads a state through it;
``js/__tests__/parity.test.ts`` checks that both schemas are equal and that a state made
here is read there with the declared types and shapes (``tests/_contract.py`` makes the
example). A new field is one line here and one in ``js/schema.ts``.

Types: ``str``, ``str[]``, ``int``, ``int[]``, ``int?`` (``null`` for none), ``float``,
``float[]``, ``float?`` (``null`` when not finite), ``float?[]``, ``bool``, ``{str: int}``,
``{str: float?}``, ``{str: str[]}``, ``arrays`` (``{name: {data, dtype, shape}}``), and the named objects
``detail``, ``top[]``, ``selection``, ``ui``, ``circuit`` (``node[]``, ``check[]``,
``faithfulness``): ``OBJECT_SCHEMAS``.

Arrays are named ``<view>/<what>``; ``ARRAY_SCHEMA`` gives each ``what`` its shape in terms
of ``rows`` (``len(row_labels)``), ``cols`` (``len(col_labels)``) and ``seeds``
(``n_seeds``). Row 0 is layer 0 and is drawn at the top in every view. Rows finish in the order
``row_order`` gives per view (``-1``: the last row first, else row 0 first), so the finished rows
are one band at the top or the bottom (:func:`done_span`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .strings import clean_text, json_safe

__all__ = [
    "ARRAY_DTYPE", "ARRAY_SCHEMA", "CHECK_SCHEMA", "CIRCUIT_SCHEMA", "DETAIL_SCHEMA", "DOCUMENT_SCHEMA",
    "FAITHFULNESS_SCHEMA", "FEATURE_GRAPH_SCHEMA", "FEDGE_SCHEMA", "FNODE_SCHEMA", "GROUP_SCHEMA", "MIME_TYPE", "NODE_SCHEMA", "OBJECT_SCHEMAS", "SCHEMA_VERSION", "SELECTION_SCHEMA", "STATE_KEYS", "STATE_SCHEMA", "TOP_SCHEMA", "UI_SCHEMA", "conform_state",
    "decode_array", "done_span", "encode_array", "select_matrix",
]  # fmt: skip

#: The grid document's MIME type (saved notebooks; the JupyterLab extension renders it).
MIME_TYPE = "application/vnd.pipatch.grid+json"
#: Version of the result schema: the saved file's header ``schema`` and the document's
#: ``version``. Bump it when a reader of the previous version would misread the new one.
SCHEMA_VERSION = 1

#: Kernel → browser: the state of one grid (widget traits of the same names).
STATE_SCHEMA: dict[str, str] = {
    "title": "str",
    "kind": "str",
    "model_name": "str",
    "metric": "str",
    "row_labels": "str[]",
    "row_axis": "str",  # what a row is: "" a layer, "latent" an SAE latent, "rank" a rank (named in the tooltip)
    "row_notes": "str[]",  # per row, text shown on hover under its name (a latent's label and top contexts; [] none)
    "cell_notes": "{str: str[]}",  # per view, text per cell (row-major) shown on hover (a feature read's latents; {} none)
    "col_labels": "str[]",
    "col_axis": "str",
    "views": "str[]",
    "n_seeds": "int",
    "seed_noun": "str",  # what the seed axis holds: "seeds" (noise draws) or a dataset's "prompts"
    "seed_labels": "str[]",  # a name per entry of the seed axis ([]: "seed i")
    "arrays": "arrays",
    "rows_done": "{str: int}",
    "row_order": "{str: int}",  # per view, -1 when its rows run from the last one up (missing: from row 0)
    "total_rows": "int",
    "status": "str",
    "message": "str",
    "warnings": "str[]",
    "elapsed": "float",
    "eta": "float",
    "baselines": "{str: float?}",
    "detail": "detail",
    "stoppable": "bool",
    "live_id": "str",  # the live widget a saved copy stands in for ("" for none)
    "code": "str",  # Result.code(): the plain nnsight script that recomputes the grid ("" for none)
    "sides": "str[]",  # a comparison's two sides, "a: …" and "b: …" ([] for one result)
    "compared": "str",  # what a comparison subtracts: "recovery" or "raw" ("" for one result)
    "values": "str",  # what one result's cells hold: "" normalized recovery, "metric" the metric itself
    "circuit": "circuit",  # a circuit's graph ({} for any other result): drawn as a graph, not a heatmap
    "subject": "int[]",  # the columns holding the subject's tokens (a dataset: its named positions), drawn marked
    "feature_graph": "feature_graph",  # a feature circuit's graph ({} for any other result): drawn as a graph
}
STATE_KEYS: tuple[str, ...] = tuple(STATE_SCHEMA)

#: The answer to a click (``pipatch._notebook.live.answer_selection``); every field optional.
DETAIL_SCHEMA: dict[str, str] = {
    "view": "str", "seed": "int", "row": "int", "col": "int", "value": "float?", "raw": "float?",
    "top": "top[]", "error": "str",
    "exact": "float?", "exact_pairs": "int",  # a circuit: the clicked edge's exact change over exact_pairs pairs
}  # fmt: skip
TOP_SCHEMA: dict[str, str] = {"token": "str", "prob": "float?"}

#: A circuit's graph (:mod:`.circuit`); its edges' scores are the arrays ``edges/raw_mean`` less
#: the corrupt baseline. Every field optional (``{}``: not a circuit).
CIRCUIT_SCHEMA: dict[str, str] = {
    "nodes": "node[]",  # embeddings first, then layer by layer (heads, the MLP), the logits last
    "senders": "int[]",  # per column (sender): its node
    "receivers": "int[]",  # per row (receiver): its node
    "ports": "float[]",  # per row: where on its node's lower side that input is drawn (x offset, graph units)
    "checked": "check[]",  # the edges patched exactly
    "agreement": "{str: float?}",  # the checks against the estimates: spearman, max_abs_error, n
    "faithfulness": "faithfulness",  # absent when the result has no curve
}
#: ``x`` in [0, 1] across its row, ``y`` its row (0: the embeddings; an MLP a little higher
#: than its layer's heads); ``layer`` −1 for the embeddings, the number of layers for the logits.
NODE_SCHEMA: dict[str, str] = {"name": "str", "kind": "str", "layer": "int", "x": "float", "y": "float"}
#: One checked edge, at grid cell (row, col): its estimated and exact change of the metric.
CHECK_SCHEMA: dict[str, str] = {"row": "int", "col": "int", "estimate": "float?", "exact": "float?"}
#: Normalized recovery of the circuit of the top ``sizes[i]`` edges (the rest ablated); ``size``
#: the smallest that reaches ``share`` (``null``: none does) out of ``edges``.
FAITHFULNESS_SCHEMA: dict[str, str] = {
    "sizes": "int[]", "recovery": "float?[]", "share": "float?", "size": "int?", "edges": "int",
}  # fmt: skip
#: A feature circuit's graph (:meth:`pipatch._results.feature_circuit.FeatureCircuitResult.to_state`):
#: rows are its SAEs (``sites``, bottom up; the metric's node one row above), columns its
#: positions; the nodes drawn (the circuit's and the largest others), the edges kept, and the
#: user's groups of nodes (supernodes). Every field optional (``{}``: not a feature circuit).
FEATURE_GRAPH_SCHEMA: dict[str, str] = {
    "sites": "str[]", "positions": "int[]", "nodes": "fnode[]", "edges": "fedge[]", "groups": "group[]",
    "total": "int",  # how many nodes the graph has in all (more than drawn when it is large)
}  # fmt: skip
#: One node: ``row`` its SAE (``len(sites)``: the metric), ``latent`` its id (``null``: an error
#: or the metric, ``kind`` says which), ``score`` the estimate, ``exact`` the exact patch's change
#: (``null``: not checked), ``circuit`` kept by the pruning, ``note`` its label and top contexts.
FNODE_SCHEMA: dict[str, str] = {
    "name": "str", "row": "int", "position": "int", "latent": "int?", "kind": "str", "score": "float?",
    "exact": "float?", "circuit": "bool", "note": "str",
}  # fmt: skip
#: One edge between nodes ``up`` and ``down`` (indices into ``nodes``), its estimate ``score`` and
#: ``exact`` patch (``null``: not checked).
FEDGE_SCHEMA: dict[str, str] = {"up": "int", "down": "int", "score": "float?", "exact": "float?"}
#: A supernode: a name for a group of nodes (by name).
GROUP_SCHEMA: dict[str, str] = {"name": "str", "nodes": "str[]"}
#: The named object types and the schema each follows.
OBJECT_SCHEMAS: dict[str, dict[str, str]] = {
    "circuit": CIRCUIT_SCHEMA, "node": NODE_SCHEMA, "check": CHECK_SCHEMA, "faithfulness": FAITHFULNESS_SCHEMA,
    "feature_graph": FEATURE_GRAPH_SCHEMA, "fnode": FNODE_SCHEMA, "fedge": FEDGE_SCHEMA, "group": GROUP_SCHEMA,
}  # fmt: skip

#: Browser → kernel: what the user chose (widget traits of the same names).
UI_SCHEMA: dict[str, str] = {
    "view": "str", "seed": "int", "mode": "str", "selected": "selection", "stop_requested": "bool",
}  # fmt: skip
SELECTION_SCHEMA: dict[str, str] = {"view": "str", "seed": "int", "row": "int", "col": "int"}

#: The saved document is the state (less ``detail``) plus these.
DOCUMENT_SCHEMA: dict[str, str] = {"version": "int", "ui": "ui"}

ARRAY_DTYPE = "float32"
ARRAY_SCHEMA: dict[str, tuple[str, ...]] = {
    "mean": ("rows", "cols"),
    "raw_mean": ("rows", "cols"),
    "std": ("rows", "cols"),
    "seeds": ("seeds", "rows", "cols"),
    "raw_seeds": ("seeds", "rows", "cols"),
    "verified": ("rows", "cols"),
    "a": ("rows", "cols"),  # a comparison's sides (its "mean" is a − b)
    "b": ("rows", "cols"),
}


# --------------------------------------------------------------------------- arrays


def decode_array(spec: Any) -> np.ndarray:
    """A float32 ndarray from an ndarray / tensor / ``{data, dtype, shape}`` (bytes or base64)."""
    if isinstance(spec, Mapping):
        data = spec.get("data")
        dtype = np.dtype(spec.get("dtype", ARRAY_DTYPE)).newbyteorder("<")
        shape = tuple(int(s) for s in spec.get("shape", ()))
        if isinstance(data, str):
            raw = base64.b64decode(data)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            return decode_array(data)
        arr = np.frombuffer(raw, dtype=dtype).astype(np.float32)
        return arr.reshape(shape) if shape else arr
    if hasattr(spec, "detach"):  # torch.Tensor without importing torch
        spec = spec.detach().float().cpu().numpy()
    return np.asarray(spec, dtype=np.float32)


def encode_array(spec: Any) -> dict[str, Any]:
    """Wire form of one array: raw little-endian float32 bytes plus dtype and shape."""
    if isinstance(spec, Mapping) and isinstance(spec.get("data"), bytes) and spec.get("dtype", ARRAY_DTYPE) == ARRAY_DTYPE:
        return {"data": spec["data"], "dtype": ARRAY_DTYPE, "shape": [int(s) for s in spec["shape"]]}
    arr = np.ascontiguousarray(decode_array(spec), dtype="<f4")
    return {"data": arr.tobytes(), "dtype": ARRAY_DTYPE, "shape": list(arr.shape)}


def arrays_to_base64(arrays: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The arrays as the JSON document holds them: base64 of the float32 bytes."""
    return {
        clean_text(k): {"dtype": ARRAY_DTYPE, "shape": v["shape"], "data": base64.b64encode(v["data"]).decode("ascii")}
        for k, v in ((k, encode_array(v)) for k, v in (arrays or {}).items())
    }


# --------------------------------------------------------------------------- conforming


def _float(value: Any, unknown: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else unknown


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _conform(kind: str, value: Any) -> Any:
    if kind == "str":
        return clean_text(value)
    if kind == "str[]":
        return [clean_text(x) for x in value]
    if kind == "int":
        return int(value)
    if kind == "int?":
        return None if value is None else int(value)
    if kind == "int[]":
        return [int(x) for x in value]
    if kind == "float":
        return _float(value, -1.0)  # elapsed / eta: −1 reads "unknown"
    if kind == "float[]":
        return [_float(x, 0.0) for x in value]
    if kind == "float?":
        return _finite_or_none(value)
    if kind == "float?[]":
        return [_finite_or_none(x) for x in value]
    if kind == "bool":
        return bool(value)
    if kind == "{str: int}":
        return {clean_text(k): int(v) for k, v in dict(value or {}).items()}
    if kind == "{str: float?}":
        return {clean_text(k): _finite_or_none(v) for k, v in dict(value or {}).items()}
    if kind == "{str: str[]}":
        return {clean_text(k): [clean_text(x) for x in v] for k, v in dict(value or {}).items()}
    if kind == "arrays":
        return {clean_text(k): encode_array(v) for k, v in dict(value or {}).items()}
    if kind == "detail":
        return json_safe(dict(value or {}))
    if kind.endswith("[]") and kind[:-2] in OBJECT_SCHEMAS:
        return [_conform(kind[:-2], x) for x in value or []]
    if kind in OBJECT_SCHEMAS:
        schema, value = OBJECT_SCHEMAS[kind], dict(value or {})
        return {key: _conform(schema[key], value[key]) for key in schema if key in value}
    raise ValueError(f"unknown schema type {kind!r}")


def conform_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``state`` that the schema knows, each in its declared type: text UTF-8 safe
    (lone surrogates → U+FFFD), non-finite numbers ``None`` (−1 for ``elapsed``/``eta``),
    arrays in wire form (float32 bytes). Unknown keys are dropped; missing ones stay missing
    (a partial state is an update)."""
    return {key: _conform(kind, state[key]) for key, kind in STATE_SCHEMA.items() if key in state}


def select_matrix(state: Mapping[str, Any], view: str, seed: int = -1, mode: str = "recovery") -> np.ndarray | None:
    """The [rows, cols] values drawn for a view / seed (−1: the mean) / mode; ``None`` when the
    state has no such array. As ``selectMatrix`` in ``js/data.ts``.

    ``mode`` is what the cells show: for one result ``"recovery"`` (normalized recovery) or
    ``"raw"`` (the raw metric); for a comparison (``sides`` set) ``"diff"`` (a − b), ``"a"`` or
    ``"b"`` (one side's compared values). Any other mode shows ``<view>/mean``.
    """
    arrays = state.get("arrays") or {}
    if mode in ("a", "b"):
        names = [f"{view}/{mode}"]
    elif mode == "raw":
        names = [f"{view}/raw_seeds", f"{view}/raw_mean"]
    else:
        names = [f"{view}/seeds", f"{view}/mean"]
    if seed >= 0 and len(names) == 2 and names[0] in arrays:
        seeds = decode_array(arrays[names[0]])
        if seeds.ndim == 3 and seed < seeds.shape[0]:
            return seeds[seed]
    if names[-1] not in arrays:
        return None
    grid = decode_array(arrays[names[-1]])
    return grid if grid.ndim == 2 else grid.reshape(len(state.get("row_labels") or []) or 1, -1)


def done_span(state: Mapping[str, Any], view: str, n_rows: int) -> tuple[int, int]:
    """The finished (drawn) rows of ``view``, ``range(*span)``; the rest are pending. As
    ``doneSpan`` in ``js/format.ts``: ``rows_done[view]`` rows from the top, or from the bottom
    when ``row_order[view]`` is -1; a view missing from ``rows_done`` is finished unless the grid
    is running."""
    done = (state.get("rows_done") or {}).get(view)
    if done is None:
        done = 0 if state.get("status") == "running" else n_rows
    done = max(0, min(n_rows, int(done)))
    return (n_rows - done, n_rows) if (state.get("row_order") or {}).get(view) == -1 else (0, done)
