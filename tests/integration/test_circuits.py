"""Circuits (pipatch.circuit): EAP / EAP-IG edge scores against a hand-written reference that
takes one edge (and one backward) at a time with plain PyTorch hooks, and the exact edge checks
against a hook-reference edge patch, on tiny random-weight models of three families: GPT-2
(fused q/k/v, LayerNorm), Llama (grouped-query attention) and Gemma 3 (grouped-query
attention, norms after each sublayer, q/k norms)."""

from __future__ import annotations

import math

import pytest
import torch

import pipatch
from pipatch import PipatchError
from pipatch._backends import backend_for
from pipatch._experiments.patching import pair_inputs
from pipatch._model.graph import graph
from pipatch._model.models import adapter_for
from pipatch._programs import CircuitRunRequest, captures, circuit_runs
from tests._reference import (
    reference_circuit_path,
    reference_edge_patch,
    reference_edge_scores,
    reference_mean_ablated,
)
from tests._tiny import tiny_model


def runs(backend, clean_ids, corrupt_ids, metric, keep, mean_of=None):
    """The circuit runs program on ``backend``: the metric of each mask of ``keep``."""
    return circuit_runs(backend, CircuitRunRequest(clean_ids, corrupt_ids, metric, keep, mean_of))

FAMILIES = ["gpt2", "llama", "gemma3"]  # fused q/k/v; grouped-query attention; GQA with post norms
PAIR = dict(clean="When Mary and John went to the store, John gave a book to",
            corrupt="When Mary and John went to the store, Mary gave a book to", answer=" Mary", foil=" John")
PAIR2 = dict(clean="When Tom and Anna went to the park, Anna gave a ball to",
             corrupt="When Tom and Anna went to the park, Tom gave a ball to", answer=" Tom", foil=" Anna")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, tiny_model(request.param)


def _scores(result):
    return {(row.sender, row.receiver): row.score for row in result.edges().itertuples()}


def test_eap_scores_equal_the_one_edge_at_a_time_reference(family):
    name, model = family
    result = pipatch.circuit(model, **PAIR, method="eap", verify=0)
    ours = _scores(result)
    reference = reference_edge_scores(model, **PAIR)
    assert set(ours) == set(reference), "the graph's edges differ from the reference's"
    worst = max(abs(ours[e] - reference[e]) for e in reference)
    assert worst < 1e-4, f"{name}: max |EAP − reference| = {worst}"
    assert max(abs(v) for v in reference.values()) > 1e-3  # the scores are not all ~0


def test_eap_ig_equals_its_reference_and_steps_1_is_eap(family):
    name, model = family
    ig = _scores(pipatch.circuit(model, **PAIR, method="eap-ig", steps=2, verify=0))
    reference = reference_edge_scores(model, **PAIR, alphas=(0.0, 0.5))
    assert max(abs(ig[e] - reference[e]) for e in reference) < 1e-4
    one = _scores(pipatch.circuit(model, **PAIR, method="eap-ig", steps=1, verify=0))
    eap = _scores(pipatch.circuit(model, **PAIR, method="eap", verify=0))
    assert one == eap
    assert max(abs(ig[e] - eap[e]) for e in eap) > 1e-6  # two points are not the corrupt run alone


def test_checked_edges_equal_the_hook_reference_edge_patch(family):
    name, model = family
    result = pipatch.circuit(model, **PAIR, method="eap", verify=40)
    checked = result.meta["checked"]
    assert len(checked) == 40
    kinds = {c["receiver"].split(".")[-1] if "." in c["receiver"] else c["receiver"].rstrip("0123456789")
             for c in checked} | {c["sender"].rstrip("0123456789") for c in checked}
    corrupt = result.corrupt
    for c in checked:
        exact = reference_edge_patch(model, **PAIR, sender=c["sender"], receiver=c["receiver"])
        assert abs((c["exact"] + corrupt) - exact) < 1e-4, (name, c)
    table = result.edges()
    assert table["exact"].notna().sum() == 40
    assert {"logits", "mlp"} <= kinds and kinds & {"k", "v", "q"}, kinds  # several receiver kinds were checked
    assert -1 <= result.meta["agreement"]["spearman"] <= 1 and result.meta["agreement"]["n"] == 40


