"""Feature circuits (:func:`pipatch.feature_circuit`, issue #47) on tiny random models of three
families with a random SAE at every layer (:mod:`tests._saes`), and on the embedded model with
its shipped SAE.

* every node's score equals a hand-written reference: torch hooks written here rebuild each
  block's output as ``decode(f) + e`` from leaves ``f`` and ``e``, autograd gives ``dM/df`` and
  ``dM/de`` (one SAE at a time; integrated gradients: the same at each interpolation point);
* every edge kept equals a hand-written reference: one backward per downstream node from that
  node (times its ``dM/d node``) to the upstream SAE's leaves ``f`` and ``e``;
* every exact node check equals a hook reference of the patch within 1e-5;
* the result saves and loads (safetensors and JSON), and bad input is one line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import pipatch
from pipatch._experiments.dataset import named_groups
from pipatch._model.models import _get, adapter_for
from tests._reference import first
from tests._saes import random_weights, save_saelens
from tests._tiny import tiny_model
from tests.conftest import COLOSSEUM, EIFFEL
from tests.integration.test_features import CLEAN, CORRUPT, FAMILIES, hand_decode, hand_encode, hand_skip

ANSWER, FOIL = " Rome", " Moscow"
N_LAYERS = 3
#: The kind of SAE each model built here has, by the model's id.
KINDS: dict[int, str] = {}


def ids_of(model, text):
    return model.tokenizer(text, return_tensors="pt").input_ids


def token(model, text):
    return model.tokenizer(text, add_special_tokens=False).input_ids[0]


def logit_diff(model, logits):
    return logits[:, -1, token(model, ANSWER)] - logits[:, -1, token(model, FOIL)]


def target_logit(model, logits):
    """One prompt's metric: the target's (``ANSWER``'s) logit."""
    return logits[:, -1, token(model, ANSWER)]


def build(tmp_path, family, kind="jumprelu"):
    """A tiny model and a random ``kind`` SAE at every block's output (a transcoder: at every
    MLP): ``(model, weights by layer, latent sites)``."""
    model = tiny_model(family)
    d = adapter_for(model).d_model
    weights = {layer: random_weights(kind, d, d, seed=10 + layer) for layer in range(N_LAYERS)}
    hooks = [(f"blocks.{layer}.hook_mlp_in", f"blocks.{layer}.hook_mlp_out") if kind == "transcoder"
             else (f"blocks.{layer}.hook_resid_post", None) for layer in range(N_LAYERS)]
    folders = [save_saelens(tmp_path / f"{family}-L{layer}", kind, weights[layer], hook, f"tiny-{family}", hook_out)
               for layer, (hook, hook_out) in enumerate(hooks)]
    KINDS[id(model)] = kind  # what the hand references below rebuild
    return model, weights, pipatch.load_saes(folders, model)


def modules_at(model, layer):
    """``(module read, module written)`` at ``layer``: the block, or (a transcoder) the MLP and
    the module whose output the MLP adds."""
    a = adapter_for(model)
    block = _get(model._module, a.blocks)[layer]
    if KINDS[id(model)] != "transcoder":
        return block, block
    return _get(block, a.mlp), _get(block, a.mlp_post_norm or a.mlp)


def run_with(model, ids, edits):
    """``model._module(ids)`` with ``edits[layer](x_in, out) -> new out`` at each layer's
    written module (``x_in``: what the SAE reads there); ``edits["embed"](None, out)`` at the
    embedding module's output."""
    handles = []
    if "embed" in edits:
        edit_embed = edits["embed"]
        embedding = _get(model._module, adapter_for(model).embed)
        handles.append(embedding.register_forward_hook(lambda m, args, out: edit_embed(None, out)))
    for layer, edit in [(k, v) for k, v in edits.items() if k != "embed"]:
        read, written = modules_at(model, layer)
        seen = {}
        if KINDS[id(model)] == "transcoder":
            handles.append(read.register_forward_pre_hook(lambda m, args, seen=seen: seen.__setitem__("x", args[0])))

        def put(module, args, output, edit=edit, seen=seen):
            out = first(output)
            new = edit(seen.get("x", out), out)
            return (new, *output[1:]) if isinstance(output, tuple) else new
        handles.append(written.register_forward_hook(put))
    try:
        return model._module(ids).logits
    finally:
        for handle in handles:
            handle.remove()


def rebuild(weights, x_in, f, e):
    """What the SAE writes from latents ``f`` and error ``e`` (a transcoder's skip from ``x_in``)."""
    return hand_decode(weights, f) + hand_skip(weights, x_in) + e


def hand_values(model, weights, kind, ids):
    """Each layer's latents and error on a plain run, ``{layer: (f, e)}`` ([1, T, ...]), and
    ``store["embed"]``: ``(embedding output, None)``."""
    store = {}

    def embed(_, out):
        store["embed"] = (out.detach(), None)
        return out

    def keep(layer):
        def edit(x_in, out):
            f = hand_encode(weights[layer], kind, x_in)
            store[layer] = (f.detach(), (out - rebuild(weights[layer], x_in, f, 0)).detach())
            return out
        return edit
    with torch.no_grad():
        run_with(model, ids, {"embed": embed, **{layer: keep(layer) for layer in range(N_LAYERS)}})
    return store


def zeros_of(values):
    """``values`` (:func:`hand_values`) with every tensor zeroed: one prompt's reference."""
    return {k: tuple(None if t is None else torch.zeros_like(t) for t in pair) for k, pair in values.items()}


def hand_embed_gradient(model, base_ids, clean, point, steps=1, metric=logit_diff):
    """``dM/de`` at the embedding output, averaged over ``steps`` points from ``point``'s
    embeddings towards ``clean``'s (1: at ``point``, the run of ``base_ids``)."""
    total = 0
    for k in range(steps):
        e = (point["embed"][0] + k / steps * (clean["embed"][0] - point["embed"][0])).requires_grad_(True)
        with torch.enable_grad():
            logits = run_with(model, base_ids, {"embed": lambda _, out: e})
            (g,) = torch.autograd.grad(metric(model, logits)[0], [e])
        total = total + g
    return total / steps


def hand_node_gradients(model, weights, kind, corrupt_ids, clean, corrupt, layer, steps=1, metric=logit_diff):
    """``(dM/df, dM/de)`` at ``layer`` alone, averaged over ``steps`` points from the corrupt
    latents and error towards the clean ones (1: at the corrupt run)."""
    total_f, total_e = 0, 0
    for k in range(steps):
        alpha = k / steps
        f = (corrupt[layer][0] + alpha * (clean[layer][0] - corrupt[layer][0])).requires_grad_(True)
        e = (corrupt[layer][1] + alpha * (clean[layer][1] - corrupt[layer][1])).requires_grad_(True)
        with torch.enable_grad():
            logits = run_with(model, corrupt_ids, {layer: lambda x_in, out: rebuild(weights[layer], x_in, f, e)})
            gf, ge = torch.autograd.grad(metric(model, logits)[0], [f, e])
        total_f, total_e = total_f + gf, total_e + ge
    return total_f / steps, total_e / steps


def hand_edge(model, weights, kind, corrupt_ids, corrupt, up, down, target, grad_f_down, grad_e_down):
    """``d (w · node) / d f_up`` and ``/ d e_up`` for the downstream node ``target`` (``(position,
    latent or None)``) of layer ``down``, ``w`` its ``dM/d node``, with layer ``up``'s output
    rebuilt from leaves (``up="embed"``: the embedding output a leaf ``e``; ``f`` then unused);
    one backward."""
    e = corrupt[up][0 if up == "embed" else 1].clone().requires_grad_(True)
    f = e if up == "embed" else corrupt[up][0].clone().requires_grad_(True)
    seen = {}

    def read(x_in, out):
        seen.update(x=x_in, out=out)
        return out
    q, j = target
    write = (lambda _, out: e) if up == "embed" else (lambda x_in, out: rebuild(weights[up], x_in, f, e))
    with torch.enable_grad():
        run_with(model, corrupt_ids, {up: write, down: read})
        latents = hand_encode(weights[down], kind, seen["x"])
        if j is None:
            error = seen["out"] - rebuild(weights[down], seen["x"], latents, 0)
            value = (error[0, q] * grad_e_down[0, q]).sum()
        else:
            value = latents[0, q, j] * grad_f_down[0, q, j]
        return torch.autograd.grad(value, [f, e])


def hand_patch(model, weights, kind, corrupt_ids, node, clean, metric=logit_diff):
    """The metric of the corrupt run with ``node``'s latent (or error) at its position set to
    its clean value, the block's output rebuilt as decode(latents) + error (an embedding node:
    the embedding output at its position)."""
    layer, p = node["layer"], node["position"]
    if node["latent"] == "embed":
        def put(_, out):
            out = out.clone()
            out[0, p] = clean["embed"][0][0, p]
            return out
        with torch.no_grad():
            return float(metric(model, run_with(model, corrupt_ids, {"embed": put}))[0])

    def edit(x_in, out):
        f = hand_encode(weights[layer], kind, x_in)
        e = out - rebuild(weights[layer], x_in, f, 0)
        if node["latent"] == "error":
            e = e.clone()
            e[0, p] = clean[layer][1][0, p]
        else:
            f = f.clone()
            f[0, p, int(node["latent"])] = clean[layer][0][0, p, int(node["latent"])]
        return rebuild(weights[layer], x_in, f, e)
    with torch.no_grad():
        return float(metric(model, run_with(model, corrupt_ids, {layer: edit}))[0])


def latent_of(node):
    return None if node["latent"] in ("error", "embed") else int(node["latent"])


def target_logprob(model, logits):
    return logits[:, -1].log_softmax(-1)[:, token(model, ANSWER)]


def check_against_hands(model, weights, sites, kind, result, steps, prompt=False, metric=None):
    """Every node, edge and check of ``result`` against the hand references: a pair's (scores
    from the corrupt run, checks patch clean values in), or (``prompt``) one prompt's (the
    target's logit, or ``metric``; scores relative to zero at the prompt's run, checks
    zero-ablate and report M(prompt) − M(ablated))."""
    metric = metric or (target_logit if prompt else logit_diff)
    clean_ids, corrupt_ids = ids_of(model, CLEAN), ids_of(model, CLEAN if prompt else CORRUPT)
    clean = hand_values(model, weights, kind, clean_ids)
    corrupt = clean if prompt else hand_values(model, weights, kind, corrupt_ids)  # where gradients are taken
    reference = zeros_of(clean) if prompt else corrupt  # what scores are relative to
    grads = {layer: hand_node_gradients(model, weights, kind, corrupt_ids, clean, corrupt, layer, steps, metric)
             for layer in range(N_LAYERS)}
    grad_embed = hand_embed_gradient(model, corrupt_ids, clean, corrupt, steps, metric)
    nodes = [n for n in result.meta["nodes"] if n["latent"] != "metric"]
    by_name = {n["node"]: n for n in nodes}
    T = clean_ids.shape[1]
    # Every embedding node: (e_clean − e_reference) · dM/de, summed over the width.
    want_embed = ((clean["embed"][0] - reference["embed"][0]) * grad_embed)[0].sum(-1)
    embeds = [n for n in nodes if n["latent"] == "embed"]
    assert sorted(n["position"] for n in embeds) == list(range(T))
    for n in embeds:
        assert abs(n["score"] - float(want_embed[n["position"]])) < 1e-4, (n["node"], n["score"])
    assert float(want_embed.abs().max()) > 1e-3
    # Every node: (clean − corrupt) · dM/d node, an error's summed over the width.
    for layer in range(N_LAYERS):
        (f_c, e_c), (f_x, e_x), (gf, ge) = clean[layer], reference[layer], grads[layer]
        want_f, want_e = ((f_c - f_x) * gf)[0], ((e_c - e_x) * ge)[0].sum(-1)
        active = (f_c[0] != 0) | (f_x[0] != 0)
        mine = [n for n in nodes if n["layer"] == layer]
        assert len(mine) == int(active.sum()) + T  # every active latent and one error per position
        for n in mine:
            want = want_e[n["position"]] if n["latent"] == "error" else want_f[n["position"], n["latent"]]
            assert abs(n["score"] - float(want)) < 1e-4, (n["node"], n["score"], float(want))
    assert max(abs(n["score"]) for n in nodes) > 1e-3  # the scores are not all zero
    # Every kept edge: one backward per downstream node.
    edges = result.meta["edges"]
    assert edges and all(by_name[e["upstream"]]["layer"] + 1 == by_name[e["downstream"]]["layer"] for e in edges)
    for target in {e["downstream"] for e in edges}:
        down = by_name[target]
        up_layer = "embed" if down["layer"] == 0 else down["layer"] - 1
        gf_up, ge_up = hand_edge(model, weights, kind, corrupt_ids, corrupt, up_layer, down["layer"],
                                 (down["position"], latent_of(down)), *grads[down["layer"]])
        for edge in [e for e in edges if e["downstream"] == target]:
            up = by_name[edge["upstream"]]
            p = up["position"]
            if up["latent"] == "embed":
                want = float(((clean["embed"][0] - reference["embed"][0])[0, p] * ge_up[0, p]).sum())
                assert abs(edge["score"] - want) < 1e-4, (edge, want)
                continue
            (f_c, e_c), (f_x, e_x) = clean[up["layer"]], reference[up["layer"]]
            if up["latent"] == "error":
                want = float(((e_c - e_x)[0, p] * ge_up[0, p]).sum())
            else:
                want = float((f_c - f_x)[0, p, up["latent"]] * gf_up[0, p, up["latent"]])
            assert abs(edge["score"] - want) < 1e-4, (edge, want)
    # Every exact check: the hook reference's patch.
    with torch.no_grad():
        base = float(metric(model, model._module(corrupt_ids).logits)[0])
    checked = [n for n in nodes if n["exact"] is not None]
    assert len(checked) == result.meta["verify"]
    for n in checked:
        patched = hand_patch(model, weights, kind, corrupt_ids, n, reference if prompt else clean, metric)
        want = base - patched if prompt else patched - base
        assert abs(n["exact"] - want) < 1e-5, (n["node"], n["exact"], want)
    return edges


@pytest.mark.parametrize("family", FAMILIES)
def test_node_edge_and_exact_values_equal_the_hand_references(family, tmp_path):
    model, weights, sites = build(tmp_path, family)
    result = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                     verify=6, top_nodes=12, top_edges=40, batch_size=5, progress=False)
    check_against_hands(model, weights, sites, "jumprelu", result, steps=1)
    assert result.meta["method"] == "atp" and -1 <= result.meta["agreement"]["spearman"] <= 1
    assert result.meta["agreement"]["n"] == 6


