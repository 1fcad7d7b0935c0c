"""Methodology guards (#45): each says in one line what would make a result mislead, and the fix.

No model runs here: noise scales that mix (in :func:`pipatch.compare` and a study's averages,
on results built by hand), a circuit's low agreement with its exact patches, and how ``curve=N``
spends its N points (the curve's own schedule, fed a made-up recovery).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import pipatch
from pipatch._base.errors import PipatchWarning
from pipatch._base.scales import mixed_scales
from pipatch._experiments._circuit_budget import curve_points, estimate_line, grid_sizes
from pipatch._experiments.circuits import _Curve
from pipatch._results.circuit import LOW_AGREEMENT, low_agreement_advice
from pipatch._results.result import Result
from pipatch._studies._facts import Fact
from pipatch._studies._read import Study
from pipatch._studies._store import Store


def _trace(scale: float, shift: float = 0.0) -> Result:
    raw = torch.tensor([[[0.1, 0.5], [0.9, 0.25]]]) + shift
    return Result(kind="trace", tokens=["a", "b"], columns=["a", "b"], layers=["0", "1"], metric="prob",
                  raw={"resid": raw}, clean=1.0, corrupt=torch.tensor([0.0]),
                  meta={"model": "m", "site": "resid", "scale": scale, "scale_requested": "auto"})


def _pipatch_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PipatchWarning)]


# --------------------------------------------------------------------------------------------
# Noise scales that mix
# --------------------------------------------------------------------------------------------


def test_mixed_scales_name_each_results_scale_and_the_fix():
    line = mixed_scales([("fact 0", 1.0), ("fact 1", 2.0), ("fact 2", 1.0), ("a patch", None)], "the facts")
    assert line is not None and "\n" not in line
    assert "1σ: fact 0, fact 2" in line and "2σ: fact 1" in line and line.endswith("rerun with scale=2")
    assert mixed_scales([("a", 3.0), ("b", 3.0), ("c", None)], "a and b") is None


def test_compare_warns_when_its_sides_were_corrupted_at_different_scales():
    with pytest.warns(PipatchWarning) as caught:
        d = pipatch.compare(_trace(1.0), _trace(2.0, shift=0.1))
    [line] = _pipatch_warnings(caught)
    assert "1σ: a" in line and "2σ: b" in line and "scale=2" in line and "\n" not in line
    assert line in d.warnings  # kept with the comparison (its files, its views)
    # The same recoveries, subtracted: allclose's default 1e-5 relative is float32 rounding only.
    assert torch.allclose(d.grid, _trace(1.0).grid - _trace(2.0, shift=0.1).grid)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = pipatch.compare(_trace(2.0), _trace(2.0, shift=0.1))
    assert _pipatch_warnings(caught) == [] and not same.warnings


def test_a_studys_averages_warn_where_its_facts_mix_scales(tmp_path):
    """A store written before a study kept one scale: its averages say which facts ran at
    which scale; the study's own scale is the one given, or auto's recorded pick."""
    store = Store(tmp_path / "old.sqlite")
    store.check_config({"experiment": "trace", "options.scale": "auto"})
    for index, scale in enumerate((1.0, 2.0, 1.0)):
        fact = Fact(index=index, id=None, relation=None, inputs={"prompt": f"prompt {index}"})
        store.put(fact, "done", result=_trace(scale, shift=0.1 * index))
    store.close()
    study = Study(tmp_path / "old.sqlite")
    with pytest.warns(PipatchWarning) as caught:
        table = study.aggregate()
    [line] = set(_pipatch_warnings(caught))
    assert "1σ: fact 0, fact 2" in line and "2σ: fact 1" in line and "scale=2 into a new store" in line
    assert len(table) and study.noise_scale is None  # auto, and nothing recorded
    store = Store(tmp_path / "old.sqlite")
    store.set_info("noise_scale", 2.0)
    store.close()
    assert study.noise_scale == 2.0


# --------------------------------------------------------------------------------------------
# Circuits: low agreement, curve=N, the estimate
# --------------------------------------------------------------------------------------------


def _checked(pairs):
    return [{"sender": f"s{i}", "receiver": f"r{i}", "estimate": e, "exact": x} for i, (e, x) in enumerate(pairs)]


def test_a_circuit_that_agrees_poorly_with_its_exact_patches_says_what_to_try():
    meta = {"method": "eap", "steps": 1, "agreement": {"spearman": 0.67, "n": 20},
            "checked": _checked([(-2.99, 9.52), (1.0, 2.0)])}
    line = low_agreement_advice(meta)
    assert line is not None and "\n" not in line
    assert "0.67" in line and "1 with the wrong sign" in line and "method='eap-ig'" in line and "verify=40" in line
    ig = low_agreement_advice({**meta, "method": "eap-ig", "steps": 5})
    assert "steps=10" in ig and "eap-ig'" not in ig
    assert low_agreement_advice({**meta, "agreement": {"spearman": LOW_AGREEMENT + 0.05, "n": 20}}) is None
    assert low_agreement_advice({"method": "eap"}) is None  # nothing checked


def _curve_sizes(total: int, points: int, reach: int) -> tuple[list[int], int | None]:
    """The sizes ``curve=points`` measures on a graph of ``total`` edges whose recovery reaches
    the share (0.8) from ``reach`` edges on: the curve's own schedule, each row fed as it asks."""
    curve = _Curve([], None, torch.ones(total, 1, dtype=torch.bool), points, 0.8, 1.0, 0.0)
    curve.rank(torch.arange(total, dtype=torch.float32).reshape(total, 1))
    for row in curve.rows():
        for size in curve.sizes[row]:
            assert size not in curve.curve, "a size measured twice"
            curve.curve[size] = 0.9 if size >= reach else 0.5 * size / reach
    return sorted(curve.curve), curve.size


