"""Side-by-side benchmark: the same sweeps by four methods, checked equal before any time is shown.

Sweeps, on the embedded default (Gemma 3 270M, float32, CPU):

(a) ``resid`` activation patching, every layer × every position: clean "The Eiffel Tower is in
    the city of", corrupt "The Colosseum is in the city of", logit difference " Paris" − " Rome".
(b) the causal trace of the core engine issue: subject "Eiffel Tower", answer " Paris",
    10 noise seeds at the scale pipatch's ``scale="auto"`` picks, P(answer).

Methods:

1. ``hooks``  — one forward per cell with PyTorch forward hooks (the primer's loop);
2. ``nnsight`` — the plain nnsight recipe: one trace per position (and seed), one invoke per layer;
3. ``floor``  — one plain batched forward of all the cells' corrupted inputs, no interventions,
   logits at the last position only (what any method that runs every cell must at least pay);
4. ``pipatch``.

Methods 1, 2 and 4 must give the same grid within 1e-4 (checked before printing any time).
pipatch and the floor of (a) and (b) are timed :data:`REPEAT` times in turn, the best of each
counting (this machine's speed drifts; the least disturbed run says what a method costs); the
others once.
Also reported: pipatch's time to its first finished row after the baselines, peak resident
memory per method, a ``head`` sweep on a 128-token prompt against the memory target, and
scaling tables (prompt length 8/32/128; seeds 1/3/10). Each sweep also reports its FLOP
limit (:mod:`bench.flops`): the matmul FLOPs it needs, full runs and only what each patch can
change, that limit in seconds at this machine's measured matmul peak, and pipatch's time as a
multiple of it. Figures are written to ``bench/results/bench.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/run.py [--quick]``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from bench.flops import Sizes, matmul_peak, sweep_flops  # noqa: E402
from pipatch._experiments._api import plan_patch, plan_trace  # noqa: E402
from pipatch._experiments.tracing import noise_draws  # noqa: E402

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class Peak:
    """Samples resident memory every 5 ms while a block runs; ``peak`` is the maximum seen."""

    def __enter__(self):
        self.start, self.peak, self._stop = rss(), rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        return False


# pipatch and the floor of the two headline sweeps run this many times, and the best time
# counts: this machine's speed drifts by a third within minutes (other machines share its
# cores), and the least disturbed run is the one that says what the method costs.
REPEAT = 3


def timed(fn, *args, **kwargs):
    with Peak() as p:
        out = fn(*args, **kwargs)
    return out, p.seconds, p.peak


# ---------------------------------------------------------------------------------------------
# Methods for sweep (a): activation patching of the residual stream
# ---------------------------------------------------------------------------------------------


def patch_hooks(model, clean_ids, corrupt_ids, answer, foil):
    hf, layers = model._module, model._module.model.layers
    cache = {}
    handles = [layer.register_forward_hook(lambda m, a, out, i=i: cache.__setitem__(i, out.detach().clone()))
               for i, layer in enumerate(layers)]
    hf(clean_ids)
    for handle in handles:
        handle.remove()
    T = clean_ids.shape[1]
    grid = torch.zeros(len(layers), T)
    for i, layer in enumerate(layers):
        for pos in range(T):
            def patch_hook(m, a, out, i=i, pos=pos):
                out = out.clone()
                out[:, pos] = cache[i][:, pos]
                return out
            handle = layer.register_forward_hook(patch_hook)
            logits = hf(corrupt_ids).logits[0, -1]
            handle.remove()
            grid[i, pos] = logits[answer] - logits[foil]
    return grid


def patch_nnsight(model, clean_ids, corrupt_ids, answer, foil):
    """The nnterp recipe: cache the clean run, then one trace per position, one invoke per layer."""
    layers = model.model.layers
    n = len(layers)
    with model.trace(clean_ids):
        cache = list().save()
        for layer in layers:
            cache.append(layer.output)
    T = clean_ids.shape[1]
    grid = torch.zeros(n, T)
    for pos in range(T):
        with model.trace() as tracer:
            sweep = list().save()
            for i in range(n):
                with tracer.invoke(corrupt_ids):
                    model.model.layers[i].output[:, pos] = cache[i][:, pos]
                    sweep.append(model.output.logits[0, -1])
        for i, logits in enumerate(sweep):
            grid[i, pos] = logits[answer] - logits[foil]
    return grid


def floor(model, ids: torch.Tensor, n_cells: int, chunk: int = 64):
    """n_cells copies of the corrupted input through the plain model, last-position logits only."""
    hf = model._module
    for start in range(0, n_cells, chunk):
        batch = ids.expand(min(chunk, n_cells - start), -1)
        hf(batch, logits_to_keep=1)


def floor_noised(model, ids, noise, positions, n_cells_per_seed, chunk: int = 64):
    """The causal-trace floor: each seed's noised embeddings, run n_cells_per_seed times."""
    hf = model._module
    embedded = hf.model.embed_tokens(ids)
    rows = []
    for s in range(noise.shape[0]):
        e = embedded.clone()
        e[:, positions] += noise[s]
        rows.append(e.expand(n_cells_per_seed, -1, -1))
    every = torch.cat(rows)
    for start in range(0, every.shape[0], chunk):
        hf(inputs_embeds=every[start : start + chunk], logits_to_keep=1)