@pytest.mark.parametrize("family", FAMILIES)
def test_one_prompt_and_its_target_equal_the_hand_references(family, tmp_path):
    """Attribution-graph form: the target's logit, every node and edge scored relative to zero
    at the prompt's run (embeddings included), the checks zero-ablations."""
    model, weights, sites = build(tmp_path, family)
    result = pipatch.feature_circuit(model, saes=sites, prompt=CLEAN, target=ANSWER, verify=6, top_nodes=14,
                                     top_edges=60, batch_size=5, progress=False)
    edges = check_against_hands(model, weights, sites, "jumprelu", result, steps=1, prompt=True)
    assert result.metric == "logit" and result.meta["direction"] == "zero" and result.corrupt_value == 0
    with torch.no_grad():
        logits = model._module(ids_of(model, CLEAN)).logits
    assert result.clean_value == pytest.approx(float(target_logit(model, logits)[0]), abs=1e-5)
    assert result.meta["agreement"]["n"] == 6
    if family == "llama":  # the top nodes here include embeddings: their edges into layer 0 are checked above
        assert any(e["upstream"].startswith("embed") for e in edges)
        top = pipatch.feature_circuit(model, saes=sites, prompt=CLEAN, verify=0, progress=False)
        assert top.meta["answer_id"] == int(logits[0, -1].argmax())
        logprob = pipatch.feature_circuit(model, saes=sites, prompt=CLEAN, target=ANSWER, metric="logprob", verify=3,
                                          top_nodes=8, top_edges=30, progress=False)
        check_against_hands(model, weights, sites, "jumprelu", logprob, steps=1, prompt=True, metric=target_logprob)
        # Every node checked exactly, embeddings included: zero-ablated here, patched in a pair.
        n = len(top.meta["nodes"]) - 1
        every = pipatch.feature_circuit(model, saes=sites, prompt=CLEAN, target=ANSWER, verify=n, top_nodes=8,
                                        top_edges=20, progress=False)
        check_against_hands(model, weights, sites, "jumprelu", every, steps=1, prompt=True)
        pair = dict(clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL)
        n = len(pipatch.feature_circuit(model, saes=sites, **pair, verify=0, progress=False).meta["nodes"]) - 1
        every = pipatch.feature_circuit(model, saes=sites, **pair, verify=n, top_nodes=8, top_edges=20, progress=False)
        check_against_hands(model, weights, sites, "jumprelu", every, steps=1)


