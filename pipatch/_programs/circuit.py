"""A circuit's programs: the edge scores' factors, the baselines an ablated edge carries, and
the circuit runs.

* **Edge terms** (:data:`EDGE_TERMS`, a backward pass): each sender's write, clean minus
  corrupt, and each receiver's gradient, averaged over ``steps`` points from the corrupt input
  embeddings towards the clean ones (EAP-IG; ``steps=1``: EAP), one trace per point
  (:func:`edge_terms`). The math is :mod:`._edges`', run inside the trace through the model's
  envoys: every backend with backward passes runs it through its one path (this process, NDIF).
* **Baselines** (:data:`CIRCUIT_BASELINES`, capability ``circuit_runs``): what a run leaves
  that a circuit run reads (:class:`Baselines`): the clean run's embeddings, and mean
  ablation's means (:func:`circuit_means`, averaged in float64).
* **Circuit runs** (:data:`CIRCUIT_RUN`, capability ``circuit_runs``): the clean prompt run
  once per mask of edges, each receiver reading the corrupt (or mean) run's value at its place
  plus the writes of its kept senders in this run: the faithfulness curve's points
  (:func:`circuit_run_body`).

Both bodies are written once, against a :class:`CircuitView`: the transformers backend runs
them inside an nnsight trace of a run input (:mod:`pipatch._backends._hf_views`), the vLLM
backend (and so a served model) as one request per run input in the engine's worker
(:mod:`pipatch._backends._vllm_worker`).

**Grouped-query attention, ungrouped.** A grouped-query model shares a key/value head among a
group of query heads, but a circuit's key and value receivers belong to query heads: query
head ``h``'s key input is its own. A circuit run therefore runs each layer's attention with
one key/value head per query head (as EAP-IG does), fed from ``h``'s own input through the
columns of key/value head ``h // group``: :meth:`CircuitView.attention` calls the family's
own attention forward with an :class:`Ungrouped` stand-in for its module. So a mask is one
forward over its rows, and nothing crosses from one run (or request) to another.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, NamedTuple

import torch

from .._model.cells import Capture, Metric
from .._model.graph import graph
from .._model.models import Adapter, PipatchError, first
from .._model.sites import QKV
from ._edges import (
    ReceiverGradients,
    SenderValues,
    SenderWrites,
    check_circuit_family,
    head_writes,
    receiver_gradients,
    sender_writes,
)
from ._inputs import Floats, TokenIds, per_row
from ._program import Needs, Program, register_program

__all__ = ["EDGE_TERMS", "CIRCUIT_BASELINES", "CIRCUIT_RUN", "EdgeTermsRequest", "EdgePoint", "CircuitRunRequest",
           "BaselinesRequest", "MasksRequest", "check_circuit_runs", "Baselines",
           "CircuitView", "Ungrouped", "edge_terms", "circuit_baselines", "circuit_means", "circuit_runs",
           "baselines_body", "circuit_run_body", "widened", "returning", "GROUP_COUNTS"]


# --------------------------------------------------------------------------------------------
# Edge terms
# --------------------------------------------------------------------------------------------


#: What to do where a backend cannot score a circuit: score it elsewhere, check it here.
SCORE_ELSEWHERE = ("score it on backend='transformers' (the default) and check those here, "
                   "pipatch.circuit(..., scores=result)")


@dataclass
class EdgeTermsRequest:
    """The two factors of every edge score of one pair: its run inputs, its captures (sites
    ``head`` and ``mlp``) and the interpolation points of EAP-IG (:func:`edge_terms` runs
    :data:`EDGE_TERMS` once per point)."""

    clean_ids: torch.Tensor
    corrupt_ids: torch.Tensor
    metric: Metric
    clean: Capture
    corrupt: Capture
    steps: int


@dataclass
class EdgePoint:
    """:data:`EDGE_TERMS`' request: one point of EAP-IG on the line from the corrupt input
    embeddings to the clean ones — the corrupt run inputs ``ids`` ([n_inputs, T']) run with
    their embedding output moved ``alpha`` of the way to the clean inputs' (``clean_ids``); the
    receivers' gradients at the first ``prompt`` positions, and (``senders`` given: the two
    runs' writes) the senders' writes."""

    ids: TokenIds
    clean_ids: TokenIds
    metric: Metric
    alpha: float
    prompt: int
    senders: SenderValues | None = None


def edge_terms_body(view: Any, request: EdgePoint) -> tuple[tuple, SenderWrites | None]:
    """Inside a trace of the corrupt run inputs with gradients (:mod:`._edges`): the embedding
    output set to the point (the clean inputs' embedding output from the embedding module,
    called through its envoy), the receivers' gradients of that run, and the senders' writes
    where the request carries what they wrote."""
    model, adapter = view.model, view.adapter
    embedding = adapter.embedding(model)
    with torch.no_grad():
        e_clean = first(embedding(request.clean_ids))
        e_corrupt = embedding.output
        point = e_corrupt + request.alpha * (e_clean - e_corrupt)
    gradients = receiver_gradients(model, adapter, request.metric, point, request.prompt)
    writes = None if request.senders is None else sender_writes(model, adapter, request.senders)
    return gradients, writes


EDGE_TERMS = register_program(Program("edge_terms", 2, Needs(writes=True, backward=True, each_row=False,
                                                            instead=SCORE_ELSEWHERE), edge_terms_body,
                                      "a circuit's receiver gradients at one point (EAP / EAP-IG) and sender writes",
                                      inputs=EdgePoint))


# --------------------------------------------------------------------------------------------
# The view a circuit's bodies run through
# --------------------------------------------------------------------------------------------


class Baselines(NamedTuple):
    """What runs leave that a circuit run reads, float32, one row per run input (``n``):
    ``embedded`` [n, T, d], the embedding output; per layer ``[n, L, T, ...]``: ``x`` (the
    residual stream into the attention's norm), ``z`` (the heads' outputs, ``[..., H·head_dim]``),
    ``x_mid`` (the stream into the MLP's norm) and ``mlp`` (the MLP's output, before any
    post-norm); ``x_final`` [n, T, d], the stream into the final norm."""

    embedded: torch.Tensor
    x: torch.Tensor
    z: torch.Tensor
    x_mid: torch.Tensor
    mlp: torch.Tensor
    x_final: torch.Tensor


class CircuitView:
    """A backend's run of one batch of run inputs, as a circuit's bodies see it.

    Values are float32 ``[rows, T, width]``; a view casts what it hands a module to the
    module's dtype and what comes back to float32.

    **What the run computes**, read live in forward order (nnsight serves a module's values
    only in the order the forward pass computes them), ``[k, T, ...]`` for the trace's ``k``
    run inputs: :meth:`embedded`, then per layer :meth:`attn_in`, :meth:`z`, :meth:`mlp_in`
    (not in a parallel family: its MLP reads :meth:`attn_in`), :meth:`mlp_out`, and last
    :meth:`final_in`.

    **The model's modules**, called on any rows, away from the forward (the run's own visit of
    each is left untouched): the norms, :meth:`project` (one q/k/v projection module's whole
    output), :meth:`out_proj`, :meth:`mlp`, :meth:`logits` (the unembedding, soft-capped where
    the model caps), and :meth:`attention`: the layer's own attention on ungrouped inputs
    (:class:`Ungrouped`), which may read the layer's call live (its positions, its mask), so it
    is called between :meth:`attn_in` and :meth:`z` of its layer.
    """

    adapter: Adapter

    def carried(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a request's tensor: the clean run's embedding output) where and as the
        view computes with it."""
        return value

    # -- live values ------------------------------------------------------------------------
    def embedded(self) -> torch.Tensor:
        raise NotImplementedError

    def attn_in(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def z(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def mlp_in(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def mlp_out(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def final_in(self) -> torch.Tensor:
        raise NotImplementedError

    # -- module calls -------------------------------------------------------------------------
    def attn_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def project(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """Projection module ``attn.<name>`` (one of the adapter's ``qkv``) on ``x``: its whole
        output, bias included."""
        raise NotImplementedError

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The layer's attention with one key/value head per query head: queries, keys and
        values ``[rows, T, H·head_dim]`` (projected, before any q/k norm and the rotary
        embedding, which the family's forward applies) → ``z`` ``[rows, T, H·head_dim]``."""
        raise NotImplementedError

    def out_proj(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attn_post_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mlp_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mlp_post_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


#: The attention modules' counts of key/value heads (or query heads per key/value head), as
#: the families' forwards read them: an :class:`Ungrouped` stand-in says one key/value head
#: per query head in each its module has.
GROUP_COUNTS = {"num_key_value_groups": lambda a: 1, "num_key_value_heads": lambda a: a.n_heads,
                "num_kv_heads": lambda a: a.n_heads, "kv_size": lambda a: a.n_heads * a.head_dim}


class Ungrouped:
    """The ``self`` a family's attention forward is called with in a circuit run.

    Every attribute is the attention module's (its submodules called through ``envoy``, the
    module's nnsight envoy, where there is one: an ad-hoc call that leaves the trace's visit of
    them untouched; its methods bound to this stand-in), except ``overrides``: what makes the
    forward ungrouped (the projections returning the fed queries, keys and values, one
    key/value head per query head, :data:`GROUP_COUNTS`, the output projection handing back
    ``z``). Nothing is set on the module; what the forward sets on ``self`` stays here.
    """

    def __init__(self, module: Any, envoy: Any, overrides: dict[str, Any]):
        vars(self)["_stand_in_for"] = (module, envoy, overrides)

    def __getattr__(self, name: str) -> Any:
        module, envoy, overrides = vars(self)["_stand_in_for"]
        if name in overrides:
            return overrides[name]
        value = getattr(module, name)
        if isinstance(value, torch.nn.Module):
            return getattr(envoy, name) if envoy is not None else value
        function = inspect.getattr_static(type(module), name, None)
        if inspect.isfunction(function):
            return types.MethodType(function, self)
        return value

    @staticmethod
    def counts(module: Any, adapter: Adapter) -> dict[str, Any]:
        """:data:`GROUP_COUNTS` that ``module`` has, as an ungrouped attention reads them."""
        return {name: count(adapter) for name, count in GROUP_COUNTS.items() if hasattr(module, name)}

    @staticmethod
    def forward(module: Any) -> Callable[..., Any]:
        """The family's attention forward, unbound (its class's, not nnsight's instance wrapper)."""
        return type(module).forward


def returning(value: Any) -> Callable[..., Any]:
    """A module's stand-in in an :class:`Ungrouped` forward: returns ``value`` whatever it is
    called with."""
    return lambda *args, **kwargs: value


def widened(adapter: Adapter, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """What each q/k/v projection module (by name) returns in an ungrouped attention: its
    output laid out as if the model had one key/value head per query head (``q``, ``k``, ``v``:
    ``[..., H·head_dim]``). A layout pipatch cannot widen is refused in one line."""
    names, layout = adapter.qkv, adapter.qkv_layout
    if layout == "separate":
        return dict(zip(names, (q, k, v)))
    if layout == "stacked":
        return {names[0]: torch.cat([q, k, v], dim=-1)}
    if layout in ("per_head", "per_group"):  # [(q, k, v) × H]: a group of one query head
        heads = [t.unflatten(-1, (adapter.n_heads, adapter.head_dim)) for t in (q, k, v)]
        return {names[0]: torch.stack(heads, dim=-2).flatten(-3)}
    raise PipatchError(f"a circuit's runs cannot ungroup {adapter.family}'s attention (q/k/v layout {layout}): "
                       "measure the curve on backend='transformers' with tensor_parallel_size=1, or pass curve=0")


# --------------------------------------------------------------------------------------------
# The bodies
# --------------------------------------------------------------------------------------------


def baselines_body(view: CircuitView) -> Baselines:
    """What the trace's runs leave that a circuit run reads (:class:`Baselines`), read in
    forward order."""
    adapter = view.adapter
    embedded = view.embedded()
    x, z, x_mid, mlp = [], [], [], []
    for layer in range(adapter.n_layers):
        x.append(view.attn_in(layer))
        z.append(view.z(layer))
        x_mid.append(x[-1] if adapter.parallel else view.mlp_in(layer))
        mlp.append(view.mlp_out(layer))
    return Baselines(embedded, *(torch.stack(v, dim=1) for v in (x, z, x_mid, mlp)), view.final_in())


def circuit_run_body(view: CircuitView, metric: Metric, keep: torch.Tensor, embedded: torch.Tensor,
                     means: Baselines | None = None) -> torch.Tensor:
    """The clean prompt run as each circuit of ``keep`` ([P, receivers, senders], bool, in
    :func:`pipatch._model.graph.graph` order), on the view's ``k`` run inputs: the metric's pieces
    (:meth:`~pipatch._model.cells.Metric.pieces`), ``[P·k, n_read, n_sequences]``, row ``p·k + i``
    mask ``p`` on input ``i``.

    Each receiver reads its baseline value at its place plus what each kept edge's sender
    writes in *this* run minus what it wrote in the baseline run (Hanna et al.'s evaluation
    of a circuit). The baseline is the trace's own run (corrupt ablation: the view runs the
    corrupt inputs), or ``means`` (mean ablation, ``[1, ...]``: every input reads them).
    ``embedded`` ([k, T, d]) is the clean run inputs' embedding output: the embeddings are the
    senders that read the clean prompt. A sender none of whose inputs are kept writes what it
    wrote in the baseline, so an edge carries something only on a kept path from the
    embeddings. With no edge kept the run is the baseline run; with every edge kept it is the
    clean run wherever a layer's write is the sum of its heads' (every family but those that
    normalize the attention's output before adding it, Gemma 2 and 3, where each head's write
    is read with the others at their baseline values). Every position is read this way (a
    multi-token answer's too). Grouped-query attention runs ungrouped (module docstring).
    """
    adapter, edge_graph = view.adapter, graph(view.adapter)
    k, P = embedded.shape[0], keep.shape[0]
    B = P * k
    device = embedded.device
    keep = keep.to(device=device, dtype=torch.float32).repeat_interleave(k, dim=0)  # row b reads mask b // k

    def rows(value: torch.Tensor) -> torch.Tensor:
        """A baseline ([k, ...] or [1, ...]) for every row: row b reads input b % k."""
        return value.float().to(device).expand(k, *value.shape[1:]).repeat(P, *([1] * (value.dim() - 1)))

    baseline_embedded = view.embedded() if means is None else means.embedded
    deltas = torch.zeros(B, keep.shape[2], *embedded.shape[1:], device=device)  # [B, senders, T, d]
    deltas[:, edge_graph.emb] = rows(embedded) - rows(baseline_embedded)

    def fed(value: torch.Tensor, receivers: Any) -> torch.Tensor:
        """Each receiver's input: the baseline ``value`` plus its kept senders' writes → [B, r, T, d]."""
        return rows(value)[:, None] + torch.einsum("brs,bstd->brtd", keep[:, receivers], deltas)

    for layer in range(adapter.n_layers):
        x = view.attn_in(layer) if means is None else means.x[:, layer]
        normed = view.attn_norm(layer, fed(x, edge_graph.qkvs(layer)))  # [B, 3H, T, d]
        z = view.attention(layer, *_queries_keys_values(view, layer, normed))
        z_base = view.z(layer) if means is None else means.z[:, layer]
        post = (lambda y, layer=layer: view.attn_post_norm(layer, y)) if adapter.attn_post_norm else None
        write, each = head_writes(adapter, lambda y, layer=layer: view.out_proj(layer, y), post, z, rows(z_base))
        deltas[:, edge_graph.heads(layer)] = each - write[:, None]
        if adapter.parallel:  # the MLP reads the block's input, as the attention does
            x_mid = x
        else:
            x_mid = view.mlp_in(layer) if means is None else means.x_mid[:, layer]
        out = view.mlp(layer, view.mlp_norm(layer, fed(x_mid, [edge_graph.mlp_in(layer)])[:, 0]))
        mlp_base = view.mlp_out(layer) if means is None else means.mlp[:, layer]
        both = torch.cat([out, mlp_base.float().to(device)])
        if adapter.mlp_post_norm:
            both = view.mlp_post_norm(layer, both)
        deltas[:, edge_graph.mlp(layer)] = both[:B] - rows(both[B:])
    x_final = view.final_in() if means is None else means.x_final
    final = fed(x_final, [edge_graph.logits])[:, 0, -metric.n_read:]
    return metric.pieces(view.logits(view.final_norm(final)))


def _queries_keys_values(view: CircuitView, layer: int,
                         normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query head's query, key and value, ``[B, T, H·head_dim]`` each, from its receivers'
    normed inputs (``normed`` [B, 3H, T, d], head by head, each its q, k, v): receiver ``(h, w)``
    through the columns :meth:`~pipatch._model.models.Adapter.qkv_columns` gives (a key or value:
    those of key/value head ``h // group``), one call per projection module."""
    adapter = view.adapter
    H, hd = adapter.n_heads, adapter.head_dim
    out = {w: normed.new_empty(normed.shape[0], normed.shape[2], H * hd) for w in QKV}
    for name in adapter.qkv:
        mine = [(head, w, *adapter.qkv_columns(w, head)[1:]) for head in range(H) for w in QKV
                if adapter.qkv_columns(w, head)[0] == name]
        projected = view.project(layer, name, normed[:, [head * len(QKV) + QKV.index(w) for head, w, _, _ in mine]])
        for i, (head, w, lo, hi) in enumerate(mine):
            out[w][..., head * hd : (head + 1) * hd] = projected[:, i, :, lo:hi]
    return out["q"], out["k"], out["v"]


#: What to do where a backend cannot run a circuit's runs: measure the curve elsewhere.
CURVE_ELSEWHERE = "measure the curve on a local model (pipatch.load_model(name)), or pass curve=0"


@dataclass
class BaselinesRequest:
    """:data:`CIRCUIT_BASELINES`' request: the run inputs ``ids`` ([n, T]), one run per row."""

    ids: TokenIds


def baselines_program(view: Any, request: BaselinesRequest) -> list[Baselines]:
    """:data:`CIRCUIT_BASELINES`' body: :func:`baselines_body` of the trace's rows, each row's
    :class:`Baselines` apart (``[1, ...]``)."""
    rows = int(request.ids.shape[0])
    every = baselines_body(view.circuit_view(rows))
    return [Baselines(*(value[i : i + 1] for value in every)) for i in range(rows)]


@dataclass
class MasksRequest:
    """:data:`CIRCUIT_RUN`' request: the run inputs ``ids`` ([k, T]) run as each circuit of
    ``keep`` ([P, receivers, senders]), each row's clean embedding output ``embedded`` (one per
    row, ``[k, T, d]``), mean ablation's ``means`` (``None``: each row's own run is the
    baseline)."""

    ids: TokenIds
    metric: Metric
    keep: Annotated[torch.Tensor, Floats(dims=(3,), masks=True)]
    embedded: Annotated[torch.Tensor, Floats(dims=(3,), width=True)] = per_row()
    means: Baselines | None = None


def circuit_run_program(view: Any, request: MasksRequest) -> list[torch.Tensor]:
    """:data:`CIRCUIT_RUN`' body: :func:`circuit_run_body` on the trace's rows, each row's
    metric pieces apart: ``[P, n_read, n_sequences]`` per row."""
    rows, P = int(request.ids.shape[0]), request.keep.shape[0]
    circuit = view.circuit_view(rows)
    pieces = circuit_run_body(circuit, request.metric, request.keep, circuit.carried(request.embedded), request.means)
    pieces = pieces.reshape(P, rows, *pieces.shape[1:])  # row p·k + i: mask p on input i
    return [pieces[:, i] for i in range(rows)]


CIRCUIT_BASELINES = register_program(Program("circuit_baselines", 2, Needs(module_calls=True, instead=CURVE_ELSEWHERE),
                                             baselines_program, "what a circuit run reads of its baseline runs",
                                             inputs=BaselinesRequest, answers=(Baselines,)))
CIRCUIT_RUN = register_program(Program("circuit_run", 3, Needs(module_calls=True, instead=CURVE_ELSEWHERE),
                                       circuit_run_program,
                                       "the clean prompt run as circuits: each receiver fed its kept edges",
                                       inputs=MasksRequest))


def check_circuit_runs(adapter: Adapter) -> None:
    """Refuse, in one line, a family pipatch cannot run circuits of, or an engine that splits
    the layers' weights over ranks (a circuit's runs compute each receiver's input from the
    whole weights)."""
    check_circuit_family(adapter)
    if adapter.tp_ranks > 1:
        raise PipatchError(f"a circuit's runs compute each receiver's input from the layer's whole weights, which "
                           f"this engine splits over {adapter.tp_ranks} ranks: measure the curve on one rank "
                           "(tensor_parallel_size=1) or on backend='transformers', or pass curve=0")


# --------------------------------------------------------------------------------------------
# Requests, and running them
# --------------------------------------------------------------------------------------------


@dataclass
class CircuitRunRequest:
    """The clean prompt run as each circuit of ``keep`` ([P, receivers, senders], bool): the
    edges not kept carry the corrupt run's values, or with ``mean_of`` (run input ids of one
    length) their mean over those prompts.

    ``embedded`` (the clean run inputs' embedding output, [k, T, d]) and ``means`` (mean
    ablation's :func:`circuit_means`: given, they stand for ``mean_of``) are what
    :func:`circuit_runs` computes first where they are ``None``: a caller that runs many masks
    of one pair passes them, computed once."""

    clean_ids: torch.Tensor
    corrupt_ids: torch.Tensor
    metric: Metric
    keep: torch.Tensor
    mean_of: Sequence[torch.Tensor] | None = None
    embedded: torch.Tensor | None = None
    means: Baselines | None = None

    @property
    def mean_ablated(self) -> bool:
        return self.mean_of is not None or self.means is not None

    @property
    def run_ids(self) -> torch.Tensor:
        """The run inputs the runs' trace reads live: the corrupt run's (corrupt ablation), or
        the clean run's (mean ablation: any of the right length, for the positions and mask)."""
        return self.metric.inputs(self.clean_ids if self.mean_ablated else self.corrupt_ids)


def edge_terms(backend: Any, request: EdgeTermsRequest) -> tuple[SenderWrites, ReceiverGradients]:
    """Every edge score's two factors for one pair: :data:`EDGE_TERMS` at each of the
    ``steps`` points (``k / steps``, ``k = 0 … steps − 1``: a left Riemann sum from the corrupt
    end), the receivers' gradients averaged, the senders' writes taken in the first."""
    check_circuit_family(backend.adapter)
    metric, steps = request.metric, request.steps
    corrupt, clean = metric.inputs(request.corrupt_ids), metric.inputs(request.clean_ids)
    T, adapter = request.corrupt_ids.shape[1], backend.adapter
    qkv = torch.zeros(adapter.n_layers, adapter.n_heads, 3, T, adapter.d_model)
    mlps = torch.zeros(adapter.n_layers, T, adapter.d_model)
    logits = torch.zeros(T, adapter.d_model)
    values, writes = [], None
    for k in range(steps):
        senders = SenderValues.of(request.clean, request.corrupt) if k == 0 else None
        (q, m, lg, value), wrote = backend.run(EDGE_TERMS, EdgePoint(corrupt, clean, metric, k / steps, T, senders))
        qkv += q.cpu()
        mlps += m.cpu()
        logits += lg.cpu()
        values.append(value)
        writes = wrote if k == 0 else writes
    assert writes is not None  # steps >= 1
    writes = SenderWrites(*(t.cpu() for t in (writes.emb, writes.heads, writes.mlps)))
    return writes, ReceiverGradients(qkv=qkv / steps, mlps=mlps / steps, logits=logits / steps, metric=values)


def circuit_baselines(backend: Any, run_ids: torch.Tensor) -> Baselines:
    """:class:`Baselines` of the run inputs ``run_ids`` ([n, T]), one row each (:data:`CIRCUIT_BASELINES`),
    on the CPU."""
    CIRCUIT_BASELINES.check(backend)
    check_circuit_runs(backend.adapter)
    rows = backend.run(CIRCUIT_BASELINES, BaselinesRequest(run_ids.cpu()))
    return Baselines(*(torch.cat([row[i].cpu() for row in rows]) for i in range(len(Baselines._fields))))


def circuit_means(backend: Any, prompts: Sequence[torch.Tensor]) -> Baselines:
    """Mean ablation's baselines: :class:`Baselines` averaged, position by position, over every
    row of ``prompts`` (run input ids [n, T], every one the same length), in float64; ``[1, ...]``."""
    if not prompts:
        raise PipatchError("mean ablation needs at least one prompt to average over")
    every = circuit_baselines(backend, torch.cat([ids.cpu() for ids in prompts]))
    return Baselines(*(value.double().mean(0, keepdim=True).float() for value in every))


def circuit_runs(backend: Any, request: CircuitRunRequest) -> torch.Tensor:
    """The metric of each circuit of ``request.keep``, ``[P]`` (:data:`CIRCUIT_RUN`), its
    ``embedded`` and ``means`` computed first where the request has none."""
    if request.embedded is None:
        request = replace(request, embedded=circuit_baselines(backend, request.metric.inputs(request.clean_ids)).embedded)
    if request.mean_of is not None and request.means is None:
        request = replace(request, means=circuit_means(backend, request.mean_of))
    assert request.embedded is not None
    CIRCUIT_RUN.check(backend)
    check_circuit_runs(backend.adapter)
    pieces = backend.run(CIRCUIT_RUN, MasksRequest(request.run_ids.cpu(), request.metric, request.keep.cpu(),
                                                   request.embedded.cpu(), request.means))
    return request.metric.combine(torch.stack([p.cpu() for p in pieces], dim=1))  # [P, k, n_read, n_sequences]
