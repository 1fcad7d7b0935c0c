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

from typing import Any

__all__ = ["backend_for"]


def backend_for(model: Any) -> Any:
    """The backend that runs ``model``: a backend as is; a ``serve=`` client → the served backend;
    a ``remote=`` model → the NDIF backend;
    nnsight's ``VLLM`` → the vLLM backend;
    any other nnsight model (built by pipatch or by the caller, lazily dispatched or not) or a
    plain transformers model → the transformers backend. Cached on the model so every call
    shares one."""
    if hasattr(model, "capture") and hasattr(model, "run") and hasattr(model, "adapter"):
        return model
    from .._compat import warn_untested
    from .vllm import VLLMBackend, is_vllm_model

    warn_untested()

    if getattr(model, "_pipatch_serve", None) is not None:
        from .served import served_backend

        return served_backend(model)  # kept apart: nnsight ships the model's attributes
    remote = getattr(model, "_pipatch_remote", None)
    if remote is not None:
        from .ndif import ndif_backend

        return ndif_backend(model, remote)
    if is_vllm_model(model):
        cls: type = VLLMBackend
    else:
        from .transformers import TransformersBackend

        cls = TransformersBackend
    cached = getattr(model, "_pipatch_backend", None)
    if isinstance(cached, cls):
        return cached
    backend = cls(model)
    try:
        model._pipatch_backend = backend
    except Exception:  # noqa: BLE001 - caching is an optimisation only
        pass
    return backend
