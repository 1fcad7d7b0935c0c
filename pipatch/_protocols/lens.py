"""The logit lens (nostalgebraist, 2020): what would the model say if it stopped at layer ``l``?

Run the prompt once and keep the residual stream after every block. Then read each layer's
state at each position through the model's own output head — the final norm and the
unembedding (and whatever the family does to its logits there: Gemma 2's soft-capping) — as
if it were the last block's output, and score the answer. The grid, layers × positions, shows
where the answer becomes readable: for a known fact typically only in the upper layers, at the
last position first.

In pipatch's terms each cell is a patched run of the prompt: the last block's output at the
last prompt position is replaced by layer ``l``'s state at position ``p`` (an op like any other,
:class:`~pipatch._cells.Op`), and the run's metric is the lens's reading. So the lens runs on
every backend the way patching does, and the engine's shortcuts apply: blocks below the last
are the base run's, and only the last position is unembedded. Cell ``(last layer, last
position)`` writes back what is already there: it is the model's own output.

Metrics: ``prob`` (P(answer)), ``logprob``, ``rank`` (how many tokens the lens reads above the
answer: 0 where it is the top token; a multi-token answer's worst over its tokens). A multi-token answer (" New York") is read
teacher-forced, as everywhere in pipatch: its first token through the lens at ``(l, p)``, its
later tokens at the model's output after the prompt and the answer's earlier tokens.

The grid holds the metric itself (there are no clean and corrupt runs to normalize against):
``result.grid`` is the mean over prompts (one for a single prompt) of P(answer), and the
result's clean baseline is the model's own output value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from string import Template

import torch

from .._cells import Base, Cell, Metric, Op
from .._declare import PROMPT, Experiment, Param
from .._engine import Plan, SiteSweep, check_batch_size
from .._models import Adapter
from .._programs.capture import capture
from .._result import Result
from .._sites import RESID, Site
from ._inputs import (
    BATCH_SIZE,
    FAST,
    answer_ids,
    answer_meta,
    check_choice,
    check_run_length,
    encode,
    layer_labels,
    model_meta,
    subject_positions,
)

__all__ = ["plan_lens", "LensSweep", "DECLARATION", "LENS_METRICS"]

LENS_METRICS = ("prob", "logprob", "rank")


@dataclass
class LensSweep(SiteSweep):
    """Cell ``(row, col)`` writes layer ``row``'s residual state at the position of column
    ``col`` (``columns[col]``; a dataset's named group of positions: its last) into the last
    block's output at the last prompt position, so the model's head reads it. ``donor`` is the
    base run's residual stream, [1, T, d] per layer."""

    def cell(self, row: int, col: int, seed: int) -> Cell:
        last_layer, last = len(self.donor) - 1, self.donor[0].shape[1] - 1
        where = self.columns[col]
        position = where[-1] if isinstance(where, list) else where
        value = self.donor[row][:, position]  # [1, d]
        # A write of the last block's output: every block of the run is the base run's.
        return Cell(row, col, seed, start=last_layer + 1, ops=[Op(RESID, last_layer, (slice(None), last), value)])


def plan_lens(
    backend,
    prompt: str,
    *,
    answer: str,
    metric: str,
    subject: str | Sequence[int] | None,
    batch_size: int | None,
    fast: bool,
) -> Plan:
    """Check the inputs and run the prompt once; return the :class:`Plan` of the lens.

    ``backend`` runs the model; the other parameters are :func:`pipatch.lens`'s (their
    defaults are :data:`DECLARATION`'s).
    """
    check_choice(metric, LENS_METRICS, "metric for the lens")
    adapter = backend.adapter
    input_ids, tokens, offsets = encode(backend, prompt)
    T = input_ids.shape[1]
    batch = check_batch_size(batch_size, T, backend)
    scorer = Metric(metric, answer_ids(backend, answer, "answer", prompt))
    check_run_length(backend, input_ids, scorer)
    run = capture(backend, input_ids, scorer, [RESID])
    output = float(run.metric[0])
    meta = model_meta(backend)
    meta.update({
        "prompt": prompt, "answer": answer, **answer_meta(backend, "answer", scorer.answer),
        "site": RESID.name, "col_axis": "token", "normalize": False, "output": output,
    })
    if subject is not None:
        meta["subject"] = subject if isinstance(subject, str) else list(subject)
        meta["subject_positions"] = subject_positions(subject, prompt, tokens, offsets)
    result = Result(
        kind="lens", tokens=tokens, columns=list(tokens), layers=layer_labels(backend), metric=metric,
        raw={RESID.name: torch.full((1, adapter.n_layers, T), float("nan"))},
        clean=output, corrupt=torch.tensor([output]), meta=meta,
    )
    # prune=False: the cell that writes back the last state is read through the head like every
    # other cell, not filled with the base run's metric (read off the model's logits, a path
    # whose float32 rounding differs by ~1e-5).
    sweep = LensSweep(view=RESID.name, base=Base(input_ids, run), metric=scorer, n_rows=adapter.n_layers, n_cols=T,
                      prune=False, site=RESID, adapter=adapter, donor=run.sites[RESID.name], columns=list(range(T)))
    return Plan(backend, result, [sweep], batch, fast)


# --------------------------------------------------------------------------------------------
# The declaration, and its part of ``Result.code()``'s script
# --------------------------------------------------------------------------------------------

_LENS = Template('''

def logit_lens(prompt, answer):
    """The logit lens of `prompt`: each layer's residual state at each position read through the
    model's own head, by writing it into the last block's output at the last position. Returns
    ({"resid": metric [1, layers, T]}, the model's own metric, the same)."""
    input_ids = tokens(prompt)
    T = input_ids.shape[1]
    with model.trace(input_ids, **LAST_ONLY):
        states = nnsight.save([site("resid", layer).clone() for layer in range(n_layers)])
        output = metric(model.output.logits[0, -1], answer).save()
    raw = torch.zeros(1, n_layers, T)
    for layer in range(n_layers):
        with model.trace(**LAST_ONLY) as tracer:
            row = nnsight.save([])
            for pos in range(T):
                with tracer.invoke(input_ids):
                    site("resid", n_layers - 1)[:, -1] = states[layer][:, pos]
                    row.append(metric(model.output.logits[0, -1], answer))
        raw[0, layer] = torch.stack(list(row))
    return {"resid": raw}, output, output.reshape(1)
''')


def _code_part(result: Result, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    summary = ("one run keeping every block's output, then one run per (layer, position) with that state\n"
               "written into the last block's output at the last position: the metric read through the head.")
    return "logit_lens", _LENS.template, [RESID], summary


def _code_inputs(meta: dict) -> dict:
    return {"prompt": meta["prompt"], "answer": int(meta["answer_id"])}



def _title(meta: dict) -> str:
    return f"Logit lens · {meta.get('model', '?')} · {meta.get('answer', '')!r}"


DECLARATION = Experiment(
    name="lens", kind="lens", noun="logit lens",
    summary="The logit lens: every layer's residual stream at every position read through the model's output head.",
    planner=plan_lens, prompts=PROMPT, title=_title,
    params=(
        Param("answer", help="the continuation to score, e.g. ' Paris' (several tokens: the first read through the "
              "lens, the rest teacher-forced at the output)", annotation="str | Sequence[str]", per_prompt=True),
        Param("metric", "prob", "prob or logprob of the answer, or its rank (0: the top token)", "str"),
        Param("subject", None, "the subject's text (or token indices): with a list of prompts, the named positions "
              "are built around it", "str | Sequence[int] | None", per_prompt=True),
        BATCH_SIZE, FAST,
    ),
    example='%%lens --answer " Paris" -o lens\nThe Eiffel Tower is in the city of',
    code=_code_part, code_inputs=_code_inputs,
    doc="""
    See :mod:`pipatch._protocols.lens`.

    Returns
    -------
    Result
        ``kind="lens"``; ``result.grid`` is tensor[layers, tokens] of the metric read through
        the model's head (not normalized: there is no corrupt run); ``meta["output"]`` is the
        model's own value, the grid's last row at the last position.

    Examples
    --------
    >>> r = pipatch.lens(model, "The Eiffel Tower is in the city of", answer=" Paris")
    >>> r.grid[-1, -1]      # the model's own P(" Paris")
    """,
)