def test_the_graph():
    model = tiny_model("llama")
    a = adapter_for(model)
    edge_graph = graph(a)
    senders, receivers, edges = edge_graph.senders, edge_graph.receivers, edge_graph.valid
    assert [s.name for s in senders[:6]] == ["emb", "0.0", "0.1", "0.2", "0.3", "mlp0"]
    assert [r.name for r in receivers[:3]] == ["0.0.q", "0.0.k", "0.0.v"] and receivers[-1].name == "logits"
    assert len(senders) == 1 + a.n_layers * (a.n_heads + 1)
    assert len(receivers) == a.n_layers * (3 * a.n_heads + 1) + 1
    r = [x.name for x in receivers].index("mlp1")
    fed = {senders[s].name for s in range(len(senders)) if edges[r, s]}
    assert fed == {"emb", "0.0", "0.1", "0.2", "0.3", "mlp0", "1.0", "1.1", "1.2", "1.3"}
    q = [x.name for x in receivers].index("1.2.q")
    assert {senders[s].name for s in range(len(senders)) if edges[q, s]} == {"emb", "0.0", "0.1", "0.2", "0.3", "mlp0"}
    assert edges[-1].all()  # everything writes to the logits
    # Parallel attention and MLP (GPT-NeoX): a layer's heads do not feed its own MLP.
    parallel = graph(adapter_for(tiny_model("gpt_neox")))
    receivers_p, edges_p = parallel.receivers, parallel.valid
    r = [x.name for x in receivers_p].index("mlp1")
    assert not edges_p[r, [s.name for s in senders].index("1.0")]


def test_a_dataset_averages_its_pairs():
    model = tiny_model("llama")
    both = pipatch.circuit(model, clean=[PAIR["clean"], PAIR2["clean"]], corrupt=[PAIR["corrupt"], PAIR2["corrupt"]],
                           answer=[PAIR["answer"], PAIR2["answer"]], foil=[PAIR["foil"], PAIR2["foil"]],
                           method="eap", verify=3)
    one, two = (_scores(pipatch.circuit(model, **p, method="eap", verify=3)) for p in (PAIR, PAIR2))
    mean = _scores(both)
    assert max(abs(mean[e] - (one[e] + two[e]) / 2) for e in mean) < 1e-6
    assert both.meta["n_pairs"] == 2 and both.clean == pytest.approx(
        (pipatch.circuit(model, **PAIR, verify=0).clean + pipatch.circuit(model, **PAIR2, verify=0).clean) / 2)
    for c in both.meta["checked"]:
        exact = [reference_edge_patch(model, **p, sender=c["sender"], receiver=c["receiver"]) for p in (PAIR, PAIR2)]
        corrupts = both.meta["corrupt_runs"]
        assert c["exact"] == pytest.approx(sum(e - k for e, k in zip(exact, corrupts)) / 2, abs=1e-4)


def test_a_task_set_splats_into_circuit():
    model = tiny_model("gpt2")
    task = pipatch.tasks.ioi(4, seed=1, tokenizer=model.tokenizer)
    result = pipatch.circuit(model, **task, steps=2, verify=5)
    assert result.meta["n_pairs"] == 4 and result.kind == "circuit"
    table = result.edges()
    assert list(table.columns) == ["sender", "receiver", "score", "exact"]
    assert table["score"].abs().is_monotonic_decreasing and table["exact"].notna().sum() == 5
    assert result.grid.shape == (len(result.layers), len(result.columns))
    assert "Circuit" in result.title


def test_a_saved_circuit_reads_back(tmp_path):
    result = pipatch.circuit(tiny_model("gpt2"), **PAIR, verify=4)
    back = pipatch.load_result(result.save(tmp_path / "c.safetensors"))
    assert back.edges().equals(result.edges())