# ---------------------------------------------------------------------------------------------
# Methods for sweep (b): the causal trace
# ---------------------------------------------------------------------------------------------


def trace_hooks(model, ids, noise, positions, answer):
    hf, layers = model._module, model._module.model.layers
    emb = hf.model.embed_tokens
    cache = {}
    handles = [layer.register_forward_hook(lambda m, a, out, i=i: cache.__setitem__(i, out.detach().clone()))
               for i, layer in enumerate(layers)]
    hf(ids)
    for handle in handles:
        handle.remove()
    S, L, T = noise.shape[0], len(layers), ids.shape[1]
    raw = torch.zeros(S, L, T)
    for s in range(S):
        def noise_hook(m, a, out, s=s):
            out = out.clone()
            out[:, positions] += noise[s]
            return out
        nh = emb.register_forward_hook(noise_hook)
        for i, layer in enumerate(layers):
            for pos in range(T):
                def restore(m, a, out, i=i, pos=pos):
                    out = out.clone()
                    out[:, pos] = cache[i][:, pos]
                    return out
                handle = layer.register_forward_hook(restore)
                raw[s, i, pos] = hf(ids).logits[0, -1].softmax(-1)[answer]
                handle.remove()
        nh.remove()
    return raw


def trace_nnsight(model, ids, noise, positions, answer):
    """The seed's recipe: per seed and position, one trace with one invoke per layer."""
    layers = model.model.layers
    L = len(layers)
    with model.trace(ids):
        clean = list().save()
        for layer in layers:
            clean.append(layer.output)
    S, T = noise.shape[0], ids.shape[1]
    raw = torch.zeros(S, L, T)
    for s in range(S):
        for pos in range(T):
            with model.trace() as tracer:
                probs = list().save()
                for i in range(L):
                    with tracer.invoke(ids):
                        model.model.embed_tokens.output[:, positions] += noise[s]
                        model.model.layers[i].output[:, pos] = clean[i][:, pos]
                        probs.append(model.output.logits[0, -1].softmax(-1)[answer])
            for i, p in enumerate(probs):
                raw[s, i, pos] = p
    return raw


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def check_same(name: str, reference: torch.Tensor, other: torch.Tensor, label: str) -> float:
    diff = float((reference - other).abs().max())
    if not diff <= 1e-4:
        raise SystemExit(f"{name}: {label} differs from pipatch by {diff:.3g} (> 1e-4); no times printed")
    return diff


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """The first position where two [1, T] token rows differ (T when they are equal)."""
    differ = (a[0] != b[0]).nonzero()
    return int(differ[0]) if len(differ) else a.shape[1]


