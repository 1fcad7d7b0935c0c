"""The grid widget (the view): serialization, throttling and saved-bundle tests (no browser, no model).

The states here are hand-made numpy arrays: they test the widget plumbing only.
"""

from __future__ import annotations

import ast
import base64
import json
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ipywidgets.widgets.widget import _remove_buffers

import pipatch._notebook.widget
from pipatch._notebook.widget import GridWidget
from pipatch._results.views import MIME_TYPE, STATE_KEYS, escape_label, mime_bundle, mime_document


def fake_state(
    n_layers: int = 4, n_tokens: int = 5, n_seeds: int = 3, done: int | None = None
) -> dict:
    rng = np.random.default_rng(0)
    seeds = rng.normal(size=(n_seeds, n_layers, n_tokens)).astype(np.float32)
    raw = rng.random(size=(n_seeds, n_layers, n_tokens)).astype(np.float32)
    mean = seeds.mean(0)
    mean[0, 0] = np.nan
    arrays = {}
    for view in ("resid", "mlp"):
        arrays[f"{view}/mean"] = mean
        arrays[f"{view}/std"] = seeds.std(0)
        arrays[f"{view}/raw_mean"] = raw.mean(0)
        arrays[f"{view}/seeds"] = seeds
        arrays[f"{view}/raw_seeds"] = raw
    return {
        "title": "<img src=x onerror=alert(1)>",
        "kind": "trace",
        "model_name": "fake",
        "metric": "p(answer)",
        "row_labels": [str(i) for i in range(n_layers)],
        "col_labels": ["<img src=x onerror=alert(1)>", "\u202eevil", "a\x00b", "x" * 10_000, "$x$"][
            :n_tokens
        ]
        + [f"t{i}" for i in range(max(0, n_tokens - 5))],
        "col_axis": "token",
        "views": ["resid", "mlp"],
        "n_seeds": n_seeds,
        "arrays": arrays,
        "rows_done": {"resid": n_layers if done is None else done, "mlp": 0},
        "total_rows": 2 * n_layers,
        "status": "running",
        "message": "",
        "warnings": [],
        "elapsed": 1.5,
        "eta": 3.0,
        "baselines": {"clean": 0.9, "corrupt": 0.1},
        "detail": {},
        "stoppable": True,
    }


