"""A feature circuit's exact edge checks and its faithfulness / completeness curve (issue #47),
on tiny random models of three families with a random SAE (or transcoder) at every layer,
each value against a hand-written reference of plain torch forward hooks
(:mod:`tests.integration.test_feature_circuit`'s: each layer's output rebuilt as
``decode(f) + skip + e`` from its latents ``f`` and error ``e``):

* an edge's ``exact``: the corrupt run with the upstream node at its clean value, the
  downstream node's value there read off; then the corrupt run with only the downstream node
  set to that value; the metric's change from the corrupt run (one edge at a time);
* the curve's points: the clean run with, at every layer and position, the latents and
  errors outside the circuit (or, for completeness, inside it) set to their ablation value,
  the rest computed freely; ``m(∅)`` with every latent and error set; so faithfulness is 1
  when the circuit holds every node, 0 with none;
* a dataset of pairs: each checked node's ``exact``, the mean over the pairs of the patch of
  that node at every token of its named position over their count; each curve point, the
  mean over the pairs of the hand-ablated runs above, a pair's circuit every node of it that
  falls in a kept averaged node;
* one prompt: the same with zeros for the corrupt values (an edge's upstream node zeroed in
  the prompt's run, ``exact = M(prompt) − M(patched)``; the curve zero-ablates);
* bad options are one line.
"""

from __future__ import annotations

import math

import pytest
import torch

import pipatch
from pipatch._experiments.dataset import named_groups
from tests.integration.test_feature_circuit import (
    ANSWER,
    FOIL,
    N_LAYERS,
    build,
    hand_values,
    ids_of,
    logit_diff,
    rebuild,
    run_with,
    target_logit,
)
from tests.integration.test_features import CLEAN, CORRUPT, FAMILIES, hand_encode


def split(weights, kind, layer, x_in, out):
    """Layer ``layer``'s latents and error on the live run: ``(f, e)``."""
    f = hand_encode(weights[layer], kind, x_in)
    return f, out - rebuild(weights[layer], x_in, f, 0)


def metric(model, ids, edits, score=logit_diff):
    with torch.no_grad():
        return float(score(model, run_with(model, ids, edits))[0])


def hand_edge(model, weights, kind, corrupt_ids, clean, up, down, score=logit_diff):
    """The exact edge patch of ``up`` → ``down`` (node dicts; ``up`` may be an embedding
    node): the patched metric, by two hooked runs on ``corrupt_ids``, the upstream node set to
    its value in ``clean`` (one prompt: zeros)."""
    seen = {}

    def set_up(x_in, out):
        f, e = split(weights, kind, up["layer"], x_in, out)
        f, e = f.clone(), e.clone()
        if up["latent"] == "error":
            e[0, up["position"]] = clean[up["layer"]][1][0, up["position"]]
        else:
            f[0, up["position"], int(up["latent"])] = clean[up["layer"]][0][0, up["position"], int(up["latent"])]
        return rebuild(weights[up["layer"]], x_in, f, e)

    def read_down(x_in, out):
        f, e = split(weights, kind, down["layer"], x_in, out)
        q = down["position"]
        seen["value"] = e[0, q].clone() if down["latent"] == "error" else f[0, q, int(down["latent"])].clone()
        return out

    def set_down(x_in, out):
        f, e = split(weights, kind, down["layer"], x_in, out)
        f, e = f.clone(), e.clone()
        if down["latent"] == "error":
            e[0, down["position"]] = seen["value"]
        else:
            f[0, down["position"], int(down["latent"])] = seen["value"]
        return rebuild(weights[down["layer"]], x_in, f, e)

    def set_embedding(_, out):
        out = out.clone()
        out[0, up["position"]] = clean["embed"][0][0, up["position"]]
        return out

    first = {"embed": set_embedding} if up["latent"] == "embed" else {up["layer"]: set_up}
    metric(model, corrupt_ids, {**first, down["layer"]: read_down}, score)
    return metric(model, corrupt_ids, {down["layer"]: set_down}, score)


def hand_ablated(model, weights, kind, clean_ids, ablated, circuit, complement, score=logit_diff):
    """The clean run's metric with, at every layer, each latent and error outside ``circuit``
    (``complement``: inside it) set to ``ablated[layer]``'s ``(f, e)``; ``circuit`` a set of
    ``(layer, position, latent or "error")``."""
    def edit(layer):
        def put(x_in, out):
            f, e = split(weights, kind, layer, x_in, out)
            T, d_sae = f.shape[1], f.shape[2]
            keep_f = torch.zeros(T, d_sae, dtype=torch.bool)
            keep_e = torch.zeros(T, dtype=torch.bool)
            for where, p, latent in circuit:
                if where == layer and latent == "error":
                    keep_e[p] = True
                elif where == layer:
                    keep_f[p, latent] = True
            if complement:
                keep_f, keep_e = ~keep_f, ~keep_e
            f = torch.where(keep_f, f[0], ablated[layer][0][0])[None]
            e = torch.where(keep_e[:, None], e[0], ablated[layer][1][0])[None]
            return rebuild(weights[layer], x_in, f, e)
        return put
    return metric(model, clean_ids, {layer: edit(layer) for layer in range(N_LAYERS)}, score)


