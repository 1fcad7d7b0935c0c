"""A circuit's graph: its nodes, its edges and every index into them, in one place.

A circuit (:mod:`pipatch._experiments.circuits`) scores the edges of one graph per model shape,
as in Hanna et al.'s EAP-IG:

* **senders** write to the residual stream: the embeddings (``emb``), each attention head's
  output (``12.2``: layer 12, head 2) and each MLP's output (``mlp12``);
* **receivers** read it: each head's query, key and value inputs, separately (``14.0.q``),
  each MLP's input (``mlp14``) and the logits (``logits``).

An edge runs from a sender to a receiver that reads after it writes: one in a later layer, or
a layer's MLP from the same layer's heads (not where attention and MLP read the same residual
side by side: GPT-NeoX, Falcon).

**Kinds.** A node's kind is its site or a kin of one (:mod:`pipatch._model.sites`), never a string:
:data:`~pipatch._model.sites.EMBED`, :data:`~pipatch._model.sites.HEAD` (a head's output; with ``which``,
one of its inputs: one of :data:`~pipatch._model.sites.QKV`), :data:`~pipatch._model.sites.MLP` (an MLP's
output), :data:`~pipatch._model.sites.MLP_IN` (its input) and :data:`~pipatch._model.sites.LOGITS`. Code
asks ``node.site is HEAD``; ``tests/unit/test_graph.py`` fails on a node-kind string compared
anywhere else.

**Names** are what results, their files and the browser hold. They are made here and read
back here alone: :func:`named` gives the nodes of a result's names, of this pipatch's files or
an earlier one's.

**Order and indices.** Senders: the embeddings, then layer by layer each head (by number) and
the MLP. Receivers: layer by layer each head's q, k, v (head by head) and the MLP's input,
then the logits. A :class:`Graph` answers every index into that order (:meth:`Graph.head`,
:meth:`Graph.qkv`, ...), which the programs that run a circuit (:mod:`pipatch._programs._edges`,
:mod:`pipatch._programs.circuit`) read rather than compute, and stacks a run's sender writes and receiver
gradients in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .models import PipatchError
from .sites import EMBED, HEAD, LOGITS, MLP, MLP_IN, QKV, Site

__all__ = ["Node", "Graph", "graph", "named", "LOGITS_NAME", "EMB_DRAWN", "HEAD_DRAWN", "MLP_DRAWN", "LOGITS_DRAWN"]

#: The logits receiver's name (path patching's ``receivers="logits"``, its direct path, too).
LOGITS_NAME = "logits"
_EMB_NAME = "emb"

#: What the views draw a node as: the view state's node ``kind``, which ``js/circuit.ts``
#: reads. A head's output and its q/k/v inputs are one node, an MLP's output and input another.
EMB_DRAWN, HEAD_DRAWN, MLP_DRAWN, LOGITS_DRAWN = "emb", "head", "mlp", "logits"
_DRAWN = {EMBED: EMB_DRAWN, HEAD: HEAD_DRAWN, MLP: MLP_DRAWN, MLP_IN: MLP_DRAWN, LOGITS: LOGITS_DRAWN}


def _head_name(layer: int, head: int) -> str:
    return f"{layer}.{head}"


def _mlp_name(layer: int) -> str:
    return f"mlp{layer}"


@dataclass(frozen=True)
class Node:
    """A sender or a receiver of the graph.

    Attributes
    ----------
    name
        ``"emb"``, ``"12.2"``, ``"mlp12"``, ``"14.0.q"`` or ``"logits"`` (module docstring).
    site
        What it is: :data:`~pipatch._model.sites.EMBED`, :data:`~pipatch._model.sites.HEAD` or
        :data:`~pipatch._model.sites.MLP` (senders); ``HEAD`` with :attr:`which`,
        :data:`~pipatch._model.sites.MLP_IN` or :data:`~pipatch._model.sites.LOGITS` (receivers).
    layer
        Its layer: ``-1`` for the embeddings, the number of layers for the logits.
    head
        The query head of a head's output or input; ``None`` elsewhere.
    which
        A head input's ``"q"``, ``"k"`` or ``"v"``; ``None`` elsewhere.
    """

    name: str
    site: Site
    layer: int
    head: int | None = None
    which: str | None = None

    @property
    def drawn(self) -> str:
        """The kind of node the views draw it as (:data:`HEAD_DRAWN`, ...)."""
        return _DRAWN[self.site]

    @property
    def drawn_name(self) -> str:
        """The name of the node the views draw it in: a head's input is drawn on its head's
        node (``"14.0.q"`` on ``"14.0"``), an MLP's input on its MLP's; any other is its own."""
        if self.which is not None and self.head is not None:
            return _head_name(self.layer, self.head)
        return self.name


def _nodes(n_layers: int, n_heads: int) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
    """``(senders, receivers)`` in graph order: the same for every graph of this shape."""
    senders = [Node(_EMB_NAME, EMBED, -1)]
    receivers = []
    for layer in range(n_layers):
        senders += [Node(_head_name(layer, h), HEAD, layer, h) for h in range(n_heads)]
        senders.append(Node(_mlp_name(layer), MLP, layer))
        receivers += [Node(f"{_head_name(layer, h)}.{w}", HEAD, layer, h, w) for h in range(n_heads) for w in QKV]
        receivers.append(Node(_mlp_name(layer), MLP_IN, layer))
    receivers.append(Node(LOGITS_NAME, LOGITS, n_layers))
    return tuple(senders), tuple(receivers)


class Graph:
    """The circuit graph of a model of ``n_layers`` layers and ``n_heads`` query heads;
    ``parallel``: its attention and MLP read the same residual, so a layer's heads do not feed
    its MLP. Made once per shape by :func:`graph`, and shared: never written to.

    Attributes
    ----------
    senders, receivers
        The nodes (:class:`Node`) in graph order (module docstring).
    valid
        ``valid[r, s]``: whether sender ``s`` writes before receiver ``r`` reads, bool
        [receivers, senders].
    """

    #: The embeddings' sender index.
    emb = 0

    def __init__(self, n_layers: int, n_heads: int, parallel: bool):
        self.n_layers, self.n_heads, self.parallel = n_layers, n_heads, parallel
        self.senders, self.receivers = _nodes(n_layers, n_heads)

    def __repr__(self) -> str:
        return (f"<pipatch graph {self.n_layers} layers × {self.n_heads} heads{', parallel' if self.parallel else ''}: "
                f"{len(self.senders)} senders, {len(self.receivers)} receivers>")

    # -- counts -----------------------------------------------------------------------------
    @property
    def senders_per_layer(self) -> int:
        """A layer's senders: its heads' outputs and its MLP's."""
        return self.n_heads + 1

    @property
    def receivers_per_layer(self) -> int:
        """A layer's receivers: each head's q, k and v inputs and its MLP's input."""
        return len(QKV) * self.n_heads + 1

    # -- sender indices -----------------------------------------------------------------------
    def head(self, layer: int, head: int) -> int:
        """The sender index of head ``head``'s output at ``layer``."""
        return self.emb + 1 + layer * self.senders_per_layer + head

    def heads(self, layer: int) -> slice:
        """The sender indices of ``layer``'s heads, head by head."""
        first = self.head(layer, 0)
        return slice(first, first + self.n_heads)

    def mlp(self, layer: int) -> int:
        """The sender index of ``layer``'s MLP output (after its heads')."""
        return self.head(layer, self.n_heads)

    # -- receiver indices ---------------------------------------------------------------------
    def qkvs(self, layer: int) -> slice:
        """The receiver indices of ``layer``'s head inputs: head by head, each its q, k, v."""
        first = layer * self.receivers_per_layer
        return slice(first, first + len(QKV) * self.n_heads)

    def qkv(self, layer: int, head: int, which: str) -> int:
        """The receiver index of head ``head``'s input ``which`` (one of
        :data:`~pipatch._model.sites.QKV`) at ``layer``."""
        return self.qkvs(layer).start + head * len(QKV) + QKV.index(which)

    def mlp_in(self, layer: int) -> int:
        """The receiver index of ``layer``'s MLP input (after its heads' inputs)."""
        return self.qkvs(layer).stop

    @property
    def logits(self) -> int:
        """The logits' receiver index: the last."""
        return self.n_layers * self.receivers_per_layer

    # -- edges ---------------------------------------------------------------------------------
    @property
    def valid(self) -> torch.Tensor:
        """Bool [receivers, senders]: sender ``s`` writes before receiver ``r`` reads (made once:
        kept in the instance, as a plain property can travel to NDIF by value)."""
        if "_valid" not in vars(self):
            self._valid = self._edges_valid()
        return self._valid

    def _edges_valid(self) -> torch.Tensor:
        sender_layer = torch.tensor([s.layer for s in self.senders])
        receiver_layer = torch.tensor([r.layer for r in self.receivers])
        valid = sender_layer[None, :] < receiver_layer[:, None]
        if not self.parallel:  # a layer's heads write before its MLP reads
            heads = torch.tensor([s.site is HEAD for s in self.senders])
            mlp_inputs = torch.tensor([r.site is MLP_IN for r in self.receivers])
            valid |= (sender_layer[None, :] == receiver_layer[:, None]) & heads[None, :] & mlp_inputs[:, None]
        return valid

    # -- a run's terms in graph order ----------------------------------------------------------
    def stack_writes(self, writes: Any) -> torch.Tensor:
        """Every sender's write in graph order, [senders, T, d], from a run's writes by kind:
        ``emb`` [T, d], ``heads`` [L, H, T, d], ``mlps`` [L, T, d]
        (:class:`~pipatch._programs._edges.SenderWrites`)."""
        rows = [writes.emb[None]]
        for layer in range(self.n_layers):
            rows += [writes.heads[layer], writes.mlps[layer][None]]
        return torch.cat(rows)

    def stack_gradients(self, gradients: Any) -> torch.Tensor:
        """Every receiver's gradient in graph order, [receivers, T, d], from a run's gradients
        by kind: ``qkv`` [L, H, 3, T, d], ``mlps`` [L, T, d], ``logits`` [T, d]
        (:class:`~pipatch._programs._edges.ReceiverGradients`)."""
        rows = []
        for layer in range(self.n_layers):
            rows += [gradients.qkv[layer].flatten(0, 1), gradients.mlps[layer][None]]
        return torch.cat(rows + [gradients.logits[None]])


