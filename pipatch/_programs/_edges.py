"""The two factors of every edge score of a circuit, computed on a transformers model.

Edge attribution patching (EAP; Syed, Rager & Conmy 2023) scores an edge from a **sender**
(the embeddings, one head, one MLP) to a **receiver** (one head's query, key or value input,
one MLP's input, the logits) as

.. math::

    \\Delta_s \\cdot u_r, \\qquad \\Delta_s = w_s^{clean} - w_s^{corrupt}, \\qquad
    u_r = \\partial M / \\partial x_r \\big|_{corrupt}

where ``w_s`` is what the sender adds to the residual stream (:func:`sender_writes`) and
``x_r`` is the residual stream *as receiver r alone reads it* (:func:`receiver_gradients`):
a copy of the residual that only ``r`` sees. The dot product runs over the prompt's
positions and the model width. This module computes the two factors; the protocol
(:mod:`pipatch._experiments.circuits`) multiplies them.

**What a sender writes.** The embeddings: the embedding output (Gemma's ``× √d`` included).
A head: the attention sublayer's write with only that head's ``z`` swapped for the clean one,
minus the corrupt write — ``W_O[:, h] (z_clean − z_corrupt)`` in most families, and Gemma's
``post_attention_layernorm`` of the whole output recomputed where it normalizes the
attention's output before adding it (exactly the contribution path patching swaps:
:mod:`pipatch._experiments.paths`). An MLP: its output (after Gemma's post-norm), clean minus
corrupt.

**What a receiver reads, and its gradient.** One forward and one backward on the corrupt
prompt give ``∂M`` at every query/key/value projection output, every ``z`` and every MLP
input. A query column block belongs to one head, so its gradient is that head's. A
grouped-query model's keys and values are read by a group of query heads: the key/value
gradient of query head ``h`` alone is a second, local backward from ``z_h`` only (the other
heads' ``∂M/∂z`` set to zero) through that layer's attention, which reaches the projections
through ``h``'s scores and values only — each query head's share kept apart. Every gradient
then goes back through the receiver's own projection columns and its norm, re-run on the
captured residual (``attn_norm`` → q/k/v, ``mlp_norm`` → MLP, the final norm → logits), so
``u_r`` is the gradient with respect to the residual as only ``r`` reads it. Those local
re-runs take ``chunk`` receivers at a time, which bounds their memory.

**EAP-IG** (Hanna, Pezzelle & Belinkov 2024) averages ``u_r`` over points on the straight line
from the corrupt to the clean input embeddings: :func:`receiver_gradients` takes the
``alphas`` (``k / steps`` for ``k = 0 … steps − 1``, a left Riemann sum from the corrupt end,
so ``steps=1`` is EAP itself).

Everything runs inside one nnsight trace of the run (the program's body, :mod:`.circuit`): the
forward's values are read through the model's envoys, the backward is ``torch.autograd.grad``
on them inside the trace, and the pull-backs and the senders' writes call the norms and
projections through their envoys. So a backend that runs a trace with gradients runs it — in
this process, or on NDIF, where the trace travels — and no hook is put on the torch model.
The gradients are taken with respect to activations only, never the weights: no ``.grad`` is
left on the model, and a frozen model works.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._compat.nnsight import torch_module
from .._model.cells import Capture, Metric
from .._model.models import Adapter, PipatchError, _get, first
from .._model.sites import HEAD, MLP, QKV

__all__ = ["SenderWrites", "SenderValues", "ReceiverGradients", "sender_writes", "receiver_gradients",
           "check_circuit_family", "head_writes"]

#: Receivers re-run through their norm and projection together (memory: ``chunk × T × d``).
CHUNK = 48


@dataclass
class SenderWrites:
    """What each sender adds to the residual stream, clean minus corrupt, at the prompt's
    positions: ``emb`` [T, d], ``heads`` [L, H, T, d], ``mlps`` [L, T, d]."""

    emb: torch.Tensor
    heads: torch.Tensor
    mlps: torch.Tensor


@dataclass
class ReceiverGradients:
    """``∂M / ∂x_r`` for each receiver at the prompt's positions, averaged over the
    interpolation points: ``qkv`` [L, H, 3, T, d] (query, key, value of each query head),
    ``mlps`` [L, T, d], ``logits`` [T, d]; ``metric`` is the metric at each point."""

    qkv: torch.Tensor
    mlps: torch.Tensor
    logits: torch.Tensor
    metric: list[float]


def check_circuit_family(adapter: Adapter) -> None:
    """Refuse, in one line, a family whose receivers pipatch cannot tell apart."""
    HEAD.check(adapter)
    if adapter.qkv_layout is None or adapter.attn_norm is None or adapter.final_norm is None:
        raise PipatchError(f"circuits are not supported for {adapter.family}: pipatch does not know its q/k/v layout "
                           "or its norms (pipatch/_model/models.py); use path_patch or attribute")
    if adapter.mlp_norm is None:
        raise PipatchError(f"circuits are not supported for {adapter.family}: its MLP reads the attention's own normed "
                           "input, so an MLP's input cannot be told from the heads'; use path_patch or attribute")


def _module(model: Any, adapter: Adapter, layer: int, path: str | None) -> Any:
    """Block ``layer``'s module at ``path`` (an envoy of the trace's model: called ad hoc, which
    leaves the trace's own visit of it untouched), or ``None`` where the family has none."""
    return _get(adapter.block(model, layer), path) if path else None


