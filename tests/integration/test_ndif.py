"""The NDIF backend through nnsight's own offline simulation of NDIF (``remote="local"``).

nnsight's simulation serialises every request exactly as for NDIF, then rebuilds it with every
module but torch, numpy, transformers, accelerate, diffusers, einops, peft and nnsight hidden
(pipatch included: this checkout's path is taken off ``sys.path`` too), and runs it on the
weights here. So each passing experiment is one whose requests NDIF could rebuild: pipatch's
invoke code travelled by value. The numbers must be the transformers backend's: the same
batches with the same forward (``fast=False`` on both) to 1e-6, the default fast paths within
1e-4 as for every backend. Then what the live grid sees (one request per batch, Stop between
requests), the magics and the CLI, ``code()``, and the checks before any request, one line
each: no key, an unreachable service (a closed loopback port stands in for it), a model it does
not host and version drift (a loopback stand-in answers NDIF's ``/status`` and ``/env``).
"""

from __future__ import annotations

import json

import pytest
import torch

import pipatch
from pipatch import cli
from pipatch._backends import backend_for
from pipatch._backends.ndif import NDIFBackend
from pipatch._base.known import remember
from pipatch._experiments._registry import EXPERIMENTS
from pipatch._model.models import PipatchError
from pipatch._programs import gradients
from tests._equal import assert_close, assert_same_feature_circuit_checks
from tests._experiments import EMBEDDED, TINY, python_result
from tests._tiny import tiny_model
from tests.conftest import EIFFEL
from tests.unit.test_ndif_checks import one_line

#: The options each experiment takes for ``fast`` (attribution has none: it runs no sweep of
#: patched runs but its verification, which has no shortcut to take; nor do the feature
#: experiments).
SLOW = {name: ({"fast": False} if "fast" in [p.keyword for p in EXPERIMENTS[name].params] else {}) for name in EMBEDDED}


@pytest.fixture(scope="module")
def simulated():
    return pipatch.load_model(remote="local")


def assert_equal_results(got, want, atol: float) -> None:
    assert got.status == want.status == "done"
    assert (got.kind, got.tokens, got.columns, got.layers, got.views) == (
        want.kind, want.tokens, want.columns, want.layers, want.views)
    assert_close(got.corrupt_seeds, want.corrupt_seeds, atol, rtol=0)
    for view in want.views:
        assert_close(got.raw[view], want.raw[view], atol, rtol=0)
    assert got.meta["backend"] == "ndif" and got.meta["remote"] == "local"


# --------------------------------------------------------------------------------------------
# The numbers
# --------------------------------------------------------------------------------------------


# A circuit's and a feature circuit's scores on NDIF are compared with the local backend's on a
# tiny family below (the embedded model's backward passes would take minutes a request here).
REMOTE_EXPERIMENTS = [name for name in EMBEDDED if name not in ("circuit", "feature_circuit")]


@pytest.mark.parametrize("name", REMOTE_EXPERIMENTS)
def test_every_experiment_equals_the_local_backend_on_the_embedded_model(simulated, model, name):
    kwargs = {**EMBEDDED[name]["kwargs"], **SLOW[name]}
    backend = backend_for(simulated)
    before = backend.requests
    got = python_result(simulated, name, kwargs)
    assert backend.requests > before  # it ran as requests, not in this process's trace
    assert_equal_results(got, python_result(model, name, kwargs), atol=1e-6)


@pytest.mark.parametrize("name", ["trace", "patch", "lens"])
def test_the_fast_paths_equal_the_local_backend_within_the_backends_tolerance(simulated, model, name):
    kwargs = EMBEDDED[name]["kwargs"]
    assert_equal_results(python_result(simulated, name, kwargs), python_result(model, name, kwargs), atol=1e-4)


@pytest.mark.parametrize("name", REMOTE_EXPERIMENTS)
def test_every_experiment_equals_the_local_backend_on_a_tiny_family(name):
    local, remote = tiny_model("qwen2"), tiny_model("qwen2")  # grouped-query attention
    remember(remote, remote="local")
    kwargs = {**TINY[name], **SLOW[name]}
    assert_equal_results(python_result(remote, name, kwargs), python_result(local, name, kwargs), atol=1e-6)


def test_the_lens_is_one_request():
    """The lens reads: one request per prompt, the service unembedding every reading."""
    local, remote = tiny_model("qwen2"), tiny_model("qwen2")
    remember(remote, remote="local")
    backend = backend_for(remote)
    before = backend.requests
    got = pipatch.lens(remote, **TINY["lens"], positions=[0, -1])
    assert backend.requests == before + 1
    assert torch.allclose(got.grid, pipatch.lens(local, **TINY["lens"], positions=[0, -1]).grid, atol=1e-6)


