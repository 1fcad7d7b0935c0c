"""The vLLM backend on the embedded model (CPU): the same grids as the transformers backend.

One vLLM engine for the whole module (in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
1 GiB KV cache, about 5 GB): it is the engine the magics and the CLI would load
(:func:`pipatch._backends._load.shared_model`), so the CLI test reuses it. The transformers model of
``conftest.py`` runs the same experiments; every vLLM number must equal its number within 1e-4
(vLLM packs requests into one flat batch and uses its own kernels, so the last bits differ).

Run apart from the other suites (``make test`` does: the engine changes process-wide torch
settings, and its memory is not all returned when it shuts down), and apart from
``test_vllm_kernel.py``, which starts an engine of its own in a Jupyter kernel.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM backend needs pip install 'pipatch[vllm]' (make install-vllm)")

import pipatch  # noqa: E402
from pipatch import cli  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._backends._load import _SHARED, shared_model  # noqa: E402
from pipatch._experiments._api import plan_patch  # noqa: E402
from pipatch._model.models import PipatchError  # noqa: E402
from tests._equal import (  # noqa: E402
    ATOL,
    assert_close,
    assert_same,
    assert_same_circuit_checks,
    assert_same_circuit_runs,
    assert_same_click,
    assert_same_feature_circuit_checks,
    assert_same_multi_token,
    attention_both_ways,
)
from tests._experiments import EMBEDDED  # noqa: E402
from tests.conftest import COLOSSEUM, EIFFEL, MEAN_PROMPTS  # noqa: E402

pytestmark = pytest.mark.vllm

PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}
SUBJECT_AND_LAST = [2, 3, 4, -1]  # " Eiffel", " Tower" (subject), " is", " of"


@pytest.fixture(scope="module")
def vllm_model():
    """The embedded model on an in-process vLLM engine, shut down after the module."""
    started = time.perf_counter()
    # bench/device_check.sh sets PIPATCH_TEST_DEVICE=cuda: stock vLLM on the GPU, same checks.
    model = shared_model(device=os.environ.get("PIPATCH_TEST_DEVICE", "cpu"), backend="vllm")
    print(f"vLLM engine started in {time.perf_counter() - started:.1f} s")
    yield model
    for key in [k for k, v in _SHARED.items() if v is model]:
        del _SHARED[key]
    model.vllm_entrypoint.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------
# What the backend is
# --------------------------------------------------------------------------------------------


def test_the_backend_describes_the_engine(vllm_model, model):
    backend = backend_for(vllm_model)
    assert backend.backend_name == "vllm" and backend_for(vllm_model) is backend  # cached on the model
    assert backend.meta() == {"model": "gemma-3-270m (embedded)", "family": "gemma3_text", "backend": "vllm",
                              "dtype": "float32", "device": "cpu"}
    reference = backend_for(model).adapter
    adapter = backend.adapter
    for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "attn", "mlp", "out_proj"):
        assert getattr(adapter, name) == getattr(reference, name), name
    assert adapter.qkv == ("qkv_proj",) and adapter.qkv_layout == "stacked"  # vLLM fuses q/k/v
    assert backend.context_length == 2048
    assert backend.decode([9079]) == [" Paris"]


def test_logits_from_final_states_equal_transformers(vllm_model, model):
    hidden = torch.randn(3, 640, generator=torch.Generator().manual_seed(0))
    want = backend_for(model).logits(hidden)
    assert_close(backend_for(vllm_model).logits(hidden), want, 1e-3)
    assert_close(backend_for(vllm_model).logits(hidden, [9079, 13706]), want[:, [9079, 13706]], 1e-3)


def test_capture_equals_transformers(vllm_model, model):
    """The baseline run: every block's residual stream, the sites, the embeddings, the metric
    (a logit difference; the answer's probability where the metric reads the softmax: the
    transformers backend reads a logit difference off two rows of the unembedding, no softmax)."""
    plan_v = plan_patch(vllm_model, **PAIR, site="head", positions=[-1])
    plan_t = plan_patch(model, **PAIR, site="head", positions=[-1])
    got, want = plan_v.sweeps[0].base.capture, plan_t.sweeps[0].base.capture
    assert_close(got.metric, want.metric)
    assert want.prob is None
    prob_v = plan_patch(vllm_model, **PAIR, site="resid", positions=[-1], metric="prob").sweeps[0].base.capture
    prob_t = plan_patch(model, **PAIR, site="resid", positions=[-1], metric="prob").sweeps[0].base.capture
    assert_close(prob_v.metric, prob_t.metric, 1e-5, rtol=0)
    assert_close(prob_v.prob, prob_t.prob, 1e-5, rtol=0)
    assert_close(got.embedded, want.embedded, 1e-5, rtol=0)
    for name in ("resid", "head"):
        for layer in range(18):
            # Gemma 3's residual stream reaches ±350: float32 rounding, relative to the largest value.
            a, b = got.sites[name][layer], want.sites[name][layer]
            assert a.shape == b.shape
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), (name, layer)


# --------------------------------------------------------------------------------------------
# What a sweep runs: blocks below a patch skipped, the tree shipped by reference
# --------------------------------------------------------------------------------------------

#: MLP forward calls seen in the engine's worker, by layer (:func:`_count_mlp_calls`).
_MLP_CALLS: dict[int, int] = {}


def _count_mlp_calls(worker, layers, on):
    """Run in the engine's worker (``collective_rpc``; in this process): count the forward
    calls of ``layers``' MLPs (a skipped block never calls its MLP), or stop counting."""
    mlps = [worker.model_runner.get_model().model.layers[i].mlp for i in layers]
    for mlp in mlps:
        for handle in getattr(mlp, "_pipatch_test_hooks", []):
            handle.remove()
        mlp._pipatch_test_hooks = []
    if on:
        _MLP_CALLS.clear()
        for i, mlp in zip(layers, mlps):
            _MLP_CALLS[i] = 0
            mlp._pipatch_test_hooks = [mlp.register_forward_hook(
                lambda *_, i=i: _MLP_CALLS.__setitem__(i, _MLP_CALLS[i] + 1))]


