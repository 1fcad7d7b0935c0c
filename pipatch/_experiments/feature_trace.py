"""Feature tracing: ROME's causal trace whose rows are an SAE's latents, not layers.

:func:`pipatch.trace` noises the subject's embeddings and restores one clean *layer* state at
one position. With an SAE loaded at a layer (:func:`pipatch.load_sae`), the question becomes
which *latents* carry the fact: the corrupt runs are :func:`pipatch.trace`'s own (the same
seeded noise of ``scale × σ`` on the subject's embedding outputs, the same ``scale="auto"``:
:func:`pipatch._experiments.tracing.noise_runs`), and a cell restores one clean latent value at
one position through the SAE (decode the edited latents, keep the noised run's SAE error), in
every seed's noised run, and reads P(answer).

There are ``n_latents × positions`` cells, so the sweep is :func:`pipatch.feature_patch`'s
(:func:`pipatch._experiments.feature_patch.screen`): each cell is **screened** by attribution,
``(clean − noised) · dM/d latent`` from one gradient pass of each seed's noised run, and the
``top_k`` cells by that estimate averaged over the seeds are **restored exactly** in every
seed, with the error row (``"L6 error"``: the clean run's SAE error restored at one position)
at every position. ``latents=[...]`` restores those latents at every position instead,
``exhaustive=True`` every latent. The grid is mean normalized recovery over the seeds, like a
trace's; each seed's grid is kept (``raw[site]`` [seeds, rows, positions]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .._engine import check_batch_size
from .._model.cells import Base, Metric
from .._model.declare import PROMPT, Experiment
from .._programs.capture import capture
from .._programs.gradients import GRADIENTS
from ._inputs import (
    BATCH_SIZE,
    OCCURRENCE,
    POSITIONS,
    answer_ids,
    answer_meta,
    check_choice,
    check_run_length,
    encode,
    subject_positions,
    sweep_positions,
)
from .attribution import VerifiedPlan
from .feature_patch import (
    EXHAUSTIVE,
    LABELS,
    LATENT_SITE,
    LATENTS,
    TOP_K,
    check_rows,
    latent_plan,
    latent_site_of,
    screen,
)
from .tracing import COLLAPSE_FRACTION, check_noise, noise_runs
from .tracing import DECLARATION as TRACE

__all__ = ["plan_feature_trace", "DECLARATION"]


def plan_feature_trace(
    backend,
    prompt: str,
    *,
    subject: str | Sequence[int],
    occurrence: int | str | None,
    answer: str,
    site: Any,
    metric: str,
    seeds: int,
    scale: float | str,
    top_k: int,
    latents: Sequence[int] | None,
    exhaustive: bool,
    positions: Sequence[int] | None,
    batch_size: int | None,
    labels: Any = None,
) -> VerifiedPlan:
    """Noise the subject, screen every (latent, position) cell of each noised run; plan the
    exact restorations of the chosen ones. ``backend`` runs the model; the other parameters
    are :func:`pipatch.feature_trace`'s."""
    target = latent_site_of(site, backend)
    error = target.error_site
    check_choice(metric, ("prob", "logprob"), "metric for tracing")
    seeds = check_noise(seeds, scale)
    top_k, chosen, exhaustive = check_rows(target, top_k, latents, exhaustive)
    GRADIENTS.check(backend, "trace on backend='transformers' (the default), or patch chosen latents here with "
                             "pipatch.feature_patch(..., scores=result)")  # one line, from what the program needs
    input_ids, tokens, offsets = encode(backend, prompt)
    subject_at = subject_positions(subject, prompt, tokens, offsets, occurrence)
    cols = sweep_positions(positions, input_ids.shape[1])
    batch = check_batch_size(batch_size, input_ids.shape[1], backend)
    scorer = Metric(metric, answer_ids(backend, answer, "answer", prompt))
    check_run_length(backend, input_ids, scorer)

    sites = [target, error]
    clean = capture(backend, input_ids, scorer, sites)
    sigma = float(clean.embedded[0, subject_at].float().std())
    clean_prob = float(clean.prob[0])
    noised = noise_runs(backend, input_ids, scorer, sites, subject_at, seeds, scale, sigma, clean_prob)
    base = Base(input_ids, noised.capture, ops=noised.ops)
    donors = {s.name: clean.sites[s.name][target.layer] for s in sites}
    rows, estimate, only = screen(backend, base, scorer, target, cols, donors, top_k, chosen, exhaustive)
    meta = {
        "prompt": prompt, "subject": subject if isinstance(subject, str) else list(subject),
        "subject_positions": subject_at, "answer": answer, **answer_meta(backend, "answer", scorer.answer),
        "seeds": seeds, "scale": noised.scale, "scale_requested": scale, "sigma": sigma, "scales": noised.tried,
        "collapse_fraction": COLLAPSE_FRACTION, "clean_prob": clean_prob, "corrupt_prob": noised.capture.prob.tolist(),
        "direction": "restore",
    }
    corrupt = noised.capture.metric.detach().float().cpu()
    return latent_plan(backend, "feature_trace", meta, target, rows, estimate, only, base, scorer, donors, cols, tokens,
                       float(clean.metric[0]), corrupt, labels, batch, min(subject_at), top_k=top_k,
                       exhaustive=exhaustive, warnings=noised.warnings)


