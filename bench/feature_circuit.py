"""A feature circuit on the embedded model: scoring the graph against exact ablation of every
node, and the peak memory of each.

``pipatch.feature_circuit`` scores every node (each active latent of each SAE at each position,
one error node per SAE and position) by attribution patching: the clean and corrupt runs' latents
and one backward pass of the corrupt run, the gradient carried through each SAE's decoder; edges
between the SAEs of consecutive layers by one pull-back per downstream node. The alternative it
replaces is an exact patch per node. Rows, on "The Eiffel Tower is in the city of" → " Paris" −
" Rome" against "The Colosseum is in the city of", float32 on this machine's CPU:

* ``scoring``: ``feature_circuit(..., verify=0)`` with :func:`pipatch.embedded_sae` (block 6's
  output, 2,048 latents) and a random SAE of the same shape at block 5 (so the graph has edges);
* ``exact, every node``: ``verify=`` every node: each patched exactly;
* the rank correlation (Spearman) between the scores and the exact values over every node and
  over the top 20;
* ``exact, every kept edge``: ``verify_edges=`` every kept edge, each patched alone (two runs
  an edge), and their rank correlation with the edge scores;
* ``faithfulness curve``: ``curve=8`` (Marks et al.'s faithfulness and completeness, corrupt
  ablation), with the faithfulness at the circuit's size and the least size measured that
  reaches 80 %;
* ``an SAE at every layer``: a random SAE of the shipped one's shape at each of the 18 blocks'
  outputs, on a pair of 64-token prompts (filler before the Eiffel Tower / Colosseum pair):
  scoring (``top_nodes=30``, edges between kept nodes, 10 nodes checked): does it fit, and
  what it costs;
* ``16 IOI pairs``: ``pipatch.tasks.ioi(16, seed=0)`` through the shipped SAE alone, a
  dataset averaged over named positions: scoring (nodes and the edges between kept nodes);
  then one run with every averaged node checked exactly (in each pair, that node at every
  token of its named position patched at once) and the curve (``curve=8``): the checks' and
  the curve's own times, the rank correlation over every node, the top 20 and the top 20
  latents (no error or embedding node), the faithfulness at the circuit's size and the nodes
  it takes to reach 80 %; and the top 20 scored by integrated gradients (``steps=4``) against
  the same exact values (one run each: the exact checks take minutes);
* each row's peak resident memory (the model and the SAEs included).

``--only pair`` runs the pair's rows and the every-layer row, ``--only ioi`` the IOI rows. Each time but the IOI rows' is the best of
:data:`REPEAT`. Figures go to ``bench/results/feature_circuit.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/feature_circuit.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from bench.run import CLEAN, CORRUPT, Peak, write_report  # noqa: E402
from pipatch._experiments.attribution import spearman  # noqa: E402

REPEAT = 2
TOP = 20


def random_sae(folder: Path, like, layer: int = 5) -> Path:
    """A random SAE of ``like``'s shape reading block ``layer``'s output, in Gemma Scope 2's format."""
    from safetensors.torch import save_file

    folder.mkdir()
    d, n = like.sae.W_enc.shape
    g = torch.Generator().manual_seed(0)
    save_file({"w_enc": torch.randn(d, n, generator=g) / d ** 0.5, "w_dec": torch.randn(n, d, generator=g) / n ** 0.5,
               "b_enc": torch.zeros(n), "b_dec": torch.zeros(d), "threshold": torch.full((n,), 0.5)},
              str(folder / "params.safetensors"))
    config = {"architecture": "jump_relu", "hf_hook_point_in": f"model.layers.{layer}.output"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def every_layer(model, trained, tmp: Path) -> tuple[float, int, object]:
    """The graph with a random SAE at every block's output on a 64-token pair (best of
    :data:`REPEAT`): seconds, peak resident bytes, the result."""
    saes = [pipatch.load_sae(random_sae(tmp / f"every-l{layer}", trained, layer), model)
            for layer in range(len(model._module.model.layers))]
    filler = "It was a bright cold day in April, and the clocks were striking thirteen. "
    clean, corrupt = CLEAN, CORRUPT
    while len(model.tokenizer(clean).input_ids) < 64:
        clean, corrupt = filler + clean, filler + corrupt
    return measured(lambda: pipatch.feature_circuit(model, clean=clean, corrupt=corrupt, answer=" Paris", foil=" Rome",
                                                    saes=saes, verify=10, verify_edges=0, curve=0, progress=False))


def ioi_rows(model, trained) -> tuple[dict, list[str]]:
    """The 16-pair IOI dataset's rows: its report entry and printed lines."""
    task = pipatch.tasks.ioi(16, seed=0, tokenizer=model.tokenizer)
    run = {**task, "saes": [trained], "verify_edges": 0, "progress": False}
    with Peak() as scoring:
        graph = pipatch.feature_circuit(model, **run, verify=0, curve=0)
    n_nodes = len(graph.meta["nodes"]) - 1
    with Peak() as exact:
        checked = pipatch.feature_circuit(model, **run, verify=n_nodes, curve=8)
    table = checked.nodes().iloc[1:]
    top = table[:TOP]  # largest |score| first
    rho_all = spearman(torch.tensor(table["score"].to_list()), torch.tensor(table["exact"].to_list()))
    rho_top = spearman(torch.tensor(top["score"].to_list()), torch.tensor(top["exact"].to_list()))
    latents = table[~table["latent"].isin(["error", "embed"])][:TOP]
    rho_latents = spearman(torch.tensor(latents["score"].to_list()), torch.tensor(latents["exact"].to_list()))
    exact_of = dict(zip(table["node"], table["exact"]))
    with Peak() as ig_run:
        ig = pipatch.feature_circuit(model, **run, steps=4, verify=0, curve=0, top_edges=0).nodes().iloc[1:TOP + 1]
    rho_ig = spearman(torch.tensor(ig["score"].to_list()), torch.tensor([exact_of[n] for n in ig["node"]]))
    curve = checked.faithfulness()
    kept = int((table["circuit"] & (table["latent"] != "embed")).sum())
    at_circuit = float(curve[curve["n_nodes"] == kept]["faithfulness"].iloc[0])
    reach = checked.meta["curve"]["nodes_for_80"]
    stages = checked.meta["elapsed_stages"]
    gb = 1 / 2 ** 30
    report = {"pairs": 16, "positions": graph.columns, "nodes": n_nodes, "edges_kept": len(graph.edges()),
              "scoring_s": scoring.seconds, "scoring_peak_gb": scoring.peak * gb, "nodes_checked": int(
                  table["exact"].notna().sum()), "exact_every_node_s": stages["checks"], "curve_s": stages["curve"],
              "checked_peak_gb": exact.peak * gb, "spearman_all": rho_all, f"spearman_top{TOP}": rho_top,
              f"spearman_top{TOP}_latents": rho_latents, "ig_steps4_scoring_s": ig_run.seconds,
              f"ig_steps4_spearman_top{TOP}": rho_ig, "curve_sizes": curve["n_nodes"].to_list(), "faithfulness": curve["faithfulness"].to_list(),
              "completeness": curve["completeness"].to_list(), "faithfulness_at_circuit": at_circuit,
              "circuit_nodes": kept, "nodes_for_80": reach}
    lines = [f"16 IOI pairs, the shipped SAE at block 6, {len(graph.columns)} named positions, {n_nodes} averaged "
             f"nodes, {len(graph.edges())} edges kept:",
             f"  scoring every node and edge       {scoring.seconds:6.2f} s   peak {scoring.peak * gb:5.2f} GB",
             f"  exact patch of every node ({report['nodes_checked']}, each in every pair)  {stages['checks']:6.2f} s   "
             f"peak {exact.peak * gb:5.2f} GB",
             f"  scores vs exact, rank correlation: every node {rho_all:5.3f}, top {TOP} {rho_top:5.3f}, "
             f"top {TOP} latents {rho_latents:5.3f}",
             f"  integrated gradients (steps=4)    {ig_run.seconds:6.2f} s   top {TOP} vs exact {rho_ig:5.3f}",
             f"  faithfulness curve ({len(curve)} sizes)      {stages['curve']:6.2f} s"
             f"   {at_circuit:5.3f} at the circuit's {kept} nodes, 80 % at {reach} nodes"]
    return report, lines


def measured(fn):
    """(best seconds, peak resident bytes, the last result) over :data:`REPEAT` runs."""
    seconds, peak, out = float("inf"), 0, None
    for _ in range(REPEAT):
        with Peak() as p:
            out = fn()
        seconds, peak = min(seconds, p.seconds), max(peak, p.peak)
    return seconds, peak, out


def pair_rows(model, trained) -> tuple[dict, list[str]]:
    """The Eiffel Tower / Colosseum pair's rows and the every-layer row: the report's entries
    and printed lines."""
    with tempfile.TemporaryDirectory() as tmp:
        saes = [pipatch.load_sae(random_sae(Path(tmp) / "random-l5", trained), model), trained]
        pair = {"clean": CLEAN, "corrupt": CORRUPT, "answer": " Paris", "foil": " Rome", "saes": saes,
                "progress": False}
        none = {"verify": 0, "verify_edges": 0, "curve": 0}
        scored, scored_peak, graph = measured(lambda: pipatch.feature_circuit(model, **pair, **none))
        nodes = graph.nodes()
        n_nodes = int((nodes["latent"] != "metric").sum())
        n_edges = len(graph.edges())
        exact_s, exact_peak, checked = measured(
            lambda: pipatch.feature_circuit(model, **pair, **{**none, "verify": n_nodes}))
        edges_s, edges_peak, edged = measured(
            lambda: pipatch.feature_circuit(model, **pair, **{**none, "verify_edges": n_edges}))
        curve_s, curve_peak, curved = measured(lambda: pipatch.feature_circuit(model, **pair, **{**none, "curve": 8}))
        every_s, every_peak, everywhere = every_layer(model, trained, Path(tmp))
    table = checked.nodes()
    table = table[table["latent"] != "metric"].dropna(subset=["exact"])
    rho_all = spearman(torch.tensor(table["score"].to_list()), torch.tensor(table["exact"].to_list()))
    top = table.reindex(table["score"].abs().sort_values(ascending=False).index)[:TOP]
    rho_top = spearman(torch.tensor(top["score"].to_list()), torch.tensor(top["exact"].to_list()))
    rho_edges = edged.meta["edge_agreement"]["spearman"]
    curve = curved.faithfulness()
    # The circuit's size as the curve counts it: SAE nodes kept (the metric's and the
    # embeddings' nodes stay in every circuit).
    kept = int((nodes["circuit"] & ~nodes["latent"].isin(["metric", "embed"])).sum())
    at_circuit = float(curve[curve["n_nodes"] == kept]["faithfulness"].iloc[0])
    reach = curved.meta["curve"]["nodes_for_80"]
    gb = 1 / 2 ** 30
    report = {"saes": [s.sae.name for s in saes], "positions": len(graph.columns), "nodes": n_nodes,
              "edges_kept": n_edges, "scoring_s": scored, "scoring_peak_gb": scored_peak * gb,
              "exact_every_node_s": exact_s, "exact_peak_gb": exact_peak * gb, "nodes_checked": len(table),
              "spearman_all": rho_all, f"spearman_top{TOP}": rho_top, "exact_every_edge_s": edges_s,
              "exact_edges_peak_gb": edges_peak * gb, "spearman_edges": rho_edges, "curve_s": curve_s,
              "curve_peak_gb": curve_peak * gb, "curve_sizes": curve["n_nodes"].to_list(),
              "faithfulness": curve["faithfulness"].to_list(), "completeness": curve["completeness"].to_list(),
              "faithfulness_at_circuit": at_circuit, "circuit_nodes": kept, "nodes_for_80": reach,
              "every_layer": {"saes": len(everywhere.layers), "positions": len(everywhere.columns),
                              "nodes": int((everywhere.nodes()["latent"] != "metric").sum()),
                              "edges_kept": len(everywhere.edges()), "seconds": every_s, "peak_gb": every_peak * gb}}
    lines = [f"feature circuit, SAEs at blocks 5 (random) and 6 (trained), {len(graph.columns)} positions, "
             f"{n_nodes} nodes, {n_edges} edges kept, {torch.get_num_threads()} thread(s):",
             f"  scoring every node and edge       {scored:6.2f} s   peak {scored_peak * gb:5.2f} GB",
             f"  exact patch of every node ({len(table)})  {exact_s:6.2f} s   peak {exact_peak * gb:5.2f} GB",
             f"  scores vs exact, rank correlation: every node {rho_all:5.3f}, top {TOP} {rho_top:5.3f}",
             f"  exact patch of every kept edge ({n_edges})  {edges_s:6.2f} s   peak {edges_peak * gb:5.2f} GB"
             f"   rank correlation {rho_edges:5.3f}",
             f"  faithfulness curve ({len(curve)} sizes)      {curve_s:6.2f} s   peak {curve_peak * gb:5.2f} GB"
             f"   {at_circuit:5.3f} at the circuit's {kept} nodes, 80 % at {reach} nodes",
             f"  an SAE at every layer ({len(everywhere.layers)}), {len(everywhere.columns)} positions: "
             f"{report['every_layer']['nodes']} nodes, scored with edges and 10 checks in {every_s:6.2f} s, "
             f"peak {every_peak * gb:5.2f} GB"]
    return report, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "feature_circuit.json"))
    parser.add_argument("--only", choices=["pair", "ioi"], help="run the pair's rows (and the every-layer row) or "
                        "the IOI rows alone")
    args = parser.parse_args(argv)
    model = pipatch.load_model(device="cpu")
    trained = pipatch.embedded_sae(model)
    report: dict = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                                "torch_threads": torch.get_num_threads()}}
    lines: list[str] = []
    if args.only != "ioi":
        pair_report, pair_lines = pair_rows(model, trained)
        report.update(pair_report)
        lines += pair_lines
    if args.only != "pair":
        report["ioi"], ioi_lines = ioi_rows(model, trained)
        lines += ioi_lines
    return write_report(lines, report, args.out)


if __name__ == "__main__":
    sys.exit(main())