def _edge_scores(result) -> dict[tuple[str, str], float]:
    return {(row.sender, row.receiver): row.score for row in result.edges().itertuples()}


def test_a_circuit_is_scored_on_ndif_as_on_transformers():
    """NDIF scores a circuit: each EAP-IG point's forward, backward and local pull-backs run in
    one request (the edge-terms program's body, through nnsight's remote trace, rebuilt with
    pipatch hidden), and every edge score equals the transformers backend's within 1e-5 (the
    same trace of the same weights in this process: only the serialisation differs, so the
    floats agree far below the scores' float32 rounding, about 1e-6 of the largest). The
    checked edges' exact patches and the faithfulness curve (each receiver fed its own input,
    the model's modules called in the request) agree too. Given the local scores, the remote
    checks them."""
    local, remote = tiny_model("qwen2"), tiny_model("qwen2")  # grouped-query attention
    remember(remote, remote="local")
    backend = backend_for(remote)
    before = backend.requests
    remote_scored = pipatch.circuit(remote, **TINY["circuit"])
    assert backend.requests - before >= TINY["circuit"]["steps"] * 2  # a request per point per pair's run, at least
    scored = pipatch.circuit(local, **TINY["circuit"])
    mine, theirs = _edge_scores(remote_scored), _edge_scores(scored)
    assert mine.keys() == theirs.keys() and len(mine) > 100
    worst = max(abs(mine[edge] - theirs[edge]) for edge in theirs)
    print(f"circuit on NDIF (simulated): {len(mine)} edge scores, max |Δ| vs transformers {worst:.2g}")
    assert worst <= 1e-5 and max(abs(v) for v in theirs.values()) > 1e-3
    assert remote_scored.meta["method"] == scored.meta["method"] == "eap-ig"
    checked_remote, checked_local = remote_scored.meta["checked"], scored.meta["checked"]
    assert [(e["sender"], e["receiver"]) for e in checked_remote] == [(e["sender"], e["receiver"]) for e in checked_local]
    assert all(abs(a["exact"] - b["exact"]) <= 1e-6 for a, b in zip(checked_remote, checked_local))
    mine, theirs = remote_scored.meta["faithfulness"], scored.meta["faithfulness"]
    assert json.dumps(mine, sort_keys=True) == json.dumps(theirs, sort_keys=True), (mine, theirs)
    assert not [w for w in remote_scored.warnings if "faithfulness" in w]
    checked = pipatch.circuit(remote, **{**TINY["circuit"], "scores": scored})
    assert checked.meta["scores_from"]["backend"] == "transformers" and checked.meta["method"] == scored.meta["method"]
    assert torch.allclose(checked.raw["edges"] - checked.corrupt, scored.raw["edges"] - scored.corrupt,
                          atol=1e-6, equal_nan=True)  # the scores given, on this run's corrupt baseline


def test_a_feature_circuit_is_scored_on_ndif_as_on_transformers(tmp_path):
    """NDIF scores a feature circuit: the node gradients and edge pull-backs (backward passes
    on the trace's own values, inside the request) give every node's and edge's score within
    1e-5 of the transformers backend's (the same floats but for the serialisation), and the
    exact node ablations, edge patches and faithfulness curve it checks agree as well. Given a
    circuit's scores (or the file it was saved to), the remote checks them; scores of other
    positions are refused in one line."""
    local, remote = tiny_model("qwen2"), tiny_model("qwen2")
    remember(remote, remote="local")
    options = {**TINY["feature_circuit"], "verify": 3, "verify_edges": 2, "curve": 2}
    remote_scored = pipatch.feature_circuit(remote, **options)
    scored, checked = assert_same_feature_circuit_checks(remote, local, options, "ndif", atol=1e-5, refused=False)
    for table in ("nodes", "edges"):
        mine, theirs = getattr(remote_scored, table)(), getattr(scored, table)()
        key = ["node"] if table == "nodes" else ["upstream", "downstream"]
        assert mine[key].equals(theirs[key]) and len(mine) > 2
        got, want = (torch.tensor(frame["score"].to_numpy()) for frame in (mine, theirs))
        print(f"feature circuit on NDIF (simulated): {len(want)} {table}, max |Δ| {float((got - want).abs().max()):.2g}")
        assert_close(got, want, 1e-5, rtol=0)
        done = theirs["exact"].notna()
        assert_close(torch.tensor(mine["exact"][done].to_numpy()), torch.tensor(theirs["exact"][done].to_numpy()),
                     1e-5, rtol=0)
    scored.save(tmp_path / "scored.json")
    from_file = pipatch.feature_circuit(remote, **options, scores=str(tmp_path / "scored.json"))
    for table in ("nodes", "edges"):
        assert_close(torch.tensor(getattr(from_file, table)()["exact"].to_numpy()),
                     torch.tensor(getattr(checked, table)()["exact"].to_numpy()), 1e-6, rtol=0)
    scored = pipatch.feature_circuit(local, **{**options, "positions": [-1]})
    with pytest.raises(PipatchError, match=r"differs from this run in its positions: ") as caught:
        pipatch.feature_circuit(remote, **options, scores=scored)
    assert "\n" not in str(caught.value)


