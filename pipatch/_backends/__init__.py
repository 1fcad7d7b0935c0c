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
``adapter``                            the family's :class:`~pipatch._model.models.Adapter`
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
``generates``                          runs programs that generate tokens (none does yet)
``torch_threads``                      computes on this process's CPU threads: the engine
                                       warns when they outnumber the free cores
=====================================  ======================================================

A new way of running models (a server, say) is one module here with those members, and a
line in :func:`backend_for`. Today: :mod:`.transformers` (the default), :mod:`.vllm`
(nnsight's ``VLLM``, an in-process vLLM engine; on the CPU through :mod:`pipatch._backends._vllm_cpu_worker`),
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

    Which one is read from what pipatch knows about the model (:func:`pipatch._base.known.known`:
    the server or remote it was loaded for) and its type, never from attributes on it. Every
    call shares one backend while something holds it (a running sweep, a result's clicks, the
    caller); it is held beside the model, weakly (:attr:`~pipatch._base.known.Known.backend`)."""
    if hasattr(model, "capabilities") and hasattr(model, "run") and hasattr(model, "adapter"):
        return model
    from .._base.known import known
    from .._compat import warn_untested

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
        from ._vllm_engine import is_vllm_model
        from .vllm import VLLMBackend

        if is_vllm_model(model):
            backend = VLLMBackend(model)
        else:
            from .transformers import TransformersBackend

            backend = TransformersBackend(model)
    facts.backend = weakref.ref(backend)
    return backend
