"""pipatch.tasks: IOI and greater-than pair datasets, with and without a tokenizer (no weights)."""

from __future__ import annotations

import pipatch
from pipatch.tasks import ioi
from tests._tiny import tiny_model


def test_a_taskset_splats_into_a_pair_experiment():
    model = tiny_model("gpt2")
    task = ioi(2, seed=0, tokenizer=model.tokenizer)
    result = pipatch.patch(model, site="resid", **task)
    assert isinstance(result, pipatch.Result) and result.n_seeds == 2
