"""How a program's body sees a trace of an nnsight transformers model (in this process or on
NDIF): :class:`~pipatch._programs._program.View`\\ s over its batch.

* :class:`RowsView`: jobs side by side as batch rows (``rows_per_job`` rows each: a run's
  inputs), from prompt position ``start`` on; the blocks below ``below`` skipped with
  ``skipped`` states (the base runs' outputs of those blocks, for the batch's rows).
* :class:`PackedView`: jobs packed into rows, each from its own position and ``start`` layer
  (:class:`~._packing.Packed`): block ``k`` runs the rows from ``active[k]`` on, the rows
  before take the base runs' output of the block.
* :class:`CircuitTraceView`: a circuit's bodies (:mod:`pipatch._programs.circuit`) in a trace
  of ``k`` run inputs: their values read live, the modules called through their envoys
  (nnsight's ad-hoc call), the attention ungrouped.

A site's holder value is the nnsight value :meth:`pipatch._model.sites.Site.value` names, as a
:class:`~pipatch._model.sites.TensorPlace`; a block's state is its raw output, cloned, in its own
structure (a tensor, or a tuple around one), as a later run skips the block with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._compat.nnsight import torch_module
from .._model.models import Adapter, _get, first
from .._model.sites import Place, Site, TensorPlace
from .._programs._program import View
from .._programs.circuit import CircuitView, Ungrouped, returning, widened
from ._packing import Packed
from ._unembedding import Unembedding, unembedding_input

__all__ = ["RowsView", "PackedView", "CircuitTraceView"]


class RowsView(View):
    """Jobs as batch rows side by side (see the module docstring)."""

    def __init__(self, adapter: Adapter, model: Any, rows_per_job: int = 1, start: int = 0, below: int = 0,
                 skipped: Sequence[Any] = ()):
        super().__init__(adapter, model, rows_per_job, start)
        self.below, self.skipped = below, skipped

    def holder(self, site: Site, layer: int) -> Place:
        return TensorPlace(site.value(self.adapter, self.model, layer))

    def enter(self, layer: int) -> None:
        if layer < self.below:
            self.adapter.block(self.model, layer).skip(self.skipped[layer])

    def block_state(self, layer: int) -> Any:
        out = self.adapter.block(self.model, layer).output
        if isinstance(out, tuple):
            return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
        return out.clone()

    def read_out(self, metric: Any) -> Any:
        """The unembedding's input at the first job's read positions, ``[n_read, d]``, the
        module itself skipped (:func:`~._unembedding.unembedding_input`)."""
        return unembedding_input(self.adapter.unembedding(self.model), (slice(0, 1), slice(-metric.n_read, None)))[0]

    def final_norm(self, states: Any) -> Any:
        """The final norm's module on ``states`` ([N, d]), through its envoy (nnsight's ad-hoc
        call); the states as they are where the family has none."""
        if self.adapter.final_norm is None:
            return states
        return first(_get(self.model, self.adapter.final_norm)(states[None]))[0]

    @property
    def unembedding(self) -> Unembedding:
        return Unembedding(self.adapter.unembedding(self.model), self.adapter.softcap)

    def circuit_view(self, rows: int) -> CircuitTraceView:
        """This trace as a circuit's bodies see it (:class:`CircuitTraceView`), its ``rows`` the
        run inputs."""
        dtype = next(torch_module(self.model).parameters()).dtype
        return CircuitTraceView(self.adapter, self.model, dtype, rows)


class PackedView(View):
    """Jobs packed into rows (see the module docstring): job ``j`` is ``pack.spans[j]``, its
    ops' positions shifted by its own first position."""

    def __init__(self, adapter: Adapter, model: Any, pack: Packed):
        super().__init__(adapter, model)
        self.pack = pack
        self.layer = 0
        self.partly = False
        self._widened: torch.Tensor | None = None

    def holder(self, site: Site, layer: int) -> Place:
        if self.partly and site.is_block_output:  # the rows it ran, and the base runs' for the others
            if self._widened is None:
                self._widened = self.pack.widen(self.adapter.block(self.model, layer), layer)
            return TensorPlace(self._widened)
        return TensorPlace(site.value(self.adapter, self.model, layer))

    def rows(self, job: int, site: Site) -> Any:
        row, span = self.pack.spans[job]
        if not (site.is_embedding or site.is_block_output):  # a site the block computes: its rows only
            row -= self.pack.active[self.layer]
        return slice(row, row + 1), span

    def index(self, job: int, op: Any) -> tuple:
        return op.index_from(self.pack.starts[job])

    def enter(self, layer: int) -> None:
        pack, block = self.pack, self.adapter.block(self.model, layer)
        self.layer, self._widened = layer, None
        active = pack.active[layer]
        self.partly = 0 < active < pack.n_rows
        if active == pack.n_rows:
            block.skip(pack.base_output(layer))
        elif self.partly:
            args, kwargs = block.inputs
            block.inputs = pack.narrowed(args, active), pack.narrowed(kwargs, active)

    def leave(self, layer: int) -> None:
        if self.partly and self._widened is None:
            self.pack.widen(self.adapter.block(self.model, layer), layer)