def _title(meta: dict) -> str:
    return (f"Feature trace · {meta.get('model', '?')} · {meta.get('site', 'latents')} · subject "
            f"{meta.get('subject', '')!r} → {meta.get('answer', '')!r}")


_TRACE = {param.keyword: param for param in TRACE.params}

DECLARATION = Experiment(
    name="feature_trace", kind="feature_trace", noun="feature trace",
    summary="Feature tracing: noise the subject's embeddings, restore clean SAE latents, screened by attribution.",
    planner=plan_feature_trace, prompts=PROMPT, title=_title,
    params=(
        _TRACE["subject"], OCCURRENCE, _TRACE["answer"], LATENT_SITE, _TRACE["metric"], _TRACE["seeds"],
        _TRACE["scale"], replace(TOP_K, help="how many screened (latent, position) cells to restore exactly, largest "
                                 "|estimated effect| over the seeds first"),
        LATENTS, EXHAUSTIVE, replace(POSITIONS, help="the positions (columns) to screen and restore"), BATCH_SIZE,
        LABELS,
    ),
    example='%%feature_trace --site saes/L6 --subject "Eiffel Tower" --answer " Paris" --top-k 10 -o feats\n'
            "The Eiffel Tower is in the city of",
    doc="""
    See :mod:`pipatch._experiments.feature_trace` for the method.

    Returns
    -------
    FeatureTraceResult
        ``kind="feature_trace"``; rows are the latents chosen, then the SAE's error
        (``meta["latents"]``: their ids, ``"error"``), columns the positions. ``raw[site]``
        is tensor[seeds, rows, columns] of ``noised metric + estimated change`` and
        ``result.grid`` its mean normalized recovery. ``meta["verified_values"]`` holds the
        exact restorations (``{"layer": row, "col", "seed", "estimate", "actual"}``, raw metric
        units), ``meta["agreement"]`` their rank correlation with the screening, and
        ``frame()`` one line per (latent, position) cell: ``latent``, ``position``, ``value``,
        ``exact`` (mean recovery over the seeds). The noise is :func:`pipatch.trace`'s:
        ``meta["scale"]``, ``meta["sigma"]`` and ``meta["scales"]`` say which.

    Raises
    ------
    PipatchError
        One line for bad input: no latent site, a bad latent id or ``top_k``, a subject not
        in the prompt, a backend that takes no gradients (vLLM, served).

    Examples
    --------
    >>> sae = pipatch.embedded_sae(model)
    >>> r = pipatch.feature_trace(model, "The Eiffel Tower is in the city of",
    ...                           subject="Eiffel Tower", answer=" Paris", site=sae, top_k=10)
    >>> r.frame().dropna()
    """,
)