class Recorder:
    """Records what the widget sends (from any thread: the coalescing timer sends from its own)."""

    def __init__(self, widget: GridWidget) -> None:
        self.messages: list[tuple[dict, list]] = []
        self.times: list[float] = []  # time.monotonic() of each message, as it is sent
        self.changed = threading.Condition()
        widget._send = self._send  # type: ignore[method-assign]

    def _send(self, msg: dict, buffers=None) -> None:
        with self.changed:
            self.messages.append((msg, list(buffers or [])))
            self.times.append(time.monotonic())
            self.changed.notify_all()

    def updates(self) -> list[tuple[float, dict]]:
        """The ``update`` messages so far, each with the time it was sent."""
        with self.changed:
            return [(at, m) for at, (m, _) in zip(self.times, self.messages) if m["method"] == "update"]

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        """Wait until ``predicate()`` holds (checked at each message); False after ``timeout`` s."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)


def test_from_state_sets_traits_and_arrays_are_binary():
    w = GridWidget.from_state(fake_state())
    assert w.title == "<img src=x onerror=alert(1)>"
    assert w.view == "resid"
    spec = w.arrays["resid/mean"]
    assert (
        isinstance(spec["data"], bytes) and spec["dtype"] == "float32" and spec["shape"] == [4, 5]
    )
    back = np.frombuffer(spec["data"], dtype="<f4").reshape(4, 5)
    assert np.isnan(back[0, 0])
    np.testing.assert_array_equal(back[1:], fake_state()["arrays"]["resid/mean"][1:])
    state, buffer_paths, buffers = _remove_buffers(w.get_state())
    assert ["arrays", "resid/mean", "data"] in buffer_paths
    assert len(buffers) == 10
    json.dumps(state)  # everything else is JSON


def test_update_state_is_one_message():
    w = GridWidget.from_state(fake_state(done=1))
    rec = Recorder(w)
    w.update_state(
        {"rows_done": {"resid": 2, "mlp": 0}, "elapsed": 2.0, "eta": 1.0, "status": "running"}
    )
    assert len(rec.messages) == 1
    msg = rec.messages[0][0]
    assert msg["method"] == "update"
    assert set(msg["state"]) == {"rows_done", "elapsed", "eta"}


def test_push_coalesces_and_flush_ends_equal():
    # An interval no test run outlasts: the first push is sent, the 199 after it are held.
    w = GridWidget.from_state(fake_state(done=0), min_interval=30.0)
    rec = Recorder(w)
    for i in range(200):
        w.push({"rows_done": {"resid": i, "mlp": 0}, "elapsed": float(i)})
    assert len(rec.updates()) == 1
    assert w.rows_done == {"resid": 0, "mlp": 0} and w.elapsed == 0.0  # the browser's state too
    w.flush({"status": "done", "rows_done": {"resid": 4, "mlp": 4}})
    updates = [m for _, m in rec.updates()]
    # The held pushes (the latest of each key) and flush's state in one message, then a full sync.
    assert len(updates) == 3
    assert updates[1]["state"]["elapsed"] == 199.0 and updates[1]["state"]["rows_done"] == {"resid": 4, "mlp": 4}
    assert w.rows_done == {"resid": 4, "mlp": 4} and w.status == "done" and w.elapsed == 199.0
    assert set(STATE_KEYS) <= set(updates[-1]["state"])  # full sync


def test_push_sends_at_most_one_message_per_interval():
    # A lower bound on the gaps: a slow machine only makes them longer.
    interval = 0.05
    w = GridWidget.from_state(fake_state(done=0), min_interval=interval)
    rec = Recorder(w)
    deadline = time.monotonic() + 30
    i = 0
    while len(rec.updates()) < 5 and time.monotonic() < deadline:
        i += 1
        w.push({"elapsed": float(i)})
        time.sleep(0.001)  # yield to the timer thread; the loop's pace does not matter
    w.flush()
    sent = [at for at, _ in rec.updates()][:-1]  # flush's full sync goes at once, by design
    assert len(sent) >= 5, "the pushes sent fewer than 5 messages in 30 s"
    gaps = np.diff(sent)
    assert gaps.min() >= 0.9 * interval, gaps  # 0.9: clock reads around the timer's wait
    assert w.elapsed == float(i)


def test_push_timer_delivers_held_state():
    interval = 0.2
    w = GridWidget.from_state(fake_state(done=0), min_interval=interval)
    rec = Recorder(w)
    w.push({"elapsed": 1.0})
    ((first, _),) = rec.updates()
    w.push({"elapsed": 2.0})
    shown, now = w.elapsed, time.monotonic()
    if now - first < interval:  # (on a loaded machine the second push may come too late to be held)
        assert shown == 1.0  # held back: the timer cannot have fired before the interval
    # No further push and no flush: the timer alone delivers the held state.
    assert rec.wait_for(lambda: len(rec.messages) >= 2), "the held state was never sent"
    (_, (second, message)) = rec.updates()
    assert message["state"] == {"elapsed": 2.0} and w.elapsed == 2.0
    assert second - first >= 0.9 * interval


def test_hooks_fire_from_other_threads():
    w = GridWidget.from_state(fake_state())
    hits: list = []
    stop = threading.Event()
    unsub = w.on_stop(stop.set)
    w.on_select(hits.append)
    th = threading.Thread(target=lambda: setattr(w, "stop_requested", True))
    th.start()
    th.join()
    assert stop.is_set()
    w.selected = {"view": "resid", "seed": -1, "row": 1, "col": 2}
    assert hits == [{"view": "resid", "seed": -1, "row": 1, "col": 2}]
    unsub()


def test_mime_document_roundtrip():
    st = fake_state()
    doc = mime_document(st, {"view": "mlp", "seed": 1, "mode": "raw"})
    text = json.dumps(doc)
    assert doc["version"] == 1 and doc["stoppable"] is False and doc["ui"]["view"] == "mlp"
    a = doc["arrays"]["resid/seeds"]
    back = np.frombuffer(base64.b64decode(a["data"]), dtype="<f4").reshape(a["shape"])
    np.testing.assert_array_equal(back, st["arrays"]["resid/seeds"])
    # The widget accepts the document form too.
    w = GridWidget.from_state(json.loads(text))
    assert w.arrays["resid/seeds"]["shape"] == [3, 4, 5]


def test_final_bundle_has_no_widget_view():
    w = GridWidget.from_state(fake_state())
    bundle = w.final_bundle({"status": "done", "stoppable": False})
    assert set(bundle) == {MIME_TYPE, "image/png", "text/plain"}
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert bundle[MIME_TYPE]["status"] == "done"
    assert "PatchGrid" in bundle["text/plain"]
    json.dumps(bundle)


def test_final_bundle_survives_partial_and_empty_states():
    st = fake_state(done=2)
    st["arrays"]["resid/mean"] = np.full((4, 5), np.nan, dtype=np.float32)
    b = mime_bundle(st)
    assert "image/png" in b
    b2 = mime_bundle({"title": "empty"})
    assert MIME_TYPE in b2


def test_display_final_adds_the_saved_copy_and_keeps_the_widget():
    from IPython.testing.globalipapp import get_ipython  # the one test shell of this process
    from IPython.utils.capture import capture_output

    get_ipython()
    w = GridWidget.from_state(fake_state())
    with capture_output() as shown:
        bundle = w.display_final(None, {"status": "done"}, png=b"\x89PNG\r\n\x1a\nfake", keep=True)
    (output,) = shown.outputs
    assert output.data == bundle and MIME_TYPE in bundle
    assert "application/vnd.jupyter.widget-view+json" not in bundle
    # The copy names the widget it copies; the widget is still open (its comm is there).
    assert bundle[MIME_TYPE]["live_id"] == w.live_id == w.model_id != ""
    assert w.comm is not None and w.status == "done"


def test_display_final_without_keep_replaces_the_widget_output_and_closes_it():
    """What a headless run (nbclient: no view ever pinged) leaves: the copy in the widget's place."""
    w = GridWidget.from_state(fake_state())
    assert not w.has_frontend() or pipatch._notebook.widget._FRONTEND_SEEN.is_set()
    calls = []

    class Handle:
        def update(self, obj, **kw):
            calls.append((obj, kw))

    w.display_final(Handle(), {"status": "done"}, png=b"\x89PNG\r\n\x1a\nfake")
    ((obj, kw),) = calls
    assert kw == {"raw": True} and MIME_TYPE in obj
    assert w.comm is None and w._esm == "" and w.arrays == {}