def _mlp_calls(vllm_model, run):
    rpc = vllm_model.vllm_entrypoint.collective_rpc
    rpc(_count_mlp_calls, args=([0, 16], True))
    try:
        result = run()
    finally:
        rpc(_count_mlp_calls, args=([0, 16], False))
    return result, dict(_MLP_CALLS)


def test_blocks_below_a_patch_do_not_run(vllm_model, model):
    """A resid grid's row at layer l skips blocks 0 … l (the base run's states go in). Block 0
    runs in two engine steps: the clean and corrupt runs (one trace, so one step) and the last
    row's head-only request (one token); block 16 in those and in the two traces of rows
    16 … 0 (the rows join: each trace from its lowest row). With the skip off every trace runs
    both; the numbers are the same."""
    backend = backend_for(vllm_model)
    kwargs = {**PAIR, "site": "resid", "positions": [4, -1]}
    skipped, calls = _mlp_calls(vllm_model, lambda: pipatch.patch(vllm_model, **kwargs))
    assert calls == {0: 2, 16: 4}, calls
    backend.skips_blocks = False
    try:
        whole, calls = _mlp_calls(vllm_model, lambda: pipatch.patch(vllm_model, **kwargs))
    finally:
        backend.skips_blocks = True
    assert calls[0] == calls[16] > 4, calls  # rows then run from layer 0 up, one trace each
    assert_close(skipped.raw["resid"], whole.raw["resid"])
    assert_same(skipped, pipatch.patch(model, **kwargs))


def test_a_study_costs_what_its_traces_cost(vllm_model, tmp_path):
    """A study on vLLM reads ROME's known-fact check off the trace's own clean run (the
    capture's top next token): a known fact runs exactly its single trace's engine steps and
    stores its grid bit for bit; an unknown one stops after that one run, kept with the
    model's top-1."""
    data = json.loads(pipatch.known_facts().read_text())
    known, unknown = data[3], data[0]  # the embedded model knows the first, not the second
    cheap = {"sites": "resid", "seeds": 1, "scale": 3.0}
    single, alone = _mlp_calls(vllm_model, lambda: pipatch.trace(
        vllm_model, known["prompt"], subject=known["subject"], answer=" " + known["attribute"], **cheap))
    found, calls = _mlp_calls(vllm_model, lambda: pipatch.study(vllm_model, [known], store=tmp_path / "k.sqlite",
                                                                **cheap))
    assert found.counts()["done"] == 1 and calls == alone, (calls, alone)
    assert torch.equal(found[0].raw["resid"], single.raw["resid"])
    skipped, calls = _mlp_calls(vllm_model, lambda: pipatch.study(vllm_model, [unknown], store=tmp_path / "u.sqlite",
                                                                  **cheap))
    row = skipped.facts().iloc[0]
    assert row["status"] == "unknown" and row["known"] == 0 and row["top1"], dict(row)
    assert calls[0] == 1, calls  # the clean run, and nothing after it


