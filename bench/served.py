"""The served backend under load: one ``pipatch serve`` (loopback), several clients.

On the embedded default (Gemma 3 270M, float32), a real server started here (nnsight's server
on a vLLM engine, CPU worker, 1 GiB KV cache), and clients in this process:

* start-up: the server's seconds to its ready line and its resident memory (all processes);
  a client's seconds to connect (weightless module tree);
* the resid grid (18 × 9) served vs the transformers backend in this process: time (the best
  of :data:`REPEAT` runs), max |Δ| (must be ≤ 1e-4 before any time is printed), requests and
  bytes per request; after the server stops, the same grid on an in-process vLLM engine (best
  of :data:`REPEAT` too), and served ÷ in-process;
* four clients at once, each its own sweep, vs the same four one after another; every grid
  equal to its sweep run alone;
* 200 small sweeps (last position, every layer: 20 requests each) from four clients at once:
  sweeps per second and the server's memory before and after (flat = within 0.25 GB);
* SIGTERM: seconds to stop, processes left.

Figures go to ``bench/results/served.json``. Run: ``make bench``, or
``.venv-vllm/bin/python bench/served.py``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402
from pipatch._backends.served import ServedBackend, Server  # noqa: E402
from pipatch._serving.serve import Spawned  # noqa: E402

KEY = "bench"
PAIRS = [
    {"clean": "The Eiffel Tower is in the city of", "corrupt": "The Colosseum is in the city of",
     "answer": " Paris", "foil": " Rome"},
    {"clean": "The Colosseum is in the city of", "corrupt": "The Eiffel Tower is in the city of",
     "answer": " Rome", "foil": " Paris"},
    {"clean": "The Louvre is in the city of", "corrupt": "The Vatican is in the city of",
     "answer": " Paris", "foil": " Rome"},
    {"clean": "The Vatican is in the city of", "corrupt": "The Louvre is in the city of",
     "answer": " Rome", "foil": " Paris"},
]
OUT = Path(__file__).resolve().parent / "results" / "served.json"
#: The resid grid's runs on each side, the best counting (this machine's speed drifts).
REPEAT = 3


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main() -> int:
    figures: dict = {"machine": platform.processor() or platform.machine()}
    server = Spawned(env={"PIPATCH_API_KEY": KEY})
    try:
        figures["server_start_s"] = round(server.start_s, 1)
        figures["server_rss_gb_idle"] = round(server.rss_gb(), 2)
        figures["server_processes"] = len(server.tree)
        served, seconds = timed(lambda: pipatch.load_model(serve=server.url, api_key=KEY))
        figures["client_connect_s"] = round(seconds, 1)
        local = pipatch.load_model(device="cpu")

        pipatch.patch(served, **PAIRS[0])  # warm-up
        sent: list[int] = []
        send = Server.generate

        def counted(self, blob, *args):
            sent.append(len(blob))
            return send(self, blob, *args)

        Server.generate = counted
        try:
            got, seconds = timed(lambda: pipatch.patch(served, **PAIRS[0]))
        finally:
            Server.generate = send
        seconds = min([seconds] + [timed(lambda: pipatch.patch(served, **PAIRS[0]))[1] for _ in range(REPEAT - 1)])
        want, local_s = timed(lambda: pipatch.patch(local, **PAIRS[0]))
        diff = float((got.raw["resid"] - want.raw["resid"]).nan_to_num().abs().max())
        if diff > 1e-4:
            print(f"served and transformers disagree (max |Δ| {diff:.3g} > 1e-4); no times shown", file=sys.stderr)
            return 1
        figures["resid_grid"] = {"served_s": round(seconds, 2), "transformers_s": round(local_s, 2),
                                 "requests": len(sent), "bytes_per_request": round(sum(sent) / len(sent)),
                                 "max_abs_diff": diff}

        clients = [ServedBackend(served, Server(server.url, KEY)) for _ in PAIRS]
        for client in clients:
            client.server.describe()
        small = {"site": "mlp", "positions": [-2, -1]}
        alone, one_by_one = timed(lambda: [pipatch.patch(backend_for(served), **p, **small) for p in PAIRS])
        with ThreadPoolExecutor(4) as pool:
            together, at_once = timed(lambda: list(pool.map(
                lambda i: pipatch.patch(clients[i], **PAIRS[i], **small), range(4))))
        same = all(torch.equal(a.raw["mlp"], b.raw["mlp"]) for a, b in zip(alone, together))
        figures["four_clients"] = {"one_after_another_s": round(one_by_one, 2), "at_once_s": round(at_once, 2),
                                   "grids_equal_alone": same}

        last = {**PAIRS[0], "site": "resid", "positions": [-1]}
        before = server.rss_gb()
        with ThreadPoolExecutor(4) as pool:
            statuses, seconds = timed(lambda: list(pool.map(
                lambda i: [pipatch.patch(clients[i], **last).status for _ in range(50)], range(4))))
        after = server.rss_gb()
        figures["sweeps_200"] = {"seconds": round(seconds, 1), "sweeps_per_s": round(200 / seconds, 2),
                                 "all_done": all(s == "done" for row in statuses for s in row),
                                 "server_rss_gb_before": round(before, 2), "server_rss_gb_after": round(after, 2)}
        for client in clients:
            client.server.close()
    finally:
        (code, seconds) = timed(server.stop)
        deadline = time.monotonic() + 60
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        figures["stop"] = {"exit": code, "seconds": round(seconds, 1), "processes_left": len(server.alive())}
        server.kill()

    # The same grid on the same engine in this process, once the server's memory is back.
    from pipatch._backends._load import shared_model

    engine = shared_model(device="cpu", backend="vllm")
    pipatch.patch(engine, **PAIRS[0])  # warm-up
    inproc_s = min(timed(lambda: pipatch.patch(engine, **PAIRS[0]))[1] for _ in range(REPEAT))
    figures["resid_grid"]["in_process_vllm_s"] = round(inproc_s, 2)
    figures["resid_grid"]["served_over_in_process"] = round(figures["resid_grid"]["served_s"] / inproc_s, 2)
    engine.vllm_entrypoint.llm_engine.engine_core.shutdown()

    grid, four, load = figures["resid_grid"], figures["four_clients"], figures["sweeps_200"]
    print(f"server: ready in {figures['server_start_s']} s, {figures['server_rss_gb_idle']} GB idle "
          f"({figures['server_processes']} processes); client connects in {figures['client_connect_s']} s")
    print(f"resid grid 18×9: served {grid['served_s']} s ({grid['requests']} requests, "
          f"{grid['bytes_per_request'] / 1024:.0f} KB each), in-process vLLM {grid['in_process_vllm_s']} s "
          f"(served ÷ in-process {grid['served_over_in_process']}), transformers here {grid['transformers_s']} s, "
          f"max |Δ| {grid['max_abs_diff']:.2g}")
    print(f"4 clients: {four['one_after_another_s']} s one after another, {four['at_once_s']} s at once, "
          f"grids equal alone: {four['grids_equal_alone']}")
    print(f"200 sweeps (4 clients): {load['seconds']} s ({load['sweeps_per_s']}/s), server memory "
          f"{load['server_rss_gb_before']} → {load['server_rss_gb_after']} GB, all done: {load['all_done']}")
    print(f"SIGTERM: exit {figures['stop']['exit']} in {figures['stop']['seconds']} s, "
          f"{figures['stop']['processes_left']} processes left")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(figures, indent=1))
    print(f"wrote {OUT}")
    return 0 if four["grids_equal_alone"] and load["all_done"] else 1


if __name__ == "__main__":
    sys.exit(main())
