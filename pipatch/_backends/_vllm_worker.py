"""What runs inside a vLLM request, in the engine's worker: the view a program's body sees,
and the request bodies.

Module-level functions, shipped by reference with each invoke (nnsight pickles an invoke's
body for the workers), taking the model and small per-job data; what they return travels back
on the CPU as named tuples (:class:`CaptureOut`, :class:`PatchOut`). Inside a request a
module's value is the request's rows, ``[T, width]``, with no batch dimension:
:class:`RequestView` shows it to a program as ``[1, T, width]`` (a view), so an op's index
means the same as on the transformers backend. Where vLLM differs from transformers:

* **The residual stream.** A decoder layer returns ``(hidden, residual)``, and the stream
  after the block is their sum (the next layer's fused add-norm adds them): one place
  (:class:`PairPlace`) whose value is the sum; a write puts the value into ``residual`` and
  zeros into ``hidden`` at the written positions, so the sum is the written value exactly.
* **Embeddings.** Some vLLM models scale the embedding *after* the embedding module (Gemma:
  ``× √d``), where transformers scales inside it. The embedding site
  (:data:`~pipatch._sites.EMBED`) is the embedding output as transformers defines it, so here
  it is block 0's input (:func:`_block_input`).
* **Logits.** vLLM computes logits at the last position only; for more (a multi-token answer,
  read teacher-forced) the final norm's output at those positions goes through the model's
  own ``compute_logits`` (:func:`_read_logits`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._cells import Metric, Op
from .._compat.nnsight import name_worker_tree, torch_module
from .._graph import graph
from .._models import TREE_ID, Adapter, _get, first
from .._programs._edges import head_writes
from .._programs._program import View
from .._programs.capture import capture_body
from .._programs.patch import patch_body
from .._sites import HEAD, QKV, Place, Site, TensorPlace

__all__ = ["RequestView", "PairPlace", "CaptureOut", "PatchOut", "capture_request", "patch_request", "head_request",
           "register_tree", "TREE_ID"]


class PairPlace:
    """A vLLM block's output, ``(hidden, residual)`` viewed ``[1, T, d]`` each, as one place
    whose value is the residual stream, their sum (the module docstring)."""

    def __init__(self, hidden: torch.Tensor, residual: torch.Tensor):
        self.hidden, self.residual = hidden, residual

    def read(self, rows: Any) -> torch.Tensor:
        return (self.hidden + self.residual)[rows]

    def apply(self, op: Op, rows: Any, index: tuple) -> torch.Tensor | None:
        if op.value is None:
            return self.read(rows)[index].clone()
        residual = self.residual[rows]
        if op.add:
            residual[index] += op.value.to(residual.device, residual.dtype)
        else:
            residual[index] = op.value.to(residual.device, residual.dtype)
            self.hidden[rows][index] = 0
        return None

    def add(self, rows: Any, delta: torch.Tensor) -> None:
        residual = self.residual[rows]
        residual += delta.to(residual.device, residual.dtype)


class RequestView(View):
    """One request as a program's body sees it: one job, every value ``[1, T, width]``.

    ``skip``, ``(below, state, pairs)``: blocks ``0 … below − 1`` do not run, and the last
    one's output is ``state`` ([T, d], the stream), as ``(0, state)`` where a block returns
    ``(hidden, residual)`` (``pairs``); every request of the engine's step skips the same
    blocks. ``prompt``: the prompt's positions (a block's state is kept there).
    """

    def __init__(self, adapter: Adapter, model: Any, *, prompt: int = 0, skip: tuple | None = None):
        super().__init__(adapter, model)
        self.prompt, self.skip = prompt, skip
        self.pairs: bool | None = None  # whether a block returns (hidden, residual), once one was read

    def holder(self, site: Site, layer: int) -> Place:
        if site.is_block_output:
            out = self.adapter.block(self.model, layer).output
            self.pairs = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor)
            if self.pairs:
                return PairPlace(out[0].unsqueeze(0), out[1].unsqueeze(0))
            return TensorPlace(first(out).unsqueeze(0))
        if site.is_embedding:
            return TensorPlace(_block_input(self.adapter, self.model).unsqueeze(0))
        return TensorPlace(site.value(self.adapter, self.model, layer).unsqueeze(0))

    def rows(self, job: int, site: Site) -> Any:
        return slice(None)

    def index(self, job: int, op: Any) -> tuple:
        return op.index

    def enter(self, layer: int) -> None:
        if self.skip is not None and layer < self.skip[0]:
            below, state, pairs = self.skip
            if layer == 0:
                state = _on_engine(torch_module(self.model), state)
                self._replacement = (torch.zeros_like(state), state) if pairs else state
            self.adapter.block(self.model, layer).skip(self._replacement)

    def block_state(self, layer: int) -> Any:
        """The stream out of block ``layer`` at the prompt's positions, ``[1, T, d]``, on the CPU."""
        from .._sites import RESID

        return self.place(RESID, layer).read(slice(None))[:, : self.prompt].clone().cpu()


