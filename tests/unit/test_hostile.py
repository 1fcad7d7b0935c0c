"""Hostile strings through the Python side: strict JSON out, no crash on lone surrogates.

Front-end behaviour (nothing executes, text shown as written) is in
tests/e2e/test_hardening_browser.py; this file checks what the kernel sends and saves.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipatch._notebook.widget import GridWidget
from pipatch._results.result import Result
from pipatch._results.views import MIME_TYPE, clean_text, escape_label, mime_bundle, mime_document

torch.set_num_threads(1)

HOSTILE = [
    "<img src=x onerror=window.__pwned=1>",
    '"><svg onload=window.__pwned=1>',
    "</script><script>window.__pwned=1</script>",
    "javascript:alert(1)",
    "'quotes' \"double\" `backticks` ${x}",
    "lone\ud800surrogate",
    "\udc00",
    "nul\x00and\x07control\x1b[31m",
    "\u202eevil",
    "zero\u200dwidth\u200bjoin",
    "x" * 10_000,
    "$\\frac{a}{b}$",  # mathtext in the PNG
]


def _strict_loads(text: str):
    def no_constant(c: str):
        raise ValueError(f"non-strict JSON constant {c}")

    return json.loads(text, parse_constant=no_constant)


def _utf8_roundtrip(obj) -> object:
    """What jupyter_client / nbformat do: ensure_ascii=False, UTF-8 encode, strict."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return _strict_loads(text.encode("utf-8").decode("utf-8"))


def _result(tokens: list[str], *, nan_clean: bool = False) -> Result:
    n_layers, n_cols = 3, len(tokens)
    raw = torch.linspace(0, 1, 2 * n_layers * n_cols).reshape(2, n_layers, n_cols)
    raw[:, 0, 0] = float("nan")
    return Result(
        kind="trace",
        tokens=list(tokens),
        columns=list(tokens),
        layers=[f"L{i}" for i in range(n_layers)],
        metric="prob",
        raw={"resid": raw},
        clean=float("nan") if nan_clean else 0.9,
        corrupt=torch.tensor([0.1, 0.2]),
        meta={"model": "fake <b>model</b>", "subject": HOSTILE[0], "answer": HOSTILE[2]},
        rows_done={"resid": n_layers},
        warnings=list(HOSTILE[:4]),
        message=HOSTILE[1],
    )


SAFE = [h for h in HOSTILE if not any(0xD800 <= ord(c) <= 0xDFFF for c in h)]


@pytest.mark.parametrize("nan_clean", [False, True])
def test_result_to_mime_and_json_are_strict_json(nan_clean: bool) -> None:
    r = _result(SAFE, nan_clean=nan_clean)
    doc = r.to_mime()
    back = _utf8_roundtrip(doc)
    assert back["col_labels"] == SAFE  # every string as written, nothing escaped or dropped
    assert back["warnings"] == SAFE[:4]
    summary = _utf8_roundtrip(r.to_json())
    assert summary["tokens"] == SAFE
    assert summary["grid"][0][0] is None  # NaN → null
    # The bundle IPython publishes: strict JSON too (PNG drawn despite $…$ and NUL).
    bundle = r._repr_mimebundle_()
    _utf8_roundtrip(bundle)
    assert set(bundle) >= {MIME_TYPE, "image/png", "text/plain"}


def test_plot_draws_hostile_labels_and_titles_as_short_plain_text() -> None:
    """Matplotlib would read ``$…$`` as mathtext (an unbalanced ``$`` is an error) and drop
    control characters; 10,000-character labels would swamp the figure."""
    import warnings

    r = _result(SAFE)
    r.meta.update(subject="costs $5 and $", answer="x" * 500)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mathtext error, no layout warning
        fig = r.plot()
        fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert all(len(label.replace("\\$", "$")) <= 16 for label in labels)
    assert labels[SAFE.index("x" * 10_000)] == "x" * 15 + "…"
    # The one escaper (the same as the browser's): control characters as ⟨U+XXXX⟩.
    assert labels[SAFE.index("nul\x00and\x07control\x1b[31m")] == escape_label("nul\x00and\x07control\x1b[31m", 16)
    assert labels[SAFE.index("nul\x00and\x07control\x1b[31m")].startswith("nul⟨U+0000⟩and")
    title = ax.get_title().split("\n")[0]
    assert len(title.replace("\\$", "$")) <= 110 and title.endswith("…") and "\\$5 and \\$" in title


def test_result_lone_surrogates_survive_utf8() -> None:
    r = _result(HOSTILE)
    _utf8_roundtrip(r.to_mime())
    _utf8_roundtrip(r.to_json())


def test_result_lone_surrogates_become_replacement_characters() -> None:
    r = _result(HOSTILE)
    back = _strict_loads(json.dumps(r.to_mime(), allow_nan=False))
    assert back["col_labels"][5] == "lone\ufffdsurrogate"