def test_the_tree_goes_by_reference_and_the_users_own_traces_are_nnsights(vllm_model):
    """pipatch's invokes name the workers' own module tree (a persistent id) instead of
    pickling it; the tag is off again after each sweep, and a hand-written trace on the same
    model (the seed recipe's clean run) works as before."""
    from pipatch._backends import _vllm_cpu_worker
    from pipatch._model import models as _models

    assert _vllm_cpu_worker.TREE_ID == _models.TREE_ID  # the CPU runner names it too (a server's)
    pipatch.patch(vllm_model, **PAIR, site="resid", positions=[-1])
    assert "_persistent_id" not in vllm_model.__dict__
    ids = vllm_model.tokenizer(EIFFEL)["input_ids"]
    paris = vllm_model.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    with vllm_model.trace(ids, temperature=0.0, max_tokens=1):
        hidden, residual = vllm_model.model.layers[5].output
        kept = (hidden + residual).clone().save()
        logits = vllm_model.logits.save()
    assert kept.dim() == 2 and kept.shape[0] == len(ids)  # [T, d]: the stream after block 5
    assert 0.4 < float(logits[0].float().softmax(-1)[paris]) < 0.6  # P(" Paris") ≈ 0.50


def test_no_method_stays_replaced_and_nothing_is_left_on_the_model_or_engine(vllm_model):
    """pipatch's traces draw no progress bars (``llm.generate`` without tqdm while they run),
    and after a sweep ``generate`` is the class's again: no method of the engine stays
    replaced, and no attribute of pipatch's is left on the model, its module or the engine."""
    from pipatch._compat.nnsight import torch_module

    llm = vllm_model.vllm_entrypoint
    objects = {"model": vllm_model, "module": torch_module(vllm_model), "llm": llm, "engine": llm.llm_engine}
    before = {name: set(vars(obj)) for name, obj in objects.items()}
    seen = []

    def on_row(result, view, layer):
        seen.append(llm.generate)  # between traces: the class's method

    r = pipatch.patch(vllm_model, **PAIR, site="resid", positions=[-1], on_row=on_row)
    assert r.status == "done" and seen
    assert "generate" not in vars(llm) and llm.generate.__func__ is type(llm).generate
    assert all(getattr(method, "__func__", None) is type(llm).generate for method in seen)
    for name, obj in objects.items():
        added = set(vars(obj)) - before[name]
        assert not [key for key in vars(obj) if key.startswith("_pipatch")], (name, sorted(vars(obj)))
        assert not {"generate", "_persistent_id"} & added, (name, added)
    # ... while one of pipatch's traces runs, generate is the quiet one.
    from pipatch._compat.vllm import quiet_generate

    with quiet_generate(llm):
        assert vars(llm)["generate"].keywords == {"use_tqdm": False}
    assert "generate" not in vars(llm)


# --------------------------------------------------------------------------------------------
# Every experiment: the transformers backend's numbers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("site", ["resid", "attn", "mlp"])
def test_patching_grid_equals_transformers(vllm_model, model, site):
    kwargs = {**PAIR, "site": site, "positions": SUBJECT_AND_LAST}
    started = time.perf_counter()
    got = pipatch.patch(vllm_model, **kwargs)
    middle = time.perf_counter()
    want = pipatch.patch(model, **kwargs)
    print(f"{site}: vllm {middle - started:.1f} s, transformers {time.perf_counter() - middle:.1f} s, "
          f"max |Δ| {float((got.raw[site] - want.raw[site]).abs().max()):.2g}")
    assert_same(got, want)


def test_head_patching_grid_equals_transformers(vllm_model, model):
    got = pipatch.patch(vllm_model, **PAIR, site="head")
    want = pipatch.patch(model, **PAIR, site="head")
    print(f"head: max |Δ| {float((got.raw['head'] - want.raw['head']).abs().max()):.2g}")
    assert_same(got, want)


