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
computes; the standard choice), ``prob``, ``logprob``. A multi-token answer or foil (" New
York") is read teacher-forced after the prompt, and ``logit_diff`` then becomes the sequences'
log-probability difference, ``logprob_diff`` (:class:`~pipatch._model.cells.Metric`). The grid is normalized recovery
``(patched − corrupt) / (clean − corrupt)`` whatever the direction: 1 is the clean run's
behaviour, 0 the corrupt run's. Raw values and both baselines are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from string import Template
from typing import Any

import torch

from .._base.checks import flag
from .._engine import Plan, SiteSweep, check_batch_size
from .._model.cells import METRICS, Base, Capture, Metric
from .._model.declare import PAIR, Experiment, Param
from .._model.models import Adapter, PipatchError
from .._model.sites import Site
from .._model.sites import site as site_named
from .._programs.capture import captures
from .._results import code as _code
from .._results.result import Result
from ._inputs import (
    BATCH_SIZE,
    FAST,
    METRIC,
    PAIR_PARAMS,
    POSITIONS,
    SITE,
    answer_ids,
    answer_meta,
    check_choice,
    check_run_length,
    encode,
    layer_labels,
    model_meta,
    pair_title,
    sweep_positions,
    undefined_recovery_warning,
)

__all__ = ["plan_patch", "pair_inputs", "PairInputs", "DIRECTIONS", "DIRECTION", "MEAN_PROMPTS", "mean_prompt_ids",
           "direction_base", "direction_donor", "DECLARATION"]

DIRECTIONS = ("denoise", "noise", "zero", "mean")


@dataclass(frozen=True)
class PairInputs:
    """A checked clean/corrupt pair: token ids [1, T] and texts of both, and the metric."""

    clean: str
    corrupt: str
    clean_ids: torch.Tensor
    clean_tokens: list[str]
    corrupt_ids: torch.Tensor
    corrupt_tokens: list[str]
    metric: Metric
    answer: str
    foil: str | None

    def meta(self, backend) -> dict:
        """The pair as a result's metadata records it (the answer's and foil's tokens too)."""
        return {"clean_prompt": self.clean, "corrupt_prompt": self.corrupt, "clean_tokens": self.clean_tokens,
                "corrupt_tokens": self.corrupt_tokens, "answer": self.answer, "foil": self.foil,
                **answer_meta(backend, "answer", self.metric.answer), **answer_meta(backend, "foil", self.metric.foil)}


def pair_inputs(backend, clean: str, corrupt: str, answer: str, foil: str | None, metric: str) -> PairInputs:
    """Tokenize and check a clean/corrupt pair and its answer/foil (shared by every pair protocol).

    Raises :class:`PipatchError` when the prompts tokenize to different lengths (showing both
    tokenizations), when ``answer`` or ``foil`` is no token, when a prompt and the answer do not
    fit the context, or when ``logit_diff`` has no foil. Answers may be several tokens.
    """
    check_choice(metric, METRICS, "metric")
    clean_ids, clean_tokens, _ = encode(backend, clean, "clean prompt")
    corrupt_ids, corrupt_tokens, _ = encode(backend, corrupt, "corrupt prompt")
    if len(clean_tokens) != len(corrupt_tokens):
        raise PipatchError(
            f"clean and corrupt prompts must tokenize to the same length so positions line up: "
            f"clean {len(clean_tokens)} tokens {clean_tokens} vs corrupt {len(corrupt_tokens)} tokens "
            f"{corrupt_tokens}; reword one of them"
        )
    answer_id = answer_ids(backend, answer, "answer", clean)
    if metric in ("logit_diff", "logprob_diff") and foil is None:
        raise PipatchError(f"metric {metric!r} needs a foil (answer − foil): pass foil=' Rome', or use metric='prob'")
    foil_id = answer_ids(backend, foil, "foil", clean) if foil is not None else None
    scorer = Metric(metric, answer_id, foil_id)
    check_run_length(backend, clean_ids, scorer)
    return PairInputs(clean, corrupt, clean_ids, clean_tokens, corrupt_ids, corrupt_tokens, scorer, answer, foil)


def mean_prompt_ids(backend, direction: str, mean_prompts: Sequence[str] | None, pair: PairInputs) -> list[torch.Tensor]:
    """The token ids [1, T] of the prompts a ``mean`` ablation averages over (``mean_prompts``,
    default the pair's two), none for another direction. Each must be the pair's token length
    (one :class:`PipatchError` line otherwise)."""
    if direction != "mean":
        return []
    T, means = pair.clean_ids.shape[1], []
    for text in list(mean_prompts) if mean_prompts else [pair.clean, pair.corrupt]:
        ids, _, _ = encode(backend, text, "mean prompt")
        if ids.shape[1] != T:
            raise PipatchError(
                f"mean prompt {text!r} is {ids.shape[1]} tokens, the clean prompt {T}: "
                "mean ablation needs prompts of the same token length"
            )
        means.append(ids)
    return means


def direction_base(direction: str, pair: PairInputs, clean_run: Capture, corrupt_run: Capture) -> tuple[Capture, torch.Tensor]:
    """The run a ``direction``'s patches write into, and its token ids: the corrupt run to
    denoise, the clean run otherwise (noise, zero and mean ablation)."""
    return (corrupt_run, pair.corrupt_ids) if direction == "denoise" else (clean_run, pair.clean_ids)


def direction_donor(direction: str, clean_run: Capture, corrupt_run: Capture, mean_runs: Sequence[Capture],
                    name: str) -> list[torch.Tensor]:
    """What a ``direction``'s patches write, per layer, of site ``name``: the clean run's
    values (denoise), the corrupt run's (noise), zeros, or the mean over ``mean_runs`` at each
    position (mean ablation)."""
    if direction == "denoise":
        return clean_run.sites[name]
    if direction == "noise":
        return corrupt_run.sites[name]
    if direction == "zero":
        return [torch.zeros_like(t) for t in clean_run.sites[name]]
    return [torch.stack([r.sites[name][layer][0] for r in mean_runs]).mean(0, keepdim=True)
            for layer in range(len(clean_run.sites[name]))]


def plan_patch(
    backend,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None,
    site: str,
    metric: str,
    direction: str,
    positions: Sequence[int] | None,
    mean_prompts: Sequence[str] | None,
    batch_size: int | None,
    fast: bool,
) -> Plan:
    """Check the inputs and run the baselines; return the :class:`Plan` of the sweep.

    ``backend`` runs the model; the other parameters are :func:`pipatch.patch`'s (their
    defaults are :data:`DECLARATION`'s).
    """
    adapter = backend.adapter
    target = site_named(site, adapter)
    check_choice(direction, DIRECTIONS, "direction")
    fast = flag(fast, "fast")
    pair = pair_inputs(backend, clean, corrupt, answer, foil, metric)
    T = pair.clean_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T, backend)
    scorer = pair.metric

    # Every baseline in one trace (the weights read once): clean, corrupt, and the mean prompts.
    means = mean_prompt_ids(backend, direction, mean_prompts, pair)
    clean_run, corrupt_run, *mean_runs = captures(backend, [pair.clean_ids, pair.corrupt_ids, *means], scorer, [target])
    base, base_ids = direction_base(direction, pair, clean_run, corrupt_run)
    donor = direction_donor(direction, clean_run, corrupt_run, mean_runs, target.name)

    columns = target.columns(adapter, pair.clean_tokens, cols)
    raw = {target.name: torch.full((1, adapter.n_layers, len(columns)), float("nan"))}
    meta = model_meta(backend)
    meta.update({**pair.meta(backend), "site": target.name, "col_axis": target.axis, "direction": direction, "positions": cols,
                 "mean_prompts": list(mean_prompts) if mean_prompts else None})
    clean_value, corrupt_value = float(clean_run.metric[0]), float(corrupt_run.metric[0])
    result = Result(
        kind="patch", tokens=pair.clean_tokens, columns=columns, layers=layer_labels(backend), metric=scorer.label,
        raw=raw, clean=clean_value, corrupt=torch.tensor([corrupt_value]), meta=meta,
        warnings=undefined_recovery_warning(scorer.label, clean_value, corrupt_value),
    )
    # Before the first token where the prompts differ, the clean and corrupt runs agree.
    differ = (pair.clean_ids[0] != pair.corrupt_ids[0]).nonzero()
    agrees = (int(differ[0]) if len(differ) else T) if direction in ("denoise", "noise") else 0
    sweep = SiteSweep(view=target.name, base=Base(base_ids, base), metric=scorer, n_rows=adapter.n_layers,
                      n_cols=len(columns), site=target, adapter=adapter, donor=donor, columns=cols, positions=cols,
                      agrees_before=agrees)
    return Plan(backend, result, [sweep], batch, fast)


