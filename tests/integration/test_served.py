"""The served backend: a real ``pipatch serve`` (nnsight's server on a vLLM engine) and clients.

One server for the module, started once on a free loopback port with an API key, as a team
would start it (``python -m pipatch.cli serve --port P --api-key K``: a web server, a vLLM
engine process and its worker, about 7.4 GB on this CPU). The client (``load_model(serve=)``:
a weightless module tree in this process) runs every experiment there; the numbers must be
the transformers backend's within 1e-4 (feature reads and latent patches included). Then the
failures (bad request, wrong key, wrong model, timeout, unreachable; nnsight code and malformed
program requests refused in one line), four clients at once, memory under load, Stop and interrupts,
the CLI, a notebook cell in a real kernel, and last: SIGTERM stops the server and leaves none of its processes behind.

Run apart from the other vLLM suites (``make test-vllm`` does), one pytest process each.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm", reason="the served backend needs pip install 'pipatch[vllm]' (make install-vllm)")
psutil = pytest.importorskip("psutil")

import pipatch  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._backends._served_programs import PROGRAM_FORMAT  # noqa: E402
from pipatch._backends.served import ServedBackend, Server  # noqa: E402
from pipatch._engine import EngineError  # noqa: E402
from pipatch._experiments._api import plan_patch  # noqa: E402
from pipatch._model.cells import Cell, Op  # noqa: E402
from pipatch._model.models import PipatchError  # noqa: E402
from pipatch._model.sites import RESID  # noqa: E402
from pipatch._programs import PatchRequest, patch  # noqa: E402
from pipatch._serving.serve import GENERATE_PATH, SKIP_HEADER, Spawned  # noqa: E402
from tests._equal import (  # noqa: E402
    ATOL,
    assert_close,
    assert_same,
    assert_same_circuit_checks,
    assert_same_circuit_runs,
    assert_same_click,
    assert_same_feature_circuit_checks,
    assert_same_multi_token,
)
from tests._experiments import EMBEDDED  # noqa: E402
from tests._program_requests import BAD_REQUESTS, good_request  # noqa: E402
from tests.conftest import COLOSSEUM, EIFFEL, MEAN_PROMPTS  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "test-key-4f1c"
PAIR = {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"}
SUBJECT_AND_LAST = [2, 3, 4, -1]  # " Eiffel", " Tower" (subject), " is", " of"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    """Where the toy program's module is written (:mod:`tests._toy_program`): the server's
    operator names it (``--programs``), the client imports it."""
    from tests._toy_program import toy_program

    folder = tmp_path_factory.mktemp("programs")
    toy_program(folder)
    return folder


@pytest.fixture(scope="module")
def server(toy_folder):
    from tests._toy_program import toy_module_name

    path = os.pathsep.join(p for p in (str(toy_folder), os.environ.get("PYTHONPATH", "")) if p)
    process = Spawned("--api-key", KEY, "--programs", toy_module_name(toy_folder), env={"PYTHONPATH": path})
    print(f"server ready in {process.start_s:.1f} s, {process.rss_gb():.1f} GB, {len(process.tree)} processes")
    yield process
    try:
        process.stop()
    finally:
        process.kill()  # anything left (the last test asserts there is nothing)


@pytest.fixture(scope="module")
def served(server):
    started = time.perf_counter()
    model = pipatch.load_model(serve=server.url, api_key=KEY)
    print(f"client ready in {time.perf_counter() - started:.1f} s")
    return model


# --------------------------------------------------------------------------------------------
# What the client is, and the numbers
# --------------------------------------------------------------------------------------------


def test_the_client_describes_the_server(served, server, model):
    backend = backend_for(served)
    assert isinstance(backend, ServedBackend) and backend_for(served) is backend
    assert backend.meta() == {"model": "gemma-3-270m (embedded)", "family": "gemma3_text", "backend": "served",
                              "dtype": "float32", "device": "cpu", "server": server.url}
    assert backend.context_length == 2048
    assert backend.decode([9079]) == [" Paris"]
    reference = backend_for(model).adapter
    for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model"):
        assert getattr(backend.adapter, name) == getattr(reference, name), name
    assert getattr(served, "dispatched", None) is False  # no weights here: they are on the server


@pytest.mark.parametrize("site", ["resid", "attn", "mlp", "head"])
def test_patching_every_site_equals_transformers(served, server, model, site):
    started = time.perf_counter()
    got = pipatch.patch(served, **PAIR, site=site)
    middle = time.perf_counter()
    want = pipatch.patch(model, **PAIR, site=site)
    print(f"{site}: served {middle - started:.1f} s, transformers {time.perf_counter() - middle:.1f} s, "
          f"max |Δ| {float((got.raw[site] - want.raw[site]).abs().max()):.2g}")
    assert_same(got, want, backend="served")
    assert got.meta["server"] == server.url and "server" not in want.meta


def test_a_trace_equals_transformers(served, model):
    kwargs = {"subject": "Eiffel Tower", "answer": " Paris", "seeds": 2}
    got = pipatch.trace(served, EIFFEL, **kwargs)
    want = pipatch.trace(model, EIFFEL, **kwargs)
    print(f"trace: max |Δ| {float((got.raw['resid'] - want.raw['resid']).abs().max()):.2g}")
    assert got.meta["sigma"] == pytest.approx(want.meta["sigma"], rel=1e-5)
    assert_same(got, want, backend="served")
    # The grid is a recovery: within what its raw metric and baselines move it by (tests/_tolerance.py).
    from tests._equal import RTOL
    from tests._tolerance import assert_recovery_close, recovery_tolerance

    assert_recovery_close(got.grid, want.grid, recovery_tolerance(want, ATOL, RTOL))


def test_path_patching_a_dataset_and_a_click_equal_transformers(served, model):
    kwargs = {**PAIR, "sender": ("head", 3, 1), "receivers": [("head", 9, 0, "q"), ("head", 12, 3, "v")]}
    assert_same(pipatch.path_patch(served, **kwargs), pipatch.path_patch(model, **kwargs), backend="served")
    pairs = {"clean": [EIFFEL, "The Louvre is in the city of"],
             "corrupt": [COLOSSEUM, "The Vatican is in the city of"], "answer": " Paris", "foil": " Rome"}
    assert_same(pipatch.patch(served, **pairs, site="mlp", positions=[-1]),
                pipatch.patch(model, **pairs, site="mlp", positions=[-1]), backend="served")
    assert_same_click(served, model, PAIR)


def test_multi_token_answers_equal_transformers(served, model):
    """The served backend runs the vLLM backend's invoke bodies (checked in full in test_vllm.py):
    here the two-input requests of one cell over HTTP, a trace and a click."""
    assert_same_multi_token(served, model, backend="served", everything=False)


def test_the_logit_lens_equals_the_hand_reference(served, model):
    from tests.integration.test_lens import reference_lens

    got = pipatch.lens(served, EIFFEL, answer=" Paris")
    want = reference_lens(model, EIFFEL, " Paris")
    print(f"lens: max |Δ| vs the reference {float((got.grid - want).abs().max()):.2g}")
    assert got.kind == "lens"
    assert_close(got.grid, want, atol=1e-5, rtol=0)  # the head-only shortcut, over HTTP: one request
    assert_same(got, pipatch.lens(model, EIFFEL, answer=" Paris"), backend="served")
    # A rank is a count: a near-tie with the answer's logit flips with the engine's rounding. It
    # lies in the band of ranks of logits each within the backends' log-probability tolerance
    # (tests/_equal.py ATOL + RTOL·|value|: the same lens's log-probabilities checked here).
    from tests._equal import RTOL
    from tests.integration.test_lens import assert_ranks_in_band

    logprob = pipatch.lens(served, EIFFEL, answer=" Paris", metric="logprob")
    assert_close(logprob.grid, reference_lens(model, EIFFEL, " Paris", "logprob"), ATOL, RTOL)
    rank = pipatch.lens(served, EIFFEL, answer=" Paris", metric="rank")
    assert rank.metric == "rank" and float(rank.grid[-1, -1]) == 0.0
    assert_ranks_in_band(rank.grid, model, EIFFEL, " Paris", ATOL, RTOL)


def test_a_circuit_scored_on_transformers_is_checked_through_the_server(served, model):
    assert_same_circuit_checks(served, model, PAIR, backend="served")


def test_a_circuits_runs_through_the_server_equal_the_transformers_backends(served, model):
    assert_same_circuit_runs(served, model, PAIR, MEAN_PROMPTS)


def test_two_circuits_at_once_on_one_server_each_get_their_own_curve(served, model):
    """Two circuits' curves (corrupt and mean ablation of one pair: different values at every
    point) measured from two threads at once, their requests interleaved on the one server:
    each equals the transformers curve of the same circuit. No request reads another's
    values, so they may share engine steps in any order."""
    options = {**PAIR, "method": "eap", "verify": 0, "curve": 6}
    scored = {ablation: pipatch.circuit(model, **options, ablation=ablation) for ablation in ("corrupt", "mean")}
    started = threading.Barrier(2)

    def measure(ablation: str) -> dict:
        started.wait()
        return pipatch.circuit(served, **options, ablation=ablation, scores=scored[ablation]).meta["faithfulness"]

    with ThreadPoolExecutor(2) as pool:
        curves = dict(zip(scored, pool.map(measure, scored)))
    assert curves["corrupt"]["recovery"] != curves["mean"]["recovery"]
    from tests._equal import assert_same_curve

    for ablation, curve in curves.items():
        assert curve["ablation"] == ablation
        # Each point within the ratio's bound of the transformers one, the sizes alike (derived: tests/_equal.py).
        assert_same_curve(curve, scored[ablation], f"served, {ablation} ablation beside another")


def test_attribution_is_refused_in_one_line(served):
    with pytest.raises(PipatchError) as error:
        pipatch.attribute(served, **PAIR)
    assert "\n" not in str(error.value) and "backend='transformers'" in str(error.value)


@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
def test_latents_read_and_patch_on_the_server_as_on_transformers(served, model, kind, tmp_path):
    """Features through the server: an SAE of layer 6's output (a transcoder replacing layer 6's
    MLP) loaded onto the client; ``features()`` reads the same latents (ids and activations);
    ``feature_patch`` refuses to screen (no gradients) in one line naming ``scores=``, and given
    the transformers screening patches its cells (the error row's too) to the same values."""
    from tests._saes import random_weights, save_saelens

    hooks = ("blocks.6.hook_mlp_in", "blocks.6.hook_mlp_out") if kind == "transcoder" else ("blocks.6.hook_resid_post", None)
    folder = save_saelens(tmp_path / kind, kind, random_weights(kind, 640, 640), hooks[0], "google/gemma-3-270m", hooks[1])
    hf_site, sv_site = (pipatch.load_sae(folder, m) for m in (model, served))
    read = [pipatch.features(m, EIFFEL, saes=[s], k=5) for m, s in ((model, hf_site), (served, sv_site))]
    assert read[1].meta["backend"] == "served" and read[1].meta["latents"] == read[0].meta["latents"]
    assert_close(read[1].raw[sv_site.name], read[0].raw[hf_site.name])
    with pytest.raises(PipatchError, match=r"scores=result\)$") as error:
        pipatch.feature_patch(served, **PAIR, site=sv_site, top_k=4)
    assert "\n" not in str(error.value)
    screened = pipatch.feature_patch(model, **PAIR, site=hf_site, top_k=4, positions=[2, 3, -1])
    patched = pipatch.feature_patch(served, **PAIR, site=sv_site, positions=[2, 3, -1], scores=screened)
    assert patched.meta["backend"] == "served" and patched.meta["latents"] == screened.meta["latents"]
    mine = {(e["layer"], e["col"]): e["actual"] for e in patched.meta["verified_values"]}
    theirs = {(e["layer"], e["col"]): e["actual"] for e in screened.meta["verified_values"]}
    assert mine.keys() == theirs.keys() and len(mine) == 4 + 3
    print(f"{kind}: exact patches through the server, max |Δ| "
          f"{max(abs(mine[cell] - value) for cell, value in theirs.items()):.2g}")
    assert_close(torch.tensor([mine[c] for c in theirs]), torch.tensor(list(theirs.values())))
    assert max(abs(value - screened.corrupt) for value in theirs.values()) > 1e-3  # the patches move it


def test_a_feature_circuit_scored_on_transformers_is_checked_through_the_server(served, model):
    """A feature circuit's checks through the server: refused without ``scores=`` in one line
    naming it; given the transformers circuit, its exact node ablations and edge patches (an
    SAE's latents and error, by name and as data) equal the transformers ones within 1e-4,
    and its faithfulness curve (each SAE's latents and error written as one site) within a
    circuit's checks' 1e-3, as on vLLM in process."""
    options = {**EMBEDDED["feature_circuit"]["kwargs"], "verify": 3, "verify_edges": 2, "curve": 2}
    assert_same_feature_circuit_checks(served, model, options, "served", curve_atol="float32")


# --------------------------------------------------------------------------------------------
# Failures: one line each, the partial result kept, the server keeps working
# --------------------------------------------------------------------------------------------


def test_a_failing_request_is_one_line_and_the_next_one_works(served):
    plan = plan_patch(served, **PAIR, site="resid", positions=[-1])
    sweep = plan.sweeps[0]
    wrong_shape = torch.zeros(1, 1, 7)  # the residual stream is 640 wide
    bad = Cell(row=5, col=0, seed=0, start=5, ops=[Op(RESID, 5, (slice(None), slice(-1, None)), wrong_shape)])
    started = time.perf_counter()
    with pytest.raises(PipatchError) as error:
        patch(backend_for(served), PatchRequest.of(sweep.base, [[bad]], sweep.metric))
    message = str(error.value)
    print(f"bad request answered in {time.perf_counter() - started:.2f} s: {message}")
    assert "\n" not in message and message.startswith("the server failed the request: RuntimeError: ")
    assert "size" in message  # the reason (a shape mismatch), not a traceback line
    good = pipatch.patch(served, **PAIR, site="resid", positions=[-1])
    assert good.status == "done" and torch.isfinite(good.raw["resid"]).all()


# --------------------------------------------------------------------------------------------
# Programs by name: no client code, every field checked
# --------------------------------------------------------------------------------------------


def post(server, path: str, blob: bytes, skip: str = "0"):
    import httpx
    from nnsight.modeling.vllm.serve import http

    return httpx.post(server.url + path, content=blob, headers={**http.headers(KEY), SKIP_HEADER: skip}, timeout=600)


def answer_ids(served) -> tuple[list[int], int, int]:
    tokenizer = served.tokenizer
    return (tokenizer(EIFFEL)["input_ids"], *(tokenizer(word, add_special_tokens=False)["input_ids"][0]
                                              for word in (" Paris", " Rome")))


def test_nnsight_code_is_refused_by_default_and_a_good_request_runs_after(served, server):
    """A real nnsight trace (code) sent to nnsight's own routes: 403, one line naming the flag
    that would allow it; the server says it runs no client code, and serves the next good
    request."""
    from nnsight.schema.request import RequestModel

    class Kept:
        blob = b""

        def __call__(self, tracer):
            self.blob = RequestModel.serialize(tracer, compress=False)

    kept = Kept()
    ids, _, _ = answer_ids(served)
    with torch.no_grad(), served.trace(backend=kept, temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(ids):
            logits = served.logits.save()  # noqa: F841 - what the code would send back
    assert len(kept.blob) > 100
    info = backend_for(served).server.info
    assert info["client_code"] is False and info["program_format"] == PROGRAM_FORMAT
    for path in ("/v1/nnsight/generate", "/v1/nnsight/register/mine"):
        response = post(server, path, kept.blob)
        print(f"{path}: {response.status_code} {response.text}")
        assert response.status_code == 403 and "\n" not in response.text.strip()
        assert "--allow-client-code" in response.text
    good = pipatch.patch(served, **PAIR, site="resid", positions=[-1])
    assert good.status == "done" and torch.isfinite(good.raw["resid"]).all()


def test_bad_program_requests_are_refused_in_one_line_and_the_next_good_one_runs(served, server):
    ids, paris, rome = answer_ids(served)
    backend = backend_for(served)
    good = good_request(backend.adapter, ids, paris, rome)
    (reference,) = backend.server.generate(good).values()
    for what, broken, words in BAD_REQUESTS:
        started = time.perf_counter()
        response = post(server, GENERATE_PATH, broken(good))
        print(f"{what}: {response.status_code} in {time.perf_counter() - started:.2f} s: {response.text}")
        assert response.status_code == 400 and "\n" not in response.text.strip() and words in response.text, what
        (after,) = backend.server.generate(good).values()  # served right after
        assert torch.equal(after.out, reference.out) and torch.equal(after.reads[0], reference.reads[0]), what
    response = post(server, GENERATE_PATH, good, skip="5")  # the rooms admit it by its header
    assert response.status_code == 400 and "header says '5'" in response.text
    with pytest.raises(PipatchError) as error:  # and the client's line, through its own call
        backend.server.generate({what: broken for what, broken, _ in BAD_REQUESTS}["unknown program"](good))
    assert "\n" not in str(error.value) and "answered 400: unknown program 'os.system'" in str(error.value)


def test_keys_models_and_addresses_are_checked_in_one_line(server):
    cases = [
        ({"serve": server.url, "api_key": "wrong"}, "refused the API key"),
        ({"serve": server.url}, "refused the API key"),
        ({"name": "gpt2", "serve": server.url, "api_key": KEY}, "serves 'gemma-3-270m (embedded)', not 'gpt2'"),
        ({"serve": server.url, "api_key": KEY, "dtype": "bfloat16"}, "runs float32, not bfloat16"),
        ({"serve": f"http://127.0.0.1:{free_port()}", "api_key": KEY}, "cannot reach a pipatch server"),
        ({"serve": "localhost:6677"}, "is not a server URL"),
        ({"serve": server.url, "backend": "vllm"}, "drop backend="),
        ({"api_key": KEY}, "api_key is for a server"),
    ]
    for kwargs, expected in cases:
        started = time.perf_counter()
        with pytest.raises(PipatchError) as error:
            pipatch.load_model(**kwargs)
        assert time.perf_counter() - started < 15, kwargs  # before any model is built
        assert expected in str(error.value) and "\n" not in str(error.value), (kwargs, str(error.value))


def test_a_timeout_fails_the_batch_in_one_line_and_keeps_the_rows(served):
    plan = plan_patch(served, **PAIR, site="resid", positions=[-1], batch_size=1)
    backend = backend_for(served)
    rows = []

    def slow_after_two_rows(result, view, layer):
        rows.append(layer)
        if len(rows) == 2:
            backend.server.timeout = 1e-4  # no engine answers in 0.1 ms

    try:
        with pytest.raises(EngineError) as error:
            plan.run(on_row=slow_after_two_rows)
    finally:
        backend.server.timeout = 600.0
    message = str(error.value)
    assert "did not answer within" in message and "\n" not in message
    partial = error.value.partial
    assert partial.status == "failed" and partial.rows_done["resid"] == 2
    done = list(partial.finished_rows("resid"))  # rows run from the last layer down
    assert done == sorted(rows[:2]) == [16, 17]
    left = [layer for layer in range(18) if layer not in done]
    assert torch.isfinite(partial.raw["resid"][:, done]).all() and partial.raw["resid"][:, left].isnan().all()
    assert pipatch.patch(served, **PAIR, site="resid", positions=[-1]).status == "done"


def test_stop_and_interrupt_keep_the_finished_rows(served):
    kwargs = {**PAIR, "site": "resid", "positions": [4, -1], "batch_size": 1}
    reference = pipatch.patch(served, **kwargs)
    rows: list[int] = []
    stopped = pipatch.patch(served, **kwargs, stop=lambda: len(rows) >= 3, on_row=lambda r, v, layer: rows.append(layer))
    assert stopped.status == "stopped" and stopped.rows_done["resid"] == 3
    done = list(stopped.finished_rows("resid"))  # rows run from the last layer down
    assert done == sorted(rows) == [15, 16, 17]
    assert torch.equal(stopped.raw["resid"][:, done], reference.raw["resid"][:, done])
    main = threading.main_thread().ident
    seen: list[int] = []

    def on_row(result, view, layer):
        seen.append(layer)
        if len(seen) == 4:
            threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()

    interrupted = pipatch.patch(served, **kwargs, on_row=on_row)
    done = list(interrupted.finished_rows("resid"))
    assert interrupted.status == "interrupted" and 4 <= len(done) < 18
    assert torch.equal(interrupted.raw["resid"][:, done], reference.raw["resid"][:, done])
    again = pipatch.patch(served, **kwargs)
    assert torch.equal(again.raw["resid"], reference.raw["resid"])


# --------------------------------------------------------------------------------------------
# Under load
# --------------------------------------------------------------------------------------------

CLIENT_PAIRS = [
    {"clean": EIFFEL, "corrupt": COLOSSEUM, "answer": " Paris", "foil": " Rome"},
    {"clean": COLOSSEUM, "corrupt": EIFFEL, "answer": " Rome", "foil": " Paris"},
    {"clean": "The Louvre is in the city of", "corrupt": "The Vatican is in the city of", "answer": " Paris",
     "foil": " Rome"},
    {"clean": "The Vatican is in the city of", "corrupt": "The Louvre is in the city of", "answer": " Rome",
     "foil": " Paris"},
]


def test_four_clients_at_once_each_get_their_own_grid(served, server):
    """Four clients (each its own connection pool) send sweeps together; every grid equals
    the same sweep run alone, so nothing was lost or swapped between them."""
    backend = backend_for(served)
    clients = [ServedBackend(served, Server(server.url, KEY)) for _ in CLIENT_PAIRS]
    for client in clients:
        client.server.describe()
    kwargs = {"site": "mlp", "positions": [-2, -1]}
    alone = [pipatch.patch(backend, **pair, **kwargs) for pair in CLIENT_PAIRS]
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda i: [pipatch.patch(clients[i], **CLIENT_PAIRS[i], **kwargs)
                                            for _ in range(3)], range(4)))
    print(f"4 clients × 3 sweeps at once: {time.perf_counter() - started:.1f} s")
    for mine, reference in zip(together, alone):
        for result in mine:
            assert result.status == "done"
            assert torch.equal(result.raw["mlp"], reference.raw["mlp"])
    for client in clients:
        client.server.close()