@pytest.mark.parametrize("bad, message", [
    (dict(method="acdc"), "method"),
    (dict(steps=0), "steps"),
    (dict(verify=-1), "verify"),
    (dict(corrupt="When Mary went to the store, Mary gave a book to"), "same length"),
])
def test_bad_input_is_one_line(bad, message):
    with pytest.raises(PipatchError) as error:
        pipatch.circuit(tiny_model("gpt2"), **{**PAIR, **bad})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_families_it_cannot_score_are_refused_in_one_line():
    with pytest.raises(PipatchError) as error:
        pipatch.circuit(tiny_model("falcon"), **PAIR)
    assert "circuits are not supported for falcon" in str(error.value) and "\n" not in str(error.value)


def test_edges_is_a_circuits_table():
    result = pipatch.patch(tiny_model("gpt2"), **PAIR, site="resid")
    with pytest.raises(PipatchError, match="circuit"):
        result.edges()
    assert not math.isnan(float(result.grid.nanmean()))


def test_a_circuits_run_keeps_exactly_its_edges(family):
    """The faithfulness curve's runs: no edge is the corrupt run, every edge the clean run (where
    a layer's write is its heads' sum: not Gemma's post-attention norm), and a two-edge path
    emb → head's key → logits equals the hook reference of that path (a grouped-query key read
    by its query head alone)."""
    name, model = family
    backend = backend_for(model)
    edge_graph = graph(backend.adapter)
    senders, receivers, valid = edge_graph.senders, edge_graph.receivers, edge_graph.valid
    pair = pair_inputs(backend, PAIR["clean"], PAIR["corrupt"], PAIR["answer"], PAIR["foil"], "logit_diff")
    clean, corrupt = (float(c.metric[0]) for c in captures(backend, [pair.clean_ids, pair.corrupt_ids], pair.metric))
    r_names, s_names = [r.name for r in receivers], [s.name for s in senders]
    candidates = [(layer, head, which) for layer in (1, 2) for head in range(backend.adapter.n_heads) for which in "kv"]
    paths = []
    for layer, head, which in candidates:
        path = torch.zeros_like(valid)
        path[r_names.index(f"{layer}.{head}.{which}"), s_names.index("emb")] = True
        path[r_names.index("logits"), s_names.index(f"{layer}.{head}")] = True
        paths.append(path)
    none, every, *two = runs(backend, pair.clean_ids, pair.corrupt_ids, pair.metric,
                             torch.stack([torch.zeros_like(valid), valid, *paths])).tolist()
    assert none == pytest.approx(corrupt, abs=1e-5)
    if backend.adapter.attn_post_norm is None:
        assert every == pytest.approx(clean, abs=1e-4)
    # The two paths (a key, a value) that move the metric most, against the reference.
    for which in "kv":
        got, (layer, head, _) = max(((g, c) for g, c in zip(two, candidates) if c[2] == which),
                                    key=lambda item: abs(item[0] - corrupt))
        want = reference_circuit_path(model, **PAIR, layer=layer, head=head, which=which)
        assert got == pytest.approx(want, abs=1e-5) and abs(got - corrupt) > 1e-5, (which, got, want, corrupt)