def test_a_dataset_of_pairs_averages_each_pairs_nodes_and_edges_over_named_positions(tmp_path):
    """Each averaged node: the mean over its named position's tokens, then over the pairs that
    have it; each averaged edge G → H: the mean over H's tokens of the sum over G's, then over
    the pairs with both; both from each pair's own graph (every node kept), averaged here."""
    model, weights, sites = build(tmp_path, "gpt2")
    pairs = [(CLEAN, CORRUPT), ("The Louvre is in the city of", "The Colosseum is in the city of"),
             ("The Kremlin is in the city of the", "The Colosseum is in the city of the")]
    kwargs = dict(saes=sites[1:], answer=ANSWER, foil=FOIL, progress=False)  # two SAEs keep the graphs small
    data = pipatch.feature_circuit(model, clean=[c for c, _ in pairs], corrupt=[x for _, x in pairs], top_nodes=12,
                                   top_edges=15, **kwargs)
    names = data.columns
    assert names[-1] == "last" and data.raw["nodes"].shape == (3, 2, len(names))
    sums: list[dict] = []  # per pair: {(site, named position, latent): mean score over its positions}
    graphs = []  # per pair: its nodes by name, its named positions, every edge between its nodes
    for c, x in pairs:
        one = pipatch.feature_circuit(model, clean=c, corrupt=x, verify=0, top_nodes=10**6, top_edges=10**6, **kwargs)
        tokens = one.meta["clean_tokens"]
        changed = [k for k, (a, b) in enumerate(zip(tokens, one.meta["corrupt_tokens"])) if a != b]
        groups = named_groups(changed, len(tokens), "changed")[1]
        here = {(None, names[g], None): 0.0 for g, group in enumerate(groups) if group}  # the groups it has
        for n in one.meta["nodes"][1:]:
            for g in [g for g, group in enumerate(groups) if n["position"] in group]:
                key = (n["site"], names[g], n["latent"])
                here[key] = here.get(key, 0.0) + n["score"] / len(groups[g])
        sums.append(here)
        graphs.append(({n["node"]: n for n in one.meta["nodes"][1:]}, groups, one.meta["edges"]))
    keys = {k for here in sums for k in here if k[0] is not None}
    # A pair with that named position but not that node adds 0; a pair without it has no say.
    by_hand = {k: [here.get(k, 0.0) for here in sums if (None, k[1], None) in here] for k in keys}
    nodes = data.meta["nodes"]
    assert nodes[0]["latent"] == "metric"
    baselines = torch.tensor(data.meta["per_prompt_clean"]) - torch.tensor(data.meta["per_prompt_corrupt"])
    assert nodes[0]["score"] == pytest.approx(float(baselines.mean()), abs=1e-6)
    assert {(n["site"], n["position"], n["latent"]) for n in nodes[1:]} == set(by_hand)
    for n in nodes[1:]:
        per_pair = by_hand[(n["site"], n["position"], n["latent"])]
        assert n["pairs"] == len(per_pair)
        assert n["score"] == pytest.approx(sum(per_pair) / len(per_pair), abs=1e-6), n["node"]
    assert sum(n["circuit"] for n in nodes[1:]) == 12 and data.warnings
    # The edges between kept averaged nodes.
    kept = {(n["site"], n["position"], n["latent"]): n["node"] for n in nodes[1:] if n["circuit"]}
    edge_sums: dict = {}
    for i, (by_name, groups, edges) in enumerate(graphs):
        def places(node):
            return [(kept[k], g) for g, group in enumerate(groups) if node["position"] in group
                    for k in [(node["site"], names[g], node["latent"])] if k in kept]
        for e in edges:
            for up, _ in places(by_name[e["upstream"]]):
                for down, h in places(by_name[e["downstream"]]):
                    edge_sums.setdefault((up, down), [0.0] * len(pairs))[i] += e["score"] / len(groups[h])
    position = {n["node"]: n["position"] for n in nodes}
    edge_by_hand = {key: [v for v, (_, groups, _) in zip(values, graphs)
                          if groups[names.index(position[key[0]])] and groups[names.index(position[key[1]])]]
                    for key, values in edge_sums.items()}
    edge_by_hand = {key: sum(v) / len(v) for key, v in edge_by_hand.items()}
    got = data.edges()
    assert len(got) == 15
    for e in got.itertuples():
        assert e.score == pytest.approx(edge_by_hand[(e.upstream, e.downstream)], abs=1e-6)
    assert abs(got["score"]).min() >= sorted(map(abs, edge_by_hand.values()))[-15] - 1e-9
    back = pipatch.load_result(data.save(tmp_path / "data.json"))
    assert back.nodes().equals(data.nodes()) and back.edges().equals(got)
    assert len(back.plot().axes[0].collections) == 12
    assert list(data.nodes()["pairs"])[:2] == [3, nodes[1]["pairs"]]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_integrated_gradients_and_a_topk_sae_equal_the_hand_references(family, tmp_path):
    model, weights, sites = build(tmp_path, family, kind="topk")
    result = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                     steps=3, verify=4, top_nodes=10, top_edges=30, progress=False)
    assert result.meta["method"] == "ig"
    check_against_hands(model, weights, sites, "topk", result, steps=3)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_transcoders_at_every_mlp_equal_the_hand_references(family, tmp_path):
    """Transcoders read each MLP's input and write its output (Gemma: after its post-norm),
    with an affine skip that stays live in every patch and along the integrated gradients."""
    model, weights, sites = build(tmp_path, family, kind="transcoder")
    for steps in (1, 2):
        result = pipatch.feature_circuit(model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                                         steps=steps, verify=4, top_nodes=10, top_edges=30, progress=False)
        check_against_hands(model, weights, sites, "transcoder", result, steps=steps)


