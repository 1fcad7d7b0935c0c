"""A feature circuit's view and files without a model (#47): the state's ``feature_graph``
part, supernodes (kept through save and load), the view's messages, and circuit-tracer's
graph JSON."""

from __future__ import annotations

import json

import pytest
import torch

import pipatch
from pipatch._base.errors import PipatchError
from pipatch._results.feature_circuit import VIEW_NODES_MAX, FeatureCircuitResult
from pipatch._results.views import conform_state

SITES = ["L0 resid_post", "L1 resid_post"]


def node(site, position, latent, score, exact=None, circuit=False):
    name = f"{site} {'error' if latent == 'error' else f'#{latent}'} @{position}"
    return {"node": name, "site": site, "layer": SITES.index(site), "position": position, "latent": latent,
            "score": score, "exact": exact, "circuit": circuit}


def example(extra: int = 0) -> FeatureCircuitResult:
    nodes = [
        {"node": "metric", "site": "metric", "layer": 2, "position": 2, "latent": "metric", "score": 0.5,
         "exact": 0.5, "circuit": True},
        node(SITES[0], 1, 7, 0.3, exact=0.25, circuit=True),
        node(SITES[0], 1, "error", -0.2, circuit=True),
        node(SITES[1], 2, 3, 0.1, circuit=True),
        *[node(SITES[1], 0, 100 + i, 1e-3 / (i + 1)) for i in range(extra)],
    ]
    edges = [{"upstream": nodes[1]["node"], "downstream": nodes[3]["node"], "score": 0.05, "exact": 0.04},
             {"upstream": nodes[2]["node"], "downstream": nodes[3]["node"], "score": -0.01}]
    meta = {"model": "tiny", "positions": [0, 1, 2], "nodes": nodes, "edges": edges,
            "saes": [{"name": s, "layer": i, "sae": f"sae{i}", "d_sae": 128} for i, s in enumerate(SITES)],
            "labels": {SITES[0]: {"7": "<b>towers</b>"}},
            "contexts": {SITES[0]: {"7": [["the <script> Eiffel", 2.5]]}}}
    return FeatureCircuitResult(kind="feature_circuit", tokens=["The", " Eiffel", " Tower"],
                                columns=["The", " Eiffel", " Tower"], layers=SITES, metric="logit_diff",
                                raw={"nodes": torch.zeros(1, 2, 3)}, clean=1.0, corrupt=torch.tensor([0.5]), meta=meta)


def test_the_state_holds_the_graph_with_labels_as_text():
    part = example().to_state()["feature_graph"]
    assert part == conform_state({"feature_graph": part})["feature_graph"]
    assert part["sites"] == SITES and part["positions"] == [0, 1, 2] and part["total"] == 4
    names = [n["name"] for n in part["nodes"]]
    assert names[0] == "metric" and part["nodes"][0]["row"] == 2 and part["nodes"][0]["kind"] == "metric"
    latent = part["nodes"][names.index("L0 resid_post #7 @1")]
    assert latent["kind"] == "latent" and latent["latent"] == 7 and latent["exact"] == 0.25 and latent["row"] == 0
    assert "<b>towers</b>" in latent["note"] and "the <script> Eiffel  (2.5)" in latent["note"]  # text, escaped by the view
    error = part["nodes"][names.index("L0 resid_post error @1")]
    assert error["kind"] == "error" and error["latent"] is None and error["exact"] is None
    assert {(names[e["up"]], names[e["down"]]) for e in part["edges"]} == {
        ("L0 resid_post #7 @1", "L1 resid_post #3 @2"), ("L0 resid_post error @1", "L1 resid_post #3 @2")}


def test_the_state_sends_each_edges_exact_value_or_null():
    part = example().to_state()["feature_graph"]
    assert [(e["score"], e["exact"]) for e in part["edges"]] == [(0.05, 0.04), (-0.01, None)]


def test_a_large_graph_sends_its_circuit_and_largest_nodes():
    part = example(extra=VIEW_NODES_MAX + 10).to_state()["feature_graph"]
    assert len(part["nodes"]) == VIEW_NODES_MAX and part["total"] == VIEW_NODES_MAX + 14
    kept = {n["name"] for n in part["nodes"]}
    assert {"metric", "L0 resid_post #7 @1", "L0 resid_post error @1", "L1 resid_post #3 @2"} <= kept
    assert "L1 resid_post #100 @0" in kept and f"L1 resid_post #{100 + VIEW_NODES_MAX + 9} @0" not in kept