def test_a_view_that_pings_hears_back():
    """The browser view asks whether its kernel is there; the widget answers ``pong``."""
    w = GridWidget.from_state(fake_state())
    sent = []
    w.send = sent.append  # record what would go to the browser
    other = GridWidget.from_state(fake_state())
    pipatch._notebook.widget._FRONTEND_SEEN.clear()
    assert not w.has_frontend() and not other.has_frontend()
    w._on_custom_msg(w, {"type": "something else"}, [])
    w._on_custom_msg(w, "not a dict", [])
    assert sent == [] and not w.has_frontend()
    w._on_custom_msg(w, {"type": "ping"}, [])
    assert sent == [{"type": "pong"}]
    # A front end draws grids in this kernel: later grids keep their live view too.
    assert w.has_frontend() and other.has_frontend()
    pipatch._notebook.widget._FRONTEND_SEEN.clear()


def test_run_grids_beyond_the_limit_are_closed_oldest_first(monkeypatch):
    from pipatch._notebook import live as _live

    monkeypatch.setattr(_live, "LIVE_GRIDS", 2)
    monkeypatch.setattr(_live, "_OPEN", _live.deque())
    grids = [GridWidget.from_state(fake_state()) for _ in range(3)]
    for g in grids:
        _live._keep_open(g)
    assert grids[0].comm is None and grids[1].comm is not None and grids[2].comm is not None
    assert list(_live._OPEN) == grids[1:]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\x00b", "a⟨U+0000⟩b"),
        ("\u202eevil", "⟨U+202E⟩evil"),
        ("x\u200dy", "x⟨U+200D⟩y"),
        ("\ud800", "⟨U+D800⟩"),
        ("  ", "␣␣"),
        (" Paris", " Paris"),
    ],
)
def test_escape_label(raw, shown):
    assert escape_label(raw) == shown


def test_escape_label_truncates():
    assert escape_label("x" * 10_000, 16) == "x" * 15 + "…"


def test_the_widget_module_imports_no_pipatch_module_but_the_views():
    """The view imports nothing that imports it: no _live, _registry, _api, ... even inside functions.
    (Its one other import is ipykernel's compat module, which imports nothing of pipatch's.)"""
    tree = ast.parse(pathlib.Path(pipatch._notebook.widget.__file__).read_text("utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("pipatch")):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names if a.name.startswith("pipatch"))
    assert imported <= {"_results.views", "_compat.ipykernel"}, imported
    # ``import pipatch`` itself loads the registry (its functions derive from it); the widget adds no
    # pipatch module beyond the views, and never the running side (_live, _magics).
    code = ("import sys, pipatch; before = set(sys.modules); import pipatch._notebook.widget as w; w.GridWidget(); "
            "added = {m for m in set(sys.modules) - before if m.startswith('pipatch.')}; "
            "assert added <= {'pipatch._notebook', 'pipatch._notebook.widget', 'pipatch._compat.ipykernel'} | "
            "{m for m in added if m.startswith('pipatch._results.views')}, added; "
            "assert not {'pipatch._notebook.live', 'pipatch._magics'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_public_patchgrid_is_the_view_plus_running():
    import pipatch
    from pipatch._notebook.live import PatchGrid

    assert pipatch.PatchGrid is PatchGrid and issubclass(PatchGrid, GridWidget)
    assert not hasattr(GridWidget, "run") and callable(PatchGrid.run)