def test_a_click_ablates_any_node_as_the_hook_reference_does(tmp_path):
    """The view's click (``answer_message`` with the plan's predictor) patches a node the checks
    left out, and a checked one again: each equals the hook reference within 1e-5."""
    from pipatch._experiments._api import plan

    model, weights, sites = build(tmp_path, "llama")
    planned = plan("feature_circuit", model, saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL,
                   verify=2, top_nodes=12)
    predictor = planned.predictor()
    planned.run()
    result = planned.result
    nodes = [n for n in result.meta["nodes"] if n["latent"] != "metric"]
    unchecked = next(n for n in nodes if n["exact"] is None and isinstance(n["latent"], int))
    error = next(n for n in nodes if n["exact"] is None and n["latent"] == "error")
    checked = next(n for n in nodes if n["exact"] is not None and n["latent"] != "embed")
    was = checked["exact"]
    corrupt_ids = ids_of(model, CORRUPT)
    clean = hand_values(model, weights, "jumprelu", ids_of(model, CLEAN))
    with torch.no_grad():
        base = float(logit_diff(model, model._module(corrupt_ids).logits)[0])
    for node in (unchecked, error, checked):
        state = result.answer_message(predictor, {"type": "ablate", "node": node["node"]})
        assert state["detail"] == {}
        shown = next(n for n in state["feature_graph"]["nodes"] if n["name"] == node["node"])
        want = hand_patch(model, weights, "jumprelu", corrupt_ids, node, clean) - base
        assert abs(node["exact"] - want) < 1e-5 and shown["exact"] == node["exact"], (node, want)
    assert abs(checked["exact"] - was) < 1e-6


