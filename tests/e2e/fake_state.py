"""Source of a notebook cell that builds a small hand-made state (no model involved)."""

FAKE_STATE_SRC = r'''
import numpy as np
from pipatch import PatchGrid

def fake_state(n_layers=6, n_tokens=7, n_seeds=3, done=None, status="done"):
    rng = np.random.default_rng(0)
    seeds = rng.normal(size=(n_seeds, n_layers, n_tokens)).astype(np.float32)
    raw = rng.random(size=(n_seeds, n_layers, n_tokens)).astype(np.float32)
    mean = seeds.mean(0)
    mean[0, 0] = np.nan
    arrays = {}
    for i, view in enumerate(("resid", "mlp")):
        arrays[f"{view}/mean"] = mean * (1 + i)
        arrays[f"{view}/std"] = seeds.std(0)
        arrays[f"{view}/raw_mean"] = raw.mean(0)
        arrays[f"{view}/seeds"] = seeds
        arrays[f"{view}/raw_seeds"] = raw
    labels = ["<img src=x onerror=alert(1)>", " Eiffel", " Tower", "\u202eevil", "a\x00b", "x" * 10000, " of"]
    return {
        "title": "fake trace <b>bold?</b>", "kind": "trace", "model_name": "fake-model",
        "metric": "p( Paris)",
        "row_labels": [str(i) for i in range(n_layers)],
        "col_labels": (labels + [f"t{i}" for i in range(n_tokens)])[:n_tokens],
        "col_axis": "token", "views": ["resid", "mlp"], "n_seeds": n_seeds, "arrays": arrays,
        "rows_done": {"resid": n_layers if done is None else done, "mlp": n_layers if done is None else 0},
        "total_rows": 2 * n_layers, "status": status, "message": "", "warnings": ["a warning <i>x</i>"],
        "elapsed": 1.5, "eta": 3.0 if status == "running" else -1, "baselines": {"clean": 0.9, "corrupt": 0.1},
        "detail": {}, "stoppable": status == "running",
    }
'''
