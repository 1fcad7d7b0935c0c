"""Sites: the places in a model where pipatch reads and writes activations.

A site is one small object that owns everything pipatch knows about a place, so that no other
module compares site names (``tests/unit/test_site_names.py`` holds them to it):

* **which module holds it** (:attr:`Site.holder`), reached through the
  :class:`~pipatch._model.models.Adapter` so it never spells a family's module names
  (:meth:`Site.module_path`, :meth:`Site.module`, :meth:`Site.value`): a block's output, a
  sublayer's output, the attention output projection's input, a query/key/value projection's
  output;
* **when** the forward pass computes it within a block (:attr:`Site.order`): nnsight serves a
  module's values only in forward order, so a patched run reads and writes sites sorted by
  ``(layer, order)``; and which layer a patched run must start at (:meth:`Site.start_layer`);
* **its shape**: the named dimensions of its value (:attr:`Site.dims`) and so what an op's index
  into it means (:meth:`Site.index`: positions on the position dimension, a head's part on the
  width or head dimension);
* **its column axis**: a grid over a site has one column per position, or one per head
  (:attr:`Site.axis`, :attr:`Site.per_head`), with labels to match (:meth:`Site.columns`).

Every site of today is ``[batch, T, width]``:

==========  ===================================================  ==========  =========
name        value                                                axis        order
==========  ===================================================  ==========  =========
``q/k/v``   a query / key / value projection's output columns    token       0 / 1 / 2
``head``    ``z``: the attention output projection's *input*     head        3
``attn``    the attention sublayer's output (its contribution)   token       4
``mlp_in``  the MLP's *input* (its normed residual; circuits)     —           5
``mlp``     the MLP sublayer's output (its contribution)         token       6
``resid``   the block's output: the residual stream after it     token       7
==========  ===================================================  ==========  =========

Three kin are no grid's sites: the embedding output (:data:`EMBED`, where causal tracing adds
its noise), the MLP's input (:data:`MLP_IN`) and the final norm's input (:data:`LOGITS`). With
:data:`HEAD` and :data:`MLP` they are the kinds of a circuit's nodes (:mod:`pipatch._model.graph`),
which code tells apart by identity (``node.site is HEAD``), never by a name.

A head ``h`` is the slice ``[h·head_dim, (h+1)·head_dim)`` of ``z``'s width; a GQA model's ``z``
still has one slice per *query* head.

**A new site is one new instance here.** An attention pattern, say, would be
``Site("pattern", order=..., holder=..., axis=HEAD_AXIS, dims=(BATCH, HEADS, POSITION, KEY))``:
its value is ``[batch, heads, query, key]``, the query being the position the row belongs to
(so :attr:`Site.position_dim` is 2, and an op's first and last positions are read there), and a
head is a dimension of its own rather than a slice of the width (:meth:`Site.head_index` indexes
it directly). Nothing assumes a width: only ``z``-like sites, whose heads sit side by side in
the width, cut it into head slices. What it would still need is a module to read the weights
from (the attention's softmax output, which not every family's attention returns): a new
:attr:`Site.holder` and its line in :meth:`Site.module_path` / :meth:`Site.value`.

Reading and writing: the contract
---------------------------------

A backend never indexes a module's value itself. Inside its trace it hands each site a
:class:`Place`: the live value of the site's *holder* (the module output or input the site
lives in) at one layer, for the rows of one invoke, ``[rows, T, width]`` on every backend
(vLLM's ``[T, width]`` is viewed with a batch dimension; its block output, a ``(hidden,
residual)`` pair, is one place whose value is their sum). The site then reads and writes
through it (:meth:`Site.apply`, :meth:`Site.read`), and that is the one place ops meet
module values.

Most sites read the holder's value as it is, so an op writes or adds at its index into the
live value (:meth:`Place.apply`). A site may instead **encode**: its value is a function of
the holder's (:meth:`Site.encode`), and a write goes back through its **decode**
(:meth:`Site.decode`) *plus what the decoder misses*::

    raw' = raw + decode(edited) − decode(encode(raw))

so an unedited write adds exactly zero and the run is the plain run. Reading (a capture, a
recording op) returns ``encode(raw)``. An op's index means the same on the encoded value
(positions on its position dimension, a slice of its width); the position axis is the
site's (:attr:`Site.dims`), never assumed to be dimension 1.

The example the contract is written for is a sparse autoencoder's latents at a layer's
residual stream: ``encode(x) = JumpReLU(x W_enc + b_enc)`` ([rows, T, n_latents]) and
``decode(f) = f W_dec + b_dec``; patching latent ``i`` at position ``p`` writes
``x + (f' − f)[p, i] · W_dec[i]`` into the block output, and the SAE's reconstruction error
stays in the stream. A new site of this kind is one subclass of :class:`Site` overriding
:meth:`~Site.encode` and :meth:`~Site.decode` (with the holder of the value it reads:
``holder="block"`` for the residual stream), in any module: no backend, engine or protocol
changes (``tests`` build one in a temporary module and patch with it on two backends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .models import Adapter, PipatchError, _get, first

__all__ = ["Site", "Place", "TensorPlace", "site", "SITES", "RESID", "ATTN", "MLP", "HEAD", "EMBED", "MLP_IN", "LOGITS",
           "QKV", "projection", "axis_of", "TOKEN_AXIS", "HEAD_AXIS", "BATCH", "POSITION", "WIDTH", "HEADS", "KEY"]

#: Column axes: what one grid column over a site is. A result records its own as ``col_axis``.
TOKEN_AXIS = "token"  # a prompt position (or, in a dataset, a named group of positions)
HEAD_AXIS = "head"  # one attention head

#: Names of a site value's dimensions (:attr:`Site.dims`).
BATCH, POSITION, WIDTH, HEADS, KEY = "batch", "position", "width", "heads", "key"

#: What a query head reads, by the names receivers use (``("head", layer, h, "q")``).
QKV = ("q", "k", "v")

# The modules that can hold a site (:attr:`Site.holder`).
_BLOCK, _ATTN, _MLP, _OUT_PROJ, _PROJ, _EMBEDDING = "block", "attn", "mlp", "out_proj", "proj", "embed"
_MLP_IN, _FINAL_NORM = "mlp_in", "final_norm"
_ALL = slice(None)  # an index part that takes the whole dimension


class Place(Protocol):
    """A site holder's live value at one layer, inside a backend's trace (see the module
    docstring's contract). ``rows`` is the backend's selector of one job's rows (and, in a
    packed trace, its span of positions); ``index`` an op's index into those rows' value."""

    def read(self, rows: Any) -> torch.Tensor:
        """The value at ``rows``, ``[rows, T, width]`` (live where the backend can)."""
        ...

    def apply(self, op: Any, rows: Any, index: tuple) -> torch.Tensor | None:
        """``op`` at ``rows``, ``index``: write, add, or (a recording op) a copy of what is there."""
        ...

    def add(self, rows: Any, delta: torch.Tensor) -> None:
        """Add ``delta`` (``[rows, T, width]``) to the value at ``rows``."""
        ...


class TensorPlace:
    """A :class:`Place` over one live tensor, ``[rows, T, width]``: a module's output or input
    in a trace (an nnsight value), or a state a backend holds (a cached block output)."""

    def __init__(self, value: Any):
        self.value = value

    def read(self, rows: Any) -> torch.Tensor:
        return self.value[rows]

    def apply(self, op: Any, rows: Any, index: tuple) -> torch.Tensor | None:
        return op.apply(self.value[rows], index)

    def add(self, rows: Any, delta: torch.Tensor) -> None:
        where = self.value[rows]
        where += delta.to(where.dtype)


@dataclass(frozen=True)
class Site:
    """One kind of place a patch reads or writes.

    Attributes
    ----------
    name
        What researchers call it: ``"resid"``, ``"attn"``, ``"mlp"``, ``"head"``, or a q/k/v
        projection module's name (``"q_proj"``, GPT-2's fused ``"c_attn"``). Results record it
        (``meta["site"]``) and captures key values by it; code outside this module only looks
        names up (:func:`site`, :func:`axis_of`), never compares them.
    order
        Position in the forward pass within one block (see the module docstring).
    holder
        Which module holds it: ``"block"`` (its output), ``"attn"`` / ``"mlp"`` (the sublayer's
        output), ``"out_proj"`` (the attention output projection's *input*), ``"mlp_in"`` (the
        MLP's *input*), ``"proj"`` (the output of the projection module under the attention
        called :attr:`name`); and, for the kin no grid sweeps, ``"embed"`` (the embedding
        output) and ``"final_norm"`` (the final norm's *input*).
    axis
        :data:`TOKEN_AXIS` or :data:`HEAD_AXIS`: what one grid column over this site is (a
        position, or a head).
    sublayer
        Whether the site sits inside a block's sublayers (refused for families whose sublayers
        return the residual stream plus their contribution, such as BLOOM).
    dims
        The named dimensions of the site's value: ``(BATCH, POSITION, WIDTH)`` for every site
        of today, ``(BATCH, HEADS, POSITION, KEY)`` for an attention pattern. An op's index
        (:meth:`index`) has one part per dimension, trailing whole ones left out.
    about
        One line on what the value is, for the scripts ``Result.code()`` writes.
    """

    name: str
    order: int
    holder: str
    axis: str = TOKEN_AXIS
    sublayer: bool = True
    dims: tuple[str, ...] = (BATCH, POSITION, WIDTH)
    about: str = ""

    @property
    def where(self) -> str:
        """Deprecated: :attr:`holder` under its old name (``where`` now only names a variable
        holding a site); kept, read-only, for code not yet moved to :attr:`holder`."""
        return self.holder

    # -- what a column and an index mean ----------------------------------------------------
    @property
    def per_head(self) -> bool:
        """Whether a grid column over this site is one head (else one position)."""
        return self.axis == HEAD_AXIS

    @property
    def per_position(self) -> bool:
        """Whether a grid column over this site is one position (or a group of them)."""
        return self.axis == TOKEN_AXIS

    @property
    def position_dim(self) -> int:
        """Which dimension of the value is the prompt position (a pattern's: the query)."""
        return self.dims.index(POSITION)

    def index(self, positions: Any, width: Any = None, head: int | None = None) -> tuple:
        """The index an op uses into this site's value: ``positions`` on the position
        dimension, ``width`` (a slice of the columns) on the width one, ``head`` on a head
        dimension; every other dimension whole, trailing whole ones left out:
        ``(slice(None), 4)`` is position 4 of a ``[batch, T, width]`` value."""
        wanted = {POSITION: positions, WIDTH: width, HEADS: head}
        parts = [_ALL if wanted.get(dim) is None else wanted[dim] for dim in self.dims]
        while len(parts) > 1 and parts[-1] is _ALL:
            parts.pop()
        return tuple(parts)

    def head_index(self, adapter: Adapter, head: int, positions: Any) -> tuple:
        """The index of head ``head``'s part at ``positions``: its slice of the width
        (``z``: the heads side by side), or its entry on a head dimension (a pattern)."""
        if HEADS in self.dims:
            return self.index(positions, head=head)
        return self.index(positions, width=self.head_slice(adapter, head))

    def column_index(self, adapter: Adapter, col: int, columns: Sequence[Any], positions: Any) -> tuple:
        """The index grid column ``col`` writes: head ``col`` at ``positions`` (a head axis),
        or the position(s) ``columns[col]`` (a token axis)."""
        if self.per_head:
            return self.head_index(adapter, col, positions)
        return self.index(columns[col])

    def window_layers(self, row: int, window: int, n_layers: int) -> range:
        """The layers a cell of grid row ``row`` writes: ``window`` of them from ``row`` on
        (clipped to the model), or row ``row`` alone on a head site (one head, one layer)."""
        return range(row, row + 1 if self.per_head else min(row + window, n_layers))

    def head_slice(self, adapter: Adapter, head: int) -> slice:
        """The columns of head ``head`` in this site's width (``head`` sites only)."""
        lo = head * adapter.head_dim
        return slice(lo, lo + adapter.head_dim)

    def columns(self, adapter: Adapter, tokens: list[str], positions: list[int]) -> list[str]:
        """Column labels of a grid over this site: the swept tokens, or ``H0, H1, ...``."""
        if self.per_head:
            return [self.head_label(h) for h in range(adapter.n_heads)]
        return [tokens[p] for p in positions]

    @staticmethod
    def head_label(head: int) -> str:
        """A head's column label: ``"H3"``."""
        return f"H{head}"

    # -- where it sits in the forward pass ----------------------------------------------------
    @property
    def is_block_output(self) -> bool:
        """Whether the value is a block's whole output (the residual stream after it), which a
        backend may skip the block with, rather than a value the block computes inside."""
        return self.holder == _BLOCK

    @property
    def is_embedding(self) -> bool:
        """Whether the value is the embedding output: what block 0 reads (:data:`EMBED`)."""
        return self.holder == _EMBEDDING

    @property
    def reads_input(self) -> bool:
        """Whether the value is its module's *input* (``z``, read before the output
        projection; the MLP's normed input; the final norm's) rather than its output."""
        return self.holder in (_OUT_PROJ, _MLP_IN, _FINAL_NORM)

    def start_layer(self, layer: int) -> int:
        """The first layer whose input a write at ``layer`` can change: a block output's write
        leaves that block's own computation the base run's, so a patched run may start above
        it; a site inside the block starts at the block."""
        return layer + 1 if self.is_block_output else layer

    @property
    def feeds_its_own_attention(self) -> bool:
        """Whether a write here reaches later positions within its own layer: a query, key or
        value does (the layer's attention reads it); every other site comes after the
        attention has mixed positions, so its write at position ``p`` stays at ``p`` until the
        next layer."""
        return self.holder == _PROJ

    # -- module access ------------------------------------------------------------------------
    @property
    def place_key(self) -> Any:
        """What a trace caches this site's :class:`Place` by (one fetch of the holder per
        layer): the site's name. Sites that read one holder alike share a key (an SAE's
        latents and its error: nnsight serves a module's value once, in forward order)."""
        return self.name

    def check(self, adapter: Adapter) -> Site:
        """Refuse, in one line, a site this family cannot patch; return the site."""
        if self.sublayer and not adapter.sublayers_are_contributions:
            raise PipatchError(
                f"site {self.name!r} is not supported for {adapter.family}: its sublayers return the residual "
                "stream plus their contribution; use site='resid'"
            )
        return self

    def module_path(self, adapter: Adapter) -> str:
        """The dotted path of the module holding this site, under a block (``""``: the block)."""
        return {
            _BLOCK: "",
            _ATTN: adapter.attn,
            _MLP: adapter.mlp,
            _MLP_IN: adapter.mlp,
            _OUT_PROJ: f"{adapter.attn}.{adapter.out_proj}",
            _PROJ: f"{adapter.attn}.{self.name}",
        }[self.holder]  # the embedding (no block's) overrides module(): see _Embedding

    def module(self, adapter: Adapter, model: Any, layer: int) -> Any:
        """The module (nnsight envoy or torch module) that holds this site at ``layer``."""
        block = adapter.block(model, layer)
        path = self.module_path(adapter)
        return _get(block, path) if path else block

    def value(self, adapter: Adapter, model: Any, layer: int) -> Any:
        """The holder's value at ``layer`` inside a trace (:attr:`dims`), readable and writable:
        what a backend wraps in a :class:`Place` (an encoding site's value is
        :meth:`encode` of it)."""
        module = self.module(adapter, model, layer)
        return module.input if self.reads_input else first(module.output)

    # -- reading and writing (the module docstring's contract) --------------------------------
    def encode(self, raw: torch.Tensor) -> torch.Tensor:
        """The site's value from its holder's, ``[rows, T, width_raw] → [rows, T, width]``: the
        holder's value itself for every built-in site. An encoding site overrides it and
        :meth:`decode`."""
        return raw

    def decode(self, value: torch.Tensor) -> torch.Tensor:
        """The holder's value a site value stands for (:meth:`encode`'s inverse, up to what it
        misses): only differences of two decodes are ever written."""
        return value

    @property
    def encodes(self) -> bool:
        """Whether the value ops see is computed from the holder's (:meth:`encode` overridden)."""
        return type(self).encode is not Site.encode

    def read(self, place: Place, rows: Any) -> torch.Tensor:
        """A copy of the site's value at ``rows`` of ``place`` (``[rows, T, width]``)."""
        raw = place.read(rows)
        return (self.encode(raw) if self.encodes else raw).clone()

    def apply(self, op: Any, place: Place, rows: Any, index: tuple) -> torch.Tensor | None:
        """Apply ``op`` (write, add, or record) to this site's value at ``rows`` of ``place``.

        A plain site applies it to the live value. An encoding site encodes the rows, applies
        the op to a copy of the encoded value, and adds ``decode(edited) − decode(value)`` to
        the holder: a recording op, or a write of the value already there, changes nothing.
        """
        if not self.encodes:
            return place.apply(op, rows, index)
        value = self.encode(place.read(rows))
        if op.value is None:
            return value[index].clone()
        edited = value.clone()
        op.apply(edited, index)
        place.add(rows, self.decode(edited) - self.decode(value))
        return None

    def __repr__(self) -> str:
        return f"<site {self.name}>"


RESID = Site("resid", order=7, holder=_BLOCK, sublayer=False, about="the block's output: the residual stream")
ATTN = Site("attn", order=4, holder=_ATTN, about="what the attention sublayer adds")
MLP = Site("mlp", order=6, holder=_MLP, about="what the MLP sublayer adds")
HEAD = Site("head", order=3, holder=_OUT_PROJ, axis=HEAD_AXIS, about="z: every head's output, side by side")

#: The MLP's input: the normed residual its first projection reads. Not a grid's site: what a
#: circuit's MLP receiver reads (:mod:`pipatch._experiments.circuits`), recorded and written by
#: exact edge patches.
MLP_IN = Site("mlp_in", order=5, holder=_MLP_IN, about="the MLP's input (the normed residual it reads)")

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


def axis_of(name: Any) -> str:
    """The column axis of the site a result names (``meta["site"]``): a result holds site names
    as strings only. Anything not a sweepable site's name reads as :data:`TOKEN_AXIS`."""
    found = SITES.get(name) if isinstance(name, str) else None
    return found.axis if found is not None else TOKEN_AXIS


_PROJECTIONS: dict[str, Site] = {}


def projection(module_name: str, order: int) -> Site:
    """The output of the query/key/value projection module ``attn.<module_name>``.

    ``order`` is the module's place among the block's projections (q, k, v are computed in
    that order; a fused projection is one module, order 0).
    """
    key = f"{module_name}#{order}"
    if key not in _PROJECTIONS:
        _PROJECTIONS[key] = Site(module_name, order=order, holder=_PROJ, about="a query / key / value projection")
    return _PROJECTIONS[key]


@dataclass(frozen=True)
class _Embedding(Site):
    """The embedding module's output, as transformers defines it: what block 0 reads (Gemma's
    ``× √d`` included, which transformers applies inside the module). Not a grid's site; the
    place causal tracing's noise is added (an :class:`~pipatch._model.cells.Op` with ``add``). It
    sits before block 0: an op here has layer 0 and runs before every other op of the run."""

    def module(self, adapter: Adapter, model: Any, layer: int) -> Any:
        return adapter.embedding(model)


#: The embedding output (see :class:`_Embedding`); never in :data:`SITES`.
EMBED: Site = _Embedding("embed", order=-1, holder=_EMBEDDING, sublayer=False, about="the embedding output")


@dataclass(frozen=True)
class _Logits(Site):
    """The final norm's input: the residual stream after the last block, which the logits are
    read from. Not a grid's site, and no op reads or writes it: the kin of a site that a
    circuit's last receiver is (:mod:`pipatch._model.graph`), as :data:`EMBED` is its first sender."""

    def module(self, adapter: Adapter, model: Any, layer: int) -> Any:
        return _get(model, adapter.final_norm)


#: What the logits read (see :class:`_Logits`); never in :data:`SITES`.
LOGITS: Site = _Logits("logits", order=8, holder=_FINAL_NORM, sublayer=False,
                       about="the final norm's input: the residual stream the logits are read from")