# --------------------------------------------------------------------------------------------
# The declaration, and its part of ``Result.code()``'s script
# --------------------------------------------------------------------------------------------

_PATCH = Template('''

SITE = $site
DIRECTION = $direction


def activation_patch(clean_prompt, corrupt_prompt, answer, foil, positions$mean_arg):
    """Activation patching of SITE at every layer × $columns_doc.
    Returns ({SITE: metric [1, layers, columns]}, clean metric, corrupt metric [1])."""
$baselines\
    with model.trace(corrupt_ids, **LAST_ONLY):
        corrupt_acts = nnsight.save([site(SITE, layer).clone() for layer in range(n_layers)])
        corrupt = metric(model.output.logits[0, -1], answer, foil).save()

$donor
    raw = torch.zeros(1, n_layers, $n_columns)
    for layer in range(n_layers):
        with model.trace(**LAST_ONLY) as tracer:
            row = nnsight.save([])
$cells
        raw[0, layer] = torch.stack(list(row))
    return {SITE: raw}, clean, corrupt.reshape(1)
''')

_DONORS = {
    "denoise": "    # denoise: run the corrupt prompt, paste in the clean activation (is the site sufficient?)\n"
               "    base_ids, donor = corrupt_ids, clean_acts\n",
    "noise": "    # noise: run the clean prompt, paste in the corrupt activation (is the site necessary?)\n"
             "    base_ids, donor = clean_ids, corrupt_acts\n",
    "zero": "    # zero ablation: run the clean prompt with the activation set to zeros\n"
            "    base_ids, donor = clean_ids, [torch.zeros_like(act) for act in clean_acts]\n",
    "mean": "    # mean ablation: run the clean prompt with the activation replaced by its mean over mean_prompts\n"
            "    runs = []\n"
            "    for text in mean_prompts:\n"
            "        with model.trace(tokens(text), **LAST_ONLY):\n"
            "            runs.append(nnsight.save([site(SITE, layer).clone() for layer in range(n_layers)]))\n"
            "    donor = [torch.stack([run[layer][0] for run in runs]).mean(0, keepdim=True) for layer in range(n_layers)]\n"
            "    base_ids = clean_ids\n",
}

