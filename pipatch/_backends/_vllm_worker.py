"""What runs inside a vLLM request, in the engine's worker: the views a program's body sees
(:class:`RequestView`; a circuit's, :class:`RequestCircuitView`), and the request bodies.

Module-level functions, shipped by reference with each invoke (nnsight pickles an invoke's
body for the workers), taking the model and small per-job data; what they return travels back
on the CPU as named tuples (:class:`CaptureOut`, :class:`PatchOut`,
:class:`~pipatch._programs.circuit.Baselines`). Nothing is kept here from one request to the
next: a request reads only its own run and what it carries. Inside a request a
module's value is the request's rows, ``[T, width]``, with no batch dimension:
:class:`RequestView` shows it to a program as ``[1, T, width]`` (a view), so an op's index
means the same as on the transformers backend. Where vLLM differs from transformers:

* **The residual stream.** A decoder layer returns ``(hidden, residual)``, and the stream
  after the block is their sum (the next layer's fused add-norm adds them): one place
  (:class:`PairPlace`) whose value is the sum; a write puts the value into ``residual`` and
  zeros into ``hidden`` at the written positions, so the sum is the written value exactly.
* **Embeddings.** Some vLLM models scale the embedding *after* the embedding module (Gemma:
  ``× √d``), where transformers scales inside it. The embedding site
  (:data:`~pipatch._model.sites.EMBED`) is the embedding output as transformers defines it, so here
  it is block 0's input (:func:`_block_input`).
* **Logits.** vLLM computes logits at the last position only; for more (a multi-token answer,
  read teacher-forced) the final norm's output at those positions goes through the model's
  own ``compute_logits`` (:func:`_read_logits`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._compat.nnsight import name_worker_tree, torch_module
from .._compat.vllm import head_rows
from .._model.cells import Metric, Op
from .._model.models import TREE_ID, Adapter, _get, first
from .._model.sites import Place, Site, TensorPlace
from .._programs._inputs import moved, on_device
from .._programs._program import PROGRAMS, View
from .._programs.capture import capture_body
from .._programs.circuit import (
    Baselines,
    CircuitView,
    Ungrouped,
    returning,
    widened,
)
from .._programs.lens import LensOut
from .._programs.patch import patch_body

__all__ = ["RequestView", "RequestCircuitView", "PairPlace", "CaptureOut", "PatchOut", "ANSWERS", "capture_request",
           "patch_request", "head_request", "EngineHead", "register_tree", "TREE_ID",
           "program_request"]


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
        from .._model.sites import RESID

        return self.place(RESID, layer).read(slice(None))[:, : self.prompt].clone().cpu()

    def read_out(self, metric: Metric) -> torch.Tensor:
        """The final norm's output (the unembedding's input) at the request's last
        ``n_read`` positions, ``[n_read, d]``."""
        assert self.adapter.final_norm is not None  # every family vLLM runs has one
        return first(_get(self.model, self.adapter.final_norm).output)[-metric.n_read :].clone()

    def final_norm(self, states: torch.Tensor) -> torch.Tensor:
        """The engine's final norm on ``states`` ([N, d]), called outside the forward
        (:func:`_normed`: the body has read the norm's output in this request, and a call
        through the module's hooks would be served as that call)."""
        assert self.adapter.final_norm is not None  # every family vLLM runs has one
        return _normed(_get(self.model, self.adapter.final_norm), states)

    @property
    def unembedding(self) -> EngineHead:
        return EngineHead(torch_module(self.model))

    def circuit_view(self, rows: int) -> RequestCircuitView:
        """This request as a circuit's bodies see it (:class:`RequestCircuitView`): one run input."""
        assert rows == 1, "a vLLM request is one sequence"
        return RequestCircuitView(self.adapter, self.model)


class EngineHead:
    """The engine module's own ``compute_logits`` (soft-capping included) as a lens read's
    unembedding: ``metric`` and ``logits`` of final-normed states, as
    :class:`~._unembedding.Unembedding` offers them."""

    def __init__(self, module: Any):
        self.module = module

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., vocab] float32."""
        return _own_logits(self.module, hidden.reshape(-1, hidden.shape[-1])).reshape(*hidden.shape[:-1], -1)

    def metric(self, metric: Metric, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, inputs, n_read, d] → the metric, [batch]. A logit difference reads its two
        rows of the head only (:func:`~pipatch._compat.vllm.head_rows`), as the transformers
        backend's :class:`~._unembedding.Unembedding` does; the rest all of them."""
        if metric.token_ids is not None:
            flat = _on_engine(self.module, hidden.reshape(-1, hidden.shape[-1]))
            rows = head_rows(self.module, flat, metric.token_ids)
            if rows is not None:
                return metric.score(rows.reshape(*hidden.shape[:-1], -1), subset=True)
        return metric.score(self.logits(hidden))


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


