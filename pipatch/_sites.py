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

from dataclasses import dataclass
from typing import Any

from ._models import Adapter, PipatchError, _get, first

__all__ = ["Site", "site", "SITES", "RESID", "ATTN", "MLP", "HEAD", "projection"]


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