class CircuitTraceView(CircuitView):
    """A circuit's bodies in an nnsight trace of ``k`` run inputs (one invoke, ``[k, T]``) of
    ``model``, whose modules are in ``dtype``.

    A live value is the envoy's ``.input`` or ``.output`` in the trace, cloned; a module call
    is the envoy's ad-hoc call. :meth:`attention` calls the attention module's class forward
    with an :class:`~pipatch._programs.circuit.Ungrouped` stand-in, on the real call's
    arguments (the position embeddings, the mask: read live), every tensor of the run's ``k``
    rows repeated for every mask and no key/value cache.
    """

    #: The attention forward's key/value-cache arguments (a circuit run keeps no cache).
    CACHES = ("past_key_values", "cache", "layer_past", "past_key_value")

    def __init__(self, adapter: Adapter, model: Any, dtype: torch.dtype, k: int):
        self.adapter, self.model, self.dtype, self.k = adapter, model, dtype, k

    def _block(self, layer: int) -> Any:
        return self.adapter.block(self.model, layer)

    def _at(self, layer: int, path: str | None) -> Any:
        assert path is not None, "a circuit needs its family's norms (check_circuit_family)"
        return _get(self._block(layer), path)

    def _call(self, envoy: Any, x: torch.Tensor) -> torch.Tensor:
        """``envoy``'s module on ``x`` ([..., T, width], any leading dimensions), float32."""
        flat = x.reshape(-1, *x.shape[-2:]).to(self.dtype)
        return first(envoy(flat)).float().reshape(*x.shape[:-1], -1)

    # -- live values ------------------------------------------------------------------------
    def embedded(self) -> torch.Tensor:
        return self.adapter.embedding(self.model).output.float().clone()

    def attn_in(self, layer: int) -> torch.Tensor:
        return self._at(layer, self.adapter.attn_norm).input.float().clone()

    def z(self, layer: int) -> torch.Tensor:
        return _get(self._at(layer, self.adapter.attn), self.adapter.out_proj).input.float().clone()

    def mlp_in(self, layer: int) -> torch.Tensor:
        return self._at(layer, self.adapter.mlp_norm).input.float().clone()

    def mlp_out(self, layer: int) -> torch.Tensor:
        return first(self._at(layer, self.adapter.mlp).output).float().clone()

    def final_in(self) -> torch.Tensor:
        assert self.adapter.final_norm is not None  # check_circuit_family's promise
        return _get(self.model, self.adapter.final_norm).input.float().clone()

    # -- module calls -------------------------------------------------------------------------
    def attn_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._at(layer, self.adapter.attn_norm), x)

    def project(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self._call(_get(self._at(layer, self.adapter.attn), name), x)

    def out_proj(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        return self._call(_get(self._at(layer, self.adapter.attn), self.adapter.out_proj), z)

    def attn_post_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._at(layer, self.adapter.attn_post_norm), x)

    def mlp_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._at(layer, self.adapter.mlp_norm), x)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._at(layer, self.adapter.mlp), x)

    def mlp_post_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._at(layer, self.adapter.mlp_post_norm), x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.adapter.final_norm is not None  # check_circuit_family's promise
        return self._call(_get(self.model, self.adapter.final_norm), x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self._call(self.adapter.unembedding(self.model), x)
        cap = self.adapter.softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        envoy = self._at(layer, self.adapter.attn)
        module = torch_module(envoy)
        args, kwargs = envoy.inputs  # the real call's: its positions and mask
        rows, T = q.shape[0], q.shape[1]
        dummy = q.new_zeros((), dtype=self.dtype).expand(rows, T, self.adapter.d_model)  # read for its shape only

        def batched(value: Any) -> Any:  # the run's k rows, repeated for every mask
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == self.k != rows:
                return value.repeat(rows // self.k, *([1] * (value.dim() - 1)))
            if isinstance(value, tuple):
                return tuple(batched(v) for v in value)
            return value

        args = (dummy, *(batched(a) for a in args[1:])) if args else ()
        kwargs = {name: None if name in self.CACHES else batched(value) for name, value in kwargs.items()}
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = dummy
        taken: dict[str, torch.Tensor] = {}

        def out_proj(z: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            taken["z"] = z
            return z

        fed = {name: returning(value.to(self.dtype)) for name, value in widened(self.adapter, q, k, v).items()}
        stand_in = Ungrouped(module, envoy, {**fed, self.adapter.out_proj: out_proj, **Ungrouped.counts(module, self.adapter)})
        Ungrouped.forward(module)(stand_in, *args, **kwargs)
        return taken["z"].float().reshape(rows, T, -1)