#: The named tuples a request answers with: tensors and plain values only, which a served
#: client's weights-only ``torch.load`` may build (:meth:`~.served.Server.generate`).
ANSWERS = (CaptureOut, PatchOut, Baselines, LensOut)


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


def program_request(model: Any, adapter: Adapter, name: str, request: Any) -> Any:
    """One request of any program with declared inputs (:data:`~pipatch._programs.PROGRAMS`,
    by ``name``: the worker's own registry): its body on this request's :class:`RequestView`,
    the request's tensors on the engine's device; its output on the CPU."""
    program = PROGRAMS.get(name)
    if program is None or program.inputs is None:
        raise RuntimeError(f"pipatch: this engine's worker has no program {name!r} with declared inputs")
    device = next(torch_module(model).parameters()).device
    return on_device(program.body(RequestView(adapter, model, prompt=int(request.ids.shape[1])), moved(request, device)), "cpu")


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


class RequestCircuitView(CircuitView):
    """A circuit's bodies (:mod:`pipatch._programs.circuit`) in one request of one run input:
    values ``[1, T, width]``, the rows a body computes ``[rows, T, width]``, flattened to vLLM's
    ``[rows · T, width]`` for each module call.

    A live value is read at its module's call (the residual stream into a norm: the sum vLLM
    fuses into it, :func:`_stream_into`). The norms and linear layers are called outside the
    forward (:func:`_normed`, :func:`_linear`); the MLP, and the attention's own submodules,
    through their envoys (nnsight's ad-hoc call). :meth:`attention` calls the attention
    module's class forward with an :class:`~pipatch._programs.circuit.Ungrouped` stand-in: the
    fused ``qkv_proj`` returns the fed ``[q | k_H | v_H]`` (``num_kv_heads = H``), the paged
    attention is :func:`_causal` and the output projection hands back ``z``.
    """

    def __init__(self, adapter: Adapter, model: Any):
        self.adapter, self.model = adapter, model

    def carried(self, value: torch.Tensor) -> torch.Tensor:
        """A request's tensor on the engine, in its dtype, then float32 (as the engine's own
        values are read)."""
        return _on_engine(torch_module(self.model), value).float()

    def _block(self, layer: int) -> Any:
        return self.adapter.block(self.model, layer)

    def _at(self, layer: int, path: str | None) -> Any:
        assert path is not None, "a circuit needs its family's norms (check_circuit_family)"
        return _get(self._block(layer), path)

    @staticmethod
    def _flat(function: Any, x: torch.Tensor) -> torch.Tensor:
        """``function`` ([N, width] → [N, width']) on ``x`` [..., T, width]."""
        return function(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    # -- live values ------------------------------------------------------------------------
    def embedded(self) -> torch.Tensor:
        return _block_input(self.adapter, self.model).float().clone()[None]

    def attn_in(self, layer: int) -> torch.Tensor:
        return _stream_into(self._at(layer, self.adapter.attn_norm))[None]

    def z(self, layer: int) -> torch.Tensor:
        return _get(self._at(layer, self.adapter.attn), self.adapter.out_proj).input.float().clone()[None]

    def mlp_in(self, layer: int) -> torch.Tensor:
        return _stream_into(self._at(layer, self.adapter.mlp_norm))[None]

    def mlp_out(self, layer: int) -> torch.Tensor:
        return first(self._at(layer, self.adapter.mlp).output).float().clone()[None]

    def final_in(self) -> torch.Tensor:
        assert self.adapter.final_norm is not None  # every family vLLM runs has one
        return _stream_into(_get(self.model, self.adapter.final_norm))[None]

    # -- module calls -------------------------------------------------------------------------
    def attn_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return _normed(self._at(layer, self.adapter.attn_norm), x)

    def project(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return _linear(_get(self._at(layer, self.adapter.attn), name), x)

    def out_proj(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        return _linear(_get(self._at(layer, self.adapter.attn), self.adapter.out_proj), z)

    def attn_post_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return _normed(self._at(layer, self.adapter.attn_post_norm), x)

    def mlp_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return _normed(self._at(layer, self.adapter.mlp_norm), x)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        envoy = self._at(layer, self.adapter.mlp)
        return self._flat(lambda flat: first(envoy(_on_engine(torch_module(envoy), flat))).float(), x)

    def mlp_post_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return _normed(self._at(layer, self.adapter.mlp_post_norm), x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.adapter.final_norm is not None  # every family vLLM runs has one
        return _normed(_get(self.model, self.adapter.final_norm), x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        module = torch_module(self.model)
        return self._flat(lambda flat: _own_logits(module, flat), x)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        adapter = self.adapter
        envoy = self._at(layer, adapter.attn)
        module = torch_module(envoy)
        args, kwargs = envoy.inputs  # the real call's: this request's positions
        rows, T = q.shape[0], q.shape[1]
        paged = module.attn
        scale, cap = paged.impl.scale, getattr(paged.impl, "logits_soft_cap", None)
        dtype = next(module.parameters()).dtype

        def flat(t: torch.Tensor) -> torch.Tensor:
            return _on_engine(module, t.reshape(rows * T, -1))

        dummy = flat(q).new_zeros(()).expand(rows * T, adapter.d_model)  # read for its shape only

        def batched(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.shape[:1] == (T,):
                return value.repeat(rows)  # the positions, for every row
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return dummy
            return value

        taken: dict[str, torch.Tensor] = {}

        def out_proj(z: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, None]:
            taken["z"] = z
            return z, None

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            return _causal(q_, k_, v_, rows, adapter.n_heads, scale, paged.sliding_window, cap).to(dtype)

        fed = {name: returning((flat(value), None)) for name, value in widened(adapter, q, k, v).items()}
        stand_in = Ungrouped(module, envoy, {**fed, "attn": attend, adapter.out_proj: out_proj,
                                             **Ungrouped.counts(module, adapter)})
        Ungrouped.forward(module)(stand_in, *(batched(a) for a in args),
                                  **{name: batched(value) for name, value in kwargs.items()})
        return taken["z"].float().reshape(rows, T, -1)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, heads: int, scale: float,
            window: int | None, cap: float | None) -> torch.Tensor:
    """Causal attention of ``rows`` sequences laid one after another, ``[rows · T, heads ·
    head_dim]`` each of ``q``, ``k``, ``v`` (one key/value head per query head), in float32:
    scores scaled by ``scale``, soft-capped at ``cap`` (``tanh(s / cap) · cap``), each position
    attending to itself and the ``window − 1`` before it (``None``: all before it)."""
    def split(t: torch.Tensor) -> torch.Tensor:  # → [rows, heads, T, head_dim]
        return t.float().reshape(rows, -1, heads, t.shape[-1] // heads).transpose(1, 2)

    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(-1, -2) * scale
    if cap:
        scores = torch.tanh(scores / cap) * cap
    T = q.shape[2]
    at, to = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None]
    seen = to <= at
    if window:
        seen &= at - to < window
    out = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(rows * T, -1)


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