def test_mean_ablation_reads_the_datasets_mean(family):
    """``mean_of``: an edge outside the circuit carries its sender's mean over the prompts. With
    one prompt it is that prompt's ablation; with four, no edge and the edge emb → logits equal
    the hook reference of the mean; every edge is still the clean run."""
    name, model = family
    backend = backend_for(model)
    valid = graph(backend.adapter).valid
    pair = pair_inputs(backend, PAIR["clean"], PAIR["corrupt"], PAIR["answer"], PAIR["foil"], "logit_diff")
    texts = [PAIR["clean"], PAIR["corrupt"], PAIR2["clean"], PAIR2["corrupt"]]
    prompts = [backend.tokenizer(t, return_tensors="pt").input_ids for t in texts]
    assert len({p.shape[1] for p in prompts}) == 1
    emb_edge = torch.zeros_like(valid)
    emb_edge[-1, 0] = True  # receivers end with the logits, senders start with the embeddings
    masks = torch.stack([torch.zeros_like(valid), emb_edge, valid])
    as_corrupt = runs(backend, pair.clean_ids, pair.corrupt_ids, pair.metric, masks)
    one = runs(backend, pair.clean_ids, pair.corrupt_ids, pair.metric, masks, [pair.corrupt_ids])
    torch.testing.assert_close(one, as_corrupt, atol=1e-5, rtol=0)
    # A clean prompt whose last token none of the four has: the edge emb → logits carries something.
    other = PAIR["clean"].replace(" to", " on")
    other_ids = backend.tokenizer(other, return_tensors="pt").input_ids
    none, emb, every = runs(backend, other_ids, pair.corrupt_ids, pair.metric, masks, prompts).tolist()
    for value, edge in ((none, False), (emb, True)):
        want = reference_mean_ablated(model, prompts=texts, clean=other, answer=PAIR["answer"],
                                      foil=PAIR["foil"], emb_edge=edge)
        assert value == pytest.approx(want, abs=1e-4), (edge, value, want)
    assert abs(none - float(as_corrupt[0])) > 1e-3 and abs(emb - none) > 1e-3  # the mean is not the corrupt run
    if backend.adapter.attn_post_norm is None:
        clean = float(captures(backend, [other_ids], pair.metric)[0].metric[0])
        assert every == pytest.approx(clean, abs=1e-4)


def test_a_mean_ablated_curve_starts_at_the_means_recovery():
    model = tiny_model("llama")
    dataset = {key: [PAIR[key], PAIR2[key]] for key in PAIR}
    result = pipatch.circuit(model, **dataset, verify=0, curve=4, ablation="mean")
    f = result.meta["faithfulness"]
    assert f["ablation"] == "mean" == result.meta["ablation"]
    texts = [PAIR["clean"], PAIR["corrupt"], PAIR2["clean"], PAIR2["corrupt"]]
    nothing = [reference_mean_ablated(model, prompts=texts, clean=p["clean"], answer=p["answer"], foil=p["foil"],
                                      emb_edge=False) for p in (PAIR, PAIR2)]
    clean, corrupt = sum(result.meta["clean_runs"]) / 2, sum(result.meta["corrupt_runs"]) / 2
    # Derived (tests/_tolerance.py): the baselines are the result's own; the runs' metrics are
    # the hook reference's within 1e-4 (test_mean_ablation_reads_the_datasets_mean: no edge,
    # and every edge the clean run), so recovery within 1e-4 / |clean − corrupt|; the corrupt
    # ablation's no-edge run is the corrupt run within 1e-5 (test_a_circuits_run_keeps_exactly_its_edges).
    from tests._tolerance import normalized_tolerance

    assert f["recovery"][0] == pytest.approx((sum(nothing) / 2 - corrupt) / (clean - corrupt),
                                             abs=normalized_tolerance(sum(nothing) / 2, corrupt, clean, 1e-4, True))
    assert f["recovery"][-1] == pytest.approx(1.0, abs=normalized_tolerance(clean, corrupt, clean, 1e-4, True))
    corrupted = pipatch.circuit(model, **dataset, verify=0, curve=4)
    assert corrupted.meta["faithfulness"]["ablation"] == "corrupt"
    assert corrupted.meta["faithfulness"]["recovery"][0] == pytest.approx(
        0.0, abs=normalized_tolerance(corrupt, corrupt, clean, 1e-5, True))
    with pytest.raises(PipatchError) as error:
        pipatch.circuit(model, clean=[PAIR["clean"], "When Mary went out, Mary gave a book to"],
                        corrupt=[PAIR["corrupt"], "When Mary went out, John gave a book to"],
                        answer=" Mary", foil=" John", verify=0, curve=4, ablation="mean")
    assert "one length" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(PipatchError, match="ablation"):
        pipatch.circuit(model, **PAIR, ablation="zero")


