"""Programs: every intervention pipatch runs inside a model, each written once.

A protocol asks a question (which state carries the fact?); the engine schedules the runs
that answer it; a *program* is the code that runs inside the model for them, and a backend
(:mod:`pipatch._backends`) is only the transport that runs programs somewhere: in this
process, on a vLLM engine, on ``pipatch serve``, on NDIF. The same body runs on each, through
the backend's :class:`~._program.View` of its trace, so a number never depends on which
backend computed it beyond floating-point order.

A program declares what it needs (:class:`~._program.Needs`: writes, a backward pass,
generation, module calls, a shortcut) and its per-request inputs (:attr:`~._program.Program.inputs`:
a dataclass of typed fields, :mod:`._inputs`, whose ``ids`` are the runs of its trace). Every
backend runs such a program through one path, naming no program: one nnsight trace in this
process (or the same trace sent to NDIF, the program's module shipped by value), one engine
request per row in a vLLM worker, the same requests built by ``pipatch serve`` from the
program's name and its declared inputs. A backend that lacks what a program needs refuses it in
one line, from the declaration (a gradient program: naming ``scores=``). A new program is one
module (``tests/_toy_program.py`` is one).

=====================  =======================  ================================================
program                needs                    what it computes
=====================  =======================  ================================================
``capture``            writes                   base runs: the embedding, every block's state,
                                                the named sites' values and the metric
                                                (:mod:`.capture`; each backend's routine)
``patch``              writes                   a batch of cells, each its ops in forward order,
                                                then the metric, its states or the logits
                                                (:mod:`.patch`; each backend's routine)
``metrics``            pools_unembedding        many batches' metrics in one pass over the
                                                unembedding (:mod:`.patch`; a routine)
``lens``               —                        one run of a prompt: every block's output at
                                                given positions, read through the head (:mod:`.lens`)
``gradients``          backward                 d metric / d site at every layer (:mod:`.gradients`)
``edge_terms``         backward                 a circuit's receiver gradients at one point, and
                                                its senders' writes (:mod:`.circuit`)
``circuit_baselines``  module calls             what a circuit run reads of a run: the
                                                embeddings, each layer's streams, heads and MLP
``circuit_run``        module calls             the clean prompt run as circuits, grouped-query
                                                attention ungrouped (:mod:`.circuit`)
``node_gradients``     backward                 d metric / d x at each SAE's written value, or
                                                its integrated gradients (:mod:`.feature_terms`)
``edge_pullbacks``     backward                 a feature circuit's edges: one backward per
                                                downstream node, batched (:mod:`.feature_terms`)
=====================  =======================  ================================================

Each program is a :class:`~._program.Program` (name, version, needs, body, inputs), listed by
name in :data:`~._program.PROGRAMS`, with a function that runs it on a backend
(``capture(backend, ...)``, ``lens(backend, ...)``, ``edge_terms(backend, request)``, ...).
"""

from ._inputs import Floats, Layer, Position, TokenIds, per_row
from ._program import PROGRAMS, Needs, Program, View, register_program
from .capture import CAPTURE, CaptureRequest, capture, captures
from .circuit import (
    CIRCUIT_BASELINES,
    CIRCUIT_RUN,
    EDGE_TERMS,
    Baselines,
    CircuitRunRequest,
    EdgeTermsRequest,
    circuit_baselines,
    circuit_means,
    circuit_runs,
    edge_terms,
)
from .feature_terms import EDGE_PULLBACKS, NODE_GRADIENTS, EdgePullbacksRequest, NodeGradientsRequest
from .gradients import GRADIENTS, GradientRequest, gradients
from .lens import LENS, LensOut, LensRequest, lens
from .patch import METRICS, PATCH, PatchRequest, metrics, patch

__all__ = ["PROGRAMS", "Needs", "Program", "View", "register_program", "TokenIds", "Layer", "Position", "Floats",
           "per_row", "CAPTURE", "PATCH", "METRICS", "GRADIENTS", "EDGE_TERMS", "LENS",
           "CIRCUIT_BASELINES", "CIRCUIT_RUN", "NODE_GRADIENTS", "EDGE_PULLBACKS", "CaptureRequest", "PatchRequest", "GradientRequest", "EdgeTermsRequest",
           "CircuitRunRequest", "NodeGradientsRequest", "EdgePullbacksRequest", "LensRequest", "LensOut", "lens", "Baselines", "capture", "captures", "patch", "metrics", "gradients", "edge_terms",
           "circuit_baselines", "circuit_means", "circuit_runs"]