def test_pruning_tables_grid_file_and_plot(tmp_path):
    model, weights, sites = build(tmp_path, "llama")
    kwargs = dict(saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, progress=False)
    result = pipatch.feature_circuit(model, **kwargs, verify=3, top_nodes=8, top_edges=5)
    nodes, edges = result.nodes(), result.edges()
    assert list(nodes.columns) == ["node", "site", "layer", "position", "latent", "score", "exact", "circuit"]
    assert list(edges.columns) == ["upstream", "downstream", "score", "exact"]
    assert nodes.iloc[0]["latent"] == "metric"
    assert nodes.iloc[0]["score"] == pytest.approx(result.clean_value - result.corrupt_value)
    rest = nodes.iloc[1:]
    assert int(rest["circuit"].sum()) == 8 and int(rest["exact"].notna().sum()) == 3 and len(edges) == 5
    assert list(rest["score"].abs()) == sorted(rest["score"].abs(), reverse=True)
    kept = set(rest[rest["circuit"]]["node"])
    assert set(edges["upstream"]) | set(edges["downstream"]) <= kept
    # The grid: each SAE's scores at each position, summed, over the corrupt metric.
    grid = result.raw["nodes"][0] - result.corrupt_value
    for row, site in enumerate(result.layers):
        for col, position in enumerate(result.meta["positions"]):
            mine = rest[(rest["site"] == site) & (rest["position"] == position)]
            assert float(grid[row, col]) == pytest.approx(float(mine["score"].sum()), abs=1e-5)
    # Thresholds prune too.
    cut = abs(float(rest.iloc[3]["score"]))
    strict = pipatch.feature_circuit(model, **kwargs, verify=0, node_threshold=cut, edge_threshold=1e9)
    assert int(strict.nodes()["circuit"].sum()) == 1 + int((rest["score"].abs() >= cut).sum())
    assert strict.edges().empty and "agreement" not in strict.meta
    for name in ("r.safetensors", "r.json"):
        back = pipatch.load_result(result.save(tmp_path / name))
        assert type(back).__name__ == "FeatureCircuitResult"
        assert back.nodes().equals(nodes) and back.edges().equals(edges)
    assert repr(result).startswith("<pipatch.FeatureCircuitResult done: ") and "5 edges" in repr(result)
    figure = result.plot()
    assert len(figure.axes[0].collections) == 8


