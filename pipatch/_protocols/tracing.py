"""ROME-style causal tracing (Meng et al., 2022): where in the network is a fact carried?

The protocol is three kinds of run on one prompt:

1. **Clean.** Run the prompt; keep every block's output (the residual stream), every sublayer
   output, and P(answer).
2. **Corrupt.** Add Gaussian noise to the *embedding outputs* of the subject's tokens, one draw
   per seed. The noise is ``scale × σ`` where σ is the standard deviation of the embedding
   outputs on the subject's tokens — what block 0 actually reads (Gemma multiplies embeddings
   by √d inside its embedding module, so σ of the weight matrix would be wrong by that factor).
   Each seed's draw is made once, outside every trace, so all restorations of a seed see the
   identical corruption.
3. **Restore.** For every (layer, position) and every seed, rerun the corrupt input but paste
   the clean state back at that one place, and read P(answer). ``kind="resid"`` restores one
   residual state; ``kind="mlp"`` / ``"attn"`` restore that sublayer's clean output over a
   window of ``window`` layers starting at the row's layer (ROME's severed traces), which
   separates the early MLP site at the subject from the late attention site at the last token.

Each cell is reported as normalized recovery ``(restored − corrupt) / (clean − corrupt)``, per
seed, then averaged; the per-seed grids are kept because one draw is one sample.

**Choosing the scale.** ``scale="auto"`` tries :data:`AUTO_SCALES` in order and takes the
smallest whose *worst* seed collapses the answer: P(answer) ≤ :data:`COLLAPSE_FRACTION` × the
clean P(answer) on every seed. Judging by the mean would hide a seed that barely corrupts —
its recovery denominator is near zero and it dominates any average. Every scale tried is
recorded (worst and mean) in ``result.meta["scales"]``.

**The control that can fail.** ``control=True`` restores from the corrupt run's *own* states
instead of the clean ones. A correctly wired sweep leaves the metric where it was: recovery 0
everywhere. (Restoring the last position at the last layer is *not* such a check: it
reproduces the donor by construction, whichever run the donor came from.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._engine import Metric, Plan, Sweep, capture, check_batch_size
from .._models import PipatchError, adapter_for
from .._result import Result
from ._inputs import check_choice, encode, layer_labels, model_meta, single_token, subject_positions

AUTO_SCALES = (1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0)
COLLAPSE_FRACTION = 0.1
KINDS = ("resid", "mlp", "attn")


def noise_draws(seeds: int, n_positions: int, d_model: int, scale: float, sigma: float) -> torch.Tensor:
    """Seeded Gaussian noise, [seeds, n_positions, d_model]: seed ``s`` always draws the same."""
    draws = []
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        draws.append(torch.randn(n_positions, d_model, generator=generator) * (scale * sigma))
    return torch.stack(draws)


def _kinds(kind: str | Sequence[str]) -> list[str]:
    kinds = [k.strip() for k in kind.split(",")] if isinstance(kind, str) else list(kind)
    if not kinds:
        raise PipatchError("kind is empty: use resid, mlp, attn or a comma-separated list of them")
    for k in kinds:
        check_choice(k, KINDS, "kind")
    return list(dict.fromkeys(kinds))


def trace(
    model,
    prompt: str | Sequence[str],
    *,
    subject: str | Sequence[int],
    answer: str,
    seeds: int = 10,
    scale: float | str = "auto",
    kind: str | Sequence[str] = "resid",
    window: int = 10,
    metric: str = "prob",
    control: bool = False,
    batch_size: int | None = None,
    on_row: Callable[[Result, str, int], None] | None = None,
    stop: Any = None,
    fast: bool = True,
) -> Result:
    """Causal tracing of ``answer`` on ``prompt`` with the ``subject`` noised.

    Parameters
    ----------
    model
        An nnsight model (from :func:`pipatch.load_model` or built by the caller).
    prompt
        The text whose next token should be ``answer``; or a list of prompts, averaged over
        named positions (see :mod:`pipatch._protocols.dataset`), with ``subject`` and
        ``answer`` given once or once per prompt.
    subject
        The subject's text as it appears in ``prompt`` (every token overlapping it is noised,
        BPE pieces included) or a list of token indices.
    answer
        One token, e.g. ``" Paris"``.
    seeds
        Number of noise draws; recovery is averaged over them.
    scale
        Noise scale in units of σ, or ``"auto"`` (see the module docstring).
    kind
        ``"resid"``, ``"mlp"``, ``"attn"`` or several (``"resid,mlp,attn"``): one grid each.
    window
        Layers restored together for ``mlp`` / ``attn``.
    metric
        ``"prob"`` (ROME), ``"logprob"``.
    control
        Restore from the corrupt run's own states (must give recovery 0 everywhere).
    batch_size
        Invokes per trace (default: sized to about 4,096 token positions per batch).
    on_row
        Called as ``on_row(result, view, layer)`` after each finished row.
    stop
        A ``threading.Event`` or function; when set the sweep stops after the current batch.
    fast
        Use the engine's exact shortcuts (reuse below the patch, last-position unembedding).

    Returns
    -------
    Result
        ``result.grid`` is tensor[layers, tokens] of mean normalized recovery.
    """
    if isinstance(prompt, (list, tuple)):
        from .dataset import trace_many

        return trace_many(model, prompt, subject=subject, answer=answer, seeds=seeds, scale=scale, kind=kind,
                          window=window, metric=metric, control=control, batch_size=batch_size, on_row=on_row,
                          stop=stop, fast=fast)
    plan = plan_trace(model, prompt, subject=subject, answer=answer, seeds=seeds, scale=scale, kind=kind,
                      window=window, metric=metric, control=control, batch_size=batch_size, fast=fast)
    return plan.run(model, on_row=on_row, stop=stop)


def plan_trace(
    model,
    prompt: str,
    *,
    subject: str | Sequence[int],
    answer: str,
    seeds: int = 10,
    scale: float | str = "auto",
    kind: str | Sequence[str] = "resid",
    window: int = 10,
    metric: str = "prob",
    control: bool = False,
    batch_size: int | None = None,
    fast: bool = True,
) -> Plan:
    """Check the inputs and run the baselines; return the :class:`Plan` of the sweep (see :func:`trace`)."""
    kinds = _kinds(kind)
    check_choice(metric, ("prob", "logprob"), "metric for tracing")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise PipatchError(f"seeds must be a whole number ≥ 1, got {seeds!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise PipatchError(f"window must be a whole number ≥ 1, got {window!r}")
    if not (scale == "auto" or (isinstance(scale, (int, float)) and not isinstance(scale, bool))):
        raise PipatchError(f"scale must be a positive number or 'auto', got {scale!r}")
    if scale != "auto" and not scale > 0:
        raise PipatchError(f"scale must be positive, got {scale!r}: noise of scale × σ needs scale > 0")
    adapter = adapter_for(model)
    input_ids, tokens, offsets = encode(model, prompt)
    positions = subject_positions(subject, prompt, tokens, offsets)
    answer_id = single_token(model, answer, "answer")
    batch = check_batch_size(batch_size, input_ids.shape[1])
    scorer = Metric(metric, answer_id)
    sites = tuple(kinds)

    clean = capture(model, input_ids, scorer, sites=sites)
    sigma = float(clean.embedded[0, positions].float().std())
    clean_prob = float(clean.prob[0])
    threshold = COLLAPSE_FRACTION * clean_prob
    warnings: list[str] = []
    scales_tried = []

    def corrupt_at(value: float):
        noise = noise_draws(seeds, len(positions), adapter.d_model, value, sigma).to(input_ids.device)
        return noise, capture(model, input_ids, scorer, sites=sites, noise=noise, noise_positions=positions)

    if scale == "auto":
        chosen = None
        for value in AUTO_SCALES:
            noise, corrupt = corrupt_at(value)
            worst, mean = float(corrupt.prob.max()), float(corrupt.prob.mean())
            scales_tried.append({"scale": value, "worst": worst, "mean": mean})
            if worst <= threshold:
                chosen = value
                break
        if chosen is None:
            chosen = AUTO_SCALES[-1]
            warnings.append(
                f"no noise scale up to {chosen:g}σ collapsed every seed (worst P(answer) "
                f"{scales_tried[-1]['worst']:.3g} > {threshold:.3g}); recovery is less reliable — "
                "try a longer subject or another prompt"
            )
        scale_value = chosen
    else:
        scale_value = float(scale)
        noise, corrupt = corrupt_at(scale_value)
        scales_tried.append({"scale": scale_value, "worst": float(corrupt.prob.max()), "mean": float(corrupt.prob.mean())})
    failed = [i for i, p in enumerate(corrupt.prob.tolist()) if p > threshold]
    if failed:
        warnings.append(
            f"seed(s) {', '.join(map(str, failed))} did not corrupt the answer at {scale_value:g}σ "
            f"(P(answer) above {threshold:.3g}); raise the scale or drop them"
        )

    n_layers = adapter.n_layers
    raw = {k: torch.full((seeds, n_layers, len(tokens)), float("nan")) for k in kinds}
    meta = model_meta(model)
    meta.update({
        "prompt": prompt, "subject": subject if isinstance(subject, str) else list(subject),
        "subject_positions": positions, "answer": answer, "answer_id": answer_id, "seeds": seeds,
        "scale": scale_value, "scale_requested": scale, "sigma": sigma, "scales": scales_tried,
        "collapse_fraction": COLLAPSE_FRACTION, "window": window, "kinds": kinds, "control": control,
        "clean_prob": clean_prob, "corrupt_prob": corrupt.prob.tolist(), "site": "resid",
    })
    result = Result(
        kind="trace", tokens=tokens, columns=list(tokens), layers=layer_labels(model), metric=metric,
        raw=raw, clean=float(clean.metric[0]), corrupt=corrupt.metric.detach().float().cpu(),
        meta=meta, warnings=warnings,
    )
    donor = corrupt.sites if control else clean.sites
    sweeps = [
        Sweep(view=k, site=k, input_ids=input_ids, columns=list(range(len(tokens))), positions=[],
              window=1 if k == "resid" else window, base=corrupt, donor=donor, metric=scorer,
              noise=noise, noise_positions=positions, prune=not control)
        for k in kinds
    ]
    return Plan(result, sweeps, batch, fast)
