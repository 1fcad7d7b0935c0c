"""The logit lens (nostalgebraist, 2020): what would the model say if it stopped at layer ``l``?

Run the prompt once and read the residual stream after every block. Then read each layer's
state at each position through the model's own output head — the final norm and the
unembedding (and whatever the family does to its logits there: Gemma 2's soft-capping) — as
if it were the last block's output, and score the answer. The grid, layers × positions, shows
where the answer becomes readable: for a known fact typically only in the upper layers, at the
last position first.

The lens only reads: it is one forward of the prompt per prompt, on every backend (the
:data:`~pipatch._programs.lens.LENS` program reads every block's output at the positions
asked for and unembeds them where the weights are), then one pass over the unembedding per
(layer, position) read. On a long prompt that pass is most of the cost: ``positions=`` reads
fewer columns. Cell ``(last layer, last position)`` is the model's own output. A click on a
cell shows the top tokens of the run whose last block's output at the last position is that
cell's state (:class:`LensSweep`): what the head reads there.

Metrics: ``prob`` (P(answer)), ``logprob``, ``rank`` (how many tokens the lens reads above the
answer: 0 where it is the top token; a multi-token answer's worst over its tokens), and
``logit_diff`` with a ``foil`` (answer − foil logits, one token each: the layer at which the
model's head separates the two). A probability or a rank needs every logit of each reading
(the whole unembedding, per layer and position); a logit difference two of its rows, so its
lens at every position of a long prompt costs about one forward. A multi-token answer (" New York") is read
teacher-forced, as everywhere in pipatch: its first token through the lens at ``(l, p)``, its
later tokens at the model's output after the prompt and the answer's earlier tokens.

The grid holds the metric itself (there are no clean and corrupt runs to normalize against):
``result.grid`` is the mean over prompts (one for a single prompt) of P(answer), and the
result's clean baseline is the model's own output value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from string import Template

import torch

from .._base.errors import PipatchError
from .._engine import Plan, SiteSweep, check_batch_size, read_flops, warn_if_long
from .._model.cells import Base, Capture, Cell, Metric, Op
from .._model.declare import PROMPT, Experiment, Param
from .._model.models import Adapter
from .._model.sites import RESID, Site
from .._programs.lens import lens
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

__all__ = ["plan_lens", "LensSweep", "DECLARATION", "LENS_METRICS"]

LENS_METRICS = ("prob", "logprob", "rank", "logit_diff")


@dataclass
class LensSweep(SiteSweep):
    """The lens's cells as patched runs, for clicks only (the grid is read in one forward):
    cell ``(row, col)`` writes layer ``row``'s residual state at the position of column ``col``
    (``columns[col]``; a dataset's named group of positions: its last) into the last block's
    output at the last prompt position, so the model's head reads it. ``donor[layer]`` is that
    layer's state at the positions read, ``read`` ([1, P, d] per layer)."""

    read: list[int] = field(default_factory=list)

    def cell(self, row: int, col: int, seed: int) -> Cell:
        last_layer, last = len(self.donor) - 1, self.base.input_ids.shape[1] - 1
        where = self.columns[col]
        position = where[-1] if isinstance(where, list) else where
        value = self.donor[row][:, self.read.index(position)]  # [1, d]
        # A write of the last block's output: every block of the run is the base run's.
        return Cell(row, col, seed, start=last_layer + 1, ops=[Op(RESID, last_layer, (slice(None), last), value)])

    @property
    def tracks_rows(self) -> bool:
        return False  # every row is read before the plan runs


def plan_lens(
    backend,
    prompt: str,
    *,
    answer: str,
    foil: str | None,
    metric: str,
    subject: str | Sequence[int] | None,
    occurrence: int | str | None,
    positions: Sequence[int] | None,
    batch_size: int | None,
    fast: bool,
) -> Plan:
    """Check the inputs and read the lens (one forward); return its :class:`Plan`, whose
    result is filled already (its sweep answers clicks).

    ``backend`` runs the model; the other parameters are :func:`pipatch.lens`'s (their
    defaults are :data:`DECLARATION`'s).
    """
    check_choice(metric, LENS_METRICS, "metric for the lens")
    adapter = backend.adapter
    input_ids, tokens, offsets = encode(backend, prompt)
    T = input_ids.shape[1]
    cols = sweep_positions(positions, T)
    batch = check_batch_size(batch_size, T, backend)
    if (metric == "logit_diff") != (foil is not None):
        raise PipatchError("the lens reads a foil only for metric='logit_diff' (answer − foil), which needs one: pass "
                           "both, e.g. foil=' Rome', metric='logit_diff'")
    scorer = Metric(metric, answer_ids(backend, answer, "answer", prompt),
                    None if foil is None else answer_ids(backend, foil, "foil", prompt))
    if foil is not None and not scorer.single:
        raise PipatchError("the lens reads logit_diff for a one-token answer and foil: use metric='logprob' for a "
                           "multi-token answer")
    check_run_length(backend, input_ids, scorer)
    meta = model_meta(backend)
    if subject is not None:
        meta["subject"] = subject if isinstance(subject, str) else list(subject)
        meta["subject_positions"] = subject_positions(subject, prompt, tokens, offsets, occurrence)
    # Readings through the whole unembedding (and the model's own output); a logit difference
    # reads two of its rows, next to nothing.
    readings = 0 if scorer.token_ids is not None else adapter.n_layers * len(cols) + 1
    warn_if_long(backend, read_flops(backend, T + scorer.n_read - 1, readings), "the logit lens",
                 f"{len(cols)} positions × {adapter.n_layers} layers through the unembedding",
                 "positions= (e.g. the last few: positions=[-3, -2, -1])")
    read = lens(backend, input_ids, scorer, cols)
    output = float(read.output[0])
    meta.update({
        "prompt": prompt, "answer": answer, **answer_meta(backend, "answer", scorer.answer), "foil": foil,
        **answer_meta(backend, "foil", scorer.foil),
        "site": RESID.name, "col_axis": "token", "normalize": False, "output": output, "positions": cols,
    })
    result = Result(
        kind="lens", tokens=tokens, columns=[tokens[p] for p in cols], layers=layer_labels(backend), metric=metric,
        raw={RESID.name: read.values[None].float()}, clean=output, corrupt=torch.tensor([output]), meta=meta,
        rows_done={RESID.name: adapter.n_layers},
    )
    # The clicks' base run: the prompt with the model's own metric (its blocks are not kept:
    # a click runs every block, fast=False).
    base = Base(input_ids, Capture(blocks=[], sites={}, metric=read.output, embedded=torch.zeros(1, 0, 0), prob=None,
                                   top1=read.top1))
    donor = [read.states[layer][None] for layer in range(adapter.n_layers)]
    sweep = LensSweep(view=RESID.name, base=base, metric=scorer, n_rows=adapter.n_layers, n_cols=len(cols),
                      prune=False, only=set(), site=RESID, adapter=adapter, donor=donor, columns=cols, read=cols)
    return Plan(backend, result, [sweep], batch, fast)


# --------------------------------------------------------------------------------------------
# The declaration, and its part of ``Result.code()``'s script
# --------------------------------------------------------------------------------------------

_LENS = Template('''

def logit_lens(prompt, answer, foil, positions):
    """The logit lens of `prompt`: each layer's residual state at each position of `positions`
    read through the model's own head, by writing it into the last block's output at the last
    position. Returns ({"resid": metric [1, layers, positions]}, the model's own metric, the same)."""
    input_ids = tokens(prompt)
    T = input_ids.shape[1]
    positions = range(T) if positions is None else positions
    with model.trace(input_ids, **LAST_ONLY):
        states = nnsight.save([site("resid", layer).clone() for layer in range(n_layers)])
        output = metric(model.output.logits[0, -1], answer, foil).save()
    raw = torch.zeros(1, n_layers, len(positions))
    for layer in range(n_layers):
        with model.trace(**LAST_ONLY) as tracer:
            row = nnsight.save([])
            for pos in positions:
                with tracer.invoke(input_ids):
                    site("resid", n_layers - 1)[:, -1] = states[layer][:, pos]
                    row.append(metric(model.output.logits[0, -1], answer, foil))
        raw[0, layer] = torch.stack(list(row))
    return {"resid": raw}, output, output.reshape(1)
''')


def _code_part(result: Result, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    summary = ("one run keeping every block's output, then one run per (layer, position read) with that\n"
               "state written into the last block's output at the last position: the metric read through the head.")
    return "logit_lens", _LENS.template, [RESID], summary


def _code_inputs(meta: dict) -> dict:
    foil = meta.get("foil_id")
    return {"prompt": meta["prompt"], "answer": int(meta["answer_id"]), "foil": None if foil is None else int(foil),
            "positions": meta.get("positions")}



def _title(meta: dict) -> str:
    versus = f" vs {meta['foil']!r}" if meta.get("foil") is not None else ""
    return f"Logit lens · {meta.get('model', '?')} · {meta.get('answer', '')!r}{versus}"


DECLARATION = Experiment(
    name="lens", kind="lens", noun="logit lens",
    summary="The logit lens: every layer's residual stream at every position read through the model's output head.",
    planner=plan_lens, prompts=PROMPT, title=_title,
    params=(
        Param("answer", help="the continuation to score, e.g. ' Paris' (several tokens: the first read through the "
              "lens, the rest teacher-forced at the output)", annotation="str | Sequence[str]", per_prompt=True),
        Param("foil", None, "the alternative for metric='logit_diff', e.g. ' Rome' (one token)", "str | None",
              per_prompt=True),
        Param("metric", "prob", "prob or logprob of the answer, its rank (0: the top token), or logit_diff "
              "(answer − foil)", "str"),
        Param("subject", None, "the subject's text (or token indices): with a list of prompts, the named positions "
              "are built around it", "str | Sequence[int] | None", per_prompt=True),
        OCCURRENCE, POSITIONS,
        BATCH_SIZE, FAST,
    ),
    example='%%lens --answer " Paris" -o lens\nThe Eiffel Tower is in the city of',
    code=_code_part, code_inputs=_code_inputs,
    doc="""
    See :mod:`pipatch._experiments.lens`.

    Returns
    -------
    Result
        ``kind="lens"``; ``result.grid`` is tensor[layers, tokens] of the metric read through
        the model's head (not normalized: there is no corrupt run), one column per position read
        (``meta["positions"]``); ``meta["output"]`` is the model's own value, the grid's last
        row at the last position. One forward of the prompt; a prompt whose lens the cost model
        puts above a minute is announced first in one line (a :class:`~pipatch._base.errors.PipatchWarning`).

    Examples
    --------
    >>> r = pipatch.lens(model, "The Eiffel Tower is in the city of", answer=" Paris")
    >>> r.grid[-1, -1]      # the model's own P(" Paris")
    """,
)
