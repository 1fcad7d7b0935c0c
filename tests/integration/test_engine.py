"""The engine's row stream: rows in order (from the last layer down where that is cheapest), stop between
batches, partial results kept."""

from __future__ import annotations

import collections
import math
import threading

import pytest
import torch

import pipatch
from pipatch._base.known import known
from pipatch._engine import RUN_FLOPS, SHARE_POSITIONS, SHARE_ROWS
from pipatch._experiments._api import plan_patch, plan_trace
from tests.conftest import COLOSSEUM, EIFFEL


def test_rows_arrive_from_the_last_layer_down_while_the_sweep_runs(model):
    seen = []

    def on_row(result, view, layer):
        # The row just finished is filled, and reported after the rows above it.
        seen.append((view, layer, result.status))
        assert torch.isfinite(result.raw[view][:, layer]).all()
        assert list(result.finished_rows(view)) == list(range(layer, 18))

    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", on_row=on_row)
    assert seen == [("resid", layer, "running") for layer in range(17, -1, -1)]
    assert r.status == "done" and r.rows_done == {"resid": 18} and r.row_order == {"resid": -1}
    # Every cell run (fast=False) costs the same whatever its layer: rows run from layer 0.
    seen.clear()
    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", positions=[-1],
                      on_row=lambda result, view, layer: seen.append(layer), fast=False)
    assert seen == list(range(18)) and r.row_order == {"resid": 1}


def run_rows(plan, flops=math.inf):
    """Run ``plan`` with runs of rows allowed ``flops`` each (:data:`RUN_FLOPS` by default;
    here unbounded unless given); the trace count after each row, in row order."""
    seen = []
    plan.run_flops = flops
    result = plan.run(on_row=lambda r, view, layer: seen.append((layer, r.meta["engine"]["traces"])))
    return result, seen


def test_rows_of_few_cells_share_traces_with_the_same_numbers(model):
    """A patching grid's rows hold 7 cells each: after the first row (alone, to show soonest),
    consecutive rows run in shared traces (packed: each cell from its own layer and position,
    tests/integration/test_prefix.py)."""
    fast, seen = run_rows(plan_patch(model, **PAIR))
    plain = pipatch.patch(model, **PAIR, fast=False)
    assert torch.allclose(fast.raw["resid"], plain.raw["resid"], atol=1e-4, rtol=0)
    assert [layer for layer, _ in seen] == list(range(17, -1, -1))
    traces = [n for _, n in seen]
    assert traces == [1] + [2] * 17, traces  # layer 17 (its last position only), then one trace for all
    # Rows of many cells (10 seeds × 7 positions from the subject on: 70 a row) share traces
    # too, packed, while the run holds at most batch_size (256) cells: three rows. Their
    # probability reads the whole unembedding, so one more row finishes with them, in traces
    # of its own, up to SHARE_ROWS rows (and SHARE_POSITIONS read positions): one pass for all.
    r, seen = run_rows(plan_trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=10, sites="resid"))
    seen = [n for _, n in seen]
    assert seen[0] < seen[1] and seen.count(seen[0]) == 1, seen
    together = collections.Counter(seen[1:]).values()
    assert max(together) == min(SHARE_ROWS, SHARE_POSITIONS // 70) and len(seen) == 18, seen
    assert r.meta["engine"]["batch_size"] == 256 and r.meta["engine"]["traces"] < 18, r.meta["engine"]
    # Filled without a forward, per seed: the top row's positions 2-7 (unread) and positions 0-1
    # of every row, before the subject. There the clean and noised runs' states differ by
    # rounding only (one run alone, ten batched): restoring them changes nothing.
    assert r.meta["engine"]["noop_cells"] == 10 * (6 + 2 * 18), r.meta["engine"]
    assert torch.equal(r.raw["resid"][:, :, :2], r.corrupt_seeds[:, None, None].expand(10, 18, 2).to(r.raw["resid"].dtype))


def test_a_run_of_rows_holds_at_most_run_flops(model):
    """Rows join a run only while its work (positions through blocks, times the backend's
    FLOPs per position and block) stays within ``plan.run_flops``: with none, every row runs
    alone (the grid shows each row, and a click is answered, as soon as it is done), with the
    same numbers. Counted, not timed: the same sweep runs the same traces every time."""
    joined, _ = run_rows(plan_patch(model, **PAIR))
    alone, seen = run_rows(plan_patch(model, **PAIR), flops=0)
    assert [n for _, n in seen] == list(range(1, 19)), seen  # one trace a row
    assert torch.allclose(alone.raw["resid"], joined.raw["resid"], atol=1e-4, rtol=0, equal_nan=True)
    # Gemma 3 270M: 5.57M weights a block (q, k, v, o, gate, up, down, norms), 2 FLOPs each.
    plan = plan_patch(model, **PAIR)
    assert plan.run_flops == RUN_FLOPS["cpu"] and plan.backend.position_flops == pytest.approx(11.1e6, rel=0.01)
    # The default on this CPU holds the grid's 17 rows below the last in one run (47.6 GFLOP),
    # and the same grid twice gives the same numbers to the last bit.
    again, seen = run_rows(plan, flops=RUN_FLOPS["cpu"])
    assert [n for _, n in seen] == [1] + [2] * 17 and torch.equal(again.raw["resid"], joined.raw["resid"]), seen


def test_stop_keeps_the_finished_rows(model):
    stop = threading.Event()

    def on_row(result, view, layer):
        if layer == 15:
            stop.set()

    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", on_row=on_row,
                      stop=stop, batch_size=4)
    assert r.status == "stopped" and r.rows_done["resid"] == 3 and list(r.finished_rows()) == [15, 16, 17]
    assert torch.isfinite(r.raw["resid"][:, 15:]).all()
    assert torch.isnan(r.raw["resid"][:, :14]).all()


