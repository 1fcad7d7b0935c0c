"""Comparing two grids (``pipatch.compare``): a − b of real results of the embedded model.

Every side is a real run (real model, real nnsight): two prompts of the same token length,
float32 vs bfloat16, two seed sets, results read back from JSON; then the comparison's files,
views, magic and command.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from IPython.core.error import UsageError

import pipatch
from pipatch import cli
from pipatch._results.compare import Comparison
from pipatch._results.result import MIME_TYPE
from pipatch._results.views import decode_array, png
from tests.conftest import COLOSSEUM, EIFFEL

#: The other prompt pair of the same token length: the Eiffel one, turned around.
REVERSED = dict(clean=COLOSSEUM, corrupt=EIFFEL, answer=" Rome", foil=" Paris")


@pytest.fixture(scope="module")
def colosseum_patch(model):
    return pipatch.patch(model, **REVERSED)


@pytest.fixture(scope="module")
def two_positions(model):
    """The Eiffel patch at two positions only (bfloat16 matmuls are slow on a CPU)."""
    return pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", positions=[5, 8])


@pytest.fixture(scope="module")
def prompts(eiffel_patch, colosseum_patch):
    return pipatch.compare(eiffel_patch, colosseum_patch)


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal element by element, NaN where the other is NaN."""
    return bool(torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(x.nan_to_num(), y.nan_to_num()))


def test_a_result_compared_with_itself_is_zero(eiffel_patch, prompts):
    for values in ("recovery", "raw"):
        same = pipatch.compare(eiffel_patch, eiffel_patch, values=values)
        finite = torch.isfinite(same.grid)
        assert finite.sum() > 0 and torch.equal(torch.isnan(same.grid), torch.isnan(eiffel_patch.grid))
        assert torch.count_nonzero(same.grid[finite]) == 0, values
    # The same check on two different results does see a difference.
    assert prompts.grid.nan_to_num().abs().max() > 0.1


def test_two_prompts_of_the_same_length_give_the_difference_of_their_grids(eiffel_patch, colosseum_patch, prompts):
    a, b, c = eiffel_patch, colosseum_patch, prompts
    assert isinstance(c, pipatch.Result) and isinstance(c, Comparison) and c.kind == "compare"
    assert c.grid.shape == a.grid.shape == (18, 9)
    assert _same(c.grid, a.grid - b.grid)
    for row, col in [(0, 2), (10, 8), (17, 0)]:
        assert float(c.grid[row, col]) == pytest.approx(float(a.grid[row, col]) - float(b.grid[row, col]), abs=1e-7)
    raw = pipatch.compare(a, b, values="raw")
    assert _same(raw.grid, a.raw_mean() - b.raw_mean())
    assert c.a is a and c.b is b and all(_same(x, y) for x, y in zip(c.side_values(), (a.grid, b.grid)))
    # Labelled with both sides: tokens where they differ, prompts and what differs in the settings.
    assert c.columns[2] == f"{a.columns[2]} / {b.columns[2]}" and c.columns[-1] == " of"
    assert c.meta["sides"][0].startswith("a: ") and repr(EIFFEL) in c.meta["sides"][0]
    assert "answer ' Rome'" in c.meta["sides"][1]
    assert c.meta["a"]["clean_prompt"] == EIFFEL and c.meta["b"]["clean_prompt"] == COLOSSEUM
    assert c.n_seeds == 1 and c.status == "done"


def test_float32_against_bfloat16_of_the_embedded_model(two_positions):
    bf16 = pipatch.load_model(dtype="bfloat16", device="cpu")
    sides = [two_positions, pipatch.patch(bf16, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome",
                                          positions=[5, 8])]
    c = pipatch.compare(*sides)
    assert c.grid.shape == (18, 2) and torch.isfinite(c.grid).all()
    assert _same(c.grid, sides[0].grid - sides[1].grid)
    assert c.grid.abs().max() > 0  # bfloat16 does move the numbers ...
    assert c.grid.abs().max() < 0.5  # ... but not the picture
    assert (c.meta["a"]["dtype"], c.meta["b"]["dtype"]) == ("float32", "bfloat16")
    assert "float32" in c.meta["sides"][0] and "bfloat16" in c.meta["sides"][1]
    assert "float32 vs" in c.meta["model"] and "bfloat16" in c.meta["model"]
    assert "bfloat16" in c.text()


def test_two_seed_sets_compare_their_means(model):
    one, two = (pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=n, scale=3.0)
                for n in (1, 2))
    c = pipatch.compare(one, two)
    assert (c.a.n_seeds, c.b.n_seeds, c.n_seeds) == (1, 2, 1)
    assert _same(c.grid, one.grid - two.grid)
    # Seed 0 is the same draw on both sides, so the mean difference is half of seed 0 − seed 1.
    # Derived: seed 0's recovery on the two sides differs by its metric and baselines, each
    # rerun within the metric's 1e-5: the ratio's bound (tests/_tolerance.py), cell by cell.
    from tests._tolerance import assert_recovery_close, recovery_tolerance

    assert_recovery_close(c.grid, (two.per_seed[0] - two.per_seed[1]) / 2, recovery_tolerance(one, 1e-5))
    assert "seeds 1" in c.meta["sides"][0] and "seeds 2" in c.meta["sides"][1]


