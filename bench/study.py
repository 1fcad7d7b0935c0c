"""A study's throughput: facts per minute, and its time over the sum of the same traces run alone.

An N-fact, 3-kind (resid, mlp, attn) causal-trace study of known facts from ROME's
``known_1000.json`` on the embedded default (float32, CPU; ``--backend`` transformers, the
default, vllm or served: a ``pipatch serve`` started here), into a fresh SQLite store, against
``pipatch.trace`` on each of those facts one by one. The study must cost no more than its facts
(ratio ≤ 1.0): it runs each fact through the same planner and engine, reads the known-fact
check off the planner's own clean run (no extra forward), and adds one committed transaction
per fact (milliseconds). In process on transformers it runs four facts as one (the backend's
``plans_together``), their cells in packed traces together and their metrics in one pass over
the unembedding; on the served backend
four at once (``plans_in_flight``), whose requests the server batches: there it costs less
than its facts. Both sides run :data:`REPEAT` times, in turns
that swap, the best of each counting (this machine's speed drifts by a third within minutes,
and more while another process shares its two cores). The stored grids are checked equal to the
single traces' (to the last bit, or within float32 rounding where the metric's pass is shared) before any time is shown. Figures go to
``bench/results/study.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/study.py [--facts N] [--seeds S]``;
``.venv-vllm/bin/python bench/study.py --backend served``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
import pipatch._backends  # noqa: E402
import pipatch._backends._contract  # noqa: E402

KNOWN_1000 = pipatch.known_facts()
REPEAT = 2
OUT = Path(__file__).resolve().parent / "results" / "study.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--facts", type=int, default=100, help="known facts in the study (default 100)")
    parser.add_argument("--repeat", type=int, default=REPEAT, help=f"runs of each side, the best counting (default {REPEAT})")
    parser.add_argument("--seeds", type=int, default=3, help="noise seeds per fact (default 3)")
    parser.add_argument("--facts-file", default=str(KNOWN_1000))
    parser.add_argument("--backend", default="transformers", choices=("transformers", "vllm", "served"),
                        help="where the model runs (vllm and served need the vLLM venv: make install-vllm)")
    parser.add_argument("--out", default=None, help="default: bench/results/study[-BACKEND].json")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.facts_file).read_text())
    options = {"sites": "resid,mlp,attn", "seeds": args.seeds, "scale": 3.0}
    out = Path(args.out) if args.out else OUT.with_name(
        "study.json" if args.backend == "transformers" else f"study-{args.backend}.json")
    with _model(args.backend) as model:
        return _measure(model, _known(model, data, args.facts), options, args, out)


def _known(model, data: list[dict], n: int) -> list[dict]:
    """The first ``n`` facts of ``data`` the model knows (ROME's rule, :func:`pipatch._studies.known_fact`:
    one forward each, not timed)."""
    from pipatch._studies import known_fact

    backend = pipatch._backends.backend_for(model)
    out = []
    for fact in data:
        if known_fact(backend, fact["prompt"], " " + fact["attribute"])[0]:
            out.append(fact)
            if len(out) == n:
                break
    return out


@contextlib.contextmanager
def _model(backend: str):
    """The embedded model on ``backend``; a served one from a ``pipatch serve`` started here."""
    if backend != "served":
        yield pipatch.load_model(backend=backend)
        return
    from pipatch._serving.serve import Spawned

    server = Spawned(env={"PIPATCH_API_KEY": "bench"})
    try:
        yield pipatch.load_model(serve=server.url, api_key="bench")
    finally:
        server.stop()
        server.kill()


def _measure(model, facts: list[dict], options: dict, args: argparse.Namespace, out: Path) -> int:
    backend = pipatch._backends.backend_for(model)
    capabilities = backend.capabilities
    in_flight, together = max(capabilities.plans_in_flight, capabilities.plans_together), capabilities.plans_together
    torch.set_grad_enabled(False)
    pipatch.trace(model, facts[0]["prompt"], subject=facts[0]["subject"], answer=" " + facts[0]["attribute"],
                  **options)  # warm-up: first-call costs belong to neither side

    best_study, best_single = float("inf"), float("inf")
    for repeat in range(args.repeat):
        # Each repeat runs both sides, in turns that swap (the machine's speed drifts): the
        # better time of each side counts.
        for side in ("singles", "study") if repeat % 2 == 0 else ("study", "singles"):
            if side == "singles":
                started = time.perf_counter()
                singles = [pipatch.trace(model, f["prompt"], subject=f["subject"], answer=" " + f["attribute"],
                                         **options) for f in facts]
                best_single = min(best_single, time.perf_counter() - started)
                continue
            with tempfile.TemporaryDirectory() as folder:
                started = time.perf_counter()
                study = pipatch.study(model, facts, store=Path(folder) / "bench.sqlite", **options)
                best_study = min(best_study, time.perf_counter() - started)
                assert study.counts()["done"] == len(facts), study.summary()
                stored = [study[i] for i in range(len(facts))]
        for single, mine in zip(singles, stored):  # the same grids before any time counts: to the last
            for view in single.views:  # bit one by one; facts run as one share the metric's pass (float32 rounding)
                same = torch.equal(mine.raw[view], single.raw[view]) if together == 1 else torch.allclose(
                    mine.raw[view], single.raw[view], atol=2e-5, rtol=0, equal_nan=True)
                assert same, view
        print(f"repeat {repeat + 1}: study {best_study:.1f} s, singles {best_single:.1f} s (best so far)", flush=True)

    ratio = best_study / best_single
    row = {"facts": len(facts), "kinds": 3, "seeds": args.seeds, "backend": args.backend, "in_flight": in_flight,
           "study_s": round(best_study, 2), "singles_s": round(best_single, 2),
           "facts_per_minute": round(60 * len(facts) / best_study, 2), "ratio": round(ratio, 3),
           "machine": platform.processor() or platform.machine()}
    print(f"{args.backend}: study of {len(facts)} facts × 3 kinds × {args.seeds} seeds ({in_flight} in flight): "
          f"{row['facts_per_minute']} facts/min "
          f"({best_study:.1f} s); the same traces one by one {best_single:.1f} s; ratio {ratio:.3f} "
          f"({'≤' if ratio <= 1.0 else '>'} 1.0)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return 0 if ratio <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
