"""One state, every view: schema, escaper, colour map, and the same cell at the same place.

The browser half of the schema / escaper / colour-map parity is js/__tests__/parity.test.ts,
run here on a contract written by tests/_contract.py; the live grid and the saved renderer in
a real browser are in tests/e2e/test_views_browser.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

from pipatch._results.result import Result
from pipatch._results.views import (
    ARRAY_DTYPE,
    ARRAY_SCHEMA,
    DIVERGING_STOPS,
    MIME_TYPE,
    STATE_SCHEMA,
    decode_array,
    diverging_rgb,
    escape_label,
    figure,
    mime_bundle,
    mime_document,
    png,
    text_grid,
)
from pipatch._results.views.schema import CIRCUIT_SCHEMA, DOCUMENT_SCHEMA, FEATURE_GRAPH_SCHEMA, UI_SCHEMA
from pipatch._results.views.strings import is_escaped

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def _hot_cold(n_layers: int = 4, n_cols: int = 5, hot=(0, 1), cold=(3, 4), **overrides) -> Result:
    """Recovery 0 everywhere except +1 at ``hot`` and −1 at ``cold`` (two seeds, same values)."""
    raw = torch.zeros(2, n_layers, n_cols)
    raw[:, hot[0], hot[1]] = 1.0
    raw[:, cold[0], cold[1]] = -1.0
    fields = dict(kind="trace", tokens=[f"t{i}" for i in range(n_cols)], columns=[f"t{i}" for i in range(n_cols)],
                  layers=[str(i) for i in range(n_layers)], metric="prob", raw={"resid": raw}, clean=1.0,
                  corrupt=torch.zeros(2), meta={"model": "m"}, rows_done={"resid": n_layers})
    fields.update(overrides)
    return Result(**fields)


# --------------------------------------------------------------------------- schema


def _has_type(kind: str, value) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "str[]":
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "int[]":
        return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    if kind == "float":
        return isinstance(value, float)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "{str: int}":
        return isinstance(value, dict) and all(isinstance(v, int) for v in value.values())
    if kind == "{str: float?}":
        return isinstance(value, dict) and all(v is None or isinstance(v, float) for v in value.values())
    if kind == "{str: str[]}":
        return isinstance(value, dict) and all(_has_type("str[]", v) for v in value.values())
    if kind == "arrays":
        return isinstance(value, dict)
    if kind == "detail":
        return isinstance(value, dict)
    if kind == "circuit":
        return isinstance(value, dict) and all(key in CIRCUIT_SCHEMA for key in value)
    if kind == "feature_graph":
        return isinstance(value, dict) and all(key in FEATURE_GRAPH_SCHEMA for key in value)
    raise AssertionError(kind)


def _check_state(state: dict, *, live: bool) -> None:
    assert list(state) == [k for k in STATE_SCHEMA if k != "detail"]  # all of them, in order
    for key, value in state.items():
        assert _has_type(STATE_SCHEMA[key], value), (key, value)
    dims = {"rows": len(state["row_labels"]), "cols": len(state["col_labels"]), "seeds": state["n_seeds"]}
    names = set()
    for name, spec in state["arrays"].items():
        view, what = name.rsplit("/", 1)
        assert view in state["views"] and what in ARRAY_SCHEMA, name
        assert spec["dtype"] == ARRAY_DTYPE and isinstance(spec["data"], bytes)
        assert spec["shape"] == [dims[d] for d in ARRAY_SCHEMA[what]], name
        assert len(spec["data"]) == 4 * int(np.prod(spec["shape"]))
        names.add(what)
    if state["sides"]:  # a comparison: a − b and both sides, live or not
        assert names == {"mean", "a", "b"} and state["compared"] in ("recovery", "raw")
    else:  # live updates carry the means and the (small) verified mask only
        assert names == ({"mean", "raw_mean", "verified"} if live else set(ARRAY_SCHEMA) - {"a", "b"})


def test_a_results_state_follows_the_schema():
    import pipatch

    r = _hot_cold(meta={"model": "m", "verified": {"resid": [[1, 0, 0, 0, 0]] + [[0] * 5] * 3}})
    _check_state(r.to_state(), live=False)
    _check_state(r.to_state(live=True), live=True)
    assert r.to_state()["sides"] == [] and r.to_state()["compared"] == ""
    c = pipatch.compare(r, _hot_cold(hot=(2, 2)))
    _check_state(c.to_state(), live=False)
    _check_state(c.to_state(live=True), live=True)


def test_widget_traits_are_the_schema_and_the_document_is_the_state():
    from pipatch._notebook.widget import GridWidget

    w = GridWidget(_hot_cold())
    synced = {name for name in w.trait_names(sync=True) if not name.startswith("_")}
    synced -= {"layout", "tabbable", "tooltip", "comm", "keys", "log"}  # ipywidgets' own
    assert synced == set(STATE_SCHEMA) | set(UI_SCHEMA)
    doc = w.to_mime()
    assert set(doc) == (set(STATE_SCHEMA) - {"detail"}) | set(DOCUMENT_SCHEMA)
    # The widget's document is the result's, plus the widget's own id (its copy's pairing).
    assert doc["live_id"] == w.model_id != "" and _hot_cold().to_state()["live_id"] == ""
    assert mime_document(_hot_cold().to_state()) == {k: v for k, v in doc.items() if k != "ui"} | {"live_id": ""}


def test_one_mime_constant_and_one_version_per_language():
    py = "\n".join(p.read_text("utf-8") for p in (REPO / "pipatch").rglob("*.py"))
    ts = "\n".join(p.read_text("utf-8") for p in (REPO / "js").glob("*.ts"))
    assert py.count(f'"{MIME_TYPE}"') == 1 and ts.count(f"'{MIME_TYPE}'") == 1
    assert "MIME_VERSION" not in py and "SUPPORTED_VERSION" not in ts
    assert len(re.findall(r"^SCHEMA_VERSION = ", py, re.M)) == 1
    for gone in ("_INVISIBLE_RANGES", "isprintable", "RdBu_r", "LinearSegmentedColormap", "def escape_label",
                 "def json_safe", "savefig"):
        assert py.count(gone) <= 1, gone  # defined once (in pipatch/_views), used nowhere else


def test_the_browser_reads_what_python_sends(tmp_path):
    """Schema (keys, types, dtypes, shapes), MIME type, version, colour map and the escaping
    rule on every code point: js/__tests__/parity.test.ts on the contract Python writes now."""
    vitest = REPO / "node_modules" / ".bin" / "vitest"
    if not vitest.exists() or shutil.which("node") is None:
        pytest.skip("node_modules missing: run `npm ci` (the parity test also runs in `npm test`)")
    from tests._contract import write

    contract = write(tmp_path / "contract.json")
    out = subprocess.run([str(vitest), "run", "js/__tests__/parity.test.ts"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PIPATCH_CONTRACT": str(contract), "CI": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]


# --------------------------------------------------------------------------- escaper


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\u0600", "⟨U+0600⟩"),  # Arabic number sign (Cf): missed by the old table
        ("\u180e", "⟨U+180E⟩"),  # Mongolian vowel separator (Cf)
        ("\U0001d173x", "⟨U+1D173⟩x"),  # musical symbol begin beam (Cf)
        ("\U00013430", "⟨U+13430⟩"),  # Egyptian hieroglyph vertical joiner (Cf)
        ("\ufff9a\ufffa", "⟨U+FFF9⟩a⟨U+FFFA⟩"),  # interlinear annotation
        ("\u2029", "⟨U+2029⟩"),  # paragraph separator (Zp)
        ("\ue000", "⟨U+E000⟩"),  # private use (Co)
        ("\ufffe", "⟨U+FFFE⟩"),  # noncharacter (Cn)
        ("\u3164", "⟨U+3164⟩"),  # Hangul filler (Default_Ignorable, Lo)
        ("\ud83d\ude00", "😀"),  # a pair given as two code points is one character
        ("\ud800", "⟨U+D800⟩"),
        ("e\u0301 é ß 中 😀", "e\u0301 é ß 中 😀"),  # combining marks and the rest as written
        ("\u00a0", "\u00a0"),  # spaces other than U+0020 are visible space
    ],
)
def test_escape_rule(raw, shown):
    assert escape_label(raw) == shown


def test_the_escape_rule_is_the_categories_plus_default_ignorables():
    cats = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
    extra = [cp for cp in range(0x110000) if is_escaped(cp) and unicodedata.category(chr(cp)) not in cats]
    assert len(extra) == 1 + 2 + 2 + 3 + 1 + 1 + 16 + 1 + 240  # the variation selectors and six fillers/joiners
    assert all(unicodedata.category(chr(cp)) in {"Mn", "Lo"} for cp in extra)


# --------------------------------------------------------------------------- colour map


def test_the_colour_map_is_rdbu_r_centred_at_zero():
    import matplotlib

    ref = matplotlib.colormaps["RdBu_r"]
    for i, stop in enumerate(DIVERGING_STOPS):
        want = tuple(round(255 * c) for c in ref(i / (len(DIVERGING_STOPS) - 1))[:3])
        assert diverging_rgb(-1 + 2 * i / (len(DIVERGING_STOPS) - 1), 1.0) == tuple(int(stop[k:k + 2], 16) for k in (1, 3, 5))
        assert max(abs(a - b) for a, b in zip(want, diverging_rgb(-1 + 2 * i / 10, 1.0))) <= 2
    assert diverging_rgb(0.0, 3.0) == (247, 247, 247)
    assert diverging_rgb(5.0, 1.0) == diverging_rgb(1.0, 1.0) == (103, 0, 31)
    assert diverging_rgb(float("nan"), 1.0) == (128, 128, 128)


# --------------------------------------------------------------------------- same cell, same place


def _cell_pixels(fig, image: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """The RGB at the centre of every cell of the heatmap axes of ``fig``, read from ``image``
    (a rendering of ``fig``, row 0 of ``image`` at the top)."""
    ax = fig.axes[0]
    box = ax.get_window_extent()
    height = image.shape[0]
    out = np.zeros((n_rows, n_cols, 3), dtype=int)
    for r in range(n_rows):
        for c in range(n_cols):
            x = box.x0 + (c + 0.5) / n_cols * box.width
            y = height - (box.y1 - (r + 0.5) / n_rows * box.height)  # the top row is row 0
            out[r, c] = np.round(image[int(y), int(x), :3] * (255 if image.dtype.kind == "f" else 1))
    return out


@pytest.mark.parametrize(("hot", "cold"), [((0, 0), (3, 4)), ((0, 1), (3, 4)), ((2, 4), (0, 0))])
def test_every_view_shows_the_same_cell_at_the_same_place(hot, cold):
    """State, MIME document, text grid, figure, PNG (Result.plot, CLI --png, the bundle) all
    put row 0 = layer 0 at the top and colour a cell by the one map."""
    import matplotlib.image

    r = _hot_cold(hot=hot, cold=cold)
    state = r.to_state()
    mean = decode_array(state["arrays"]["resid/mean"])
    assert mean[hot] == 1.0 and mean[cold] == -1.0 and np.count_nonzero(mean) == 2
    doc = mime_document(state)
    assert np.array_equal(decode_array(doc["arrays"]["resid/mean"]), mean)
    # Text: the first grid line is layer 0; the full block sits in the hot cell's column.
    lines = r.text().splitlines()
    grid_lines = lines[2 : 2 + 4]
    assert [line[:5].strip() for line in grid_lines] == ["L0", "L1", "L2", "L3"]
    width = (len(grid_lines[0]) - 5) // 5
    cells = [[line[5 + c * width : 5 + (c + 1) * width].strip() for c in range(5)] for line in grid_lines]
    assert [(i, j) for i in range(4) for j in range(5) if cells[i][j] == "█"] == [hot]
    assert lines[6].startswith(f"layer   {hot[0]}  token 't{hot[1]}'  recovery 1.000")
    # Figure and PNG: the colour at the centre of every cell is diverging_rgb of its value.
    want = np.array([[diverging_rgb(float(v), 1.0) for v in row] for row in mean])
    fig = figure(state, dpi=80)
    fig.canvas.draw()
    drawn = _cell_pixels(fig, np.asarray(fig.canvas.buffer_rgba()), 4, 5)
    assert np.abs(drawn - want).max() <= 3, (drawn, want)
    for data in (png(state, dpi=80), png(r.to_state(live=True), dpi=80)):
        assert np.array_equal(_cell_pixels(fig, matplotlib.image.imread(io.BytesIO(data)), 4, 5), drawn)
    bundle = r._repr_mimebundle_()
    import base64

    assert base64.b64decode(bundle["image/png"]) == png(state)
    assert set(bundle) == {MIME_TYPE, "image/png", "text/plain"}
    # Result.plot draws the same picture.
    plotted = r.plot()
    plotted.set_dpi(80)
    plotted.canvas.draw()
    assert np.abs(_cell_pixels(plotted, np.asarray(plotted.canvas.buffer_rgba()), 4, 5) - want).max() <= 3
    import matplotlib.pyplot as plt

    plt.close(plotted)


def test_pending_rows_are_hatched_and_a_running_grid_without_rows_is_all_pending():
    r = _hot_cold(rows_done={"resid": 2}, status="stopped")
    state = r.to_state()
    fig = figure(state, dpi=80)
    fig.canvas.draw()
    drawn = _cell_pixels(fig, np.asarray(fig.canvas.buffer_rgba()), 4, 5)
    assert tuple(drawn[0, 1]) == diverging_rgb(1.0, 1.0)
    assert all(tuple(drawn[r_, c]) != diverging_rgb(0.0, 1.0) for r_ in (2, 3) for c in range(5))  # hatched
    assert "·" in text_grid(state).splitlines()[4] and "█" in text_grid(state).splitlines()[2]
    running = {**state, "status": "running", "rows_done": {}}
    assert text_grid(running).splitlines()[2].count("·") == 5


def test_rows_that_run_from_the_last_layer_up_are_a_finished_band_at_the_bottom(tmp_path):
    # A partial result whose rows ran from layer 3 down: rows 2 and 3 are finished, 0 and 1 pending.
    r = _hot_cold(rows_done={"resid": 2}, row_order={"resid": -1}, status="stopped")
    assert list(r.finished_rows()) == [2, 3]
    state = r.to_state()
    fig = figure(state, dpi=80)
    fig.canvas.draw()
    drawn = _cell_pixels(fig, np.asarray(fig.canvas.buffer_rgba()), 4, 5)
    assert tuple(drawn[3, 4]) == diverging_rgb(-1.0, 1.0) and tuple(drawn[2, 0]) == diverging_rgb(0.0, 1.0)
    assert all(tuple(drawn[r_, c]) != diverging_rgb(0.0, 1.0) for r_ in (0, 1) for c in range(5))  # hatched
    assert tuple(drawn[0, 1]) != diverging_rgb(1.0, 1.0)  # the +1 at row 0 is not drawn: pending
    lines = text_grid(state).splitlines()
    assert lines[2].count("·") == 5 and lines[3].count("·") == 5 and "·" not in lines[4] + lines[5]
    assert "layer   0" not in text_grid(state)  # the top cells are finished cells only
    # Saved (safetensors, JSON) and read back, the order holds.
    from pipatch._results.result import load_result

    (tmp_path / "r.json").write_text(json.dumps(r.to_json()))
    for again in (load_result(r.save(tmp_path / "r.safetensors")), load_result(tmp_path / "r.json")):
        assert again.row_order == {"resid": -1} and list(again.finished_rows()) == [2, 3]


def test_the_time_left_counts_the_layers_a_row_computes_when_rows_run_from_the_last_layer():
    # 4 layers, one row finished in 2 s. From the last layer down, row r computes 4 − r layers:
    # done 1 (row 3) of 4 + 3 + 2 + 1 = 10, so 9 more units of 2 s each; from layer 0, 3 more rows.
    assert _hot_cold(rows_done={"resid": 1}, row_order={"resid": -1}, status="running").time_left(2.0) == 18.0
    assert _hot_cold(rows_done={"resid": 1}, status="running").time_left(2.0) == 6.0
    assert _hot_cold(rows_done={"resid": 0}, status="running").time_left(2.0) == -1.0
    assert _hot_cold().time_left(2.0) == 0.0


def test_the_bundle_draws_the_view_seed_and_mode_shown():
    r = _hot_cold()
    r.raw["mlp"] = -r.raw["resid"]
    state = r.to_state()
    for ui in ({"view": "mlp"}, {"view": "resid", "seed": 1}, {"view": "resid", "mode": "raw"}):
        bundle = mime_bundle(state, ui)
        assert bundle[MIME_TYPE]["ui"] == ui
        import base64

        assert base64.b64decode(bundle["image/png"]) == png(state, ui["view"], mode=ui.get("mode", "recovery"),
                                                           seed=ui.get("seed", -1))
    assert png(state, "mlp") != png(state, "resid")


def test_text_grid_columns_fit_one_escape():
    r = _hot_cold(columns=["\n", "a", "b", "c", " "])
    header = r.text().splitlines()[1]
    assert "⟨U+000A⟩" in header and "␣" in header
    json.dumps(r.to_json())


# --------------------------------------------------------------------------- a circuit's graph


def _circuit():
    from tests._contract import example_circuit

    return example_circuit()


def test_a_circuits_state_carries_its_graph_and_any_other_result_none():
    from pipatch._results.views import conform_state

    r = _circuit()
    state = r.to_state()
    assert list(state) == [k for k in STATE_SCHEMA if k != "detail"]
    assert all(_has_type(STATE_SCHEMA[key], value) for key, value in state.items())
    assert set(state["arrays"]) == {f"edges/{what}" for what in ("mean", "raw_mean", "std", "seeds", "raw_seeds")}
    part = state["circuit"]
    assert set(part) == set(CIRCUIT_SCHEMA)
    assert conform_state({"circuit": part})["circuit"] == part  # already in its declared types
    nodes = part["nodes"]
    assert [n["name"] for n in nodes] == ["emb", "0.0", "0.1", "mlp0", "1.0", "1.1", "mlp1", "logits"]
    assert [n["kind"] for n in nodes] == ["emb", "head", "head", "mlp", "head", "head", "mlp", "logits"]
    assert [n["layer"] for n in nodes] == [-1, 0, 0, 0, 1, 1, 1, 2]
    # The embeddings at the bottom, a row per layer (its MLP a little higher), the logits on top.
    y = {n["name"]: n["y"] for n in nodes}
    assert y["emb"] < y["0.0"] == y["0.1"] < y["mlp0"] < y["1.0"] < y["mlp1"] < y["logits"]
    assert all(0 < n["x"] < 1 for n in nodes)
    # Each column's node and each row's: a head's q, k, v read into its head's node, left to right.
    names = [n["name"] for n in nodes]
    assert [names[i] for i in part["senders"]] == r.columns
    assert [names[i] for i in part["receivers"]] == [x.rsplit(".", 1)[0] if x.count(".") == 2 else x for x in r.layers]
    q = r.layers.index("1.0.q")
    assert part["ports"][q] < part["ports"][q + 1] == 0.0 < part["ports"][q + 2]
    assert part["ports"][r.layers.index("logits")] == 0.0
    assert part["checked"] == [
        {"row": len(r.layers) - 1, "col": 0, "estimate": 0.5, "exact": 0.45},
        {"row": len(r.layers) - 1, "col": 1, "estimate": -0.5, "exact": None},
    ]
    assert part["agreement"] == {"spearman": 1.0, "max_abs_error": 0.05, "n": 2.0}
    assert part["faithfulness"] == {"sizes": [0, 1, 3, 10, 30], "recovery": [0.0, 0.2, None, 0.6, 0.7], "share": 0.8,
                                    "size": None, "edges": 30}
    # Live updates carry it too; a grid's state has an empty one; a circuit without a curve none.
    assert r.to_state(live=True)["circuit"] == part
    assert _hot_cold().to_state()["circuit"] == {}
    del r.meta["faithfulness"]
    assert "faithfulness" not in r.to_state()["circuit"]
    # The document the notebook saves holds it, strict JSON.
    doc = mime_document(state)
    assert doc["circuit"]["nodes"] == nodes
    json.dumps(doc, allow_nan=False)


def test_a_circuits_graph_exports_as_json_ranked_as_its_edge_table():
    from pipatch._model.models import PipatchError

    r = _circuit()
    graph = r.graph()
    json.dumps(graph, allow_nan=False)
    table = r.edges()
    assert [(e["sender"], e["receiver"]) for e in graph["edges"]] == list(zip(table["sender"], table["receiver"]))
    assert np.allclose([e["score"] for e in graph["edges"]], table["score"], atol=1e-6)
    assert graph["edges"][0] == {"sender": "emb", "receiver": "logits", "score": 0.5, "recovery": 0.5, "exact": 0.45}
    assert graph["edges"][1]["exact"] is None
    assert [e["sender"] for e in r.graph(top=3)["edges"]] == [e["sender"] for e in graph["edges"][:3]]
    assert {n["name"] for n in graph["nodes"]} >= {"emb", "logits"}
    assert graph["faithfulness"]["share"] == 0.8 and graph["metric"] == "logit_diff"
    assert graph["title"] == r.title
    with pytest.raises(PipatchError, match="circuit"):
        _hot_cold().graph()


def _edge_patches(fig):
    from matplotlib.patches import PathPatch

    return [p for ax in fig.axes for p in ax.patches if isinstance(p, PathPatch)]


def test_a_circuit_is_drawn_as_its_graph_in_the_figure_the_png_and_the_bundle(tmp_path):
    import base64

    import matplotlib.image
    from matplotlib.colors import to_rgb
    from matplotlib.image import AxesImage

    r = _circuit()
    state = r.to_state()
    fig = figure(state, dpi=80)
    graph_ax, curve_ax = fig.axes[0], fig.axes[1]
    assert not [a for ax in fig.axes for a in ax.get_children() if isinstance(a, AxesImage)]  # no heatmap
    edges = _edge_patches(fig)
    total = len(r.edges())
    assert len(edges) == min(50, total) == total  # every edge of this small graph
    # The largest edge is drawn last, in its colour on the one map (±max |score|).
    assert np.allclose(to_rgb(edges[-1].get_edgecolor()), np.array(diverging_rgb(0.5, 0.5)) / 255, atol=2 / 255)
    assert len(_edge_patches(figure(state, dpi=80, top=4))) == 4
    assert [t.get_text() for t in graph_ax.get_yticklabels()] == ["embeddings", "layer 0", "layer 1", "logits"]
    # The faithfulness curve beside it: its points, the share line.
    line = curve_ax.get_lines()[0]
    assert list(line.get_xdata()) == [0, 1, 3, 10, 30]
    assert any(np.allclose(ln.get_ydata(), [0.8, 0.8]) for ln in curve_ax.get_lines()[1:])
    # The PNG is that figure, and the bundle's PNG is that PNG.
    data = png(state)
    assert matplotlib.image.imread(io.BytesIO(data)).shape[1] > 600
    bundle = r._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"]) == data
    assert bundle[MIME_TYPE]["circuit"]["checked"] == state["circuit"]["checked"]
    assert "receivers × " in bundle["text/plain"]
    # Result.plot draws the graph (top n edges) and saves as SVG or PNG: the export.
    import matplotlib.pyplot as plt

    plotted = r.plot(top=5)
    assert len(_edge_patches(plotted)) == 5
    plotted.savefig(tmp_path / "circuit.svg")
    plotted.savefig(tmp_path / "circuit.png")
    plt.close(plotted)
    assert (tmp_path / "circuit.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "circuit.png").read_bytes()[:4] == b"\x89PNG"
    # Drawn into a given axes: the graph alone.
    fig2 = plt.figure()
    ax = fig2.add_subplot()
    r.plot(ax=ax, top=3)
    assert len(_edge_patches(fig2)) == 3 and len([a for a in fig2.axes if a.get_lines()]) == 0
    plt.close(fig2)
    # Read back from its file, it is the same graph.
    from pipatch._results.result import load_result

    again = load_result(r.save(tmp_path / "c.safetensors"))
    assert again.to_state()["circuit"] == state["circuit"] and again.graph() == r.graph()