class CaptureOut(NamedTuple):
    """One capture request's answer. ``blocks``, ``values``, ``embedded``, ``pairs`` and
    ``top1`` are ``None`` in a further input's request (a foil's continuation), which only
    reads the metric's pieces."""

    blocks: list[torch.Tensor] | None  # per layer, the stream at the prompt's positions [1, T, d]
    values: dict[str, list[torch.Tensor]] | None  # the kept sites', per layer [1, T, width]
    pieces: torch.Tensor  # the metric's pieces [n_read, n_sequences]
    prob: torch.Tensor  # P(answer) [1]
    embedded: torch.Tensor | None  # the embedding output [1, T, d]
    pairs: bool | None  # whether a block returns (hidden, residual)
    top1: torch.Tensor | None  # the top next token after the prompt


class PatchOut(NamedTuple):
    """One patched request's answer: the metric's pieces at the read positions (or the logits
    after the prompt), and what its recording ops read."""

    out: torch.Tensor
    reads: list[torch.Tensor]


def capture_request(model: Any, adapter: Adapter, metric: Metric, keep: list[Site] | None, ops: list[Op],
                    prompt: int) -> CaptureOut:
    """One base request under ``ops`` (the run's writes: causal tracing's noise at the
    embedding): the capture program with ``keep`` (a run's first input), or (``keep is
    None``, a further input) its ops alone; then the metric's pieces and P(answer)."""
    view = RequestView(adapter, model, prompt=prompt)
    embedded: torch.Tensor | None = None
    blocks: list[Any] | None = None
    values: dict[str, list[torch.Tensor]] | None = None
    if keep is not None:
        embedded, blocks, values = capture_body(view, [ops], keep, prompt, slice(None))
    else:
        patch_body(view, [ops])
    logits = _read_logits(model, adapter, metric.n_read)
    # The model's top next token after the prompt (the first read position): a study's
    # known-fact check, read off the run every planner starts with.
    top1 = logits[0].argmax().cpu() if keep is not None else None
    return CaptureOut(blocks, None if values is None else {k: [v.cpu() for v in vs] for k, vs in values.items()},
                      metric.pieces(logits).cpu(), metric.answer_prob(logits[None, None]).cpu(),
                      None if embedded is None else embedded.cpu(), view.pairs if keep is not None else None, top1)


def patch_request(model: Any, adapter: Adapter, metric: Metric, ops: list[Op], full_logits: bool,
                  skip: tuple | None = None) -> PatchOut:
    """One patched request: the patch program (the cell's seed's base ops and its own), then
    the metric's pieces at the read positions (or, ``full_logits``, the logits after the
    prompt). ``skip``: :class:`RequestView`'s."""
    (reads,) = patch_body(RequestView(adapter, model, skip=skip), [ops])
    logits = _read_logits(model, adapter, metric.n_read)
    out = logits[:1] if full_logits else metric.pieces(logits)
    return PatchOut(out.cpu(), [read.cpu() for read in reads])


def _block_input(adapter: Adapter, model: Any) -> torch.Tensor:
    """Block 0's hidden-state input, [T, d]: the (scaled) embeddings every block builds on."""
    args, kwargs = adapter.block(model, 0).inputs
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dim() == 2:
            return arg
    raise RuntimeError("pipatch: found no hidden-state input to block 0 of this vLLM model")



def _read_logits(model: Any, adapter: Adapter, n_read: int) -> torch.Tensor:
    """The request's logits at its last ``n_read`` positions, [n_read, vocab] float32.

    vLLM computes logits at the last position only (``model.logits``); for more (a multi-token
    answer, read teacher-forced) the final norm's output at those positions goes through the
    model's own ``compute_logits`` (soft-capping included), in the worker.
    """
    if n_read == 1:
        return model.logits.float()
    assert adapter.final_norm is not None  # every family vLLM runs has one
    hidden = first(_get(model, adapter.final_norm).output)[-n_read:]
    return torch_module(model).compute_logits(hidden).float()


#: Cells per head-only request: their logits, [cells · n_read, vocab] float32, are what it holds
#: (64 cells of Gemma 3's 262,144-token vocabulary: 64 MiB).
_HEAD_CELLS = 64


def head_request(model: Any, adapter: Adapter, metric: Metric, states: torch.Tensor) -> torch.Tensor:
    """One request's body that runs no block of its own: ``states`` ([cells, n_read, d], last
    block outputs) through the model's final norm and ``compute_logits`` (soft-capping
    included) → the metric's pieces, [cells, n_read, n_sequences]."""
    assert adapter.final_norm is not None  # every family vLLM runs has one
    module = torch_module(model)
    cells, n_read, d = states.shape
    normed = first(_get(module, adapter.final_norm)(_on_engine(module, states.reshape(-1, d))))
    return metric.pieces(_own_logits(module, normed).reshape(cells, n_read, -1)).cpu()