def test_attribution_runs_its_gradients_as_a_request(simulated, model):
    backend = backend_for(simulated)
    ids = simulated.tokenizer(EIFFEL, return_tensors="pt").input_ids
    from pipatch._model.cells import Metric
    from pipatch._model.sites import site as site_named

    metric = Metric("logit_diff", simulated.tokenizer(" Paris").input_ids[-1:], simulated.tokenizer(" Rome").input_ids[-1:])
    before = backend.requests
    got_values, got_grads, got_score = gradients(backend, ids, metric, site_named("mlp"))
    assert backend.requests == before + 1
    want_values, want_grads, want_score = gradients(backend_for(model), ids, metric, site_named("mlp"))
    assert got_score == pytest.approx(want_score, abs=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert_close(got, want, 1e-6, rtol=0)
    assert float(torch.stack([g.abs().sum() for g in got_grads]).sum()) > 0  # gradients, not zeros


# --------------------------------------------------------------------------------------------
# Requests, the live grid, Stop
# --------------------------------------------------------------------------------------------


def test_one_request_per_batch_and_the_grid_fills_per_request(simulated, model):
    kwargs = {**EMBEDDED["patch"]["kwargs"], "batch_size": 4}
    backend = backend_for(simulated)
    backend.count_bytes = True
    try:
        before, sent = backend.requests, backend.bytes_sent
        rows: list[int] = []
        result = pipatch.patch(simulated, **kwargs, on_row=lambda r, v, layer: rows.append(layer))
    finally:
        backend.count_bytes = False
    # The baselines, then one request per batch: each row's 2 cells (2 positions) are one batch.
    assert result.raw["resid"].shape == (1, len(result.layers), 2)
    assert backend.requests - before == 1 + len(result.layers)
    assert 10_000 < (backend.bytes_sent - sent) / (backend.requests - before) < 2_000_000
    assert rows == list(range(len(result.layers)))


def test_stop_lands_between_requests_and_keeps_the_rows(simulated):
    kwargs = {**EMBEDDED["patch"]["kwargs"], "batch_size": 1}
    reference = pipatch.patch(simulated, **kwargs)
    rows: list[int] = []
    backend = backend_for(simulated)
    before = backend.requests
    stopped = pipatch.patch(simulated, **kwargs, stop=lambda: len(rows) >= 3,
                            on_row=lambda r, v, layer: rows.append(layer))
    assert stopped.status == "stopped" and stopped.rows_done["resid"] == 3
    assert torch.equal(stopped.raw["resid"][:, :3], reference.raw["resid"][:, :3])
    assert backend.requests - before == 1 + 3 * reference.raw["resid"].shape[-1]  # no request after the Stop


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def test_the_magic_and_the_cli_take_remote_local(simulated, tmp_path):
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "pipatch")
    case = EMBEDDED["patch"]
    ip.run_cell_magic("patch", f"--remote local {case['line']} -o remote_patch", case["body"])
    got = ip.user_ns["remote_patch"]
    want = python_result(simulated, "patch", case["kwargs"])
    assert got.meta["backend"] == "ndif"
    assert_equal_results(got, want, atol=0.0)
    out = tmp_path / "patch.json"
    assert cli.main([*case["argv"], "--remote", "local", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["grid"] == json.loads(json.dumps(want.grid.tolist()).replace("NaN", "null"))


def test_code_writes_the_transformers_script_for_an_ndif_result(simulated):
    result = python_result(simulated, "patch", EMBEDDED["patch"]["kwargs"])
    script = result.code()
    assert "nnsight" in script and "remote" not in script.split("import")[0]


def test_bad_remote_arguments_are_one_line():
    for kwargs, said in [({"remote": "ndif.example"}, "remote='ndif.example'"),
                         ({"remote": "local", "backend": "vllm"}, "drop backend"),
                         ({"remote": True}, "pass its hub id")]:
        with pytest.raises(PipatchError) as error:
            pipatch.load_model(**kwargs)
        assert said in one_line(error), kwargs
    with pytest.raises(PipatchError) as error:
        NDIFBackend(tiny_model("llama"), remote="elsewhere")
    assert "remote='local'" in one_line(error)
    assert cli.main(["lens", EIFFEL, "--answer", " Paris", "--remote", "elsewhere"]) == 2
