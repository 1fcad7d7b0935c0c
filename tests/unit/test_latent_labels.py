"""Latent labels (:func:`pipatch.load_labels`): Neuronpedia's explanation export, a
``{id: label}`` JSON object and a dict all read to ``{latent id: label}``; every bad input is
one :class:`~pipatch.PipatchError` line."""

from __future__ import annotations

import json

import pytest

import pipatch
from pipatch._model.features.labels import LABELS_FILE, labels_next_to

NEURONPEDIA = [
    {"modelId": "gemma-3-270m", "layer": "6-res-16k", "index": "12", "description": " the Eiffel Tower",
     "explanationModelName": "gpt-4o-mini", "typeName": "oai_token-act-pair"},
    {"modelId": "gemma-3-270m", "layer": "6-res-16k", "index": 7, "description": "<b>French</b> cities"},
    {"modelId": "gemma-3-270m", "layer": "6-res-16k", "index": "12", "description": "a later explanation"},
]


def test_a_neuronpedia_export_reads_to_id_and_description(tmp_path):
    path = tmp_path / "export.json"
    path.write_text(json.dumps(NEURONPEDIA), encoding="utf-8")
    # The first explanation of a latent is kept; the label stays text as written (no HTML read).
    assert pipatch.load_labels(path) == {12: " the Eiffel Tower", 7: "<b>French</b> cities"}


def test_an_id_to_label_object_and_a_dict_read_alike(tmp_path):
    path = tmp_path / "labels.json"
    path.write_text(json.dumps({"3": "Paris", "40": "Rome"}), encoding="utf-8")
    assert pipatch.load_labels(path) == {3: "Paris", 40: "Rome"}
    assert pipatch.load_labels({3: "Paris", "40": "Rome"}) == {3: "Paris", 40: "Rome"}
    assert pipatch.load_labels(str(path)) == pipatch.load_labels({3: "Paris", 40: "Rome"})


def test_labels_next_to_an_sae_are_its_folders_labels_file(tmp_path):
    assert labels_next_to(tmp_path) == {} and labels_next_to(None) == {}
    (tmp_path / LABELS_FILE).write_text(json.dumps(NEURONPEDIA[:1]), encoding="utf-8")
    assert labels_next_to(tmp_path) == {12: " the Eiffel Tower"}


@pytest.mark.parametrize("content, said", [
    ("{not json", "is not UTF-8 JSON"),
    ('"just text"', "holds a JSON str"),
    ('[{"index": 1}]', "record 0 has no 'index' and 'description'"),
    ('[{"index": "one", "description": "x"}]', "latent id 'one' is not a whole number"),
    ('{"-2": "x"}', "latent id -2 is negative"),
    ('{"2": 5}', "the label of latent 2 is int, not text"),
])
def test_a_bad_file_is_one_line(tmp_path, content, said):
    path = tmp_path / "labels.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(pipatch.PipatchError, match=said) as caught:
        pipatch.load_labels(path)
    assert "\n" not in str(caught.value)


def test_a_missing_file_or_another_type_is_one_line(tmp_path):
    with pytest.raises(pipatch.PipatchError, match="no labels file at") as caught:
        pipatch.load_labels(tmp_path / "absent.json")
    assert "\n" not in str(caught.value)
    with pytest.raises(pipatch.PipatchError, match="cannot read labels from list"):
        pipatch.load_labels([("3", "Paris")])  # type: ignore[arg-type]
    with pytest.raises(pipatch.PipatchError, match="latent id 2.5 is not a whole number"):
        pipatch.load_labels({2.5: "x"})
    (tmp_path / "latin1.json").write_bytes('{"1": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(pipatch.PipatchError, match="is not UTF-8 JSON"):
        pipatch.load_labels(tmp_path / "latin1.json")
