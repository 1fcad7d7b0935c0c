"""Every view of a result, made from its one state.

Data flows one way: ``Result.to_state()`` → the state (:mod:`.schema`: one schema, the same
in ``js/schema.ts``) → the views:

* the widget's traits (:mod:`pipatch._notebook.widget`, drawn by ``js/grid.ts``);
* the MIME document and bundle a notebook saves (:mod:`.mime`, drawn without a kernel by the
  same ``js/grid.ts``);
* the matplotlib figure and the PNG (:mod:`.render`: ``Result.plot()``, the CLI's ``--png``,
  the bundle's ``image/png``);
* the text grid and the one-line summary (:mod:`.text`);
* a circuit's graph instead of the heatmap (:mod:`.circuit`: the state's ``circuit`` part, the
  edge ranking and the JSON export; drawn by ``js/circuit.ts`` and :mod:`.render`).

One orientation everywhere (row 0 = layer 0 at the top, columns left to right), one set of
colour scales (:mod:`.colors`: diverging for signed values, sequential for a probability or a
rank drawn as itself; the same stops and arithmetic in ``js/format.ts``), one JSON sanitiser
(:func:`json_safe`) and one escaper (:func:`escape_label`, the same rule as ``escapeLabel``
in ``js/format.ts``), both in :mod:`.strings`.
"""

from .circuit import circuit_edges, circuit_part, graph_document, is_circuit
from .colors import DIVERGING_STOPS, NAN_RGB, diverging_rgb, symmetric_max
from .mime import mime_bundle, mime_document
from .render import TOP_EDGES, figure, png
from .schema import (
    ARRAY_DTYPE,
    ARRAY_SCHEMA,
    MIME_TYPE,
    SCHEMA_VERSION,
    STATE_KEYS,
    STATE_SCHEMA,
    conform_state,
    decode_array,
    done_span,
    encode_array,
    select_matrix,
)
from .strings import clean_text, escape_label, json_safe
from .text import summary, text_grid

__all__ = [
    "ARRAY_DTYPE", "ARRAY_SCHEMA", "DIVERGING_STOPS", "MIME_TYPE", "NAN_RGB", "SCHEMA_VERSION", "STATE_KEYS",
    "STATE_SCHEMA", "TOP_EDGES", "circuit_edges", "circuit_part", "clean_text", "conform_state", "decode_array",
    "diverging_rgb", "done_span", "encode_array", "escape_label", "figure", "graph_document", "is_circuit",
    "json_safe", "mime_bundle", "mime_document", "png", "select_matrix", "summary", "symmetric_max", "text_grid",
]  # fmt: skip