def test_grids_that_do_not_line_up_are_refused_naming_the_axis(model, eiffel_patch, two_positions):
    p, fewer_columns = eiffel_patch, two_positions
    heads = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", site="head")
    shallower = dataclasses.replace(p, layers=p.layers[:6], raw={"resid": p.raw["resid"][:, :6]})
    more_views = dataclasses.replace(p, raw={**p.raw, "extra": p.raw["resid"]})
    other_site = dataclasses.replace(p, meta={**p.meta, "site": "mlp"})
    other_metric = dataclasses.replace(p, metric="prob")
    cases = [
        ((p, shallower), {}, "layers differ: a has 18 layers, b has 6"),
        ((p, heads), {}, "column axes differ: a's columns are tokens, b's are heads"),
        ((p, fewer_columns), {}, "columns differ: a has 9 token columns, b has 2; use two prompts of the same token length"),
        ((p, other_site), {}, "sites differ: a patches 'resid', b patches 'mlp'"),
        ((p, more_views), {}, "views differ: a holds resid, b holds resid, extra; .* pass view='resid'"),
        ((p, other_metric), {"values": "raw"}, "metrics differ: a measures logit_diff, b prob"),
        ((p, p), {"values": "logits"}, "unknown values 'logits'"),
        ((p, 3), {}, "b is of type int"),
    ]
    for sides, options, message in cases:
        with pytest.raises(pipatch.PipatchError, match=message) as error:
            pipatch.compare(*sides, **options)
        assert "\n" not in str(error.value)
    # The fixes the messages name work.
    assert pipatch.compare(p, more_views, view="resid").views == ["resid"]
    assert pipatch.compare(p, other_metric).grid.shape == (18, 9)  # normalized: metrics may differ


def test_a_comparison_of_partial_results_is_finished_where_both_sides_are(eiffel_patch, colosseum_patch):
    def stopped(result, done, order):
        return dataclasses.replace(result, rows_done={"resid": done}, row_order={"resid": order}, status="stopped")

    up = stopped(colosseum_patch, 5, -1)  # layers 13..17 finished (rows run from the last layer)
    c = pipatch.compare(eiffel_patch, up)
    assert list(c.finished_rows()) == list(range(13, 18)) and c.status == "stopped"
    assert list(pipatch.compare(stopped(eiffel_patch, 8, -1), up).finished_rows()) == list(range(13, 18))
    assert list(pipatch.compare(stopped(eiffel_patch, 7, 1), eiffel_patch).finished_rows()) == list(range(7))
    assert list(pipatch.compare(stopped(eiffel_patch, 7, 1), up).finished_rows()) == []  # no row finished on both
    # Rows 13 and 14 are finished on both sides, but a grid's finished rows are a band from one end.
    assert list(pipatch.compare(stopped(eiffel_patch, 15, 1), up).finished_rows()) == []


def test_a_comparison_saves_and_loads_whole(tmp_path, prompts, eiffel_patch, colosseum_patch):
    for path in (prompts.save(tmp_path / "c.safetensors"), tmp_path / "c.json"):
        if path.suffix == ".json":
            path.write_text(json.dumps(prompts.to_json()), encoding="utf-8")
        back = pipatch.load_result(path)
        assert isinstance(back, Comparison) and back.values == "recovery"
        assert _same(back.grid, prompts.grid) and back.meta["sides"] == prompts.meta["sides"]
        assert _same(back.a.raw["resid"], eiffel_patch.raw["resid"]) and back.b.clean == colosseum_patch.clean
        assert back.to_json() == prompts.to_json()
    assert (tmp_path / "c.safetensors").read_bytes()[8:9] == b"{"  # a safetensors header, no pickle
    # One result's JSON (the CLI's --json) reads back whole too: every seed's raw values.
    (tmp_path / "p.json").write_text(json.dumps(eiffel_patch.to_json()), encoding="utf-8")
    back = pipatch.load_result(tmp_path / "p.json")
    assert _same(back.raw["resid"], eiffel_patch.raw["resid"]) and back.meta == json.loads(json.dumps(eiffel_patch.meta))
    # A comparison of comparisons nests its sides, and reads back whole too.
    nested = pipatch.compare(prompts, pipatch.compare(colosseum_patch, eiffel_patch))
    back = pipatch.load_result(nested.save(tmp_path / "nested.safetensors"))
    assert _same(back.grid, 2 * prompts.grid) and isinstance(back.a, Comparison) and back.to_json() == nested.to_json()
    # A result compared with itself saves too (the same tensors on both sides).
    assert pipatch.load_result(pipatch.compare(eiffel_patch, eiffel_patch).save(tmp_path / "same.safetensors")).a.kind == "patch"
    # Raw differences survive the round trip as well.
    raw = pipatch.compare(eiffel_patch, colosseum_patch, values="raw")
    assert _same(pipatch.load_result(raw.save(tmp_path / "raw.safetensors")).grid, raw.grid)
    # A JSON file of only means (an older pipatch) is refused in one line.
    summary = eiffel_patch.to_json()
    del summary["views"]["resid"]["raw_seeds"]
    (tmp_path / "old.json").write_text(json.dumps(summary), encoding="utf-8")
    with pytest.raises(pipatch.PipatchError, match="holds only means"):
        pipatch.load_result(tmp_path / "old.json")


