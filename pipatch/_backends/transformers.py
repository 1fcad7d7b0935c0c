"""The transformers backend: an nnsight ``TransformersModel`` (or ``LanguageModel``) in this process.

Every patched run is an nnsight *invoke*; a batch of cells is one ``model.trace()`` with one
invoke per cell, so the model runs a real batch instead of one forward per cell. Inside an
invoke a cell's ops are applied in forward order (nnsight serves a module's values only in
the order the forward pass computes them).

Two exact shortcuts, used when the engine asks for ``fast=True`` (a test compares them with
``fast=False`` within 1e-4):

* **Reuse below the patch.** Blocks below a cell's ``start`` layer see exactly the base run's
  inputs, so their outputs are the base run's cached ones: the block is ``skip()``\\ ped with
  the cached value instead of recomputed.
* **Unembed one position.** The metric needs the last position only (the last few for a
  multi-token answer), and a logit difference needs two rows of the unembedding, not 262k: the
  invoke reads the unembedding's *input* at those positions and skips the unembedding; :meth:`TransformersBackend.logits` computes
  just the rows the metric reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric
from .._models import _get, adapter_for, dispatched, first
from .._sites import RESID, Site
from ._described import Described

__all__ = ["TransformersBackend"]


class TransformersBackend(Described):
    """Runs cells on an nnsight model of a transformers checkpoint, in this process."""

    kind = "transformers"

    def __init__(self, model: Any):
        self.model = dispatched(model)
        self.adapter = adapter_for(self.model)

    # -- what the model is ------------------------------------------------------------------
    @property
    def _hf(self) -> Any:
        return getattr(self.model, "_module", self.model)

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def device(self) -> torch.device:
        try:
            return next(self._hf.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        try:
            return next(self._hf.parameters()).dtype
        except StopIteration:
            return torch.float32

    @property
    def name(self) -> str:
        """What results call the model: the name it was loaded by, else its checkpoint's."""
        label = getattr(self.model, "_pipatch_name", None)
        if label:
            return label
        hf = self._hf
        return str(getattr(hf, "name_or_path", "") or getattr(hf.config, "_name_or_path", "") or type(hf).__name__)

    @property
    def context_length(self) -> int | None:
        config = getattr(self._hf, "config", None)
        config = getattr(config, "text_config", None) or config
        for key in ("max_position_embeddings", "n_positions", "seq_length"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def runs_on(self) -> str:
        return str(self.device)

    @property
    def path(self) -> str:
        """Where the model loads from: the folder or hub id it was loaded from, else its checkpoint's."""
        hf = self._hf
        return str(getattr(self.model, "_pipatch_path", None) or getattr(hf.config, "_name_or_path", "")
                   or getattr(hf, "name_or_path", ""))

    def meta(self) -> dict[str, Any]:
        """What a result records about the model (:meth:`Described.meta`), plus where it loads
        from (``model_path``) and where the adapter found each site (``adapter``), which
        ``Result.code()`` reads."""
        return {**super().meta(), "model_path": self.path, "adapter": dataclasses.asdict(self.adapter)}

    # -- runs -------------------------------------------------------------------------------
    def capture(
        self,
        input_ids: torch.Tensor,
        metric: Metric,
        sites: Sequence[Site] = (),
        *,
        noise: torch.Tensor | None = None,
        noise_positions: list[int] | None = None,
    ) -> Capture:
        """Run ``input_ids`` ([1, T]) once per noise draw and keep every block output and site.

        ``noise`` is [n, len(noise_positions), d]: invoke ``i`` adds draw ``i`` to the
        embedding output at ``noise_positions`` (causal tracing's corrupted runs); ``None``
        is one clean run. ``sites`` lists the site values to keep besides the block outputs.
        """
        model, adapter = self.model, self.adapter
        n = 1 if noise is None else noise.shape[0]
        T, m = input_ids.shape[1], metric.n_read
        run_ids = metric.inputs(input_ids)
        keep = sorted({s for s in sites if s is not RESID}, key=lambda s: s.order)
        layers = range(adapter.n_layers)
        with torch.no_grad(), model.trace(**adapter.trace_kwargs(m)) as tracer:
            runs = list().save()
            for i in range(n):
                with tracer.invoke(run_ids):
                    embedded = adapter.embedding(model).output
                    if noise is not None:
                        embedded[:, noise_positions] += noise[i].to(embedded.dtype)
                    embedded_copy = embedded[:1, :T].clone()
                    blocks = []
                    values = {s.name: [] for s in keep}
                    for layer in layers:
                        for s in keep:
                            values[s.name].append(s.value(adapter, model, layer)[:1, :T].clone())
                        out = adapter.block(model, layer).output
                        blocks.append(tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                                      if isinstance(out, tuple) else out.clone())
                    logits = model.output.logits[:, -m:].float()
                    runs.append((blocks, values, logits, embedded_copy))
        blocks = [_cat([r[0][layer] for r in runs]) for layer in layers]
        values = {s.name: [torch.cat([r[1][s.name][layer] for r in runs]) for layer in layers] for s in keep}
        values[RESID.name] = [first(b)[:: metric.n_inputs, :T] for b in blocks]
        logits = torch.stack([r[2] for r in runs])  # [n, inputs, n_read, vocab]
        return Capture(blocks=blocks, sites=values, metric=metric.score(logits),
                       embedded=torch.cat([r[3] for r in runs]), prob=metric.answer_prob(logits),
                       inputs=metric.n_inputs)

    def run(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool = True,
            full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Run ``cells`` on ``base`` as invokes of one trace.

        Returns the metric per cell ([len(cells)], float32) — or, with ``full_logits``, the
        last prompt position's logits per cell ([len(cells), vocab]) — and, per cell, the values
        its recording ops read (in op order). A cell is one invoke of ``metric.n_inputs`` batch
        rows (the prompt and each answer continuation); its writes cover every row.
        """
        model, adapter = self.model, self.adapter
        unembed = adapter.unembedding(model)
        run_ids = metric.inputs(base.input_ids)
        L, m = run_ids.shape[1], metric.n_read
        last_only = fast and not full_logits
        plans = [cell.sorted_ops() for cell in cells]
        with torch.no_grad(), model.trace() as tracer:
            outs = list().save()
            recorded = list().save()
            for cell, ops in zip(cells, plans):
                with tracer.invoke(run_ids):
                    if base.noise is not None and (cell.start == 0 or not fast):
                        embedded = adapter.embedding(model).output
                        embedded[:, base.noise_positions] += base.noise[cell.seed].to(embedded.dtype)
                    if fast:
                        for below in range(cell.start):
                            adapter.block(model, below).skip(base.capture.block_for(below, cell.seed))
                    values: dict[tuple[str, int], Any] = {}
                    reads = []
                    for op in ops:
                        key = (op.site.name, op.layer)
                        if key not in values:
                            values[key] = op.site.value(adapter, model, op.layer)
                        if op.value is None:
                            reads.append(values[key][op.index].clone())
                        else:
                            values[key][op.index] = op.value
                    recorded.append(reads)
                    if last_only:
                        final = unembed.input
                        outs.append(final[:, -m:])
                        # The logits are computed from ``final`` outside the trace, for the read
                        # positions and the metric's rows only; the module returns a placeholder.
                        unembed.skip(torch.zeros(run_ids.shape[0], L, 1, dtype=final.dtype, device=final.device))
                    elif full_logits:
                        outs.append(model.output.logits[:1, -m])  # the next token after the prompt
                    else:
                        outs.append(model.output.logits[:, -m:])
        if full_logits:
            return torch.cat(list(outs)).float(), list(recorded)
        stacked = torch.stack(list(outs))  # [cells, inputs, n_read, d or vocab]
        if last_only:
            return self.metric_from_hidden(metric, stacked), list(recorded)
        return metric.score(stacked), list(recorded)

    def metric_from_hidden(self, metric: Metric, hidden: torch.Tensor, chunk: int = 32) -> torch.Tensor:
        """The metric from the unembedding's input at the read positions,
        [batch, inputs, n_read, d] → [batch]."""
        out = []
        for start in range(0, hidden.shape[0], chunk):
            part = self.logits(hidden[start : start + chunk], metric.token_ids)
            out.append(metric.score(part, subset=metric.token_ids is not None))
        return torch.cat(out) if out else torch.zeros(0)

    def logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Logits from the input of the unembedding (final-normed states, [..., d] → [..., vocab]).

        ``token_ids=None`` gives the whole vocabulary; a list gives just those columns, which is
        all a logit difference needs and avoids multiplying by a 262k-row matrix.
        """
        module = _get(self._hf, self.adapter.unembed)
        weight, bias = module.weight, getattr(module, "bias", None)
        if token_ids is not None:
            index = torch.as_tensor(token_ids, device=weight.device)
            weight = weight.index_select(0, index)
            bias = bias.index_select(0, index) if bias is not None else None
        out = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
        if self.adapter.softcap:
            out = torch.tanh(out / self.adapter.softcap) * self.adapter.softcap
        return out

    def gradients(self, input_ids: torch.Tensor, metric: Metric, site: Site):
        """One forward with gradient tracking and one backward on ``input_ids``.

        Returns (site value per layer [1, T, width], d metric / d value per layer, metric).
        The embedding output is swapped for a detached leaf and the backward is restricted to
        it (``inputs=[leaf]``), so autograd walks every activation between the embedding and
        the metric but never computes a parameter gradient: no ``.grad`` is left on the
        model, and a frozen model (``requires_grad=False``) works too.
        """
        model, adapter = self.model, self.adapter
        T, m = input_ids.shape[1], metric.n_read
        with torch.enable_grad(), model.trace(**adapter.trace_kwargs(m)) as tracer:
            values = list().save()
            grads = list().save()
            with tracer.invoke(metric.inputs(input_ids)):
                embedding = adapter.embedding(model)
                leaf = embedding.output.detach().requires_grad_(True)
                embedding.output = leaf
                acts = []
                for layer in range(adapter.n_layers):
                    act = site.value(adapter, model, layer)
                    acts.append(act)
                    values.append(act[:1, :T].detach().clone())
                score = metric.score(model.output.logits[:, -m:].unsqueeze(0))[0]
                value = score.detach().save()
                # nnsight serves .grad in the reverse of the forward order. A prompt position's
                # activation is shared by every input of the run: its gradients add up.
                with score.backward(inputs=[leaf]):
                    for act in reversed(acts):
                        grads.append(act.grad[:, :T].sum(0, keepdim=True).detach().clone())
        return list(values), list(reversed(list(grads))), float(value)


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat([p[i] for p in parts]) if isinstance(parts[0][i], torch.Tensor) else parts[0][i]
            for i in range(len(parts[0]))
        )
    return torch.cat(parts)