def test_labels_and_top_contexts_reach_the_nodes_the_view_draws(tmp_path):
    """Labels given (``labels=``, one SAE) or in the labels file next to an SAE (the other), and
    the top contexts stored next to an SAE, are in the hover text of each latent node drawn, and
    survive a save; a latent with neither has none."""
    model, _, sites = build(tmp_path, "llama")
    contexts = pipatch.feature_contexts(model, sites[1], [CLEAN, CORRUPT, "Rome is the capital of Italy"], k=2)
    kwargs = dict(saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, verify=0, verify_edges=0,
                  curve=0, top_nodes=12, progress=False)
    latents = {s.name: sorted({int(n) for n in pipatch.feature_circuit(model, **kwargs).nodes().query(
        f"site == '{s.name}' and circuit").latent if n not in ("error", "embed")}) for s in sites[:2]}
    words = {i: f"<b>latent</b> {i}" for i in latents[sites[0].name]}  # text, never HTML
    (sites[1].sae.folder / "labels.json").write_text(json.dumps({str(i): f"L1 #{i}" for i in latents[sites[1].name]}))
    result = pipatch.feature_circuit(model, **kwargs, labels={sites[0].name: words})
    for state in (result.to_state(), pipatch.load_result(result.save(tmp_path / "g.json")).to_state()):
        drawn = {n["name"]: n for n in state["feature_graph"]["nodes"] if n["kind"] == "latent"}
        node = next(n for n in result.meta["nodes"] if n["site"] == sites[0].name and n["latent"] in words)
        assert drawn[node["node"]]["note"].splitlines()[0] == words[node["latent"]]
        node = next(n for n in result.meta["nodes"] if n["site"] == sites[1].name and n["circuit"]
                    and n["latent"] in latents[sites[1].name] and contexts.top(n["latent"]))
        lines = drawn[node["node"]]["note"].splitlines()
        assert lines[0] == f"L1 #{node['latent']}" and lines[1].startswith(contexts.top(node["latent"])[0][0])
        bare = [n for n in result.meta["nodes"] if n["site"] == sites[2].name and isinstance(n["latent"], int)
                and n["node"] in drawn]
        assert bare and all(drawn[n["node"]]["note"] == "" for n in bare)


