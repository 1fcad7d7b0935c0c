"""The engine: run a sweep of patched forward passes as batched nnsight invokes.

A protocol (causal tracing, activation patching) describes *what* to run as a :class:`Sweep`;
this module decides *how*. Every cell of a grid is one patched run of the model: a base run
(the corrupt prompt, or the clean prompt under noise) in which the activations at one site —
a residual state, a window of sublayer outputs, one head's slice of ``z`` — are replaced by a
donor's (the clean run's, or zeros, or a mean). The engine

* captures each run it needs once (:func:`capture`), keeping block outputs and site values;
* groups the cells of one grid row (one layer) into traces of at most ``batch_size`` invokes,
  one invoke per cell, so the model runs a real batch instead of one forward per cell;
* yields rows in order through ``on_row`` so a front end can draw them live, and checks
  ``should_stop`` between batches so a caller can stop and keep what is finished.

Two optimizations make a sweep cheaper than even a plain batched forward of all its cells,
and neither changes a number (a test compares them with ``fast=False`` within 1e-4):

* **Reuse below the patch.** Blocks below the first patched layer see exactly the base run's
  inputs, so their outputs are the base run's cached ones: the engine ``skip()``\\ s them with
  the cached value instead of recomputing them.
* **Unembed one position.** Only the last position's logits matter, and a logit difference
  needs two rows of the unembedding, not 262k: the engine reads the unembedding's *input* at
  the last position, skips the unembedding, and lets the adapter compute just what the metric
  needs.

Cells whose donor value equals the base run's own value at every written location (a position
before the first corrupted token, say) cannot change anything; they take the base metric
without a forward pass.

Where another nnsight backend plugs in: :func:`_run_trace` is the one place that opens a trace
and runs invokes; a vLLM or remote backend replaces that function (and :func:`capture`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._models import Adapter, PipatchError, adapter_for, first

__all__ = ["Metric", "Sweep", "Plan", "Capture", "capture", "run_sweep", "execute", "top_predictions", "EngineError"]


class EngineError(RuntimeError):
    """A batch failed. ``partial`` holds the result with every finished row kept."""

    def __init__(self, message: str, partial: Any = None):
        super().__init__(message)
        self.partial = partial


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------

METRICS = ("logit_diff", "prob", "logprob")


@dataclass(frozen=True)
class Metric:
    """A number read off the last position's logits.

    ``prob`` and ``logprob`` of ``answer`` need the whole vocabulary (for the softmax);
    ``logit_diff`` (answer − foil) needs two rows of the unembedding only.
    """

    name: str
    answer: int
    foil: int | None = None

    @property
    def token_ids(self) -> list[int] | None:
        """Vocabulary rows the metric reads, or ``None`` for all of them."""
        return [self.answer, self.foil] if self.name == "logit_diff" else None

    def from_logits(self, logits: torch.Tensor, subset: bool = False) -> torch.Tensor:
        """``logits``: [batch, vocab] (or [batch, 2] when ``subset``) → [batch] float32."""
        logits = logits.float()
        if self.name == "logit_diff":
            if subset:
                return logits[:, 0] - logits[:, 1]
            return logits[:, self.answer] - logits[:, self.foil]
        logp = torch.log_softmax(logits, dim=-1)[:, self.answer]
        return logp.exp() if self.name == "prob" else logp

    def from_hidden(self, model, adapter: Adapter, hidden: torch.Tensor, chunk: int = 32) -> torch.Tensor:
        """The metric from the unembedding's input at the last position, [batch, d] → [batch]."""
        out = []
        for start in range(0, hidden.shape[0], chunk):
            part = adapter.logits(model, hidden[start : start + chunk], self.token_ids)
            out.append(self.from_logits(part, subset=self.token_ids is not None))
        return torch.cat(out) if out else torch.zeros(0)


# --------------------------------------------------------------------------------------------
# Capturing runs
# --------------------------------------------------------------------------------------------


@dataclass
class Capture:
    """What one traced run (or a batch of ``n`` runs, e.g. one per noise seed) leaves behind.

    ``blocks[l]`` is block ``l``'s raw output (tensor or tuple) for the whole batch, as the
    engine must hand it back to ``skip()``. ``sites[site][l]`` is the site value, [n, T, width].
    ``metric`` is [n].
    """

    blocks: list[Any]
    sites: dict[str, list[torch.Tensor]]
    metric: torch.Tensor
    embedded: torch.Tensor
    prob: torch.Tensor

    def block_for(self, layer: int, row: int) -> Any:
        """Block ``layer``'s output for batch row ``row`` only, in the block's own structure."""
        value = self.blocks[layer]
        if isinstance(value, tuple):
            return (value[0][row : row + 1],) + tuple(
                v[row : row + 1] if isinstance(v, torch.Tensor) and v.shape[:1] == value[0].shape[:1] else v
                for v in value[1:]
            )
        return value[row : row + 1]