def _stream_into(norm: Any) -> torch.Tensor:
    """The residual stream a norm reads: its input, or the sum of ``(hidden, residual)`` where
    vLLM fuses the add into the norm. Read at the norm's call, before the fused add updates
    its inputs in place."""
    args, kwargs = norm.inputs
    parts = [a for a in (*args, kwargs.get("residual")) if isinstance(a, torch.Tensor)]
    return (parts[0] + parts[1] if len(parts) > 1 else parts[0]).float().clone()


def _normed(envoy: Any, x: torch.Tensor) -> torch.Tensor:
    """The norm module of ``envoy`` on ``x`` ([..., d]), called outside the model's forward:
    vLLM's own ``forward_native`` where it has one (no fused add, no hook fires)."""
    module = torch_module(envoy)
    flat = _on_engine(module, x.reshape(-1, x.shape[-1]))
    out = module.forward_native(flat) if hasattr(module, "forward_native") else module(flat)
    return first(out).float().reshape(x.shape)


def _linear(envoy: Any, x: torch.Tensor) -> torch.Tensor:
    """The linear layer of ``envoy`` (one rank's whole weight) on ``x`` ([..., in]), bias
    included, float32: through the layer's own ``quant_method`` (vLLM's CPU path repacks the
    weight and empties ``weight``), outside the model's forward (no hook fires)."""
    module = torch_module(envoy)
    bias = None if getattr(module, "skip_bias_add", False) else getattr(module, "bias", None)
    flat = _on_engine(module, x.reshape(-1, x.shape[-1]))
    return module.quant_method.apply(module, flat, bias).float().reshape(*x.shape[:-1], -1)


def _circuit_cache(model: Any, adapter: Adapter) -> dict[str, torch.Tensor]:
    """One baseline request of a circuit's runs (the corrupt prompt, or a prompt of mean
    ablation's): the values an ablated edge carries, float32 on the CPU: the embeddings
    (``embedded`` [T, d]); per layer ([L, T, ...]) the stream into the attention's norm (``x``),
    the heads' outputs (``z``), the stream into the MLP's norm (``x_mid``) and the MLP's
    output (``mlp``); and the stream into the final norm (``x_final``)."""
    out: dict[str, Any] = {"embedded": _block_input(adapter, model).float().clone()}
    layers: dict[str, list[torch.Tensor]] = {"x": [], "z": [], "x_mid": [], "mlp": []}
    assert adapter.attn_norm and adapter.mlp_norm and adapter.final_norm  # check_circuit_family's promise
    for layer in range(adapter.n_layers):
        block = adapter.block(model, layer)
        attn = _get(block, adapter.attn)
        layers["x"].append(_stream_into(_get(block, adapter.attn_norm)))
        layers["z"].append(_get(attn, adapter.out_proj).input.float().clone())
        layers["x_mid"].append(_stream_into(_get(block, adapter.mlp_norm)))
        layers["mlp"].append(first(_get(block, adapter.mlp).output).float().clone())
    out["x_final"] = _stream_into(_get(model, adapter.final_norm))
    out.update({name: torch.stack(values) for name, values in layers.items()})
    return {name: value.cpu() for name, value in out.items()}


#: What the requests of one circuit trace hand each other in the worker, by the trace's key:
#: its baselines (sent once, with its first invoke) and each member's head outputs per layer.
#: All of a trace's requests run in one engine step, each module call taking them in invoke
#: order, so a member's ``z`` is here before any request reads it at the layer's MLP.
_CIRCUITS: dict[str, dict[str, Any]] = {}