def test_noising_and_mean_ablation_equal_transformers(vllm_model, model):
    for direction in ("noise", "mean"):
        kwargs = {**PAIR, "site": "mlp", "positions": [-1], "direction": direction}
        assert_same(pipatch.patch(vllm_model, **kwargs), pipatch.patch(model, **kwargs))


def test_three_seed_trace_equals_transformers(vllm_model, model):
    """Same seeds, same noise (added where block 0 reads the embeddings), same grids."""
    kwargs = {"subject": "Eiffel Tower", "answer": " Paris", "seeds": 3}
    started = time.perf_counter()
    got = pipatch.trace(vllm_model, EIFFEL, **kwargs)
    middle = time.perf_counter()
    want = pipatch.trace(model, EIFFEL, **kwargs)
    print(f"trace: vllm {middle - started:.1f} s, transformers {time.perf_counter() - middle:.1f} s, "
          f"max |Δ| {float((got.raw['resid'] - want.raw['resid']).abs().max()):.2g}")
    assert got.meta["sigma"] == pytest.approx(want.meta["sigma"], rel=1e-5)
    assert got.meta["scale"] == want.meta["scale"]
    assert_close(torch.tensor(got.meta["corrupt_prob"]), torch.tensor(want.meta["corrupt_prob"]), 1e-5, rtol=0)
    assert_same(got, want)
    # The grid is a recovery: within what its raw metric and baselines move it by (tests/_tolerance.py).
    from tests._equal import RTOL
    from tests._tolerance import assert_recovery_close, recovery_tolerance

    assert_recovery_close(got.grid, want.grid, recovery_tolerance(want, ATOL, RTOL))


def test_path_patching_equals_transformers(vllm_model, model):
    """The direct path (sweep over every MLP) and q/k/v receivers (vLLM's fused qkv_proj)."""
    for kwargs in ({"sender": "mlp"},
                   {"sender": ("head", 3, 1), "receivers": [("head", 9, 0, "q"), ("head", 9, 2, "k"),
                                                            ("head", 12, 3, "v")]}):
        assert_same(pipatch.path_patch(vllm_model, **PAIR, **kwargs), pipatch.path_patch(model, **PAIR, **kwargs))


def test_a_dataset_equals_transformers(vllm_model, model):
    pairs = {"clean": [EIFFEL, "The Louvre is in the city of"],
             "corrupt": [COLOSSEUM, "The Vatican is in the city of"], "answer": " Paris", "foil": " Rome"}
    kwargs = {**pairs, "site": "head"}  # 72 cells a pair (a dataset sweeps every position)
    assert_same(pipatch.patch(vllm_model, **kwargs), pipatch.patch(model, **kwargs))


def test_a_click_shows_the_same_top_predictions(vllm_model, model):
    assert_same_click(vllm_model, model, PAIR)


def test_multi_token_answers_equal_transformers(vllm_model, model):
    """" New York" vs " San Francisco" (two inputs per cell: the foil diverges at its first
    token), a one-token foil, P(" New York") of a trace, path patching, and a click."""
    assert_same_multi_token(vllm_model, model, backend="vllm")


