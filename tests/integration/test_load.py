"""Load in one process: many sweeps in a row must not grow memory without bound."""

from __future__ import annotations

import gc

import pytest

import pipatch
from tests._tiny import tiny_model


def _rss() -> int:
    import os

    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_two_hundred_sweeps_level_off():
    model = tiny_model("llama")
    # Words of the tiny model's vocabulary; both prompts are 9 tokens.
    kw = dict(clean="The Eiffel Tower is in the city of", corrupt="The Big Ben is in the city of",
              answer=" Paris", foil=" London")
    marks = {}
    for i in range(1, 201):
        if i % 2:
            r = pipatch.patch(model, **kw, site="head" if i % 3 == 0 else "resid")
        else:
            r = pipatch.trace(model, kw["clean"], subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0)
        assert r.status == "done"
        if i in (50, 100, 200):
            gc.collect()
            marks[i] = _rss()
    growth = (marks[200] - marks[100]) / marks[100]
    assert growth < 0.05, f"RSS grew {growth:.1%} between sweep 100 and 200 ({marks})"


def test_twenty_grids_keep_a_notebook_small(eiffel_trace):
    """Each saved output holds the grid data and a PNG, never the JS bundle or activations."""
    import json
    from pathlib import Path

    js = (Path(pipatch.__file__).parent / "static" / "widget.js").read_text()
    snippet = js[len(js) // 2 : len(js) // 2 + 200]
    outputs = [eiffel_trace._repr_mimebundle_() for _ in range(20)]
    sizes = [len(json.dumps(o)) for o in outputs]
    assert max(sizes) < 200_000, sizes
    assert sum(sizes) < 4_000_000
    assert all(snippet not in json.dumps(o) for o in outputs)
    # The arrays are the grid's numbers only: seeds × layers × tokens, no hidden states.
    arrays = outputs[0]["application/vnd.pipatch.grid+json"]["arrays"]
    assert all(spec["shape"][-2:] == [18, 9] for spec in arrays.values())
