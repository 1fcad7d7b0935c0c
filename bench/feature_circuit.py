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
* each row's peak resident memory (the model and the SAEs included).

Each time is the best of :data:`REPEAT`. Figures go to ``bench/results/feature_circuit.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/feature_circuit.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from bench.run import CLEAN, CORRUPT, Peak, write_report  # noqa: E402
from pipatch._protocols.attribution import spearman  # noqa: E402

REPEAT = 2
TOP = 20


def random_sae(folder: Path, like) -> Path:
    """A random SAE of ``like``'s shape reading block 5's output, in Gemma Scope 2's format."""
    from safetensors.torch import save_file

    folder.mkdir()
    d, n = like.sae.W_enc.shape
    g = torch.Generator().manual_seed(0)
    save_file({"w_enc": torch.randn(d, n, generator=g) / d ** 0.5, "w_dec": torch.randn(n, d, generator=g) / n ** 0.5,
               "b_enc": torch.zeros(n), "b_dec": torch.zeros(d), "threshold": torch.full((n,), 0.5)},
              str(folder / "params.safetensors"))
    (folder / "config.json").write_text('{"architecture": "jump_relu", "hf_hook_point_in": "model.layers.5.output"}')
    return folder


def measured(fn):
    """(best seconds, peak resident bytes, the last result) over :data:`REPEAT` runs."""
    seconds, peak, out = float("inf"), 0, None
    for _ in range(REPEAT):
        with Peak() as p:
            out = fn()
        seconds, peak = min(seconds, p.seconds), max(peak, p.peak)
    return seconds, peak, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "feature_circuit.json"))
    args = parser.parse_args(argv)
    model = pipatch.load_model(device="cpu")
    trained = pipatch.embedded_sae(model)
    with tempfile.TemporaryDirectory() as tmp:
        saes = [pipatch.load_sae(random_sae(Path(tmp) / "random-l5", trained), model), trained]
        pair = {"clean": CLEAN, "corrupt": CORRUPT, "answer": " Paris", "foil": " Rome", "saes": saes,
                "progress": False}
        scored, scored_peak, graph = measured(lambda: pipatch.feature_circuit(model, **pair, verify=0))
        nodes = graph.nodes()
        n_nodes = int((nodes["latent"] != "metric").sum())
        exact_s, exact_peak, checked = measured(lambda: pipatch.feature_circuit(model, **pair, verify=n_nodes))
    table = checked.nodes()
    table = table[table["latent"] != "metric"].dropna(subset=["exact"])
    rho_all = spearman(torch.tensor(table["score"].to_list()), torch.tensor(table["exact"].to_list()))
    top = table.reindex(table["score"].abs().sort_values(ascending=False).index)[:TOP]
    rho_top = spearman(torch.tensor(top["score"].to_list()), torch.tensor(top["exact"].to_list()))
    n_edges = len(graph.edges())
    gb = 1 / 2 ** 30
    report = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "torch_threads": torch.get_num_threads()},
              "saes": [s.sae.name for s in saes], "positions": len(graph.columns), "nodes": n_nodes,
              "edges_kept": n_edges, "scoring_s": scored, "scoring_peak_gb": scored_peak * gb,
              "exact_every_node_s": exact_s, "exact_peak_gb": exact_peak * gb, "nodes_checked": len(table),
              "spearman_all": rho_all, f"spearman_top{TOP}": rho_top}
    lines = [f"feature circuit, SAEs at blocks 5 (random) and 6 (trained), {len(graph.columns)} positions, "
             f"{n_nodes} nodes, {n_edges} edges kept, {torch.get_num_threads()} thread(s):",
             f"  scoring every node and edge       {scored:6.2f} s   peak {scored_peak * gb:5.2f} GB",
             f"  exact patch of every node ({len(table)})  {exact_s:6.2f} s   peak {exact_peak * gb:5.2f} GB",
             f"  scores vs exact, rank correlation: every node {rho_all:5.3f}, top {TOP} {rho_top:5.3f}"]
    return write_report(lines, report, args.out)


if __name__ == "__main__":
    sys.exit(main())
