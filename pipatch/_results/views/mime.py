"""The one MIME producer: the grid document and the bundle a notebook saves.

``Result.to_mime()`` / ``Result._repr_mimebundle_`` and the widget's saved output
(``GridWidget.to_mime`` / ``final_bundle``) are these two functions applied to a state.
The bundle holds no widget view: ``application/vnd.pipatch.grid+json`` (drawn by the pipatch
JupyterLab extension with the live grid's code, no kernel), ``image/png`` (nbconvert, GitHub,
other front ends) and ``text/plain``.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from .render import png as png_bytes
from .schema import MIME_TYPE, SCHEMA_VERSION, arrays_to_base64, conform_state
from .strings import json_safe
from .text import summary

__all__ = ["mime_bundle", "mime_document"]


def mime_document(state: Mapping[str, Any], ui: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``application/vnd.pipatch.grid+json`` document: the state (less the click
    ``detail``), arrays as base64, ``stoppable`` false, ``version``, and the user's ``ui``
    choices (view, seed, mode) when given. Strict, UTF-8-safe JSON."""
    clean = conform_state(state)
    doc: dict[str, Any] = {"version": SCHEMA_VERSION}
    for key, value in clean.items():
        doc[key] = arrays_to_base64(value) if key == "arrays" else value
    doc.pop("detail", None)
    doc["stoppable"] = False
    if ui:
        doc["ui"] = {k: ui[k] for k in ("view", "seed", "mode") if k in ui}
    return json_safe(doc)


def mime_bundle(state: Mapping[str, Any], ui: Mapping[str, Any] | None = None, *, png: bytes | None = None) -> dict[str, Any]:
    """The bundle for a finished grid: the document, a PNG of the shown view / seed / mode
    (``png=b""`` leaves it out; a PNG that fails to draw is left out too) and one line of
    text."""
    state = conform_state(state)
    ui = dict(ui or {})
    if png is None:
        try:
            png = png_bytes(state, ui.get("view"), mode=str(ui.get("mode") or "recovery"), seed=int(ui.get("seed", -1)))
        except Exception:  # noqa: BLE001 - a PNG is a convenience; never lose the grid over it
            png = b""
    bundle: dict[str, Any] = {MIME_TYPE: mime_document(state, ui), "text/plain": summary(state)}
    if png:
        bundle["image/png"] = base64.b64encode(png).decode("ascii")
    return bundle
