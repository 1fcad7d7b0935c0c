"""The IOI circuit on the embedded model: EAP-IG against exact patching of every edge.

On the embedded default (Gemma 3 270M, float32, CPU), a 32-pair IOI dataset
(``pipatch.tasks.ioi(32, seed=0)``, name-flip corruptions, logit difference IO − S):

1. ``pipatch.circuit(..., method="eap-ig", steps=5, verify=0)``: every edge's score (5
   gradient passes per pair);
2. the same with ``verify=50``: the 50 edges with the largest |score| patched exactly (two
   runs per edge and pair), which gives the cost of one exact edge patch over the dataset and
   the rank correlation (Spearman) between estimate and exact over those 50.

3. the faithfulness curve (``curve=16``): the top-n edges kept, every other edge given its
   corrupt value, normalized recovery as n grows, and the smallest circuit reaching 80 %.

4. mean ablation (``ablation="mean"``) against corrupt ablation on a one-template IOI set
   (``pipatch.tasks.ioi(16, seed=0, template=0)``, every prompt one length): the same scores,
   the curve with every other edge given its mean over the dataset's prompts, position by
   position, instead of its corrupt value.

Exact patching of *every* edge is the per-edge cost times the number of edges (measured on
the 50, extrapolated to all: running all of them would take hours on this CPU). Also printed:
the top heads (sum of |score| over their outgoing edges) and peak resident memory. Figures go
to ``bench/results/circuit.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/circuit.py [--pairs N]``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import pipatch
from pipatch._base.known import known
from pipatch._experiments._api import planner

plan_circuit = planner("circuit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--verify", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mean-pairs", type=int, default=16, help="pairs of the mean-ablation comparison (0: skip)")
    args = parser.parse_args()

    model = pipatch.load_model()
    task = pipatch.tasks.ioi(args.pairs, seed=0, tokenizer=model.tokenizer)
    # Planning scores every edge (the gradient passes); running measures the curve, or the
    # exact patches: each timed on its own.
    start = time.perf_counter()
    plan = plan_circuit(model, **task, method="eap-ig", steps=args.steps, verify=0, curve=16)
    t_scores = time.perf_counter() - start
    start = time.perf_counter()
    scored = plan.run()
    t_curve = time.perf_counter() - start
    faithful = scored.meta["faithfulness"]
    plan = plan_circuit(model, **task, method="eap-ig", steps=args.steps, verify=args.verify, curve=0)
    start = time.perf_counter()
    checked = plan.run()
    t_checked = time.perf_counter() - start
    edges = scored.edges()
    ours = edges.set_index(["sender", "receiver"])["score"]
    again = checked.edges().set_index(["sender", "receiver"])["score"].reindex(ours.index)
    assert float((ours - again).abs().max()) < 1e-6, "the two runs' scores differ"
    per_edge = t_checked / max(args.verify, 1)
    n_edges = len(edges)
    agreement = checked.meta["agreement"]
    heads = edges[edges["sender"].str.fullmatch(r"\d+\.\d+")]
    top_heads = heads.assign(size=heads["score"].abs()).groupby("sender")["size"].sum().sort_values(ascending=False)
    to_logits = heads[heads["receiver"] == "logits"].set_index("sender")["score"]
    ablations = {}
    if args.mean_pairs:
        one = pipatch.tasks.ioi(args.mean_pairs, seed=0, tokenizer=model.tokenizer, template=0)
        for ablation in ("corrupt", "mean"):
            start = time.perf_counter()
            run = plan_circuit(model, **one, method="eap-ig", steps=args.steps, verify=0, curve=12,
                               ablation=ablation).run()
            ablations[ablation] = {**run.meta["faithfulness"], "seconds": time.perf_counter() - start}
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    figures = {
        "pairs": args.pairs, "steps": args.steps, "edges": n_edges,
        "clean_logit_diff": checked.clean, "corrupt_logit_diff": checked.corrupt,
        "eap_ig_s": t_scores, "exact_per_edge_s": per_edge, "exact_all_edges_s": per_edge * n_edges,
        "spearman_top": agreement["spearman"], "checked": agreement["n"],
        "top_heads": {h: round(float(v), 3) for h, v in top_heads.head(8).items()},
        "top_heads_to_logits": {h: round(float(to_logits[h]), 3) for h in top_heads.head(8).index if h in to_logits},
        "faithfulness": faithful, "curve_s": t_curve, "one_template_ablations": ablations,
        "peak_rss_gb": peak_gb,
    }
    print(f"IOI circuit, {known(model).name or 'embedded'}: "
          f"{args.pairs} pairs, {n_edges} edges; logit diff clean {checked.clean:.2f}, corrupt "
          f"{checked.corrupt:.2f}")
    print(f"  EAP-IG (steps={args.steps}), every edge: {t_scores:7.1f} s")
    print(f"  exact patching, one edge over the dataset: {per_edge:7.2f} s (measured on {args.verify})")
    print(f"  exact patching of every edge (extrapolated): {per_edge * n_edges:9.0f} s "
          f"= {per_edge * n_edges / max(t_scores, 1e-9):.0f}x EAP-IG")
    print(f"  Spearman(EAP-IG, exact) over the top {agreement['n']} edges: {agreement['spearman']:.3f}")
    print("  top heads (sum |score| of their edges; score into the logits): "
          + ", ".join(f"{h} {v:.1f} ({float(to_logits.get(h, float('nan'))):+.1f})" for h, v in top_heads.head(6).items()))
    curve = ", ".join(f"{n}: {v:.2f}" for n, v in zip(faithful["sizes"], faithful["recovery"]))
    print(f"  faithfulness (top-n edges kept, the rest corrupt; normalized recovery): {curve}")
    print(f"  smallest circuit reaching {faithful['share']:.0%}: {faithful['size']} of {faithful['edges']} edges "
          f"(curve: {t_curve:.1f} s)")
    for ablation, f in ablations.items():
        points = ", ".join(f"{n}: {v:.2f}" for n, v in zip(f["sizes"], f["recovery"]))
        print(f"  one template ({args.mean_pairs} pairs), the rest {ablation}-ablated: {points}; reaching "
              f"{f['share']:.0%}: {f['size']} edges ({f['seconds']:.0f} s with the scores)")
    print(f"  peak resident memory: {peak_gb:.2f} GB")
    out = Path(__file__).parent / "results" / "circuit.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(figures, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