def test_the_logit_lens_equals_the_hand_reference(vllm_model, model):
    """Every layer's state read through vLLM's own head: the hooks-and-by-hand reference on the
    transformers model (tests/integration/test_lens.py) within 1e-5, and the transformers backend's lens; a
    multi-token answer too. The head-only shortcut (cells that run no block) changes no bit."""
    from tests.integration.test_lens import reference_lens

    got = pipatch.lens(vllm_model, EIFFEL, answer=" Paris")
    want = reference_lens(model, EIFFEL, " Paris")
    print(f"lens: max |Δ| vs the reference {float((got.grid - want).abs().max()):.2g}")
    assert got.meta["backend"] == "vllm" and got.kind == "lens"
    assert_close(got.grid, want, atol=1e-5, rtol=0)  # measured 2.4e-6
    assert torch.equal(got.grid, pipatch.lens(vllm_model, EIFFEL, answer=" Paris", fast=False).grid)
    assert_same(got, pipatch.lens(model, EIFFEL, answer=" Paris"))
    two = pipatch.lens(vllm_model, "The Statue of Liberty is in the city of", answer=" New York")
    assert_close(two.grid, reference_lens(model, "The Statue of Liberty is in the city of", " New York"), atol=1e-5, rtol=0)
    # A rank is a count: a near-tie with the answer's logit flips with the engine's rounding. It
    # lies in the band of ranks of logits each within the backends' log-probability tolerance
    # (tests/_equal.py ATOL + RTOL·|value|: the same lens's log-probabilities checked here).
    from tests._equal import RTOL
    from tests.integration.test_lens import assert_ranks_in_band

    logprob = pipatch.lens(vllm_model, EIFFEL, answer=" Paris", metric="logprob")
    assert_close(logprob.grid, reference_lens(model, EIFFEL, " Paris", "logprob"), ATOL, RTOL)
    rank = pipatch.lens(vllm_model, EIFFEL, answer=" Paris", metric="rank")
    assert rank.metric == "rank" and float(rank.grid[-1, -1]) == 0.0
    assert_ranks_in_band(rank.grid, model, EIFFEL, " Paris", ATOL, RTOL)


def test_a_long_prompts_lens_is_one_request(vllm_model, model):
    """A 1,000-token prompt's lens is one request to the engine (one forward), whose worker
    reads every block's output and unembeds it; the model's own output in its last cell, and
    the transformers backend's numbers."""
    from tests.integration.test_lens import long_prompt

    backend = backend_for(vllm_model)
    prompt = long_prompt(model, 1000)
    with backend.log.recording() as events:
        got = pipatch.lens(vllm_model, prompt, answer=" Paris", positions=list(range(-8, 0)))
    assert [e["invokes"] for e in events if e["event"] == "requests"] == [1]
    assert len(got.tokens) >= 1000 and got.grid.shape == (18, 8)
    assert abs(float(got.grid[-1, -1]) - got.meta["output"]) < 1e-6
    assert_close(got.grid, pipatch.lens(model, prompt, answer=" Paris", positions=list(range(-8, 0))).grid,
                 atol=1e-4, rtol=0)


def test_the_logit_difference_lens_equals_the_transformers_backends(vllm_model, model):
    """A foil's lens on the engine (the difference read through two rows of the unembedding on
    the worker) equals the transformers backend's, every position of a 1,000-token prompt in
    one request."""
    from tests.integration.test_lens import long_prompt

    kwargs = {"answer": " Paris", "foil": " Rome", "metric": "logit_diff", "progress": False}
    assert_same(pipatch.lens(vllm_model, EIFFEL, **kwargs), pipatch.lens(model, EIFFEL, **kwargs))
    backend = backend_for(vllm_model)
    prompt = long_prompt(model, 1000)
    with backend.log.recording() as events:
        got = pipatch.lens(vllm_model, prompt, **kwargs)
    assert [e["invokes"] for e in events if e["event"] == "requests"] == [1]
    assert got.grid.shape == (18, len(got.tokens)) and abs(float(got.grid[-1, -1]) - got.meta["output"]) < 1e-5


def test_attribution_is_refused_in_one_line(vllm_model):
    with pytest.raises(PipatchError) as error:
        pipatch.attribute(vllm_model, **PAIR)
    message = str(error.value)
    assert "\n" not in message and "gradients" in message and "backend='transformers'" in message


def test_a_circuit_scored_on_transformers_is_checked_here(vllm_model, model):
    assert_same_circuit_checks(vllm_model, model, PAIR, backend="vllm")


def test_a_circuits_runs_equal_the_transformers_backends(vllm_model, model):
    """Each receiver fed its own input in vLLM's requests (one request a run input, every mask
    in it, Gemma's query-head group ungrouped): every mask's metric, corrupt- and mean-ablated,
    equals transformers'."""
    assert_same_circuit_runs(vllm_model, model, PAIR, MEAN_PROMPTS)


def _attention_both_ways(model, adapter):
    """A request's body, in the engine's worker: :func:`tests._equal.attention_both_ways`."""
    from pipatch._backends._vllm_worker import RequestCircuitView

    return attention_both_ways(RequestCircuitView(adapter, model), model, adapter)