# --------------------------------------------------------------------------------------------
# One engine for every experiment: each is a Plan whose rows stream
# --------------------------------------------------------------------------------------------

LOUVRE, VATICAN = "The Louvre is in the city of", "The Vatican is in the city of"
PAIR = dict(clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome")


def _streamed(plan):
    """Run ``plan`` recording, at each row, how many rows of each view were finished."""
    seen = []

    def on_row(result, view, layer):
        seen.append((view, layer, dict(result.rows_done)))
        assert result is plan.result and result.status == "running"

    return plan.run(on_row=on_row), seen


def test_a_dataset_streams_rows_one_layer_at_a_time_across_prompts(model):
    from pipatch._experiments._api import plan_patch

    plan = plan_patch(model, clean=[EIFFEL, LOUVRE], corrupt=[COLOSSEUM, VATICAN], answer=" Paris", foil=" Rome",
                      positions=None)
    assert torch.isnan(plan.result.raw["resid"]).all() and plan.result.n_seeds == 2
    result, seen = _streamed(plan)
    # Row r of both prompts runs before row r − 1 of either: the combined grid fills from the last layer up.
    assert [layer for _, layer, _ in seen] == [layer for layer in range(17, -1, -1) for _ in range(2)]
    assert [done["resid"] for _, _, done in seen] == [done for n in range(18) for done in (n, n + 1)]
    assert result.row_order == {"resid": -1}
    assert result.status == "done" and result.columns[-1] == "last"
    one = pipatch.patch(model, clean=LOUVRE, corrupt=VATICAN, answer=" Paris", foil=" Rome")
    assert torch.allclose(result.raw["resid"][1, :, -1], one.raw["resid"][0, :, -1], atol=1e-5)


def test_attribution_verification_and_path_sweeps_stream_rows(model):
    from pipatch._experiments._api import plan_attribute, plan_path_patch

    plan = plan_attribute(model, **PAIR, site="head", verify=4)
    assert plan.result.rows_done == {"head": 18}  # the estimate is complete before the run
    result, seen = _streamed(plan)
    assert [layer for _, layer, _ in seen] == list(range(17, -1, -1))
    marked = sum(map(sum, result.meta["verified"]["head"]))
    assert marked == 4 and result.meta["agreement"]["n"] == 4

    plan = plan_path_patch(model, **PAIR, sender="mlp")
    result, seen = _streamed(plan)
    assert [layer for _, layer, _ in seen] == list(range(17, -1, -1)) and result.raw["mlp"].shape == (1, 18, 1)
    assert [done["mlp"] for _, _, done in seen] == list(range(1, 19))


def test_a_click_reruns_the_cell_with_full_logits(model):
    from pipatch._experiments._api import plan_patch, plan_path_patch

    # Restoring the clean residual at the last position of the last layer IS the clean run.
    predict = plan_patch(model, **PAIR, positions=[-1]).predictor()
    top = predict("resid", 17, 0, 0, 5)
    assert top[0][0] == " Paris" and len(top) == 5 and top[0][1] > 0.3
    # A named-position column of a dataset patches every position of its group for that prompt.
    predict = plan_patch(model, clean=[EIFFEL, LOUVRE], corrupt=[COLOSSEUM, VATICAN], answer=" Paris",
                         foil=" Rome").predictor()
    assert predict("resid", 17, 6, 1, 3)[0][0] == " Paris"
    top = plan_path_patch(model, **PAIR, sender=("head", 12, 2)).predictor()("head", 0, 0, 0, 3)
    assert [t for t, _ in top] and all(isinstance(t, str) for t, _ in top)


def test_the_predictor_does_not_keep_the_result_alive(model):
    import gc
    import weakref

    from pipatch._experiments._api import plan_patch

    plan = plan_patch(model, **PAIR, positions=[-1])
    predict = plan.predictor()
    ref = weakref.ref(plan.result)
    del plan
    gc.collect()
    assert ref() is None and predict("resid", 17, 0, 0, 1)[0][0] == " Paris"


# --------------------------------------------------------------------------------------------
# Entry points take what a researcher naturally passes
# --------------------------------------------------------------------------------------------


def test_a_model_name_or_folder_is_loaded_and_a_bad_one_is_one_line(model, tmp_path):
    r = pipatch.patch(None, **PAIR, positions=[-1])  # None: the embedded default, the session's model
    assert r.status == "done" and r.meta["model"] == known(model).name
    with pytest.raises(pipatch.PipatchError, match="does not exist") as info:
        pipatch.patch(str(tmp_path / "no-such-model"), **PAIR)
    assert "\n" not in str(info.value)
    with pytest.raises(pipatch.PipatchError, match="model must be a loaded model"):
        pipatch.trace(42, EIFFEL, subject="Eiffel Tower", answer=" Paris")


@pytest.mark.parametrize("call, match", [
    (lambda m: pipatch.trace(m, 123, subject="Eiffel Tower", answer=" Paris"), "prompt must be text.*got int"),
    (lambda m: pipatch.patch(m, clean=EIFFEL, corrupt=None, answer=" Paris"), "corrupt prompt must be text"),
    (lambda m: pipatch.patch(m, **{**PAIR, "answer": 7}), "answer must be text"),
    (lambda m: pipatch.trace(m, [EIFFEL, 5], subject="Eiffel Tower", answer=" Paris"), "prompt must be text"),
])
def test_a_prompt_that_is_not_text_is_refused_as_such(model, call, match):
    with pytest.raises(pipatch.PipatchError, match=match):
        call(model)
