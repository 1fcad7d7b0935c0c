"""Latent labels: what each latent of an SAE is thought to stand for, in words.

A label is someone's description of a latent ("the Eiffel Tower", "French cities"), written by
hand or by a model that read the latent's top contexts (Neuronpedia's auto-interpretation).
pipatch reads labels from

* **Neuronpedia's explanation export**: a JSON list of records, each with the latent's
  ``"index"`` (a number, or a number as text) and its ``"description"``; other fields
  (``modelId``, ``layer``, ``explanationModelName``, ...) are ignored, and where a latent has
  several explanations the first is kept;
* **a** ``{id: label}`` **JSON object** (``{"12": "the Eiffel Tower"}``);
* **a Python dict** ``{12: "the Eiffel Tower"}`` (ids as numbers or as text).

Each becomes a plain ``dict[int, str]`` (:func:`load_labels`). A file named :data:`LABELS_FILE`
in an SAE's folder is found by :func:`pipatch.features` on its own (:func:`labels_next_to`).

A label is text from a user or a file: it is kept as text and never read as HTML (every view
escapes it in one place).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..._base.errors import PipatchError

__all__ = ["load_labels", "labels_next_to", "LABELS_FILE"]

#: The labels file :func:`pipatch.features` reads from an SAE's folder, in either format.
LABELS_FILE = "labels.json"


def _latent_id(key: Any, where: str) -> int:
    """A latent id from a number or a number as text; one line otherwise."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise PipatchError(f"{where}: latent id {key!r} is not a whole number: key labels by latent id, "
                           "e.g. {12: 'the Eiffel Tower'}")
    try:
        value = int(key)
    except ValueError:
        raise PipatchError(f"{where}: latent id {key!r} is not a whole number: key labels by latent id, "
                           "e.g. {\"12\": \"the Eiffel Tower\"}") from None
    if value < 0:
        raise PipatchError(f"{where}: latent id {value} is negative: latent ids count from 0")
    return value


def _label(value: Any, latent: int, where: str) -> str:
    if not isinstance(value, str):
        raise PipatchError(f"{where}: the label of latent {latent} is {type(value).__name__}, not text: "
                           "give each latent a string")
    return value


def _from_mapping(labels: Mapping[Any, Any], where: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for key, value in labels.items():
        latent = _latent_id(key, where)
        out[latent] = _label(value, latent, where)
    return out


def _from_records(records: list[Any], where: str) -> dict[int, str]:
    """Neuronpedia's export: ``[{"index": ..., "description": ...}, ...]``, first one per latent."""
    out: dict[int, str] = {}
    for number, record in enumerate(records):
        if not isinstance(record, Mapping) or "index" not in record or "description" not in record:
            raise PipatchError(f"{where}: record {number} has no 'index' and 'description': a Neuronpedia export is "
                               "a list of records with both (or pass a {id: label} object)")
        latent = _latent_id(record["index"], f"{where}, record {number}")
        out.setdefault(latent, _label(record["description"], latent, f"{where}, record {number}"))
    return out


def load_labels(source: str | Path | Mapping[Any, str]) -> dict[int, str]:
    """Latent labels from a file or a dict, as ``{latent id: label}``.

    Parameters
    ----------
    source
        A path to a JSON file — Neuronpedia's explanation export (a list of records with
        ``"index"`` and ``"description"``) or a ``{id: label}`` object — or a dict
        ``{id: label}`` (ids as numbers or text).

    Returns
    -------
    dict[int, str]
        Each labelled latent's id and label; a latent without one is absent.

    Raises
    ------
    PipatchError
        One line: no such file, a file that is not JSON (or not UTF-8), JSON of another shape,
        a record without ``index`` / ``description``, an id that is not a whole number ≥ 0, a
        label that is not text, or a source that is neither a path nor a dict.

    Examples
    --------
    >>> labels = pipatch.load_labels("gemma-3-270m_12-res-16k.json")   # Neuronpedia's export
    >>> labels[1234]
    'references to Paris'
    """
    if isinstance(source, Mapping):
        return _from_mapping(source, "the labels")
    if not isinstance(source, (str, Path)):
        raise PipatchError(f"cannot read labels from {type(source).__name__}: pass a JSON file's path or a "
                           "{id: label} dict")
    path = Path(source).expanduser()
    where = str(path)
    if not path.is_file():
        raise PipatchError(f"no labels file at {where!r}: pass the path of a Neuronpedia export or a "
                           "{id: label} JSON file")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PipatchError(f"{where} is not UTF-8 JSON ({type(error).__name__}): pass a Neuronpedia export or a "
                           "{id: label} JSON file") from None
    if isinstance(document, list):
        return _from_records(document, where)
    if isinstance(document, dict):
        return _from_mapping(document, where)
    raise PipatchError(f"{where} holds a JSON {type(document).__name__}: labels are a list of Neuronpedia records "
                       "or a {id: label} object")


def labels_next_to(folder: Path | None) -> dict[int, str]:
    """The labels in ``folder``'s :data:`LABELS_FILE`, or none (no folder, no file)."""
    if folder is None or not (folder / LABELS_FILE).is_file():
        return {}
    return load_labels(folder / LABELS_FILE)