def test_the_ungrouped_attention_is_the_engines_own_when_a_group_reads_one_input(vllm_model):
    """A circuit request's attention (one key/value head per query head, in plain torch)
    fed the group's own keys and values for every query head is the engine's paged attention
    over Gemma 3's one key/value head: every head's output at every layer."""
    backend = backend_for(vllm_model)
    adapter = backend.adapter
    assert adapter.n_kv_heads < adapter.n_heads  # grouped
    [layers] = backend._invokes(_attention_both_ways, [(backend.tokenizer(EIFFEL).input_ids, (adapter,))])
    assert len(layers) == adapter.n_layers
    worst = max(float((ungrouped - grouped).abs().max()) for ungrouped, grouped in layers)
    print(f"ungrouped attention vs the engine's: max |Δ| {worst:.2g}, "
          f"|z| up to {max(float(grouped.abs().max()) for _, grouped in layers):.3g}")
    for ungrouped, grouped in layers:  # the engine's CPU kernel sums in its own order
        assert_close(ungrouped, grouped)
        assert float(grouped.abs().max()) > 1e-3


# --------------------------------------------------------------------------------------------
# Interrupts, the engine reused, memory, the CLI
# --------------------------------------------------------------------------------------------


def test_an_interrupt_keeps_the_rows_and_the_engine_keeps_working(vllm_model):
    kwargs = {**PAIR, "site": "resid", "positions": [4, -1]}
    reference = pipatch.patch(vllm_model, **kwargs)
    main = threading.main_thread().ident
    import signal

    rows_seen = []

    def on_row(result, view, layer):
        rows_seen.append(layer)
        if len(rows_seen) == 4:  # interrupt while a later batch's requests are in the engine
            threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()

    r = pipatch.patch(vllm_model, **kwargs, batch_size=1, on_row=on_row)
    assert r.status == "interrupted"
    done = list(r.finished_rows("resid"))
    assert 4 <= len(done) < 18 and done == sorted(rows_seen)[-len(done):]  # from the last layer down
    assert_close(r.raw["resid"][:, done], reference.raw["resid"][:, done], 0.0, rtol=0)
    engine = vllm_model.vllm_entrypoint.llm_engine
    assert not engine.has_unfinished_requests()
    again = pipatch.patch(vllm_model, **kwargs)
    assert again.status == "done" and torch.equal(again.raw["resid"], reference.raw["resid"])


def test_stop_keeps_the_rows_and_the_engine_runs_the_next_sweep(vllm_model):
    """The Stop button of a live grid (set from another thread, as a kernel subshell does)."""
    from pipatch._notebook.live import PatchGrid, run_live

    kwargs = {**PAIR, "site": "resid", "positions": [4, -1]}
    widget = PatchGrid()

    def on_rows(change):
        if sum(change["new"].values()) >= 2 and not widget.stop_requested:
            pressed = threading.Thread(target=setattr, args=(widget, "stop_requested", True))
            pressed.start()
            pressed.join()

    widget.observe(on_rows, names="rows_done")
    r = run_live(plan_patch(vllm_model, **kwargs, batch_size=1), widget=widget, show=False)
    assert r.status == "stopped" and widget.status == "stopped"
    assert 2 <= r.rows_done["resid"] < 18
    assert not vllm_model.vllm_entrypoint.llm_engine.has_unfinished_requests()
    again = pipatch.patch(vllm_model, **kwargs)
    done = list(r.finished_rows("resid"))
    assert len(done) == r.rows_done["resid"]
    assert again.status == "done" and torch.equal(again.raw["resid"][:, done], r.raw["resid"][:, done])
    widget.close()


def test_memory_stays_flat_over_many_sweeps(vllm_model):
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    kwargs = {**PAIR, "site": "resid", "positions": [-1]}
    pipatch.patch(vllm_model, **kwargs)
    before = process.memory_info().rss
    for _ in range(6):
        pipatch.patch(vllm_model, **kwargs)
    grew = (process.memory_info().rss - before) / 2**20
    assert grew < 100, f"RSS grew {grew:.0f} MiB over 6 sweeps"


