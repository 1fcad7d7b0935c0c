"""Tensor parallelism on vLLM's CPU build: the embedded model split over two ranks.

One TP=2 engine for the module (two spawned CPU workers, gloo and shared-memory collectives,
about 8 GB with its workers), run apart from the other vLLM suites (``make test-vllm``).
pipatch gives each rank its own cores (``VLLM_CPU_OMP_THREADS_BIND``, which vLLM's default
``auto`` would set per NUMA node, and this machine has one), and reads the fused ``qkv_proj``
output, gathered rank after rank, with the ``stacked_by_rank`` layout: the grids equal the
transformers backend's, path patching into q/k/v receivers included (which reading it as
one stacked projection got wrong by up to 0.065, silently).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM backend needs pip install 'pipatch[vllm]' (make install-vllm)")

import pipatch  # noqa: E402
from pipatch import cli  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._backends._load import _SHARED, shared_model  # noqa: E402
from tests._equal import assert_close, assert_same, assert_same_click  # noqa: E402
from tests.conftest import COLOSSEUM, EIFFEL, TWO_PAIRS  # noqa: E402

pytestmark = pytest.mark.vllm

PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}


@pytest.fixture(scope="module")
def tp_model():
    """The embedded model on an in-process TP=2 vLLM engine, shut down after the module: the
    engine ``--backend vllm --tensor-parallel-size 2`` loads (the CLI test reuses it)."""
    was = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # pipatch chooses (the test checks it)
    started = time.perf_counter()
    model = shared_model(backend="vllm", tensor_parallel_size=2)
    print(f"TP=2 vLLM engine started in {time.perf_counter() - started:.1f} s, "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')!r}")
    yield model
    for key in [k for k, v in _SHARED.items() if v is model]:
        del _SHARED[key]
    model.vllm_entrypoint.llm_engine.engine_core.shutdown()
    if was is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = was


def test_each_rank_gets_its_own_cores_and_the_adapter_knows_the_ranks(tp_model):
    cores = sorted(os.sched_getaffinity(0))
    binding = os.environ["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert len(binding) == 2 and all(binding)
    if len(cores) >= 2:
        used = [int(c) for part in binding for c in part.split(",")]
        assert sorted(used) == sorted(set(used)) and set(used) <= set(cores)  # no core shared
    adapter = backend_for(tp_model).adapter
    assert adapter.tp_ranks == 2 and adapter.qkv_layout == "stacked_by_rank"


def test_each_rank_reports_its_own_memory(tp_model):
    ranks = backend_for(tp_model).rank_memory()
    print("memory per rank:", ", ".join(f"rank {r['rank']} (pid {r['pid']}): {r['rss_gb']} GB" for r in ranks))
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3  # a worker process per rank
    assert all(0.3 < r["rss_gb"] < 8 for r in ranks)  # its weight shard and its own KV cache


def test_stop_keeps_the_rows_and_the_ranks_run_the_next_sweep(tp_model):
    kwargs = {**PAIR, "positions": [-1], "batch_size": 3}
    rows: list[int] = []
    stopped = pipatch.patch(tp_model, **kwargs, stop=lambda: len(rows) >= 2, on_row=lambda r, v, layer: rows.append(layer))
    # Rows run from the last layer down, a few sharing a trace: they finish together.
    assert stopped.status == "stopped" and 2 <= stopped.rows_done["resid"] == len(rows) < 18
    done = list(stopped.finished_rows("resid"))
    assert done == sorted(rows)
    whole = pipatch.patch(tp_model, **kwargs)
    assert whole.status == "done" and torch.equal(stopped.raw["resid"][:, done], whole.raw["resid"][:, done])
    assert len(backend_for(tp_model).rank_memory()) == 2  # both ranks still answer


def test_the_resid_and_head_grids_equal_transformers(tp_model, model):
    assert_same(pipatch.patch(tp_model, **PAIR, positions=[-1]), pipatch.patch(model, **PAIR, positions=[-1]))
    assert_same(pipatch.patch(tp_model, **PAIR, site="head", positions=[-1]),
                pipatch.patch(model, **PAIR, site="head", positions=[-1]))


def test_every_site_a_trace_a_dataset_and_a_click_equal_transformers(tp_model, model):
    """The other sites (attention and MLP outputs: all-reduced, whole on every rank), a causal
    trace (noise at block 0's input), a two-pair dataset averaged over named positions and a
    click's top tokens at TP=2 are the transformers backend's."""
    for site in ("attn", "mlp"):
        assert_same(pipatch.patch(tp_model, **PAIR, site=site, positions=[4, -1]),
                    pipatch.patch(model, **PAIR, site=site, positions=[4, -1]))
    trace = {"subject": "Eiffel Tower", "answer": " Paris", "seeds": 2}
    assert_same(pipatch.trace(tp_model, EIFFEL, **trace), pipatch.trace(model, EIFFEL, **trace))
    assert_same(pipatch.patch(tp_model, **TWO_PAIRS), pipatch.patch(model, **TWO_PAIRS))
    assert_same_click(tp_model, model, PAIR)


def test_path_patching_into_q_k_v_receivers_equals_transformers(tp_model, model):
    """The receivers read and write the fused projection's columns: a query head on each rank,
    and the key/value head that each rank holds a copy of (the model has one)."""
    kwargs = {"sender": "mlp", "receivers": [("head", 14, 0, "q"), ("head", 15, 1, "v"), ("head", 15, 2, "k"),
                                             ("head", 13, 3, "q")]}
    got, want = pipatch.path_patch(tp_model, **PAIR, **kwargs), pipatch.path_patch(model, **PAIR, **kwargs)
    print(f"path grid: max |value| {float(want.grid.nan_to_num().abs().max()):.3f}, "
          f"max |Δ| {float((got.grid - want.grid).nan_to_num().abs().max()):.2g}")
    assert_same(got, want)


def test_a_circuit_on_the_split_engine_is_checked_and_its_curve_refused_in_one_line(tp_model, model):
    """The top edges' exact patches run on the ranks; a circuit's runs, which compute each
    receiver's input from a layer's whole weights, are one warning naming the fix."""
    options = {**PAIR, "method": "eap", "verify": 4, "curve": 3}
    scored = pipatch.circuit(model, **options)
    checked = pipatch.circuit(tp_model, **options, scores=scored)
    got = torch.tensor([e["exact"] for e in checked.meta["checked"]])
    assert_close(got, torch.tensor([e["exact"] for e in scored.meta["checked"]]))
    [warning] = checked.warnings
    assert warning.startswith("no faithfulness curve:") and "tensor_parallel_size=1" in warning and "\n" not in warning
    assert "faithfulness" not in checked.meta


def test_the_logit_lens_reads_the_split_head(tp_model, model):
    """Each rank holds a slice of the vocabulary: the head-only shortcut's logits are gathered
    ones, and a multi-token answer (a forward per cell) agrees too."""
    from tests.integration.test_lens import reference_lens

    got = pipatch.lens(tp_model, EIFFEL, answer=" Paris")
    want = reference_lens(model, EIFFEL, " Paris")
    print(f"lens: max |Δ| vs the reference {float((got.grid - want).abs().max()):.2g}")
    torch.testing.assert_close(got.grid, want, atol=1e-5, rtol=0)
    two = pipatch.lens(tp_model, "The Statue of Liberty is in the city of", answer=" New York")
    assert_same(two, pipatch.lens(model, "The Statue of Liberty is in the city of", answer=" New York"))


def test_the_cli_runs_on_the_split_engine(tp_model, tmp_path):
    """``pipatch patch ... --backend vllm --tensor-parallel-size 2``: the same engine, the same grid."""
    out = tmp_path / "heads.json"
    argv = ["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome",
            "--site", "head", "--positions=-1", "--backend", "vllm", "--tensor-parallel-size", "2", "--quiet",
            "--json", str(out)]
    assert cli.main(argv) == 0
    assert sum(1 for key in _SHARED if key[-1] == "vllm") == 1  # no second engine
    data = json.loads(out.read_text(encoding="utf-8"))
    want = pipatch.patch(tp_model, **PAIR, site="head", positions=[-1])
    # The same engine runs the same requests in the same batches: the same float32 recoveries
    # (the JSON holds them exactly); 1e-6 is no more than a few ulps of a recovery below 10.
    assert float(want.grid.nan_to_num().abs().max()) < 10
    assert torch.allclose(torch.tensor(data["grid"], dtype=torch.float32), want.grid, atol=1e-6)