def check_edges_and_curve(model, weights, kind, result, ablation="corrupt", prompt=False):
    """``prompt``: one prompt (``CLEAN``, the target's logit): an edge's upstream node is zeroed
    in the prompt's run and its exact is ``M(prompt) − M(patched)``; the curve zero-ablates."""
    clean_ids, corrupt_ids = ids_of(model, CLEAN), ids_of(model, CORRUPT)
    clean = hand_values(model, weights, kind, clean_ids)
    corrupt = hand_values(model, weights, kind, corrupt_ids)
    score, sign = (target_logit, -1.0) if prompt else (logit_diff, 1.0)
    if prompt:  # the edges' base is the prompt's run, the upstream node's value zero
        corrupt_ids = clean_ids
        clean = {k: (torch.zeros_like(f), None if e is None else torch.zeros_like(e)) for k, (f, e) in clean.items()}
    every = [n for n in result.meta["nodes"] if n["latent"] != "metric"]
    by_name = {n["node"]: n for n in every}
    nodes = [n for n in every if n["latent"] != "embed"]  # the curve's: the embeddings stay free
    # Every checked edge: two hooked runs.
    edges = result.meta["edges"]
    checked = [e for e in edges if e["exact"] is not None]
    assert len(checked) == min(result.meta["verify_edges"], len(edges)) > 0
    assert checked == edges[:len(checked)]  # the largest |score| first
    base = metric(model, corrupt_ids, {}, score)
    for edge in checked:
        want = sign * (hand_edge(model, weights, kind, corrupt_ids, clean, by_name[edge["upstream"]],
                                 by_name[edge["downstream"]], score) - base)
        assert abs(edge["exact"] - want) < 1e-5, (edge, want)
    assert max(abs(e["exact"]) for e in checked) > 1e-4  # the patches move the metric
    table = result.edges()
    assert table["exact"].notna().sum() == len(checked)
    # Every point of the curve, and its ends.
    if ablation == "zero":
        ablated = {layer: (torch.zeros_like(corrupt[layer][0]), torch.zeros_like(corrupt[layer][1]))
                   for layer in range(N_LAYERS)}
    else:  # one pair: the mean over its corrupt prompt is the corrupt run's value
        ablated = corrupt
    curve = result.meta["curve"]
    assert curve["ablation"] == ablation
    full = metric(model, clean_ids, {}, score)
    empty = hand_ablated(model, weights, kind, clean_ids, ablated, set(), complement=False, score=score)
    assert abs(curve["full"] - full) < 1e-5 and abs(curve["empty"] - empty) < 1e-5
    rows = result.faithfulness()
    assert list(rows.columns) == ["n_nodes", "faithfulness", "completeness", "with", "without"]
    assert list(rows["n_nodes"]) == sorted(set(rows["n_nodes"])) and rows["n_nodes"].iloc[-1] == len(nodes)
    assert int(sum(n["circuit"] for n in nodes)) in set(rows["n_nodes"])
    # The ratios' tolerance is derived from their parts' (tests/_tolerance.py): m(C), m(M∖C),
    # m(M) and m(∅) each within ε = 1e-5 of the hand values (asserted), so each difference
    # within 2ε and (kept − empty) / (full − empty) within 2ε (1 + |ratio|) / (|full − empty| − 2ε),
    # per row from the hand values (a transcoder's faithfulness of 9.9 over a span of 0.012:
    # 1.9e-2; a bare 1e-4 failed on 1.2e-4 here, from parts 1e-6 apart).
    from tests._tolerance import normalized_tolerance

    eps = 1e-5
    for _, row in rows.iterrows():
        circuit = {(n["layer"], n["position"], n["latent"]) for n in nodes[:int(row["n_nodes"])]}
        kept = hand_ablated(model, weights, kind, clean_ids, ablated, circuit, complement=False, score=score)
        dropped = hand_ablated(model, weights, kind, clean_ids, ablated, circuit, complement=True, score=score)
        assert abs(row["with"] - kept) < eps and abs(row["without"] - dropped) < eps, (row, kept, dropped)
        assert row["faithfulness"] == pytest.approx((kept - empty) / (full - empty),
                                                    abs=normalized_tolerance(kept, empty, full, eps))
        assert row["completeness"] == pytest.approx((dropped - empty) / (full - empty),
                                                    abs=normalized_tolerance(dropped, empty, full, eps))
    # The whole graph kept is the clean run: nothing is ablated but latents off on both prompts.
    # By hand m(C = every node) equals m(M) within ε; pipatch's m(C) and m(M) are each within ε
    # of those, so m(C) − m(M) within 3ε and the faithfulness 1 within 3ε / (|m(M) − m(∅)| − 2ε).
    assert abs(kept - full) < eps
    assert rows["faithfulness"].iloc[-1] == pytest.approx(1.0, abs=3 * eps / (abs(full - empty) - 2 * eps))
    reached = [n for n, f in zip(rows["n_nodes"], rows["faithfulness"]) if f >= 0.8]
    assert curve["nodes_for_80"] == min(reached)
    agreement = result.meta["edge_agreement"]
    assert agreement["n"] == len(checked) and (len(checked) < 3 or -1 <= agreement["spearman"] <= 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_edges_and_the_curve_equal_the_hand_references(family, tmp_path):
    model, weights, sites = build(tmp_path, family)
    result = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                     verify=0, top_nodes=10, top_edges=12, verify_edges=6, curve=4, batch_size=4,
                                     progress=False)
    check_edges_and_curve(model, weights, "jumprelu", result)


