"""Backends: the only code that runs a model.

A backend wraps one way of running a model and owns every call into it: opening nnsight
traces, reading the device, dtype and tokenizer, the unembedding arithmetic, gradients. The
engine, the protocols and the result never touch the model; they hand a backend *cells*
(:mod:`pipatch._cells`) and get numbers back.

Every backend offers the core (:class:`~._contract.Backend`, a ``typing.Protocol``):

=====================================  ======================================================
core member                            what it is
=====================================  ======================================================
``adapter``                            the family's :class:`~pipatch._models.Adapter`
``tokenizer``                          the model's tokenizer
``device``                             where inputs, noise and donors go
``dtype``                              the model's dtype
``name``                               what results call the model
``runs_on``                            where the forward passes run (``"cpu"``, ``"cuda:0"``)
``context_length``                     longest run, or ``None``
``meta()``                             what a result records about the model
``capture(ids, metric, sites, ops=)``  one run per list of ops (causal tracing's noise,
                                       added at the embedding) keeping every block output
                                       and the named sites → :class:`Capture`
``captures(prompts, metric, sites)``   each prompt's capture, maybe in one trace
``run(base, cells, metric, fast=)``    a batch of patched runs as invokes of one trace →
                                       (metric per cell, recorded values per cell)
``decode(ids)``                        token ids → text
``gradients(ids, metric, site)``       d metric / d site at every layer (attribution)
``edge_terms(clean, corrupt, ...)``    a circuit's sender writes and receiver gradients
``circuit_metrics(clean, corrupt,      the clean prompt run as each circuit of a mask
metric, keep, mean_of=)``              (faithfulness; ``mean_of``: mean ablation's prompts)
=====================================  ======================================================

and may tell the engine how to schedule its work, through ``hints``, a
:class:`~._contract.Hints` whose defaults take no shortcut (a backend without ``hints`` gets
them: a new backend can start from the core alone):

=====================================  ======================================================
hint                                   what the engine does with it
=====================================  ======================================================
``starts_at_layer``                    runs a sweep's rows from the last layer down
``position_flops``                     bounds the work rows that share traces may hold
``device_kind``                        picks its per-device sizes (``"cpu"``, ``"cuda"``)
``prefix_reuse(base)``                 groups cells by their first written position
``pack_tokens(base, metric)``          cuts a row's cells into packed traces of that size
``shares_unembedding(metric)``         lets rows finish together, one ``run_many`` call
``run_many(base, batches, metric)``    hands it several batches at once
``plans_in_flight``                    a study runs that many facts at once, each on a thread
``plans_together``                     a study runs that many facts as one engine ``Chain``
``states_many(base, batches, m)``      runs batches up to their metric's states, which ...
``metrics_many(items)``                ... it finishes later, with other plans' (a Chain's)
``packs_plans``                        hands a Chain's packed rows of several plans ...
``states_packed(traces)``              ... to it in traces that mix their prompts' cells
=====================================  ======================================================

A new way of running models (a server, say) is one module here with those members, and a
line in :func:`backend_for`. Today: :mod:`.transformers` (the default), :mod:`.vllm`
(nnsight's ``VLLM``, an in-process vLLM engine; on the CPU through :mod:`pipatch._vllm_cpu_worker`),
:mod:`.served` (the vLLM backend's invokes sent to a ``pipatch serve`` server) and :mod:`.ndif`
(requests through nnsight's remote path: NDIF, or its offline simulation).
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["backend_for"]


def backend_for(model: Any) -> Any:
    """The backend that runs ``model``: a backend as is; a ``serve=`` client → the served backend;
    a ``remote=`` model → the NDIF backend;
    nnsight's ``VLLM`` → the vLLM backend;
    any other nnsight model (built by pipatch or by the caller, lazily dispatched or not) or a
    plain transformers model → the transformers backend.

    Which one is read from what pipatch knows about the model (:func:`pipatch._known.known`:
    the server or remote it was loaded for) and its type, never from attributes on it. Every
    call shares one backend while something holds it (a running sweep, a result's clicks, the
    caller); it is held beside the model, weakly (:attr:`~pipatch._known.Known.backend`)."""
    if hasattr(model, "capture") and hasattr(model, "run") and hasattr(model, "adapter"):
        return model
    from .._compat import warn_untested
    from .._known import known

    warn_untested()
    facts = known(model)
    backend = facts.backend() if facts.backend is not None else None
    if backend is not None:
        return backend
    if facts.server is not None:
        from .served import ServedBackend

        backend = ServedBackend(model, facts.server)
    elif facts.remote is not None:
        from .ndif import NDIFBackend

        backend = NDIFBackend(model, facts.remote)
    else:
        from .vllm import VLLMBackend, is_vllm_model

        if is_vllm_model(model):
            backend = VLLMBackend(model)
        else:
            from .transformers import TransformersBackend

            backend = TransformersBackend(model)
    facts.backend = weakref.ref(backend)
    return backend