def _site_value(adapter: Adapter, model, site: str, layer: int):
    module = adapter.site_module(model, site, layer)
    return module.input if site == "head" else first(module.output)


def capture(
    model,
    input_ids: torch.Tensor,
    metric: Metric,
    *,
    sites: tuple[str, ...] = ("resid",),
    noise: torch.Tensor | None = None,
    noise_positions: list[int] | None = None,
) -> Capture:
    """Run ``input_ids`` ([1, T]) once per noise draw and keep every block output and site.

    Parameters
    ----------
    noise
        [n, len(noise_positions), d]: each invoke adds one draw to the embedding output at
        ``noise_positions`` (causal tracing's corrupted runs). ``None``: one clean run.
    sites
        Which site values to keep besides the block outputs (``attn``, ``mlp``, ``head``).
    """
    adapter = adapter_for(model)
    n = 1 if noise is None else noise.shape[0]
    layers = range(adapter.n_layers)
    keep = [s for s in sites if s != "resid"]
    with torch.no_grad(), model.trace(**adapter.trace_kwargs) as tracer:
        runs = list().save()
        for i in range(n):
            with tracer.invoke(input_ids):
                embedded = adapter.embedding(model).output
                if noise is not None:
                    embedded[:, noise_positions] += noise[i].to(embedded.dtype)
                embedded_copy = embedded.clone()
                blocks = []
                values = {s: [] for s in keep}
                for layer in layers:
                    for s in ("head", "attn", "mlp"):  # the order the forward pass computes them
                        if s in keep:
                            values[s].append(_site_value(adapter, model, s, layer).clone())
                    out = adapter.block(model, layer).output
                    blocks.append(tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                                  if isinstance(out, tuple) else out.clone())
                logits = model.output.logits[:, -1].float()
                runs.append((blocks, values, logits, embedded_copy))
    blocks = [_cat([r[0][layer] for r in runs]) for layer in layers]
    values = {s: [torch.cat([r[1][s][layer] for r in runs]) for layer in layers] for s in keep}
    values["resid"] = [first(b) for b in blocks]
    logits = torch.cat([r[2] for r in runs])
    return Capture(
        blocks=blocks, sites=values, metric=metric.from_logits(logits),
        embedded=torch.cat([r[3] for r in runs]),
        prob=logits.softmax(-1)[:, metric.answer],
    )


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat([p[i] for p in parts]) if isinstance(parts[0][i], torch.Tensor) else parts[0][i]
            for i in range(len(parts[0]))
        )
    return torch.cat(parts)


# --------------------------------------------------------------------------------------------
# Sweeps
# --------------------------------------------------------------------------------------------


@dataclass
class Sweep:
    """One grid to fill: rows are layers, columns are positions (or heads for ``site="head"``).

    Cell ``(layer, col)`` for base run ``seed`` writes the donor's value of ``site`` at layers
    ``layer .. layer + window - 1`` (clipped to the model), at position ``columns[col]`` — or,
    for heads, head ``col``'s slice of ``z`` at ``positions`` — into base run ``seed``.

    ``donor[site][layer]`` is [n_donor, T, width] with ``n_donor`` 1 (shared by every seed)
    or equal to the number of base runs (the corrupt-run control: each seed its own states).
    """

    view: str
    site: str
    input_ids: torch.Tensor
    columns: list[int]
    positions: list[int]
    window: int
    base: Capture
    donor: dict[str, list[torch.Tensor]]
    metric: Metric
    noise: torch.Tensor | None = None
    noise_positions: list[int] | None = None
    prune: bool = True

    @property
    def n_seeds(self) -> int:
        return int(self.base.metric.shape[0])


@dataclass
class _Cell:
    layer: int
    col: int
    seed: int


def _writes(sweep: Sweep, adapter: Adapter, cell: _Cell):
    """(layer, index, donor value) triples one cell writes; index is what ``value[index]`` takes."""
    donor_seed = cell.seed if sweep.donor[sweep.site][0].shape[0] > 1 else 0
    out = []
    if sweep.site == "head":
        lo = cell.col * adapter.head_dim
        index = (slice(None), sweep.positions, slice(lo, lo + adapter.head_dim))
        value = sweep.donor["head"][cell.layer][donor_seed : donor_seed + 1][index]
        out.append((cell.layer, index, value))
        return out
    pos = sweep.columns[cell.col]
    last = min(cell.layer + sweep.window, adapter.n_layers)
    for layer in range(cell.layer, last):
        index = (slice(None), pos)
        out.append((layer, index, sweep.donor[sweep.site][layer][donor_seed : donor_seed + 1][index]))
    return out


