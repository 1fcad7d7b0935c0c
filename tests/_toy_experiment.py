"""The toy experiment of the declaration tests (``tests/unit/test_declare.py`` and
``tests/integration/test_declare.py``): a module of its own (a protocol and its declaration,
nothing else), written to a temporary folder with an installed distribution's entry point.

``tests/conftest.py`` loads this module as a plugin (``pytest_plugins``): its fixtures
``toy_dir`` (the folder) and ``toy`` (the declaration, registered for one test module) are
every test module's.
"""

from __future__ import annotations

import sys

import pytest

from pipatch._model import declare as _declare

#: A toy experiment: zero-ablate the residual stream at each (layer, position) of one prompt.
TOY = '''
"""Zero ablation of the residual stream, one (layer, position) at a time: a toy experiment."""

import torch

from pipatch._model.cells import Base, Metric
from pipatch._model.declare import PROMPT, Experiment, Param
from pipatch._programs import capture
from pipatch._engine import Plan, SiteSweep, check_batch_size
from pipatch._experiments._inputs import answer_ids, encode, layer_labels, model_meta
from pipatch._results.result import Result
from pipatch._model.sites import RESID


def plan_ablate(backend, prompt, *, answer, batch_size):
    ids, tokens, _ = encode(backend, prompt)
    scorer = Metric("prob", answer_ids(backend, answer, "answer"))
    run = capture(backend, ids, scorer, [RESID])
    n_layers, T = backend.adapter.n_layers, ids.shape[1]
    meta = {**model_meta(backend), "prompt": prompt, "answer": answer, "site": "resid"}
    clean = float(run.metric[0])
    result = Result(kind="toy_ablation", tokens=tokens, columns=list(tokens), layers=layer_labels(backend),
                    metric="prob", raw={"resid": torch.full((1, n_layers, T), float("nan"))},
                    clean=clean, corrupt=torch.tensor([0.0]), meta=meta)
    zeros = [torch.zeros_like(v) for v in run.sites["resid"]]
    sweep = SiteSweep(view="resid", base=Base(ids, run), metric=scorer, n_rows=n_layers, n_cols=T, site=RESID,
                      adapter=backend.adapter, donor=zeros, columns=list(range(T)))
    return Plan(backend, result, [sweep], check_batch_size(batch_size, T, backend))


DECLARATION = Experiment(
    name="toy_ablate", kind="toy_ablation", noun="toy ablation",
    summary="Zero-ablate the residual stream at each layer and position.",
    planner=plan_ablate, prompts=PROMPT, title=lambda meta: f"Toy ablation · {meta['answer']!r}",
    params=(Param("answer", help="the continuation to score"),
            Param("batch_size", None, "invokes per trace", "int | None")),
    example='%%toy_ablate --answer " Paris"\\nThe Eiffel Tower is in the city of',
)
'''


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """A folder holding the toy module and an installed distribution's entry point for it."""
    root = tmp_path_factory.mktemp("toy")
    (root / "toy_ablate.py").write_text(TOY, encoding="utf-8")
    info = root / "toy_ablate-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-ablate\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text("[pipatch.experiments]\ntoy_ablate = toy_ablate\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def toy(toy_dir):
    """The toy's declaration registered in this process (as the entry point would), then removed."""
    sys.path.insert(0, str(toy_dir))
    try:
        import toy_ablate

        yield _declare.register(toy_ablate.DECLARATION)
    finally:
        _declare.unregister("toy_ablate")
        sys.path.remove(str(toy_dir))
        sys.modules.pop("toy_ablate", None)
