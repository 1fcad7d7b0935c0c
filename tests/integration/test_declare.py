"""An experiment declared once reaches every front end: a toy experiment kept in a temporary
module (its protocol and its declaration, nothing else) runs through the Python API, the CLI's
``--json``, a cell magic in a real Jupyter kernel and ``PatchGrid.run``, with no file of
pipatch changed; and the old spellings of renamed parameters still work, with a warning."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import pipatch
from pipatch._experiments import _api
from pipatch._model.models import PipatchError
from tests.conftest import EIFFEL

#: Another process (CLI, kernel) runs its own CPU kernels, threads and batch picks: its numbers agree to
#: float32 accumulation order (measured up to 7.6e-6 on a CI machine), not bit for bit. Derived: the
#: toy's grid is a recovery P / P(clean) (its corrupt baseline 0), each probability within the metric's
#: 1e-5 in another process, so each cell within the ratio's bound (tests/_tolerance.py), which
#: :func:`assert_across_processes` checks is at most this.
ACROSS_PROCESSES = 1e-4


def assert_across_processes(got: torch.Tensor, want) -> None:
    """``got`` (another process's grid) equals ``want`` (the toy result)'s within
    :data:`ACROSS_PROCESSES`, after checking that the ratio's bound stays below it."""
    from tests._tolerance import recovery_tolerance

    assert float(recovery_tolerance(want, 1e-5).nan_to_num().max()) <= ACROSS_PROCESSES
    torch.testing.assert_close(got, want.grid, atol=ACROSS_PROCESSES, rtol=0)


def _env(toy_dir) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(toy_dir), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def toy_result(toy, model):
    return pipatch.toy_ablate(model, EIFFEL, answer=" Paris")


def test_the_python_api_derives_the_function_from_the_declaration(toy, toy_result, model):
    assert list(inspect.signature(pipatch.toy_ablate).parameters) == [
        "model", "prompt", "answer", "batch_size", "on_row", "stop", "progress"]
    assert "Zero-ablate the residual stream" in pipatch.toy_ablate.__doc__
    r = toy_result
    assert r.kind == "toy_ablation" and r.status == "done" and r.title == "Toy ablation · ' Paris'"
    assert r.grid.shape == (18, len(r.tokens)) and torch.isfinite(r.raw["resid"]).all()
    # Zeroing the residual stream at the last position of the last layer leaves no Paris.
    assert float(r.raw["resid"][0, -1, -1]) < 0.01 < r.clean_value
    # Its planner and a missing argument's message come from the declaration too.
    assert _api.plan_toy_ablate(model, EIFFEL, answer=" Paris").result.kind == "toy_ablation"
    with pytest.raises(PipatchError, match=r"toy_ablate\(\) needs answer="):
        pipatch.toy_ablate(None, EIFFEL)


def test_the_cli_runs_the_toy_with_json(toy_dir, toy_result, tmp_path):
    out = tmp_path / "toy.json"
    done = subprocess.run([sys.executable, "-m", "pipatch.cli", "toy-ablate", EIFFEL, "--answer", " Paris",
                           "--json", str(out), "--quiet"], env=_env(toy_dir), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["kind"] == "toy_ablation"
    assert_across_processes(torch.tensor(data["grid"]), toy_result)
    helped = subprocess.run([sys.executable, "-m", "pipatch.cli", "toy-ablate", "--help"], env=_env(toy_dir),
                            capture_output=True, text=True, timeout=300)
    assert "--answer ANSWER" in helped.stdout and "--batch-size BATCH_SIZE" in helped.stdout


def test_a_real_kernel_runs_the_toy_as_a_magic(toy_dir, toy_result):
    jupyter_client = pytest.importorskip("jupyter_client")
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(toy_dir), env=_env(toy_dir))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        code = (f"import sys; assert sys.prefix == {sys.prefix!r}\n%load_ext pipatch\n")
        cell = '%%toy_ablate --answer " Paris" -o toy\n' + EIFFEL
        show = "import json; print(json.dumps(toy.grid.tolist()), toy.kind)"
        outputs = []
        for source in (code, cell, show):
            msg_id = client.execute(source)
            deadline = time.monotonic() + 600
            while True:
                msg = client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 1))
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "error":
                    raise AssertionError(f"{msg['content']['ename']}: {msg['content']['evalue']}")
                if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                    outputs.append(msg["content"]["text"])
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
        grid, kind = "".join(outputs).rsplit(" ", 1)
        assert kind.strip() == "toy_ablation"
        assert_across_processes(torch.tensor(json.loads(grid)), toy_result)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_patchgrid_run_runs_the_toy(toy, toy_result, model):
    from pipatch._notebook.live import PatchGrid

    r = PatchGrid.run(model, "toy_ablate", prompt=EIFFEL, answer=" Paris")
    assert r.kind == "toy_ablation"
    torch.testing.assert_close(r.raw["resid"], toy_result.raw["resid"], atol=1e-6, rtol=0)


def test_renamed_parameters_keep_working_with_a_warning(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=1, scale=3.0, kind="mlp",
                            window=2)
    assert any(issubclass(w.category, DeprecationWarning) and "sites=" in str(w.message) for w in caught)
    new = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=1, scale=3.0, sites="mlp",
                        window=2)
    assert old.views == new.views == ["mlp"] and torch.equal(old.raw["mlp"], new.raw["mlp"])
    with pytest.raises(PipatchError, match="both kind= and sites="):
        pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", kind="mlp", sites="mlp")
    with pytest.raises(PipatchError, match="unexpected argument 'sede'"):
        pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", sede=3)
