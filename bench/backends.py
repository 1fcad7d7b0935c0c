"""One row per backend: the same two sweeps on transformers and on vLLM, checked equal first.

Sweeps, on the embedded default (Gemma 3 270M, float32, CPU), as in ``bench/run.py``:

(a) ``resid`` activation patching, every layer × every position, logit difference;
(b) the 10-seed causal trace (``scale="auto"``), P(answer).

Both backends run in this process (the vLLM engine in-process, 1 GiB KV cache). The grids must
agree within 1e-4 before any time is printed. Also reported: the vLLM engine's start-up time and
the resident memory after each load. Figures go to ``bench/results/backends.json``.

Run: ``make bench`` (which installs the vLLM venv), or ``.venv-vllm/bin/python bench/backends.py``.
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

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
OUT = Path(__file__).resolve().parent / "results" / "backends.json"


def rss_gb() -> float:
    with open("/proc/self/statm") as handle:
        import os

        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main() -> int:
    rows: dict[str, dict] = {}
    models = {}
    for backend in ("transformers", "vllm"):
        models[backend], seconds = timed(lambda b=backend: pipatch.load_model(device="cpu", backend=b))
        rows[backend] = {"load_s": round(seconds, 1), "rss_gb_after_load": round(rss_gb(), 2)}
    sweeps = {
        "resid grid 18×9": lambda m: pipatch.patch(m, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome"),
        "trace 10 seeds": lambda m: pipatch.trace(m, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=10),
    }
    for name, sweep in sweeps.items():
        results = {}
        for backend, model in models.items():
            sweep(model)  # warm-up
            results[backend], seconds = timed(lambda s=sweep, m=model: s(m))
            rows[backend][name] = round(seconds, 2)
        got, want = results["vllm"], results["transformers"]
        diff = max(float((got.raw[v] - want.raw[v]).abs().max()) for v in want.views)
        if not diff <= 1e-4:
            print(f"{name}: the backends disagree (max |Δ| {diff:.3g} > 1e-4); no times shown", file=sys.stderr)
            return 1
        rows["vllm"][f"{name} max |Δ|"] = f"{diff:.1e}"
    print(f"{'backend':<14}{'load s':>8}{'RSS GB':>8}" + "".join(f"{n:>18}" for n in sweeps) + "   max |Δ| vs transformers")
    for backend, row in rows.items():
        deltas = ", ".join(row.get(f"{n} max |Δ|", "-") for n in sweeps)
        print(f"{backend:<14}{row['load_s']:>8}{row['rss_gb_after_load']:>8}"
              + "".join(f"{row[n]:>17}s" for n in sweeps) + f"   {deltas}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.machine(), "threads": torch.get_num_threads(), "rows": rows},
                              indent=1, ensure_ascii=False))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