def test_the_cli_runs_on_the_shared_engine(vllm_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["patch", "--backend", "vllm", "--device", "cpu", "--clean", EIFFEL, "--corrupt", COLOSSEUM,
            "--answer", " Paris", "--foil", " Rome", "--positions", "-1", "--json", str(out), "--quiet"]
    assert cli.main(argv) == 0
    assert sum(1 for key in _SHARED if key[-1] == "vllm") == 1  # no second engine
    data = json.loads(out.read_text())
    want = pipatch.patch(vllm_model, **PAIR, positions=[-1])
    assert data["model"] == "gemma-3-270m (embedded)"
    # The same engine runs the same requests in the same batches: the same float32 recoveries
    # (the JSON holds them exactly); 1e-6 is no more than a few ulps of a recovery below 10.
    assert float(want.grid.nan_to_num().abs().max()) < 10
    assert torch.allclose(torch.tensor(data["grid"], dtype=torch.float32), want.grid, atol=1e-6)


def test_the_magic_takes_backend_vllm_and_reuses_the_engine(vllm_model, model):
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "pipatch")
    body = f"clean: {EIFFEL}\ncorrupt: {COLOSSEUM}\n"
    ip.run_cell_magic("patch", '--backend vllm --answer " Paris" --foil " Rome" --positions -1 -o via_magic', body)
    r = ip.user_ns["via_magic"]
    assert r.status == "done" and r.meta["backend"] == "vllm"
    assert sum(1 for key in _SHARED if key[-1] == "vllm") == 1
    assert torch.equal(r.raw["resid"], pipatch.patch(vllm_model, **PAIR, positions=[-1]).raw["resid"])
    ip.user_ns["tm"] = model
    with pytest.raises(UsageError, match="runs on the transformers backend, not vllm") as error:
        ip.run_cell_magic("patch", '--backend vllm --model tm --answer " Paris" --foil " Rome"', body)
    assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match="invalid choice: 'vlm'"):
        ip.run_cell_magic("patch", '--backend vlm --answer " Paris" --foil " Rome"', body)


@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
def test_a_latent_site_patches_on_vllm_as_on_transformers(vllm_model, model, kind, tmp_path):
    """An SAE's latents (``pipatch/_features``) at layer 6 of the embedded model, and a
    transcoder replacing layer 6's MLP: the same SAE folder loaded for each backend, the same
    patch grid (its SAE's row: every clean latent at one position) within the backends'
    tolerance."""
    from tests._saes import random_weights, save_saelens

    hooks = ("blocks.6.hook_mlp_in", "blocks.6.hook_mlp_out") if kind == "transcoder" else ("blocks.6.hook_resid_post", None)
    folder = save_saelens(tmp_path / kind, kind, random_weights(kind, 640, 640), hooks[0], "google/gemma-3-270m", hooks[1])
    hf, vl = (pipatch.patch(m, **PAIR, site=pipatch.load_sae(folder, m), positions=[2, 3, -1]) for m in (model, vllm_model))
    name = hf.meta["site"]
    assert vl.meta["site"] == name and vl.meta["backend"] == "vllm"
    assert_close(vl.raw[name][0], hf.raw[name][0])
    assert (hf.raw[name][0][6] - hf.corrupt).abs().max() > 1e-3



def test_latents_read_and_patch_on_vllm_as_on_transformers(vllm_model, model, tmp_path):
    """Features on vLLM: ``features()`` reads the same latents; ``feature_patch`` refuses to
    screen (no gradients) in one line naming ``scores=``, and given the transformers
    screening patches its cells (the error row's too) to the same values."""
    from tests._saes import random_weights, save_saelens

    folder = save_saelens(tmp_path / "sae", "jumprelu", random_weights("jumprelu", 640, 640), "blocks.6.hook_resid_post",
                          "google/gemma-3-270m")
    hf_site, vl_site = (pipatch.load_sae(folder, m) for m in (model, vllm_model))
    read = [pipatch.features(m, EIFFEL, saes=[s], k=5) for m, s in ((model, hf_site), (vllm_model, vl_site))]
    assert read[1].meta["latents"] == read[0].meta["latents"]  # the top 5 ids at each position
    assert_close(read[1].raw[vl_site.name], read[0].raw[hf_site.name])
    with pytest.raises(PipatchError, match=r"scores=result\)$") as error:
        pipatch.feature_patch(vllm_model, **PAIR, site=vl_site, top_k=4)
    assert "\n" not in str(error.value)
    screened = pipatch.feature_patch(model, **PAIR, site=hf_site, top_k=4, positions=[2, 3, -1])
    patched = pipatch.feature_patch(vllm_model, **PAIR, site=vl_site, positions=[2, 3, -1], scores=screened)
    assert patched.meta["backend"] == "vllm" and patched.meta["latents"] == screened.meta["latents"]
    mine = {(e["layer"], e["col"]): e["actual"] for e in patched.meta["verified_values"]}
    theirs = {(e["layer"], e["col"]): e["actual"] for e in screened.meta["verified_values"]}
    assert mine.keys() == theirs.keys() and len(mine) == 4 + 3
    assert_close(torch.tensor([mine[c] for c in theirs]), torch.tensor(list(theirs.values())))


