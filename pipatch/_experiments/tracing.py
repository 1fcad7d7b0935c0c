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
   the clean state back at that one place, and read P(answer). ``sites="resid"`` restores one
   residual state; ``sites="mlp"`` / ``"attn"`` restore that sublayer's clean output over a
   window of ``window`` layers starting at the row's layer (ROME's severed traces), which
   separates the early MLP site at the subject from the late attention site at the last token.

Each cell is reported as normalized recovery ``(restored − corrupt) / (clean − corrupt)``, per
seed, then averaged; the per-seed grids are kept because one draw is one sample.

A multi-token answer (" New York") is read teacher-forced: every run's input is the prompt
followed by the answer's tokens but the last, noise and restorations touch the prompt's
positions only, and P(answer) is the probability of the whole sequence
(:class:`~pipatch._model.cells.Metric`).

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

from collections.abc import Sequence
from dataclasses import dataclass
from string import Template
from typing import Any

import torch

from .._base.checks import flag, whole_number
from .._engine import Plan, SiteSweep, check_batch_size
from .._model.cells import Base, Capture, Metric, Op
from .._model.declare import PROMPT, Experiment, Param, positive_int
from .._model.models import Adapter, PipatchError
from .._model.sites import ATTN, EMBED, MLP, RESID, Site
from .._model.sites import site as site_named
from .._programs.capture import capture
from .._results import code as _code
from .._results.result import Result
from ._inputs import (
    BATCH_SIZE,
    FAST,
    OCCURRENCE,
    POSITIONS,
    answer_ids,
    answer_meta,
    check_choice,
    check_run_length,
    encode,
    layer_labels,
    model_meta,
    subject_positions,
    sweep_positions,
)

__all__ = ["plan_trace", "noise_draws", "noise_ops", "noise_runs", "check_noise", "Noised", "KINDS", "AUTO_SCALES",
           "DECLARATION"]

AUTO_SCALES = (1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0)
COLLAPSE_FRACTION = 0.1
KINDS = tuple(s.name for s in (RESID, MLP, ATTN))  # the sites a trace restores


def noise_draws(seeds: int, n_positions: int, d_model: int, scale: float, sigma: float) -> torch.Tensor:
    """Seeded Gaussian noise, [seeds, n_positions, d_model]: seed ``s`` always draws the same."""
    draws = []
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        draws.append(torch.randn(n_positions, d_model, generator=generator) * (scale * sigma))
    return torch.stack(draws)


def noise_ops(noise: torch.Tensor, positions: Sequence[int]) -> list[list[Op]]:
    """Noise draws [seeds, len(positions), d] → each seed's ops: its draw *added* to the
    embedding output (:data:`~pipatch._model.sites.EMBED`: what block 0 reads) at ``positions``.
    A backend applies them as it applies any write; the corrupted base run of seed ``s`` is
    the prompt run under ``ops[s]``, and so is every restoration of that seed."""
    index = (slice(None), list(positions))
    return [[Op(EMBED, 0, index, noise[s : s + 1], add=True)] for s in range(noise.shape[0])]


def parse_kinds(sites: str | Sequence[str]) -> list[str]:
    """``"resid,mlp"`` or ``["resid", "mlp"]`` → checked, de-duplicated list of the sites traced."""
    if not isinstance(sites, (str, Sequence)):
        raise PipatchError(f"sites={sites!r}: a trace restores resid, mlp or attn states; trace an SAE's latents "
                           "with pipatch.feature_trace(..., site=sae)")
    kinds = [k.strip() for k in sites.split(",")] if isinstance(sites, str) else list(sites)
    if not kinds:
        raise PipatchError("sites is empty: use resid, mlp, attn or a comma-separated list of them")
    for k in kinds:
        check_choice(k, KINDS, "site")
    return list(dict.fromkeys(kinds))


def check_noise(seeds: Any, scale: Any) -> int:
    """``seeds`` as a whole number ≥ 1; ``scale`` a positive number or ``"auto"`` (one
    :class:`PipatchError` line otherwise)."""
    seeds = whole_number(seeds, "seeds", minimum=1)
    if not (scale == "auto" or (isinstance(scale, (int, float)) and not isinstance(scale, bool))):
        raise PipatchError(f"scale must be a positive number or 'auto', got {scale!r}")
    if scale != "auto" and not scale > 0:
        raise PipatchError(f"scale must be positive, got {scale!r}: noise of scale × σ needs scale > 0")
    return seeds