def test_a_click_on_an_edge_runs_its_exact_patch_over_every_pair():
    """What the view's click asks the kernel (answer_selection): the edge's exact change, the
    mean over the pairs, equal to the same edge's check; an unchecked edge is measured too."""
    from pipatch._experiments._api import plan
    from pipatch._notebook.live import answer_selection

    dataset = {key: [PAIR[key], PAIR2[key]] for key in PAIR}
    circuit = plan("circuit", tiny_model("llama"), **dataset, verify=3, curve=0)
    result = circuit.run()
    predictor = circuit.predictor()
    rows, cols = result.meta["receivers"], result.meta["senders"]
    for check in result.meta["checked"]:
        where = {"view": "edges", "seed": -1, "row": rows.index(check["receiver"]), "col": cols.index(check["sender"])}
        detail = answer_selection(predictor, result, where)
        assert "error" not in detail and len(detail["top"]) == 5
        assert detail["exact_pairs"] == 2 and detail["exact"] == pytest.approx(check["exact"], abs=1e-6)
    table = result.edges()
    unchecked = table[table["exact"].isna()].iloc[0]
    where = {"view": "edges", "seed": -1, "row": rows.index(unchecked.receiver), "col": cols.index(unchecked.sender)}
    detail = answer_selection(predictor, result, where)
    assert math.isfinite(detail["exact"]) and "error" not in detail
    where = {"view": "edges", "seed": -1, "row": rows.index("0.0.q"), "col": cols.index("mlp1")}
    assert "no edge from mlp1" in answer_selection(predictor, result, where)["error"]


def test_the_faithfulness_curve():
    result = pipatch.circuit(tiny_model("llama"), **PAIR, verify=0, curve=8, share=0.8)
    f = result.meta["faithfulness"]
    assert f["sizes"][0] == 0 and f["sizes"][-1] == f["edges"] == len(result.edges())
    # Derived (tests/_tolerance.py): no edge is the corrupt run within 1e-5, every edge the
    # clean run within 1e-4 (test_a_circuits_run_keeps_exactly_its_edges), the baselines the
    # result's own: recovery 0 and 1 within those over |clean − corrupt|.
    from tests._tolerance import normalized_tolerance

    clean, corrupt = result.clean, result.corrupt
    assert f["recovery"][0] == pytest.approx(0.0, abs=normalized_tolerance(corrupt, corrupt, clean, 1e-5, True))
    assert f["recovery"][-1] == pytest.approx(1.0, abs=normalized_tolerance(clean, corrupt, clean, 1e-4, True))
    assert f["size"] is not None and dict(zip(f["sizes"], f["recovery"]))[f["size"]] >= 0.8
    assert all(b > a for a, b in zip(f["sizes"], f["sizes"][1:]))
    assert "faithfulness" not in pipatch.circuit(tiny_model("llama"), **PAIR, verify=0, curve=0).meta
    with pytest.raises(PipatchError, match="share"):
        pipatch.circuit(tiny_model("llama"), **PAIR, share=1.5)


@pytest.mark.parametrize("name", ["gpt_neox", "falcon_new", "qwen3"])
def test_other_families_score_against_the_reference(name):
    """Families beyond the three above: parallel attention and MLP (GPT-NeoX; Falcon's new
    decoder, which runs the MLP's norm before the attention) and q/k norms (Qwen3)."""
    model = tiny_model(name)
    ours = _scores(pipatch.circuit(model, **PAIR, method="eap", verify=0, curve=0))
    reference = reference_edge_scores(model, **PAIR)
    assert set(ours) == set(reference) and max(abs(ours[e] - reference[e]) for e in reference) < 1e-4


