"""The vLLM backend's engine plumbing: how its requests reach an engine in this process.

:class:`LocalEngine` opens the one kind of trace the vLLM backend needs — one invoke (request)
per job, on a list of token ids, its body a module-level function shipped by reference (the
request bodies of :mod:`._vllm_worker`) — and keeps the engine usable around it:

* **The model's tree by reference** (:func:`tree_by_reference`): nnsight pickles every invoke
  for the workers, and by default the whole envoy tree with it; each worker names its own tree
  once (:func:`~._vllm_worker.register_tree`), and an invoke then names it.
* **Quiet.** vLLM draws two progress bars per ``generate``; in a notebook each is a widget per
  batch. ``generate`` is quiet only while pipatch's own trace runs
  (:func:`pipatch._compat.vllm.quiet_generate`), the original again after.
* **Interrupts.** Kernel ▸ Interrupt can land while the engine still holds this trace's
  requests; they are aborted before the ``KeyboardInterrupt`` propagates, so the engine is idle
  and the next sweep in the same kernel runs normally.

Also here: what the client side needs to know of an engine without one (:func:`vllm_adapter`:
the family adapter over vLLM's module tree, fused ``qkv_proj`` and tensor-parallel ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from .._base.known import known
from .._compat import vllm as vllm_compat
from .._compat.nnsight import persistent_id
from .._model.models import TREE_ID, Adapter, adapter_for
from ._vllm_worker import register_tree

__all__ = ["LocalEngine", "INVOKES_PER_REQUEST", "SAMPLING", "is_vllm_model", "tree_by_reference", "vllm_adapter",
           "per_invoke"]

#: Every pipatch run is one prefill and one greedy step; nothing is generated, and the one
#: sampled token is never read as text (pipatch's invoke bodies save what they read).
SAMPLING = {"temperature": 0.0, "max_tokens": 1, "detokenize": False}

#: Invokes per request to a server, and per trace where a trace's requests must share an
#: engine step (a circuit's masks): a batch of cells is one request as a rule (a grid's
#: batches hold up to a few dozen), which the server starts in one engine step
#: (:func:`pipatch._serving.serve._together`); a batch split over requests that arrive apart runs as
#: more steps (``bench/served.py`` compares it with the in-process engine).
INVOKES_PER_REQUEST = 64

def is_vllm_model(model: Any) -> bool:
    """Whether ``model`` is nnsight's ``VLLM`` (checked without importing vLLM)."""
    return any(cls.__module__.startswith("nnsight.modeling.vllm") and cls.__name__ == "VLLM"
               for cls in type(model).__mro__)


class LocalEngine:
    """The engine of an nnsight ``VLLM`` model in this process (see the module docstring)."""

    def __init__(self, model: Any):
        self.model = model

    @property
    def llm_engine(self) -> Any:
        return self.model.vllm_entrypoint.llm_engine

    def invokes(self, body: Any, jobs: list[tuple[list[int], tuple]]) -> list:
        """``body(model, *args)`` for each job ``(ids, args)``, each in its own invoke of one
        trace on the token list ``ids``; what each returned, in order."""
        import nnsight

        model = self.model
        with (self._requests_aborted_on_interrupt(), self._tree_by_reference(),
              vllm_compat.quiet_generate(model.vllm_entrypoint), torch.no_grad(), model.trace(**SAMPLING) as tracer):
            for ids, args in jobs:
                with tracer.invoke(ids):
                    out = nnsight.save(body(model, *args))
        return per_invoke(out, len(jobs))

    def collective_rpc(self, method: Any, args: tuple = ()) -> list:
        """``method(worker, *args)`` on every rank's worker; their answers in rank order."""
        return list(self.model.vllm_entrypoint.collective_rpc(method, args=args))

    @contextlib.contextmanager
    def _tree_by_reference(self):
        """While pipatch's own traces are built, ship the model's envoy tree with each invoke
        by reference (:func:`tree_by_reference`), once each worker knows it by name
        (:func:`register_tree`, once per engine)."""
        model, facts = self.model, known(self.model)
        if not facts.tree_named:
            model.vllm_entrypoint.collective_rpc(register_tree)
            facts.tree_named = True
        with tree_by_reference(model):
            yield

    @contextlib.contextmanager
    def _requests_aborted_on_interrupt(self):
        """On any exception (Kernel ▸ Interrupt above all) abort the engine's unfinished requests.

        ``LLM.generate`` steps the engine until its requests finish; an interrupt between steps
        leaves them queued, and the next trace would run (and be handed the outputs of) them.
        """
        try:
            yield
        except BaseException:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> int:
        """Abort every request the engine still holds (:func:`pipatch._compat.vllm.abort_unfinished`);
        returns how many there were."""
        return vllm_compat.abort_unfinished(self.llm_engine)


@contextlib.contextmanager
def tree_by_reference(model: Any):
    """Within this block, a pickled invoke names ``model``'s envoy tree by :data:`TREE_ID`
    instead of carrying it.

    nnsight pickles every invoke for the engine's workers (``extra_args`` of its request), and
    an invoke body that names ``model`` carries the whole envoy tree with it: 264 envoys for
    Gemma 3 270M, a third of a resid grid's time (``bench/backends.py``). Each worker already
    holds the same tree over its own modules and interleaver, which a by-value copy is rebuilt
    into from persistent ids; with the tree named among each worker's persistent objects
    (:func:`register_tree`) and ``model`` tagged with the id, an invoke is a few hundred
    bytes. The tag comes off after the block (:func:`pipatch._compat.nnsight.persistent_id`):
    the user's own traces of the model stay nnsight's. (A ``pipatch serve`` server names its
    tree the same way, for its clients' requests and its engine's.)"""
    with persistent_id(model, TREE_ID):
        yield


def per_invoke(saved: Any, n: int) -> list:
    """nnsight hands back a name saved in ``n`` invokes as a list of ``n``, but a single one as is."""
    if n == 1:
        return [saved]
    if not isinstance(saved, list) or len(saved) != n:
        raise RuntimeError(f"pipatch: expected {n} values back from the vLLM engine, got "
                           f"{len(saved) if isinstance(saved, list) else 1}")
    return saved


def _tp_ranks(model: Any) -> int:
    """The engine's tensor-parallel size (1 for a model without an engine config)."""
    engine = getattr(getattr(model, "vllm_entrypoint", None), "llm_engine", None)
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def vllm_adapter(model: Any, ranks: int | None = None) -> Adapter:
    """The family adapter over vLLM's module tree.

    vLLM keeps transformers' module names for most families (``model.layers``, ``self_attn``,
    ``mlp``, ``o_proj``), so the transformers adapter's lookup finds them; what differs is the
    query/key/value projection: vLLM fuses it into ``qkv_proj``, always laid out
    ``[q × n_heads | k × n_kv | v × n_kv]`` (``QKVParallelLinear``) on each tensor-parallel
    rank, which nnsight gathers rank after rank (``"stacked_by_rank"`` from TP = 2 up).
    ``ranks``: the engine's tensor-parallel size where ``model`` has no engine (a served
    client's module tree; the server says its size).
    """
    adapter = adapter_for(model)
    if adapter.qkv == ("qkv_proj",):
        ranks = _tp_ranks(model) if ranks is None else ranks
        adapter = dataclasses.replace(adapter, qkv_layout="stacked" if ranks == 1 else "stacked_by_rank",
                                      tp_ranks=ranks)
    return dataclasses.replace(adapter, last_logits_only=False)
