"""A ``pipatch serve --tensor-parallel-size 2`` server: the TP=2 engine behind HTTP.

One server for the module (the web server, the engine core and two spawned CPU workers, each
rank on its own core: about 10 GB), run apart from every other vLLM suite (``make
test-vllm``). The client learns the server's ranks from its info and reads the fused
``qkv_proj`` with the ``stacked_by_rank`` layout, as in process (``tests/integration/test_vllm_tp.py``):
the grids equal the transformers backend's, q/k/v receivers included, and SIGTERM leaves no
process of the tree behind.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm", reason="the served backend needs pip install 'pipatch[vllm]' (make install-vllm)")
pytest.importorskip("psutil")

import pipatch  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._serving.serve import Spawned  # noqa: E402
from tests._equal import assert_same, assert_same_click  # noqa: E402
from tests.conftest import COLOSSEUM, EIFFEL, TWO_PAIRS  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "tp-key-81d2"
PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}


@pytest.fixture(scope="module")
def server():
    process = Spawned("--api-key", KEY, "--tensor-parallel-size", "2")
    print(f"TP=2 server ready in {process.start_s:.1f} s, {process.rss_gb():.1f} GB, {len(process.tree)} processes")
    yield process
    try:
        process.stop()
    finally:
        process.kill()


@pytest.fixture(scope="module")
def served(server):
    return pipatch.load_model(serve=server.url, api_key=KEY)


def test_the_client_knows_the_ranks(server, served):
    adapter = backend_for(served).adapter
    assert adapter.tp_ranks == 2 and adapter.qkv_layout == "stacked_by_rank"
    assert len(server.tree) >= 4  # the web server, the engine core, a worker per rank


def test_the_grids_equal_transformers(served, model):
    assert_same(pipatch.patch(served, **PAIR, positions=[-1]), pipatch.patch(model, **PAIR, positions=[-1]),
                backend="served")
    assert_same(pipatch.patch(served, **PAIR, site="head", positions=[-1]),
                pipatch.patch(model, **PAIR, site="head", positions=[-1]), backend="served")
    kwargs = {"subject": "Eiffel Tower", "answer": " Paris", "seeds": 1}
    assert_same(pipatch.trace(served, EIFFEL, **kwargs), pipatch.trace(model, EIFFEL, **kwargs), backend="served")


def test_every_site_a_dataset_and_a_click_equal_transformers(served, model):
    """Attention and MLP outputs, a two-pair dataset and a click's top tokens through the TP=2
    server are the transformers backend's (the trace is in the test above)."""
    for site in ("attn", "mlp"):
        assert_same(pipatch.patch(served, **PAIR, site=site, positions=[4, -1]),
                    pipatch.patch(model, **PAIR, site=site, positions=[4, -1]), backend="served")
    assert_same(pipatch.patch(served, **TWO_PAIRS), pipatch.patch(model, **TWO_PAIRS), backend="served")
    assert_same_click(served, model, PAIR)


def test_path_patching_into_q_k_v_receivers_equals_transformers(served, model):
    kwargs = {"sender": "mlp", "receivers": [("head", 14, 0, "q"), ("head", 15, 1, "v"), ("head", 15, 2, "k")]}
    assert_same(pipatch.path_patch(served, **PAIR, **kwargs), pipatch.path_patch(model, **PAIR, **kwargs),
                backend="served")


def test_the_lens_reads_the_split_head(served, model):
    from tests.integration.test_lens import reference_lens

    got = pipatch.lens(served, EIFFEL, answer=" Paris")
    torch.testing.assert_close(got.grid, reference_lens(model, EIFFEL, " Paris"), atol=1e-5, rtol=0)


def test_sigterm_stops_every_process_of_the_split_engine(server):
    assert server.stop() == 0
    deadline = time.monotonic() + 60
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.alive() == [], f"left running: {server.alive()}"