def test_a_study_runs_facts_in_flight_each_its_single_trace(served, tmp_path):
    """A study on the served backend runs four facts at once (its hint), each from a thread of
    its own and committed as it ends: the facts overlap (their seconds add up to more than the
    study's), and each stored fact is its single served trace, bit for bit."""
    data = json.loads(pipatch.known_facts().read_text())
    facts = [data[i] for i in (3, 21, 25, 32)]  # facts the embedded model knows
    cheap = {"sites": "resid", "seeds": 1, "scale": 3.0}
    assert backend_for(served).capabilities.plans_in_flight == 4
    started = time.perf_counter()
    found = pipatch.study(served, facts, store=tmp_path / "served.sqlite", **cheap)
    wall = time.perf_counter() - started
    assert found.counts()["done"] == 4, found.summary()
    seconds = found.facts().seconds.tolist()
    print(f"4 facts in flight: {wall:.1f} s, their own {sum(seconds):.1f} s")
    assert sum(seconds) > 1.5 * wall, (seconds, wall)
    for i, fact in enumerate(facts):
        single = pipatch.trace(served, fact["prompt"], subject=fact["subject"], answer=" " + fact["attribute"], **cheap)
        assert torch.equal(found[i].raw["resid"], single.raw["resid"]), i
        assert torch.equal(found[i].corrupt_seeds, single.corrupt_seeds) and found[i].clean == single.clean