def test_bad_input_is_one_line(tmp_path):
    model, weights, sites = build(tmp_path, "gpt2")
    kwargs = dict(saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, progress=False)
    for bad, words in [({"steps": 0}, "steps"), ({"node_threshold": -1}, "node_threshold"),
                       ({"top_nodes": 0}, "top_nodes"), ({"saes": []}, "saes="),
                       ({"answer": " Rome Rome"}, "one-token answer")]:
        with pytest.raises(pipatch.PipatchError) as error:
            pipatch.feature_circuit(model, **{**kwargs, **bad})
        assert words in str(error.value) and "\n" not in str(error.value)
    one = dict(saes=sites, prompt=CLEAN, progress=False)
    for bad, words in [({"target": " Rome Rome"}, "one token's logit"), ({"steps": 2}, "steps=1"),
                       ({"metric": "logit_diff"}, "metric for one prompt"), ({"answer": ANSWER}, "target="),
                       ({"clean": CLEAN}, "not both"), ({"prompt": [CLEAN, CLEAN]}, "clean/corrupt pairs")]:
        with pytest.raises(pipatch.PipatchError) as error:
            pipatch.feature_circuit(model, **{**one, **bad})
        assert words in str(error.value) and "\n" not in str(error.value), error.value
    for bad, words in [({"target": ANSWER}, "target= goes with prompt="), ({"answer": None}, "needs answer="),
                       ({"clean": [CLEAN, CLEAN], "corrupt": [CORRUPT]}, "same length"),
                       ({"clean": [CLEAN], "corrupt": [CORRUPT], "positions": [1]}, "named positions")]:
        with pytest.raises(pipatch.PipatchError) as error:
            pipatch.feature_circuit(model, **{**kwargs, **bad})
        assert words in str(error.value) and "\n" not in str(error.value), error.value
    with pytest.raises(pipatch.PipatchError, match="needs clean= \\(or prompt=\\)"):
        pipatch.feature_circuit(model, saes=sites, answer=ANSWER, progress=False)


def test_scores_given_are_checked_here_and_bad_scores_are_one_line(tmp_path):
    """``scores=`` (what vLLM, served and NDIF take) on the transformers backend: a pair's and
    one prompt's circuit, checked again from their scores, keep the nodes and edges and
    give the same exact values. Scores of another prompt, answer or set of SAEs, of
    another experiment, or for a dataset are refused in one line."""
    model, weights, sites = build(tmp_path, "gpt2")
    kwargs = dict(saes=sites, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, progress=False, verify=3,
                  verify_edges=2, curve=2, top_nodes=6)
    one = dict(saes=sites, prompt=CLEAN, progress=False, verify=3, top_nodes=6)
    for options in (kwargs, one):
        scored = pipatch.feature_circuit(model, **options)
        checked = pipatch.feature_circuit(model, **options, scores=scored)
        assert checked.meta["scores_from"]["backend"] == "transformers"
        for table in ("nodes", "edges"):
            mine, theirs = getattr(checked, table)(), getattr(scored, table)()
            assert mine.drop(columns="exact").equals(theirs.drop(columns="exact"))
            assert torch.allclose(torch.tensor(mine["exact"].to_numpy()), torch.tensor(theirs["exact"].to_numpy()),
                                  atol=1e-6, equal_nan=True)
        assert int(checked.nodes()["exact"].notna().sum()) == 1 + 3
    scored = pipatch.feature_circuit(model, **{**kwargs, "verify": 0, "verify_edges": 0, "curve": 0})
    for bad, words in [({"corrupt": "The Louvre is in the city of"}, "differs from this run in its corrupt_tokens"),
                       ({"foil": " Paris"}, "in its foil_ids"), ({"saes": sites[:2]}, "in its saes"),
                       ({"positions": [-1]}, "in its positions"),
                       ({"scores": 3}, "scores=int: give the result of pipatch.feature_circuit"),
                       ({"clean": [CLEAN], "corrupt": [CORRUPT]}, "scores= checks one pair's (or one prompt's) feature circuit, not a dataset's")]:
        with pytest.raises(pipatch.PipatchError) as error:
            pipatch.feature_circuit(model, **{**kwargs, "scores": scored, **bad})
        assert words in str(error.value) and "\n" not in str(error.value), error.value


def test_the_embedded_model_and_its_sae_on_the_eiffel_tower_pair(model):
    """One SAE (layer 6): its latents and errors as nodes, the embeddings below it (edges from
    them only); the top 20 nodes' estimates against their exact patches (the rank correlation
    is printed), and the faithfulness curve (printed: at the circuit's size, and the nodes it
    takes to reach 80 %)."""
    site = pipatch.embedded_sae(model)
    result = pipatch.feature_circuit(model, saes=[site], clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris",
                                     foil=" Rome", verify=20, curve=4, progress=False)
    every = result.nodes().iloc[1:]
    nodes = every[every["latent"] != "embed"]
    T = len(result.tokens)
    assert (nodes["latent"] == "error").sum() == T and len(nodes) > T and (every["latent"] == "embed").sum() == T
    assert set(nodes["layer"]) == {6} and all(result.edges()["upstream"].str.startswith("embed @"))
    agreement = result.meta["agreement"]
    assert agreement["n"] == 20 and not math.isnan(agreement["spearman"])
    print(f"embedded SAE L6, Eiffel/Colosseum: {len(nodes)} nodes, top-20 rank correlation "
          f"{agreement['spearman']:.3f}, max |estimate − exact| {agreement['max_abs_error']:.3f}")
    # Every latent and error of the one SAE at every position ablated to its corrupt value is
    # the corrupt run's stream from layer 6 on; every node kept is the clean run (the
    # embeddings stay free: no node of the curve).
    curve, rows = result.meta["curve"], result.faithfulness()
    assert curve["empty"] == pytest.approx(result.corrupt_value, abs=1e-3)
    # The full end likewise: every node kept is the clean run within 1e-3; the faithfulness,
    # (m(C) − m(∅)) / (m(M) − m(∅)) of the same numbers, is then 1 within 1e-3 over the span
    # (tests/_tolerance.py), which is below 1e-3 (|m(M) − m(∅)| > 1).
    from tests._tolerance import ratio_tolerance

    assert rows["with"].iloc[-1] == pytest.approx(curve["full"], abs=1e-3)
    within = ratio_tolerance(0.0, curve["full"] - curve["empty"], 1e-3, 0.0)
    assert within < 1e-3
    assert rows["n_nodes"].iloc[-1] == len(nodes) and rows["faithfulness"].iloc[-1] == pytest.approx(1, abs=1e-3)
    at = rows[rows["n_nodes"] == int(nodes["circuit"].sum())].iloc[0]
    print(f"faithfulness at the circuit's {int(at['n_nodes'])} nodes {at['faithfulness']:.3f} (completeness "
          f"{at['completeness']:.3f}); 80 % reached at {curve['nodes_for_80']} nodes of the sizes measured")