def limit(model, peak: float, n_tokens: int, cells, logit_rows: int, baselines: int, seconds: float) -> dict:
    """The FLOP limit of a sweep (see bench/flops.py) and pipatch's ``seconds`` against it.

    ``cells`` are the (layer, position) block outputs patched, no-op cells left out.
    """
    flops = sweep_flops(Sizes.from_config(model._module.config), n_tokens, cells, logit_rows, baselines)
    limit_s = flops["limit"] / peak
    return {"full_gflop": flops["full"] / 1e9, "limit_gflop": flops["limit"] / 1e9, "limit_s": limit_s,
            "pipatch_x_limit": seconds / limit_s}


def vocab_of(model) -> int:
    return model._module.config.get_text_config().vocab_size


def pipatch_and_floor(run, floor_of):
    """pipatch (``run()``: :func:`run_pipatch`'s four values) and its floor (``floor_of(result)``:
    the floor as a function of no arguments), :data:`REPEAT` times in turn, so both meet the
    machine in the same moods: pipatch's result, best total, best first row and highest peak,
    then the floor's best seconds and highest peak."""
    mine, floors = [], []
    for _ in range(REPEAT):
        mine.append(run())
        floors.append(timed(floor_of(mine[-1][0]))[1:])
    _, seconds, first_row, peak = zip(*mine)
    floor_seconds, floor_peak = zip(*floors)
    return (mine[-1][0], min(seconds), min(first_row), max(peak)), (min(floor_seconds), max(floor_peak))


def run_pipatch(model, plan_fn, *args, **kwargs):
    """Plan (baselines included) and run; returns result, total seconds, first-row latency, peak."""
    marks = {}

    def on_row(result, view, layer):
        marks.setdefault("first_row", time.perf_counter())

    with Peak() as peak:
        plan = plan_fn(model, *args, **kwargs)
        marks["planned"] = time.perf_counter()
        result = plan.run(on_row=on_row)
    first = marks["first_row"] - marks["planned"]
    return result, peak.seconds, first, peak.peak