_POSITION_CELLS = '''\
            for pos in positions:
                with tracer.invoke(base_ids):
                    site(SITE, layer)[:, pos] = donor[layer][:, pos]
                    row.append(metric(model.output.logits[0, -1], answer, foil))'''

_HEAD_CELLS = '''\
            for head in range(N_HEADS):
                cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                with tracer.invoke(base_ids):
                    site(SITE, layer)[:, positions, cols] = donor[layer][:, positions, cols]
                    row.append(metric(model.output.logits[0, -1], answer, foil))'''


def _code_part(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Activation patching's part of ``Result.code()``'s script (assembled by
    :func:`pipatch._results.code.script`): the name of the script's function, its code, the site it
    reads and a summary for the script's docstring.

    ``activation_patch`` runs both prompts, builds the donor of the direction (the other run's
    activation, zeros, or the mean over ``mean_prompts``), then one invoke per cell, a layer's
    cells one trace. A site or direction it does not know raises :class:`PipatchError`.
    """
    target, heads, n_columns, columns_doc = _code.pair_site(result)
    direction = result.meta.get("direction", "denoise")
    if direction not in _DONORS:
        raise PipatchError(f"code(): unknown patching direction {direction!r}")
    code = _PATCH.substitute(site=repr(target.name), direction=repr(direction), columns_doc=columns_doc,
                             mean_arg=", mean_prompts" if direction == "mean" else "",
                             baselines=_code.PAIR_BASELINES, donor=_DONORS[direction], n_columns=n_columns,
                             cells=_HEAD_CELLS if heads else _POSITION_CELLS)
    summary = (f"clean and corrupt runs, then one {direction} patch of the {target.name} site per cell, normalized\n"
               "recovery (patched − corrupt) / (clean − corrupt).")
    return "activation_patch", code, [target], summary


def _title(meta: dict) -> str:
    return pair_title("Activation patching", meta, f"{meta.get('direction', 'denoise')}, {meta.get('site', 'resid')}")


DIRECTION = Param("direction", "denoise", "denoise (clean into corrupt), noise (corrupt into clean), zero or mean "
                  "ablation", "str")
MEAN_PROMPTS = Param("mean_prompts", None, "for direction mean: prompts of the same token length to average over",
                     "Sequence[str] | None", many=True, shown="the clean and corrupt prompts", flag_name="--mean-prompt")

DECLARATION = Experiment(
    name="patch", kind="patch", noun="activation patching",
    summary="Activation patching: paste one run's activations into another's, site by site.",
    planner=plan_patch, prompts=PAIR, title=_title,
    params=(
        *PAIR_PARAMS, SITE, METRIC,
        DIRECTION, POSITIONS, MEAN_PROMPTS, BATCH_SIZE, FAST,
    ),
    example='%%patch --answer " Paris" --foil " Rome" --site head -o heads\n'
            "clean: The Eiffel Tower is in the city of\n"
            "corrupt: The Colosseum is in the city of",
    doc="""
    Returns
    -------
    Result
        ``result.grid``: tensor[layers, positions] (or [layers, heads]) of normalized recovery
        ``(patched − corrupt) / (clean − corrupt)``; raw values in ``result.raw``.
    """,
    code=_code_part, code_inputs=lambda meta: _code.pair_inputs(meta, means=True),
)
