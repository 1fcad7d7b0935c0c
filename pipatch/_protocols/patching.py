"""Activation patching: paste an activation from one prompt's run into another's.

Take a *clean* prompt and a *corrupt* prompt that differ in one respect that changes the
answer ("The Eiffel Tower is in the city of" / "The Colosseum is in the city of"), of equal
token length so that position ``p`` means the same slot in both. Then, at one site at a time,

* ``direction="denoise"``: run the corrupt prompt and paste in the clean activation. Asks
  whether the site is *sufficient* to restore the answer (the causal-tracing direction);
* ``direction="noise"``: run the clean prompt and paste in the corrupt activation. Asks whether
  the site is *necessary*; results are usually sparser;
* ``direction="zero"`` / ``"mean"``: run the clean prompt and replace the activation with zeros
  or with its mean over ``mean_prompts`` (ablations; zero is off-distribution, mean is the
  better-behaved default).

Sites: ``resid`` (a block's output), ``attn`` / ``mlp`` (what that sublayer adds), ``head``
(one head's slice of ``z``, the attention output projection's input; the grid is then
layers × heads, each head patched at ``positions``, all by default).

Metrics, read at the last position: ``logit_diff`` (answer − foil, linear in what the model
computes; the standard choice), ``prob``, ``logprob``. The grid is normalized recovery
``(patched − corrupt) / (clean − corrupt)`` whatever the direction: 1 is the clean run's
behaviour, 0 the corrupt run's. Raw values and both baselines are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._engine import METRICS, Metric, Plan, Sweep, capture, check_batch_size
from .._models import PipatchError, adapter_for
from .._result import Result
from ._inputs import SITES, check_choice, encode, layer_labels, model_meta, single_token, sweep_positions

DIRECTIONS = ("denoise", "noise", "zero", "mean")


@dataclass(frozen=True)
class PairInputs:
    """A checked clean/corrupt pair: token ids [1, T] and texts of both, and the metric."""

    clean_ids: torch.Tensor
    clean_tokens: list[str]
    corrupt_ids: torch.Tensor
    corrupt_tokens: list[str]
    metric: Metric


def pair_inputs(model, clean: str, corrupt: str, answer: str, foil: str | None, metric: str) -> PairInputs:
    """Tokenize and check a clean/corrupt pair and its answer/foil (shared by every pair protocol).

    Raises :class:`PipatchError` when the prompts tokenize to different lengths (showing both
    tokenizations), when ``answer`` or ``foil`` is not one token, or when ``logit_diff`` has no foil.
    """
    clean_ids, clean_tokens, _ = encode(model, clean, "clean prompt")
    corrupt_ids, corrupt_tokens, _ = encode(model, corrupt, "corrupt prompt")
    if len(clean_tokens) != len(corrupt_tokens):
        raise PipatchError(
            f"clean and corrupt prompts must tokenize to the same length so positions line up: "
            f"clean {len(clean_tokens)} tokens {clean_tokens} vs corrupt {len(corrupt_tokens)} tokens "
            f"{corrupt_tokens}; reword one of them"
        )
    answer_id = single_token(model, answer, "answer")
    if metric == "logit_diff" and foil is None:
        raise PipatchError("metric 'logit_diff' needs a foil (answer − foil): pass foil=' Rome', or use metric='prob'")
    foil_id = single_token(model, foil, "foil") if foil is not None else None
    return PairInputs(clean_ids, clean_tokens, corrupt_ids, corrupt_tokens, Metric(metric, answer_id, foil_id))


def patch(
    model,
    *,
    clean: str | Sequence[str],
    corrupt: str | Sequence[str],
    answer: str | Sequence[str],
    foil: str | None = None,
    site: str = "resid",
    metric: str = "logit_diff",
    direction: str = "denoise",
    positions: Sequence[int] | None = None,
    mean_prompts: Sequence[str] | None = None,
    batch_size: int | None = None,
    on_row: Callable[[Result, str, int], None] | None = None,
    stop: Any = None,
    fast: bool = True,
) -> Result:
    """Activation patching of ``site`` at every layer × position (or × head).

    Parameters
    ----------
    clean, corrupt
        Prompts of equal token length; or two lists of such prompts (pairs), averaged over
        named positions (see :mod:`pipatch._protocols.dataset`), with ``answer`` / ``foil``
        given once or once per pair.
    answer, foil
        Single tokens; ``foil`` is required for ``metric="logit_diff"`` (e.g. ``" Rome"``).
    site
        ``"resid"``, ``"attn"``, ``"mlp"`` or ``"head"``.
    metric
        ``"logit_diff"``, ``"prob"`` or ``"logprob"``.
    direction
        ``"denoise"``, ``"noise"``, ``"zero"`` or ``"mean"`` (see the module docstring).
    positions
        Positions to sweep (negative indices allowed); default all. For ``site="head"`` the
        positions at which each head is patched.
    mean_prompts
        For ``direction="mean"``: prompts of the same token length whose activations are
        averaged (default: the clean and corrupt prompts).
    batch_size, on_row, stop, fast
        As for :func:`pipatch.trace`.

    Returns
    -------
    Result
        ``result.grid``: tensor[layers, positions] (or [layers, heads]) of normalized recovery.
    """
    if isinstance(clean, (list, tuple)) or isinstance(corrupt, (list, tuple)):
        from .dataset import patch_many

        if not (isinstance(clean, (list, tuple)) and isinstance(corrupt, (list, tuple)) and len(clean) == len(corrupt)):
            raise PipatchError("for many prompts pass clean and corrupt as lists of the same length")
        return patch_many(model, list(zip(clean, corrupt)), answer=answer, foil=foil, site=site, metric=metric,
                          direction=direction, positions=positions, mean_prompts=mean_prompts,
                          batch_size=batch_size, on_row=on_row, stop=stop, fast=fast)
    plan = plan_patch(model, clean=clean, corrupt=corrupt, answer=answer, foil=foil, site=site, metric=metric,
                      direction=direction, positions=positions, mean_prompts=mean_prompts,
                      batch_size=batch_size, fast=fast)
    return plan.run(model, on_row=on_row, stop=stop)


def plan_patch(
    model,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None = None,
    site: str = "resid",
    metric: str = "logit_diff",
    direction: str = "denoise",
    positions: Sequence[int] | None = None,
    mean_prompts: Sequence[str] | None = None,
    batch_size: int | None = None,
    fast: bool = True,
) -> Plan:
    """Check the inputs and run the baselines; return the :class:`Plan` of the sweep (see :func:`patch`)."""
    check_choice(site, SITES, "site")
    check_choice(metric, METRICS, "metric")
    check_choice(direction, DIRECTIONS, "direction")
    adapter = adapter_for(model)
    adapter.site_module(model, site, 0)  # refuses sublayer sites a family cannot patch
    pair = pair_inputs(model, clean, corrupt, answer, foil, metric)
    clean_ids, clean_tokens, corrupt_ids, corrupt_tokens = pair.clean_ids, pair.clean_tokens, pair.corrupt_ids, pair.corrupt_tokens
    answer_id, foil_id = pair.metric.answer, pair.metric.foil
    T = clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T)
    scorer = pair.metric
    sites = (site,)

    clean_run = capture(model, clean_ids, scorer, sites=sites)
    corrupt_run = capture(model, corrupt_ids, scorer, sites=sites)
    if direction == "denoise":
        base, base_ids, donor = corrupt_run, corrupt_ids, clean_run.sites
    elif direction == "noise":
        base, base_ids, donor = clean_run, clean_ids, corrupt_run.sites
    elif direction == "zero":
        base, base_ids = clean_run, clean_ids
        donor = {site: [torch.zeros_like(t) for t in clean_run.sites[site]]}
    else:
        prompts = list(mean_prompts) if mean_prompts else [clean, corrupt]
        runs = []
        for text in prompts:
            ids, _, _ = encode(model, text, "mean prompt")
            if ids.shape[1] != T:
                raise PipatchError(
                    f"mean prompt {text!r} is {ids.shape[1]} tokens, the clean prompt {T}: "
                    "mean ablation needs prompts of the same token length"
                )
            runs.append(capture(model, ids, scorer, sites=sites))
        donor = {site: [torch.stack([r.sites[site][layer][0] for r in runs]).mean(0, keepdim=True)
                        for layer in range(adapter.n_layers)]}
        base, base_ids = clean_run, clean_ids

    if site == "head":
        columns = [f"H{h}" for h in range(adapter.n_heads)]
        sweep_cols, head_positions = list(range(adapter.n_heads)), cols
    else:
        columns = [clean_tokens[p] for p in cols]
        sweep_cols, head_positions = cols, []
    raw = {site: torch.full((1, adapter.n_layers, len(columns)), float("nan"))}
    meta = model_meta(model)
    meta.update({
        "clean_prompt": clean, "corrupt_prompt": corrupt, "clean_tokens": clean_tokens,
        "corrupt_tokens": corrupt_tokens, "answer": answer, "foil": foil, "answer_id": answer_id,
        "foil_id": foil_id, "site": site, "direction": direction, "positions": cols,
        "mean_prompts": list(mean_prompts) if mean_prompts else None,
    })
    warnings = []
    clean_value, corrupt_value = float(clean_run.metric[0]), float(corrupt_run.metric[0])
    if abs(clean_value - corrupt_value) <= 1e-6 + 1e-3 * max(abs(clean_value), abs(corrupt_value)):
        warnings.append(
            f"clean and corrupt give (almost) the same {metric} ({clean_value:.4g} vs {corrupt_value:.4g}): "
            "normalized recovery is undefined (NaN); raw values are kept — pick prompts that change the answer"
        )
    result = Result(
        kind="patch", tokens=clean_tokens, columns=columns, layers=layer_labels(model), metric=metric,
        raw=raw, clean=clean_value, corrupt=torch.tensor([corrupt_value]), meta=meta, warnings=warnings,
    )
    # For the column → position mapping the engine wants positions; for heads, head indices.
    sweep = Sweep(view=site, site=site, input_ids=base_ids, columns=sweep_cols, positions=head_positions,
                  window=1, base=base, donor=donor, metric=scorer)
    return Plan(result, [sweep], batch, fast)