def test_the_embedded_model_and_its_sae_on_sixteen_ioi_pairs(model):
    """A dataset of 16 IOI pairs (name-flip corruptions) over the shipped SAE, averaged over
    named positions: the top 20 averaged nodes checked exactly (the rank correlation is
    printed), and a short faithfulness curve whose ends are the mean clean and corrupt
    metrics (printed: its value at the circuit's size, and the nodes it takes to reach 80 %).
    No edges (``top_edges=0``: the Eiffel Tower test has them) keeps it cheap."""
    task = pipatch.tasks.ioi(16, seed=0, tokenizer=model.tokenizer)
    result = pipatch.feature_circuit(model, saes=[pipatch.embedded_sae(model)], **task, verify=20, top_edges=0,
                                     verify_edges=0, curve=2, progress=False)
    nodes = result.nodes().iloc[1:]
    assert result.meta["dataset"] and len(result.meta["per_prompt_clean"]) == 16 and set(nodes["pairs"]) == {16}
    assert nodes["exact"].notna().sum() == 20 and nodes["exact"].iloc[:20].notna().all()
    agreement = result.meta["agreement"]
    assert agreement["n"] == 20 and not math.isnan(agreement["spearman"])
    # Every latent and error of the one SAE ablated to its corrupt value is each pair's corrupt
    # stream from layer 6 on; every node kept is its clean run.
    curve, rows = result.meta["curve"], result.faithfulness()
    clean, corrupt = result.clean_value, result.corrupt_value
    assert curve["full"] == pytest.approx(clean, abs=1e-5) and curve["empty"] == pytest.approx(corrupt, abs=1e-3)
    assert rows["with"].iloc[-1] == pytest.approx(clean, abs=1e-3)
    sae_nodes = nodes[nodes["latent"] != "embed"]
    kept = int(sae_nodes["circuit"].sum())
    assert rows["n_nodes"].iloc[-1] == len(sae_nodes) and kept in set(rows["n_nodes"])
    at = rows[rows["n_nodes"] == kept].iloc[0]
    print(f"embedded SAE L6, 16 IOI pairs: {len(sae_nodes)} averaged nodes, top-20 rank correlation "
          f"{agreement['spearman']:.3f}, max |estimate − exact| {agreement['max_abs_error']:.3f}; faithfulness at "
          f"the circuit's {kept} nodes {at['faithfulness']:.3f}, 80 % reached at {curve['nodes_for_80']} nodes "
          f"({result.meta['elapsed_stages']})")


def test_the_magic_and_patchgrid_run_take_one_prompt_as_python_does(ip, tmp_path):
    """``%%feature_circuit`` with the prompt as its body (no clean/corrupt lines) and
    ``PatchGrid.run(model, "feature_circuit", prompt=...)``: the Python call's graph."""
    from pipatch import PatchGrid

    model, weights, sites = build(tmp_path, "gpt2")
    kwargs = dict(target=ANSWER, verify=2, top_nodes=6)
    want = pipatch.feature_circuit(model, saes=sites, prompt=CLEAN, progress=False, **kwargs)
    ip.user_ns["tiny"] = model
    folders = " ".join(f"--saes {tmp_path / f'gpt2-L{layer}'}" for layer in range(N_LAYERS))
    ip.run_cell_magic("feature_circuit", f'--model tiny {folders} --target " Rome" --verify 2 --top-nodes 6 -o g',
                      CLEAN)
    assert ip.user_ns["g"].nodes().equals(want.nodes()) and ip.user_ns["g"].edges().equals(want.edges())
    live = PatchGrid.run(model, "feature_circuit", saes=sites, prompt=CLEAN, **kwargs)
    assert live.nodes().equals(want.nodes())
