"""One small example of every experiment, spelled for each entry point, and a result comparison.

``EMBEDDED[name]`` is sized for the embedded model (a few seconds each on a laptop CPU):
``kwargs`` for the Python function, ``line`` + ``body`` for the magic, ``argv`` for the CLI.
They are written out by hand, not derived from the registry, so a test comparing two entry
points checks the registry's translation too. ``TINY[name]`` is the Python form for the tiny
GPT-2 of ``tests/_tiny.py`` (whose word-level tokenizer knows "Big Ben" but not "Colosseum").
"""

from __future__ import annotations

import math

import torch

from tests._saes import sae_folder
from tests._tiny import D_MODEL
from tests.conftest import COLOSSEUM, EIFFEL

BIG_BEN = "The Big Ben is in the city of"  # as many tiny-tokenizer tokens as EIFFEL

PAIR = f"clean: {EIFFEL}\ncorrupt: {COLOSSEUM}\n"
PAIR_ARGV = ["--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome"]
PAIR_KWARGS = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}

EMBEDDED: dict[str, dict] = {
    "trace": {
        # One seed: a trace on the embedded model is ~300 patched runs per seed.
        "kwargs": {"prompt": EIFFEL, "subject": "Eiffel Tower", "answer": " Paris", "seeds": 1, "scale": 3.0},
        "line": '--subject "Eiffel Tower" --answer " Paris" --seeds 1 --scale 3',
        "body": EIFFEL,
        "argv": ["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--seeds", "1", "--scale", "3"],
    },
    "patch": {
        "kwargs": {**PAIR_KWARGS, "site": "resid", "positions": [2, -1]},
        "line": '--answer " Paris" --foil " Rome" --site resid --positions 2,-1',
        "body": PAIR,
        "argv": ["patch", *PAIR_ARGV, "--site", "resid", "--positions", "2,-1"],
    },
    "attribute": {
        "kwargs": {**PAIR_KWARGS, "site": "head", "verify": 2},
        "line": '--answer " Paris" --foil " Rome" --site head --verify 2',
        "body": PAIR,
        "argv": ["attribute", *PAIR_ARGV, "--site", "head", "--verify", "2"],
    },
    "path_patch": {
        "kwargs": {**PAIR_KWARGS, "sender": ("head", 12, 2)},
        "line": '--answer " Paris" --foil " Rome" --sender 12.2',
        "body": PAIR,
        "argv": ["path-patch", *PAIR_ARGV, "--sender", "12.2"],
    },
    "lens": {
        "kwargs": {"prompt": EIFFEL, "answer": " Paris"},
        "line": '--answer " Paris"',
        "body": EIFFEL,
        "argv": ["lens", EIFFEL, "--answer", " Paris"],
    },
    "circuit": {
        "kwargs": {**PAIR_KWARGS, "method": "eap", "verify": 2, "curve": 3},
        "line": '--answer " Paris" --foil " Rome" --method eap --verify 2 --curve 3',
        "body": PAIR,
        "argv": ["circuit", *PAIR_ARGV, "--method", "eap", "--verify", "2", "--curve", "3"],
    },
    "features": {  # a random SAE of the embedded model's layer 6 (640 wide)
        "kwargs": {"prompt": EIFFEL, "saes": [sae_folder(640, 6)], "k": 3},
        "line": f"--saes {sae_folder(640, 6)} --k 3",
        "body": EIFFEL,
        "argv": ["features", EIFFEL, "--saes", sae_folder(640, 6), "--k", "3"],
    },
    "feature_patch": {  # a random SAE after layer 6 (the embedded model is 640 wide)
        "kwargs": {**PAIR_KWARGS, "site": sae_folder(640, 6), "top_k": 3, "positions": [2, -1]},
        "line": f'--answer " Paris" --foil " Rome" --site {sae_folder(640, 6)} --top-k 3 --positions 2,-1',
        "body": PAIR,
        "argv": ["feature-patch", *PAIR_ARGV, "--site", sae_folder(640, 6), "--top-k", "3",
                 "--positions", "2,-1"],
    },
    "feature_trace": {  # the same SAE; one seed, the subject's last token and the last position
        "kwargs": {"prompt": EIFFEL, "subject": "Eiffel Tower", "answer": " Paris", "site": sae_folder(640, 6),
                   "seeds": 1, "scale": 3.0, "top_k": 3, "positions": [3, -1]},
        "line": f'--subject "Eiffel Tower" --answer " Paris" --site {sae_folder(640, 6)} --seeds 1 --scale 3 '
                "--top-k 3 --positions 3,-1",
        "body": EIFFEL,
        "argv": ["feature-trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--site",
                 sae_folder(640, 6), "--seeds", "1", "--scale", "3", "--top-k", "3", "--positions", "3,-1"],
    },
    "feature_circuit": {  # random SAEs after layers 5 and 6: nodes of both, edges between them
        "kwargs": {**PAIR_KWARGS, "saes": [sae_folder(640, 5), sae_folder(640, 6)], "verify": 2, "top_nodes": 6,
                   "positions": [2, -1]},
        "line": f'--answer " Paris" --foil " Rome" --saes {sae_folder(640, 5)} --saes {sae_folder(640, 6)} '
                "--verify 2 --top-nodes 6 --positions 2,-1",
        "body": PAIR,
        "argv": ["feature-circuit", *PAIR_ARGV, "--saes", sae_folder(640, 5), "--saes", sae_folder(640, 6),
                 "--verify", "2", "--top-nodes", "6", "--positions", "2,-1"],
    },
}

