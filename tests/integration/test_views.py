"""One state, every view: schema, escaper, colour map, and the same cell at the same place.

The browser half of the schema / escaper / colour-map parity is js/__tests__/parity.test.ts,
run here on a contract written by tests/_contract.py; the live grid and the saved renderer in
a real browser are in tests/e2e/test_views_browser.py.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)


def test_a_real_circuits_view_names_every_node_and_ranks_as_its_table():
    """On the tiny Llama: every sender and receiver has its node, the q/k/v of a head are its
    node's three ports, the checked edges are the top of the ranking, and the graph's ranking is
    ``Result.edges()``'s."""
    import pipatch
    from tests._tiny import tiny_model

    r = pipatch.circuit(tiny_model("llama"), clean="When Mary and John went to the store, John gave a book to",
                        corrupt="When Mary and John went to the store, Mary gave a book to", answer=" Mary",
                        foil=" John", verify=3, curve=0)
    part = r.to_state()["circuit"]
    names = [n["name"] for n in part["nodes"]]
    assert len(names) == 1 + 3 * (4 + 1) + 1 and names[0] == "emb" and names[-1] == "logits"
    assert len(part["senders"]) == len(r.columns) and len(part["receivers"]) == len(r.layers)
    assert len({names[i] for i in part["receivers"]}) == len(names) - 1  # every node but the embeddings reads
    assert "faithfulness" not in part
    graph = r.graph()
    table = r.edges()
    assert [(e["sender"], e["receiver"]) for e in graph["edges"]] == list(zip(table["sender"], table["receiver"]))
    checked = {(c["sender"], c["receiver"]) for c in r.meta["checked"]}
    assert {(e["sender"], e["receiver"]) for e in graph["edges"][:3]} == checked
    assert all(e["exact"] is not None for e in graph["edges"][:3])
