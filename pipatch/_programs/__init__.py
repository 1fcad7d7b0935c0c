"""Programs: every intervention pipatch runs inside a model, each written once.

A protocol asks a question (which state carries the fact?); the engine schedules the runs
that answer it; a *program* is the code that runs inside the model for them, and a backend
(:mod:`pipatch._backends`) is only the transport that runs programs somewhere: in this
process, on a vLLM engine, on ``pipatch serve``, on NDIF. The same body runs on each, through
the backend's :class:`~._program.View` of its trace, so a number never depends on which
backend computed it beyond floating-point order.

=====================  ===================  ====================================================
program                capability needed    what it computes
=====================  ===================  ====================================================
``capture``            —                    base runs: the embedding, every block's state, the
                                            named sites' values and the metric (:mod:`.capture`)
``patch``              —                    a batch of cells, each its ops in forward order, then
                                            the metric, its states or the logits (:mod:`.patch`)
``metrics``            pools_unembedding    many batches' metrics in one pass over the
                                            unembedding (:mod:`.patch`)
``lens``               —                    one run of a prompt: every block's output at given
                                            positions, read through the head (:mod:`.lens`)
``gradients``          gradients            d metric / d site at every layer (:mod:`.gradients`)
``edge_terms``         gradients            a circuit's sender writes and receiver gradients
                                            (:mod:`.circuit`)
``circuit_baselines``  circuit_runs         what a circuit run reads of a run: the embeddings,
                                            each layer's streams, heads and MLP (:mod:`.circuit`)
``circuit_run``        circuit_runs         the clean prompt run as circuits, grouped-query
                                            attention ungrouped (:mod:`.circuit`)
``node_gradients``     gradients            d metric / d x at each SAE's written value, or its
                                            integrated gradients (:mod:`.feature_terms`)
``edge_pullbacks``     gradients            a feature circuit's edges: one backward per
                                            downstream node, batched (:mod:`.feature_terms`)
=====================  ===================  ====================================================

Each program is a :class:`~._program.Program` (name, version, the capability it needs, its
body), listed by name in :data:`~._program.PROGRAMS`, with a request type and a function that
runs it on a backend (``capture(backend, ...)``, ``patch(backend, request)``, ...).
"""

from ._program import PROGRAMS, Program, View
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

__all__ = ["PROGRAMS", "Program", "View", "CAPTURE", "PATCH", "METRICS", "GRADIENTS", "EDGE_TERMS", "LENS",
           "CIRCUIT_BASELINES", "CIRCUIT_RUN", "NODE_GRADIENTS", "EDGE_PULLBACKS", "CaptureRequest", "PatchRequest", "GradientRequest", "EdgeTermsRequest",
           "CircuitRunRequest", "NodeGradientsRequest", "EdgePullbacksRequest", "LensRequest", "LensOut", "lens", "Baselines", "capture", "captures", "patch", "metrics", "gradients", "edge_terms",
           "circuit_baselines", "circuit_means", "circuit_runs"]