def test_server_memory_is_flat_under_load(served, server):
    """40 small sweeps (the last position, every layer: 20 requests each) from four clients at
    once; the server's memory after equals its memory before. (``bench/served.py`` runs 200
    and reports the figures: 200 take ~8 min on this 2-core machine.)"""
    kwargs = {**PAIR, "site": "resid", "positions": [-1]}
    clients = [ServedBackend(served, Server(server.url, KEY)) for _ in range(4)]
    for client in clients:
        client.server.describe()
        pipatch.patch(client, **kwargs)  # warm-up: each client's first requests
    before = server.rss_gb()
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: [pipatch.patch(clients[i], **kwargs).status for _ in range(10)], range(4)))
    after = server.rss_gb()
    print(f"40 sweeps in {time.perf_counter() - started:.0f} s; server {before:.2f} → {after:.2f} GB")
    assert all(status == "done" for statuses in results for status in statuses)
    assert after - before < 0.25, f"server memory grew {after - before:.2f} GB over 40 sweeps"
    for client in clients:
        client.server.close()


# --------------------------------------------------------------------------------------------
# The CLI, the loopback rule, shutting down
# --------------------------------------------------------------------------------------------


def test_the_cli_runs_a_sweep_on_the_server(served, server, tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PIPATCH_API_KEY": KEY}
    done = subprocess.run([sys.executable, "-m", "pipatch.cli", "patch", "--serve", server.url, "--clean", EIFFEL,
                           "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome", "--positions", "-1",
                           "--json", str(out), "--quiet"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    want = pipatch.patch(served, **PAIR, positions=[-1])
    assert data["model"] == "gemma-3-270m (embedded)"
    # Two clients of one server, their requests batched as they come: each metric and baseline
    # within the backends' ATOL + RTOL·|value|, the recovery within what those move it by.
    from tests._equal import RTOL
    from tests._tolerance import assert_recovery_close, recovery_tolerance

    assert_recovery_close(torch.tensor(data["grid"], dtype=torch.float32), want.grid.float(),
                          recovery_tolerance(want, ATOL, RTOL))


def test_other_hosts_need_an_api_key():
    done = subprocess.run([sys.executable, "-m", "pipatch.cli", "serve", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key" in lines[0], done.stderr


def test_a_notebook_cell_fills_a_live_grid_from_the_server(server, tmp_path):
    """``%%patch --serve URL`` in a real Jupyter kernel: the grid's rows arrive one by one (the
    widget's state messages), and the result is bound."""
    from tests.integration.test_vllm_kernel import Kernel

    kernel = Kernel(str(tmp_path))
    try:
        assert kernel.run("%load_ext pipatch")["error"] is None
        rows: list[int] = []

        def on_message(msg):
            state = (msg["content"].get("data") or {}).get("state") or {} if msg["msg_type"] == "comm_msg" else {}
            done = (state.get("rows_done") or {}).get("resid")
            if done is not None and (not rows or rows[-1] != done):
                rows.append(int(done))

        cell = (f'%%patch --serve {server.url} --api-key {KEY} --answer " Paris" --foil " Rome" --positions -1 '
                f"-o from_server\nclean: {EIFFEL}\ncorrupt: {COLOSSEUM}")
        out = kernel.collect(kernel.send(cell), 600, on_message)
        assert out["error"] is None, out
        assert rows[-1] == 18 and len(rows) >= 3, rows  # filled in as batches came back
        check = kernel.run("print(from_server.status, from_server.meta['backend'], from_server.meta['server'])")
        assert check["stdout"].split() == ["done", "served", server.url], check
    finally:
        kernel.close()


def test_a_toy_program_runs_on_the_server_as_the_hook_reference(served, server, model, toy_folder):
    """One way a program reaches a model: the toy program (``tests/_toy_program.py``, in a
    module of its own that the server's operator names with ``--programs``) goes to the server
    by name, its request encoded from its declared inputs (no code travels), one invoke per
    row; equal to the plain-hook reference on the transformers model within the backends'
    tolerance (``assert_close``: the residual stream's own values' rtol). A server that does
    not run a program says so in one line, before anything is sent."""
    import dataclasses

    from pipatch._model.sites import site as site_named
    from tests._toy_program import hook_norms, toy_program

    toy = toy_program(toy_folder)
    backend = backend_for(served)
    assert backend.server.info["programs"]["site_norms"] == 1
    rows = [model.tokenizer(text, return_tensors="pt").input_ids[0, :7] for text in (EIFFEL, COLOSSEUM)]
    ids = torch.stack(rows)
    for name in ("resid", "mlp"):
        got = backend.run(toy.SITE_NORMS, toy.NormsRequest(ids, site_named(name)))
        want = hook_norms(model, ids, name)
        for mine, theirs in zip(got, want):
            assert_close(mine, theirs)
    newer = dataclasses.replace(toy.SITE_NORMS, version=2)
    with pytest.raises(PipatchError) as error:
        backend.run(newer, toy.NormsRequest(ids, site_named("resid")))
    assert "\n" not in str(error.value) and "runs version 1 of the site_norms program" in str(error.value)
    assert "pipatch serve --programs" in str(error.value)


def test_sigterm_stops_the_server_and_every_process_it_started(server):
    assert len(server.tree) >= 3  # the web server, the engine core, its worker
    started = time.perf_counter()
    assert server.stop() == 0
    deadline = time.monotonic() + 60
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"stopped in {time.perf_counter() - started:.1f} s")
    assert server.alive() == [], f"left running: {server.alive()}"
    assert "pipatch serve: stopped" in "".join(server.lines)