class SenderValues(NamedTuple):
    """What the senders wrote in the clean run (row 0) and the corrupt run (row 1), as their
    captures kept them at the prompt's positions: ``z`` [2, L, T, H·head_dim] (each layer's
    heads, the output projection's input), ``mlp`` [2, L, T, d] (each MLP's output, before
    any post-norm), ``embedded`` [2, T, d] (the embedding output)."""

    z: torch.Tensor
    mlp: torch.Tensor
    embedded: torch.Tensor

    @classmethod
    def of(cls, clean: Capture, corrupt: Capture) -> SenderValues:
        """From two captures of :data:`~pipatch._model.sites.HEAD` and :data:`~pipatch._model.sites.MLP`."""
        def both(name: str) -> torch.Tensor:
            return torch.stack([torch.stack([run.sites[name][layer][0] for layer in range(len(run.sites[name]))])
                                for run in (clean, corrupt)])
        return cls(both(HEAD.name), both(MLP.name), torch.stack([clean.embedded[0], corrupt.embedded[0]]))


def sender_writes(model: Any, adapter: Adapter, senders: SenderValues) -> SenderWrites:
    """Each sender's write, clean minus corrupt (module docstring), from what the senders wrote
    in the two runs (:class:`SenderValues`), inside a trace of ``model`` (the output projection
    and the post-norms called through their envoys)."""
    H, L = adapter.n_heads, adapter.n_layers
    heads, mlps = [], []
    with torch.no_grad():
        for layer in range(L):
            attn = _module(model, adapter, layer, adapter.attn)
            out_proj = _get(attn, adapter.out_proj)
            post = _module(model, adapter, layer, adapter.attn_post_norm)
            z_clean, z_corrupt = senders.z[0, layer].float(), senders.z[1, layer].float()
            swapped = z_corrupt.expand(H, *z_corrupt.shape).clone()  # [H, T, H·head_dim]
            for head in range(H):
                cut = HEAD.head_slice(adapter, head)
                swapped[head, :, cut] = z_clean[:, cut]
            both = first(out_proj(torch.cat([swapped, z_corrupt[None]]).to(_dtype(out_proj))))
            if post is not None:
                both = first(post(both))
            both = both.float()
            heads.append(both[:H] - both[H:])
            mlp_post = _module(model, adapter, layer, adapter.mlp_post_norm)
            pair = senders.mlp[:, layer]
            if mlp_post is not None:
                pair = first(mlp_post(pair))
            pair = pair.float()
            mlps.append(pair[0] - pair[1])
    emb = senders.embedded[0].float() - senders.embedded[1].float()
    return SenderWrites(emb=emb, heads=torch.stack(heads), mlps=torch.stack(mlps))


def _dtype(envoy: Any) -> torch.dtype:
    return next(torch_module(envoy).parameters()).dtype


def _through(norm: Any, projections: Sequence[Any], x: torch.Tensor, cotangents: Sequence[torch.Tensor | None],
             n: int) -> torch.Tensor:
    """``n`` gradients with respect to ``x`` ([k, T', d]): cotangent ``i`` (``[n, k, T', width]``
    per projection, ``None`` where none reaches it) pulled back through ``projection(norm(x))``
    (envoys, called ad hoc); no projections: through the norm alone (one cotangent). Returns
    [n, k, T', d]."""
    with torch.enable_grad():
        xs = x.detach().unsqueeze(0).expand(n, *x.shape).reshape(n * x.shape[0], *x.shape[1:]).clone()
        xs.requires_grad_(True)
        normed = first(norm(xs))
        outs = [first(p(normed)) for p in projections] if projections else [normed]
        total = sum((out.float() * c.reshape(out.shape)).sum() for out, c in zip(outs, cotangents) if c is not None)
        (grad,) = torch.autograd.grad(total, xs)
    return grad.reshape(n, *x.shape).float().cpu()


