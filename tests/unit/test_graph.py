"""A circuit's graph lives in one module (``pipatch/_model/graph.py``): its nodes are typed by site,
its indices are the ones the hand formulas gave, and no other module compares node kinds.

* **The grep test.** No module of ``pipatch/`` but ``_model/graph.py`` and ``_model/sites.py`` compares a
  circuit node-kind string (``"emb"``, ``"head_out"``, ``"mlp_out"``, ``"qkv"``,
  ``"mlp_in"``, ``"logits"``): read with :mod:`ast`, so prose and the code templates of
  ``Result.code()`` (string literals) are never read as code. Flagged: such a literal (alone or
  in a tuple, list or set) on either side of a comparison (``==``, ``!=``, ``in``, ``is``) or
  after ``case``; as a key of a dict literal (a kind map); as a subscript (a lookup by kind);
  as the key of ``.get`` / ``.index`` / ``.count`` / ``.pop`` / ``.setdefault`` /
  ``.startswith`` / ``.endswith``. The one spelling shared with something else: ``qkv`` is an
  :class:`~pipatch._model.models.Adapter` field too (the q/k/v projection modules), so a dict of
  adapter fields may have it as a key.
* **Indices.** Every index :class:`pipatch._model.graph.Graph` gives equals the formula the backends
  computed by hand before (``per_layer = 3 * H + 1``, ``sender = 1 + layer * (H + 1)``, ...),
  the valid-edge mask equals the old string-kind loop, and the stacked writes and gradients
  the old orderings.
* **Names and files.** Node names are what they were; :func:`pipatch._model.graph.named` reads them
  back; a circuit's file written as a plain result (as pipatch wrote them before
  :class:`~pipatch._results.circuit.CircuitResult`) loads as one, drawn the same.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipatch._model.graph import LOGITS_NAME, Graph, Node, graph, named
from pipatch._model.models import Adapter, PipatchError
from pipatch._model.sites import EMBED, HEAD, LOGITS, MLP, MLP_IN, QKV

PACKAGE = Path(__file__).resolve().parents[2] / "pipatch"
ALLOWED = {PACKAGE / "_model" / "graph.py", PACKAGE / "_model" / "sites.py"}

#: The circuit node kinds of the string-typed graph that ``_model/graph.py`` replaced.
KINDS = ("emb", "head_out", "mlp_out", "qkv", "mlp_in", "logits")
_KEY_METHODS = ("get", "index", "count", "pop", "setdefault", "startswith", "endswith")
#: Keys that are an adapter's field names before they are node kinds (``{**fields, "qkv": ...}``).
_ADAPTER_FIELDS = {field.name for field in dataclasses.fields(Adapter)}


def _is_kind(node: ast.AST) -> bool:
    """A node-kind string, or a tuple / list / set literal holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_kind(element) for element in node.elts)
    return False


def _is_kind_key(node: ast.AST) -> bool:
    """A node-kind string used as a key, unless it is an adapter field's name."""
    return _is_kind(node) and not (isinstance(node, ast.Constant) and node.value in _ADAPTER_FIELDS)


def kind_comparisons(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every node-kind string compared or looked up in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_is_kind(side) for side in (node.left, *node.comparators)):
            found.append((node.lineno, "compared"))
        elif isinstance(node, ast.MatchValue) and _is_kind(node.value):
            found.append((node.value.lineno, "matched by case"))
        elif isinstance(node, ast.Dict) and any(key is not None and _is_kind_key(key) for key in node.keys):
            found.append((node.lineno, "a dict key (a kind map)"))
        elif isinstance(node, ast.Subscript) and _is_kind_key(node.slice):
            found.append((node.lineno, "a subscript (a lookup by kind)"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KEY_METHODS
              and node.args and _is_kind_key(node.args[0])):
            found.append((node.lineno, f"the key of .{node.func.attr}()"))
    return found


def test_no_module_but_the_graph_and_the_sites_compares_a_node_kind():
    files = sorted(path for path in PACKAGE.rglob("*.py") if path not in ALLOWED)
    assert PACKAGE / "_experiments" / "circuits.py" in files and PACKAGE / "_results" / "views" / "circuit.py" in files
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: a node kind {what}"
             for path in files for line, what in kind_comparisons(path.read_text(encoding="utf-8"))]
    assert not found, "node kinds are sites (node.site is HEAD), read from pipatch/_model/graph.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    'node.kind == "head_out"',
    '"mlp_in" != receiver.kind',
    'kind in ("emb", "x")',
    'kind not in {"logits"}',
    'MARKERS = {"emb": "s"}',
    'corrupt["emb"]',
    'kinds.get("mlp_in")',
    'names.index("logits")',
    'match kind:\n    case "mlp_out":\n        pass',
])
def test_the_grep_test_sees_each_way_of_comparing_a_kind(source):
    assert kind_comparisons(source), source