def test_the_curve_fills_row_by_row_and_stop_keeps_what_it_has():
    import threading

    from pipatch._experiments._api import plan

    seen, stop = [], threading.Event()

    def on_row(result, view, row):
        curve = result.meta.get("faithfulness")
        if curve is not None:
            seen.append(len(curve["sizes"]))
            stop.set()  # after the first forward of the curve

    model = tiny_model("llama")
    result = plan("circuit", model, **PAIR, verify=2, curve=12).run(on_row=on_row, stop=stop)
    assert result.status == "stopped" and "faithfulness" in result.message
    assert seen == [4] and result.meta["faithfulness"]["size"] is None
    assert result.meta["agreement"]["n"] == 2  # the exact checks before it are kept
    whole = pipatch.circuit(model, **PAIR, verify=2, curve=12)
    assert whole.meta["faithfulness"]["recovery"][:4] == result.meta["faithfulness"]["recovery"]


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_the_ungrouped_attention_is_the_models_own_when_a_group_reads_one_input(name):
    """A circuit run's attention has one key/value head per query head; fed the group's own
    keys and values for every query head of the group, it is the model's grouped attention:
    every head's output at every layer (Llama: rotary; Gemma 3: q/k norms, sliding window)."""
    from pipatch._backends._hf_views import CircuitTraceView
    from tests._equal import attention_both_ways

    model = tiny_model(name)
    backend = backend_for(model)
    adapter = backend.adapter
    assert adapter.n_kv_heads < adapter.n_heads  # grouped
    ids = backend.tokenizer(PAIR["clean"], return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(ids, use_cache=False):
        saved = attention_both_ways(CircuitTraceView(adapter, model, backend.dtype, 1), model, adapter).save()
    assert len(saved) == adapter.n_layers
    for ungrouped, grouped in saved:
        torch.testing.assert_close(ungrouped, grouped, atol=1e-6, rtol=0)
        assert grouped.abs().max() > 1e-3


def test_the_curve_halves_its_masks_on_out_of_memory_and_names_a_failing_point():
    """The curve runs as the engine's work: a point's masks that run out of memory are run in
    halves, to the same numbers; a point that fails is named, the curve before it kept."""
    from pipatch._engine import EngineError
    from pipatch._experiments._api import plan

    model = tiny_model("llama")
    whole = pipatch.circuit(model, **PAIR, verify=0, curve=8)
    mlp = model._module.model.layers[0].mlp
    raised = []

    def small_memory(module, args, output):
        if args[0].shape[0] > 1:  # the MLP called on more than one mask's rows
            raised.append(args[0].shape[0])
            raise torch.OutOfMemoryError("out of memory (injected): tried to allocate 1 GiB")

    circuit = plan("circuit", model, **PAIR, verify=0, curve=8)  # its captures run one prompt a row
    handle = mlp.register_forward_hook(small_memory)
    try:
        halved = circuit.run()
    finally:
        handle.remove()
    assert halved.status == "done" and raised[:2] == [4, 2]
    mine, theirs = halved.meta["faithfulness"], whole.meta["faithfulness"]
    # float32 rows, batched otherwise: each point's metric within the runs' 1e-5 (a run's
    # metric against its rerun, test_mean_ablation_reads_the_datasets_mean), the baselines the
    # same runs: each recovery within 1e-5 / |clean − corrupt| (tests/_tolerance.py). The sizes
    # are choices made on those values (the bisection towards the share): alike where no point
    # is within its bound of the share (asserted).
    from tests._tolerance import normalized_tolerance

    within = [normalized_tolerance(r * (whole.clean - whole.corrupt) + whole.corrupt, whole.corrupt, whole.clean,
                                   1e-5, True) for r in theirs["recovery"]]
    assert all(abs(r - theirs["share"]) > t for r, t in zip(theirs["recovery"], within))
    assert mine["sizes"] == theirs["sizes"] and mine["size"] == theirs["size"]
    assert all(abs(a - b) <= t for a, b, t in zip(mine["recovery"], theirs["recovery"], within, strict=True))

    def fault(module, args, output):
        if args[0].shape[0] > 1:
            raised.append(args[0].shape[0])
            if len(raised) == 2:  # the curve's second row
                raise RuntimeError("injected fault")

    raised.clear()
    circuit = plan("circuit", model, **PAIR, verify=0, curve=8)
    handle = mlp.register_forward_hook(fault)
    try:
        with pytest.raises(EngineError, match=r"the faithfulness curve's circuits of [\d, ]+ edges failed: "
                                              r"RuntimeError: injected fault") as info:
            circuit.run()
    finally:
        handle.remove()
    partial = info.value.partial
    assert partial.status == "failed" and partial.meta["faithfulness"]["size"] is None
    # The first row's sizes (the grid's smallest four; the bisection's points of curve=8 lie among them).
    first_row = circuit._curve.sizes[0]
    assert partial.meta["faithfulness"]["sizes"] == first_row and set(first_row) <= set(theirs["sizes"])