@dataclass
class Noised:
    """The noised runs of a causal trace: each seed's ops (its draw at the embedding), their
    capture (one batch row per seed), the scale used, every scale tried (``{"scale", "worst",
    "mean"}``) and the warnings of seeds that did not collapse."""

    ops: list[list[Op]]
    capture: Capture
    scale: float
    tried: list[dict]
    warnings: list[str]


def noise_runs(backend: Any, input_ids: torch.Tensor, scorer: Metric, sites: Sequence[Site], subject_at: list[int],
               seeds: int, scale: float | str, sigma: float, clean_prob: float) -> Noised:
    """Noise the subject's embedding outputs (``scale × sigma``, one seeded draw per seed) and
    capture the noised runs, keeping ``sites``; ``scale="auto"``: the smallest of
    :data:`AUTO_SCALES` whose worst seed collapses P(answer) to :data:`COLLAPSE_FRACTION` of
    ``clean_prob`` (the module docstring). Every causal trace's corruption, layers' or latents'."""
    threshold = COLLAPSE_FRACTION * clean_prob
    warnings: list[str] = []
    tried = []

    def corrupt_at(value: float):
        noise = noise_draws(seeds, len(subject_at), backend.adapter.d_model, value, sigma).to(input_ids.device)
        ops = noise_ops(noise, subject_at)
        return ops, capture(backend, input_ids, scorer, sites, ops=ops)

    if scale == "auto":
        chosen = None
        for value in AUTO_SCALES:
            corrupting, corrupt = corrupt_at(value)
            worst, mean = float(corrupt.prob.max()), float(corrupt.prob.mean())
            tried.append({"scale": value, "worst": worst, "mean": mean})
            if worst <= threshold:
                chosen = value
                break
        if chosen is None:
            chosen = AUTO_SCALES[-1]
            warnings.append(
                f"no noise scale up to {chosen:g}σ collapsed every seed (worst P(answer) "
                f"{tried[-1]['worst']:.3g} > {threshold:.3g}); recovery is less reliable — "
                "try a longer subject or another prompt"
            )
        scale_value = chosen
    else:
        scale_value = float(scale)
        corrupting, corrupt = corrupt_at(scale_value)
        tried.append({"scale": scale_value, "worst": float(corrupt.prob.max()), "mean": float(corrupt.prob.mean())})
    failed = [i for i, p in enumerate(corrupt.prob.tolist()) if p > threshold]
    if failed:
        warnings.append(
            f"seed(s) {', '.join(map(str, failed))} did not corrupt the answer at {scale_value:g}σ "
            f"(P(answer) above {threshold:.3g}); raise the scale or drop them"
        )
    return Noised(corrupting, corrupt, scale_value, tried, warnings)


def plan_trace(
    backend,
    prompt: str,
    *,
    subject: str | Sequence[int],
    occurrence: int | str | None,
    answer: str,
    positions: Sequence[int] | None,
    seeds: int,
    scale: float | str,
    sites: str | Sequence[str],
    window: int,
    metric: str,
    control: bool,
    batch_size: int | None,
    fast: bool,
) -> Plan:
    """Check the inputs and run the baselines; return the :class:`Plan` of the sweep.

    ``backend`` runs the model (:mod:`pipatch._backends`); the other parameters are
    :func:`pipatch.trace`'s (their defaults are :data:`DECLARATION`'s).
    """
    kinds = parse_kinds(sites)
    check_choice(metric, ("prob", "logprob"), "metric for tracing")
    seeds, window = check_noise(seeds, scale), whole_number(window, "window", minimum=1)
    control, fast = flag(control, "control"), flag(fast, "fast")
    adapter = backend.adapter
    sites = [site_named(k, adapter) for k in kinds]
    input_ids, tokens, offsets = encode(backend, prompt)
    subject_at = subject_positions(subject, prompt, tokens, offsets, occurrence)
    cols = sweep_positions(positions, input_ids.shape[1])
    batch = check_batch_size(batch_size, input_ids.shape[1], backend)
    scorer = Metric(metric, answer_ids(backend, answer, "answer", prompt))
    check_run_length(backend, input_ids, scorer)

    clean = capture(backend, input_ids, scorer, sites)
    sigma = float(clean.embedded[0, subject_at].float().std())
    clean_prob = float(clean.prob[0])
    noised = noise_runs(backend, input_ids, scorer, sites, subject_at, seeds, scale, sigma, clean_prob)
    corrupt, scale_value = noised.capture, noised.scale

    n_layers = adapter.n_layers
    raw = {k: torch.full((seeds, n_layers, len(cols)), float("nan")) for k in kinds}
    meta = model_meta(backend)
    meta.update({
        "prompt": prompt, "subject": subject if isinstance(subject, str) else list(subject),
        "subject_positions": subject_at, "answer": answer, **answer_meta(backend, "answer", scorer.answer),
        "seeds": seeds,
        "scale": scale_value, "scale_requested": scale, "sigma": sigma, "scales": noised.tried,
        "collapse_fraction": COLLAPSE_FRACTION, "window": window, "kinds": kinds, "control": control,
        "clean_prob": clean_prob, "corrupt_prob": corrupt.prob.tolist(), "site": RESID.name, "col_axis": RESID.axis,
        "positions": cols,
    })
    result = Result(
        kind="trace", tokens=tokens, columns=[tokens[p] for p in cols], layers=layer_labels(backend), metric=metric,
        raw=raw, clean=float(clean.metric[0]), corrupt=corrupt.metric.detach().float().cpu(),
        meta=meta, warnings=noised.warnings,
    )
    donor = corrupt.sites if control else clean.sites
    base = Base(input_ids, corrupt, ops=noised.ops)
    sweeps = [
        SiteSweep(view=s.name, base=base, metric=scorer, n_rows=n_layers, n_cols=len(cols), prune=not control,
                  agrees_before=min(subject_at),
                  site=s, adapter=adapter, donor=donor[s.name], columns=cols,
                  window=window if s.sublayer else 1)
        for s in sites
    ]
    plan = Plan(backend, result, sweeps, batch, fast)
    plan.narrow = "positions= (the subject's and the last few), fewer seeds=, or fewer sites="
    return plan


