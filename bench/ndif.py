"""The resid grid through nnsight's simulation of NDIF: requests per grid and bytes per request.

On the embedded default (Gemma 3 270M, float32, CPU), ``resid`` activation patching, every
layer × every position, logit difference, as in ``bench/run.py``: once on the transformers
backend in this process, once with ``load_model(remote="local")``, whose every request is
serialised as for NDIF, rebuilt with this machine's modules hidden, and run here
(:mod:`pipatch._backends.ndif`). The grids must agree within 1e-4 before anything is printed.
The time is the simulation's (serialising and rebuilding each request, on this CPU), not a
service's; the requests and their bytes are what NDIF would be sent. Figures go to
``bench/results/ndif.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/ndif.py``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
OUT = Path(__file__).resolve().parent / "results" / "ndif.json"


def grid(model):
    return pipatch.patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome")


def main() -> int:
    local, simulated = pipatch.load_model(), pipatch.load_model(remote="local")
    backend = backend_for(simulated)
    backend.count_bytes = True
    grid(local), grid(simulated)  # warm-up
    rows = {}
    for name, model in (("transformers", local), ("ndif (simulated)", simulated)):
        before, sent = backend.requests, backend.bytes_sent
        started = time.perf_counter()
        result = grid(model)
        rows[name] = {"s": round(time.perf_counter() - started, 2), "result": result,
                      "requests": backend.requests - before, "bytes": backend.bytes_sent - sent}
    want, got = rows["transformers"]["result"], rows["ndif (simulated)"]["result"]
    diff = float((got.raw["resid"] - want.raw["resid"]).abs().max())
    if not diff <= 1e-4:
        print(f"the simulated NDIF grid differs (max |Δ| {diff:.3g} > 1e-4); nothing shown", file=sys.stderr)
        return 1
    sim = rows["ndif (simulated)"]
    per = sim["bytes"] / sim["requests"]
    print(f"resid grid 18×9: transformers {rows['transformers']['s']} s in process; NDIF simulated {sim['s']} s, "
          f"{sim['requests']} requests per grid (the baselines and one per batch), {per / 1024:.0f} KB per request "
          f"(max |Δ| {diff:.1e})")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.machine(), "threads": torch.get_num_threads(),
                               "transformers_s": rows["transformers"]["s"], "ndif_simulated_s": sim["s"],
                               "requests_per_grid": sim["requests"], "bytes_per_request": round(per),
                               "max_abs_diff": diff}, indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
