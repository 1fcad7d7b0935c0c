"""What a feature grid's rows say in the views: ``row_axis`` (what a row is) and ``row_notes``
(a latent's label and top contexts, shown on hover), in the state, the saved document, the
widget's traits and a file read back. No model: the results are built by hand."""

from __future__ import annotations

import json

import torch

import pipatch
from pipatch._experiments._feature_contexts import shown_tokens, window
from pipatch._experiments._feature_screen import ERROR, FeaturePatchResult
from pipatch._notebook.widget import GridWidget
from pipatch._results.features import NOTE_CONTEXTS, LatentsResult
from pipatch._results.result import Result
from pipatch._results.views import mime_document

SITE = "L1 resid_post"
HOSTILE = "<img src=x onerror=window.__pwned=1> lone\ud800"


def feature_result() -> FeaturePatchResult:
    contexts = [[f"… ctx {i}«tok»", 5.0 - i] for i in range(NOTE_CONTEXTS + 2)]
    meta = {"latents": [7, 3, ERROR], "positions": [0, 1], "site": SITE,
            "labels": {SITE: {"7": "the Eiffel Tower", "3": HOSTILE}},
            "contexts": {SITE: {"7": contexts}}}
    return FeaturePatchResult(kind="feature_patch", tokens=["a", "b"], columns=["a", "b"],
                              layers=["L1 #7", "L1 #3", "L1 error"], metric="logit_diff",
                              raw={SITE: torch.rand(1, 3, 2)}, clean=1.0, corrupt=torch.tensor([0.0]), meta=meta)


def test_a_feature_grids_rows_are_latents_noted_with_label_and_top_contexts():
    state = feature_result().to_state()
    assert state["row_axis"] == "latent"
    seven, three, error = state["row_notes"]
    assert seven.split("\n") == ["the Eiffel Tower", *(f"… ctx {i}«tok»  ({5.0 - i:.3g})" for i in range(NOTE_CONTEXTS))]
    assert three == "<img src=x onerror=window.__pwned=1> lone\ufffd"  # text, UTF-8 safe; no contexts stored
    assert "error" in error
    assert feature_result().label(3) == HOSTILE and feature_result().contexts(3) == []


def test_the_notes_reach_the_document_the_widget_and_a_file_read_back(tmp_path):
    result = feature_result()
    document = json.loads(json.dumps(mime_document(result.to_state()), allow_nan=False))
    assert document["row_axis"] == "latent" and document["row_notes"] == result.to_state()["row_notes"]
    widget = GridWidget(result)
    assert widget.row_axis == "latent" and widget.row_notes == result.to_state()["row_notes"]
    widget.close()
    back = pipatch.load_result(result.save(tmp_path / "features.json"))
    assert back.to_state()["row_notes"] == result.to_state()["row_notes"]


def test_other_results_rows_are_layers_or_ranks_without_notes():
    plain = Result(kind="trace", tokens=["a"], columns=["a"], layers=["0", "1"], metric="prob",
                   raw={"resid": torch.rand(1, 2, 1)}, clean=1.0, corrupt=torch.tensor([0.0]))
    assert (plain.to_state()["row_axis"], plain.to_state()["row_notes"]) == ("", [])
    assert GridWidget().row_axis == "" and GridWidget().row_notes == []
    ranks = LatentsResult(kind="features", tokens=["a"], columns=["a"], layers=["top 1"], metric="activation",
                          raw={SITE: torch.rand(1, 1, 1)}, clean=float("nan"), corrupt=torch.tensor([float("nan")]),
                          meta={"latents": {SITE: [[4]]}, "labels": {SITE: {"4": "x"}}, "normalize": False})
    assert (ranks.to_state()["row_axis"], ranks.to_state()["row_notes"]) == ("rank", [])


def test_a_context_window_leaves_special_tokens_out_of_its_text():
    tokens = ["<bos>", "The", " Eiffel", " Tower", " is", " in", " Paris", "<eos>"]
    shown = shown_tokens(tokens, [False, True, True, True, True, True, True, False])
    record = window(shown, 6, text=0)
    assert (record["before"], record["token"], record["after"]) == ("The Eiffel Tower is in", " Paris", "")
    assert window(shown, 1, text=0)["before"] == ""


def test_a_feature_reads_cells_are_noted_with_their_latent_label_and_top_contexts(tmp_path):
    """A feature read's rows are ranks: each cell holds its own latent, so each cell has the
    note (``cell_notes``, per view, row-major) a feature patch's latent row has, headed by the
    latent's id; a cell where none fires has none. It reaches the document, the widget and a
    file read back."""
    contexts = [[f"… ctx {i}«tok»", 5.0 - i] for i in range(NOTE_CONTEXTS + 2)]
    read = LatentsResult(kind="features", tokens=["a", "b"], columns=["a", "b"], layers=["top 1", "top 2"],
                         metric="activation", raw={SITE: torch.tensor([[[2.0, 1.5], [1.0, float("nan")]]])},
                         clean=float("nan"), corrupt=torch.tensor([float("nan")]),
                         meta={"latents": {SITE: [[7, 3], [3, None]]}, "labels": {SITE: {"7": "the Eiffel Tower",
                                                                                     "3": HOSTILE}},
                               "contexts": {SITE: {"7": contexts}}, "normalize": False})
    state = read.to_state()
    seven, three, three_again, none = state["cell_notes"][SITE]
    assert seven.split("\n") == ["latent 7", "the Eiffel Tower",
                                 *(f"… ctx {i}«tok»  ({5.0 - i:.3g})" for i in range(NOTE_CONTEXTS))]
    assert three == three_again == "latent 3\n<img src=x onerror=window.__pwned=1> lone\ufffd"  # text, UTF-8 safe
    assert none == "" and state["row_notes"] == []
    document = json.loads(json.dumps(mime_document(state), allow_nan=False))
    assert document["cell_notes"] == state["cell_notes"]
    widget = GridWidget(read)
    assert widget.cell_notes == state["cell_notes"]
    widget.close()
    assert pipatch.load_result(read.save(tmp_path / "read.json")).to_state()["cell_notes"] == state["cell_notes"]
    assert feature_result().to_state()["cell_notes"] == {} and GridWidget().cell_notes == {}
