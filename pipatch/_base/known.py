"""What pipatch knows about a model, held beside it (weakly), never on it.

pipatch sets no attribute on a model: the model is the user's (nnsight pickles a model's
attributes into every remote request, and a user's own code should find the object as
nnsight made it). What pipatch needs to remember about one (the name it was loaded by, the
server it runs on, the backend made for it) is a :class:`Known` in one
``weakref.WeakKeyDictionary``, keyed by the model itself (nnsight envoys and torch modules
hash by identity): an entry goes with its model, and no entry keeps its model alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["Known", "known", "remember"]


@dataclass
class Known:
    """What pipatch knows about one model.

    Attributes
    ----------
    name
        What results call the model (``meta()["model"]``): the name :func:`pipatch.load_model`
        was given, the embedded model's label, a tiny test model's family; ``None``: the
        checkpoint's own.
    path
        Where ``Result.code()``'s script loads it from (the embedded model's converted folder).
    server
        A ``serve=`` client's connection (:class:`pipatch._backends.served.Server`).
    remote
        ``remote=``'s value for a model that runs through nnsight's remote path (``True``:
        NDIF, ``"local"``: its offline simulation).
    tree_named
        Whether the vLLM engine's workers name this model's envoy tree
        (:func:`pipatch._backends._vllm_worker.register_tree`).
    backend
        A weak reference to the backend :func:`pipatch._backends.backend_for` made for it,
        shared by every call while something holds it (a backend holds its model: a strong
        reference here would keep the model alive for good).
    """

    name: str | None = None
    path: str | None = None
    server: Any = None
    remote: bool | str | None = None
    tree_named: bool = False
    backend: weakref.ref | None = None


_KNOWN: weakref.WeakKeyDictionary[Any, Known] = weakref.WeakKeyDictionary()


def known(model: Any) -> Known:
    """What pipatch knows about ``model`` (an empty :class:`Known` the first time, kept; for
    an object that cannot be weakly referenced, a new empty one each time)."""
    try:
        entry = _KNOWN.get(model)
    except TypeError:
        return Known()
    if entry is None:
        entry = _KNOWN[model] = Known()
    return entry


def remember(model: Any, **facts: Any) -> Any:
    """Record ``facts`` (fields of :class:`Known`) about ``model``; returns ``model``."""
    entry = known(model)
    for field, value in facts.items():
        if not hasattr(entry, field):
            raise TypeError(f"Known has no field {field!r}")
        setattr(entry, field, value)
    return model