def test_transcoders_and_zero_ablation_equal_the_hand_references(tmp_path):
    """A transcoder's latents and error replace the MLP (its skip stays live) in both checks."""
    model, weights, sites = build(tmp_path, "gemma3", kind="transcoder")
    result = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                     verify=0, top_nodes=8, top_edges=6, verify_edges=6, curve=4, ablation="zero",
                                     progress=False)
    check_edges_and_curve(model, weights, "transcoder", result, ablation="zero")


@pytest.mark.parametrize("family", FAMILIES)
def test_one_prompts_exact_edges_and_curve_zero_ablate_as_the_hand_references(family, tmp_path):
    """One prompt (attribution-graph form): an edge's upstream node zeroed, its change passed
    through the downstream node alone; the curve zero-ablates (its only counterfactual), the
    ``ablation`` asked for notwithstanding."""
    model, weights, sites = build(tmp_path, family)
    result = pipatch.feature_circuit(model, saes=sites, prompt=CLEAN, target=ANSWER, verify=0, top_nodes=10,
                                     top_edges=12, verify_edges=6, curve=4, batch_size=4, progress=False)
    check_edges_and_curve(model, weights, "jumprelu", result, ablation="zero", prompt=True)


def hand_group_patch(model, weights, kind, corrupt_ids, clean, node, positions):
    """The corrupt run's metric with ``node``'s latent (error, embedding) at every one of
    ``positions`` set to its clean value."""
    if node["latent"] == "embed":
        def set_embedding(_, out):
            out = out.clone()
            out[0, positions] = clean["embed"][0][0, positions]
            return out
        return metric(model, corrupt_ids, {"embed": set_embedding})

    def edit(x_in, out):
        f, e = split(weights, kind, node["layer"], x_in, out)
        f, e = f.clone(), e.clone()
        if node["latent"] == "error":
            e[0, positions] = clean[node["layer"]][1][0, positions]
        else:
            f[0, positions, int(node["latent"])] = clean[node["layer"]][0][0, positions, int(node["latent"])]
        return rebuild(weights[node["layer"]], x_in, f, e)
    return metric(model, corrupt_ids, {node["layer"]: edit})