@pytest.mark.parametrize("source", [
    'x = "emb"',
    'Param("receivers", "logits", "the direct path")',
    'meta.get("receivers", "logits")',
    'TEMPLATE = """if kind == "emb": pass"""',
    'f(kind="logits")',
    'adapter.qkv_columns(QKV[which], head)',
    'Adapter(**{**fields, "qkv": tuple(fields.get("qkv") or ())})',  # the adapter's field
])
def test_the_grep_test_leaves_what_is_no_comparison(source):
    assert not kind_comparisons(source), source


# --------------------------------------------------------------------------------------------
# The graph against the hand formulas it replaced
# --------------------------------------------------------------------------------------------

SHAPES = [(1, 1, False), (2, 2, False), (3, 4, True), (5, 3, False), (18, 4, False)]


def _old_graph(L: int, H: int, parallel: bool):
    """``pipatch._experiments.circuits.graph`` as it was: names, string kinds, the double loop."""
    senders = [("emb", "emb", -1, None, None)]
    receivers = []
    for layer in range(L):
        senders += [(f"{layer}.{h}", "head_out", layer, h, None) for h in range(H)] + [
            (f"mlp{layer}", "mlp_out", layer, None, None)]
        receivers += [(f"{layer}.{h}.{w}", "qkv", layer, h, w) for h in range(H) for w in QKV] + [
            (f"mlp{layer}", "mlp_in", layer, None, None)]
    receivers.append(("logits", "logits", L, None, None))
    edges = torch.zeros(len(receivers), len(senders), dtype=torch.bool)
    for r, receiver in enumerate(receivers):
        for s, sender in enumerate(senders):
            same_layer_ok = sender[1] == "head_out" and receiver[1] == "mlp_in" and not parallel
            edges[r, s] = sender[2] < receiver[2] or (sender[2] == receiver[2] and same_layer_ok)
    return senders, receivers, edges


_SITE_OF = {"emb": EMBED, "head_out": HEAD, "mlp_out": MLP, "qkv": HEAD, "mlp_in": MLP_IN, "logits": LOGITS}


@pytest.mark.parametrize("L, H, parallel", SHAPES)
def test_the_nodes_and_edges_are_the_old_graphs_with_typed_kinds(L, H, parallel):
    g = graph(SimpleNamespace(n_layers=L, n_heads=H, parallel=parallel))
    senders, receivers, edges = _old_graph(L, H, parallel)
    for mine, (name, kind, layer, head, which) in zip(g.senders + g.receivers, senders + receivers):
        assert mine == Node(name, _SITE_OF[kind], layer, head, which)
    assert (len(g.senders), len(g.receivers)) == (len(senders), len(receivers))
    assert g.valid.dtype == torch.bool and g.valid.equal(edges)


@pytest.mark.parametrize("L, H, parallel", SHAPES)
def test_every_index_is_the_hand_formulas(L, H, parallel):
    g = graph(SimpleNamespace(n_layers=L, n_heads=H, parallel=parallel))
    per_layer = 3 * H + 1  # each head's q, k and v, then the MLP's input
    assert g.receivers_per_layer == per_layer and g.senders_per_layer == H + 1
    assert g.emb == 0 and g.senders[g.emb].site is EMBED
    assert g.logits == L * per_layer == len(g.receivers) - 1 and g.receivers[g.logits].site is LOGITS
    for layer in range(L):
        row, sender = layer * per_layer, 1 + layer * (H + 1)
        assert g.heads(layer) == slice(sender, sender + H)
        assert g.mlp(layer) == sender + H and g.senders[g.mlp(layer)] == Node(f"mlp{layer}", MLP, layer)
        assert g.qkvs(layer) == slice(row, row + 3 * H)
        assert g.mlp_in(layer) == row + 3 * H and g.receivers[g.mlp_in(layer)] == Node(f"mlp{layer}", MLP_IN, layer)
        for head in range(H):
            assert g.head(layer, head) == sender + head and g.senders[sender + head].name == f"{layer}.{head}"
            for i, which in enumerate(QKV):
                assert g.qkv(layer, head, which) == row + 3 * head + i
                assert g.receivers[g.qkv(layer, head, which)] == Node(f"{layer}.{head}.{which}", HEAD, layer, head, which)