# --------------------------------------------------------------------------------------------
# The declaration, and its part of ``Result.code()``'s script
# --------------------------------------------------------------------------------------------

_TRACE = Template('''

KINDS = $kinds  # in forward order: attention, MLP, then the block's output
WINDOW = $window  # layers restored together for the attn / mlp kinds (ROME's severed traces)
SEEDS = $seeds
CONTROL = $control  # True: restore from the corrupt run's own states (recovery must stay 0)


def causal_trace(prompt, subject, answer, scale, positions):
    """ROME causal tracing of `prompt`: noise the `subject` token positions' embeddings, restore
    one clean state per (layer, position of `positions`). Returns ({kind: metric [seeds, layers,
    positions]}, clean metric, corrupt metric [seeds])."""
    input_ids = tokens(prompt)
    T = input_ids.shape[1]
    positions = range(T) if positions is None else positions
    embed = model.$embed

    # 1. Clean run: every state a restoration writes back, and the embeddings the subject uses.
    with model.trace(input_ids, **LAST_ONLY):
        embedded = embed.output.clone().save()
        clean_states = nnsight.save({kind: [] for kind in KINDS})
        for layer in range(n_layers):
            for kind in KINDS:
                clean_states[kind].append(site(kind, layer).clone())
        clean = metric(model.output.logits[0, -1], answer).save()

    # 2. Noise of scale × σ on the subject's embedding outputs, σ their spread in the clean run;
    #    one seeded draw per seed, made once, so every restoration of a seed sees the same noise.
    sigma = float(embedded[0, subject].float().std())
    d_model = embedded.shape[-1]
    noise = [
        (torch.randn(len(subject), d_model, generator=torch.Generator().manual_seed(seed)) * (scale * sigma))
        .to(DEVICE)
        for seed in range(SEEDS)
    ]
    with model.trace(**LAST_ONLY) as tracer:
        corrupt = nnsight.save([])
        corrupt_states = nnsight.save([])
        for seed in range(SEEDS):
            with tracer.invoke(input_ids):
                embedded = embed.output
                embedded[:, subject] += noise[seed].to(embedded.dtype)
                states = {kind: [] for kind in KINDS}
                for layer in range(n_layers):
                    for kind in KINDS:
                        states[kind].append(site(kind, layer).clone())
                corrupt_states.append(states)
                corrupt.append(metric(model.output.logits[0, -1], answer))
    corrupt = torch.stack(list(corrupt))

    # 3. Restore: the noised run with one clean state (or a window of sublayer outputs) written
    #    back at one position; every (seed, position) of a layer as invokes of one trace.
    raw = {kind: torch.zeros(SEEDS, n_layers, len(positions)) for kind in KINDS}
    for kind in KINDS:
        for layer in range(n_layers):
            window = [layer] if kind == "resid" else range(layer, min(layer + WINDOW, n_layers))
            with model.trace(**LAST_ONLY) as tracer:
                row = nnsight.save([])
                for seed in range(SEEDS):
                    donor = corrupt_states[seed][kind] if CONTROL else clean_states[kind]
                    for pos in positions:
                        with tracer.invoke(input_ids):
                            embedded = embed.output
                            embedded[:, subject] += noise[seed].to(embedded.dtype)
                            for w in window:
                                site(kind, w)[:, pos] = donor[w][:, pos]
                            row.append(metric(model.output.logits[0, -1], answer))
            raw[kind][:, layer] = torch.stack(list(row)).reshape(SEEDS, len(positions))
    return raw, clean, corrupt
''')