#: Each shape's graph, made once. (A dict, not an ``lru_cache``: a program's body that reads
#: the graph travels to NDIF by value, and a memo object would travel by name, to a server
#: that has no pipatch.)
_GRAPHS: dict[tuple[int, int, bool], Graph] = {}


def graph(adapter: Any) -> Graph:
    """The graph of a model: of ``adapter``'s ``n_layers``, ``n_heads`` and ``parallel`` (an
    :class:`~pipatch._model.models.Adapter`, or anything with the three)."""
    key = (int(adapter.n_layers), int(adapter.n_heads), bool(adapter.parallel))
    if key not in _GRAPHS:
        _GRAPHS[key] = Graph(*key)
    return _GRAPHS[key]


def named(senders: Sequence[str], receivers: Sequence[str]) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
    """The nodes a circuit result's names stand for: ``(senders, receivers)`` of the graph
    whose names they are, every one in order (a result's ``columns`` and ``layers``; a file's,
    written by this pipatch or an earlier one).

    Raises :class:`~pipatch._model.models.PipatchError` where they are no graph's names.
    """
    # A graph of L layers and H heads has 1 + L(H + 1) senders and 1 + L(3H + 1) receivers.
    twice_layers = 3 * (len(senders) - 1) - (len(receivers) - 1)
    n_layers = twice_layers // 2
    if n_layers > 0 and twice_layers % 2 == 0 and (len(senders) - 1) % n_layers == 0:
        nodes = _nodes(n_layers, (len(senders) - 1) // n_layers - 1)
        if [n.name for n in nodes[0]] == list(senders) and [n.name for n in nodes[1]] == list(receivers):
            return nodes
    raise PipatchError(f"these {len(senders)} senders and {len(receivers)} receivers are not a circuit graph's "
                       "nodes (emb, LAYER.HEAD, mlpLAYER; LAYER.HEAD.q|k|v, mlpLAYER, logits): make the result "
                       "with pipatch.circuit")
