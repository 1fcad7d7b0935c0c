"""Backends: transports that run pipatch's programs on a model.

A backend wraps one way of running a model and owns every call into it: opening nnsight
traces (or requests), reading the device, dtype and tokenizer. It says *where and how* a
batch of intervention bodies runs and names no experiment: what runs is a program
(:mod:`pipatch._programs`), each written once, which a backend runs through its own view of
its trace (``backend.run(program, request)``). The engine, the protocols and the result never
touch the model.

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
``capabilities``                       what it can do, as data (the table below)
``meta()``                             what a result records about the model
``decode(ids)``                        token ids → text
``batch_size(n_tokens)``               invokes per trace that fit the device
``run(program, request)``              run a program (:mod:`pipatch._programs`), or refuse
                                       it in one line
=====================================  ======================================================

and says what it can do and what the engine may rely on in its
:class:`~._contract.Capabilities`, whose defaults are a new backend's (no shortcut, no
gradient):

=====================================  ======================================================
capability                             what it means
=====================================  ======================================================
``gradients``                          runs backward passes (attribution, a circuit's scores)
``circuit_runs``                       feeds each circuit receiver its own input (the curve)
``skips_blocks``                       starts a run at its first patched layer: the engine
                                       runs a sweep's rows from the last layer down
``reuses_prefix``                      starts a run at its first written position: the
                                       engine groups cells by it
``pack_tokens``                        positions per packed trace (0: no packing)
``packs_prompts``                      a packed trace may mix prompts (a study's facts)
``pools_unembedding``                  many batches' metrics in one pass (``metrics``)
``device_kind``                        which of the engine's per-device sizes apply
``position_flops``                     bounds the work rows that share traces may hold
``plans_in_flight``                    a study runs that many facts at once, each on a thread
``plans_together``                     a study runs that many facts as one engine chain
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
    if hasattr(model, "capabilities") and hasattr(model, "run") and hasattr(model, "adapter"):
        return model
    from .vllm import VLLMBackend, is_vllm_model

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