def test_clean_text_replaces_lone_surrogates_only() -> None:
    assert clean_text("a\ud800b") == "a\ufffdb"
    assert clean_text("\udc00") == "\ufffd"
    assert clean_text("\ud83d\ude00") == "😀"  # a pair given as two code points is joined
    assert clean_text("😀 <b>x</b> \u202e\x00") == "😀 <b>x</b> \u202e\x00"  # the rest unchanged
    assert clean_text(3) == "3"


def _state(labels: list[str]) -> dict:
    n_layers, n_cols = 2, len(labels)
    mean = np.arange(n_layers * n_cols, dtype=np.float32).reshape(n_layers, n_cols)
    mean[0, 0] = np.nan
    return {
        "title": HOSTILE[2] + "\ud800",
        "kind": "trace",
        "model_name": "m\udfff",
        "metric": HOSTILE[3],
        "row_labels": ["r\ud800", HOSTILE[0]],
        "col_labels": labels,
        "views": ["resid"],
        "n_seeds": 1,
        "arrays": {"resid/mean": mean, "resid/raw_mean": mean},
        "rows_done": {"resid": n_layers},
        "total_rows": n_layers,
        "status": "done",
        "message": HOSTILE[1] + "\udc80",
        "warnings": HOSTILE,
        "baselines": {"clean": float("nan"), "corrupt": float("inf")},
        "detail": {"row": 0, "col": 0, "top": [{"token": "\ud800", "prob": 0.5}]},
    }


def test_widget_state_and_bundle_are_utf8_safe_strict_json() -> None:
    state = _state(HOSTILE)
    doc = mime_document(state, {"view": "resid\ud800", "seed": -1, "mode": "recovery"})
    back = _utf8_roundtrip(doc)
    # Lone surrogates → U+FFFD; every other character (markup, NUL, U+202E) kept as written.
    assert back["col_labels"][5] == "lone\ufffdsurrogate"
    assert back["col_labels"][6] == "\ufffd"
    assert back["col_labels"][0] == HOSTILE[0]
    assert back["col_labels"][7] == HOSTILE[7]
    assert back["col_labels"][10] == "x" * 10_000
    assert back["title"].endswith("\ufffd") and back["model_name"] == "m\ufffd"
    assert back["baselines"] == {"clean": None, "corrupt": None}
    bundle = mime_bundle(state)
    _utf8_roundtrip(bundle)
    assert "\ud800" not in bundle["text/plain"]
    # The widget's traits (what the comm sends) are UTF-8 safe too, detail included.
    from jupyter_client.session import json_packer

    w = GridWidget.from_state(state)
    sent = {k: getattr(w, k) for k in ("title", "model_name", "message", "row_labels", "col_labels", "warnings", "detail")}
    json_packer(sent)  # raised UnicodeEncodeError before clean_text
    assert w.detail["top"][0]["token"] == "\ufffd"
    assert w.col_labels[3] == "javascript:alert(1)"
    # The widget's own MIME document (what it saves and re-renders) is strict UTF-8 JSON too,
    # with the labels exactly as the state's document has them: none dropped, none escaped.
    mine = _utf8_roundtrip(w.to_mime())
    assert mine["col_labels"] == back["col_labels"] and len(mine["col_labels"]) == len(HOSTILE)
    assert mine["row_labels"] == back["row_labels"] == ["r\ufffd", HOSTILE[0]]
    assert mine["title"] == back["title"] and mine["warnings"] == back["warnings"]


@pytest.mark.parametrize("nan_clean", [False, True])
def test_save_of_a_hostile_result_round_trips(tmp_path, nan_clean: bool) -> None:
    """``save`` goes through the one sanitiser: a lone surrogate anywhere (labels, message,
    warnings, meta, a meta key) used to raise UnicodeEncodeError inside safetensors."""
    from pipatch import load_result
    from pipatch._results.views import json_safe

    r = _result(HOSTILE, nan_clean=nan_clean)
    r.meta["notes"] = {"key\ud800": ["value\udfff", float("nan"), 1.5]}
    path = r.save(tmp_path / "hostile.safetensors")
    back = load_result(path)
    assert back.columns == back.tokens == [clean_text(h) for h in HOSTILE]
    assert back.columns[5] == "lone\ufffdsurrogate" and back.columns[7] == HOSTILE[7]  # NUL etc. as written
    assert back.message == clean_text(HOSTILE[1]) and back.warnings == HOSTILE[:4]
    assert back.meta == json_safe(r.meta) and back.meta["notes"] == {"key\ufffd": ["value\ufffd", None, 1.5]}
    assert torch.equal(torch.isnan(back.raw["resid"]), torch.isnan(r.raw["resid"]))
    assert torch.allclose(back.raw["resid"].nan_to_num(), r.raw["resid"].nan_to_num())
    assert isinstance(back.clean, float) and (np.isnan(back.clean) if nan_clean else back.clean == 0.9)
    # Every view of the loaded result is the original's.
    assert back.to_mime() == r.to_mime() and back.text() == r.text()
    # The header is strict UTF-8 JSON (no NaN literal, no surrogate).
    import struct

    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size].decode("utf-8"))["__metadata__"]["pipatch"]
    _strict_loads(header)
    assert load_result(back.save(tmp_path / "again.safetensors")).to_mime() == r.to_mime()
