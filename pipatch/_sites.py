"""Sites: the places in a model where pipatch reads and writes activations.

A site is one small object that knows

* **where** its value lives, through the :class:`~pipatch._models.Adapter` (so it never spells
  a module name): a block's output, a sublayer's output, the attention output projection's
  input, a query/key/value projection's output;
* **when** the forward pass computes it within a block (:attr:`Site.order`): nnsight serves a
  module's values only in forward order, so a patched run reads and writes sites sorted by
  ``(layer, order)``;
* its **column axis**: a grid over a site has one column per position, or one per head
  (:attr:`Site.axis`), with labels to match.

Every value of a site is ``[batch, T, width]``. The sites of today:

==========  ===================================================  ==========  =========
name        value                                                axis        order
==========  ===================================================  ==========  =========
``q/k/v``   a query / key / value projection's output columns    token       0 / 1 / 2
``head``    ``z``: the attention output projection's *input*     head        3
``attn``    the attention sublayer's output (its contribution)   token       4
``mlp``     the MLP sublayer's output (its contribution)         token       5
``resid``   the block's output: the residual stream after it     token       6
==========  ===================================================  ==========  =========

A head ``h`` is the slice ``[h·head_dim, (h+1)·head_dim)`` of ``z``; a GQA model's ``z`` still
has one slice per *query* head. Adding a site (an attention pattern, say) is one new instance
here; nothing else compares site names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._models import Adapter, PipatchError, _get, first

__all__ = ["Site", "site", "SITES", "RESID", "ATTN", "MLP", "HEAD", "EMBED", "projection"]


@dataclass(frozen=True)
class Site:
    """One kind of place a patch reads or writes.

    Attributes
    ----------
    name
        What researchers call it: ``"resid"``, ``"attn"``, ``"mlp"``, ``"head"``, ``"q"``, ...
    order
        Position in the forward pass within one block (see the module docstring).
    axis
        ``"token"`` or ``"head"``: what one grid column over this site is (a position, or a head).
    where
        Which module holds it: ``"block"`` (its output), ``"attn"`` / ``"mlp"`` (the sublayer's
        output), ``"out_proj"`` (the attention output projection's *input*), or ``"proj"``
        (the output of the projection module under the attention called :attr:`name`).
    sublayer
        Whether the site sits inside a block's sublayers (refused for families whose sublayers
        return the residual stream plus their contribution, such as BLOOM).
    """

    name: str
    order: int
    where: str
    axis: str = "token"
    sublayer: bool = True

    @property
    def feeds_its_own_attention(self) -> bool:
        """Whether a write here reaches later positions within its own layer: a query, key or
        value does (the layer's attention reads it); every other site comes after the
        attention has mixed positions, so its write at position ``p`` stays at ``p`` until the
        next layer."""
        return self.where == "proj"

    def check(self, adapter: Adapter) -> Site:
        """Refuse, in one line, a site this family cannot patch; return the site."""
        if self.sublayer and not adapter.sublayers_are_contributions:
            raise PipatchError(
                f"site {self.name!r} is not supported for {adapter.family}: its sublayers return the residual "
                "stream plus their contribution; use site='resid'"
            )
        return self

    def module(self, adapter: Adapter, model: Any, layer: int) -> Any:
        """The module (nnsight envoy or torch module) that holds this site at ``layer``."""
        block = adapter.block(model, layer)
        if self.where == "block":
            return block
        if self.where == "mlp":
            return _get(block, adapter.mlp)
        attn = _get(block, adapter.attn)
        if self.where == "attn":
            return attn
        return _get(attn, adapter.out_proj if self.where == "out_proj" else self.name)

    def value(self, adapter: Adapter, model: Any, layer: int) -> Any:
        """The site's value at ``layer`` inside a trace: [batch, T, width], readable and writable."""
        module = self.module(adapter, model, layer)
        return module.input if self.where == "out_proj" else first(module.output)

    def columns(self, adapter: Adapter, tokens: list[str], positions: list[int]) -> list[str]:
        """Column labels of a grid over this site: the swept tokens, or ``H0, H1, ...``."""
        if self.axis == "head":
            return [f"H{h}" for h in range(adapter.n_heads)]
        return [tokens[p] for p in positions]

    def head_slice(self, adapter: Adapter, head: int) -> slice:
        """The columns of head ``head`` in this site's width (``head`` sites only)."""
        lo = head * adapter.head_dim
        return slice(lo, lo + adapter.head_dim)

    def __repr__(self) -> str:
        return f"<site {self.name}>"

    # -- what the engine and the backends ask a site (they never compare its name) -----------
    @property
    def is_block_output(self) -> bool:
        """Whether the value is a block's whole output (the residual stream after it), which a
        backend may skip the block with, rather than a value the block computes inside."""
        return self.where == "block"

    @property
    def is_embedding(self) -> bool:
        """Whether the value is the embedding output: what block 0 reads (:data:`EMBED`)."""
        return self.where == "embed"

    def start_layer(self, layer: int) -> int:
        """The lowest block whose computation a write here at ``layer`` can change: the block
        above for a block's output (the block itself stays the base run's), else the block
        that computes the value."""
        return layer + 1 if self.is_block_output else layer

    def index(self, adapter: Adapter, col: int, columns: Sequence[Any], positions: Sequence[int]) -> tuple:
        """The op index of grid column ``col``: on a token site, the position (or list of
        them) ``columns[col]``; on a head site, head ``col``'s slice at ``positions``."""
        if self.axis == "head":
            return (slice(None), positions, self.head_slice(adapter, col))
        return (slice(None), columns[col])

    def window_layers(self, row: int, window: int, n_layers: int) -> range:
        """The layers a cell of grid row ``row`` writes: ``window`` of them from ``row`` on
        (clipped to the model), or row ``row`` alone on a head site (one head, one layer)."""
        return range(row, row + 1 if self.axis == "head" else min(row + window, n_layers))


RESID = Site("resid", order=6, where="block", sublayer=False)
ATTN = Site("attn", order=4, where="attn")
MLP = Site("mlp", order=5, where="mlp")
HEAD = Site("head", order=3, where="out_proj", axis="head")

#: The sites a grid can sweep, by name.
SITES: dict[str, Site] = {s.name: s for s in (RESID, ATTN, MLP, HEAD)}


def site(name: Any, adapter: Adapter | None = None) -> Site:
    """The :class:`Site` called ``name`` (checked against ``adapter``'s family when given)."""
    if isinstance(name, Site):
        found = name
    elif name in SITES:
        found = SITES[name]
    else:
        raise PipatchError(f"unknown site {name!r}: use one of {', '.join(SITES)}")
    return found.check(adapter) if adapter is not None else found


_PROJECTIONS: dict[str, Site] = {}


def projection(module_name: str, order: int) -> Site:
    """The output of the query/key/value projection module ``attn.<module_name>``.

    ``order`` is the module's place among the block's projections (q, k, v are computed in
    that order; a fused projection is one module, order 0).
    """
    key = f"{module_name}#{order}"
    if key not in _PROJECTIONS:
        _PROJECTIONS[key] = Site(module_name, order=order, where="proj")
    return _PROJECTIONS[key]


@dataclass(frozen=True)
class _Embedding(Site):
    """The embedding module's output, as transformers defines it: what block 0 reads (Gemma's
    ``× √d`` included, which transformers applies inside the module). Not a grid's site; the
    place causal tracing's noise is added (an :class:`~pipatch._cells.Op` with ``add``). It
    sits before block 0: an op here has layer 0 and runs before every other op of the run."""

    def module(self, adapter: Adapter, model: Any, layer: int) -> Any:
        return adapter.embedding(model)


#: The embedding output (see :class:`_Embedding`); never in :data:`SITES`.
EMBED: Site = _Embedding("embed", order=-1, where="embed", sublayer=False)
