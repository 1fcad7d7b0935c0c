"""What the kernel promises the browser, as JSON: read by ``js/__tests__/parity.test.ts``.

``python tests/_contract.py`` prints it (the vitest parity test runs this with the project's
Python); ``tests/unit/test_views.py`` writes it to a file and runs the vitest test on it.

It holds the Python side of every shared definition (the state schema, the MIME type and
version, the array shapes, the colour map, the escaping rule over all code points) and real
states made by pipatch: a result's MIME document, its live state and a widget's traits after
a click was answered. The TypeScript side compares its own definitions with these and reads
the states through ``normalizeState``.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HOSTILE_LABELS = [
    " Paris", "<img src=x onerror=alert(1)>", "a\x00b", "\n", "x\u200dy", "\u202eevil", "\ud800", "\udc00x",
    "\ud83d\ude00", "😀", "  ", " ", "", "\u2066iso\u2069", "\ufff9ann\ufffb", "\u2028", "\u00ad", "\ufe0f", "\U000e0041",
    "\U000f0000", "\ufffe", "\u0378", "\u3164", "\u180e", "\u0600", "$x$", "x" * 40, "\x7f\x9f", "é", "e\u0301",
]


def example_result(flip: bool = False):
    """A small result: 2 views × 3 layers × 4 columns, 2 seeds, one verified mask, hostile labels
    (``flip``: the same with its columns reversed, to compare it with)."""
    import torch

    from pipatch._results.result import Result

    raw = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) / 24
    raw[:, 0, 0] = float("nan")
    raw = raw.flip(2) if flip else raw
    return Result(
        kind="attribution", tokens=["The", " Eiffel\ud800", "\u202e", " of"], columns=["The", " Eiffel\ud800", "\u202e", " of"],
        layers=["0", "1", "2"], metric="logit_diff", raw={"resid": raw, "mlp": raw.flip(1)}, clean=1.0,
        corrupt=torch.tensor([0.0, 0.1]), meta={"model": "tiny <b>", "verified": {"resid": [[1, 0, 0, 0]] + [[0] * 4] * 2}},
        rows_done={"resid": 3, "mlp": 2}, row_order={"mlp": -1}, status="stopped", message="stopped \ud800",
        warnings=["w\u2028"],
    )


def example_circuit():
    """A small circuit result (2 layers × 2 heads, the protocol's own graph and names): random
    scores with a tie of opposite signs, two checked edges (one not run), a faithfulness curve
    whose share is never reached, a hostile answer."""
    from types import SimpleNamespace

    import torch

    from pipatch._model.graph import graph
    from pipatch._results.circuit import CircuitResult

    edge_graph = graph(SimpleNamespace(n_layers=2, n_heads=2, parallel=False))
    senders, receivers, valid = edge_graph.senders, edge_graph.receivers, edge_graph.valid
    scores = torch.randn(valid.shape, generator=torch.Generator().manual_seed(0)) * 0.1
    scores[-1, 0], scores[-1, 1] = 0.5, -0.5  # emb → logits and 0.0 → logits: the same |score|
    scores[~valid] = float("nan")
    corrupt, clean = 0.25, 1.25
    names_s, names_r = [s.name for s in senders], [r.name for r in receivers]
    meta = {
        "model": "tiny <b>", "answer": " <img src=x onerror=alert(1)>\u202e", "foil": " Rome", "method": "eap-ig",
        "n_pairs": 1, "senders": names_s, "receivers": names_r, "site": "edges", "col_axis": "sender",
        "checked": [{"sender": "emb", "receiver": "logits", "estimate": 0.5, "exact": 0.45, "exact_runs": [0.7]},
                    {"sender": "0.0", "receiver": "logits", "estimate": -0.5, "exact": None, "exact_runs": [None]}],
        "agreement": {"spearman": 1.0, "max_abs_error": 0.05, "n": 2},
        "faithfulness": {"sizes": [0, 1, 3, 10, 30], "recovery": [0.0, 0.2, float("nan"), 0.6, 0.7], "share": 0.8,
                         "size": None, "edges": 30},
    }
    return CircuitResult(kind="circuit", tokens=["When", " Mary"], columns=names_s, layers=names_r, metric="logit_diff",
                  raw={"edges": (corrupt + scores).unsqueeze(0)}, clean=clean, corrupt=torch.tensor([corrupt]),
                  meta=meta, rows_done={"edges": len(names_r)})


def example_lens(metric: str):
    """A small logit lens (2 layers × 3 positions, the subject the middle token) of ``metric``:
    ranks from 0 to a large vocabulary's, or probabilities."""
    import torch

    from pipatch._results.result import Result

    ranks = torch.tensor([[[5000.0, 40.0, 3.0], [12.0, 0.0, 1.0]]])
    raw = ranks if metric == "rank" else 1 / (1 + ranks)
    return Result(kind="lens", tokens=["The", " Eiffel", " Tower"], columns=["The", " Eiffel", " Tower"],
                  layers=["0", "1"], metric=metric, raw={"resid": raw}, clean=float(raw[0, -1, -1]),
                  corrupt=torch.tensor([float("nan")]), meta={"model": "tiny", "normalize": False,
                                                               "subject_positions": [1]},
                  rows_done={"resid": 2})


def contract() -> dict[str, Any]:
    from pipatch import compare
    from pipatch._notebook.live import PatchGrid, answer_selection
    from pipatch._results.views import TOP_EDGES, circuit_edges, colors, schema, strings
    from pipatch._results.views.render import color_scale, default_top
    from pipatch._results.views.schema import arrays_to_base64

    result = example_result()
    circuit = example_circuit()
    document = result.to_mime()
    live = schema.conform_state(result.to_state(live=True))
    live["arrays"] = arrays_to_base64(live["arrays"])
    widget = PatchGrid(result)
    answered = answer_selection(lambda view, row, col, seed, k: [("\ud800 x", 0.5), (" Paris", float("nan"))],
                                result, {"view": "resid", "seed": -1, "row": 1, "col": 2})
    failed = answer_selection(None, result, {"view": "resid", "seed": 0, "row": 0, "col": 0})
    widget.selected = {"view": "resid", "seed": -1, "row": 1, "col": 2}  # answered at once (no model)
    widget.update_state({"detail": answered})  # what a model's answer sets
    traits = widget.get_state_dict()
    traits["arrays"] = arrays_to_base64(traits["arrays"])
    ui = {key: getattr(widget, key) for key in schema.UI_SCHEMA}
    samples = [(v / 16, vmax) for vmax in (1.0, 0.37, 2.5) for v in range(-20, 21)] + [(0.3, 0.0), (-0.2, 0.0)]
    scaled = ([(v / 16, colors.SEQUENTIAL, lo, hi) for lo, hi in ((0.0, 1.0), (0.0, 0.37), (-3.5, 0.0), (0.3, 0.3))
               for v in range(-60, 25)]
              + [(float(v), colors.RANK, lo, hi) for lo, hi in ((0.0, 1.0), (0.0, 17.0), (0.0, 262143.0), (5.0, 100.0))
                 for v in (-1, 0, 1, 2, 3, 5, 7, 10, 17, 100, 1000, 262143, 10**6)])
    lenses = [example_lens("rank"), example_lens("prob")]
    scales = [(doc, mode) for doc in [document, *(lens.to_mime() for lens in lenses)] for mode in ("recovery", "raw")]
    faithful = circuit.to_mime()
    faithful["circuit"]["faithfulness"]["size"] = 10
    return {
        "mime_type": schema.MIME_TYPE,
        "schema_version": schema.SCHEMA_VERSION,
        "schemas": {
            "state": schema.STATE_SCHEMA, "detail": schema.DETAIL_SCHEMA, "top": schema.TOP_SCHEMA,
            "ui": schema.UI_SCHEMA, "selection": schema.SELECTION_SCHEMA, "document": schema.DOCUMENT_SCHEMA,
            **schema.OBJECT_SCHEMAS,
        },
        "array_dtype": schema.ARRAY_DTYPE,
        "arrays": {k: list(v) for k, v in schema.ARRAY_SCHEMA.items()},
        "colors": {
            "stops": list(colors.DIVERGING_STOPS), "nan": list(colors.NAN_RGB),
            "samples": [[v, vmax, list(colors.diverging_rgb(v, vmax))] for v, vmax in samples],
            "sequential_stops": list(colors.SEQUENTIAL_STOPS),
            "scaled": [[v, kind, lo, hi, list(colors.scale_rgb(v, kind, lo, hi)), colors.strength(v, kind, lo, hi)]
                       for v, kind, lo, hi in scaled],
        },
        "escape": {
            "unicode": unicodedata.unidata_version,
            "escaped": strings.escaped_ranges(),
            "unassigned": strings.unassigned_ranges(),
            "labels": [[label, strings.escape_label(label)] for label in HOSTILE_LABELS],
            "truncated": [[label, n, strings.escape_label(label, n)] for label in HOSTILE_LABELS for n in (4, 9)],
        },
        "examples": {
            "document": document,
            "live": strings.json_safe(live),
            "widget": strings.json_safe(traits),
            "ui": strings.json_safe(ui),
            "details": strings.json_safe([answered, failed]),
            "comparison": compare(result, example_result(flip=True)).to_mime(),
            "circuit": circuit.to_mime(),
            "circuit_edges": [[e["row"], e["col"], e["score"]] for e in circuit_edges(circuit.to_state())],
            "circuit_top": TOP_EDGES,
            # What the faithful circuit's size makes of the edges drawn at first: [document, edges].
            "circuit_default_top": [[circuit.to_mime(), default_top(circuit.to_state())],
                                    [faithful, default_top(faithful)]],
            # Per document and mode: the scale's kind and range, [document, mode, kind, lo, hi].
            "scales": [[doc, mode, *color_scale(doc, mode=mode)] for doc, mode in scales],
            "lens_subject": lenses[0].to_state()["subject"],
        },
    }


def write(path: str | Path) -> Path:
    path = Path(path)
    # ensure_ascii: a lone surrogate of a label sample travels as \ud800, which JSON.parse reads back.
    path.write_text(json.dumps(contract(), ensure_ascii=True, allow_nan=False), "ascii")
    return path


if __name__ == "__main__":
    sys.stdout.write(json.dumps(contract(), ensure_ascii=True, allow_nan=False))