def test_supernodes_are_saved_with_the_result(tmp_path):
    r = example()
    r.group("towers", ["L0 resid_post #7 @1", "L1 resid_post #3 @2"])
    r.group("gone", ["L0 resid_post error @1"])
    r.group("gone", [])
    assert r.supernodes() == {"towers": ["L0 resid_post #7 @1", "L1 resid_post #3 @2"]}
    assert r.to_state()["feature_graph"]["groups"] == [{"name": "towers", "nodes": ["L0 resid_post #7 @1",
                                                                                    "L1 resid_post #3 @2"]}]
    for suffix in ("safetensors", "json"):
        loaded = pipatch.load_result(r.save(tmp_path / f"r.{suffix}"))
        assert isinstance(loaded, FeatureCircuitResult) and loaded.supernodes() == r.supernodes()
    assert r.to_mime()["feature_graph"]["groups"][0]["name"] == "towers"


def test_bad_groups_and_ablations_are_one_line():
    r = example()
    with pytest.raises(PipatchError, match="no node 'nope'"):
        r.group("x", ["nope"])
    with pytest.raises(PipatchError, match="needs a name"):
        r.group("  ", ["metric"])
    with pytest.raises(PipatchError, match="loaded result"):
        r.ablate("L0 resid_post #7 @1", None)
    with pytest.raises(PipatchError, match="not the metric"):
        r.ablate("metric", None)


class _Ablates:
    """A predictor that answers every ablation with 0.125 (the plan's predictor patches the
    model: tests/integration/test_feature_circuit.py)."""

    def ablate(self, node):
        return 0.125


def test_the_views_messages_update_the_graph():
    r = example()
    out = r.answer_message(_Ablates(), {"type": "ablate", "node": "L1 resid_post #3 @2"})
    assert out["detail"] == {}
    shown = {n["name"]: n for n in out["feature_graph"]["nodes"]}
    assert shown["L1 resid_post #3 @2"]["exact"] == 0.125 and r.nodes().set_index("node").loc["L1 resid_post #3 @2", "exact"] == 0.125
    out = r.answer_message(None, {"type": "group", "name": "g", "nodes": ["metric"]})
    assert out["feature_graph"]["groups"] == [{"name": "g", "nodes": ["metric"]}]
    assert "loaded result" in r.answer_message(None, {"type": "ablate", "node": "L0 resid_post #7 @1"})["detail"]["error"]
    assert "not 'drop'" in r.answer_message(None, {"type": "drop"})["detail"]["error"]


def test_circuit_tracer_graph_json(tmp_path):
    r = example()
    r.group("towers", ["L0 resid_post #7 @1", "L1 resid_post #3 @2"])
    graph = json.loads(r.to_circuit_tracer(tmp_path / "graph.json").read_text())
    assert set(graph) == {"metadata", "qParams", "nodes", "links"}
    assert graph["metadata"]["prompt_tokens"] == ["The", " Eiffel", " Tower"]
    assert graph["metadata"]["transcoder_list"] == ["sae0", "sae1"]
    by_id = {n["node_id"]: n for n in graph["nodes"]}
    assert by_id["0_7_1"]["feature_type"] == "cross layer transcoder" and by_id["0_7_1"]["clerp"] == "<b>towers</b>"
    assert by_id["0_7_1"]["influence"] == 0.3 and by_id["0_7_1"]["ctx_idx"] == 1
    assert by_id["0_0_1"]["feature_type"] == "mlp reconstruction error"
    assert by_id["3_0_2"]["feature_type"] == "logit" and by_id["3_0_2"]["is_target_logit"]
    assert graph["links"] == [{"source": "0_7_1", "target": "1_3_2", "weight": 0.05},
                              {"source": "0_0_1", "target": "1_3_2", "weight": -0.01}]
    assert graph["qParams"]["supernodes"] == [["towers", "0_7_1", "1_3_2"]]


def test_embedding_nodes_get_a_row_below_the_saes_and_a_datasets_named_positions_are_columns():
    result = example()
    embed = {"node": "embed @1", "site": "embed", "layer": -1, "position": 1, "latent": "embed", "score": 0.4,
             "exact": None, "circuit": True}
    result.meta["nodes"].append(embed)
    result.meta["edges"].append({"upstream": "embed @1", "downstream": "L0 resid_post #7 @1", "score": 0.2})
    part = result.to_state()["feature_graph"]
    names = [n["name"] for n in part["nodes"]]
    assert part["sites"] == ["embed", *SITES]
    drawn = part["nodes"][names.index("embed @1")]
    assert drawn["kind"] == "embed" and drawn["row"] == 0 and drawn["latent"] is None
    assert part["nodes"][names.index("L0 resid_post #7 @1")]["row"] == 1 and part["nodes"][0]["row"] == 3
    assert ("embed @1", "L0 resid_post #7 @1") in {(names[e["up"]], names[e["down"]]) for e in part["edges"]}

    named = example()
    named.columns = ["before", "last subject", "last"]
    named.meta.update({"dataset": True, "positions": list(named.columns)})
    for n in named.meta["nodes"]:
        n["position"] = named.columns[n["position"]]
    part = named.to_state()["feature_graph"]
    assert part["positions"] == [0, 1, 2]
    assert {n["name"]: n["position"] for n in part["nodes"]}["L0 resid_post #7 @1"] == 1
