"""The metric's inputs, without a model: one-token answers read exactly as before, and each
sequence of a multi-token answer is teacher-forced.

Multi-token answers on the embedded model: ``tests/integration/test_multitoken.py``.
"""

from __future__ import annotations

import pytest
import torch

from pipatch._model.cells import Metric

# --------------------------------------------------------------------------------------------
# The metric itself
# --------------------------------------------------------------------------------------------


def test_one_token_answers_read_exactly_as_before():
    logits = torch.randn(3, 1, 1, 50)
    flat = logits[:, 0, 0]
    assert torch.equal(Metric("logit_diff", 4, 9).score(logits), flat[:, 4] - flat[:, 9])
    # A log-softmax taken in float64 (over a 262k vocabulary float32's is off by 2e-5), read as float32.
    logprob = torch.log_softmax(flat.double(), -1)[:, 4].float()
    assert torch.equal(Metric("logprob", 4).score(logits), logprob)
    assert torch.equal(Metric("prob", 4).score(logits), logprob.exp())
    assert torch.equal(Metric("prob", 4).answer_prob(logits), flat.softmax(-1)[:, 4])
    ids = torch.tensor([[2, 3, 5]])
    assert Metric("logit_diff", 4, 9).inputs(ids) is ids and Metric("logit_diff", 4, 9).label == "logit_diff"


@pytest.mark.parametrize("answer, foil, inputs", [
    ((7, 8), None, [(7,)]),
    ((7, 8), (9,), [(7,)]),  # a one-token foil is read at the last prompt position of the answer's input
    ((7, 8), (7, 9), [(7,)]),  # a shared first token: one input
    ((7, 8), (9, 10), [(7,), (9,)]),  # diverging: the foil needs an input of its own
    ((7,), (9, 10, 11), [(7, 7), (9, 10)]),  # padded to one length with a token never read
])
def test_inputs_hold_each_sequence_teacher_forced(answer, foil, inputs):
    metric = Metric("logit_diff" if foil else "logprob", answer, foil)
    assert sorted(metric.continuations) == sorted(inputs)
    ids = torch.tensor([[1, 2, 3]])
    run = metric.inputs(ids)
    assert run.shape == (len(inputs), 3 + metric.n_read - 1) and (run[:, :3] == ids).all()
    # By hand: each sequence's token j is read at window position j of an input holding its prefix.
    logits = torch.randn(2, len(inputs), metric.n_read, 20)
    logp = logits.log_softmax(-1)
    rows = run[:, 3:].tolist()

    def by_hand(seq):
        i = next(i for i, row in enumerate(rows) if tuple(row[: len(seq) - 1]) == tuple(seq[:-1]))
        return sum(logp[:, i, j, t] for j, t in enumerate(seq))
    want = by_hand(answer) - by_hand(foil) if foil else by_hand(answer)
    assert torch.allclose(metric.score(logits), want, atol=1e-6)
    assert metric.label == ("logprob_diff" if foil else "logprob")