def sweep_a(model, quick: bool, peak: float):
    tok = model.tokenizer
    clean_ids = tok(CLEAN, return_tensors="pt").input_ids
    corrupt_ids = tok(CORRUPT, return_tensors="pt").input_ids
    answer, foil = tok(" Paris", add_special_tokens=False).input_ids[0], tok(" Rome", add_special_tokens=False).input_ids[0]
    L, T = len(model.model.layers), clean_ids.shape[1]
    (result, t_pipatch, first_row, m_pipatch), floor_tm = pipatch_and_floor(
        lambda: run_pipatch(model, plan_patch, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome"),
        lambda result: functools.partial(floor, model, corrupt_ids, L * T))
    mine = result.raw["resid"][0]
    rows = {}
    grid, t, m = timed(patch_nnsight, model, clean_ids, corrupt_ids, answer, foil)
    rows["nnsight"] = (t, m, check_same("sweep (a)", mine, grid, "the nnsight recipe"))
    if not quick:
        grid, t, m = timed(patch_hooks, model, clean_ids, corrupt_ids, answer, foil)
        rows["hooks"] = (t, m, check_same("sweep (a)", mine, grid, "the hook loop"))
    rows["floor"] = (*floor_tm, None)
    rows["pipatch"] = (t_pipatch, m_pipatch, 0.0)
    # Positions before the first differing token hold the same state in both runs: no-ops.
    cells = [(i, p) for i in range(L) for p in range(first_difference(clean_ids, corrupt_ids), T)]
    return {"cells": L * T, "methods": rows, "first_row_s": first_row,
            "limit": limit(model, peak, T, cells, 2, 2, t_pipatch)}


def sweep_b(model, quick: bool, peak: float, seeds: int = 10):
    tok = model.tokenizer
    ids = tok(CLEAN, return_tensors="pt").input_ids
    answer = tok(" Paris", add_special_tokens=False).input_ids[0]
    L, T = len(model.model.layers), ids.shape[1]

    def noise_of(result):
        meta = result.meta
        return noise_draws(seeds, len(meta["subject_positions"]), model._module.config.hidden_size, meta["scale"],
                           meta["sigma"])

    (result, t_pipatch, first_row, m_pipatch), floor_tm = pipatch_and_floor(
        lambda: run_pipatch(model, plan_trace, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=seeds),
        lambda result: functools.partial(floor_noised, model, ids, noise_of(result), result.meta["subject_positions"],
                                         L * T))
    meta = result.meta
    positions = meta["subject_positions"]
    noise = noise_of(result)
    mine = result.raw["resid"]
    rows = {}
    raw, t, m = timed(trace_nnsight, model, ids, noise, positions, answer)
    rows["nnsight"] = (t, m, check_same("sweep (b)", mine, raw, "the nnsight recipe"))
    if not quick:
        raw, t, m = timed(trace_hooks, model, ids, noise, positions, answer)
        rows["hooks"] = (t, m, check_same("sweep (b)", mine, raw, "the hook loop"))
    rows["floor"] = (*floor_tm, None)
    rows["pipatch"] = (t_pipatch, m_pipatch, 0.0)
    return {"cells": seeds * L * T, "scale": meta["scale"], "methods": rows, "first_row_s": first_row,
            "limit": trace_limit(model, peak, T, positions, seeds, t_pipatch)}


def trace_limit(model, peak: float, n_tokens: int, subject: list[int], seeds: int, seconds: float) -> dict:
    """A causal trace's limit: the clean run, one noised run per seed, then per seed every
    restoration at or after the subject's first token (before it, the noised run's states are
    the clean ones), each read as P(answer): the whole vocabulary at the last position."""
    L = model._module.config.get_text_config().num_hidden_layers
    cells = [(i, p) for _ in range(seeds) for i in range(L) for p in range(min(subject), n_tokens)]
    return limit(model, peak, n_tokens, cells, vocab_of(model), 1 + seeds, seconds)


def best(fn, repeat: int) -> tuple[float, object]:
    """The least of ``repeat`` timings of ``fn()`` (the least disturbed run), and its last value."""
    times, value = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - started)
    return min(times), value


def write_report(lines: list[str], report: dict, out: str) -> int:
    """Print a benchmark's lines, write its numbers as JSON to ``out``; the exit status (0)."""
    print("\n".join(lines))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