def _circuit_run(model: Any, adapter: Adapter, metric: Metric, keep: torch.Tensor, row: int, member: int,
                 trace: tuple[str, int, int], baselines: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
    """One request of a circuit's run (:meth:`VLLMBackend.circuit_metrics`): input ``row`` of
    the run under mask ``keep`` ([receivers, senders]), as member ``member`` of its grouped-query
    groups; returns the metric's pieces.

    Each receiver reads its baseline value plus its kept senders' ``deltas`` (what each wrote
    in this run minus in the baseline). The request feeds the query, key and value columns of
    the heads of its member (``qkv_proj``'s output, whose attention then runs on them), leaves
    its heads' outputs for the other members' requests and takes theirs, feeds the MLP its
    input, and reads the logits off the final norm of its own fed stream. ``trace``: the
    trace's key, this mask's index in it and its number of requests."""
    key, mask, count = trace
    assert adapter.attn_norm and adapter.mlp_norm and adapter.final_norm  # check_circuit_family's promise
    while len(_CIRCUITS) > 8 and key not in _CIRCUITS:  # left by traces that failed
        _CIRCUITS.pop(next(iter(_CIRCUITS)))
    shared = _CIRCUITS.setdefault(key, {"z": {}, "done": 0})
    if baselines is not None:
        shared["baselines"] = baselines
    H, L = adapter.n_heads, adapter.n_layers
    group, edge_graph = H // max(1, adapter.n_kv_heads), graph(adapter)
    embedded = _block_input(adapter, model).float()  # [T, d]
    device = embedded.device
    base = {name: value.to(device) for name, value in shared["baselines"][row].items()}
    keep = keep.to(device, torch.float32)
    deltas = torch.zeros(keep.shape[1], *embedded.shape, device=device)  # [senders, T, d]
    deltas[edge_graph.emb] = embedded - base["embedded"]

    def fed(value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return value[None] + torch.einsum("rs,std->rtd", rows, deltas)

    mine = [(head, which, *adapter.qkv_columns(which, head)) for head in range(H) if head % group == member
            for which in QKV]
    for layer in range(L):
        block = adapter.block(model, layer)
        attn = _get(block, adapter.attn)
        normed = _normed(_get(block, adapter.attn_norm),
                         fed(base["x"][layer], keep[[edge_graph.qkv(layer, head, which) for head, which, *_ in mine]]))
        for name in adapter.qkv:  # in forward order
            mine_here = [(i, lo, hi) for i, (_, _, module, lo, hi) in enumerate(mine) if module == name]
            if not mine_here:
                continue
            projection = _get(attn, name)
            out = first(projection.output)
            projected = _linear(projection, normed[[i for i, _, _ in mine_here]])
            for j, (_, lo, hi) in enumerate(mine_here):
                out[:, lo:hi] = projected[j, :, lo:hi].to(out.dtype)
        out_proj = _get(attn, adapter.out_proj)
        shared["z"][mask, row, layer, member] = out_proj.input.float().clone()
        mlp = _get(block, adapter.mlp)
        mlp_input = mlp.input  # every member's request has left its heads' outputs by now
        z = torch.empty_like(base["z"][layer])  # every head's output, each from its member's request
        for head in range(H):
            cut = HEAD.head_slice(adapter, head)
            theirs = shared["z"].get((mask, row, layer, head % group))
            if theirs is None:
                raise RuntimeError("pipatch: a circuit's requests ran in different engine steps; run fewer at once")
            z[:, cut] = theirs[:, cut]
        post = _get(block, adapter.attn_post_norm) if adapter.attn_post_norm else None
        write, each = head_writes(adapter, lambda x: _linear(out_proj, x),
                                  None if post is None else (lambda x: _normed(post, x)), z[None], base["z"][layer][None])
        deltas[edge_graph.heads(layer)] = each[0] - write
        x = fed(base["x_mid"][layer], keep[edge_graph.mlp_in(layer), None])[0]
        mlp.input = _normed(_get(block, adapter.mlp_norm), x).to(mlp_input.dtype)
        both = torch.stack([first(mlp.output).float(), base["mlp"][layer]])
        if adapter.mlp_post_norm:
            both = _normed(_get(block, adapter.mlp_post_norm), both)
        deltas[edge_graph.mlp(layer)] = both[0] - both[1]
    x = fed(base["x_final"], keep[edge_graph.logits, None])[0]
    normed = _normed(_get(model, adapter.final_norm), x[-metric.n_read :])
    pieces = metric.pieces(_own_logits(torch_module(model), normed)).cpu()
    shared["done"] += 1
    if shared["done"] == count:  # the trace's last request: its hand-overs are spent
        _CIRCUITS.pop(key, None)
    return pieces


def _compute_logits(worker: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Run on the engine's worker (``collective_rpc``): the model's own logits of ``hidden``."""
    with torch.no_grad():
        return _own_logits(worker.model_runner.get_model(), hidden).cpu()


def register_tree(worker: Any) -> None:
    """Run on each rank's worker (``collective_rpc``): name its nnsight model tree among the
    persistent objects its requests are unpickled with."""
    name_worker_tree(worker.model_runner, TREE_ID)


def _worker_memory(worker: Any) -> dict[str, Any]:
    """Run on each rank's worker (``collective_rpc``): its rank, process id and resident memory."""
    import os

    with open("/proc/self/statm") as statm:  # Linux: the resident pages are the second field
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rank": int(getattr(worker, "rank", 0)), "pid": os.getpid(), "rss_gb": round(rss / 2**30, 2)}


def _on_engine(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` on the engine module's device, in its dtype."""
    param = next(module.parameters())
    return hidden.to(param.device, param.dtype)


def _own_logits(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The engine module's own logits (soft-capping included) of final-normed ``hidden``, float32."""
    return module.compute_logits(_on_engine(module, hidden)).float()