@pytest.mark.parametrize("total, points, reach", [(500, 16, 40), (500, 6, 300), (500, 8, 2), (1000, 3, 7),
                                                  (30, 12, 30), (200, 2, 1)])
def test_curve_n_measures_n_points(total, points, reach):
    sizes, size = _curve_sizes(total, points, reach)
    assert len(sizes) == points and sizes[0] == 0 and sizes[-1] == total
    assert size is not None and size >= reach  # the smallest measured circuit reaching the share
    assert not any(reach <= n < size for n in sizes)


def test_a_graph_with_fewer_sizes_than_points_measures_every_size():
    sizes, size = _curve_sizes(5, 10, 3)
    assert sizes == [0, 1, 2, 3, 4, 5] and size == 3
    assert grid_sizes(5, 10) == [0, 1, 2, 3, 4, 5]
    assert curve_points(16) == (11, 5) and curve_points(6) == (4, 2)


def test_the_estimate_is_one_line_that_names_what_cuts_it():
    line = estimate_line(0.5, 8, "cpu", "eap-ig", 3, 10, 6)
    # 8 pairs × (3 steps × 3 + 10 checks × 2 + 6 points × 3) forwards × 0.5 s
    assert line.startswith("circuit: about 3 min on this cpu (8 pairs, eap-ig with 3 steps, 10 exact checks, a "
                           "6-point curve)") and "\n" not in line
    assert "steps=" in line and "verify=" in line and "curve=" in line
    assert "step" not in estimate_line(0.1, 1, "cuda", "eap", None, 20, 16).split("(")[1].split(")")[0]


def test_a_duration_reads_as_a_person_says_it():
    from pipatch._engine import duration

    assert [duration(s) for s in (0.4, 40, 180, 9000)] == ["under 1 s", "about 40 s", "about 3 min", "about 2.5 h"]
    assert estimate_line(0.001, 1, "CPU", "eap", None, 1, 1).startswith("circuit: under 1 s on this CPU (")