def _is_noop(sweep: Sweep, writes, seed: int) -> bool:
    """True when every write puts back the value the base run already has there."""
    base_sites = sweep.base.sites[sweep.site]
    for layer, index, value in writes:
        current = base_sites[layer][seed : seed + 1][index]
        if not torch.allclose(current, value, rtol=1e-6, atol=1e-7):
            return False
    return True


def _run_trace(model, adapter: Adapter, sweep: Sweep, layer: int, cells: list[_Cell], fast: bool,
               raw_logits: bool = False) -> torch.Tensor:
    """Run ``cells`` (all starting at ``layer``) as invokes of one trace → metric per cell.

    ``raw_logits=True`` (with ``fast=False``) returns the last position's logits instead.
    """
    site, metric = sweep.site, sweep.metric
    plans = [_writes(sweep, adapter, cell) for cell in cells]
    unembed = adapter.unembedding(model)
    T = sweep.input_ids.shape[1]
    with torch.no_grad(), model.trace() as tracer:
        outs = list().save()
        for cell, writes in zip(cells, plans):
            with tracer.invoke(sweep.input_ids):
                if sweep.noise is not None and (layer == 0 or not fast):
                    embedded = adapter.embedding(model).output
                    embedded[:, sweep.noise_positions] += sweep.noise[cell.seed].to(embedded.dtype)
                if fast:
                    for below in range(layer):
                        adapter.block(model, below).skip(sweep.base.block_for(below, cell.seed))
                for target, index, value in writes:
                    module = adapter.site_module(model, site, target)
                    if site == "head":
                        module.input[index] = value
                    else:
                        first(module.output)[index] = value
                if fast:
                    final = unembed.input
                    outs.append(final[:, -1])
                    # The logits are computed from ``final`` outside the trace, for the last
                    # position and the metric's rows only; the module returns a placeholder.
                    unembed.skip(torch.zeros(1, T, 1, dtype=final.dtype, device=final.device))
                else:
                    outs.append(model.output.logits[:, -1])
    stacked = torch.cat(list(outs))
    if raw_logits:
        return stacked
    return metric.from_hidden(model, adapter, stacked) if fast else metric.from_logits(stacked)