TINY_PAIR = {"clean": EIFFEL, "corrupt": BIG_BEN, "answer": " Paris", "foil": " London"}
TINY: dict[str, dict] = {
    "trace": {"prompt": EIFFEL, "subject": "Eiffel Tower", "answer": " Paris", "seeds": 2, "scale": 3.0},
    "patch": {**TINY_PAIR, "site": "mlp"},
    "attribute": {**TINY_PAIR, "site": "head"},
    "path_patch": dict(TINY_PAIR),  # no sender: a sweep over every head
    "lens": {"prompt": EIFFEL, "answer": " Paris", "metric": "logprob"},
    "circuit": {**TINY_PAIR, "steps": 2, "verify": 3, "curve": 4},
    "features": {"prompt": EIFFEL, "saes": sae_folder(D_MODEL, 1), "k": 4},
    "feature_patch": {**TINY_PAIR, "site": sae_folder(D_MODEL, 1), "top_k": 4},
    "feature_trace": {"prompt": EIFFEL, "subject": "Eiffel Tower", "answer": " Paris", "site": sae_folder(D_MODEL, 1),
                      "seeds": 2, "scale": 3.0, "top_k": 4},
    "feature_circuit": {**TINY_PAIR, "saes": [sae_folder(D_MODEL, 0), sae_folder(D_MODEL, 1)], "verify": 3,
                        "top_nodes": 8},
}


_COMPUTED: dict[tuple, object] = {}


def python_result(model, name: str, kwargs: dict):
    """The Python API's result for ``name`` (``pipatch.trace`` etc.), computed once per session.

    Callers only read it: the magic and the CLI tests compare against the same result.
    """
    key = (id(model), name, repr(sorted(kwargs.items())))
    if key not in _COMPUTED:
        _COMPUTED[key] = (model, _python_result(model, name, kwargs))  # the model keeps its id
    return _COMPUTED[key][1]


def _python_result(model, name: str, kwargs: dict):
    import pipatch

    kwargs = dict(kwargs)
    if "prompt" in kwargs:
        return getattr(pipatch, name)(model, kwargs.pop("prompt"), **kwargs)
    return getattr(pipatch, name)(model, **kwargs)


def assert_same_result(got, want, atol: float = 1e-6) -> None:
    """Same axes and the same raw metric in every cell (NaN where the other has NaN)."""
    assert (got.kind, got.tokens, got.columns, got.layers, got.metric, got.views) == (
        want.kind, want.tokens, want.columns, want.layers, want.metric, want.views)
    assert got.status == want.status == "done"
    for view in want.views:
        torch.testing.assert_close(got.raw[view], want.raw[view], atol=atol, rtol=0, equal_nan=True)
    torch.testing.assert_close(got.corrupt_seeds, want.corrupt_seeds, atol=atol, rtol=0,
                               equal_nan=True)
    assert (got.clean_value == want.clean_value or abs(got.clean_value - want.clean_value) <= atol
            or math.isnan(got.clean_value) and math.isnan(want.clean_value))  # a read has no metric


def assert_json_matches(data: dict, want, atol: float = 1e-6) -> None:
    """A CLI ``--json`` document against a Python result: the keys every command writes, and the grid."""
    for key in ("kind", "model", "tokens", "layers", "grid", "metric", "clean", "corrupt"):
        assert key in data, key
    assert (data["kind"], data["tokens"], data["layers"], data["metric"]) == (
        want.kind, want.tokens, want.layers, want.metric)
    grid = want.grid.tolist()
    assert len(data["grid"]) == len(grid)
    for got_row, want_row in zip(data["grid"], grid, strict=True):
        for got, expected in zip(got_row, want_row, strict=True):
            if math.isnan(expected):
                assert got is None
            else:
                assert abs(got - expected) <= atol