def test_a_datasets_node_checks_and_curve_equal_the_hand_references(tmp_path):
    model, weights, sites = build(tmp_path, "gpt2")
    pairs = [(CLEAN, CORRUPT), ("The Louvre is in the city of", "The Colosseum is in the city of"),
             ("The Kremlin is in the city of the", "The Colosseum is in the city of the")]
    kwargs = dict(saes=sites, answer=ANSWER, foil=FOIL, progress=False)
    data = pipatch.feature_circuit(model, clean=[c for c, _ in pairs], corrupt=[x for _, x in pairs], verify=8,
                                   top_nodes=10, top_edges=5, verify_edges=0, curve=4, **kwargs)
    names = data.columns
    nodes = data.meta["nodes"]
    checked = [n for n in nodes[1:] if n["exact"] is not None]
    assert checked == nodes[1:9] and not data.warnings  # the largest |score| first; no edge checks asked
    graph = [n for n in nodes[1:] if n["latent"] != "embed"]
    rows = data.faithfulness()
    sums = {"empty": [], **{(int(n), side): [] for n in rows["n_nodes"] for side in ("with", "without")}}
    exact: dict[str, list[float]] = {n["node"]: [] for n in checked}
    for c, x in pairs:
        clean_ids, corrupt_ids = ids_of(model, c), ids_of(model, x)
        clean = hand_values(model, weights, "jumprelu", clean_ids)
        tokens = model.tokenizer.convert_ids_to_tokens(clean_ids[0])
        changed = [k for k, (a, b) in enumerate(zip(clean_ids[0], corrupt_ids[0])) if a != b]
        groups = named_groups(changed, len(tokens), "changed")[1]
        base = metric(model, corrupt_ids, {})
        for n in checked:
            group = groups[names.index(n["position"])]
            if group:
                patched = hand_group_patch(model, weights, "jumprelu", corrupt_ids, clean, n, group)
                exact[n["node"]].append((patched - base) / len(group))
        # The curve: this pair's own nodes, each kept where an averaged node it falls in is.
        own = pipatch.feature_circuit(model, clean=c, corrupt=x, verify=0, verify_edges=0, curve=0, **kwargs)
        rank = {(n["site"], n["position"], n["latent"]): i for i, n in enumerate(graph)}
        ranked = [(n, min(rank[(n["site"], names[g], n["latent"])] for g, group in enumerate(groups)
                          if n["position"] in group))
                  for n in own.meta["nodes"] if n["latent"] not in ("metric", "embed")]
        corrupt = hand_values(model, weights, "jumprelu", corrupt_ids)
        sums["empty"].append(hand_ablated(model, weights, "jumprelu", clean_ids, corrupt, set(), complement=False))
        for size in rows["n_nodes"]:
            circuit = {(n["layer"], n["position"], n["latent"]) for n, r in ranked if r < size}
            for side, complement in (("with", False), ("without", True)):
                sums[(int(size), side)].append(hand_ablated(model, weights, "jumprelu", clean_ids, corrupt, circuit,
                                                            complement))
    for n in checked:
        assert len(exact[n["node"]]) == n["pairs"]
        assert abs(n["exact"] - sum(exact[n["node"]]) / n["pairs"]) < 1e-5, n
    curve = data.meta["curve"]
    assert abs(curve["full"] - sum(data.meta["per_prompt_clean"]) / 3) < 1e-6
    assert abs(curve["empty"] - sum(sums["empty"]) / 3) < 1e-5
    for _, row in rows.iterrows():
        size = int(row["n_nodes"])
        assert abs(row["with"] - sum(sums[(size, "with")]) / 3) < 1e-5
        assert abs(row["without"] - sum(sums[(size, "without")]) / 3) < 1e-5
    # The whole graph kept is the clean run: by hand m(C = every node) is pipatch's clean within
    # ε = 1e-5; pipatch's m(C) is the hand's within ε and its m(M) the clean's within 1e-6, so
    # m(C) − m(M) within 2ε + 1e-6 and the faithfulness 1 within that over |m(M) − m(∅)|, the
    # span pipatch divides by (tests/_tolerance.py).
    from tests._tolerance import ratio_tolerance

    last = int(rows["n_nodes"].iloc[-1])
    assert abs(sum(sums[(last, "with")]) / 3 - sum(data.meta["per_prompt_clean"]) / 3) < 1e-5
    within = ratio_tolerance(0.0, curve["full"] - curve["empty"], 2e-5 + 1e-6, 0.0)
    assert last == len(graph) and rows["faithfulness"].iloc[-1] == pytest.approx(1, abs=within)
    assert data.meta["agreement"]["n"] == 8 and curve["nodes_for_80"] is not None


def test_no_checks_asked_and_the_file(tmp_path):
    model, weights, sites = build(tmp_path, "llama")
    result = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                     verify=0, top_nodes=6, top_edges=4, verify_edges=0, curve=0, progress=False)
    assert result.edges()["exact"].isna().all() and "edge_agreement" not in result.meta
    assert result.faithfulness().empty and result.meta["curve"]["points"] == []
    mean = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                   verify=0, top_nodes=6, top_edges=4, verify_edges=2, curve=3, ablation="mean",
                                   progress=False)
    for name in ("r.safetensors", "r.json"):
        back = pipatch.load_result(mean.save(tmp_path / name))
        assert back.edges().equals(mean.edges()) and back.faithfulness().equals(mean.faithfulness())
    assert not math.isnan(mean.faithfulness()["faithfulness"].iloc[-1])


def test_bad_check_options_are_one_line(tmp_path):
    model, weights, sites = build(tmp_path, "gpt2")
    kwargs = dict(saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, progress=False)
    for bad, words in [({"verify_edges": -1}, "verify_edges"), ({"curve": 1.5}, "curve"),
                       ({"ablation": "noise"}, "ablation must be one of corrupt, mean, zero"),
                       ({"clean": [CLEAN], "corrupt": [CORRUPT], "ablation": "mean"}, "ablation='mean' averages"),
                       ({"clean": [CLEAN], "corrupt": [CORRUPT], "verify": -1}, "verify")]:
        with pytest.raises(pipatch.PipatchError) as error:
            pipatch.feature_circuit(model, **{**kwargs, **bad})
        assert words in str(error.value) and "\n" not in str(error.value)