def test_a_comparison_renders_like_any_result(prompts):
    c = prompts
    text = c.text()
    assert "a − b" in text and "a: gemma" in text and "b: gemma" in text
    assert "+" in text and "-" in text  # signed cells
    bundle = c._repr_mimebundle_()
    assert set(bundle) == {MIME_TYPE, "image/png", "text/plain"}
    doc = bundle[MIME_TYPE]
    assert doc["kind"] == "compare" and doc["compared"] == "recovery" and doc["sides"] == c.meta["sides"]
    assert doc["baselines"] == pytest.approx({"a clean": c.a.clean_value, "a corrupt": c.a.corrupt,
                                              "b clean": c.b.clean_value, "b corrupt": c.b.corrupt})
    arrays = {name: decode_array(spec) for name, spec in doc["arrays"].items()}
    assert sorted(arrays) == ["resid/a", "resid/b", "resid/mean"]
    np.testing.assert_array_equal(arrays["resid/mean"], c.grid.numpy())
    np.testing.assert_array_equal(arrays["resid/a"], c.a.grid.numpy())
    np.testing.assert_array_equal(arrays["resid/b"], c.b.grid.numpy())
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    state = c.to_state()
    assert len({png(state, mode=mode) for mode in ("diff", "a", "b")}) == 3  # the toggle, in PNG
    fig = c.plot()
    assert fig.axes[1].get_ylabel() == "a − b"
    assert "a − b of normalized recovery" in fig.axes[0].get_title()


def test_the_widget_shows_a_comparison_and_says_why_clicks_have_no_top5(prompts):
    from pipatch._notebook.live import PatchGrid, answer_selection

    grid = PatchGrid(prompts)
    assert grid.sides == prompts.meta["sides"] and grid.compared == "recovery"
    assert set(grid.arrays) == {"resid/mean", "resid/a", "resid/b"}
    detail = answer_selection(None, prompts, {"view": "resid", "seed": -1, "row": 0, "col": 2})
    assert detail["value"] == pytest.approx(float(prompts.grid[0, 2])) and "PatchGrid(result.a)" in detail["error"]
    grid.close()


def test_the_magic_shows_and_binds_the_comparison(ip, eiffel_patch, colosseum_patch):
    ip.user_ns.update(eiffel=eiffel_patch, colosseum=colosseum_patch, number=3)
    ip.user_ns.pop("moved", None)
    ip.run_cell_magic("compare", "-o moved", "eiffel colosseum\n")
    moved = ip.user_ns["moved"]
    assert isinstance(moved, Comparison) and _same(moved.grid, eiffel_patch.grid - colosseum_patch.grid)
    ip.run_line_magic("compare", "--values raw eiffel colosseum")
    assert _same(ip.user_ns["_compare"].grid, eiffel_patch.raw_mean() - colosseum_patch.raw_mean())
    ip.run_cell_magic("compare", "-o again eiffel", "colosseum")
    assert _same(ip.user_ns["again"].grid, moved.grid)
    shallower = dataclasses.replace(eiffel_patch, layers=eiffel_patch.layers[:6], raw={"resid": eiffel_patch.raw["resid"][:, :6]})
    ip.user_ns["shallower"] = shallower
    for line, message in [("eiffel nothing", "no variable 'nothing'"), ("eiffel number", "number is of type int"),
                          ("-o x eiffel shallower", "layers differ"), ("eiffel", "name two results")]:
        with pytest.raises(UsageError, match=message):
            ip.run_line_magic("compare", line)
    assert "x" not in ip.user_ns


def test_the_command_compares_two_json_files(tmp_path, eiffel_patch, colosseum_patch, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, result in ((a, eiffel_patch), (b, colosseum_patch)):
        path.write_text(json.dumps(result.to_json()), encoding="utf-8")
    out, image = tmp_path / "moved.json", tmp_path / "moved.png"
    assert cli.main(["compare", str(a), str(b), "--json", str(out), "--png", str(image)]) == 0
    printed = capsys.readouterr().out
    assert "a − b" in printed and f"wrote {out}" in printed and f"wrote {image}" in printed
    back = pipatch.load_result(out)
    assert isinstance(back, Comparison) and _same(back.grid, eiffel_patch.grid - colosseum_patch.grid)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # As a process too, with one line for bad input and status 2.
    done = subprocess.run([sys.executable, "-m", "pipatch.cli", "compare", str(a), str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no result file" in done.stderr
