"""One row per backend: the same two sweeps on transformers and on vLLM, checked equal first.

Sweeps, on the embedded default (Gemma 3 270M, float32, CPU), as in ``bench/run.py``:

(a) ``resid`` activation patching, every layer × every position, logit difference;
(b) the 10-seed causal trace (``scale="auto"``), P(answer).

Both backends run in this process (the vLLM engine in-process, 1 GiB KV cache). The grids must
agree within 1e-4 before any time is printed. Also reported: the vLLM engine's start-up time and
the resident memory after each load; and the anchor on vLLM, the seed's own recipe
(``shared/seeds/activation_patching_vllm.txt``: a clean trace saving every layer's ``(hidden,
residual)``, then one trace with an invoke per (layer, position)) against pipatch's vLLM backend
on the same resid grid, same engine, checked equal first, with their ratio (target ≤ 0.3).
Figures go to ``bench/results/backends.json``.

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


def seed_recipe(model, clean: list[int], corrupt: list[int], answer: int, foil: int) -> torch.Tensor:
    """The seed's vLLM recipe (``shared/seeds/activation_patching_vllm.txt``) for the whole resid
    grid: one clean trace saving every layer's ``(hidden, residual)``, then one trace with an
    invoke per (layer, position) writing both halves there; the logit difference per cell."""
    layers = model.model.layers
    with model.trace(clean, temperature=0.0, max_tokens=1):
        saved = list().save()
        for layer in layers:
            hidden, residual = layer.output
            saved.append((hidden.clone(), residual.clone()))
    n, T = len(layers), len(clean)
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for i in range(n):
            for pos in range(T):
                with tracer.invoke(corrupt):
                    hidden, residual = model.model.layers[i].output
                    hidden[pos] = saved[i][0][pos]
                    residual[pos] = saved[i][1][pos]
                    patched = model.logits.save()  # one per invoke: nnsight hands back the list
    return torch.stack([logits[0, answer] - logits[0, foil] for logits in patched]).reshape(n, T)


def seed_recipe_vs_pipatch(model, rounds: int = 3) -> dict:
    """The resid grid by the seed recipe and by pipatch's vLLM backend, on one engine in this
    process: checked equal (1e-4) first, then the best of ``rounds`` each, in turn (this
    machine's speed drifts within minutes)."""
    tok = model.tokenizer
    clean, corrupt = tok(CLEAN)["input_ids"], tok(CORRUPT)["input_ids"]
    answer, foil = tok(" Paris", add_special_tokens=False)["input_ids"][0], tok(" Rome", add_special_tokens=False)["input_ids"][0]
    def ours():
        return pipatch.patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome").raw["resid"]

    def theirs():
        return seed_recipe(model, clean, corrupt, answer, foil)

    diff = float((ours().float() - theirs()).abs().max())  # also the warm-up of both
    if not diff <= 1e-4:
        raise SystemExit(f"the seed recipe and pipatch disagree on vLLM (max |Δ| {diff:.3g} > 1e-4); no times shown")
    best = {"recipe": float("inf"), "pipatch": float("inf")}
    for _ in range(rounds):
        best["recipe"] = min(best["recipe"], timed(theirs)[1])
        best["pipatch"] = min(best["pipatch"], timed(ours)[1])
    return {"recipe_s": round(best["recipe"], 2), "pipatch_s": round(best["pipatch"], 2),
            "ratio": round(best["pipatch"] / best["recipe"], 2), "max |Δ|": f"{diff:.1e}"}


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
    recipe = seed_recipe_vs_pipatch(models["vllm"])
    print(f"{'backend':<14}{'load s':>8}{'RSS GB':>8}" + "".join(f"{n:>18}" for n in sweeps) + "   max |Δ| vs transformers")
    for backend, row in rows.items():
        deltas = ", ".join(row.get(f"{n} max |Δ|", "-") for n in sweeps)
        print(f"{backend:<14}{row['load_s']:>8}{row['rss_gb_after_load']:>8}"
              + "".join(f"{row[n]:>17}s" for n in sweeps) + f"   {deltas}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    print(f"vLLM, same engine: the seed recipe {recipe['recipe_s']} s, pipatch {recipe['pipatch_s']} s, "
          f"pipatch ÷ recipe {recipe['ratio']} (target ≤ 0.3; grids agree within {recipe['max |Δ|']})")
    OUT.write_text(json.dumps({"machine": platform.machine(), "threads": torch.get_num_threads(), "rows": rows,
                               "vllm_seed_recipe": recipe},
                              indent=1, ensure_ascii=False))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
