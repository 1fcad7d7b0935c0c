"""Feature patching on the embedded model with the SAE pipatch ships: the screening's cost and
how well it ranks the exact patches.

``pipatch.feature_patch`` screens every latent × position of an SAE by attribution (the clean
and corrupt runs' latents, one backward pass of the corrupt run, the gradient carried through
the SAE's decoder), then patches the top cells exactly. Rows, on "The Eiffel Tower is in the
city of" → " Paris" − " Rome" against "The Colosseum is in the city of", float32 on this
machine's CPU, with :func:`pipatch.embedded_sae` (2,048 latents of block 6's output):

* ``resid attribution``: ``pipatch.attribute(..., site="resid", verify=0)``, the same two runs
  and one backward over the residual stream (the baseline the screening is held to, ≤ 1.5×);
* ``screening``: planning ``feature_patch`` (the runs, the backward, every latent × position
  scored), no exact patch;
* ``exact checks``: running that plan: the top :data:`TOP` cells and the error row at every
  position patched exactly;
* the rank correlation (Spearman) between the screening's estimates and the exact values over
  the top cells (the error row apart: it is patched whatever its estimate).

Each timing is the best of :data:`REPEAT`. Figures go to ``bench/results/features.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/features.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from bench.run import CLEAN, CORRUPT, best, write_report  # noqa: E402
from pipatch._experiments._api import plan  # noqa: E402
from pipatch._experiments.attribution import spearman  # noqa: E402

REPEAT = 3
#: How many screened cells the exact checks patch (the issue's "top 50").
TOP = 50



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "features.json"))
    args = parser.parse_args(argv)
    model = pipatch.load_model(device="cpu")
    sae = pipatch.embedded_sae(model)
    pair = {"clean": CLEAN, "corrupt": CORRUPT, "answer": " Paris", "foil": " Rome"}
    pipatch.attribute(model, **pair, site="resid", verify=0, progress=False)  # warm up
    attribution, _ = best(lambda: pipatch.attribute(model, **pair, site="resid", verify=0, progress=False), REPEAT)
    screening, planned = best(lambda: plan("feature_patch", model, **pair, site=sae, top_k=TOP), REPEAT)
    started = time.perf_counter()
    result = planned.run()
    checks = time.perf_counter() - started
    error_row = len(result.layers) - 1
    top = [e for e in result.meta["verified_values"] if e["layer"] != error_row]
    rho = spearman(torch.tensor([e["estimate"] for e in top]), torch.tensor([e["actual"] for e in top]))
    n_cells = sae.n_latents * len(result.columns)
    report = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "torch_threads": torch.get_num_threads()},
              "sae": sae.sae.name, "latents": sae.n_latents, "positions": len(result.columns), "cells_screened": n_cells,
              "resid_attribution_s": attribution, "screening_s": screening, "screening_x_attribution": screening / attribution,
              "exact_checks_s": checks, "exact_cells": len(result.meta["verified_values"]), "top_cells": len(top),
              "spearman_top": rho}
    lines = [f"feature patching, {sae.sae.name} ({sae.n_latents} latents × {len(result.columns)} positions = "
             f"{n_cells:,} cells), {torch.get_num_threads()} thread(s):",
             f"  resid attribution (2 runs + 1 backward)  {attribution:6.2f} s",
             f"  screening every latent × position        {screening:6.2f} s = {screening / attribution:4.2f}× (goal ≤ 1.5×)",
             f"  exact checks (top {len(top)} cells + the error row at each position)  {checks:6.2f} s",
             f"  screening vs exact over the top {len(top)}, rank correlation  {rho:6.3f}"]
    return write_report(lines, report, args.out)


if __name__ == "__main__":
    sys.exit(main())