def test_a_feature_circuit_scored_on_transformers_is_checked_on_vllm(vllm_model, model):
    """A feature circuit (random SAEs after layers 5 and 6, each folder loaded onto each
    model): refused on vLLM without ``scores=`` in one line naming it; given the transformers
    circuit, vLLM's exact node ablations and edge patches equal its own within 1e-4, and its
    faithfulness curve (whole SAEs ablated at once) within a circuit's checks' 1e-3."""
    options = {**EMBEDDED["feature_circuit"]["kwargs"], "verify": 3, "verify_edges": 2, "curve": 2}
    assert_same_feature_circuit_checks(vllm_model, model, options, "vllm", curve_atol="float32")


def test_bad_backend_choices_are_one_line():
    with pytest.raises(PipatchError, match="unknown backend 'vlm': use transformers or vllm"):
        pipatch.load_model(backend="vlm")
    with pytest.raises(PipatchError, match="engine_args .* backend='vllm'"):
        pipatch.load_model(engine_args={"max_model_len": 64})


def test_a_site_that_encodes_patches_on_vllm_as_the_hook_reference(vllm_model, model, tmp_path):
    """The site contract on vLLM: the toy site (``tests/_toy_site.py``: the residual stream
    times two, written back halved, in a module of its own) patches through vLLM's
    ``(hidden, residual)`` pair, equal to the residual stream's plain-hook reference on the
    transformers model within the backends' tolerance."""
    from tests._reference import patch_grid
    from tests._toy_site import toy_site

    doubled = toy_site(tmp_path)
    tok = model.tokenizer
    ids = [tok(text, return_tensors="pt").input_ids for text in (EIFFEL, COLOSSEUM)]
    answer, foil = (tok(t, add_special_tokens=False).input_ids[0] for t in (" Paris", " Rome"))
    result = pipatch.patch(vllm_model, **PAIR, site=doubled, positions=[2, 3, -1])
    assert result.meta["site"] == "doubled" and result.meta["backend"] == "vllm"
    want = patch_grid(model, "resid", ids[0], ids[1], answer, foil, positions=[2, 3, -1])
    assert_close(result.raw["doubled"][0], want)
    assert (want - result.corrupt).abs().max() > 1e-2


def test_a_toy_program_runs_on_vllm_as_the_hook_reference(vllm_model, model, tmp_path):
    """One way a program reaches a model: the toy program (``tests/_toy_program.py``: a site's
    norm at every layer, in a module of its own, no pipatch file changed) runs in the engine's
    worker through the generic request (one request per row, in one trace), equal to the
    plain-hook reference on the transformers model within the backends' tolerance (a norm
    sums 640 squares of states that differ by the engines' float32 rounding: ``assert_close``'s
    rtol, as the residual stream's own values)."""
    from pipatch._model.sites import site as site_named
    from tests._toy_program import hook_norms, toy_program

    toy = toy_program(tmp_path)
    backend = backend_for(vllm_model)
    rows = [model.tokenizer(text, return_tensors="pt").input_ids[0, :7] for text in (EIFFEL, COLOSSEUM)]
    ids = torch.stack(rows)
    for name in ("resid", "mlp"):
        with backend.log.recording() as events:
            got = backend.run(toy.SITE_NORMS, toy.NormsRequest(ids, site_named(name)))
        assert [e["invokes"] for e in events if e["event"] == "requests"] == [2]  # a request per row, one trace
        want = hook_norms(model, ids, name)
        worst = max(float(((g - w).abs() / w.abs().clamp_min(1)).max()) for g, w in zip(got, want))
        print(f"{name}: max relative |Δ| {worst:.2g}")
        for mine, theirs in zip(got, want):
            assert_close(mine, theirs)