def receiver_gradients(model: Any, adapter: Adapter, metric: Metric, point: torch.Tensor, prompt: int, *,
                       chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``∂M/∂x_r`` for every receiver (module docstring) of one run, inside a trace of ``model``
    (an nnsight model, with gradients) whose embedding output is replaced by ``point``
    ([n_inputs, T', d]: the corrupt prompt's, or a point on the line to the clean one's):
    ``(qkv [L, H, 3, T, d], mlps [L, T, d], logits [T, d], the metric)`` at the first ``prompt``
    positions. One forward, one backward (``torch.autograd.grad`` on the trace's own values),
    then the local pull-backs through each receiver's norm and projections, called through
    their envoys."""
    T, H, L = prompt, adapter.n_heads, adapter.n_layers
    group = H // max(1, adapter.n_kv_heads)
    m = metric.n_read
    adapter.embedding(model).output = point.detach().clone().requires_grad_(True)
    layers = []
    for layer in range(L):
        block = adapter.block(model, layer)
        attn = _get(block, adapter.attn)
        x = _get(block, adapter.attn_norm).input
        projections = [first(_get(attn, name).output) for name in adapter.qkv]
        z = _get(attn, adapter.out_proj).input
        # The residual the MLP reads: the block's input too where attention and MLP read it
        # side by side (a parallel family may run the MLP's norm before the attention).
        x_mid = x if adapter.parallel else _get(block, adapter.mlp_norm).input
        mlp_in = _get(block, adapter.mlp).input
        layers.append((x, projections, z, x_mid, mlp_in))
    final = _get(model, adapter.final_norm)
    x_final, y_final = final.input, first(final.output)
    score = metric.score(model.output.logits[:, -m:].unsqueeze(0))[0]
    targets = [t for (_, projections, z, _, mlp_in) in layers for t in (*projections, z, mlp_in)] + [y_final]
    grads = list(torch.autograd.grad(score, targets, retain_graph=group > 1, allow_unused=True))
    per = len(adapter.qkv) + 2
    qkv = torch.zeros(L, H, 3, T, adapter.d_model)
    mlps = torch.zeros(L, T, adapter.d_model)
    for layer, (x, projections, z, x_mid, _) in enumerate(layers):
        g = grads[layer * per : (layer + 1) * per]
        g_proj, g_z, g_mlp = g[: len(projections)], g[-2], g[-1]
        g_proj = [torch.zeros_like(p) if gp is None else gp for p, gp in zip(projections, g_proj)]
        # Each receiver's cotangent on the projection output(s): its own columns, filled with
        # the gradient of its head alone.
        receivers = [(head, which) for head in range(H) for which in range(3)]
        cots = [torch.zeros(len(receivers), *p.shape, device=p.device) for p in projections]
        for head in range(H):
            if group > 1 and g_z is not None:
                mask = torch.zeros_like(g_z)
                cut = HEAD.head_slice(adapter, head)
                mask[..., cut] = g_z[..., cut]
                share = torch.autograd.grad(z, projections, grad_outputs=mask, retain_graph=True, allow_unused=True)
                share = [torch.zeros_like(p) if s is None else s for p, s in zip(projections, share)]
            else:
                share = g_proj
            for which in range(3):
                module, lo, hi = adapter.qkv_columns(QKV[which], head)
                i = adapter.qkv.index(module)
                cots[i][head * 3 + which, ..., lo:hi] = share[i][..., lo:hi].float()
        block = adapter.block(model, layer)
        attn = _get(block, adapter.attn)
        norm = _get(block, adapter.attn_norm)
        modules = [_get(attn, name) for name in adapter.qkv]
        pulled = []
        for lo in range(0, len(receivers), chunk):
            part = [c[lo : lo + chunk] for c in cots]
            pulled.append(_through(norm, modules, x, part, part[0].shape[0]))
        qkv[layer] = torch.cat(pulled).sum(1)[:, :T].reshape(H, 3, T, -1)
        if g_mlp is not None:
            mlp_norm = _get(block, adapter.mlp_norm)
            mlps[layer] = _through(mlp_norm, [], x_mid, [g_mlp.unsqueeze(0)], 1)[0].sum(0)[:T]
    g_final = grads[-1]
    logits = _through(final, [], x_final, [g_final.unsqueeze(0)], 1)[0].sum(0)[:T]
    return qkv, mlps, logits, float(score.detach())


def head_writes(adapter: Adapter, project: Any, post: Any, z: torch.Tensor, z_corrupt: torch.Tensor):
    """(the write of ``z_corrupt`` [B, T', H·hd], each head's write with its slice from ``z``: [B, H, T', d]),
    float32: ``project`` is the attention's output projection and ``post`` its output norm
    (Gemma's; ``None`` elsewhere), functions of a [rows, T', ...] tensor (a circuit view's
    module calls, :class:`~pipatch._programs.circuit.CircuitView`)."""
    H = adapter.n_heads
    swapped = z_corrupt[:, None].repeat(1, H, 1, 1)
    for head in range(H):
        cut = HEAD.head_slice(adapter, head)
        swapped[:, head, :, cut] = z[..., cut]
    B, T = z.shape[0], z.shape[1]
    both = project(torch.cat([swapped.flatten(0, 1), z_corrupt]))
    if post is not None:
        both = post(both)
    both = both.float()
    return both[B * H :], both[: B * H].reshape(B, H, T, -1)