def top_predictions(model, sweep: Sweep, layer: int, col: int, seed: int = 0, k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` most likely next tokens of one patched run, as ``(token text, probability)``.

    This is what a click on a grid cell shows: the cell's run repeated with full logits.
    """
    adapter = adapter_for(model)
    logits = _run_trace(model, adapter, sweep, layer, [_Cell(layer, col, seed)], fast=False, raw_logits=True)
    probs = logits.float().softmax(-1)[0]
    best = probs.topk(k)
    return [(model.tokenizer.decode([i]), float(p)) for i, p in zip(best.indices.tolist(), best.values.tolist())]


@dataclass
class Plan:
    """A protocol's output: the result to fill and the sweeps that fill it, not yet run.

    ``plan.run(model)`` runs it; a front end keeps the plan to answer clicks
    (:func:`top_predictions` needs the sweep) and to drive live updates.
    """

    result: Any
    sweeps: list[Sweep]
    batch_size: int
    fast: bool = True
    model: Any = None

    def run(self, model=None, *, on_row=None, stop=None):
        return execute(model or self.model, self.sweeps, self.result, batch_size=self.batch_size, fast=self.fast,
                       on_row=on_row, stop=stop)

    @property
    def total_rows(self) -> int:
        return sum(len(self.result.layers) for _ in self.sweeps)

    def predictor(self):
        model, sweeps = self.model, {s.view: s for s in self.sweeps}

        def predict(view, row, col, seed=0, k=5):
            return top_predictions(model, sweeps[view], layer=row, col=col, seed=seed, k=k)

        return predict

    def sweep(self, view: str) -> Sweep:
        return next(s for s in self.sweeps if s.view == view)


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def run_sweep(
    model,
    sweep: Sweep,
    out: torch.Tensor,
    *,
    batch_size: int,
    fast: bool = True,
    on_row: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    stats: dict[str, int] | None = None,
) -> int:
    """Fill ``out`` ([seeds, layers, cols], raw metric) row by row; return rows finished.

    Rows are finished in layer order. Between batches ``should_stop()`` is asked; when it says
    yes the function returns early (rows already finished stay in ``out``). A batch that runs
    out of memory is halved and retried. Any other failure raises :class:`EngineError` naming
    the batch; ``out`` keeps every finished row.
    """
    adapter = adapter_for(model)
    stats = stats if stats is not None else {}
    for key in ("cells", "noop_cells", "traces", "max_invokes"):
        stats.setdefault(key, 0)
    n_rows, n_cols = out.shape[1], out.shape[2]
    for layer in range(n_rows):
        cells = []
        for col in range(n_cols):
            for seed in range(sweep.n_seeds):
                cell = _Cell(layer, col, seed)
                stats["cells"] += 1
                if sweep.prune and _is_noop(sweep, _writes(sweep, adapter, cell), seed):
                    out[seed, layer, col] = sweep.base.metric[seed]
                    stats["noop_cells"] += 1
                else:
                    cells.append(cell)
        size = batch_size
        start = 0
        batch_no = 0
        while start < len(cells):
            if should_stop is not None and should_stop():
                return layer
            batch = cells[start : start + size]
            try:
                values = _run_trace(model, adapter, sweep, layer, batch, fast)
            except Exception as error:  # noqa: BLE001 - re-raised with the batch named
                if _is_oom(error) and size > 1:
                    size = max(1, size // 2)
                    continue
                raise EngineError(
                    f"{sweep.view}: batch {batch_no + 1} of layer {layer} ({len(batch)} cells) failed: "
                    f"{type(error).__name__}: {error}"
                ) from error
            stats["traces"] += 1
            stats["max_invokes"] = max(stats["max_invokes"], len(batch))
            for cell, value in zip(batch, values.tolist()):
                if not math.isfinite(value):
                    # NaN/Inf from the model itself: store NaN, flag the row (once).
                    value = float("nan")
                    flagged = stats.setdefault("nonfinite_rows", [])
                    if [sweep.view, layer] not in flagged:
                        flagged.append([sweep.view, layer])
                out[cell.seed, cell.layer, cell.col] = value
            start += len(batch)
            batch_no += 1
        if on_row is not None:
            on_row(layer)
    return n_rows


def auto_batch_size(n_tokens: int, budget_tokens: int = 4096, cap: int = 256) -> int:
    """Invokes per trace so that one batch holds about ``budget_tokens`` token positions."""
    return max(1, min(cap, budget_tokens // max(1, n_tokens)))


def check_batch_size(batch_size: int | None, n_tokens: int) -> int:
    if batch_size is None:
        return auto_batch_size(n_tokens)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PipatchError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


def now() -> float:
    return time.perf_counter()


def _stop_check(stop: Any) -> Callable[[], bool] | None:
    if stop is None:
        return None
    if hasattr(stop, "is_set"):
        return stop.is_set
    if callable(stop):
        return stop
    raise PipatchError("stop must be a threading.Event or a function returning True to stop")


def execute(
    model,
    sweeps: list[Sweep],
    result: Any,
    *,
    batch_size: int,
    fast: bool = True,
    on_row: Callable[[Any, str, int], None] | None = None,
    stop: Any = None,
) -> Any:
    """Run every sweep into ``result`` (its ``raw``/``rows_done``/``status`` are filled in).

    ``on_row(result, view, layer)`` is called after each finished row. ``stop`` (an Event or
    a function) is checked between batches: the run ends ``"stopped"``. Ctrl-C / a kernel
    interrupt ends it ``"interrupted"``. Either way the finished rows are kept and ``result`` is
    returned; a failing batch raises :class:`EngineError` with the partial result attached.
    """
    should_stop = _stop_check(stop)
    started = now()
    stats = result.meta.setdefault("engine", {})
    stats.update({"batch_size": batch_size, "fast": fast})
    result.status = "running"
    for sweep in sweeps:
        result.rows_done[sweep.view] = 0
    try:
        for sweep in sweeps:
            out = result.raw[sweep.view]

            def row_done(layer: int, view: str = sweep.view) -> None:
                result.rows_done[view] = layer + 1
                result.meta["elapsed"] = now() - started
                if on_row is not None:
                    on_row(result, view, layer)

            finished = run_sweep(model, sweep, out, batch_size=batch_size, fast=fast,
                                 on_row=row_done, should_stop=should_stop, stats=stats)
            if finished < out.shape[1]:
                result.status = "stopped"
                result.message = f"stopped by request after {sum(result.rows_done.values())} row(s)"
                break
        else:
            result.status = "done"
    except KeyboardInterrupt:
        result.status = "interrupted"
        result.message = f"interrupted after {sum(result.rows_done.values())} row(s); finished rows are kept"
    except EngineError as error:
        result.status = "failed"
        result.message = str(error)
        error.partial = result
        result.meta["elapsed"] = now() - started
        raise
    result.meta["elapsed"] = now() - started
    for view, layer in stats.get("nonfinite_rows", []):
        result.warnings.append(f"{view} row {layer}: the model produced NaN/Inf in some cells (stored as NaN)")
    return result