@pytest.mark.parametrize("L, H, parallel", SHAPES[:3])
def test_writes_and_gradients_stack_in_the_old_orders(L, H, parallel):
    g = graph(SimpleNamespace(n_layers=L, n_heads=H, parallel=parallel))
    T, d = 3, 5
    rand = torch.Generator().manual_seed(L * 10 + H)
    writes = SimpleNamespace(emb=torch.randn(T, d, generator=rand), heads=torch.randn(L, H, T, d, generator=rand),
                             mlps=torch.randn(L, T, d, generator=rand))
    grads = SimpleNamespace(qkv=torch.randn(L, H, 3, T, d, generator=rand), mlps=torch.randn(L, T, d, generator=rand),
                            logits=torch.randn(T, d, generator=rand))
    # protocols/circuits.py's _writes and _gradients as they were
    old_writes = [writes.emb[None]]
    old_grads = []
    for layer in range(L):
        old_writes += [writes.heads[layer], writes.mlps[layer][None]]
        old_grads += [grads.qkv[layer].flatten(0, 1), grads.mlps[layer][None]]
    assert g.stack_writes(writes).equal(torch.cat(old_writes))
    assert g.stack_gradients(grads).equal(torch.cat(old_grads + [grads.logits[None]]))
    assert g.stack_writes(writes).shape[0] == len(g.senders) and g.stack_gradients(grads).shape[0] == len(g.receivers)


def test_one_graph_per_shape_and_its_kinds_are_sites():
    shape = SimpleNamespace(n_layers=3, n_heads=2, parallel=False)
    g = graph(shape)
    assert graph(SimpleNamespace(**vars(shape))) is g and isinstance(g, Graph)
    assert graph(SimpleNamespace(n_layers=3, n_heads=2, parallel=True)) is not g
    assert {node.site for node in g.senders} == {EMBED, HEAD, MLP}
    assert {node.site for node in g.receivers} == {HEAD, MLP_IN, LOGITS}
    assert all(node.which in QKV for node in g.receivers if node.site is HEAD)
    # The views draw a head's inputs on its head's node, an MLP's input on its MLP's.
    assert [n.drawn_name for n in g.receivers[:4]] == ["0.0", "0.0", "0.0", "0.1"]
    assert g.receivers[g.mlp_in(1)].drawn_name == g.senders[g.mlp(1)].name == "mlp1"
    assert [g.senders[0].drawn, g.senders[1].drawn, g.senders[g.mlp(0)].drawn, g.receivers[-1].drawn] == [
        "emb", "head", "mlp", "logits"]
    assert g.receivers[-1].name == LOGITS_NAME


# --------------------------------------------------------------------------------------------
# Names read back, and a circuit's file
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L, H, parallel", SHAPES)
def test_named_reads_the_names_back_as_the_graphs_nodes(L, H, parallel):
    g = graph(SimpleNamespace(n_layers=L, n_heads=H, parallel=parallel))
    assert named([n.name for n in g.senders], [n.name for n in g.receivers]) == (g.senders, g.receivers)


@pytest.mark.parametrize("senders, receivers", [
    (["emb", "0.0", "mlp0"], ["0.0.q", "0.0.k", "0.0.v", "mlp0"]),  # no logits
    (["emb", "0.1", "mlp0"], ["0.0.q", "0.0.k", "0.0.v", "mlp0", "logits"]),  # a wrong head
    (["emb"], ["logits"]),
    ([], []),
])
def test_names_of_no_graph_are_refused_in_one_line(senders, receivers):
    with pytest.raises(PipatchError) as error:
        named(senders, receivers)
    assert "pipatch.circuit" in str(error.value) and "\n" not in str(error.value)


def test_a_circuit_file_written_as_a_plain_result_loads_as_a_circuit_drawn_the_same(tmp_path):
    """Files from before :class:`CircuitResult` held a plain result of kind ``circuit``: the
    same header and tensors. Read back (safetensors and JSON), each is a circuit again."""
    from pipatch._results.circuit import CircuitResult
    from pipatch._results.result import Result, load_result
    from tests._contract import example_circuit

    circuit = example_circuit()
    assert isinstance(circuit, CircuitResult) and circuit.nodes == named(circuit.columns, circuit.layers)
    plain = Result(**{field.name: getattr(circuit, field.name) for field in dataclasses.fields(Result)})
    assert type(plain) is Result and plain.to_state()["circuit"] == {}  # a plain result draws no graph
    (tmp_path / "old.json").write_text(json.dumps(plain.to_json()))
    for path in (plain.save(tmp_path / "old.safetensors"), tmp_path / "old.json"):
        back = load_result(path)
        assert isinstance(back, CircuitResult), path
        assert back.to_state()["circuit"] == circuit.to_state()["circuit"] and back.graph() == circuit.graph()
        assert back.edges().equals(circuit.edges())


def test_edges_and_graph_are_a_circuits_alone():
    from tests._contract import example_result

    grid = example_result()
    for method, what in ((grid.edges, "edges() is a circuit's table"), (grid.graph, "graph() is a circuit's")):
        with pytest.raises(PipatchError) as error:
            method()
        assert str(error.value).startswith(what) and "attribution result" in str(error.value)
        assert "\n" not in str(error.value)