def _code_part(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Causal tracing's part of ``Result.code()``'s script (assembled by :func:`pipatch._results.code.script`):
    the name of the script's function, its code, the sites it reads (in forward order, as its
    ``KINDS``), and a summary for the script's docstring.

    ``causal_trace`` does the three runs the plain way. Its noise is drawn as :func:`noise_draws`
    draws it (one ``torch.Generator().manual_seed(seed)`` per seed, ``randn × scale × σ``), with σ
    recomputed from the clean run's embedding outputs on the subject, as :func:`plan_trace`
    measures it; each restoration is one invoke, a layer's (seed, position) cells one trace.
    """
    meta = result.meta
    # In forward order (attention, MLP, then the block's output), as the script's KINDS say.
    traced = sorted((site_named(name) for name in meta.get("kinds") or result.views), key=lambda s: s.order)
    code = _TRACE.substitute(kinds=repr([s.name for s in traced]), window=int(meta["window"]),
                             seeds=int(meta["seeds"]), control=bool(meta.get("control")),
                             embed=_code.dotted_path(adapter.embed, "embedding"))
    summary = (f"noise the subject's embeddings ({int(meta['seeds'])} seeded draws), restore one clean state per\n"
               "(layer, position), average normalized recovery over the seeds.")
    return "causal_trace", code, traced, summary


def _code_inputs(meta: dict) -> dict[str, Any]:
    """One causal trace's inputs to the script's ``causal_trace``: the prompt, the subject's
    token positions, the answer's id and the noise scale."""
    return {"prompt": meta["prompt"], "subject": list(meta["subject_positions"]), "answer": int(meta["answer_id"]),
            "scale": float(meta["scale"]), "positions": meta.get("positions")}


def parse_scale(value: str) -> float | str:
    """A positive number, or ``auto``."""
    if value == "auto":
        return value
    try:
        number = float(value)
    except ValueError:
        raise PipatchError(f"{value!r} is neither a number nor 'auto'") from None
    if not number > 0:  # also refuses NaN
        raise PipatchError(f"must be positive, got {value}")
    return number


def _title(meta: dict) -> str:
    return f"Causal trace · {meta.get('model', '?')} · subject {meta.get('subject', '')!r} → {meta.get('answer', '')!r}"


DECLARATION = Experiment(
    name="trace", kind="trace", noun="causal trace",
    summary="Causal tracing (ROME): noise the subject's embeddings, restore clean states layer by layer.",
    planner=plan_trace, prompts=PROMPT, title=_title,
    params=(
        Param("subject", help="the subject's text as it appears in the prompt (every token overlapping it is "
              "noised), or a list of token indices", annotation="str | Sequence[int]", per_prompt=True),
        OCCURRENCE,
        Param("answer", help="the expected continuation, e.g. ' Paris' or ' New York' (several tokens are read "
              "teacher-forced: P of the whole sequence)", annotation="str | Sequence[str]", per_prompt=True),
        POSITIONS,
        Param("seeds", 10, "noise draws averaged over", "int", parse=positive_int),
        Param("scale", "auto", "noise scale in units of σ, or auto (the smallest that collapses every seed)",
              "float | str", parse=parse_scale),
        Param("sites", "resid", "resid, mlp, attn or a comma-separated list: one grid each", "str | Sequence[str]",
              aliases=("kind",)),
        Param("window", 10, "layers restored together for mlp / attn", "int", parse=positive_int),
        Param("metric", "prob", "prob or logprob of the answer", "str"),
        Param("control", False, "restore from the corrupt run itself (a control that must give 0)", "bool",
              switch=True),
        BATCH_SIZE, FAST,
    ),
    example='%%trace --subject "Eiffel Tower" --answer " Paris" -o eiffel\nThe Eiffel Tower is in the city of',
    doc="""
    Returns
    -------
    Result
        ``result.grid`` is tensor[layers, positions swept] of mean normalized recovery (see
        :mod:`pipatch._experiments.tracing`); ``result.per_seed`` keeps every seed's grid.

    Raises
    ------
    PipatchError
        One line for bad input, such as a subject whose text occurs more than once in the
        prompt without ``occurrence=``. A sweep the cost model puts above a minute is announced
        first in one line (a :class:`~pipatch._base.errors.PipatchWarning`) naming ``positions=``.
    """,
    code=_code_part, code_inputs=_code_inputs,
)