def prompt_of(model, n_tokens: int) -> tuple[str, str]:
    """A clean/corrupt pair of exactly n_tokens tokens (filler text before the fact)."""
    tok = model.tokenizer
    filler = "It was a bright cold day in April, and the clocks were striking thirteen. " * (n_tokens // 15 + 1)
    words = filler.split(" ")
    for k in range(len(words) + 1):
        prefix = " ".join(words[:k]) + (" " if k else "")
        clean, corrupt = prefix + CLEAN, prefix + CORRUPT
        if len(tok(clean).input_ids) >= n_tokens:
            break
    ids = tok(clean).input_ids
    while len(ids) > n_tokens:  # trim from the front, keeping the fact
        clean = clean[1:]
        corrupt = corrupt[1:]
        ids = tok(clean).input_ids
    assert len(tok(corrupt).input_ids) == len(ids)
    return clean, corrupt


def scaling(model, quick: bool, peak: float):
    tok = model.tokenizer
    L = len(model.model.layers)
    lengths = []
    for n in (8, 32) if quick else (8, 32, 128):
        clean, corrupt = prompt_of(model, n)
        T = len(tok(clean).input_ids)
        # The last (up to) 16 positions, so every length sweeps the same number of cells and the
        # table shows the cost of one cell growing with the prompt (a full sweep grows as T²).
        positions = list(range(max(0, T - 16), T))
        _, t_p, first, _ = run_pipatch(model, plan_patch, clean=clean, corrupt=corrupt, answer=" Paris",
                                       foil=" Rome", positions=positions)
        cells = L * len(positions)
        corrupt_ids = tok(corrupt, return_tensors="pt").input_ids
        _, t_f, _ = timed(floor, model, corrupt_ids, cells)
        d = first_difference(tok(clean, return_tensors="pt").input_ids, corrupt_ids)
        needed = [(i, p) for i in range(L) for p in positions if p >= d]
        lengths.append({"tokens": T, "cells": cells, "pipatch_s": t_p, "floor_s": t_f, "first_row_s": first,
                        "limit": limit(model, peak, T, needed, 2, 2, t_p)})
        print(f"  scaling: {T} tokens done", flush=True)
    seeds = []
    for s in (1, 3) if quick else (1, 3, 10):
        result, t_p, first, _ = run_pipatch(model, plan_trace, CLEAN, subject="Eiffel Tower", answer=" Paris",
                                            seeds=s)
        seeds.append({"seeds": s, "pipatch_s": t_p, "first_row_s": first,
                      "limit": trace_limit(model, peak, len(result.tokens), result.meta["subject_positions"], s,
                                           t_p)})
    return {"prompt_length": lengths, "seeds": seeds}


def head_memory(model):
    """A head sweep on a 128-token prompt: peak RSS against 2 × (model + one batch)."""
    clean, corrupt = prompt_of(model, 128)
    params = sum(p.numel() * p.element_size() for p in model._module.parameters())
    base = rss()
    result, seconds, _, peak = run_pipatch(model, plan_patch, clean=clean, corrupt=corrupt, answer=" Paris",
                                           foil=" Rome", site="head")
    batch = result.meta["engine"]["batch_size"]
    # One batch's working set, measured: a plain forward of `batch` copies, logits at the end only.
    ids = model.tokenizer(corrupt, return_tensors="pt").input_ids
    with Peak() as one:
        model._module(ids.expand(batch, -1), logits_to_keep=1)
    batch_bytes = max(0, one.peak - one.start)
    return {"tokens": ids.shape[1], "seconds": seconds, "batch_size": batch, "model_bytes": params,
            "one_batch_bytes": batch_bytes, "rss_before": base, "peak_rss": peak,
            "bound": 2 * (params + batch_bytes), "within_bound": peak <= 2 * (params + batch_bytes)}


def trace_memory(model):
    """The causal trace's baseline runs (clean + 10 noised seeds) on a 128-token prompt.

    Each run reads the logits at the last position only (``logits_to_keep=1``); computing them
    at every position would add seeds × tokens × vocabulary floats (1.3 GB for Gemma's 262k).
    """
    clean, _ = prompt_of(model, 128)
    base = rss()
    plan, seconds, peak = timed(plan_trace, model, clean, subject="Eiffel Tower", answer=" Paris", seeds=10,
                                scale=3.0)
    tokens = len(plan.result.tokens)
    vocab = model._module.config.get_text_config().vocab_size
    return {"tokens": tokens, "seeds": 10, "seconds": seconds, "rss_before": base, "peak_rss": peak,
            "all_position_logits_bytes": 10 * tokens * vocab * 4}


def fmt_rows(title: str, block: dict) -> list[str]:
    rows = block["methods"]
    t_mine = rows["pipatch"][0]
    out = [f"{title} — {block['cells']} cells", f"  {'method':<9} {'seconds':>8} {'pipatch/x':>10} {'peak RSS':>9} {'max |Δ|':>9}"]
    for name in ("hooks", "nnsight", "floor", "pipatch"):
        if name not in rows:
            continue
        t, m, diff = rows[name]
        out.append(f"  {name:<9} {t:8.2f} {t_mine / t:10.2f} {m / 2**30:8.2f}G {'' if diff is None else f'{diff:.1e}':>9}")
    out.append(f"  first finished row after the baselines: {block['first_row_s']:.2f} s")
    out.append("  " + fmt_limit(block["limit"]))
    return out


def fmt_limit(lim: dict) -> str:
    return (f"FLOPs: full runs {lim['full_gflop']:.1f} GFLOP, limit {lim['limit_gflop']:.1f} GFLOP = "
            f"{lim['limit_s']:.3f}s at peak; pipatch {lim['pipatch_x_limit']:.2f}× the limit")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the hook loops and the longest scaling rows")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench.json"))
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model = pipatch.load_model(device="cpu")  # this machine's CPU, also where a GPU is present
    # Warm up (first-call allocations, nnsight's source parsing) so no method pays for it.
    pipatch.patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome", positions=[-1])
    peak = matmul_peak()
    print(f"float32 matmul peak: {peak / 1e9:.1f} GFLOP/s on {torch.get_num_threads()} thread(s)", flush=True)
    report = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "matmul_gflops": peak / 1e9},
              "a": sweep_a(model, args.quick, peak)}
    print("\n".join(fmt_rows("(a) resid activation patching, Eiffel/Colosseum, logit diff", report["a"])), flush=True)
    report["b"] = sweep_b(model, args.quick, peak)
    print("\n".join(fmt_rows(f"(b) causal trace, 10 seeds at {report['b']['scale']:g}σ, P(answer)", report["b"])),
          flush=True)
    report["scaling"] = scaling(model, args.quick, peak)
    report["head_memory"] = head_memory(model)
    report["trace_memory"] = trace_memory(model)
    lines = []
    lines.append("scaling with prompt length (resid patching, the last 16 positions):")
    for row in report["scaling"]["prompt_length"]:
        lines.append(f"  {row['tokens']:4d} tokens  {row['cells']:5d} cells  pipatch {row['pipatch_s']:7.2f}s  "
                     f"floor {row['floor_s']:7.2f}s  ratio {row['pipatch_s'] / row['floor_s']:.2f}  "
                     f"first row {row['first_row_s']:.2f}s  limit {row['limit']['limit_s']:.3f}s  "
                     f"pipatch/limit {row['limit']['pipatch_x_limit']:.2f}×")
    lines.append("scaling with seeds (causal trace):")
    for row in report["scaling"]["seeds"]:
        lines.append(f"  {row['seeds']:3d} seeds  pipatch {row['pipatch_s']:7.2f}s  first row {row['first_row_s']:.2f}s  "
                     f"limit {row['limit']['limit_s']:.3f}s  pipatch/limit {row['limit']['pipatch_x_limit']:.2f}×")
    hm = report["head_memory"]
    lines.append(f"head sweep, {hm['tokens']} tokens: {hm['seconds']:.1f}s, peak RSS {hm['peak_rss'] / 2**30:.2f}G "
                 f"vs bound 2×(model {hm['model_bytes'] / 2**30:.2f}G + one batch {hm['one_batch_bytes'] / 2**30:.2f}G) "
                 f"= {hm['bound'] / 2**30:.2f}G: {'within' if hm['within_bound'] else 'OVER'}")
    tm = report["trace_memory"]
    lines.append(f"trace baselines, {tm['tokens']} tokens, {tm['seeds']} seeds: {tm['seconds']:.1f}s, peak RSS "
                 f"{tm['peak_rss'] / 2**30:.2f}G ({(tm['peak_rss'] - tm['rss_before']) / 2**30:.2f}G above the loaded "
                 f"model; all-position logits would add {tm['all_position_logits_bytes'] / 2**30:.2f}G)")
    return write_report(lines, report, args.out)


if __name__ == "__main__":
    sys.exit(main())
